"""Two CPU processes (gloo DDP through `accelerate launch`) take the same optimizer steps as one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune import distributed
from tests import dist_worker
from tests.helpers import assert_same_history

ROOT = Path(__file__).resolve().parent.parent
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_UPDATE_DOWNLOAD_COUNTS": "0", "PYTHONPATH": str(ROOT),
       "TOKENIZERS_PARALLELISM": "false"}
CONFIG = str(ROOT / "accelerate_configs" / "multi_cpu_2.yaml")
GRPO_LOSS_ABS = 1e-7


def launch(*args, config=CONFIG, timeout=600, port=None):
    cmd = [ACCELERATE, "launch", "--config_file", config]
    if port:
        cmd += ["--main_process_port", str(port)]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "w2.json"
    proc = launch(str(ROOT / "tests" / "dist_worker.py"), str(out), "2", port=29521)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", [*dist_worker.CASES, *dist_worker.CUSTOM])
def test_two_processes_match_one(two_process_results, case):
    two = two_process_results[case]
    one = dist_worker.run(case, processes=1)
    assert two["processes"] == 2 and one["processes"] == 1
    assert two["shutdown_at_exit"]  # the gloo group is destroyed before the interpreter finalizes (else SIGABRT)
    assert two["effective"] == one["effective"] == dist_worker.CASES.get(case, {}).get("effective", 12)
    w2, w1 = torch.tensor(two["weights"]), torch.tensor(one["weights"])
    assert float((w2 - w1).abs().max() / w1.abs().max()) <= 1e-5
    assert two["lr"] == one["lr"]
    # history.jsonl is the same for any number of processes (timings aside)
    # GRPO's loss sums to about 0 (centred advantages): its steps' losses agree to 1e-7 absolute (test_grpo's
    # negative control differs by more)
    assert_same_history(two["history"], one["history"], loss_abs=GRPO_LOSS_ABS if case.startswith("grpo") else 0.0)
    if case.startswith("grpo"):  # the same rollouts, each process having sampled only its share of the prompts
        assert two["rollouts"] == one["rollouts"]
        prompts = sum(len(r["prompts"]) for r in one["rollouts"])
        assert len(one["generated"]) == prompts and 0 < len(two["generated"]) < prompts
    # validation: every sample once, same loss
    assert [v["loss"] for v in two["val"]] == pytest.approx([v["loss"] for v in one["val"]], rel=1e-5)
    # the run ends with a barrier, after its last reduce / gather (loop.finish)
    assert two["collectives"][-1] == "barrier"
    assert {"all_reduce", "all_gather_object"} <= set(two["collectives"])  # the recorder saw the others too


def test_shutdown_destroys_the_process_group(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert torch.distributed.is_initialized()
    distributed.shutdown()
    assert not torch.distributed.is_initialized()
    distributed.shutdown()  # a second call (explicit, then at exit) is harmless


def test_recipe_under_two_process_config_logs_once(tmp_path):
    out = tmp_path / "run"
    proc = launch(str(ROOT / "finetune" / "run.py"), "--recipe", "minilm-sentiment", "--max-steps", "2",
                  "--batch-size", "4", "--set", "data.limit=40", "--output-dir", str(out), port=29522)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("FINE-TUNING") == 1
    assert "Processes: 2" in proc.stdout and "Effective batch size: 32 (4 × 4 × 2 processes)" in proc.stdout
    assert proc.stdout.count("done:") == 1
    assert proc.stderr.count("LOAD REPORT") <= 1
    history = (out / "history.jsonl").read_text().splitlines()
    assert len(history) == 2  # one writer
    assert json.loads(history[0])["samples"] == 32


def test_two_machines_on_loopback(tmp_path):
    """num_machines = 2 (machine_rank 0 and 1, main process at 127.0.0.1), one process each, gloo."""
    out = tmp_path / "w2.json"
    config = str(ROOT / "accelerate_configs" / "multi_node_cpu.yaml")
    script = [str(ROOT / "tests" / "dist_worker.py"), str(out), "2", "mlp_uneven"]
    cmd = lambda rank: [ACCELERATE, "launch", "--config_file", config, "--machine_rank", str(rank),  # noqa: E731
                        "--main_process_port", "29533", *script]
    machines = [subprocess.Popen(cmd(r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                                 cwd=ROOT) for r in (0, 1)]
    results = [m.communicate(timeout=600) for m in machines]
    assert all(m.returncode == 0 for m in machines), results[0][1][-3000:] + results[1][1][-3000:]
    two = json.loads(out.read_text())["mlp_uneven"]
    one = dist_worker.run("mlp_uneven", processes=1)
    assert two["processes"] == 2
    w2, w1 = torch.tensor(two["weights"]), torch.tensor(one["weights"])
    assert float((w2 - w1).abs().max() / w1.abs().max()) <= 1e-5
