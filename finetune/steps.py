"""One window's micro-steps and the optimizer step after them — every line that changes the numbers.

A window's accumulated gradient must be the gradient of the mean loss over all its items (samples or label tokens,
on every process), whatever the tail, the micro-batch size, the token budget or N. So each micro-batch's mean loss
is weighted by its share of the window's items, counted over every process before the first backward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from accelerate.utils import send_to_device

from finetune import distributed
from finetune.items import batch_len
from finetune.memory.measure import fake_oom_check
from finetune.models.forward import compute_loss, offload_activations


class NonFiniteError(RuntimeError):
    """A window produced a non-finite loss or gradient and ``training.on_nonfinite`` is ``stop``."""


def loss_weight(items: int, window_items: int, processes: int) -> float:
    """Factor for one micro-batch's mean loss so that the window's accumulated gradient is the gradient of the
    mean loss over all the window's items (every process, every micro-batch).

    * ``items / window_items`` — the micro-batch's share. (Accelerate's ``accumulate()`` divides every loss by N
      instead: right only for N equal micro-batches, so a short tail window or a short micro-batch would be
      mis-weighted. Our Accelerator has N = 1 and divides by nothing.)
    * ``× processes`` — DDP / FSDP / DeepSpeed average gradients over processes; the window needs their sum (under
      fp16's loss scale it multiplies the summed gradients instead: ``accumulate_window``).
    """
    return items / window_items * processes


def token_counts(batch) -> tuple:
    """(real, padded) tokens of a text micro-batch from its attention mask; (0, 0) for other batches."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor):
        return 0, 0
    return int(mask.sum()), mask.numel()


@dataclass
class WindowResult:
    """What one window's micro-steps produced: counts over every process, losses of this process."""

    items: int
    real_tokens: int
    padded_tokens: int
    micro_steps: int                           # micro-batches run on this process (placeholders included)
    loss: torch.Tensor                          # item-weighted mean loss of this process's share
    extras: dict = field(default_factory=dict)  # other loss terms, weighted the same way


def pad_to_window(accelerator, micro_batches: list, targets=None) -> list:
    """Each text micro-batch (a mapping with a 2-D ``attention_mask``) right-padded to the window's longest sample,
    over every process: its ``attention_mask`` and every other tensor as long as it along dim 1 (``labels`` with
    -100, the rest with 0; the padding is masked out). Under bf16 a sample's numbers depend on the padded length it
    runs at (up to 5e-3 in its loss), and the big batch runs every sample at the window's longest; other batches
    are returned as they are. ``targets`` (``Window.pad_lengths``, ``training.replay_padding``): each micro-batch's
    own length instead, the one its baseline micro-batch was padded to."""
    lengths = [b["attention_mask"].shape[1] if isinstance(b, Mapping) and isinstance(b.get("attention_mask"),
                                                                                    torch.Tensor)
               and b["attention_mask"].dim() == 2 else None for b in micro_batches]
    if any(n is None for n in lengths):
        return micro_batches
    if targets is None:
        longest = max(lengths)
        if accelerator.num_processes > 1:
            longest = int(accelerator.reduce(torch.tensor(longest, device=accelerator.device), "max"))
        targets = [longest] * len(lengths)
    if any(n > t for n, t in zip(lengths, targets)):
        # the lengths the task gave (Job.length_of) are not its collated rows': the baseline's padding is unknown
        raise RuntimeError(f"training.replay_padding: a micro-batch of {max(lengths)} tokens is longer than the "
                           f"{min(targets)} its baseline micro-batch was padded to (the task's sample lengths)")
    return [{k: _right_pad(v, n, t, -100 if k == "labels" else 0) for k, v in b.items()}
            for b, n, t in zip(micro_batches, lengths, targets)]


def _right_pad(value, length: int, longest: int, fill: int):
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != length or length == longest:
        return value
    pad = value.new_full((value.shape[0], longest - length, *value.shape[2:]), fill)
    return torch.cat([value, pad], dim=1)


def count_window(accelerator, window, micro_batches, counter, divisor=None) -> tuple[list, list, int, int, int]:
    """Items per micro-batch of this process, what each one's loss is divided by, and the window's items (what its
    loss is divided by: ``divisor``'s counts when given, ``training.loss_divisor``) / real / padded tokens over every
    process (one all-reduce, before the first backward). Each micro-batch's loss is divided by the window's items;
    with ``window.groups`` (``training.process_mean``) by its baseline process's items × their number: the mean of
    each one's own mean."""
    counts = [counter(b) if active else 0 for b, active in zip(micro_batches, window.active)]
    tokens = window.token_counts or [token_counts(b) if active else (0, 0)  # packed: known from the plan
                                     for b, active in zip(micro_batches, window.active)]
    divided = [divisor(b) if active else 0 for b, active in zip(micro_batches, window.active)] if divisor else counts
    shares = [0] * window.group_count
    for g, d in zip(window.groups or (), divided):
        shares[g] += d
    totals = [sum(divided), sum(r for r, _ in tokens), sum(p for _, p in tokens), *shares]
    if accelerator.num_processes > 1:
        totals = accelerator.reduce(torch.tensor(totals, device=accelerator.device), "sum").tolist()
    window_items, real, padded = (int(x) for x in totals[:3])
    shares = [int(x) for x in totals[3:]]
    per_micro_batch = [shares[g] * len(shares) for g in window.groups] if window.groups else \
        [window_items] * len(counts)
    return counts, per_micro_batch, window_items, real, padded


@dataclass(frozen=True)
class Backward:
    """What every window's forwards and backwards are computed with, the same for the whole run: the Accelerator,
    the model (its prepared wrapper, and ``forward_model``: what the loss is asked of), the job's loss and item
    counter; ``offload``: activations saved for backward wait in host memory (``training.activation_offloading``);
    ``divisor``: what a window's summed loss is divided by (``training.loss_divisor``'s count; None: its items);
    ``scaler``: fp16's loss scale (``distributed.loss_scaler``), the same for every micro-batch; ``dropout_keys``:
    whose masks the model's keyed dropout draws (``models.dropout``), told each micro-batch's samples."""

    accelerator: Any
    model: Any
    forward_model: Any
    loss_fn: Callable
    counter: Any
    offload: bool = False
    divisor: Any = None
    scaler: Any = None
    dropout_keys: Any = None


def accumulate_window(b: Backward, window, micro_batches) -> WindowResult:
    """Forward and backward every micro-batch of one window, each weighted by its share of the window's items (of
    the window's ``b.divisor`` count, when given); gradients are all-reduced once, on the last micro-batch."""
    accelerator, model, forward_model, loss_fn, offload, scaler = (b.accelerator, b.model, b.forward_model,
                                                                   b.loss_fn, b.offload, b.scaler)
    counts, shares, window_items, real, padded = count_window(accelerator, window, micro_batches, b.counter,
                                                              b.divisor)
    device, last = accelerator.device, len(micro_batches) - 1
    window_loss, window_extras = torch.zeros((), device=device), {}
    # The process factor goes into each loss, or, under fp16's loss scale, onto the gradients once they are summed:
    # in the loss it would scale every fp16 gradient of the backward by the process count, which would then
    # overflow at 1/P of the scale a one-process run of the same window overflows at, and skip other steps.
    processes = accelerator.num_processes
    on_gradients = scaler is not None and processes > 1
    keys = b.dropout_keys
    if keys is not None:  # each sample's dropout masks from its own key, whichever micro-batch holds it
        keys.window(window.epoch, window.samples)
    for i, (batch, items, share) in enumerate(zip(micro_batches, counts, shares)):
        fake_oom_check(batch_len(batch))  # test hook (FINETUNE_FAKE_OOM_ABOVE); a no-op otherwise
        if keys is not None:
            keys.see(window.micro_batches[i])
        with distributed.sync_gradients(accelerator, model, sync=i == last):
            # The outputs (a language model's logits) are not kept: held, they would stay allocated through this
            # backward and the next micro-batch's forward.
            with offload_activations(offload):
                loss, extras = compute_loss(forward_model, send_to_device(batch, device), loss_fn)[:2]
            # A weight-0 placeholder (or an item-less micro-batch) must add exact zeros, not 0 × NaN.
            weighted = loss * loss_weight(items, share, 1 if on_gradients else processes) if items \
                else torch.nan_to_num(loss, 0.0, 0.0, 0.0) * 0.0
            distributed.backward(accelerator, weighted, sync=i == last, scaler=scaler)
        # The logged loss: the same item-weighted mean, without the process factor. Every term is entered even from
        # a placeholder (as 0), so that each process sums the same terms over processes.
        for k in extras:
            window_extras.setdefault(k, torch.zeros((), device=device))
        if items:
            window_loss += loss.detach().float() * (items / share)
            for k, v in extras.items():
                window_extras[k] += v.detach().float() * (items / share)
    if keys is not None:
        keys.clear()
    if on_gradients:
        scale_gradients(model, processes)
    return WindowResult(window_items, real, padded, len(micro_batches), window_loss, window_extras)


@torch.no_grad()
def scale_gradients(model, factor: int) -> None:
    """Multiply every gradient of ``model`` by ``factor`` (the process count: the all-reduce averaged them)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)


def whole(norm):
    """A norm as a plain tensor: over FSDP2's sharded gradients torch returns it as a (replicated) DTensor."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@dataclass(frozen=True)
class Update:
    """What one optimizer step did: the total grad norm before clipping and the lr, per optimizer; whether the update
    was skipped (a non-finite gradient, or fp16's overflow); fp16's loss scale the window was backpropagated at."""

    norms: list
    skipped: bool
    lrs: list
    loss_scale: float | None = None


def optimizer_step(accelerator, optims: list, on_nonfinite: str, step: int, window, scaler=None) -> Update:
    """Unscale → grad norm → clip → step → scheduler → zero_grad, for each optimizer. ``step`` is the number of
    the update being taken (for messages); ``on_nonfinite``: ``training.on_nonfinite``; ``scaler``: fp16's loss
    scale (``distributed.loss_scaler``; default Accelerate's, if any)."""
    scaler = accelerator.scaler if scaler is None else scaler
    if distributed.own_scaler(accelerator, scaler):  # Accelerate's clip_grad_norm_ unscales only its own
        for o in optims:
            scaler.unscale_(torch_optimizer(o))
    norms = []
    for i, o in enumerate(optims):
        # the gradients are unscaled first (GradScaler.unscale_, for every optimizer at once, once per window: the
        # accumulated gradient; Accelerate's clip_grad_norm_ does it with its own), so the norm and the clip are in
        # true units; with clipping off, max_norm=inf still returns the total norm and leaves the gradients as they are.
        max_norm = o.max_grad_norm if o.max_grad_norm is not None else math.inf
        clip = accelerator.clip_grad_norm_ if i == 0 else torch.nn.utils.clip_grad_norm_
        norms.append(clip(o.params, max_norm))
    # DeepSpeed's engine reports no norm when it does not clip: unknown (NaN in the history), not non-finite
    known = [n is not None for n in norms]
    norms = torch.stack([torch.as_tensor(whole(n) if k else math.nan, dtype=torch.float32).cpu()
                         for n, k in zip(norms, known)]).tolist()  # one host sync
    lrs = [o.optimizer.param_groups[0]["lr"] for o in optims]
    scale = None
    if scaler is not None:
        scale, skipped = scaled_step(scaler, optims)
    elif all(math.isfinite(n) for n, k in zip(norms, known) if k):
        for o in optims:
            o.optimizer.step()
        skipped = False
    elif on_nonfinite == "skip":
        skipped = True
    else:
        bad = ", ".join(f"{o.name} {n}" for o, n in zip(optims, norms) if not math.isfinite(n))
        raise NonFiniteError(
            f"non-finite gradient (norm {bad if len(optims) > 1 else norms[0]}) at optimizer step "
            f"{step} (epoch {window.epoch}, window {window.index}); set "
            "training.on_nonfinite=skip to drop such windows")
    for o in optims:
        if not skipped:  # a skipped update is not a step of the schedule (the Trainer's fp16 loop neither)
            o.scheduler.step()
        o.optimizer.zero_grad(set_to_none=True)
    return Update(norms, skipped, lrs, scale)


def scaled_step(scaler, optims: list) -> tuple[float, bool]:
    """fp16: each optimizer stepped through the GradScaler (which skips an update whose unscaled gradient holds an
    inf or NaN), then the scale updated once for the step — halved after an overflow, else grown on schedule.
    Returns (the scale the window was backpropagated at, whether the step was skipped). Not Accelerate's optimizer
    step: it updates the scale after each optimizer, so a second optimizer would see a scale its gradients were not
    scaled by."""
    scale = scaler.get_scale()
    for o in optims:
        scaler.step(torch_optimizer(o))
    scaler.update()
    return scale, scaler.get_scale() < scale  # the scale falls only on an overflow


def torch_optimizer(o):
    """The torch optimizer of ``o`` (an ``Optim``), inside Accelerate's wrapper when it is prepared."""
    return getattr(o.optimizer, "optimizer", o.optimizer)
