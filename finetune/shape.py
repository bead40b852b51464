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
from dataclasses import dataclass

from finetune.config import TrainingConfig
from finetune.errors import ConfigError
from finetune.job import Job
from finetune.windows import resolve_accumulation, windows_per_epoch


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
        return dataclasses.replace(self, total_steps=min(steps, t.max_steps) if t.max_steps else steps)


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


def check_job(job: Job, t: TrainingConfig, shape: Shape) -> None:
    """Data the settings can't use: an empty training set, a micro-batch larger than it."""
    n_train = len(job.train_data)
    if n_train == 0:
        raise ConfigError("data: the training set is empty")
    if shape.micro_batch > n_train:
        field = "effective_batch_size" if shape.auto else "batch_size"  # auto starts from the whole window
        raise ConfigError(f"training.{field}: {shape.micro_batch} is larger than the {n_train} training samples")
    if t.sort_within_window and job.length_of is None:
        raise ConfigError("training.sort_within_window: this task gives no sample lengths (Job.length_of)")
