"""Two GPUs through ``accelerate launch``: DDP over NCCL takes the steps of one GPU (≤ 1e-5, fp32), and the shipped
FSDP and DeepSpeed ZeRO-2 configs train a recipe with the steps of one GPU.

The DDP cases are ``tests/dist_worker.py``'s (the CPU suite runs them over gloo): tails that split unevenly over the
two ranks, an idle rank, padded token losses, windows cut by a token budget.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests import dist_worker, helpers
from tests.gpu.common import GPU, rel_diff
from tests.helpers import ACCELERATE, ROOT, RUN, assert_same_history

CONFIGS = ROOT / "accelerate_configs"
ENV = {**helpers.ENV, "NVIDIA_TF32_OVERRIDE": "0"}  # no TF32 in any library of the launched processes
# dist_worker's custom recipes are left out: their convolutions run cuDNN algorithms picked per shape (and TF32 by
# default), which ≤ 1e-5 between two batch shapes does not survive
DDP_CASES = list(dist_worker.CASES)
# minilm-sentiment for three optimizer steps of 32 samples, micro-batches of 4, dropout off, no warm-up (so that
# every step moves the weights)
RECIPE = ["--recipe", "minilm-sentiment", "--max-steps", "3", "--batch-size", "4", "--set", "data.limit=96",
          "--set", "model.dropout=0", "--set", "training.warmup_steps=0", "--set", "output.plots=false"]

pytestmark = [*GPU, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                       reason=f"needs 2 GPUs (this machine has {torch.cuda.device_count()})")]


def launch(config: str, *args, port: int, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([ACCELERATE, "launch", "--config_file", str(CONFIGS / config), "--main_process_port",
                           str(port), *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)


def failure(proc: subprocess.CompletedProcess) -> str:
    """The launched run's last error line first (what the summary shows), then the end of its stderr."""
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    errors = [x for x in lines if "Error" in x or "error:" in x]
    return f"exit code {proc.returncode}: {(errors or lines or ['no stderr'])[-1].strip()}\n{proc.stderr[-4000:]}"


def history(run_dir: Path) -> list:
    path = run_dir / "history.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "w2.json"
    proc = launch("multi_gpu.yaml", str(ROOT / "tests" / "dist_worker.py"), str(out), "2", ",".join(DDP_CASES),
                  port=29541)
    assert proc.returncode == 0, failure(proc)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", DDP_CASES)
def test_ddp_matches_one_gpu(ddp_results, case, figures, ieee_fp32):
    """``accelerate launch`` with accelerate_configs/multi_gpu.yaml (``--multi_gpu --num_processes 2``) against the
    same case on one GPU in this process: weights ≤ 1e-5 (fp32), the same windows, losses and grad norms ≤ 1e-5."""
    two = ddp_results[case]
    one = dist_worker.run(case, processes=1)
    weights = rel_diff(torch.tensor(two["weights"]), torch.tensor(one["weights"]))
    figures("weights", weights, "≤ 1e-05")
    assert two["processes"] == 2 and one["processes"] == 1
    assert two["effective"] == one["effective"]
    assert weights <= 1e-5, weights
    assert_same_history(two["history"], one["history"])


@pytest.fixture(scope="module")
def one_gpu_recipe(tmp_path_factory):
    """The recipe on one GPU (accelerate_configs/single_gpu.yaml): the steps the sharded runs must take."""
    out = tmp_path_factory.mktemp("one") / "run"
    proc = launch("single_gpu.yaml", RUN, *RECIPE, "--output-dir", str(out), port=29542)
    assert proc.returncode == 0, failure(proc)
    return history(out)


@pytest.mark.parametrize("config", ["fsdp.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml"],
                         ids=["fsdp2", "deepspeed_zero2", "deepspeed_zero3"])
def test_sharded_config_trains_a_recipe(config, one_gpu_recipe, tmp_path, figures):
    """The shipped FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3 configs on 2 GPUs run three optimizer steps of
    minilm-sentiment: each step holds the effective batch (32 samples) and the one-GPU run's window; the first
    step's grad norm (same weights, before any update) equals the one-GPU run's within 1e-5, and every step's loss
    and grad norm within 1e-4. Only the order of the sums differs; on the CPU, two gloo processes matched one within
    1e-7 on these three steps. 1e-4 leaves room for AdamW, which divides each gradient element by its own running
    magnitude and so turns rounding in near-zero elements into visible updates."""
    if config.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs DeepSpeed: pip install deepspeed")
    out = tmp_path / "run"
    port = {"fsdp.yaml": 29543, "deepspeed_zero2.yaml": 29544}.get(config, 29545)
    proc = launch(config, RUN, *RECIPE, "--output-dir", str(out), port=port)
    steps, ref = history(out), one_gpu_recipe
    figures("steps", f"{len(steps)} of 3; exit code {proc.returncode}")
    if steps and len(steps) == len(ref):
        figures("loss vs 1 GPU", max(abs(a["loss"] / b["loss"] - 1) for a, b in zip(steps, ref)), "≤ 1e-04")
        figures("grad norm vs 1 GPU", max(abs(a["grad_norm"] / b["grad_norm"] - 1) for a, b in zip(steps, ref)),
                "≤ 1e-04")

    assert len(steps) == 3, f"{len(steps)} of 3 steps; " + failure(proc)
    assert proc.returncode == 0, "3 steps trained, then " + failure(proc)
    assert "Processes: 2" in proc.stdout
    assert [h["samples"] for h in steps] == [32, 32, 32]
    assert [h["window_hash"] for h in steps] == [h["window_hash"] for h in ref]
    assert steps[0]["grad_norm"] == pytest.approx(ref[0]["grad_norm"], rel=1e-5)
    for key in ("loss", "grad_norm"):
        assert [h[key] for h in steps] == pytest.approx([h[key] for h in ref], rel=1e-4), key
