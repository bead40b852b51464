"""The run's shape: how many samples an optimizer step takes and how they split, computed once at start-up.

``micro_batch × accumulation × processes`` is the effective batch, the baseline's batch that every optimizer step
equals. ``finetune.startup`` splits it before anything is built (``split_batch``: a split that cannot work is refused
before a model is downloaded) and counts the run's optimizer steps once the data is known (``count_steps``). The
loop only reads the result.

    >>> shape = Shape(micro_batch=4, accumulation=4, processes=2)
    >>> shape.per_process, shape.effective
    (16, 32)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The samples of one optimizer step and their split; made at start-up (``startup.split_batch``), read by the
    loop."""

    micro_batch: int      # samples per micro-batch on each process (batch_size: auto: the one being tried)
    accumulation: int     # N: micro-batches per process in a full window
    processes: int
    auto: bool = False    # batch_size: auto — an out-of-memory error picks a smaller micro_batch (memory.auto_batch)
    total_steps: int = 0  # optimizer steps of the whole run; 0 until the training set is known (``count_steps``)

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
