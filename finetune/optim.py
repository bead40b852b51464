"""Optimizers and their schedules, sized in optimizer steps."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from finetune.config import TrainingConfig
from finetune.errors import ConfigError

EIGHT_BIT = {"adamw8bit": "AdamW8bit", "paged_adamw8bit": "PagedAdamW8bit"}  # training.optimizer → bitsandbytes class


def make_optimizer(params, t: TrainingConfig) -> torch.optim.Optimizer:
    """adamw / sgd / lion / adamw8bit / paged_adamw8bit over the trainable ones of ``params`` (a module or an iterable
    of parameters); no weight decay on biases and norm weights (1-D)."""
    decay, no_decay = [], []
    for p in (params.parameters() if isinstance(params, torch.nn.Module) else params):
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": t.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if t.optimizer == "adamw":
        # The fused kernel (one pass over all parameters): torch's default on a CPU is a loop over the tensors,
        # ~6× slower for MiniLM's 22.7 M parameters. Not with fp16: the GradScaler then hands a fused optimizer its
        # inf check, and Accelerate could no longer tell a skipped step.
        fused = t.mixed_precision != "fp16" and all(p.is_floating_point() for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, lr=t.learning_rate, betas=tuple(t.betas), fused=fused or None)
    if t.optimizer in EIGHT_BIT:
        # bitsandbytes' AdamW with its two moments stored block-wise in 8 bits (tensors under 4096 elements keep
        # fp32 state). The update rounds differently from fp32 AdamW: not the baseline's step (compare says so).
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError(f"training.optimizer: {t.optimizer} needs bitsandbytes (pip install 'finetune[quant]')") \
                from None
        return getattr(bnb.optim, EIGHT_BIT[t.optimizer])(groups, lr=t.learning_rate, betas=tuple(t.betas))
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.learning_rate, momentum=t.momentum)
    from lion_pytorch import Lion

    return Lion(groups, lr=t.learning_rate, betas=tuple(t.betas))


@dataclass
class Optim:
    """One optimizer with its scheduler, parameters and clipping (a GAN has two; most jobs one, named "model")."""

    name: str
    optimizer: torch.optim.Optimizer
    scheduler: object
    params: list
    max_grad_norm: Optional[float]


def lr_scale(t: TrainingConfig, effective: int) -> float:
    """``training.scale_lr``: linear or square-root scaling of the lr from the baseline's batch to this run's."""
    if t.scale_lr == "none":
        return 1.0
    ratio = effective / t.reference_batch_size
    return ratio if t.scale_lr == "linear" else math.sqrt(ratio)


def group_settings(param_groups, t: TrainingConfig) -> dict:
    """name → the training settings of each optimizer a job's ``param_groups`` make (``t`` with the group's
    overrides), or {"model": t} for one optimizer over the whole model."""
    groups = param_groups or {"model": {}}
    return {name: dataclasses.replace(t, **{k: v for k, v in spec.items() if k != "params"})
            for name, spec in groups.items()}


def make_optims(model: torch.nn.Module, param_groups, t: TrainingConfig, total_steps: int,
                scale: float = 1.0) -> list[Optim]:
    """One Optim per ``param_groups`` entry (name → {"params": …, TrainingConfig overrides}), else one over the
    whole model, at ``scale`` × their learning rates. Schedulers come from ``transformers.get_scheduler``, sized
    in optimizer steps."""
    from transformers import get_scheduler

    groups = param_groups or {"model": {"params": model.parameters()}}
    optims = []
    for (name, spec), tg in zip(groups.items(), group_settings(param_groups, t).values()):
        tg = dataclasses.replace(tg, learning_rate=tg.learning_rate * scale)
        params = [p for p in spec["params"] if p.requires_grad]
        optimizer = make_optimizer(params, tg)
        scheduler = get_scheduler(tg.lr_scheduler, optimizer, num_warmup_steps=tg.warmup_steps,
                                  num_training_steps=total_steps)
        optims.append(Optim(name, optimizer, scheduler, params, tg.max_grad_norm))
    return optims
