"""The shared training loop: set up → per window: accumulate → optimizer step → record → advance → finish.

Every optimizer step is the step the baseline took with one batch of ``micro_batch × N × processes`` samples:

* a window holds exactly the baseline batch's samples (``windows.py``), the epoch's last window included;
* its item count (samples, or label tokens) is known before the first backward, summed over processes;
* each micro-batch's mean loss is weighted by its share of those items (``steps.loss_weight``), so the accumulated
  gradient is the gradient of the mean loss over the whole window — whatever the tail, the micro-batch size or N;
* gradients are all-reduced once per window, on its last micro-batch (``accelerator.no_sync`` on the others);
* unscale (fp16) → grad norm → clip → step → scheduler, once per optimizer step (``steps.optimizer_step``).

``train()`` reads top to bottom. The state of the run (``TrainState``) has one writer, ``advance()``: each step's
record is built whole (its evaluation and its time included) and handed to it; everything else only reads the
state. ``RunLog`` only writes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from accelerate import Accelerator

from finetune import checkpoint, distributed
from finetune.config import Cadence, TrainingConfig
from finetune.content import content_hash
from finetune.evaluation import report, run_eval
from finetune.job import Job
from finetune.memory.auto_batch import AutoBatch
from finetune.memory.measure import MemoryMonitor, is_oom
from finetune.optim import Optim
from finetune.runlog import RunLog
from finetune.shape import Shape
from finetune.state import TrainState
from finetune.steps import (
    Backward,
    Update,
    WindowResult,
    accumulate_window,
    optimizer_step,
    pad_to_window,
)
from finetune.windows import WindowSpec, stream_windows


@dataclass(frozen=True)
class Reporting:
    """What a run writes and whom it tells; the default writes nothing. ``finetune.startup`` fills it from the
    recipe's output section."""

    dir: Optional[Path] = None              # history.jsonl and checkpoints/ (and the trackers' files)
    save_every: Optional[int] = None        # optimizer steps between checkpoints (and one at the end)
    keep_checkpoints: int = 2
    tracker: Optional[str] = None           # an Accelerate tracker: tensorboard, wandb, mlflow
    settings: Optional[dict] = None         # the run's settings: what the trackers record, each checkpoint's config
    banner: bool = True                     # say what the run will do before the first step (main process)
    on_eval: Optional[Callable] = None      # called with every evaluation's record (a search prunes there)

    def __post_init__(self):
        if self.dir is not None:  # a str from the Python API
            object.__setattr__(self, "dir", Path(self.dir))


@dataclass(frozen=True)
class Run:
    """What start-up assembles for one training run (``finetune.startup.assemble``); the loop only reads it
    (``batch_size: auto`` replaces it by one with a smaller micro-batch)."""

    job: Job
    training: TrainingConfig
    shape: Shape
    reporting: Reporting
    accelerator: Accelerator
    model: torch.nn.Module            # prepared (DDP-wrapped with several processes)
    forward_model: torch.nn.Module    # the model the forward goes through (compiled, or the prepared one)
    optims: list[Optim]
    counter: Callable                 # micro-batch → items its mean loss averages over
    monitor: MemoryMonitor
    auto: Optional[AutoBatch]         # batch_size: auto — a smaller micro-batch after an out-of-memory error
    window_spec: WindowSpec           # how the samples become windows (the stream, the banner)
    checkpointer: checkpoint.Checkpointer  # what its checkpoints hold; it saves, loads, and knows when
    packing_note: str                 # what the banner says about packing
    head_note: str                    # what the banner says about the loss head
    pad_to_window: bool = False       # pad each micro-batch to its window's longest sample (bf16 / fp16)
    divisor: Optional[Callable] = None  # micro-batch → its part of what the window's loss is divided by (None: items)
    scaler: Optional[object] = None   # fp16's loss scale: Accelerate's GradScaler, or finetune's on a CPU
    dropout_keys: Optional[object] = None  # dropout keyed by sample (models.dropout.SampleKeys), set per micro-batch

    @property
    def schedulers(self) -> dict:
        return {o.name: o.scheduler for o in self.optims}


@dataclass
class TrainResult:
    """What a run did. Also readable as a dict (``result["loss_history"]``), as ``test_fine_tuning`` documents."""

    model: torch.nn.Module            # trained in place, unwrapped
    accelerator: Accelerator
    state: TrainState
    effective_batch_size: int
    gradient_accumulation_steps: int
    total_steps: int
    train_samples: int = 0            # the training set's size (a baseline's windows are recomputed over it)
    val_samples: int = 0              # the held-out set's size: what the evaluation numbers rest on
    extra_metrics: dict = field(default_factory=dict)  # added by the caller (train time, a generated sample, …)

    history = property(lambda self: self.state.history)
    val_history = property(lambda self: self.state.val_history)
    optimizer_steps = property(lambda self: self.state.optimizer_step)
    loss_history = property(lambda self: [h["loss"] for h in self.history])
    lr_history = property(lambda self: [h["lr"] for h in self.history])
    grad_norm_history = property(lambda self: [h["grad_norm"] for h in self.history])
    skipped_steps = property(lambda self: sum(h["skipped"] for h in self.history))
    micro_batches = property(lambda self: sum(h["micro_batches"] for h in self.history))
    tokens = property(lambda self: sum(h.get("tokens", 0) for h in self.history))
    padded_tokens = property(lambda self: sum(h.get("padded_tokens", 0) for h in self.history))
    final_metrics = property(lambda self: self.val_history[-1] if self.val_history else {})

    @property
    def final_loss(self) -> float:
        """The last validation loss, else the last window's loss."""
        if self.val_history:
            return self.val_history[-1]["loss"]
        return self.history[-1]["loss"] if self.history else float("nan")

    def __getitem__(self, key):
        return getattr(self, key)

    def __setitem__(self, key, value):
        setattr(self, key, value)

    def __contains__(self, key) -> bool:
        return hasattr(self, key)

    def get(self, key, default=None):
        return getattr(self, key, default)


# ---------------------------------------------------------------------------------------------------------------
# the loop


def train(run: Run, saved: Optional[checkpoint.Saved] = None) -> TrainResult:
    """Train the run start-up assembled (``finetune.startup``: its job, settings, shape, prepared model and
    optimizers, windows and checkpointer) to its last optimizer step; ``saved``: a checkpoint (``checkpoint.read``)
    the run continues at its next window, with the same sample order and random state."""
    job, t = run.job, run.training
    # its Accelerate hooks, removed when the run ends, error or not; fp16 on a CPU in kernels of any micro-batch;
    # Accelerate's per-step question of an installed package asked once
    with run.checkpointer.hooked(run.accelerator), distributed.fp16_kernels(run.accelerator, run.scaler), \
            distributed.lomo_asked_once():
        state = start_state(run, saved)
        with RunLog(run.accelerator, run.reporting.dir, state, run.shape.total_steps, run.shape.effective,
                    run.reporting.tracker, rewrite=saved is not None) as log:
            stream = open_stream(run, state)
            backward = Backward(run.accelerator, run.model, run.forward_model, job.loss_fn, run.counter,
                                offload=t.activation_offloading, divisor=run.divisor, scaler=run.scaler,
                                dropout_keys=run.dropout_keys)
            while state.optimizer_step < run.shape.total_steps:
                window, micro_batches, epoch_windows, held = next(stream, (None,) * 4)
                if window is None:
                    break
                if job.before_window is not None:  # e.g. a KL weight or an R1 interval keyed on optimizer steps
                    job.before_window(state)
                rng = torch.get_rng_state()  # an out-of-memory retry rewinds to it: the same dropout masks
                if run.pad_to_window:  # bf16: every sample at the big batch's (or its baseline's) padded length
                    micro_batches = pad_to_window(run.accelerator, micro_batches, window.pad_lengths)
                try:
                    result = accumulate_window(backward, window, micro_batches)
                except Exception as error:  # batch_size: auto out of memory → the same window, smaller micro-batches
                    if run.auto is None or not is_oom(error):
                        raise
                    smaller = run.auto.shrink(run.shape, window, rng)
                    run = dataclasses.replace(run, shape=smaller,
                                              window_spec=run.window_spec.with_micro_batch(smaller))
                    stream = open_stream(run, state)
                    continue
                update = optimizer_step(run.accelerator, run.optims, t.on_nonfinite, state.optimizer_step + 1,
                                        window, run.scaler)
                record = step_record(run, state, window, result, update, held)
                val = evaluate_if_due(run, record, last_of_epoch=window.index == epoch_windows - 1)
                record = {**record, **val_columns(val), "seconds": log.lap()}  # whole before it is stored
                advance(state, record, val, window, epoch_windows, result.micro_steps, t.ema_beta)
                after_step(run, state)
                log.write(record)
    return finish(run, state)


# ---------------------------------------------------------------------------------------------------------------
# the run's start


def start_state(run: Run, saved: Optional[checkpoint.Saved]) -> TrainState:
    """The state the run starts from: the checkpoint's (its model, optimizers and random state restored with it),
    or a fresh one — holding the untuned model's evaluation with ``training.eval_at_start``."""
    if saved is not None:
        return run.checkpointer.load(run.accelerator, saved, run.schedulers)
    if run.job.val_data is not None and run.training.eval_at_start:
        return TrainState(val_history=[evaluate(run, step=0, epoch=0)])
    return TrainState()


def open_stream(run: Run, state: TrainState):
    """The windows from where the state stands (its epoch and next window) to the end of training."""
    a = run.accelerator
    return stream_windows(run.job, run.window_spec, a.process_index, state.epoch, state.next_window,
                          pin_memory=a.device.type == "cuda", num_workers=run.training.num_workers)


# ---------------------------------------------------------------------------------------------------------------
# per window


def step_record(run: Run, state: TrainState, window, result: WindowResult, update: Update, held) -> dict:
    """The history line of one optimizer step. The logged loss and its terms are summed over processes with one
    all-reduce and read with one host sync; so is what each process's part of the window held (``held``)."""
    logged = torch.stack([result.loss, *result.extras.values()])
    logged = (run.accelerator.reduce(logged, "sum") if run.shape.processes > 1 else logged).tolist()
    if run.shape.processes > 1:  # int64 lane sums: exact, and equal to one process's sum of the whole window
        held = run.accelerator.reduce(torch.tensor(held, device=run.accelerator.device), "sum").tolist()
    return {
        "step": state.optimizer_step + 1, "epoch": window.epoch, "window": window.index,
        "items": result.items, "samples": len(window.samples), "micro_batches": window.total_micro_batches,
        **(token_columns(state.history, result) if result.padded_tokens else {}),
        "loss": logged[0], "lr": update.lrs[0], "grad_norm": update.norms[0], "skipped": update.skipped,
        **({"loss_scale": update.loss_scale} if update.loss_scale is not None else {}),
        "window_hash": window.sample_hash, "content_hash": content_hash(held), **dict(zip(result.extras, logged[1:])),
        **{f"{key}_{o.name}": v[i] for i, o in enumerate(run.optims) if i
           for key, v in (("lr", update.lrs), ("grad_norm", update.norms))},
        "micro_batch_size": run.shape.micro_batch, **run.monitor.sample(),
    }


def token_columns(history: list, result: WindowResult) -> dict:
    """The window's real and padded tokens, over every process, and both summed over the run so far: TRL's
    ``num_tokens`` (each micro-batch's ``attention_mask`` summed, gathered over processes, cumulative) and the
    Trainer's ``num_input_tokens_seen`` (``non_padding``: the same; ``all``: the padded tokens). Counted from the
    host's masks and summed over processes in the window's one count all-reduce (``steps.count_window``): no sync of
    their own. A run resumed from a checkpoint written before the sums were kept adds up its history's windows."""
    seen = {}
    for key, window in (("tokens_seen", result.real_tokens), ("padded_tokens_seen", result.padded_tokens)):
        per_window = key.removesuffix("_seen")
        before = history[-1].get(key) if history else 0
        if before is None:
            before = sum(h.get(per_window, 0) for h in history)
        seen[key] = before + window
    return {"tokens": result.real_tokens, "padded_tokens": result.padded_tokens, **seen}


def evaluate_if_due(run: Run, record: dict, last_of_epoch: bool) -> Optional[dict]:
    """The evaluation after the step of ``record``, when one is due: every ``eval_every`` steps (else at the end of
    each epoch) and after the last step."""
    step = record["step"]
    if run.job.val_data is not None and eval_due(run.training.cadence, step, run.shape.total_steps, last_of_epoch):
        return evaluate(run, step, record["epoch"])
    return None


def eval_due(c: Cadence, step: int, total_steps: int, last_of_epoch: bool) -> bool:
    """Whether optimizer step ``step`` (of ``total_steps``) is followed by an evaluation: every ``c.eval_every``
    steps (else at the end of each epoch) and after the last step."""
    return step >= total_steps or bool(c.eval_every and step % c.eval_every == 0) or \
        (last_of_epoch and not c.eval_every)


def val_columns(val: Optional[dict]) -> dict:
    """An evaluation's metrics as the step's history columns (``val_loss``, ``val_accuracy``, …)."""
    return {f"val_{k}": v for k, v in (val or {}).items() if k not in ("step", "epoch")}


def advance(state: TrainState, record: dict, val: Optional[dict], window, epoch_windows: int, micro_steps: int,
            ema_beta: float) -> None:
    """The one place the run's state moves: one optimizer step taken over ``window``, its ``record`` (whole: nothing
    is added to it once stored) and its evaluation ``val``, if any."""
    state.optimizer_step += 1
    state.micro_step += micro_steps
    state.items += record["items"]
    state.samples += record["samples"]
    state.history.append(record)
    if val is not None:
        state.val_history.append(val)
    state.update_ema(record["loss"], ema_beta)
    if window.index == epoch_windows - 1:
        state.epoch, state.next_window = window.epoch + 1, 0
    else:
        state.epoch, state.next_window = window.epoch, window.index + 1


def after_step(run: Run, state: TrainState) -> None:
    """The task's hook, then the checkpoint — in this order, so that a checkpoint holds everything up to it and a
    resumed run repeats nothing."""
    if run.job.after_step is not None:
        run.job.after_step(state, run.accelerator.unwrap_model(run.model))
    run.checkpointer.save_if_due(run.accelerator, state, run.schedulers, run.shape.total_steps)


def evaluate(run: Run, step: int, epoch: int) -> dict:
    """The validation record after optimizer step ``step`` (0: the untuned model), also handed to ``on_eval``."""
    metrics = run_eval(run.job, run.forward_model, run.accelerator, run.counter, run.shape.micro_batch,
                       run.training.num_workers)
    record = {"step": step, "epoch": epoch, **metrics}
    report(record, run.accelerator, run.reporting.tracker)
    if run.reporting.on_eval is not None:
        run.reporting.on_eval(record)
    return record


# ---------------------------------------------------------------------------------------------------------------
# finish


def finish(run: Run, state: TrainState) -> TrainResult:
    if run.reporting.tracker is not None:  # not accelerator.end_training(): it also tears down the process group
        for tracker in run.accelerator.trackers:
            tracker.finish()
    # only a run that succeeded waits here: no process leaves (closing its connections) while another still has a
    # collective in flight; a process that failed must not wait for the others
    distributed.wait_for_everyone()
    distributed.release_sharding(run.accelerator, run.model)
    return TrainResult(model=run.accelerator.unwrap_model(run.model), accelerator=run.accelerator, state=state,
                       effective_batch_size=run.shape.effective, gradient_accumulation_steps=run.shape.accumulation,
                       total_steps=run.shape.total_steps, train_samples=len(run.job.train_data),
                       val_samples=len(run.job.val_data) if run.job.val_data is not None else 0)
