"""Start-up: everything between a validated recipe (or the Python API's objects, or the planner) and the first step,
in three stages, each returning one frozen record. Every refusal before the first step comes from here, or earlier
from loading the recipe (a field's range and what it needs: docs/code-map.md, "Where each refusal goes"), as one
line naming the setting (ConfigError); ``loop.train`` only trains.

    checked = check(cfg, resume)     # 1. no model: the output directory and its lock, the checkpoint (read once and
                                     #    checked), what this machine and the launch's engine config can run, the
                                     #    split of the effective batch
    built = build(cfg, checked)      # 2. the task's Job (seeded, told the run: ``TaskContext``), checked against
                                     #    its data; the run's optimizer steps counted; the checkpoint checked
                                     #    against the job (what it restores from it)
    run = assemble(built.job, cfg.training, built.shape, reporting)
                                     # 3. the Accelerator, the prepared model and optimizers, the windows, the
                                     #    checkpointer, the trackers; every refusal that needs the model
    result = loop.train(run, checked.saved)

``run_recipe`` takes stages 2 and 3 and writes the outputs (the command line, the search). The Python API, the
planner and the benchmarks hold a Job already; ``train_job`` runs the same stages for it — ``check_job`` (stage 1
without the recipe's output directory: the caller's ``Reporting`` names it), ``counted`` (stage 2 without building),
``assemble`` — so a job resumed from a checkpoint gets the command line's checks and refusals. ``resume`` is the
user's argument alone (a checkpoint's path or "latest"); the checkpoint it names, read once in stage 1, is ``saved``.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed

from finetune import checkpoint, distributed, durable, loop, offload, outputs, runlock
from finetune.config import Precision, RecipeConfig, Schedule, TrainingConfig, flatten
from finetune.engine_config import check_deepspeed, check_engine_config
from finetune.errors import ConfigError
from finetune.items import count_items, is_causal_lm
from finetune.job import Job, TaskContext
from finetune.memory.auto_batch import AutoBatch
from finetune.memory.measure import MemoryMonitor
from finetune.models import precision
from finetune.models.dropout import key_by_sample
from finetune.models.forward import enable_chunked_head, enable_gradient_checkpointing
from finetune.optim import group_settings, lr_scale, make_optims
from finetune.packing import decide_packing
from finetune.registry import task_module
from finetune.runlog import banner
from finetune.schema import installed
from finetune.shape import Shape
from finetune.windows import WindowSpec, windows_per_epoch

# ---------------------------------------------------------------------------------------------------------------
# 1. checks that need no model


@dataclass(frozen=True)
class Checked:
    """What stage 1 settled before a model is built."""

    out_dir: Optional[Path]             # the run's output directory (a recipe's: locked by the main process;
                                        # a job's: the caller's, None when it writes nothing)
    saved: Optional[checkpoint.Saved]   # the checkpoint the run continues (read once), or None
    shape: Shape                        # the split of the effective batch (its steps are counted in stage 2)
    settings: dict                      # the recipe as the run uses it: its config.yaml (written once the job is
                                        # built), what trackers and checkpoints record


def check(cfg: RecipeConfig, resume: Optional[str] = None) -> Checked:
    """Stage 1, on every process: the output directory (named and locked by the main process, the same on every
    process), what this machine and the launch's engine config can run, the split of the effective batch, and the
    checkpoint to resume. A refusal on any process stops every process with the same error, before anything is
    written. The lock is held until ``runlock.release_all()`` (or exit). An offload level first becomes the
    DeepSpeed launch Accelerate reads (``offload.engage``), before the process group exists."""
    offload.engage(cfg.training.host_offload)
    if cfg.training.host_offload.on:  # the DeepSpeed it asked for joins a process group even alone
        distributed.group_of_one()
    group = distributed.process_group()
    out_dir = distributed.agree(lambda: claim_output_dir(cfg, resume), main_only=True)
    saved, shape = distributed.agree(lambda: check_run(cfg, resume, out_dir, group.num_processes,
                                                       group.process_index))
    return Checked(out_dir, saved, shape, as_run(cfg, shape).to_dict())


def check_before_launch(cfg: RecipeConfig, resume: Optional[str], processes: int) -> Path:
    """``finetune run --processes N`` checks here what ``check`` checks, for N processes, before it starts them;
    returns the output directory. The lock is only tried: the workers' main process takes it for the run."""
    offload.engage(cfg.training.host_offload)  # the workers inherit the launch it asks for
    out_dir = claim_output_dir(cfg, resume)
    try:
        check_run(cfg, resume, out_dir, processes, rank=0, speak=False)  # the launched processes say the notes
    finally:
        runlock.release(out_dir)
    return out_dir


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


def check_run(cfg: RecipeConfig, resume: Optional[str], out_dir: Path, processes: int, rank: int,
              speak: bool = True) -> tuple[Optional[checkpoint.Saved], Shape]:
    """``check_training`` for a recipe: with ``speak``, rank 0 also prints the recipe's notes (a key in its old
    place)."""
    return check_training(cfg.training, cfg.to_dict(), resume, out_dir, processes, cfg.output.tracker,
                          cfg.notes if speak and rank == 0 else None)


def check_training(t: TrainingConfig, settings: dict, resume: Optional[str], out_dir: Optional[Path],
                   processes: int, tracker: Optional[str] = None,
                   notes: Optional[list] = None) -> tuple[Optional[checkpoint.Saved], Shape]:
    """What every process checks before a model is built, for a recipe and for a job built already alike: what this
    machine and the launch's engine config can run, that the effective batch splits over ``processes``, and the
    checkpoint to resume against ``settings`` (the run's recipe as a mapping: ``training`` and what else it holds).
    Returns (the checkpoint or None, the run's shape before the data is known). ``notes``: None on a process that
    keeps quiet; else they are printed, with the notes on resuming (e.g. a new effective split), after them."""
    check_environment(t, tracker)
    shape = split_batch(t, processes)
    check_even_batches(t, shape)
    saved, resuming = None, []
    if resume is not None:
        # refuses a missing / corrupt checkpoint; every process reads the same files, so every process reaches the
        # same verdict (no one waits on a peer that refused)
        saved = checkpoint.read(checkpoint.find_checkpoint(resume, out_dir))
        resuming = checkpoint.check_resume(saved, settings, shape)
    for note in [*notes, *resuming] if notes is not None else []:
        print(note, file=sys.stderr)
    return saved, shape


def check_even_batches(t: TrainingConfig, shape: Shape) -> None:
    """``training.even_batches`` replays a baseline's windows of whole per-device batches from its sample order:
    the effective batch must be a multiple of its processes × per-device batch, and no setting may cut or regroup
    the epoch otherwise; ``training.process_mean`` averages those processes' means, so it needs them."""
    if t.process_mean and not t.even_batches:
        raise ConfigError("training.process_mean: needs training.even_batches (the baseline's processes and "
                          "per-device batch, whose samples each process's mean covers)")
    if not t.even_batches:
        return
    processes, per_device = t.even_batches
    if shape.effective % (processes * per_device):
        raise ConfigError(f"training.even_batches: {processes} processes × {per_device} per device does not divide "
                          f"the effective batch {shape.effective}; give the baseline's [processes, per-device batch]")
    if t.drop_last:
        raise ConfigError("training.even_batches: cannot be combined with training.drop_last (the baseline kept its "
                          "short last batch, evened with the epoch's first samples)")
    if t.process_mean and t.packing:
        raise ConfigError("training.process_mean: cannot be combined with training.packing (a packed row mixes the "
                          "baseline processes' samples); set training.packing=false")


def check_job(t: TrainingConfig, reporting: loop.Reporting, resume: Optional[str] = None,
              processes: Optional[int] = None) -> Checked:
    """Stage 1 for a job built already (the Python API, the planner, the benchmarks), on every process:
    ``check_training`` with the caller's ``reporting`` (where it writes, its tracker, and the ``settings`` a checkpoint
    is compared with) in place of a recipe's output directory, which the caller owns. ``processes``: this
    launch's (default)."""
    if resume == checkpoint.LATEST and reporting.dir is None:
        raise ConfigError("resume: 'latest' needs output_dir (the run to continue); or give a checkpoint's folder")
    if t.host_offload.on and distributed.engine() != "deepspeed":  # the process group may exist already, DDP's
        raise ConfigError(f"training.offload: {t.offload} runs through DeepSpeed, which starts with the process: "
                          f"finetune run --offload {t.offload}, or accelerate launch --config_file "
                          f"{offload.SHIPPED[t.offload]}")
    offload.engage(t.host_offload)
    processes = processes or distributed.process_group().num_processes
    main = distributed.is_main_process()
    saved, shape = distributed.agree(lambda: check_training(t, reporting.settings, resume, reporting.dir, processes,
                                                            reporting.tracker, [] if main else None))
    return Checked(reporting.dir, saved, shape, reporting.settings)


def as_run(cfg: RecipeConfig, shape: Shape) -> RecipeConfig:
    """The recipe as the run uses it, for its ``config.yaml``: N is the one derived from the effective batch."""
    if shape.auto:
        return cfg
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training,
                                                                 gradient_accumulation_steps=shape.accumulation))


def check_environment(t: TrainingConfig, tracker: Optional[str] = None) -> None:
    """Refuse, naming the setting, what this machine or the launch cannot run (fail at set-up, not mid-run)."""
    # not a field's needs (schema.check_needs): the Python API names its tracker outside any recipe
    if tracker not in (None, "none") and not installed(tracker):
        raise ConfigError(f"output.tracker: {tracker} is not installed (pip install {tracker}); "
                          "or set output.tracker=none")
    if t.mixed_precision == "fp16" and not torch.cuda.is_available() and distributed.engine() in ("deepspeed", "fsdp"):
        # finetune's CPU loss scale is for one process or DDP; the engines scale their own, on a GPU
        raise ConfigError(f"training.mixed_precision: fp16 under {distributed.engine()} needs a CUDA device; on this "
                          "machine use bf16, or fp16 without the engine")
    if t.activation_offloading and not torch.cuda.is_available():
        raise ConfigError("training.activation_offloading: moves activations from GPU to host memory and needs CUDA; "
                          "on this machine there is no device memory to save")
    check_engine_config(t.max_grad_norm, t.on_nonfinite, t.offload)


def split_batch(t: TrainingConfig, processes: int) -> Shape:
    """The split of ``t``'s effective batch over ``processes`` processes.

    ``batch_size: auto`` starts from the largest candidate, the whole window in one micro-batch
    (``finetune.memory.auto_batch`` then picks the micro-batch the planner predicts to fit).

    Raises:
        ConfigError: an effective batch that does not split into micro-batches × processes; ``batch_size: auto`` on
            several processes.
    """
    if t.batch_size != "auto":
        return Shape(t.batch_size, resolve_accumulation(t, processes), processes)
    if processes > 1:
        raise ConfigError("training.batch_size: auto runs on one process (an out-of-memory error on one rank "
                          "would leave the others waiting); give a number with several processes")
    return Shape(micro_batch=t.effective_batch_size, accumulation=1, processes=1, auto=True)


def resolve_accumulation(t, processes: int) -> int:
    """N from ``t.effective_batch_size`` when given (it must split exactly, and agree with an N given beside it),
    else ``t.gradient_accumulation_steps`` (1 when null) (``t``: a TrainingConfig). With ``batch_size: auto`` the
    loop starts at N = 1 and shrinks micro-batches."""
    if t.batch_size == "auto":
        return 1
    if t.effective_batch_size is None:
        return t.gradient_accumulation_steps or 1
    per_step = t.batch_size * processes
    if t.effective_batch_size % per_step:
        raise ConfigError(
            f"training.effective_batch_size: {t.effective_batch_size} is not a multiple of batch_size × processes "
            f"= {t.batch_size} × {processes}; pick a batch_size that divides {t.effective_batch_size // processes}")
    n = t.effective_batch_size // per_step
    if t.gradient_accumulation_steps not in (None, n):
        raise ConfigError(
            f"training.gradient_accumulation_steps: {t.gradient_accumulation_steps} contradicts "
            f"training.effective_batch_size {t.effective_batch_size}, which makes N = {n} with batch_size "
            f"{t.batch_size} on {processes} process{'es' if processes > 1 else ''}; give one of them")
    return n


# ---------------------------------------------------------------------------------------------------------------
# 2. the task's job


@dataclass(frozen=True)
class Built:
    """What stage 2 built: the task's job, and the run's shape over its data (its optimizer steps counted)."""

    job: Job
    shape: Shape


def build(cfg: RecipeConfig, checked: Checked) -> Built:
    """Stage 2: the task's job, then ``counted``."""
    return counted(build_job(cfg, checked.shape), cfg.training, checked)


def counted(job: Job, t: TrainingConfig, checked: Checked) -> Built:
    """Stage 2 for a built job (a recipe's, or one the caller built): the job checked against its data, and the
    run's optimizer steps; a resumed run that is already complete, or whose checkpoint lacks what the job restores
    from it (a scheduler's state, the task's state: ``checkpoint.check_holds``), is refused here, before a model is
    assembled and before the run's directory holds anything new."""
    shape = count_steps(job, t, checked.shape)
    if checked.saved is not None and checked.saved.step >= shape.total_steps:
        where = checked.out_dir or checked.saved.path.parent.parent  # <run>/checkpoints/step-…
        raise ConfigError(f"resume: the run in {where} is complete ({checked.saved.step} of "
                          f"{shape.total_steps} optimizer steps); nothing to do (raise training.epochs or --max-steps "
                          "to train further)")
    if checked.saved is not None:
        checkpoint.check_holds(checked.saved, job)
    return Built(job, shape)


def build_job(cfg: RecipeConfig, shape: Optional[Shape] = None) -> Job:
    """Seed (model init of new heads is part of the reproduction), then call the recipe's task's ``build`` with the
    context of this launch (``TaskContext``; ``shape``: the run's split, by default this launch's split of the
    recipe's batch)."""
    set_seed(cfg.training.seed)
    group = distributed.process_group()
    shape = shape or split_batch(cfg.training, group.num_processes)
    ctx = TaskContext(shape=shape, processes=group.num_processes, rank=group.process_index, device=group.device,
                      main=distributed.is_main_process(), seed=cfg.training.seed, agree=distributed.agree)
    make = task_module(cfg.task).build
    return make(cfg, ctx) if takes_context(make) else make(cfg)


def takes_context(make) -> bool:
    """Whether a task's ``build`` takes the context as well as the recipe (``build(cfg, ctx)``); one written for
    ``build(cfg)`` keeps working."""
    try:
        params = list(inspect.signature(make).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def count_steps(job: Job, t: TrainingConfig, shape: Shape) -> Shape:
    """``shape`` over ``job``'s training set, checked against it (``check_data``), with the run's optimizer steps:
    Σ over epochs of ceil(samples / effective batch), capped by ``t.max_steps``."""
    check_data(job, t, shape)
    steps = run_length(t.schedule, windows_per_epoch(len(job.train_data), shape.micro_batch, shape.accumulation,
                                                     shape.processes, t.drop_last))
    warn_about_schedule(t, steps)
    return dataclasses.replace(shape, total_steps=steps)


def check_data(job: Job, t: TrainingConfig, shape: Shape) -> None:
    """Data the settings can't use: an empty training set, a micro-batch larger than it, sorting without lengths, a
    stream asked for what needs every sample ahead, shuffling a task whose samples must come in order."""
    n_train = len(job.train_data)
    if n_train == 0:
        raise ConfigError("data: the training set is empty")
    if shape.micro_batch > n_train:
        field = "effective_batch_size" if shape.auto else "batch_size"  # auto starts from the whole window
        raise ConfigError(f"training.{field}: {shape.micro_batch} is larger than the {n_train} training samples")
    if job.windows_in_order and (t.shuffle or t.sort_within_window):  # the cause, before what follows from it
        key = "shuffle" if t.shuffle else "sort_within_window"
        raise ConfigError(f"training.{key}: this task's samples must come in order (Job.windows_in_order); set "
                          f"training.{key}=false")
    if t.sort_within_window and job.length_of is None:
        raise ConfigError("training.sort_within_window: this task gives no sample lengths (Job.length_of)")
    check_replay_padding(job, t)
    if job.stream_block is not None:
        check_stream(t)


def check_replay_padding(job: Job, t: TrainingConfig) -> None:
    """``training.replay_padding`` cuts each window into the baseline's micro-batches, in its sampler order, and pads
    each to the length the baseline padded it to: it needs the samples' lengths, and nothing may regroup, pack or
    re-cut them."""
    if not t.replay_padding:
        return
    clash = next((f"training.{k}" for k, on in (("sort_within_window", t.sort_within_window), ("packing", t.packing),
                                                 ("max_tokens_per_micro_batch", t.max_tokens_per_micro_batch))
                  if on), None)
    if clash:
        raise ConfigError(f"{clash}: cannot be combined with training.replay_padding (it regroups the baseline's "
                          "micro-batches, whose padding is replayed); set one of them off")
    if job.length_of is None:
        raise ConfigError("training.replay_padding: this task gives no sample lengths (Job.length_of), so the "
                          "baseline's padded lengths are unknown; set training.replay_padding=null")


def check_stream(t: TrainingConfig) -> None:
    """What needs every sample before training, which a stream (read a window at a time) cannot give."""
    if t.batch_size == "auto":
        raise ConfigError("training.batch_size: auto measures the longest samples, which a stream has not read; give "
                          "a number (finetune plan sizes it)")
    if t.sample_order == "trainer" and t.shuffle:
        raise ConfigError("training.sample_order: trainer draws one permutation of every sample, which a stream "
                          "cannot read a block at a time; use finetune (blocks in a seeded order) or shuffle=false")
    if t.packing and not t.pack_length:
        raise ConfigError("training.pack_length: packing a stream needs the row length (its longest sample is not "
                          "known ahead)")


def run_length(s: Schedule, per_epoch: int) -> int:
    """The run's optimizer steps: ``s.epochs`` × ``per_epoch`` windows, capped by ``s.max_steps``."""
    steps = s.epochs * per_epoch
    return min(steps, s.max_steps) if s.max_steps else steps


def warn_about_schedule(t: TrainingConfig, steps: int) -> None:
    """One line (main process) when the warm-up does not end before the run does (the learning rate never reaches
    its peak)."""
    if distributed.is_main_process() and t.warmup_steps and t.warmup_steps >= steps and t.lr_scheduler != "constant":
        print(f"warning: training.warmup_steps: {t.warmup_steps} is not below the run's {steps} optimizer steps; "
              f"the learning rate never reaches training.learning_rate ({t.learning_rate:g})", file=sys.stderr,
              flush=True)


# ---------------------------------------------------------------------------------------------------------------
# 3. assembling the run


def assemble(job: Job, t: TrainingConfig, shape: Shape, reporting: Optional[loop.Reporting] = None,
             accelerator: Optional[Accelerator] = None) -> loop.Run:
    """Stage 3: make the Accelerator, ready the model, decide packing, refuse what needs the model
    (``check_model``), prepare the model and optimizers, settle the micro-batch and how the samples become windows,
    build the checkpointer, start the trackers, and say what the run will do (main process)."""
    reporting = reporting or loop.Reporting()
    accelerator = accelerator if accelerator is not None else accelerator_for(t.precision, reporting)
    model, head_note = ready_model(job, t)
    dropout_keys = key_by_sample(model, t.seed if t.dropout_seed is None else t.dropout_seed, job.length_of)
    scaler = scaler_for(accelerator, model, t.precision)
    pack_length_of, packing_note = packing_for(job, t, model)
    distributed.agree(lambda: check_model(accelerator, model, job, t, pack_length_of, reporting))  # all refuse alike
    model, optims = with_optimizers(accelerator, model, job, t, shape)
    auto = AutoBatch(accelerator, model) if shape.auto else None
    shape = auto.initial_shape(shape, job, t) if auto is not None else shape
    causal = is_causal_lm(model)
    run = loop.Run(job=job, training=t, shape=shape, reporting=reporting, accelerator=accelerator, model=model,
                   forward_model=torch.compile(model, mode=t.compile_mode) if t.compile else model, optims=optims,
                   counter=job.count_items or (lambda b: count_items(b, t.items, causal)),
                   monitor=MemoryMonitor(accelerator.device), auto=auto,
                   window_spec=WindowSpec.of(t, shape, len(job.train_data), job.length_of, pack_length_of,
                                             pack_capacity(job, t.pack_length, pack_length_of), job.stream_block),
                   checkpointer=checkpointer_for(job, shape, reporting,
                                                 scaler if distributed.own_scaler(accelerator, scaler) else None),
                   packing_note=packing_note, head_note=head_note,
                   pad_to_window=bool(t.replay_padding or t.mixed_precision != "no" and t.pad_to_window)
                   and not pack_length_of and not t.max_tokens_per_micro_batch,
                   # a job counting its own items (a preference pair, a rollout) is divided by them
                   divisor=(lambda b: count_items(b, "tokens")) if t.loss_divisor == "labels" and job.count_items is
                   None else None, scaler=scaler, dropout_keys=dropout_keys)
    if reporting.banner and distributed.is_main_process():
        print(banner(run), flush=True)
    start_trackers(run)
    return run


def accelerator_for(p: Precision, reporting: loop.Reporting) -> Accelerator:
    """The run's Accelerator: its mixed precision, and the tracker writing into the run's folder."""
    return distributed.make_accelerator(p.mixed_precision, log_with=reporting.tracker,
                                        project_dir=str(reporting.dir) if reporting.dir else None,
                                        loss_scale=loss_scale(p))


def loss_scale(p: Precision) -> distributed.LossScale:
    return distributed.LossScale(p.initial_loss_scale, p.loss_scale_growth_interval)


def scaler_for(accelerator: Accelerator, model, p: Precision):
    """fp16's loss scaler (``distributed.loss_scaler``); where it is finetune's own (a CPU), the model's forward
    runs under fp16 autocast (before ``prepare``), as Accelerate's prepare makes it run where it scales itself; and
    so under bf16 where the engine would not autocast (``distributed.own_autocast``)."""
    scaler = distributed.loss_scaler(accelerator, p.mixed_precision, loss_scale(p))
    if distributed.own_scaler(accelerator, scaler):
        precision.autocast_forward(model, torch.float16)
    elif distributed.own_autocast(accelerator, p.mixed_precision):
        precision.autocast_forward(model, torch.bfloat16)
    return scaler


def ready_model(job: Job, t: TrainingConfig) -> tuple:
    """The job's model in training mode with what the recipe turns on before it is wrapped: fp32 gradient sums
    under autocast, gradient checkpointing, the chunked loss head. Returns (model, what the banner says of the
    head)."""
    torch.backends.cudnn.benchmark = t.cudnn_benchmark
    model = job.model
    model.train()  # from_pretrained returns a model in eval mode: dropout would silently stay off
    precision.prepare_quantized(model)  # bitsandbytes-quantized weights: adapters only, and no CPU repacking
    if t.mixed_precision != "no" and t.fp32_grad_sums:  # N micro-batches add the fp32 sum the big batch takes
        precision.sum_weight_grads_in_fp32(model)
    if t.gradient_checkpointing:
        enable_gradient_checkpointing(model, job.enable_gradient_checkpointing)
    head_note = enable_chunked_head(model, t.chunked_loss) if job.loss_fn is None or t.chunked_loss else \
        "plain (the job computes its own loss)"
    return model, head_note


def packing_for(job: Job, t: TrainingConfig, model) -> tuple:
    """(each sample's length for packing, or None when the run does not pack; what the banner says of packing)."""
    if t.loss_divisor == "labels":  # a packed row hides each sample's first label, which the divisor counts
        return None, "off (training.loss_divisor=labels counts each sample's first label); sorted windows instead"
    if t.process_mean:  # each micro-batch holds one baseline process's samples: a packed row would mix them
        return None, "off (training.process_mean: each micro-batch holds one baseline process's samples)"
    if t.replay_padding:  # a packed row has no baseline micro-batch whose padding it could replay
        return None, "off (training.replay_padding: each micro-batch padded as its baseline micro-batch was)"
    pack_length_of, packing_note = decide_packing(t.packing, model, job.train_data, job.length_of, job.loss_fn)
    if job.stream_block is not None and pack_length_of and not t.pack_length:  # rows as long as the longest sample:
        return None, STREAM_UNPACKED  # a stream's is not known ahead
    return pack_length_of, packing_note


def with_optimizers(accelerator: Accelerator, model, job: Job, t: TrainingConfig, shape: Shape) -> tuple:
    """The model and the optimizers, made for the run's steps and prepared by Accelerate (DeepSpeed told the
    micro-batch first). Schedulers are not passed to ``accelerator.prepare``: a prepared scheduler steps
    num_processes times per optimizer step (Accelerate assumes each process's dataloader shrank by W); the windows
    already span every process, so each raw scheduler is stepped exactly once per optimizer step."""
    optims = make_optims(model, job.param_groups, t, shape.total_steps, lr_scale(t.optimizer_settings, shape.effective))
    distributed.configure_deepspeed(accelerator, shape.micro_batch, optims)
    model, optimizers = prepare(accelerator, model, [o.optimizer for o in optims])
    for o, p in zip(optims, optimizers):
        o.optimizer = p
    return model, optims


def pack_capacity(job: Job, pack_length: Optional[int], pack_length_of) -> Optional[int]:
    """A packed run's row capacity: ``training.pack_length``, else its longest sample (None: not packed)."""
    return (pack_length or max(map(pack_length_of, range(len(job.train_data))))) if pack_length_of else None


def checkpointer_for(job: Job, shape: Shape, reporting: loop.Reporting, scaler=None) -> checkpoint.Checkpointer:
    """The checkpointer of what the job's checkpoints hold (``scaler``: fp16's loss scale where finetune owns it),
    where and how often the run saves them."""
    return checkpoint.Checkpointer(checkpoint.contents(job, scaler), reporting.dir, reporting.save_every,
                                   reporting.keep_checkpoints, reporting.settings,
                                   {"effective_batch_size": shape.effective, "engine": distributed.launch_engine()})


STREAM_UNPACKED = "off (a stream's longest sample is not known ahead: training.pack_length packs it)"


def check_model(accelerator: Accelerator, model, job: Job, t: TrainingConfig, pack_length_of,
                reporting: loop.Reporting) -> None:
    """The refusals that need the model: token budgets without sample lengths, ``batch_size: auto`` for a task whose
    micro-steps cannot be measured ahead (``Job.unplannable``), checkpoints of a model the task
    sharded itself, what DeepSpeed would run differently with the job's optimizers (its config as Accelerate
    prepares it), and an offload level this machine's host memory cannot hold."""
    if t.max_tokens_per_micro_batch and not (job.length_of or pack_length_of):
        raise ConfigError("training.max_tokens_per_micro_batch: this task gives no sample lengths (Job.length_of)")
    if t.batch_size == "auto" and job.unplannable:
        raise ConfigError(f"training.batch_size: auto measures micro-steps before the run, and {job.unplannable}; "
                          "give a number of samples")
    if distributed.is_fsdp2(model) and accelerator.distributed_type != DistributedType.FSDP and reporting.save_every:
        raise ConfigError("output.save_every: checkpoints of a model the task sharded itself (fully_shard) are not "
                          "written; set output.save_every=null, or launch with accelerate_configs/fsdp.yaml (GPUs)")
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        groups = list(group_settings(job.param_groups, t).values())
        check_deepspeed(accelerator.deepspeed_plugin.deepspeed_config, groups[0].max_grad_norm, len(groups),
                        t.on_nonfinite)
        offload.check_host(model, accelerator.deepspeed_plugin.deepspeed_config, t.optimizer,
                           accelerator.num_processes)


def prepare(accelerator: Accelerator, model, optimizers: list) -> tuple:
    """``accelerator.prepare`` the model and optimizers. A model the task already sharded with ``fully_shard``
    (FSDP2 on a device mesh) is trained as it is: wrapped in DDP it would be synchronised twice."""
    if distributed.is_fsdp2(model):
        return model, list(accelerator.prepare(*optimizers)) if len(optimizers) > 1 else \
            [accelerator.prepare(*optimizers)]
    model, *prepared = accelerator.prepare(model, *optimizers)
    return model, prepared


def start_trackers(run: loop.Run) -> None:
    if run.reporting.tracker is None:
        return
    scalars = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
               for k, v in flatten(run.reporting.settings or {}, sep="/").items()}  # trackers take nothing else
    run.accelerator.init_trackers("finetune", config={
        **scalars, "config/effective_batch_size": run.shape.effective,
        "config/gradient_accumulation_steps": run.shape.accumulation,
        "config/physical_batch_size": run.shape.micro_batch})


# ---------------------------------------------------------------------------------------------------------------
# the stages together


def run_recipe(cfg: RecipeConfig, checked: Checked, on_eval: Optional[Callable] = None):
    """Stages 2 and 3 for a recipe checked by stage 1, then the loop and the outputs; returns the loop's result.
    ``on_eval(record)`` is called after every evaluation (a search prunes there)."""
    main = distributed.is_main_process()
    if not main:
        quiet_libraries()
    built = distributed.agree(lambda: build(cfg, checked))
    reporting = loop.Reporting(dir=checked.out_dir, save_every=cfg.output.save_every,
                               keep_checkpoints=cfg.output.keep_checkpoints,
                               tracker=None if cfg.output.tracker == "none" else cfg.output.tracker,
                               settings=checked.settings, on_eval=on_eval)
    run = assemble(built.job, cfg.training, built.shape, reporting)
    if main:  # after every refusal: a run refused before training leaves its directory as it found it
        checked.out_dir.mkdir(parents=True, exist_ok=True)
        durable.atomic_write_text(checked.out_dir / "config.yaml", yaml.safe_dump(checked.settings, sort_keys=False))
    start = time.perf_counter()
    result = loop.train(run, checked.saved)
    result.extra_metrics = {"train_seconds": round(time.perf_counter() - start, 2), "recipe": cfg.name,
                            "arithmetic": outputs.arithmetic(next(result.model.parameters()).device),
                            # what compare's twin must vary: masks keyed by sample, in this many layers
                            "dropout_layers": run.dropout_keys.layers if run.dropout_keys else 0}
    with distributed.whole_model(result.model):  # sharded weights (ZeRO-3, FSDP2) whole on every process
        distributed.agree(lambda: outputs.write_outputs(cfg.output, built.job, result, checked.out_dir,
                                                        cfg.training.ema_beta), main_only=True)
    return result


def train_job(job: Job, t: TrainingConfig, reporting: Optional[loop.Reporting] = None, resume: Optional[str] = None,
              accelerator: Optional[Accelerator] = None) -> loop.TrainResult:
    """The three stages for a job built already (the Python API, the planner's measurement, the benchmarks), then
    the loop: ``check_job`` (what this machine can run, the split, the checkpoint ``resume`` names — "latest" in
    ``reporting.dir``, or a checkpoint's folder — checked against the run as the command line checks it), ``counted``
    (the shape over the job's data; a complete run refused), ``assemble``.

    Raises:
        ConfigError: what the command line refuses for the same settings, with the same line.
    """
    reporting = recorded(reporting or loop.Reporting(), t)
    checked = check_job(t, reporting, resume, accelerator.num_processes if accelerator is not None else None)
    built = distributed.agree(lambda: counted(job, t, checked))
    return loop.train(assemble(built.job, t, built.shape, reporting, accelerator), checked.saved)


def recorded(reporting: loop.Reporting, t: TrainingConfig) -> loop.Reporting:
    """``reporting`` with the run's settings, for a caller that gave none: its training section, shaped as a recipe
    (what a checkpoint records, and what a resumed run is compared with)."""
    if reporting.settings is not None:
        return reporting
    return dataclasses.replace(reporting, settings={"training": dataclasses.asdict(t)})


def quiet_libraries() -> None:
    """One process speaks: the others keep quiet about loading and mapping."""
    import datasets  # the workers of a multi-process run only: a command that never launches one skips its import
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
