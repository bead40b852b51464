"""Items: what a micro-batch's mean loss averages over — samples, or label tokens (shifted for causal LMs).
The loop weights each micro-batch by its share of the window's items."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def is_causal_lm(model) -> bool:
    """True for HF causal LMs (their loss shifts labels by one), looking through DDP / compile / peft wrappers."""
    seen = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        name = type(model).__name__
        if name.endswith(("ForCausalLM", "LMHeadModel")):
            return True
        model = next((getattr(model, a) for a in ("module", "_orig_mod", "base_model", "model")
                      if isinstance(getattr(model, a, None), torch.nn.Module)), None)
    return False


def count_items(batch, mode: str = "auto", causal: bool = False) -> int:
    """How many items the micro-batch's mean loss averages over.

    ``samples``: the batch's leading dimension. ``tokens``: labels that are not -100. ``shifted_tokens``: the same
    after the one-position shift a causal LM applies (the first label of every row is never predicted).
    ``auto``: token labels (2-D or more) → tokens, shifted when ``causal``; otherwise samples.
    """
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if mode == "auto":
        if isinstance(labels, torch.Tensor) and labels.dim() >= 2:
            mode = "shifted_tokens" if causal else "tokens"
        else:
            mode = "samples"
    if mode == "samples":
        return batch_len(batch)
    if not isinstance(labels, torch.Tensor):
        raise ValueError(f"training.items={mode!r} needs a 'labels' tensor in every batch")
    if mode == "shifted_tokens":
        labels = labels[..., 1:]
    return int((labels != -100).sum())


def batch_len(batch) -> int:
    """Leading dimension of the first tensor found in a (nested) batch."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for v in batch:
            try:
                return batch_len(v)
            except ValueError:
                pass
    raise ValueError("cannot find a tensor in the batch to count its samples")
