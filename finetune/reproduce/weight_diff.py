"""How far two sets of weights are apart: the measures ``finetune compare`` judges the trained weights by (the
largest element's difference; the relative L2 over every weight, less the few elements an adaptive optimizer sends
either way on rounding); a run's saved weights are read by ``runs.Run.weights``."""

from __future__ import annotations

import math

import torch

# For the adaptive optimizers (ADAPTIVE: their per-element normalisation turns rounding-level gradients into
# full-size steps) the relative L2 leaves out this share of the elements, the largest differences: an element whose
# gradient is near zero takes a full step of either sign on rounding. A TRL DPOTrainer baseline on SmolLM2 (LoRA,
# AdamW at 5e-4, fp32, 10 steps) ended with 10 of 460,800 adapter elements about one step (5e-4) apart, 1.25e-4 of
# the L2 with them and 4.8e-5 without, every step's loss and grad norm within the fp32 tolerances
# (benchmarks/README.md).
FLIP_SHARE = 1e-4


def flat(model, trainable_only: bool = False) -> torch.Tensor:
    """The parameters of ``model`` flattened into one fp64 tensor on the CPU; ``trainable_only``: those that train
    (a LoRA model's adapters), as a benchmark of what trains compares them."""
    return torch.cat([p.detach().flatten().double().cpu() for p in model.parameters()
                      if p.requires_grad or not trainable_only])


def rel_diff(a, b, trainable_only: bool = False) -> float:
    """max |a − b| / max |b|: how far weights ``a`` are from ``b``, relative to the largest of ``b``. ``a``, ``b``:
    models (their parameters, see :func:`flat`) or flat tensors.

        >>> rel_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
        0.5
    """
    a = a if isinstance(a, torch.Tensor) else flat(a, trainable_only)
    b = b if isinstance(b, torch.Tensor) else flat(b, trainable_only)
    return float((a - b).abs().max() / b.abs().max())


def weight_differences(wa: dict, wb: dict) -> tuple[float, float, float, int]:
    """(max |a − b| / max |b|, ‖a − b‖₂ / ‖b‖₂, the same without the ``k`` largest element differences, ``k``) over
    all tensors, in fp64, one pass over each; ``k`` is ``FLIP_SHARE`` of the elements, rounded down."""
    k = int(FLIP_SHARE * sum(b.numel() for b in wb.values()))
    diff_max = ref_max = diff_sq = ref_sq = 0.0
    largest = torch.zeros(0, dtype=torch.float64)  # the k largest |a − b| so far
    for name, b in wb.items():
        b = b.double()
        d = wa[name].double() - b
        diff_max, ref_max = max(diff_max, float(d.abs().max())), max(ref_max, float(b.abs().max()))
        diff_sq, ref_sq = diff_sq + float(d.square().sum()), ref_sq + float(b.square().sum())
        if k:
            largest = torch.cat([largest, d.abs().flatten().topk(min(k, d.numel())).values]).topk(
                min(k, largest.numel() + d.numel())).values
    kept, ref = max(diff_sq - float(largest.square().sum()), 0.0), max(math.sqrt(ref_sq), 1e-30)
    return diff_max / max(ref_max, 1e-30), math.sqrt(diff_sq) / ref, math.sqrt(kept) / ref, k



def weight_distance(wa: dict | None, wb: dict, adaptive: bool) -> float:
    """The distance ``compare.weights`` judges: relative L2 for an adaptive optimizer, else the largest element (inf
    when the two cannot be compared)."""
    if wa is None or wa.keys() != wb.keys() or any(wa[k].shape != wb[k].shape for k in wa):
        return math.inf
    biggest, _, l2, _ = weight_differences(wa, wb)
    return l2 if adaptive else biggest
