"""What a run says while it trains: the banner, the progress bar, ``history.jsonl`` and the trackers.
These only write; the loop owns the state they report."""

from __future__ import annotations

import itertools
import json
import sys
import time

from tqdm.auto import tqdm

from finetune import distributed
from finetune.durable import atomic_write_text
from finetune.models import precision
from finetune.optim import lr_scale
from finetune.state import TrainState
from finetune.windows import even_batch_windows, kept


class RunLog:
    """Where each optimizer step is reported, on the main process only: ``history.jsonl`` (one line per step,
    flushed), the trackers, and the progress bar (effective batch, EMA loss, lr, ETA, padding share)."""

    def __init__(self, accelerator, out_dir, state: TrainState, total_steps: int, effective: int, log_with,
                 rewrite: bool = False):
        self.accelerator, self.state, self.effective, self.log_with = accelerator, state, effective, log_with
        self.file = None
        main = distributed.is_main_process()
        if main and out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            if rewrite:  # resuming: drop lines a killed run wrote after its last checkpoint
                atomic_write_text(out_dir / "history.jsonl", "".join(json.dumps(h) + "\n" for h in state.history))
            self.file = open(out_dir / "history.jsonl", "a")
        self.bar = tqdm(total=total_steps, initial=state.optimizer_step, disable=not main, unit="step",
                        dynamic_ncols=True, desc=f"train (batch {effective})",
                        mininterval=0.5 if sys.stderr.isatty() else 15)
        self.last = time.perf_counter()
        self.real = self.padded = 0

    def lap(self) -> float:
        """Seconds since the previous lap (the first: since the log was opened), for a step's ``seconds``."""
        now = time.perf_counter()
        seconds, self.last = round(now - self.last, 6), now
        return seconds

    def write(self, record: dict) -> None:
        """Report one optimizer step (its record whole: with its evaluation as val_*, and its seconds)."""
        if self.log_with is not None:
            self.accelerator.log({f"train/{k}": record[k] for k in ("loss", "lr", "grad_norm")}, step=record["step"])
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        self.real += record.get("tokens", 0)
        self.padded += record.get("padded_tokens", 0)
        pad = f" padding={1 - self.real / self.padded:.0%}" if self.padded else ""
        ema = self.state.ema_loss if self.state.ema_loss is not None else float("nan")
        self.bar.update(1)
        self.bar.set_postfix_str(f"eff_batch={self.effective} loss={ema:.4f} lr={record['lr']:.2e}{pad}",
                                 refresh=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()  # also on an error, so its message starts on a line of its own
        if self.file is not None:
            self.file.close()


def dropout_line(keys) -> str:
    """What the banner says of dropout keyed by sample (``models.dropout.SampleKeys``)."""
    n = keys.layers
    line = f"Dropout: keyed by sample in {n} layer{'s' if n > 1 else ''} (each sample's masks the same at any " \
           "micro-batch)"
    return line + (f"; attention dropout ({keys.unkeyed}) is drawn inside the attention kernel, not keyed"
                   if keys.unkeyed else "")


def banner(run) -> str:
    """What the run will do, said once before the first step (``run``: ``loop.Run``)."""
    t, shape, accelerator, windows = run.training, run.shape, run.accelerator, run.window_spec
    n_train, total_steps, world, effective = windows.samples, shape.total_steps, shape.processes, shape.effective
    per_epoch, opt = windows.per_epoch, t.optimizer_settings
    split = f"{shape.micro_batch} × {shape.accumulation}" + (f" × {world} processes" if world > 1 else "")
    trained = kept(n_train, windows.drop_last)
    tail = trained - (per_epoch - 1) * effective
    tail_text = "every window is full" if tail == effective else \
        f"the last window of each epoch holds {tail} sample{'s' if tail > 1 else ''}"
    if windows.even_batches and tail < effective:  # the baseline's last window, replayed
        held = len(even_batch_windows(list(range(trained)), effective, *windows.even_batches)[-1])
        tail_text += f" and {held - tail} of the epoch's first again (training.even_batches)" if held > tail else ""
    if trained < n_train:  # training.drop_last: not the big batch's epoch, said
        tail_text += f"; its last {n_train - trained} samples dropped (training.drop_last {windows.drop_last})"
    lines = [
        "=" * 60, "FINE-TUNING", "=" * 60,
        f"Training samples: {n_train}",
        f"Batch size: {shape.micro_batch}",
        f"Gradient accumulation steps: {shape.accumulation}",
        f"Processes: {world}" + (f", {engine}" if (engine := distributed.describe_engine(accelerator, run.model))
                                 else ""),
        f"Effective batch size: {effective} ({split})",
        f"Optimizer steps: {total_steps} ({per_epoch} per epoch; {tail_text})",
        f"Optimizer: {t.optimizer}, lr {t.learning_rate * lr_scale(opt, effective):g}, schedule {t.lr_scheduler}, "
        f"warm-up {t.warmup_steps} steps",
        *([f"LR scaling: {t.scale_lr} from the baseline's batch {t.reference_batch_size} to {effective}: "
           f"{t.learning_rate:g} × {lr_scale(opt, effective):.4g}"] if t.scale_lr != "none" else []),
        *([f"Loss head: {run.head_note}"] if run.head_note else []),
        *([dropout_line(run.dropout_keys)] if run.dropout_keys else []),
        *([f"Packing: {run.packing_note}" + (f", rows of {windows.pack_capacity} tokens" if windows.pack_capacity
                                              else "")] if run.packing_note else []),
        *([f"Padding: {padding_share(windows):.1%} of the tokens of epoch 0"
           + (f"'s first {PLANNED_WINDOWS} windows" if windows.per_epoch > PLANNED_WINDOWS else "")
           + (f", each micro-batch as its baseline micro-batch of {windows.replay[0]} was padded (training."
              "replay_padding)" if windows.replay else "")]
          if windows.length_of and windows.block is None else []),  # a stream is not read ahead
        f"Mixed precision: {t.mixed_precision}, device: {accelerator.device}",
        *([f"Weights: {weights}"] if (weights := precision.describe(accelerator.unwrap_model(run.model))) else []),
        "=" * 60,
    ]
    return "\n".join(lines)


PLANNED_WINDOWS = 256  # the banner's padding share is planned on this many windows: a large set's are minutes


def padding_share(windows) -> float:
    """Padded share of the tokens the first epoch's first ``PLANNED_WINDOWS`` windows will hold, from the plan (every
    process; ``windows``: the run's ``WindowSpec``, with sample lengths)."""
    real = padded = 0
    for rank in range(windows.processes):
        for w in itertools.islice(windows.windows(0, rank), PLANNED_WINDOWS):
            pads = w.pad_lengths or [None] * len(w.active)  # training.replay_padding: the baseline's lengths
            for mb, active, counts, pad in zip(w.micro_batches, w.active, w.token_counts or pads, pads):
                if not active:
                    continue
                if counts is None or pad is not None:
                    lengths = [windows.length_of(i) for i in mb]
                    counts = (sum(lengths), len(lengths) * (pad or max(lengths)))
                real, padded = real + counts[0], padded + counts[1]
    return 1 - real / padded if padded else 0.0
