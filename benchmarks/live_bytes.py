"""Activation memory on any device, CPU included: bytes of tensor storage alive right now and at the peak.

``LiveBytes`` is a ``TorchDispatchMode``: every storage an operation creates while it is active (forward, backward,
recomputation in backward) is counted until it is freed, so ``peak`` is the most memory the step itself held —
what ``torch.cuda.max_memory_allocated`` measures on a GPU, minus what existed before (weights, inputs).

    >>> with LiveBytes() as m:
    ...     loss = model(x).sum(); mark = m.live; loss.backward()
    >>> m.peak, mark   # bytes at the peak; bytes kept for backward at the end of forward
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen = set()

    def _free(self, key, n):
        self._seen.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key, n = storage.data_ptr(), storage.nbytes()
                if n and key not in self._seen:  # a view or an in-place result shares a counted storage
                    self._seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, n)
        return out


def measure(step) -> dict:
    """Run ``step(mark)`` under LiveBytes; ``step`` calls ``mark()`` between forward and backward.
    Returns {"peak": bytes, "kept": bytes alive at the mark (what the graph holds for backward)}."""
    kept = []
    with LiveBytes() as m:
        step(lambda: kept.append(m.live))
    return {"peak": m.peak, "kept": kept[0] if kept else 0}


def training_step(model, batch):
    """``step(mark)`` for ``measure`` / ``best_seconds``: zero grads, forward, ``mark()``, backward."""

    def step(mark=lambda: None):
        model.zero_grad(set_to_none=True)
        loss = model(**batch)["loss"]
        mark()
        loss.backward()

    return step


def best_seconds(step, repeats: int) -> float:
    """The fastest of ``repeats`` runs: on a shared machine the others measure the neighbours."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(lambda: None)
        times.append(time.perf_counter() - start)
    return min(times)


def machine() -> str:
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import os

    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
