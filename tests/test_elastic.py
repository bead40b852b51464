"""Elastic resume: a checkpoint continues on another number of processes or another micro-batch with the same steps,
as long as micro-batch × N × processes is the checkpoint's effective batch."""

import json
import signal
import subprocess
import time

import psutil
import pytest

from finetune.reproduce.compare import compare_runs
from tests.helpers import ACCELERATE, ENV, ROOT, RUN, TINY, checkpoint_copy, cli

CONFIG = str(ROOT / "accelerate_configs" / "multi_cpu_2.yaml")
# dropout off: per-process random draws are the one thing another layout cannot replay. 64 samples, effective
# batch 8: 8 windows an epoch, 16 steps.
COMMON = ["--recipe", TINY, "--set", "data.limit=64", "--set", "model.dropout=0", "--effective-batch-size", "8",
          "--save-every", "1", "--keep-last", "100", "--set", "output.tracker=none"]


def launch2(*args, **kw):
    cmd = [ACCELERATE, "launch", "--config_file", CONFIG, "--main_process_port", "29533", RUN, *COMMON, *args]
    return subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    proc = cli(*COMMON, "--batch-size", "4", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _resume_copy(run, tmp_path, step):
    """A copy of ``run`` whose newest checkpoint is the one after ``step`` optimizer steps."""
    out = checkpoint_copy(run, tmp_path / "resumed", step)
    (out / "metrics.json").unlink()
    return out


def _assert_equivalent(resumed, reference):
    result = compare_runs(resumed, reference)
    assert result.equivalent, result.report()
    hashes = lambda run: [json.loads(x)["window_hash"] for x in (run / "history.jsonl").read_text().splitlines()]
    assert hashes(resumed) == hashes(reference)


def test_another_micro_batch_on_the_same_process(one_process, tmp_path):
    out = _resume_copy(one_process, tmp_path, step=5)  # mid-epoch 0
    proc = cli(*COMMON, "--batch-size", "2", "--output-dir", str(out), "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resume: saved on" not in proc.stderr  # same layout: nothing to say
    _assert_equivalent(out, one_process)


def test_one_process_to_two(one_process, tmp_path):
    """Through ``finetune run --processes 2``, which checks the resume before it starts the two processes."""
    out = _resume_copy(one_process, tmp_path, step=11)  # mid-epoch 1
    proc = cli("--processes", "2", *COMMON, "--batch-size", "2", "--output-dir", str(out), "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = [x for x in proc.stderr.splitlines() if x.startswith("resume: saved on 1 process, continuing on 2")]
    assert len(notes) == 1 and "dropout" in notes[0]  # said once (main process), with what is not replayed
    _assert_equivalent(out, one_process)


def test_two_processes_killed_then_resumed_on_one(one_process, tmp_path):
    """Killed on 2 processes (2 × 2 × 2), resumed on one (4 × 2 × 1): the steps of the uninterrupted run, which is
    here the one-process run (the same steps as two processes take: test_distributed.py)."""
    out = tmp_path / "run"
    proc = launch2("--batch-size", "2", "--output-dir", str(out), start_new_session=True)
    history, deadline = out / "history.jsonl", time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if history.exists() and len(history.read_text().splitlines()) >= 6:
            break
        time.sleep(0.01)
    # SIGKILL the launcher and its workers (torchrun's workers outlive a killed launcher)
    workers = psutil.Process(proc.pid).children(recursive=True)
    for p in [psutil.Process(proc.pid), *workers]:
        p.send_signal(signal.SIGKILL)
    proc.communicate()
    psutil.wait_procs(workers, timeout=30)
    assert len(history.read_text().splitlines()) < 16, "the run finished before it was killed"
    resumed = cli(*COMMON, "--batch-size", "4", "--output-dir", str(out), "--resume", "latest")  # 4 × 2 × 1
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume: saved on 2 processes, continuing on 1" in resumed.stderr
    _assert_equivalent(out, one_process)


def test_another_effective_batch_is_refused(one_process, tmp_path):
    out = _resume_copy(one_process, tmp_path, step=5)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = cli(*COMMON, "--effective-batch-size", "16", "--batch-size", "4", "--output-dir", str(out),
               "--resume", "latest")
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: resume: the checkpoint's effective batch is 8, this run's 4 × 4 × 1 = 16")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
