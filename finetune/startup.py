"""Run a validated recipe: pick the output directory, build the task's job, train it through the shared loop, write
what the run leaves behind. The command line (``finetune.cli``) and the search (``finetune.search``) both call it.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from finetune import checkpoint, distributed, durable, loop, outputs, runlock
from finetune.config import RecipeConfig, flatten, result_changes
from finetune.errors import ConfigError
from finetune.job import Job, TaskContext
from finetune.registry import task_module
from finetune.shape import Shape, plan_shape


def build_job(cfg: RecipeConfig, shape: Optional[Shape] = None) -> Job:
    """Seed, then build the recipe's task (model init of new heads is part of the reproduction), telling it the run
    (``TaskContext``; ``shape``: the run's split, by default this launch's split of the recipe's batch)."""
    from accelerate.utils import set_seed

    set_seed(cfg.training.seed)
    state = distributed.distributed_state()
    shape = shape or plan_shape(cfg.training, state.num_processes)
    ctx = TaskContext(shape=shape, processes=state.num_processes, rank=state.process_index, device=state.device,
                      main=distributed.is_main_process(), seed=cfg.training.seed, agree=distributed.agree)
    build = task_module(cfg.task).build
    return build(cfg, ctx) if takes_context(build) else build(cfg)


def takes_context(build) -> bool:
    """Whether a task's ``build`` takes the context as well as the recipe (``build(cfg, ctx)``); one written for
    ``build(cfg)`` keeps working."""
    import inspect

    try:
        params = list(inspect.signature(build).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def output_dir_for(cfg: RecipeConfig, resume: Optional[str] = None) -> Path:
    """The run's output directory (its path; ``claim_output_dir`` checks and locks it)."""
    if resume is not None and resume != "latest" and not cfg.output.dir:
        return Path(resume).resolve().parent.parent  # <run>/checkpoints/step-…
    if resume == "latest" and not cfg.output.dir:
        raise ConfigError("resume: 'latest' needs --output-dir (the run to continue)")
    out = Path(cfg.output.dir) if cfg.output.dir else Path("runs") / cfg.name / time.strftime("%Y%m%d-%H%M%S")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir: {out} is a file; give a directory")
    return out


def claim_output_dir(cfg: RecipeConfig, resume: Optional[str] = None) -> Path:
    """The run's output directory, locked by this process for the run (``runlock``); refused, before anything is
    written, when another run holds it or it already holds another run's files."""
    out = output_dir_for(cfg, resume)
    runlock.acquire(out)
    if resume is None and not cfg.output.overwrite and any(p.name != runlock.LOCK for p in out.iterdir()):
        runlock.release(out)
        raise ConfigError(f"output.dir: {out} already holds files; pick a new directory or set output.overwrite=true")
    return out


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` settled before a model is built."""

    out_dir: Path                       # the run's output directory (locked by the main process)
    resume: Optional[checkpoint.Saved]  # the checkpoint the run continues, or None
    shape: Shape                        # the split of the effective batch (its steps are counted once the data is)
    settings: dict                      # the recipe as the run uses it: its config.yaml (written once the job is
                                        # built), what trackers and checkpoints record


def check_run(cfg: RecipeConfig, resume: Optional[str], out_dir: Path, processes: int, rank: int,
              speak: bool = True) -> tuple[Optional[checkpoint.Saved], Shape]:
    """What every process checks before a model is built: that the effective batch splits over ``processes``, the
    checkpoint to resume, and what this machine can run. Returns (the checkpoint or None, the run's shape before
    the data is known). With ``speak``, rank 0 prints the recipe's notes (a key in its old place) and the notes on
    resuming (e.g. a new effective split)."""
    distributed.check_environment(cfg.training, cfg.output.tracker)
    shape = plan_shape(cfg.training, processes)
    saved, notes = None, list(cfg.notes)
    if resume is not None:
        # refuses a missing / corrupt checkpoint; every process reads the same files, so every process reaches the
        # same verdict (no one waits on a peer that refused)
        saved = checkpoint.read(checkpoint.find_checkpoint(resume, out_dir))
        notes += check_resume(saved, cfg, shape)
    if speak and rank == 0:
        for note in notes:
            print(note, file=sys.stderr)
    return saved, shape


def prepare(cfg: RecipeConfig, resume: Optional[str] = None) -> Prepared:
    """Everything checked before a model is built: the output directory (named and locked by the main process, the
    same on every process), the checkpoint to resume, what this machine can run, and that the effective batch
    splits. A refusal on any process stops every process with the same error. The lock is held until
    ``runlock.release_all()`` (or exit)."""
    state = distributed.distributed_state()
    out_dir = distributed.agree(lambda: claim_output_dir(cfg, resume), main_only=True)
    saved, shape = distributed.agree(lambda: check_run(cfg, resume, out_dir, state.num_processes,
                                                       state.process_index))
    return Prepared(out_dir, saved, shape, as_run(cfg, shape).to_dict())


def check_before_launch(cfg: RecipeConfig, resume: Optional[str], processes: int) -> Path:
    """``finetune run --processes N`` checks here what ``prepare`` checks, for N processes, before it starts them;
    returns the output directory. The lock is only tried: the workers' main process takes it for the run."""
    out_dir = claim_output_dir(cfg, resume)
    try:
        check_run(cfg, resume, out_dir, processes, rank=0, speak=False)  # the launched processes say the notes
    finally:
        runlock.release(out_dir)
    return out_dir


def execute(cfg: RecipeConfig, prepared: Prepared, on_eval=None):
    """Build the recipe's task, train it through the shared loop, write the outputs; return the loop's result.
    ``on_eval(record)`` is called after every evaluation (a search prunes there)."""
    main = distributed.is_main_process()
    if not main:
        quiet_libraries()
    out_dir = prepared.out_dir
    job, shape = distributed.agree(lambda: build_checked(cfg, prepared))
    if main:
        out_dir.mkdir(parents=True, exist_ok=True)
        durable.atomic_write_text(out_dir / "config.yaml", yaml.safe_dump(prepared.settings, sort_keys=False))
    output = loop.Outputs(dir=out_dir, save_every=cfg.output.save_every, keep_checkpoints=cfg.output.keep_checkpoints,
                          tracker=None if cfg.output.tracker == "none" else cfg.output.tracker,
                          settings=prepared.settings, on_eval=on_eval)
    start = time.perf_counter()
    result = loop.train(job, cfg.training, shape, output, prepared.resume)
    result.extra_metrics = {"train_seconds": round(time.perf_counter() - start, 2), "recipe": cfg.name,
                            "arithmetic": outputs.arithmetic(next(result.model.parameters()).device)}
    with distributed.whole_model(result.model):  # sharded weights (ZeRO-3, FSDP2) whole on every process
        distributed.agree(lambda: outputs.write_outputs(cfg.output, job, result, out_dir, cfg.training.ema_beta),
                          main_only=True)
    return result


def build_checked(cfg: RecipeConfig, prepared: Prepared) -> tuple[Job, Shape]:
    """The job, and the run's shape over its data (checked against it: data the settings can't use; a resumed run
    that is already complete)."""
    job = build_job(cfg, prepared.shape)
    if distributed.engine() == "deepspeed":  # before the run's directory holds anything
        distributed.check_deepspeed({}, None, len(job.param_groups or [job.model]), cfg.training.on_nonfinite)
    shape = prepared.shape.for_data(job, cfg.training)
    if prepared.resume is not None:
        done = prepared.resume.step
        if done >= shape.total_steps:
            raise ConfigError(f"resume: the run in {prepared.out_dir} is complete ({done} of {shape.total_steps} "
                              "optimizer steps); nothing to do (raise training.epochs or --max-steps to train further)")
    return job, shape


def as_run(cfg: RecipeConfig, shape: Shape) -> RecipeConfig:
    """The recipe as the run uses it, for its ``config.yaml``: N is the one derived from the effective batch."""
    if shape.auto:
        return cfg
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training,
                                                                 gradient_accumulation_steps=shape.accumulation))


def quiet_libraries() -> None:
    """One process speaks: the others keep quiet about loading and mapping."""
    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


def check_resume(saved: checkpoint.Saved, cfg: RecipeConfig, shape: Shape) -> list[str]:
    """Whether the checkpoint ``saved`` can continue with ``cfg`` in ``shape``, and what to say.

    The windows depend on the seed and the effective batch only, so any micro-batch and any number of processes
    continue the same run as long as ``b × N × processes`` is the checkpoint's effective batch (elastic resume).
    Another effective batch is refused — unless ``training.scale_lr`` says the run is meant to change batch, and
    then only at an epoch boundary (mid-epoch the remaining windows would not cover the epoch's samples).
    Returns lines to print: settings that change the result, and a changed process layout."""
    t, effective, processes = cfg.training, shape.effective, shape.processes
    notes = []
    if saved.effective_batch_size not in (None, effective):
        mid_epoch = saved.state.next_window != 0
        if t.scale_lr == "none" or mid_epoch:
            why = "mid-epoch the remaining windows would not be the epoch's samples" if t.scale_lr != "none" \
                else "or set training.scale_lr to change the batch on purpose, at an epoch boundary"
            raise ConfigError(f"resume: the checkpoint's effective batch is {saved.effective_batch_size}, this run's "
                              f"{shape.micro_batch} × {shape.accumulation} × {processes} = {effective}; "
                              f"give a micro-batch and N whose product with the processes is "
                              f"{saved.effective_batch_size} ({why})")
        notes.append(f"warning: resuming with another effective batch ({saved.effective_batch_size} → {effective}): "
                     "the steps from here are not the baseline's")
    new, old = flatten(cfg.to_dict()), saved.settings
    changed = [f"{k} ({old.get(k)!r} → {new.get(k)!r})" for k in result_changes(old, new)]
    if changed:
        notes.append("warning: resuming with settings that change the result: " + ", ".join(changed))
    check_resume_engine(saved, processes)
    if saved.processes not in (None, processes):
        notes.append(f"resume: saved on {saved.processes} process{'es' if saved.processes > 1 else ''}, continuing "
                     f"on {processes} with the same windows (effective batch {effective}); random draws made per "
                     "process (dropout) cannot replay the same masks on another layout — the rest is exact")
    return notes


def check_resume_engine(saved: checkpoint.Saved, processes: int) -> None:
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
