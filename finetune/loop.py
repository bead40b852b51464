"""The shared training loop: set up → per window: accumulate → optimizer step → after the step → finish.

Every optimizer step is the step the baseline took with one batch of ``micro_batch × N × processes`` samples:

* a window holds exactly the baseline batch's samples (``windows.py``), the epoch's last window included;
* its item count (samples, or label tokens) is known before the first backward, summed over processes;
* each micro-batch's mean loss is weighted by its share of those items (``steps.loss_weight``), so the accumulated
  gradient is the gradient of the mean loss over the whole window — whatever the tail, the micro-batch size or N;
* gradients are all-reduced once per window, on its last micro-batch (``accelerator.no_sync`` on the others);
* unscale (fp16) → grad norm → clip → step → scheduler, once per optimizer step (``steps.optimizer_step``).

``train()`` reads top to bottom; the state of the run (``TrainState``) is advanced in one place, ``advance()``,
and everything else only reads it. ``RunLog`` only writes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from accelerate import Accelerator

from finetune import checkpoint, distributed, precision
from finetune.config import TrainingConfig, flatten
from finetune.errors import ConfigError
from finetune.evaluation import run_eval
from finetune.items import count_items, is_causal_lm
from finetune.job import Job
from finetune.memory import MemoryMonitor, free_memory, is_oom, smaller_micro_batch
from finetune.modeling import enable_checkpointing, enable_chunked_head
from finetune.optim import Optim, lr_scale, make_optims
from finetune.packing import decide_packing
from finetune.runlog import RunLog, banner
from finetune.state import TrainState
from finetune.steps import NonFiniteError, WindowResult, accumulate_window, optimizer_step  # noqa: F401
from finetune.windows import resolve_accumulation, stream_windows, total_optimizer_steps


@dataclass
class Run:
    """What set-up builds for one training run. The loop reads it; only ``state`` (in ``advance``) and, with
    ``batch_size: auto``, ``t`` (in ``shrink_micro_batch``) change."""

    job: Job
    t: TrainingConfig
    accelerator: Accelerator
    model: torch.nn.Module            # prepared (DDP-wrapped with several processes)
    forward_model: torch.nn.Module    # the model the forward goes through (compiled, or the prepared one)
    optims: list[Optim]
    counter: Callable                 # micro-batch → items its mean loss averages over
    state: TrainState
    total_steps: int
    out_dir: Optional[Path] = None
    save_every: Optional[int] = None  # optimizer steps between checkpoints
    keep_checkpoints: int = 2
    config_text: str = ""
    log_with: Optional[str] = None
    on_eval: Optional[Callable] = None
    monitor: Optional[MemoryMonitor] = None
    pack_capacity: Optional[int] = None  # tokens per packed row; None: windows are not packed
    pack_length_of: Optional[Callable] = None  # sample index → tokens, what packing packs by
    packing_note: str = ""            # what the banner says about packing
    head_note: str = ""               # what the banner says about the loss head
    auto_batch: bool = False          # batch_size: auto — shrink the micro-batch on out-of-memory

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def accum(self) -> int:
        return resolve_accumulation(self.t, self.world)

    @property
    def effective(self) -> int:
        return self.t.batch_size * self.accum * self.world

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


def train(job: Job, t: TrainingConfig, output_dir: Optional[str] = None, accelerator: Optional[Accelerator] = None,
          tracker_config: Optional[dict] = None, log_with=None, print_banner: bool = True,
          save_every: Optional[int] = None, keep_checkpoints: int = 2, resume_from=None,
          config_text: str = "", on_eval=None) -> TrainResult:
    """Train ``job`` with the settings in ``t``; write ``history.jsonl`` under ``output_dir`` when given.

    ``save_every`` (optimizer steps) writes a checkpoint under ``output_dir/checkpoints`` every K steps and at the
    end, keeping the last ``keep_checkpoints``; ``resume_from`` (a checkpoint directory) continues that run at
    its next window with the same sample order and random state. ``on_eval(record)`` is called after every
    evaluation (a hyper-parameter search prunes there).
    """
    run = setup(job, t, output_dir, accelerator, log_with, save_every, keep_checkpoints, resume_from, config_text,
                on_eval)
    if run.accelerator.is_main_process and print_banner:
        print(banner(run), flush=True)
    start_trackers(run, tracker_config)
    with RunLog(run.accelerator, run.out_dir, run.state, run.total_steps, run.effective, log_with,
                rewrite=resume_from is not None) as log:
        evaluate_at_start(run)
        windows = open_stream(run)
        while run.state.optimizer_step < run.total_steps:
            window, micro_batches, epoch_windows = next(windows, (None, None, None))
            if window is None:
                break
            if job.before_window is not None:  # e.g. a KL weight or an R1 interval keyed on optimizer steps
                job.before_window(run.state)
            result = accumulate_or_shrink(run, window, micro_batches)
            if result is None:  # batch_size auto ran out of memory: the same window, smaller micro-batches
                windows = open_stream(run)
                continue
            norms, skipped, lrs = optimizer_step(run.accelerator, run.optims, run.t, run.state.optimizer_step + 1,
                                                 window)
            record = step_record(run, window, result, norms, skipped, lrs)
            advance(run.state, record, window, epoch_windows, result.micro_steps, run.t.ema_beta)
            after_step(run, record)
            log.write(record)
    return finish(run, log_with)


# ---------------------------------------------------------------------------------------------------------------
# set-up


def setup(job: Job, t: TrainingConfig, output_dir=None, accelerator=None, log_with=None, save_every=None,
          keep_checkpoints: int = 2, resume_from=None, config_text: str = "", on_eval=None) -> Run:
    """Check the settings against the data, make the Accelerator, prepare the model and optimizers, resume."""
    processes = accelerator.num_processes if accelerator is not None else distributed.distributed_state().num_processes
    auto_batch = t.batch_size == "auto"
    if auto_batch:
        t = start_auto_batch(t, processes)
    check_job(job, t)
    accum = resolve_accumulation(t, processes)  # refuses an effective batch that does not split
    out_dir = Path(output_dir) if output_dir else None
    if accelerator is None:
        accelerator = distributed.make_accelerator(t, log_with=log_with, project_dir=str(out_dir) if out_dir else None)
    torch.backends.cudnn.benchmark = t.cudnn_benchmark
    total_steps = total_optimizer_steps(len(job.train_data), t, accum, processes)

    model = job.model
    model.train()  # from_pretrained returns a model in eval mode: dropout would silently stay off
    precision.prepare_quantized(model)  # bitsandbytes-quantized weights: adapters only, and no CPU repacking
    if t.gradient_checkpointing:
        enable_checkpointing(model, job.enable_checkpointing)
    head_note = enable_chunked_head(model, t.chunked_loss) if job.loss_fn is None or t.chunked_loss else \
        "plain (the job computes its own loss)"
    # Schedulers are not passed to accelerator.prepare: a prepared scheduler steps num_processes times per
    # optimizer step (Accelerate assumes each process's dataloader shrank by W). Our windows already span every
    # process, so each raw scheduler is stepped exactly once per optimizer step.
    optims = make_optims(model, job.param_groups, t, total_steps, lr_scale(t, t.batch_size * accum * processes))
    distributed.agree(lambda: distributed.configure_deepspeed(accelerator, t.batch_size))  # every process refuses
    model, *prepared = accelerator.prepare(model, *[o.optimizer for o in optims])
    for o, p in zip(optims, prepared):
        o.optimizer = p
    causal = is_causal_lm(model)
    pack_length_of, packing_note = decide_packing(t.packing, accelerator.unwrap_model(model), job.train_data,
                                                  job.length_of, job.loss_fn)
    if t.max_tokens_per_micro_batch and not (job.length_of or pack_length_of):
        raise ConfigError("training.max_tokens_per_micro_batch: this task gives no sample lengths (Job.length_of)")
    run = Run(job=job, t=t, accelerator=accelerator, model=model,
              forward_model=torch.compile(model, mode=t.compile_mode) if t.compile else model, optims=optims,
              counter=job.count_items or (lambda b: count_items(b, t.items, causal)), state=TrainState(),
              total_steps=total_steps, out_dir=out_dir, save_every=save_every, keep_checkpoints=keep_checkpoints,
              config_text=config_text, log_with=log_with, on_eval=on_eval, monitor=MemoryMonitor(accelerator.device),
              auto_batch=auto_batch, packing_note=packing_note, head_note=head_note,
              pack_length_of=pack_length_of,
              pack_capacity=(t.pack_length or max(map(pack_length_of, range(len(job.train_data)))))
              if pack_length_of else None)
    if auto_batch:
        run.t = planned_micro_batch(run)
    if resume_from is not None:
        run.state = checkpoint.load_checkpoint(accelerator, resume_from, run.schedulers)
    return run


def check_job(job: Job, t: TrainingConfig) -> None:
    """Data the settings can't use: an empty training set, a micro-batch larger than it."""
    n_train = len(job.train_data)
    if n_train == 0:
        raise ConfigError("data: the training set is empty")
    if t.batch_size != "auto" and t.batch_size > n_train:
        raise ConfigError(f"training.batch_size: {t.batch_size} is larger than the {n_train} training samples")
    if t.sort_within_window and job.length_of is None:
        raise ConfigError("training.sort_within_window: this task gives no sample lengths (Job.length_of)")


def start_auto_batch(t: TrainingConfig, processes: int) -> TrainingConfig:
    """``batch_size: auto`` starts from the largest candidate: the whole per-process window in one micro-batch."""
    if processes > 1:
        raise ConfigError("training.batch_size: auto runs on one process (an out-of-memory error on one rank "
                          "would leave the others waiting); give a number with several processes")
    return dataclasses.replace(t, batch_size=t.effective_batch_size, gradient_accumulation_steps=None)  # N derived


def planned_micro_batch(run: Run) -> TrainingConfig:
    """``batch_size: auto`` starts from the planner's prediction (``step_memory.auto_profile``, measured on this model
    in this run's settings): the largest micro-batch dividing the window whose step is predicted to fit the device.
    An out-of-memory error still shrinks it (``shrink_micro_batch``)."""
    from accelerate.utils import send_to_device

    from finetune.step_memory import auto_profile, device_budget, longest_batches, tensor_bytes

    device = run.accelerator.device
    batches = [send_to_device(b, device) for b in longest_batches(run.job, sizes=(1, 2))[0]]
    window = run.t.batch_size  # start_auto_batch: the whole per-process window
    profile = auto_profile(run.model, batches, run.t, run.job.loss_fn, up_to=window)
    budget = device_budget(device, held=tensor_bytes(run.model.parameters()))
    b = profile.largest_micro_batch(window, budget)
    peak = profile.step_peak(max(b, 1), window // max(b, 1))
    if run.accelerator.is_main_process:
        print(f"batch_size auto: micro-batch {max(b, 1)} × {window // max(b, 1)}, predicted step peak "
              f"{peak / 2**30:.2f} of {budget / 2**30:.2f} GiB free on {device}"
              + ("" if b else " (even one sample is predicted not to fit: trying it)"), flush=True)
    return dataclasses.replace(run.t, batch_size=max(b, 1))


def start_trackers(run: Run, tracker_config: Optional[dict]) -> None:
    if run.log_with is None:
        return
    scalars = {k: v if isinstance(v, (int, float, str, bool)) else str(v)
               for k, v in flatten(tracker_config or {}, sep="/").items()}  # trackers take nothing else
    run.accelerator.init_trackers("finetune", config={
        **scalars, "config/effective_batch_size": run.effective, "config/gradient_accumulation_steps": run.accum,
        "config/physical_batch_size": run.t.batch_size})


def open_stream(run: Run):
    """The windows from where the state stands (its epoch and next window) to the end of training."""
    a = run.accelerator
    return stream_windows(run.job, run.t, run.accum, a.num_processes, a.process_index, run.state.epoch,
                          run.state.next_window, pin_memory=a.device.type == "cuda", pack_capacity=run.pack_capacity,
                          pack_length_of=run.pack_length_of)


# ---------------------------------------------------------------------------------------------------------------
# per window


def accumulate_or_shrink(run: Run, window, micro_batches) -> Optional[WindowResult]:
    """The window's micro-steps; with ``batch_size: auto``, an out-of-memory error shrinks the micro-batch instead
    (returns None: the caller re-opens the stream and runs the same window again — its samples, and so the step,
    do not change)."""
    rng = torch.get_rng_state()
    try:
        return accumulate_window(run.accelerator, run.model, run.forward_model, run.job.loss_fn, window,
                                 micro_batches, run.counter, offload=run.t.activation_offloading)
    except Exception as error:
        if not (run.auto_batch and is_oom(error)):
            raise
    run.accelerator.unwrap_model(run.model).zero_grad(set_to_none=True)
    free_memory()
    torch.set_rng_state(rng)
    shrink_micro_batch(run, window)
    return None


def shrink_micro_batch(run: Run, window) -> None:
    """The next micro-batch to try: the largest divisor of the per-process window below the current one."""
    per_process = run.effective // run.world
    smaller = smaller_micro_batch(run.t.batch_size, per_process)
    if smaller == 0:
        raise ConfigError("training.batch_size: auto found no micro-batch that fits (1 sample does not)")
    if run.accelerator.is_main_process:
        from tqdm.auto import tqdm

        tqdm.write(f"out of memory at micro-batch {run.t.batch_size}: window {window.index} again with "
                   f"{smaller} × {per_process // smaller}")
    run.t = dataclasses.replace(run.t, batch_size=smaller)


def step_record(run: Run, window, result: WindowResult, norms, skipped, lrs) -> dict:
    """The history line of one optimizer step. The logged loss and its terms are summed over processes with one
    all-reduce and read with one host sync."""
    logged = torch.stack([result.loss, *result.extras.values()])
    logged = (run.accelerator.reduce(logged, "sum") if run.world > 1 else logged).tolist()
    return {
        "step": run.state.optimizer_step + 1, "epoch": window.epoch, "window": window.index,
        "items": result.items, "samples": len(window.samples), "micro_batches": window.total_micro_batches,
        **({"tokens": result.real_tokens, "padded_tokens": result.padded_tokens} if result.padded_tokens else {}),
        "loss": logged[0], "lr": lrs[0], "grad_norm": norms[0], "skipped": skipped,
        "window_hash": window.sample_hash, **dict(zip(result.extras, logged[1:])),
        **{f"{key}_{o.name}": v[i] for i, o in enumerate(run.optims) if i
           for key, v in (("lr", lrs), ("grad_norm", norms))},
        "micro_batch_size": run.t.batch_size, **run.monitor.sample(),
    }


def advance(state: TrainState, record: dict, window, epoch_windows: int, micro_steps: int, ema_beta: float) -> None:
    """The one place the run's state moves: one optimizer step taken over ``window``."""
    state.optimizer_step += 1
    state.micro_step += micro_steps
    state.items += record["items"]
    state.samples += record["samples"]
    state.history.append(record)
    state.update_ema(record["loss"], ema_beta)
    if window.index == epoch_windows - 1:
        state.epoch, state.next_window = window.epoch + 1, 0
    else:
        state.epoch, state.next_window = window.epoch, window.index + 1


def after_step(run: Run, record: dict) -> None:
    """The task's hook, then evaluation, then the checkpoint — in this order, so that a checkpoint holds everything
    up to it and a resumed run repeats nothing."""
    state, t = run.state, run.t
    if run.job.after_step is not None:
        run.job.after_step(state, run.accelerator.unwrap_model(run.model))
    done = state.optimizer_step >= run.total_steps
    epoch_end = state.next_window == 0
    if run.job.val_data is not None and (done or (t.eval_every and state.optimizer_step % t.eval_every == 0)
                                         or (epoch_end and not t.eval_every)):
        val = evaluate(run, epoch=record["epoch"])
        record.update({f"val_{k}": v for k, v in val.items() if k not in ("step", "epoch")})
    if run.save_every and run.out_dir is not None and (done or state.optimizer_step % run.save_every == 0):
        checkpoint.save_checkpoint(run.accelerator, state, run.out_dir, run.schedulers, run.config_text,
                                   run.keep_checkpoints, meta={"effective_batch_size": run.effective})


def evaluate(run: Run, epoch: int) -> dict:
    record = run_eval(run.job, run.forward_model, run.accelerator, run.t, run.state.optimizer_step, epoch,
                      run.log_with)
    run.state.val_history.append(record)
    if run.on_eval is not None:
        run.on_eval(record)
    return record


def evaluate_at_start(run: Run) -> None:
    """``training.eval_at_start``: the untuned model's metrics, once (not again on resume)."""
    if run.job.val_data is not None and run.t.eval_at_start and run.state.optimizer_step == 0 \
            and not run.state.val_history:
        evaluate(run, epoch=0)


# ---------------------------------------------------------------------------------------------------------------
# finish


def finish(run: Run, log_with=None) -> TrainResult:
    if log_with is not None:  # not accelerator.end_training(): it also tears down the process group
        for tracker in run.accelerator.trackers:
            tracker.finish()
    # only a run that succeeded waits here: no process leaves (closing its connections) while another still has a
    # collective in flight; a process that failed must not wait for the others
    distributed.wait_for_everyone()
    return TrainResult(model=run.accelerator.unwrap_model(run.model), accelerator=run.accelerator, state=run.state,
                       effective_batch_size=run.effective, gradient_accumulation_steps=run.accum,
                       total_steps=run.total_steps)
