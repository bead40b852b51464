"""What goes wrong around a run: a second writer on its directory, a refusal on one of several processes, a full
disk, resuming a run that is complete or whose latest checkpoint is gone, bad arguments to the Python API."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from finetune import checkpoint, distributed, durable, runlock, test_fine_tuning
from finetune.cli import run_main
from finetune.errors import ConfigError
from tests.helpers import ENV, MLP, ROOT, TINY, regression_data

DATA = Path(__file__).resolve().parent / "assets" / "tiny-sentiment.csv"  # 40 rows: 36 train = 5 windows of 8
# the recipe's val_fraction given as is: 4 rows held out, not the 10 its minimum would hold out of a user's 40
SMALL = ["--recipe", TINY, "--set", f"data.source={DATA}", "--set", "data.val_fraction=0.1", "--set",
         "output.tracker=none"]


def _files(root):
    return {p: p.read_bytes() for p in Path(root).rglob("*") if p.is_file()}


def _errors(text):
    return [x for x in text.splitlines() if x.startswith("error: ")]


def _pids_running(text):
    """Processes whose command line holds ``text`` (a test's own run directory)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _acquire_when_free(directory, seconds=180):
    """runlock.acquire, retried while a killed holder finishes exiting (a SIGKILL lands only after an fsync in
    progress returns, which on a loaded machine can take a while)."""
    deadline = time.time() + seconds
    while True:
        try:
            return runlock.acquire(directory)
        except ConfigError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # a SIGKILLed process in the middle of an fsync (a checkpoint) exits only when the disk answers: on a loaded
    # machine that can take a while, and its lock is held until then
    deadline = time.time() + 180
    while time.time() < deadline and any(Path(f"/proc/{p}").exists() and "Z" not in _state(p) for p in pids):
        time.sleep(0.1)


def _state(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


# ---------------------------------------------------------------------------------------------------------------
# one writer per run directory


def test_second_writer_and_resume_after_sigkilled_launcher_are_refused(tmp_path, capsys):
    """A 2-process run holds its directory: a second run on it is refused naming the holder; SIGKILL of the launcher
    leaves the workers running (they are in their own sessions), and a --resume is refused while they live."""
    out = tmp_path / "run"
    args = [*SMALL, "--epochs", "200", "--save-every", "5", "--output-dir", str(out)]
    launcher = subprocess.Popen([sys.executable, "-m", "finetune", "run", "--processes", "2", *args], env=ENV,
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        history = out / "history.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline and launcher.poll() is None and not (
                history.is_file() and history.read_text().count("\n") >= 2):
            time.sleep(0.2)
        assert launcher.poll() is None, "the run ended before the test could watch it"
        holder = int(runlock.holder(out))
        assert holder in _pids_running(str(out)) and holder != launcher.pid  # the main worker holds the lock

        capsys.readouterr()
        config = (out / "config.yaml").read_text()
        assert run_main([*args, "--set", "output.overwrite=true"]) == 2  # a second run, even one allowed to overwrite
        errors = _errors(capsys.readouterr().err)
        assert errors == [f"error: output.dir: {out} is in use by another run (pid {holder}); wait for it to end, "
                          "or stop it, or pick another directory"]
        assert (out / "config.yaml").read_text() == config

        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        workers = _pids_running(str(out))
        assert holder in workers and len(workers) == 2  # orphaned, still training
        assert run_main([*args, "--resume", "latest"]) == 2
        assert _errors(capsys.readouterr().err) == errors
    finally:
        if launcher.poll() is None:
            launcher.kill()
        _kill(_pids_running(str(out)))
    steps = [json.loads(x)["step"] for x in (out / "history.jsonl").read_text().splitlines() if x.endswith("}")]
    assert steps == list(range(1, len(steps) + 1))  # one writer's lines, in order
    _acquire_when_free(out)  # the kernel drops the dead holder's lock once it has exited
    runlock.release(out)


def test_refusal_on_two_processes_is_one_line(tmp_path):
    """`finetune run --processes 2` with a data file the workers refuse (checked after the launch, on every
    process): one line from the main process, exit 2, every process gone, nothing written."""
    data = tmp_path / "header.csv"
    data.write_text("text,label\n")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "finetune", "run", "--processes", "2", *SMALL, "--set",
                           f"data.source={data}", "--output-dir", str(out)], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [f"error: data.source: {data} holds no data rows"], proc.stderr[-3000:]
    assert not out.exists() and not _pids_running(str(out))


def test_a_refusal_on_one_process_is_agreed_by_all(monkeypatch):
    """distributed.agree: the main process passes its check, process 1 refuses; the main process raises process 1's
    error, marked agreed (the command line then waits for every process before exiting)."""

    class TwoProcesses:
        num_processes, is_main_process = 2, True

    refusal = (ConfigError, ["resume: checkpoint c has no random state for process 1"])
    monkeypatch.setattr(distributed, "process_group", lambda: TwoProcesses())
    monkeypatch.setattr(distributed, "gather_object", lambda mine: [mine[0], (None, refusal)])
    with pytest.raises(ConfigError, match="no random state for process 1") as refused:
        distributed.agree(lambda: "fine here")
    assert refused.value.agreed
    monkeypatch.setattr(distributed, "gather_object", lambda mine: [mine[0], (None, None)])
    assert distributed.agree(lambda: Path("runs/x"), main_only=True) == Path("runs/x")  # the main's value for all


# ---------------------------------------------------------------------------------------------------------------
# checkpoints: a full disk, a complete run, a deleted latest


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A complete 2-step run with a checkpoint after each step (and its stderr)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = run_main([*SMALL, "--max-steps", "2", "--save-every", "1", "--output-dir", str(out)])
    assert code == 0, err.getvalue()[-3000:]
    return out, err.getvalue()


def test_warmup_longer_than_the_run_is_named(finished):
    warnings = [x for x in finished[1].splitlines() if x.startswith("warning:")]
    assert warnings == ["warning: training.warmup_steps: 2 is not below the run's 2 optimizer steps; the learning "
                        "rate never reaches training.learning_rate (0.001)"]


@pytest.mark.parametrize("case", ["complete", "latest deleted"])
def test_resume_refusals_touch_nothing(finished, tmp_path, capsys, case):
    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    if case == "latest deleted":
        shutil.rmtree(out / "checkpoints" / "step-000002")
    before = _files(out)
    capsys.readouterr()
    assert run_main([*SMALL, "--max-steps", "2", "--output-dir", str(out), "--resume", "latest"]) == 2
    stderr = capsys.readouterr().err
    if case == "complete":
        expected = f"resume: the run in {out} is complete (2 of 2 optimizer steps); nothing to do"
    else:
        ckpts = out / "checkpoints"
        expected = (f"resume: checkpoints/latest names {ckpts / 'step-000002'}, which is missing; the newest intact "
                    f"one is {ckpts / 'step-000001'} (--resume {ckpts / 'step-000001'})")
    assert len(_errors(stderr)) == 1 and expected in _errors(stderr)[0], stderr[-2000:]
    assert "Traceback" not in stderr
    assert _files(out) == before


def test_full_disk_is_one_line_and_the_previous_checkpoint_resumes(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real, calls = checkpoint.capture_rng, []

    def no_space_at_the_second(rank, directory):
        calls.append(directory)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory / f"rng_{rank}.json"))
        real(rank, directory)

    monkeypatch.setattr(checkpoint, "capture_rng", no_space_at_the_second)
    args = [*SMALL, "--max-steps", "3", "--save-every", "1", "--output-dir", str(out)]
    capsys.readouterr()
    assert run_main(args) == 1
    stderr = capsys.readouterr().err
    ckpts = out / "checkpoints"
    assert _errors(stderr) == [f"error: output.dir: no space left on device in {ckpts}: checkpoint step-000002 not "
                               "written; step-000001 is still the latest"], stderr[-2000:]
    assert "Traceback" not in stderr
    assert (ckpts / "latest").read_text().strip() == "step-000001"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000001"]  # the partial one removed
    checkpoint.verify(ckpts / "step-000001")
    monkeypatch.undo()  # space again: the run resumes from the previous checkpoint and ends
    assert run_main([*args, "--resume", "latest"]) == 0
    steps = [json.loads(x)["step"] for x in (out / "history.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3] and (ckpts / "latest").read_text().strip() == "step-000003"


def test_torch_writer_failure_on_a_full_disk_is_recognised(tmp_path, monkeypatch):
    """torch's zip writer drops the errno ("unexpected pos …"): a full disk is told by the space left."""
    torn = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 9664 vs 9556")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 10 << 30, 4096))
    assert durable.disk_full(torn, tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 1 << 30, 9 << 30))
    assert not durable.disk_full(torn, tmp_path)
    assert durable.disk_full(OSError(errno.ENOSPC, "No space left on device"))


# ---------------------------------------------------------------------------------------------------------------
# the Python API


class NoLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6, 1)

    def forward(self, x, y):
        return {"prediction": self.net(x)}


API_CASES = {
    "no loss": (dict(model=NoLoss()), "model: it returned no loss"),
    "keys differ": (dict(train_data=[*regression_data(4), {"x": torch.zeros(6)}]),
                    "train_data: sample 4 has ['x'], sample 0 has ['x', 'y']"),
    "no model": (dict(model=None), "model: got NoneType; expected a torch.nn.Module"),
    "tuples": (dict(train_data=[(s["x"], s["y"]) for s in regression_data(8)]),
               "train_data: samples are tuples; model(**batch) needs dict samples"),
    "loss without grad": (dict(loss_fn=lambda model, batch: torch.tensor(1.0)),
                          "loss_fn: its loss has no gradient"),
    "empty val_data": (dict(val_data=[]), "val_data: empty"),
}


@pytest.mark.parametrize("case", API_CASES)
def test_api_bad_arguments_are_config_errors_naming_them(case):
    kwargs, message = API_CASES[case]
    kwargs = {"model": MLP(), "train_data": regression_data(8), "batch_size": 4, **kwargs}
    with pytest.raises(ConfigError) as refused:
        test_fine_tuning(**kwargs)
    assert message in str(refused.value)
