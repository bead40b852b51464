"""Everything that resumes a run, in one object saved and restored whole.

Counters name their unit: ``optimizer_step`` (updates), ``micro_step`` (micro-batches on this process),
``epoch``, ``next_window`` (the window of ``epoch`` to train next), ``items`` (samples or tokens that counted toward
the loss). The loop advances it in one place (``loop.advance``); everything else reads it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


def ema(average: Optional[float], value: float, beta: float) -> Optional[float]:
    """The moving average after ``value``: ``value`` itself first; a NaN (a skipped window) leaves it alone."""
    if value != value:
        return average
    return value if average is None else beta * average + (1 - beta) * value


@dataclass
class TrainState:
    optimizer_step: int = 0         # optimizer updates taken (skipped ones included)
    micro_step: int = 0             # micro-batches run on this process
    epoch: int = 0                  # current epoch
    next_window: int = 0            # the window of `epoch` to train next
    items: int = 0                  # loss items seen, all processes
    samples: int = 0                # samples seen, all processes
    ema_loss: Optional[float] = None
    history: list = field(default_factory=list)      # one dict per optimizer step
    val_history: list = field(default_factory=list)  # one dict per evaluation

    def update_ema(self, loss: float, beta: float) -> float:
        """Exponential moving average of the window loss, started at the first value (so unbiased from step 1)."""
        self.ema_loss = ema(self.ema_loss, loss, beta)
        return float("nan") if self.ema_loss is None else self.ema_loss

    def state_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainState":
        """The state ``state_dict`` saved (a checkpoint's ``trainer_state.json``), as a new object."""
        d = dict(d)
        if "window" in d:  # checkpoints written before the rename
            d["next_window"] = d.pop("window")
        return cls(**d)
