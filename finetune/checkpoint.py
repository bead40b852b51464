"""Crash-safe checkpoints that resume the very same run, and the one registry of what they hold.

Layout under the run's output directory::

    checkpoints/step-000012/   one checkpoint: the files of every entry of the registry (below),
                               manifest.json (size + sha256 of every file, written last)
    checkpoints/latest         name of the newest complete checkpoint (moved last)

What a checkpoint holds is one registry, ``contents(job)`` (name → ``Held``: how it is saved, how it is loaded, what
a checkpoint lacks for it), owned by the run's ``Checkpointer``, which saves it, loads it and decides when:

    accelerate   model.safetensors, optimizer.bin, scaler.pt, random_states_<rank>.pkl (accelerator.save_state),
                 less a model's quantized layers (Accelerate's state pre-hooks, registered once per run)
    train_state  trainer_state.json (finetune.state.TrainState; read in stage 1 by ``read``)
    schedulers   scheduler.json (JSON, not a pickle), one state per optimizer
    task         task_state.safetensors: the task's own objects (``Job.checkpointed``), when it has any
    settings     config.yaml, the run's recipe, which a resumed run is compared with (in stage 1)
    rng          rng_<rank>.json / .safetensors (random states without pickle); restored last

A checkpoint is written into ``checkpoints/.tmp-step-…``, every file fsynced, then renamed into place; only then
does ``latest`` move (write-to-temp + rename). A kill at any moment leaves the previous checkpoint loadable; a
checkpoint whose files do not match its manifest is refused (stage 1), and one that lacks what the job restores is
refused in stage 2 (``check_holds``), before a model is assembled. The next resumable thing is one more entry of
``contents``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, load_model, save_file

from finetune import distributed
from finetune.cache import file_digest
from finetune.config import flatten, result_changes
from finetune.durable import atomic_write_text, disk_full, fsync_dir
from finetune.errors import ConfigError, WriteError
from finetune.loading import moved_keys
from finetune.models import precision
from finetune.seeding import capture_rng, restore_rng, step_seed
from finetune.state import TrainState

LATEST = "latest"
MANIFEST = "manifest.json"
STATE = "trainer_state.json"
SCHEDULER = "scheduler.json"
CONFIG = "config.yaml"
TASK_STATE = "task_state.safetensors"
LOSS_SCALE = "loss_scale.json"


# ---------------------------------------------------------------------------------------------------------------
# what a checkpoint holds: one registry


@dataclass(frozen=True)
class Live:
    """The run's objects a checkpoint is written from and restored into (the ``Checkpointer`` hands them over)."""

    accelerator: Any
    schedulers: dict                    # optimizer name → its scheduler
    state: Optional[TrainState] = None  # saving: the state after the step being saved
    settings: Optional[dict] = None     # saving: the run's config.yaml


def holds_all(path: Path) -> Optional[str]:
    """Any checkpoint holds it (or ``verify`` and ``read`` refused the checkpoint in stage 1)."""
    return None


def read_in_stage_1(saved: Saved, live: Live) -> None:
    """Nothing left to load: ``read`` read it once in stage 1, where the resume was checked against it."""


@dataclass(frozen=True)
class Held:
    """One entry of the registry of what a checkpoint holds (``contents``)."""

    save: Callable[[Path, Live], None]                  # writes it into the checkpoint folder being written
    load: Callable[[Saved, Live], None]                 # restores it from the checkpoint ``saved``
    lacks: Callable[[Path], Optional[str]] = holds_all  # what a checkpoint misses for it (stage 2 refuses), or None
    each_process: bool = False                          # every process writes its part (else the main process)
    hooks: Optional[tuple] = None                       # Accelerate (save, load) state pre-hooks it needs


def contents(job, scaler=None) -> dict[str, Held]:
    """The registry of what a checkpoint of ``job``'s run holds, by name: the one list that the ``Checkpointer``
    saves and loads, and that stage 2 checks a checkpoint against (``check_holds``). Loaded in this order: the
    random states last, over those Accelerate's ``load_state`` set. ``scaler``: fp16's loss scale where finetune
    owns it (``distributed.loss_scaler``; Accelerate saves its own, scaler.pt)."""
    return {
        "loss_scale": scaler_held(scaler),
        "accelerate": Held(save_accelerate, load_accelerate, each_process=True,
                           hooks=(leave_quantized_out, load_quantized_aside)),
        "train_state": Held(save_train_state, read_in_stage_1),
        "schedulers": schedulers_held(list(job.param_groups or {"model": {}})),  # the names make_optims gives
        "task": task_held(job.checkpointed),
        "settings": Held(save_settings, read_in_stage_1),
        "rng": Held(save_rng, load_rng, each_process=True),
    }


def check_holds(saved: Saved, job) -> None:
    """Stage 2: refuse the checkpoint ``saved`` when it lacks what ``job``'s run restores from it (a scheduler's
    state, the task's state), in one line naming all of it.

    Raises:
        ConfigError: e.g. ``resume: checkpoint … lacks what this run restores: the task's state (…)``.
    """
    missing = [why for why in (held.lacks(saved.path) for held in contents(job).values()) if why]
    if missing:
        raise ConfigError(f"resume: checkpoint {saved.path} lacks what this run restores: {'; '.join(missing)}; "
                          "it was saved by a run without it")


def save_accelerate(folder: Path, live: Live) -> None:
    live.accelerator.save_state(str(folder), safe_serialization=True)


def load_accelerate(saved: Saved, live: Live) -> None:
    live.accelerator.load_state(str(saved.path))  # tensors via safetensors / torch.load(weights_only=True)


def leave_quantized_out(models, weights, output_dir) -> None:
    """Accelerate's save pre-hook: a model's bitsandbytes-quantized layers are left out of its saved state
    (constants that the run loads again from its model source; ``precision.quantized_state_keys``)."""
    for model, tensors in zip(models, weights):
        for key in precision.quantized_state_keys(model):
            tensors.pop(key, None)


def load_quantized_aside(models, input_dir) -> None:
    """Accelerate's load pre-hook: a model with quantized layers is loaded here instead, checking the rest strictly
    (only the quantized keys may be missing, nothing may be unexpected)."""
    if len(models) != 1 or not precision.quantized_state_keys(models[0]):
        return  # nothing quantized (the loop prepares one model): Accelerate loads it strictly
    model = models.pop()  # Accelerate loads the models left in its list
    missing, unexpected = load_model(model, os.path.join(input_dir, "model.safetensors"), strict=False)
    stray = sorted(set(missing) - precision.quantized_state_keys(model)) + sorted(unexpected)
    if stray:
        raise ConfigError(f"resume: checkpoint {input_dir} does not fit this model (e.g. {stray[0]})")


def save_train_state(folder: Path, live: Live) -> None:
    (folder / STATE).write_text(json.dumps(live.state.state_dict()))


def save_settings(folder: Path, live: Live) -> None:
    (folder / CONFIG).write_text(yaml.safe_dump(live.settings or {}, sort_keys=False))


def schedulers_held(names: list) -> Held:
    """The schedulers of the optimizers ``names``, as JSON (not a pickle: loading it runs no code)."""

    def save(folder: Path, live: Live) -> None:
        (folder / SCHEDULER).write_text(json.dumps({k: s.state_dict() for k, s in live.schedulers.items()}))

    def load(saved: Saved, live: Live) -> None:
        states = json.loads((saved.path / SCHEDULER).read_text())
        for name, scheduler in live.schedulers.items():
            scheduler.load_state_dict(states[name])

    def lacks(path: Path) -> Optional[str]:
        try:
            states = json.loads((path / SCHEDULER).read_text())
        except (OSError, ValueError):
            states = {}
        missing = [name for name in names if name not in states]
        return f"the scheduler state of optimizer {', '.join(map(repr, missing))} ({SCHEDULER})" if missing else None

    return Held(save, load, lacks)


def scaler_held(scaler) -> Held:
    """fp16's loss scale and its growth count as JSON (no pickle), where finetune owns the GradScaler; a checkpoint
    of a run in another precision holds none (the resume warned that the result changes): the scale starts anew."""

    def save(folder: Path, live: Live) -> None:
        if scaler is not None:
            (folder / LOSS_SCALE).write_text(json.dumps(scaler.state_dict()))

    def load(saved: Saved, live: Live) -> None:
        if scaler is not None and (saved.path / LOSS_SCALE).is_file():
            scaler.load_state_dict(json.loads((saved.path / LOSS_SCALE).read_text()))

    return Held(save, load)


def task_held(objects) -> Held:
    """The task's own objects (``Job.checkpointed``: ``state_dict()`` name → tensor, and ``load_state_dict``; e.g.
    DPO's precomputed reference log-probs, GRPO's rollouts), as one safetensors file (no pickle); nothing when the
    task has none."""
    objects = list(objects or [])

    def save(folder: Path, live: Live) -> None:
        if objects:
            save_file({f"{i}.{k}": v.detach().cpu().contiguous() for i, o in enumerate(objects)
                       for k, v in o.state_dict().items()}, str(folder / TASK_STATE))

    def load(saved: Saved, live: Live) -> None:
        if objects:
            tensors = load_file(str(saved.path / TASK_STATE))
            for i, o in enumerate(objects):
                o.load_state_dict({k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == str(i)})

    def lacks(path: Path) -> Optional[str]:
        if objects and not (path / TASK_STATE).is_file():
            return f"the task's state ({TASK_STATE}, e.g. precomputed reference log-probs)"
        return None

    return Held(save, load, lacks)


def save_rng(folder: Path, live: Live) -> None:
    capture_rng(live.accelerator.process_index, folder)


def load_rng(saved: Saved, live: Live) -> None:
    """The same layout: the very random stream the run would have drawn; another layout (elastic resume): no stream
    to replay, so a fresh one per process, keyed on the step."""
    rank = live.accelerator.process_index
    if saved.processes == live.accelerator.num_processes and (saved.path / f"rng_{rank}.json").is_file():
        restore_rng(rank, saved.path)
    else:
        reseed_rng(saved.state.optimizer_step, rank)


def reseed_rng(step: int, rank: int) -> None:
    """Seed python, numpy and torch (all devices) from the optimizer step and the process."""
    seed = step_seed(step, rank)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------------------------
# the checkpointer: save, load, cadence


@dataclass(frozen=True)
class Checkpointer:
    """What a run's checkpoints hold (``holds``, the registry ``contents``), and where and when they are written,
    built once at start-up (``startup.assemble``): every ``every`` optimizer steps and after the last, into
    ``<dir>/checkpoints``, keeping ``keep``; nothing without ``every`` or ``dir``. The loop opens it for the run
    (``hooked``), saves through ``save_if_due`` and starts a resumed run with ``load``."""

    holds: dict                       # name → Held
    dir: Optional[Path]
    every: Optional[int]
    keep: int = 2
    settings: Optional[dict] = None   # the run's config.yaml, which a resumed run is compared with
    meta: Optional[dict] = None       # manifest entries: the effective batch, the engine that writes the files

    @contextlib.contextmanager
    def hooked(self, accelerator):
        """The registry's Accelerate state pre-hooks on ``accelerator`` for the run inside, registered once and
        removed by their handles when it ends, error or not: a second run in this process (a test, a search trial,
        the Python API) does not inherit them."""
        handles = []
        try:
            for held in self.holds.values():
                if held.hooks is not None:
                    save_hook, load_hook = held.hooks
                    handles.append(accelerator.register_save_state_pre_hook(save_hook))
                    handles.append(accelerator.register_load_state_pre_hook(load_hook))
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def load(self, accelerator, saved: Saved, schedulers: dict) -> TrainState:
        """Restore every entry of the registry from the checkpoint ``saved`` (read once and checked at start-up)
        into the run's objects; return its TrainState."""
        live = Live(accelerator, schedulers)
        for held in self.holds.values():
            held.load(saved, live)
        return saved.state

    def save_if_due(self, accelerator, state: TrainState, schedulers: dict, total_steps: int) -> Optional[Path]:
        """Save after ``state.optimizer_step`` when it is due; every process calls it (a collective when due)."""
        done = state.optimizer_step >= total_steps
        if not self.every or self.dir is None or not (done or state.optimizer_step % self.every == 0):
            return None
        return self.save(accelerator, state, schedulers)

    def save(self, accelerator, state: TrainState, schedulers: dict) -> Path:
        """Save every entry of the registry after ``state.optimizer_step``; every process must call it.

        Raises:
            WriteError: on every process, when a process could not write its part (a full disk); the partial
                checkpoint is removed and ``latest`` still names the previous one.
        """
        root = Path(self.dir) / "checkpoints"
        name = f"step-{state.optimizer_step:06d}"
        final = root / name
        tmp = root / f".tmp-{name}"
        live = Live(accelerator, schedulers, state, self.settings)
        main = distributed.is_main_process()

        def start():
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)

        def write_shards():  # model (safetensors), optimizer, scaler, random states: each process its part
            for held in self.holds.values():
                if held.each_process:
                    held.save(tmp, live)
            _fault("save", state.optimizer_step)  # test hook: dies here, mid-write, when asked to

        def seal():
            for held in self.holds.values():
                if not held.each_process:
                    held.save(tmp, live)
            files = sorted(p for p in tmp.rglob("*") if p.is_file())
            for p in files:
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            manifest = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": file_digest(p).hexdigest()}
                        for p in files}
            (tmp / MANIFEST).write_text(json.dumps({"step": state.optimizer_step,
                                                    "processes": accelerator.num_processes, **(self.meta or {}),
                                                    "files": manifest}, indent=1))
            with open(tmp / MANIFEST, "rb") as f:
                os.fsync(f.fileno())
            fsync_dir(tmp)
            if final.exists():  # a checkpoint of this step from an earlier attempt: replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(root)
            atomic_write_text(root / LATEST, name + "\n")  # the pointer moves last
            for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)

        # Each phase ends with every process agreeing that it wrote its part (a barrier that also carries a failure).
        try:
            distributed.agree(lambda: _written(start, root, name), main_only=True)
            distributed.agree(lambda: _written(write_shards, root, name))
            distributed.agree(lambda: _written(seal, root, name), main_only=True)
        except WriteError:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)  # give the space back; latest still names the previous one
            raise
        if torch.cuda.is_available():  # saving churns the allocator; give fragmented blocks back
            torch.cuda.empty_cache()
        return final


def _written(write, root: Path, name: str) -> None:
    """``write()``; a full disk becomes one WriteError naming the checkpoint and its directory."""
    try:
        write()
    except Exception as error:
        if not disk_full(error, root):
            raise
        latest = root / LATEST
        previous = latest.read_text().strip() if latest.is_file() else None
        raise WriteError(f"output.dir: no space left on device in {root}: checkpoint {name} not written; "
                         + (f"{previous} is still the latest" if previous else "there is no earlier checkpoint")) \
            from None


def _fault(point: str, step: int) -> None:
    """``FINETUNE_FAULT=save:4`` kills the process in the middle of writing the step-4 checkpoint (tests only)."""
    if os.environ.get("FINETUNE_FAULT") == f"{point}:{step}":
        os.kill(os.getpid(), 9)


# ---------------------------------------------------------------------------------------------------------------
# find, verify, read, check


def find_checkpoint(spec: str, run_dir) -> Path:
    """``latest`` → the newest complete checkpoint of ``run_dir``; otherwise a checkpoint directory. A ``latest``
    that names a missing or damaged checkpoint is refused naming the newest intact one."""
    if spec != LATEST:
        path = Path(spec)
        if not path.is_dir():
            raise ConfigError(f"resume: checkpoint {path} not found")
        verify(path)
        return path
    pointer = Path(run_dir) / "checkpoints" / LATEST
    if not pointer.is_file():
        raise ConfigError(f"resume: no checkpoint in {run_dir} (no checkpoints/{LATEST}); "
                          "train with --save-every K first, or give a checkpoint path")
    path = pointer.parent / pointer.read_text().strip()
    try:
        if not path.is_dir():
            raise ConfigError(f"resume: checkpoints/{LATEST} names {path}, which is missing")
        verify(path)
    except ConfigError as error:
        intact = newest_intact(pointer.parent)
        hint = f"the newest intact one is {intact} (--resume {intact})" if intact else \
            f"no intact checkpoint is left in {pointer.parent}"
        raise ConfigError(f"{error.problems[0]}; {hint}") from None
    return path


def newest_intact(root: Path):
    """The newest checkpoint under ``root`` that matches its manifest, or None."""
    for path in sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True):
        try:
            verify(path)
            return path
        except ConfigError:
            continue
    return None


def verify(path: Path) -> dict:
    """Refuse a partial or corrupt checkpoint: every file of the manifest present, with its size and hash."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError):
        raise ConfigError(f"resume: {path} is not a complete checkpoint (no valid {MANIFEST})") from None
    for rel, meta in files.items():
        p = path / rel
        if not p.is_file():
            raise ConfigError(f"resume: checkpoint {path} is incomplete: {rel} is missing")
        if p.stat().st_size != meta["bytes"] or file_digest(p).hexdigest() != meta["sha256"]:
            raise ConfigError(f"resume: checkpoint {path} is corrupt: {rel} does not match its manifest")
    return manifest


@dataclass(frozen=True)
class Saved:
    """What a checkpoint says about the run it continues (its manifest, trainer_state.json and config.yaml)."""

    path: Path
    step: int                               # optimizer steps taken
    processes: Optional[int]                # the process layout it was saved on
    effective_batch_size: Optional[int]
    engine: str                             # what wrote its model and optimizer files (distributed.launch_engine)
    state: TrainState
    settings: dict                          # its config.yaml, flat (``training.learning_rate`` → value)


def read(path: Path) -> Saved:
    """Read a (verified) checkpoint's description: the one reader of these files.

    Raises:
        ConfigError: when one of them does not parse.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        state = TrainState.from_dict(json.loads((path / STATE).read_text()))
        settings = flatten(yaml.safe_load((path / CONFIG).read_text()) or {})
    except (OSError, ValueError, TypeError, yaml.YAMLError) as error:
        raise ConfigError(f"resume: checkpoint {path} cannot be read ({error})") from None
    return Saved(path=path, step=int(manifest["step"]), processes=manifest.get("processes"),
                 effective_batch_size=manifest.get("effective_batch_size"), engine=manifest.get("engine", "ddp"),
                 state=state, settings=settings)


def check_resume(saved: Saved, settings: dict, shape) -> list[str]:
    """Whether the checkpoint ``saved`` can continue the run whose recipe is ``settings`` (its ``to_dict()``) in
    ``shape``, and what to say.

    The windows depend on the seed and the effective batch only, so any micro-batch and any number of processes
    continue the same run as long as ``b × N × processes`` is the checkpoint's effective batch (elastic resume).
    Another effective batch is refused — unless ``training.scale_lr`` says the run is meant to change batch, and
    then only at an epoch boundary (mid-epoch the remaining windows would not cover the epoch's samples).
    Returns lines to print: settings that change the result, and a changed process layout."""
    new = flatten(settings)
    scale_lr, effective, processes = new.get("training.scale_lr", "none"), shape.effective, shape.processes
    notes = []
    if saved.effective_batch_size not in (None, effective):
        mid_epoch = saved.state.next_window != 0
        if scale_lr == "none" or mid_epoch:
            why = "mid-epoch the remaining windows would not be the epoch's samples" if scale_lr != "none" \
                else "or set training.scale_lr to change the batch on purpose, at an epoch boundary"
            raise ConfigError(f"resume: the checkpoint's effective batch is {saved.effective_batch_size}, this run's "
                              f"{shape.micro_batch} × {shape.accumulation} × {processes} = {effective}; "
                              f"give a micro-batch and N whose product with the processes is "
                              f"{saved.effective_batch_size} ({why})")
        notes.append(f"warning: resuming with another effective batch ({saved.effective_batch_size} → {effective}): "
                     "the steps from here are not the baseline's")
    moved = moved_keys(new.get("task"))  # a checkpoint saved before a key moved names it in its old place
    old = {moved.get(k, k): v for k, v in saved.settings.items()}
    changed = [f"{k} ({old.get(k)!r} → {new.get(k)!r})" for k in result_changes(old, new)]
    if changed:
        notes.append("warning: resuming with settings that change the result: " + ", ".join(changed))
    check_resume_engine(saved, processes)
    if saved.processes not in (None, processes):
        notes.append(f"resume: saved on {saved.processes} process{'es' if saved.processes > 1 else ''}, continuing "
                     f"on {processes} with the same windows (effective batch {effective}); dropout layers keyed by "
                     "sample draw the same masks, other random draws made per process (attention dropout inside "
                     "its kernel, a task's own noise) cannot be replayed on another layout — the rest is exact")
    return notes


def check_resume_engine(saved: Saved, processes: int) -> None:
    """A checkpoint written by a sharding engine holds its model and optimizer state in that engine's files, split
    per process: it resumes under the same engine (and ZeRO stage) on the same number of processes. Between DDP and
    one process any layout resumes (elastic)."""
    engine = distributed.launch_engine()
    if saved.engine != engine:
        raise ConfigError(f"resume: checkpoint {saved.path} was written under {saved.engine}, this launch is "
                          f"{engine}; resume it with the launch config it was saved with (a DeepSpeed checkpoint's "
                          "zero_to_fp32.py writes its weights whole)")
    if saved.engine != "ddp" and saved.processes not in (None, processes):
        raise ConfigError(f"resume: checkpoint {saved.path} was written by {saved.engine} on {saved.processes} "
                          f"processes; it resumes on {saved.processes} (its state is split per process), not "
                          f"{processes}")
