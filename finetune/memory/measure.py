"""Memory while training: what autograd saves for backward, the device monitor, and the pieces of out-of-memory
handling that ``finetune.memory.auto_batch`` (``batch_size: auto``) uses. The planner that uses these measurements is
``finetune.memory.plan``."""

from __future__ import annotations

import functools
import gc
import json
import os
import sys
import tempfile
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from finetune.models.forward import compute_loss

GiB = 1024 ** 3
WARN_AT = 0.85  # monitoring: warn once at this share of device memory


# ---------------------------------------------------------------------------------------------------------------
# measuring activations


class SavedTensors:
    """Counts the bytes autograd saves for backward (unique storages; parameters and buffers excluded)."""

    def __init__(self, model: torch.nn.Module):
        self.skip = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
        self.seen = {}

    def __enter__(self):
        def pack(t):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.skip:
                    self.seen[ptr] = t.untyped_storage().nbytes()
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


def activation_bytes(model, batch, loss_fn=None, autocast_dtype=None) -> int:
    """Bytes saved for backward by one forward of ``batch`` (then backward, freeing them)."""
    model.train()
    ctx = torch.autocast("cuda" if next(model.parameters()).is_cuda else "cpu", dtype=autocast_dtype) \
        if autocast_dtype is not None else _null()
    with SavedTensors(model) as saved, ctx:
        loss, _, _ = compute_loss(model, batch, loss_fn)
    loss.float().backward()
    model.zero_grad(set_to_none=True)
    return saved.bytes


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------------------------------------
# measuring a peak


class PeakMeter:
    """Bytes allocated inside the block on ``device``: ``peak`` (the most at any moment) and ``net`` (still allocated
    at the end), both relative to the start. CUDA: the caching allocator's counters; CPU: the profiler's record of
    every allocation and free, in order (deterministic, unlike the process's RSS, which also holds the allocator's
    cache and the libraries)."""

    def __init__(self, device=None):
        self.cuda = torch.device(device or "cpu").type == "cuda"

    def __enter__(self):
        # garbage left by earlier work (reference cycles holding tensors) would otherwise be freed inside the block
        # whenever the collector happens to run, and count as a negative allocation against this block's peak
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's own start/stop lines: read at first use
            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
            self.net = torch.cuda.memory_allocated() - self.start
            return
        self.prof.__exit__(*exc)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            self.prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        deltas = sorted((e["ts"], e["args"].get("Ev Idx", 0), e["args"]["Bytes"]) for e in events
                        if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0)
        now = peak = 0
        for *_, nbytes in deltas:
            now += nbytes
            peak = max(peak, now)
        self.peak, self.net = peak, now


def offload_to_host(device) -> object:
    """Activation offloading as it acts on device memory: on CUDA torch's ``save_on_cpu`` itself; on a CPU (where
    the planner measures for a card it does not have) saved tensors leave torch's allocator for NumPy's and come back
    as a fresh tensor when backward needs them — the allocations ``save_on_cpu`` makes and frees on the device."""
    if torch.device(device).type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)

    def pack(t):
        t = t.detach()
        raw = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
        return t.dtype, raw.contiguous().numpy().copy()

    def unpack(packed):
        dtype, array = packed
        return torch.from_numpy(array).clone().view(dtype)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


# ---------------------------------------------------------------------------------------------------------------
# monitoring


def device_memory(device: torch.device) -> tuple[int, int, dict]:
    """(used, total, fields for the history): CUDA allocated of the card's memory, else this process's RSS of RAM."""
    if device.type == "cuda":
        allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
        total = torch.cuda.get_device_properties(device).total_memory
        return reserved, total, {"mem_allocated_mib": allocated / 2**20, "mem_reserved_mib": reserved / 2**20}
    rss = this_process().memory_info().rss
    return rss, host_memory(), {"mem_rss_mib": rss / 2**20}


def this_process():
    """psutil's handle on this process, made once per process id (a forked child gets its own): making one reads
    /proc/PID/stat (its start time), which cost 12 ms a step on a loaded 2-core machine; reading RSS, microseconds."""
    return process_of(os.getpid())


@functools.lru_cache(maxsize=None)
def process_of(pid: int):
    import psutil  # lazy: 13 ms on every command (this module is on each one's path); only CPU runs ask

    return psutil.Process(pid)


@functools.lru_cache(maxsize=None)
def host_memory() -> int:
    """The machine's RAM in bytes, read once (it does not change during a run)."""
    import psutil

    return psutil.virtual_memory().total


class MemoryMonitor:
    """Samples memory once per optimizer step; warns once when use reaches 85 % of the device's memory."""

    def __init__(self, device: torch.device, warn_at: float = WARN_AT):
        self.device, self.warn_at, self.warned = device, warn_at, False

    def sample(self) -> dict:
        used, total, fields = device_memory(self.device)
        if not self.warned and total and used >= self.warn_at * total:
            self.warned = True
            warnings.warn(f"memory: {used / GiB:.1f} of {total / GiB:.1f} GiB ({used / total:.0%}) in use on "
                          f"{self.device}; lower training.batch_size (the effective batch stays) or turn on "
                          "training.gradient_checkpointing", ResourceWarning, stacklevel=2)
            print(f"warning: memory {used / total:.0%} of {self.device} in use", file=sys.stderr, flush=True)
        return {k: round(v, 1) for k, v in fields.items()}


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


def fake_oom_check(batch_samples: int) -> None:
    """``FINETUNE_FAKE_OOM_ABOVE=k``: a micro-batch of more than k samples raises an out-of-memory error (tests and
    dry runs of ``batch_size: auto`` on a machine without the real limit)."""
    limit = os.environ.get("FINETUNE_FAKE_OOM_ABOVE")
    if limit is not None and batch_samples > int(limit):
        raise torch.OutOfMemoryError(f"out of memory (injected: micro-batch of {batch_samples} > {limit})")


def smaller_micro_batch(current: int, per_process: int) -> int:
    """The next micro-batch to try after an OOM: the largest divisor of the per-process window below ``current``,
    so that micro-batch × N stays exactly the window (few tries: a window has few divisors)."""
    for d in range(current - 1, 0, -1):
        if per_process % d == 0:
            return d
    return 0


def free_memory() -> None:
    """Give freed blocks back after an out-of-memory error (the retry needs them)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
