"""``batch_size: auto``: the largest micro-batch predicted to fit the device, and a smaller one after an
out-of-memory error.

Only the split changes, never the effective batch: the micro-batch is a divisor of the window and N follows
(``Shape.with_micro_batch``), so the optimizer steps are the baseline's whatever micro-batch the run settles on.
The prediction comes from the planner's measurements (``finetune.memory.step``); ``shape.split_batch`` refuses auto on
several processes (an out-of-memory error on one rank would leave the others waiting).
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device
from tqdm.auto import tqdm

from finetune import distributed
from finetune.config import TrainingConfig
from finetune.errors import ConfigError
from finetune.job import Job
from finetune.memory import step as step_memory  # looked up when called (a test replaces the device budget)
from finetune.memory.measure import free_memory, smaller_micro_batch
from finetune.shape import Shape


class AutoBatch:
    """The micro-batch of a ``batch_size: auto`` run, for ``model`` (prepared by ``accelerator``).

        auto = AutoBatch(accelerator, model)
        shape = auto.initial_shape(shape, job, t)          # at set-up
        shape = auto.shrink(shape, window, rng)   # after an out-of-memory error in ``window``
    """

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module):
        self.accelerator, self.model = accelerator, model

    def initial_shape(self, shape: Shape, job: Job, t: TrainingConfig) -> Shape:
        """``shape`` in the largest micro-batch dividing its window whose step is predicted to fit the
        device (``finetune.memory.step.auto_profile``, measured on this model in this run's settings); one sample when
        none is."""
        device = self.accelerator.device
        batches = [send_to_device(b, device) for b in step_memory.longest_batches(job, sizes=(1, 2))[0]]
        window = shape.per_process
        profile = step_memory.auto_profile(self.model, batches, t, job.loss_fn, up_to=window)
        budget = step_memory.device_budget(device, held=step_memory.tensor_bytes(self.model.parameters()))
        b = profile.largest_micro_batch(window, budget)
        peak = profile.step_peak(max(b, 1), window // max(b, 1))
        if distributed.is_main_process():
            print(f"batch_size auto: micro-batch {max(b, 1)} × {window // max(b, 1)}, predicted step peak "
                  f"{peak / 2**30:.2f} of {budget / 2**30:.2f} GiB free on {device}"
                  + ("" if b else " (even one sample is predicted not to fit: trying it)"), flush=True)
        return shape.with_micro_batch(max(b, 1))

    def shrink(self, shape: Shape, window, rng: torch.Tensor) -> Shape:
        """After an out-of-memory error in ``window``: drop its partial gradients, give the memory back, rewind the
        random state to ``rng`` (taken before the window, so the retry draws the same dropout masks), and return the
        shape to retry the same window with: the largest divisor of the window below the current micro-batch.

        Raises:
            ConfigError: when not even one sample fits.
        """
        self.accelerator.unwrap_model(self.model).zero_grad(set_to_none=True)
        free_memory()
        torch.set_rng_state(rng)
        smaller = smaller_micro_batch(shape.micro_batch, shape.per_process)
        if smaller == 0:
            raise ConfigError("training.batch_size: auto found no micro-batch that fits (1 sample does not)")
        if distributed.is_main_process():
            tqdm.write(f"out of memory at micro-batch {shape.micro_batch}: window {window.index} again with "
                       f"{smaller} × {shape.per_process // smaller}")
        return shape.with_micro_batch(smaller)
