"""A step's memory as a function of the micro-batch, measured on the model itself: what ``finetune plan``
(``finetune.memory.plan``) recommends from and what ``batch_size: auto`` starts from.

For one setting (checkpointing, the chunked loss head, offloading, LoRA) a ``Profile`` holds the fixed bytes
(weights, gradients, the optimizer's state and step) and the micro-step's peak at a few micro-batch sizes, measured
with the allocator's record (``memory.PeakMeter``) on the longest samples and joined by straight lines:

    step peak = weights + optimizer state + max(first micro-batch, gradients + later micro-batch,
                                                gradients + optimizer step)
                (+ the buckets of DDP or DeepSpeed, + ZeRO-3's gathered weights in the micro-batches)

The first micro-batch of a window runs without gradients; every later one with the window's gradients held. The
micro-step's peak holds what autograd saves for backward, the loss head's logits (or one chunk) and their gradient,
and backward's temporaries.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Optional

import torch

from finetune.items import batch_len
from finetune.memory import speed
from finetune.memory.fixed import held_bytes, optimizer_state_bytes, state_bytes
from finetune.memory.measure import PeakMeter, SavedTensors, fake_oom_check, free_memory, is_oom, offload_to_host
from finetune.models.forward import compute_loss
from finetune.models.loss_head import chunk_size
from finetune.optim import make_optimizer

HEADROOM = 0.9        # plan to use at most 90 % of what is free (fragmentation)


@dataclass(frozen=True)
class Setting:
    """One combination of the memory settings."""

    checkpointing: bool = False
    chunked_loss: bool = False
    offload: bool = False   # activation offloading (training.activation_offloading)
    host: str = ""          # training.offload where it is not none: optimizer or parameters (``memory.host``)
    lora: bool = False      # LoRA where the recipe trains every weight
    optimizer: str = ""     # where it differs from the recipe's: adamw8bit
    base: str = ""          # the frozen base, where it differs from the recipe's: bf16, or nf4 (with the rest in bf16)
    compute: str = ""       # training.mixed_precision, where it differs from the recipe's: bf16

    @property
    def parts(self) -> tuple[str, ...]:
        """The names of what this setting switches on, levers first (each a key of ``plan.COST``)."""
        return tuple(name for name, on in (("8-bit AdamW", self.optimizer == "adamw8bit"), ("LoRA", self.lora),
                                           (f"{self.base} base", self.base), (f"{self.compute} compute", self.compute),
                                           ("checkpointing", self.checkpointing), ("chunked loss", self.chunked_loss),
                                           ("offloading", self.offload),
                                           ("optimizer offload", self.host == "optimizer"),
                                           ("parameter offload", self.host == "parameters")) if on)

    @property
    def label(self) -> str:
        """For people: the parts joined, or "plain" (display only: code reads ``parts`` and the fields)."""
        return " + ".join(self.parts) or "plain"

    def flags(self) -> list[str]:
        """The run flags that select this setting."""
        out = [f"--set training.gradient_checkpointing={str(self.checkpointing).lower()}"]
        if self.offload:
            out.append("--set training.activation_offloading=true")
        if self.host:
            out.append(f"--offload {self.host}")
        if self.lora:
            out.append("--set peft.enabled=true")
        if self.optimizer:
            out.append(f"--set training.optimizer={self.optimizer}")
        if self.base == "nf4":
            out.append("--set model.quantization=nf4")
        if self.base:
            out.append("--set model.dtype=bf16")
        if self.compute:
            out.append(f"--set training.mixed_precision={self.compute}")
        return out

    @property
    def overrides(self) -> dict:
        """The recipe's fields this setting changes beyond the memory settings (``section.key`` → value)."""
        out = {"peft.enabled": True} if self.lora else {}
        if self.optimizer:
            out["training.optimizer"] = self.optimizer
        if self.base:
            out.update({"model.dtype": "bf16", **({"model.quantization": "nf4"} if self.base == "nf4" else {})})
        if self.compute:
            out["training.mixed_precision"] = self.compute
        return out


def linear(a1: int, b1: int, a2: int, b2: int) -> tuple[int, int]:
    """(fixed, per sample) of a quantity measured as a1 at b1 samples and a2 at b2."""
    per = max((a2 - a1) // max(b2 - b1, 1), 0)
    return max(a1 - per * b1, 0), per


def at_size(points: list, b: int) -> int:
    """A quantity measured at ``points`` ([samples, bytes], by size) at ``b`` samples: on the segment that holds b,
    else on the nearest end segment extended (measured sizes bracket where the slope changes)."""
    i = next((k for k in range(1, len(points) - 1) if b <= points[k][0]), len(points) - 1)
    (b1, a1), (b2, a2) = points[i - 1], points[i]
    fixed, per = linear(a1, b1, a2, b2)
    return fixed + per * b


@dataclass
class Profile:
    """What one setting measured: the fixed bytes, and the micro-step's peak and saved bytes at the micro-batch
    sizes measured ([samples, bytes] points, ``at_size`` between and beyond them)."""

    setting: Setting
    parameters: int
    trainable: int
    weights: int
    gradients: int
    optimizer_state: int
    optimizer_step: int         # peak of the optimizer step above weights + gradients (its state and temporaries)
    buckets: int                # DDP's gradient buckets or DeepSpeed's reduce bucket (``memory.sharded``)
    saved: list                 # what autograd saves for backward
    first: list                 # micro-step peak above its start, no gradients held (a window's first micro-batch)
    later: list                 # the same with the window's gradients held (every later micro-batch)
    floor: Optional[dict] = None  # offloading: the same setting's first / later without it, less what it saved
    measured: bool = True       # False: priced from its fixed part alone, which already exceeds the card
    gathered: int = 0           # ZeRO-3: whole parameters gathered for forward and backward (``memory.sharded``)
    multiplying: tuple = (0, 0)  # (N, N_t): parameters that multiply a token's activations, and those that train
    here_flops: float = 0.0     # FLOP/s this machine sustained in the last micro-step measured (0: none)
    host: int = 0               # bytes kept in host memory for the training state (``memory.host``; 0: none)
    counts: Optional[object] = None  # under a host level: the model's ``host.Counts``, for the link's traffic

    def part(self, which: list, b: int) -> int:
        return at_size(which, b)

    def micro(self, mode: str, b: int) -> int:
        """The micro-step's peak (``mode``: "first" or "later") at ``b`` samples. With offloading, never below what
        stays on the device without the saved tensors: at the small micro-batches measured a fixed buffer can hide
        how the rest grows."""
        value = at_size(getattr(self, mode), b)
        return max(value, at_size(self.floor[mode], b)) if self.floor else value

    def per_sample(self, which: list) -> tuple[int, int]:
        """(fixed, per sample) of ``which`` on its largest measured segment."""
        (b1, a1), (b2, a2) = which[-2:]
        return linear(a1, b1, a2, b2)

    def step_peak(self, b: int, n: int) -> int:
        """Predicted peak of an optimizer step of ``n`` micro-batches of ``b`` samples."""
        # Without gradients the peak sits where activations and the gradients made so far add up most; as b grows
        # it moves to where activations alone peak, as with gradients held: the larger of the two lines.
        micro = max(self.micro("first", b), self.micro("later", b))
        if n > 1:
            micro = max(micro, self.gradients + self.micro("later", b))
        return self.weights + self.buckets + max(self.optimizer_state + self.gathered + micro,
                                                 self.gradients + self.optimizer_step)

    def largest_micro_batch(self, per_process: int, budget: float) -> int:
        """The largest divisor of the per-process window whose step fits ``budget`` (0: none does)."""
        return next((d for d in range(per_process, 0, -1)
                     if per_process % d == 0 and self.step_peak(d, per_process // d) <= budget), 0)


def without_saved(profile: Profile) -> dict:
    """``profile``'s micro-step peaks less what autograd saved at the same sizes: the floor of the same setting
    with offloading (the saved tensors leave the device, the rest stays)."""
    saved = dict(map(tuple, profile.saved))
    return {mode: [[b, max(peak - saved[b], 0)] for b, peak in getattr(profile, mode)] for mode in ("first", "later")}


def micro_step(model, batch, loss_fn, autocast_dtype, offload: bool, device) -> tuple[int, int, float]:
    """(peak bytes above the start, bytes saved for backward, seconds its forward and backward took with the
    allocator recorded) of one forward and backward of ``batch``; gradients accumulate into whatever ``.grad``
    holds."""
    fake_oom_check(batch_len(batch))  # a probe meets the injected limit as the loop's micro-steps do
    autocast = torch.autocast(torch.device(device).type, dtype=autocast_dtype) if autocast_dtype is not None \
        else contextlib.nullcontext()
    with PeakMeter(device) as meter:
        start = time.perf_counter()
        with SavedTensors(model) as saved, (offload_to_host(device) if offload else contextlib.nullcontext()), \
                autocast:
            loss = compute_loss(model, batch, loss_fn)[0]  # the outputs (logits) go now, as in the loop
        loss.float().backward()
        del loss
        if meter.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return meter.peak, saved.bytes, seconds


def profile_micro_steps(model, batches: list, loss_fn=None, autocast_dtype=None, offload: bool = False,
                        up_to: int = 0) -> dict:
    """The micro-step's peak (without gradients, then with them held) and saved bytes at micro-batch sizes.

    Measured at the two sizes of ``batches``, then at doubled sizes (up to ``up_to`` samples) while the line would
    mislead: while the peak grows slower than what autograd saves (a fixed buffer — an embedding's gradient — sets
    the peak at small micro-batches, and activations take over later), and until a micro-batch holds more than one
    chunk of the chunked loss head (its buffer grows with the tokens up to one chunk, then stays). The random state
    is restored afterwards (dropout draws here must not shift the run's); gradients are cleared."""
    device = next(model.parameters()).device
    model.train()
    first, later, saved, timed = [], [], [], []
    chunk = chunk_size(model)

    def at(batch):
        b = batch_len(batch)
        model.zero_grad(set_to_none=True)
        peak, kept, _ = micro_step(model, batch, loss_fn, autocast_dtype, offload, device)
        later_peak, _, seconds = micro_step(model, batch, loss_fn, autocast_dtype, offload, device)
        first.append([b, peak])
        saved.append([b, kept])
        later.append([b, later_peak])  # recorded once both steps ran: a probe that runs out of memory leaves nothing
        timed[:] = [b, row_tokens(batch), seconds]  # the second step: warm, as a window's later micro-steps are
        return tokens_in(batch)

    def slope(points):
        return linear(points[-2][1], points[-2][0], points[-1][1], points[-1][0])[1]

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for k, batch in enumerate(batches):
            try:
                tokens = at(batch)
            except RuntimeError as error:
                if not k or not is_oom(error):
                    raise
                # the card holds one sample, not two: no line through two sizes, so each quantity is taken as
                # proportional to the samples (an over-estimate: the fixed part counted per sample), the plan picks
                # a micro-batch on the safe side and the loop's retry shrinks it further if need be
                model.zero_grad(set_to_none=True)
                free_memory()
                for points in (first, later, saved):
                    points.append([2 * points[-1][0], 2 * points[-1][1]])
                return {"first": first, "later": later, "saved": saved, "timed": timed}
        batch = batches[-1]
        while (slope(later) < 0.9 * slope(saved) or tokens <= chunk) and 2 * later[-1][0] <= up_to:
            batch = doubled(batch)
            if batch is None:
                break
            try:
                tokens = at(batch)
            except RuntimeError as error:  # torch.OutOfMemoryError is one
                if not is_oom(error):
                    raise
                # a doubling only sharpens the line through the sizes measured already: a device that cannot hold
                # the probe (a small or capped card) still gets a plan from them, and the loop's retry does the rest
                model.zero_grad(set_to_none=True)
                free_memory()
                break
    model.zero_grad(set_to_none=True)
    return {"first": first, "later": later, "saved": saved, "timed": timed}


def tokens_in(batch) -> int:
    """Tokens of a causal LM's micro-batch (its input_ids), 0 for other batches."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    return ids.numel() if isinstance(ids, torch.Tensor) else 0


def row_tokens(batch) -> int:
    """Tokens a row of ``batch`` (the width of its input_ids; a BatchEncoding too), 0 without them."""
    ids = batch.get("input_ids") if hasattr(batch, "get") else None
    return ids.shape[-1] if isinstance(ids, torch.Tensor) and ids.dim() else 0


def doubled(batch):
    """``batch`` twice over (its tensors concatenated along the samples), or None when it is not a dict of tensors
    that share a leading sample dimension."""
    n = batch_len(batch)
    if not isinstance(batch, dict) or not n:
        return None
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == n:
            out[key] = torch.cat([value, value])
        elif isinstance(value, torch.Tensor) and value.dim():
            return None
        else:
            out[key] = value
    return out


def optimizer_step_bytes(model, t) -> tuple[int, int]:
    """(state bytes, peak bytes above weights + gradients) of the recipe's optimizer's first step (its state is
    created there; later steps hold it and make the same temporaries). Changes the weights: a planning model only."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = make_optimizer(params, t)
    with PeakMeter(params[0].device) as meter:
        optimizer.step()
    state = state_bytes(optimizer)
    model.zero_grad(set_to_none=True)
    return state, meter.peak


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(model, batches, setting: Setting, t, loss_fn=None, up_to: int = 0) -> Profile:
    """A Profile of ``setting`` on ``model`` (already switched to it), one process holding everything
    (``sharded.per_process`` spreads it over several)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    gradients = tensor_bytes(trainable)
    state, step = optimizer_step_bytes(model, t)
    micro = profile_micro_steps(model, batches, loss_fn, autocast_dtype(t.mixed_precision), setting.offload, up_to)
    rows, tokens, seconds = micro.pop("timed") or (0, 0, 0.0)
    return Profile(setting=setting, parameters=sum(p.numel() for p in model.parameters()),
                   trainable=sum(p.numel() for p in trainable),
                   weights=held_bytes(model),
                   gradients=gradients, optimizer_state=state, optimizer_step=step, buckets=0, **micro,
                   multiplying=speed.multiplying(model),
                   here_flops=speed.measured_rate(model, (rows, tokens), seconds, setting.checkpointing))


def autocast_dtype(precision: str):
    """fp16 and bf16 save the same 2-byte activations; on a CPU bf16 stands in for fp16."""
    if precision == "bf16" or (precision == "fp16" and not torch.cuda.is_available()):
        return torch.bfloat16
    return torch.float16 if precision == "fp16" else None


# ---------------------------------------------------------------------------------------------------------------
# batch_size: auto


def auto_profile(model, batches: list, t, loss_fn=None, up_to: int = 0) -> Profile:
    """The Profile ``batch_size: auto`` picks its micro-batch from: measured on the run's own model in its own
    settings (offloading as ``t`` says). The optimizer step is left out: it does not depend on the micro-batch, and
    its state does not exist yet, so it is counted from the trainable tensors (``fixed.optimizer_state_bytes``, the
    count ``finetune plan`` uses too)."""
    micro = profile_micro_steps(model, batches, loss_fn, autocast_dtype(t.mixed_precision), t.activation_offloading,
                                up_to)
    micro.pop("timed")
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = optimizer_state_bytes([p.numel() for p in trainable], t.optimizer, t.momentum)
    return Profile(setting=Setting(), parameters=0, trainable=0, weights=tensor_bytes(model.parameters()),
                   gradients=tensor_bytes(trainable), optimizer_state=state, optimizer_step=0, buckets=0, **micro)


def device_budget(device: torch.device, held: int) -> float:
    """Bytes this run's tensors may reach on ``device``: what is free plus what it already holds (``held``), less
    the headroom. CUDA: the driver's free memory and the allocator's cache; CPU: the system's available RAM."""
    if device.type == "cuda":
        # Accelerate's device is often plain "cuda"; get_per_process_memory_fraction takes only an index
        index = device.index if device.index is not None else torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        # a process capped with set_per_process_memory_fraction gets no more than its share of the card
        cap = torch.cuda.get_per_process_memory_fraction(index) * total
        return min(free + torch.cuda.memory_reserved(index), cap) * HEADROOM
    import psutil  # lazy: 13 ms on every command (this module is on each one's path); only CPU runs ask

    return (psutil.virtual_memory().available + held) * HEADROOM


def longest_batches(job, sizes=(1, 2)) -> tuple[list, Optional[int]]:
    """Two micro-batches made of the longest training samples (the worst case), and their sequence length. A stream
    is searched in its first block only: the rest is not read ahead."""
    n = min(len(job.train_data), job.stream_block or len(job.train_data))
    order = sorted(range(n), key=job.length_of, reverse=True) if job.length_of else list(range(n))
    collate = job.collate_fn or torch.utils.data.default_collate
    batches = []
    for size in sizes:
        idx = order[:1] * size if job.length_of else order[:size]  # same length: repeat the longest sample
        batches.append(collate([job.train_data[i] for i in idx]))
    seq = job.length_of(order[0]) if job.length_of else None
    return batches, seq
