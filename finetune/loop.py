"""The shared training loop: windows → micro-steps → one optimizer step → history / eval / save.

Every optimizer step is the step the baseline took with one batch of ``micro_batch × N × processes`` samples:

* a window holds exactly the baseline batch's samples (``windows.py``), the epoch's last window included;
* its item count (samples, or label tokens) is known before the first backward, summed over processes;
* each micro-batch's mean loss is weighted by its share of those items (``loss_weight``), so the accumulated
  gradient is the gradient of the mean loss over the whole window — whatever the tail, the micro-batch size or N;
* gradients are all-reduced once per window (``accelerator.accumulate`` → ``no_sync`` on the other micro-steps);
* unscale (fp16) → grad norm → clip → step → scheduler, once per optimizer step.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType, send_to_device
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from finetune.config import ConfigError, TrainingConfig
from finetune.job import Job
from finetune.memory import MemoryMonitor, fake_oom_check, is_oom, smaller_micro_batch
from finetune.state import TrainState
from finetune.windows import WindowSampler, batch_len, count_items, is_causal_lm, plan_epoch, windows_per_epoch


class NonFiniteError(RuntimeError):
    """A window produced a non-finite loss or gradient and ``training.on_nonfinite`` is ``stop``."""


# ---------------------------------------------------------------------------------------------------------------
# set-up helpers


def make_accelerator(t: TrainingConfig, accum: int, log_with=None, project_dir=None) -> Accelerator:
    """An Accelerator for this run (see ``check_environment`` for what is refused)."""
    check_environment(t)
    # Accelerate keeps process-wide singletons; a second run in the same process (the Python API, tests, a search)
    # may ask for another precision or N, so start them afresh (the distributed process group is kept).
    if AcceleratorState._shared_state:
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
    return Accelerator(
        mixed_precision=t.mixed_precision,
        gradient_accumulation_steps=accum,
        log_with=log_with,
        project_dir=project_dir,
        cpu=not _has_device(),
    )


def check_environment(t: TrainingConfig, tracker: Optional[str] = None) -> None:
    """Refuse, naming the setting, what this machine cannot run (fail at set-up, not mid-run)."""
    if tracker not in (None, "none"):
        import importlib.util

        if importlib.util.find_spec(tracker) is None:
            raise ConfigError(f"output.tracker: {tracker} is not installed (pip install {tracker}); "
                              "or set output.tracker=none")
    if t.mixed_precision == "fp16" and not torch.cuda.is_available():  # Accelerate would silently train in fp32
        raise ConfigError("training.mixed_precision: fp16 needs a CUDA device; use bf16 or no on this machine")
    for engine in ("FSDP", "DEEPSPEED"):  # Accelerate's plugins for these refuse to start without a GPU
        if os.environ.get(f"ACCELERATE_USE_{engine}", "false").lower() == "true" and not _has_device():
            raise ConfigError(f"accelerate config: {engine.lower()} needs GPUs; on CPU use "
                              "accelerate_configs/multi_cpu_2.yaml (DDP over gloo)")


def check_job(job: Job, t: TrainingConfig) -> None:
    """Data the settings can't use: an empty training set, a micro-batch larger than it."""
    n_train = len(job.train_data)
    if n_train == 0:
        raise ConfigError("data: the training set is empty")
    if t.batch_size != "auto" and t.batch_size > n_train:
        raise ConfigError(f"training.batch_size: {t.batch_size} is larger than the {n_train} training samples")
    if t.sort_within_window and job.length_of is None:
        raise ConfigError("training.sort_within_window: this task gives no sample lengths (Job.length_of)")
    if t.max_tokens_per_micro_batch and job.length_of is None:
        raise ConfigError("training.max_tokens_per_micro_batch: this task gives no sample lengths (Job.length_of)")


def _has_device() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return torch.cuda.is_available() or bool(mps and mps.is_available()) or \
        bool(getattr(torch, "xpu", None) and torch.xpu.is_available())


def distributed_state() -> PartialState:
    """The process group Accelerate sets up from the launcher's environment. Without an accelerator we ask for the
    CPU explicitly: several processes then train with gloo DDP (``accelerate launch --multi_gpu`` or torchrun),
    which ``accelerate launch --cpu --num_processes 2`` does not give (it starts one process)."""
    state = PartialState(cpu=not _has_device())
    if state.num_processes > 1 and not _shutdown_registered:
        atexit.register(shutdown)
        _shutdown_registered.append(True)
    return state


_shutdown_registered: list = []


def shutdown() -> None:
    """Destroy the process group (local, no collective). Runs at exit of every multi-process run: a gloo group
    left alive while the interpreter finalizes can abort the process (SIGABRT) after training succeeded."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def resolve_accumulation(t: TrainingConfig, processes: int) -> int:
    """N from ``effective_batch_size`` when given (it must split exactly), else ``gradient_accumulation_steps``."""
    if t.batch_size == "auto":
        return 1  # decided at run time, see train()
    if t.effective_batch_size is None:
        return t.gradient_accumulation_steps
    per_step = t.batch_size * processes
    if t.effective_batch_size % per_step:
        raise ConfigError(
            f"training.effective_batch_size: {t.effective_batch_size} is not a multiple of batch_size × processes "
            f"= {t.batch_size} × {processes}; pick a batch_size that divides {t.effective_batch_size // processes}")
    return t.effective_batch_size // per_step


def total_optimizer_steps(n_train: int, t: TrainingConfig, accum: int, processes: int) -> int:
    """Optimizer steps the run will take: Σ over epochs of ceil(samples / (b·N·W)), capped by max_steps."""
    steps = t.epochs * windows_per_epoch(n_train, t.batch_size, accum, processes)
    return min(steps, t.max_steps) if t.max_steps else steps


def make_optimizer(params, t: TrainingConfig) -> torch.optim.Optimizer:
    """adamw / sgd / lion over the trainable ones of ``params`` (a module or an iterable of parameters); no weight
    decay on biases and norm weights (1-D)."""
    decay, no_decay = [], []
    for p in (params.parameters() if isinstance(params, torch.nn.Module) else params):
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": t.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if t.optimizer == "adamw":
        # The fused kernel (one pass over all parameters): torch's default on a CPU is a loop over the tensors,
        # ~6× slower for MiniLM's 22.7 M parameters. Not with fp16: the GradScaler then hands a fused optimizer its
        # inf check, and Accelerate could no longer tell a skipped step.
        fused = t.mixed_precision != "fp16" and all(p.is_floating_point() for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, lr=t.learning_rate, betas=tuple(t.betas), fused=fused or None)
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.learning_rate, momentum=t.momentum)
    from lion_pytorch import Lion

    return Lion(groups, lr=t.learning_rate, betas=tuple(t.betas))


@dataclass
class Optim:
    """One optimizer with its scheduler, parameters and clipping (a GAN has two; most jobs one, named "model")."""

    name: str
    optimizer: torch.optim.Optimizer
    scheduler: object
    params: list
    max_grad_norm: Optional[float]


def lr_scale(t: TrainingConfig, effective: int) -> float:
    """``training.scale_lr``: linear or square-root scaling of the lr from the baseline's batch to this run's."""
    if t.scale_lr == "none":
        return 1.0
    ratio = effective / t.reference_batch_size
    return ratio if t.scale_lr == "linear" else math.sqrt(ratio)


def make_optims(model: torch.nn.Module, job: Job, t: TrainingConfig, total_steps: int, lr_scale: float = 1.0) -> list:
    """One Optim per ``job.param_groups`` entry (name → {"params": …, TrainingConfig overrides}), else one over the
    whole model, at ``lr_scale`` × their learning rates. Schedulers come from ``transformers.get_scheduler``, sized
    in optimizer steps."""
    from transformers import get_scheduler

    groups = job.param_groups or {"model": {"params": model.parameters()}}
    optims = []
    for name, spec in groups.items():
        tg = dataclasses.replace(t, **{k: v for k, v in spec.items() if k != "params"})
        tg = dataclasses.replace(tg, learning_rate=tg.learning_rate * lr_scale)
        params = [p for p in spec["params"] if p.requires_grad]
        optimizer = make_optimizer(params, tg)
        scheduler = get_scheduler(tg.lr_scheduler, optimizer, num_warmup_steps=tg.warmup_steps,
                                  num_training_steps=total_steps)
        optims.append(Optim(name, optimizer, scheduler, params, tg.max_grad_norm))
    return optims


def enable_checkpointing(model: torch.nn.Module, hook=None) -> None:
    """Activation checkpointing: the task's hook, else the HF API (new name first), else a ConfigError."""
    if hook is not None:
        hook(model)
    elif hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ConfigError("training.gradient_checkpointing: this model has no checkpointing support "
                          "(give the task an enable_checkpointing hook)")
    # LoRA / frozen embeddings: checkpointed blocks need an input that requires grad to rebuild the graph.
    if hasattr(model, "enable_input_require_grads") and any(not p.requires_grad for p in model.parameters()):
        model.enable_input_require_grads()


def loss_weight(items: int, window_items: int, accelerator: Accelerator) -> float:
    """Factor for one micro-batch's mean loss so that a window's accumulated gradient is the gradient of the mean
    loss over all the window's items (every process, every micro-batch).

    * ``items / window_items`` — the micro-batch's share. Accelerate instead divides every loss by N in
      ``accelerator.backward``, which is right only for N equal micro-batches: a short tail window (k < N) or a
      short micro-batch is then mis-weighted.
    * ``× divisor`` — undoes that ÷N (this is the one place we correct it). Accelerate divides by its
      ``gradient_accumulation_steps``, which the loop sets to each window's micro-step count; DeepSpeed's engine
      divides by the value in its own config instead.
    * ``× num_processes`` — DDP / FSDP average gradients over processes; the window needs their sum.
    """
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        divisor = accelerator.deepspeed_engine_wrapped.engine.gradient_accumulation_steps()
    else:
        divisor = accelerator.gradient_accumulation_steps
    return items / window_items * divisor * accelerator.num_processes


def token_counts(batch) -> tuple:
    """(real, padded) tokens of a text micro-batch from its attention mask; (0, 0) for other batches."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor):
        return 0, 0
    return int(mask.sum()), mask.numel()


def compute_loss(model, batch, loss_fn):
    """Run the model; return (mean loss, dict of extra scalars to log, outputs)."""
    out = loss_fn(model, batch) if loss_fn is not None else model(**batch)
    if isinstance(out, torch.Tensor):
        return out, {}, None
    loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None:
        raise ValueError("the model returned no loss: pass labels in the batch, or give a loss_fn")
    # other 0-d tensors of a dict output (loss terms such as "kl" or "d_loss") are logged beside the loss
    extras = {k: v for k, v in out.items() if k != "loss" and isinstance(v, torch.Tensor) and v.dim() == 0} \
        if isinstance(out, dict) else {}
    return loss, extras, out


# ---------------------------------------------------------------------------------------------------------------
# the loop


def train(job: Job, t: TrainingConfig, output_dir: Optional[str] = None, accelerator: Optional[Accelerator] = None,
          tracker_config: Optional[dict] = None, log_with=None, print_banner: bool = True,
          save_every: Optional[int] = None, keep_checkpoints: int = 2, resume_from=None,
          config_text: str = "", on_eval=None) -> dict:
    """Train ``job`` with the settings in ``t``; write ``history.jsonl`` under ``output_dir`` when given.

    ``save_every`` (optimizer steps) writes a checkpoint under ``output_dir/checkpoints`` every K steps and at the
    end, keeping the last ``keep_checkpoints``; ``resume_from`` (a checkpoint directory) continues that run at
    its next window with the same sample order and random state. ``on_eval(record)`` is called after every
    evaluation (a hyper-parameter search prunes there).

    Returns a dict with the histories, counts and the trained (unwrapped) model — see ``finetune.api``.
    """
    from finetune import checkpoint

    out_dir = Path(output_dir) if output_dir else None
    auto_batch = t.batch_size == "auto"
    if auto_batch:  # start from the largest candidate: the whole per-process window in one micro-batch
        processes = accelerator.num_processes if accelerator is not None else distributed_state().num_processes
        if processes > 1:
            raise ConfigError("training.batch_size: auto runs on one process (an out-of-memory error on one rank "
                              "would leave the others waiting); give a number with several processes")
        t = dataclasses.replace(t, batch_size=t.effective_batch_size, gradient_accumulation_steps=1)
    if accelerator is None:
        processes = distributed_state().num_processes
        accelerator = make_accelerator(t, resolve_accumulation(t, processes), log_with=log_with,
                                       project_dir=str(out_dir) if out_dir else None)
    world, accum = accelerator.num_processes, accelerator.gradient_accumulation_steps
    if t.effective_batch_size is not None and resolve_accumulation(t, world) != accum:
        raise ConfigError(f"training.effective_batch_size: {t.effective_batch_size} needs N = "
                          f"{resolve_accumulation(t, world)} with {world} processes, the Accelerator has {accum}")
    check_job(job, t)
    n_train = len(job.train_data)
    state = TrainState()
    total_steps = total_optimizer_steps(n_train, t, accum, world)
    effective = t.batch_size * accum * world
    torch.backends.cudnn.benchmark = t.cudnn_benchmark

    model = job.model
    model.train()  # from_pretrained returns a model in eval mode: dropout would silently stay off
    if t.gradient_checkpointing:
        enable_checkpointing(model, job.enable_checkpointing)
    # Schedulers are not passed to accelerator.prepare: a prepared scheduler steps num_processes times per
    # optimizer step (Accelerate assumes each process's dataloader shrank by W). Our windows already span every
    # process, so each raw scheduler is stepped exactly once per optimizer step.
    optims = make_optims(model, job, t, total_steps, lr_scale(t, effective))
    model, *prepared = accelerator.prepare(model, *[o.optimizer for o in optims])
    for o, p in zip(optims, prepared):
        o.optimizer = p
    forward_model = torch.compile(model, mode=t.compile_mode) if t.compile else model
    causal = is_causal_lm(model)
    counter = job.count_items or (lambda b: count_items(b, t.items, causal))
    schedulers = {o.name: o.scheduler for o in optims}
    if resume_from is not None:
        state = checkpoint.load_checkpoint(accelerator, resume_from, schedulers)

    if accelerator.is_main_process and print_banner:
        print(banner(n_train, t, accum, world, total_steps, accelerator), flush=True)
    if log_with is not None:
        accelerator.init_trackers("finetune", config={
            **_scalars(tracker_config or {}), "config/effective_batch_size": effective,
            "config/gradient_accumulation_steps": accum, "config/physical_batch_size": t.batch_size})

    if job.val_data is not None and t.eval_at_start and state.optimizer_step == 0 and not state.val_history:
        run_eval(job, forward_model, accelerator, t, state, log_with)  # the untuned model, for before/after
    monitor = MemoryMonitor(accelerator.device)
    with RunLog(accelerator, out_dir, state, total_steps, effective, log_with, rewrite=resume_from is not None) as log:
        windows = iterate_windows(job, t, accelerator, state, accum)
        while state.optimizer_step < total_steps:
            window, micro_batches, epoch_windows = next(windows, (None, None, None))
            if window is None:
                break
            if job.before_window is not None:  # e.g. a KL weight or an R1 interval keyed on optimizer steps
                job.before_window(state)
            rng = torch.get_rng_state()
            try:
                window_items, real_tokens, padded_tokens, window_loss, window_extras = accumulate_window(
                    accelerator, model, forward_model, job, window, micro_batches, counter, state)
            except Exception as error:
                if not (auto_batch and is_oom(error)):
                    raise
                # batch_size: auto — retry the same window split into smaller micro-batches: its samples, and
                # so the step, do not change.
                accelerator.unwrap_model(model).zero_grad(set_to_none=True)
                del micro_batches, error
                free_memory()
                torch.set_rng_state(rng)
                smaller = smaller_micro_batch(t.batch_size, effective // world)
                if smaller == 0:
                    raise ConfigError("training.batch_size: auto found no micro-batch that fits (1 sample does not)")
                if accelerator.is_main_process:
                    tqdm.write(f"out of memory at micro-batch {t.batch_size}: window {window.index} again with "
                               f"{smaller} × {effective // world // smaller}")
                t = dataclasses.replace(t, batch_size=smaller)
                accum = effective // world // smaller
                windows = iterate_windows(job, t, accelerator, state, accum)
                continue

            norms, skipped, lrs = optimizer_step(accelerator, optims, t, state, window)
            # the logged loss and its terms: one all-reduce and one host sync for all of them
            logged = torch.stack([window_loss, *window_extras.values()])
            logged = (accelerator.reduce(logged, "sum") if world > 1 else logged).tolist()
            window_loss, window_extras = logged[0], dict(zip(window_extras, logged[1:]))
            log.step({
                "step": state.optimizer_step, "epoch": window.epoch, "window": window.index,
                "items": window_items, "samples": len(window.samples),
                "micro_batches": window.total_micro_batches,
                **({"tokens": real_tokens, "padded_tokens": padded_tokens} if padded_tokens else {}),
                "loss": window_loss, "lr": lrs[0], "grad_norm": norms[0], "skipped": skipped,
                "window_hash": window.sample_hash, **window_extras,
                **{f"{key}_{o.name}": v[i] for i, o in enumerate(optims) if i
                   for key, v in (("lr", lrs), ("grad_norm", norms))},
                "micro_batch_size": t.batch_size, **monitor.sample(),
            }, window, t.ema_beta)

            if job.after_step is not None:
                job.after_step(state, accelerator.unwrap_model(model))
            # After the step: close the epoch, evaluate, checkpoint — in this order, so that a checkpoint holds
            # everything up to it and a resumed run repeats nothing.
            done = state.optimizer_step >= total_steps
            epoch_end = window.index == epoch_windows - 1
            if epoch_end:
                state.epoch, state.window = state.epoch + 1, 0
            if job.val_data is not None and (
                    done or (t.eval_every and state.optimizer_step % t.eval_every == 0)
                    or (epoch_end and not t.eval_every)):
                val = run_eval(job, forward_model, accelerator, t, state, log_with)
                state.history[-1].update({f"val_{k}": v for k, v in val.items() if k not in ("step", "epoch")})
                if on_eval is not None:
                    on_eval(val)
            if save_every and out_dir is not None and (done or state.optimizer_step % save_every == 0):
                checkpoint.save_checkpoint(accelerator, state, out_dir, schedulers, config_text, keep_checkpoints,
                                           meta={"effective_batch_size": effective})
            log.flush()
            if done:
                break
    if log_with is not None:  # not accelerator.end_training(): it also tears down the process group
        for tracker in accelerator.trackers:
            tracker.finish()

    history = state.history
    final = state.val_history[-1] if state.val_history else None
    return {
        "grad_norm_history": [h["grad_norm"] for h in history],
        "loss_history": [h["loss"] for h in history],
        "lr_history": [h["lr"] for h in history],
        "val_history": state.val_history,
        "history": history,
        "optimizer_steps": state.optimizer_step,
        "skipped_steps": sum(h["skipped"] for h in history),
        "micro_batches": sum(h["micro_batches"] for h in history),
        "tokens": sum(h.get("tokens", 0) for h in history),
        "padded_tokens": sum(h.get("padded_tokens", 0) for h in history),
        "effective_batch_size": effective,
        "gradient_accumulation_steps": accum,
        "total_steps": total_steps,
        "final_loss": final["loss"] if final else (history[-1]["loss"] if history else float("nan")),
        "final_metrics": final or {},
        "model": accelerator.unwrap_model(model),
        "accelerator": accelerator,
        "state": state,
    }


def _scalars(config: dict, prefix: str = "") -> dict:
    """Flatten a nested config into ``section/key`` scalars (trackers such as TensorBoard take nothing else)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_scalars(value, f"{prefix}{key}/"))
        else:
            out[prefix + key] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


def accumulate_window(accelerator, model, forward_model, job: Job, window, micro_batches, counter, state):
    """Forward and backward every micro-batch of one window, each weighted by its share of the window's items.

    Returns (window items, real tokens, padded tokens, window loss, extra loss terms) — the counts over every
    process, the losses of this process (summed over processes by the caller).
    """
    # The window's item count, over every process, before its first backward (one all-reduce, which also carries
    # the real and padded token counts for the history).
    counts = [counter(b) if active else 0 for b, active in zip(micro_batches, window.active)]
    tokens = [token_counts(b) if active else (0, 0) for b, active in zip(micro_batches, window.active)]
    totals = [sum(counts), sum(r for r, _ in tokens), sum(p for _, p in tokens)]
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(torch.tensor(totals, device=accelerator.device), "sum").tolist()
    window_items, real_tokens, padded_tokens = (int(x) for x in totals)
    # Accelerate syncs gradients (and divides losses) by its gradient_accumulation_steps: make that this window's
    # micro-step count, so accumulate() all-reduces on its last micro-batch even when the window is short (k < N)
    # or cut by a token budget (k ≠ N).
    accelerator.gradient_accumulation_steps = len(micro_batches)
    accelerator.step = 0
    window_loss, window_extras = torch.zeros((), device=accelerator.device), {}
    for batch, items in zip(micro_batches, counts):
        fake_oom_check(batch_len(batch))  # test hook (FINETUNE_FAKE_OOM_ABOVE); a no-op otherwise
        with accelerator.accumulate(model):
            # The outputs (a language model's logits) are not kept: held, they would stay allocated through this
            # backward and the next micro-batch's forward.
            loss, extras = compute_loss(forward_model, send_to_device(batch, accelerator.device), job.loss_fn)[:2]
            # A weight-0 placeholder (or an item-less micro-batch) must add exact zeros, not 0 × NaN.
            accelerator.backward(loss * loss_weight(items, window_items, accelerator) if items
                                 else torch.nan_to_num(loss, 0.0, 0.0, 0.0) * 0.0)
        state.micro_step += 1
        # the logged loss: the same item-weighted mean, without Accelerate's factors. Every term is entered even
        # from a placeholder (as 0), so that each process sums the same terms over processes.
        for k in extras:
            window_extras.setdefault(k, torch.zeros((), device=accelerator.device))
        if items:
            window_loss += loss.detach().float() * (items / window_items)
            for k, v in extras.items():
                window_extras[k] += v.detach().float() * (items / window_items)
    return window_items, real_tokens, padded_tokens, window_loss, window_extras


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def iterate_windows(job: Job, t: TrainingConfig, accelerator, state: TrainState, accum: int):
    """Yield (window, its micro-batches for this process, windows in the epoch) from ``state.epoch`` /
    ``state.window`` on; each window's micro-batches are collated ahead (prefetched) so they can be counted."""
    world, rank = accelerator.num_processes, accelerator.process_index
    while state.epoch < t.epochs:
        epoch = state.epoch
        sort = t.sort_within_window if t.sort_within_window is not None else job.length_of is not None
        windows = plan_epoch(len(job.train_data), t.batch_size, accum, world, rank, t.seed, epoch, t.shuffle,
                             sort_key=job.length_of if sort else None, length_of=job.length_of,
                             max_tokens=t.max_tokens_per_micro_batch)
        todo = windows[state.window:]
        # The loader gets its own generator: iter() would otherwise draw a seed from the global RNG, and a run
        # resumed mid-epoch would then see different dropout masks than the uninterrupted one.
        loader = DataLoader(job.train_data, batch_sampler=WindowSampler(todo), collate_fn=job.collate_fn,
                            num_workers=t.num_workers, pin_memory=accelerator.device.type == "cuda",
                            generator=torch.Generator().manual_seed(t.seed + epoch))
        batches = iter(loader)
        for window in todo:
            yield window, [next(batches) for _ in window.micro_batches], len(windows)
        if state.epoch == epoch:  # the caller stopped early
            return


class RunLog:
    """Where each optimizer step is reported, on the main process only: ``history.jsonl`` (one line per step,
    flushed), the trackers, and the progress bar (effective batch, EMA loss, lr, ETA)."""

    def __init__(self, accelerator, out_dir, state: TrainState, total_steps: int, effective: int, log_with,
                 rewrite: bool = False):
        self.accelerator, self.state, self.effective, self.log_with = accelerator, state, effective, log_with
        self.main = accelerator.is_main_process
        self.file = None
        if self.main and out_dir is not None:
            from finetune.checkpoint import atomic_write_text

            out_dir.mkdir(parents=True, exist_ok=True)
            if rewrite:  # resuming: drop lines a killed run wrote after its last checkpoint
                atomic_write_text(out_dir / "history.jsonl", "".join(json.dumps(h) + "\n" for h in state.history))
            self.file = open(out_dir / "history.jsonl", "a")
        self.bar = tqdm(total=total_steps, initial=state.optimizer_step, disable=not self.main, unit="step",
                        dynamic_ncols=True, desc=f"train (batch {effective})",
                        mininterval=0.5 if sys.stderr.isatty() else 15)
        self.last = time.perf_counter()
        self.real = self.padded = 0

    def step(self, record: dict, window, ema_beta: float) -> None:
        now = time.perf_counter()
        record["seconds"] = round(now - self.last, 6)
        self.last = now
        state = self.state
        state.items += record["items"]
        state.samples += record["samples"]
        state.window = window.index + 1
        state.history.append(record)
        ema = state.update_ema(record["loss"], ema_beta)
        if self.log_with is not None:
            self.accelerator.log({f"train/{k}": record[k] for k in ("loss", "lr", "grad_norm")},
                                 step=state.optimizer_step)
        self.real += record.get("tokens", 0)
        self.padded += record.get("padded_tokens", 0)
        pad = f" pad_eff={self.real / self.padded:.0%}" if self.padded else ""
        self.bar.update(1)
        self.bar.set_postfix_str(f"eff_batch={self.effective} loss={ema:.4f} lr={record['lr']:.2e}{pad}",
                                 refresh=False)

    def flush(self) -> None:
        """Write the step's line (after its evaluation, whose results it carries as val_*)."""
        if self.file is not None:
            self.file.write(json.dumps(self.state.history[-1]) + "\n")
            self.file.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()  # also on an error, so its message starts on a line of its own
        if self.file is not None:
            self.file.close()


def optimizer_step(accelerator, optims: list, t: TrainingConfig, state: TrainState, window):
    """Unscale → grad norm → clip → step → scheduler → zero_grad, for each optimizer.

    Returns (total grad norm before clipping per optimizer, whether the update was skipped, lr per optimizer).
    """
    norms = []
    for i, o in enumerate(optims):
        # clip_grad_norm_ unscales fp16 gradients first (GradScaler.unscale_, for every optimizer at once), so the
        # norm and the clip are in true units; with clipping off, max_norm=inf still returns the total norm and
        # leaves the gradients untouched.
        max_norm = o.max_grad_norm if o.max_grad_norm is not None else math.inf
        clip = accelerator.clip_grad_norm_ if i == 0 else torch.nn.utils.clip_grad_norm_
        norm = clip(o.params, max_norm)
        norms.append(norm if norm is not None else torch.tensor(float("nan")))
    norms = torch.stack([torch.as_tensor(n, dtype=torch.float32).cpu() for n in norms]).tolist()  # one host sync
    lrs = [o.optimizer.param_groups[0]["lr"] for o in optims]
    if accelerator.scaler is not None:
        for o in optims:
            o.optimizer.step()  # GradScaler skips the update on inf/NaN gradients and lowers the scale
        skipped = any(bool(o.optimizer.step_was_skipped) for o in optims)
    elif all(math.isfinite(n) for n in norms):
        for o in optims:
            o.optimizer.step()
        skipped = False
    elif t.on_nonfinite == "skip":
        skipped = True
    else:
        bad = ", ".join(f"{o.name} {n}" for o, n in zip(optims, norms) if not math.isfinite(n))
        raise NonFiniteError(
            f"non-finite gradient (norm {bad if len(optims) > 1 else norms[0]}) at optimizer step "
            f"{state.optimizer_step + 1} (epoch {window.epoch}, window {window.index}); set "
            "training.on_nonfinite=skip to drop such windows")
    for o in optims:
        if not skipped:  # a skipped update is not a step of the schedule
            o.scheduler.step()
        o.optimizer.zero_grad(set_to_none=True)
    state.optimizer_step += 1
    return norms, skipped, lrs


@torch.no_grad()
def run_eval(job: Job, model, accelerator: Accelerator, t: TrainingConfig, state: TrainState, log_with=None) -> dict:
    """Item-weighted validation loss over the whole validation set (sharded over processes, no sample repeated),
    plus the task's metrics. Appends to ``state.val_history`` and returns the record."""
    from accelerate.utils import gather_object

    world, rank = accelerator.num_processes, accelerator.process_index
    indices = list(range(rank, len(job.val_data), world))
    loader = DataLoader(job.val_data, batch_sampler=[indices[i:i + t.batch_size]
                                                     for i in range(0, len(indices), t.batch_size)],
                        collate_fn=job.collate_fn, num_workers=t.num_workers)
    counter = job.count_items or (lambda b: count_items(b, t.items, is_causal_lm(model)))
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    items_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    preds, refs = [], []
    for batch in loader:
        items = counter(batch)
        batch = send_to_device(batch, accelerator.device)
        loss, _, outputs = compute_loss(model, batch, job.loss_fn)
        if items:
            loss_sum += loss.double() * items
            items_sum += items
        if job.eval_step is not None:
            p, r = job.eval_step(model, batch, outputs)
            preds += list(p)
            refs += list(r)
    model.train(was_training)
    if world > 1:
        loss_sum = accelerator.reduce(loss_sum, "sum")
        items_sum = accelerator.reduce(items_sum, "sum")
        preds, refs = gather_object(preds), gather_object(refs)
    epoch = state.history[-1]["epoch"] if state.history else state.epoch
    record = {"step": state.optimizer_step, "epoch": epoch,
              "loss": float(loss_sum / items_sum) if float(items_sum) else float("nan")}
    if job.val_loss_metrics is not None:  # e.g. perplexity = exp(loss)
        record.update(job.val_loss_metrics(record["loss"]))
    if job.compute_metrics is not None and preds:
        record.update(job.compute_metrics(preds, refs))
    state.val_history.append(record)
    if accelerator.is_main_process:
        tqdm.write("eval " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in record.items()))
    if log_with is not None:
        accelerator.log({f"eval/{k}": v for k, v in record.items() if k not in ("step", "epoch")},
                        step=state.optimizer_step)
    return record


def banner(n_train: int, t: TrainingConfig, accum: int, world: int, total_steps: int, accelerator) -> str:
    per_epoch = windows_per_epoch(n_train, t.batch_size, accum, world)
    effective = t.batch_size * accum * world
    split = f"{t.batch_size} × {accum}" + (f" × {world} processes" if world > 1 else "")
    tail = n_train - (per_epoch - 1) * effective
    tail_text = "every window is full" if tail == effective else \
        f"the last window of each epoch holds {tail} sample{'s' if tail > 1 else ''}"
    lines = [
        "=" * 60, "FINE-TUNING", "=" * 60,
        f"Training samples: {n_train}",
        f"Batch size: {t.batch_size}",
        f"Gradient accumulation steps: {accum}",
        f"Processes: {world}",
        f"Effective batch size: {t.batch_size * accum * world} ({split})",
        f"Optimizer steps: {total_steps} ({per_epoch} per epoch; {tail_text})",
        f"Optimizer: {t.optimizer}, lr {t.learning_rate * lr_scale(t, effective):g}, schedule {t.lr_scheduler}, "
        f"warm-up {t.warmup_steps} steps",
        *([f"LR scaling: {t.scale_lr} from the baseline's batch {t.reference_batch_size} to {effective}: "
           f"{t.learning_rate:g} × {lr_scale(t, effective):.4g}"] if t.scale_lr != "none" else []),
        f"Mixed precision: {t.mixed_precision}, device: {accelerator.device}",
        "=" * 60,
    ]
    return "\n".join(lines)
