"""The run's shape: how many samples an optimizer step takes and how they split, computed once at set-up.

``micro_batch × accumulation × processes`` is the effective batch, the baseline's batch that every optimizer step
equals. ``plan_shape`` splits it before anything is built (a split that cannot work is refused before a model is
downloaded); ``Shape.for_data`` checks it against the training set and counts the run's optimizer steps. The loop
only reads the result.

    >>> shape = plan_shape(TrainingConfig(batch_size=4, effective_batch_size=32), processes=2)
    >>> shape.accumulation, shape.effective
    (4, 32)
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Optional

from finetune.config import TrainingConfig
from finetune.errors import ConfigError
from finetune.job import Job
from finetune.windows import windows_per_epoch


@dataclass(frozen=True)
class Shape:
    """The samples of one optimizer step and their split; made by ``plan_shape``, read by the loop."""

    micro_batch: int      # samples per micro-batch on each process (batch_size: auto: the one being tried)
    accumulation: int     # N: micro-batches per process in a full window
    processes: int
    auto: bool = False    # batch_size: auto — an out-of-memory error picks a smaller micro_batch (memory.auto_batch)
    total_steps: int = 0  # optimizer steps of the whole run; 0 until the training set is known (``for_data``)

    @property
    def effective(self) -> int:
        """Samples per optimizer step, over all processes."""
        return self.micro_batch * self.accumulation * self.processes

    @property
    def per_process(self) -> int:
        """Samples of a full window on one process."""
        return self.micro_batch * self.accumulation

    def with_micro_batch(self, micro_batch: int) -> Shape:
        """The same window in micro-batches of ``micro_batch`` samples (a divisor of ``per_process``)."""
        return dataclasses.replace(self, micro_batch=micro_batch, accumulation=self.per_process // micro_batch)

    def for_data(self, job: Job, t: TrainingConfig) -> Shape:
        """This shape over ``job``'s training set: checked against it, with the run's optimizer steps — Σ over
        epochs of ceil(samples / effective batch), capped by ``t.max_steps``.

        Raises:
            ConfigError: an empty training set, a micro-batch larger than it, sorting without sample lengths.
        """
        check_job(job, t, self)
        steps = t.epochs * windows_per_epoch(len(job.train_data), self.micro_batch, self.accumulation, self.processes)
        steps = min(steps, t.max_steps) if t.max_steps else steps
        warn_about_schedule(t, steps)
        return dataclasses.replace(self, total_steps=steps)


def plan_shape(t: TrainingConfig, processes: int) -> Shape:
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


def shape_for(job: Job, t: TrainingConfig, processes: Optional[int] = None) -> Shape:
    """``plan_shape`` then ``for_data``, for a caller that holds the job already (the Python API, the planner);
    ``finetune.startup`` takes the same two steps apart, the first before the model is built. ``processes``: this
    launch's (default)."""
    if processes is None:
        from finetune.distributed import distributed_state

        processes = distributed_state().num_processes
    return plan_shape(t, processes).for_data(job, t)


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


def warn_about_schedule(t, steps: int) -> None:
    """One line (main process) when the warm-up does not end before the run does (the learning rate never reaches
    its peak)."""
    from finetune.distributed import is_main_process

    if is_main_process() and t.warmup_steps and t.warmup_steps >= steps and t.lr_scheduler != "constant":
        print(f"warning: training.warmup_steps: {t.warmup_steps} is not below the run's {steps} optimizer steps; "
              f"the learning rate never reaches training.learning_rate ({t.learning_rate:g})", file=sys.stderr,
              flush=True)


def check_job(job: Job, t: TrainingConfig, shape: Shape) -> None:
    """Data the settings can't use: an empty training set, a micro-batch larger than it, an order the task's samples
    cannot take."""
    n_train = len(job.train_data)
    if n_train == 0:
        raise ConfigError("data: the training set is empty")
    if shape.micro_batch > n_train:
        field = "effective_batch_size" if shape.auto else "batch_size"  # auto starts from the whole window
        raise ConfigError(f"training.{field}: {shape.micro_batch} is larger than the {n_train} training samples")
    if job.windows_in_order:
        check_in_order(t)
    if t.sort_within_window and job.length_of is None:
        raise ConfigError("training.sort_within_window: this task gives no sample lengths (Job.length_of)")
    if job.stream_block is not None:
        check_stream(t)


def check_in_order(t: TrainingConfig) -> None:
    """A task whose samples must come in their own order (``Job.windows_in_order``): neither shuffled nor sorted."""
    for name in ("shuffle", "sort_within_window"):
        if getattr(t, name):
            raise ConfigError(f"training.{name}: this task's samples must come in order (Job.windows_in_order); "
                              f"set training.{name}=false")


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
