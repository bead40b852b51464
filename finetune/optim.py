"""Optimizers (made from the table in ``finetune.optimizers``) and their schedules, sized in optimizer steps."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from finetune.config import OptimizerSettings, TrainingConfig
from finetune.optimizers import OPTIMIZERS


def make_optimizer(params, t: TrainingConfig) -> torch.optim.Optimizer:
    """``t.optimizer`` (an entry of ``finetune.optimizers.OPTIMIZERS``) over the trainable ones of ``params`` (a
    module or an iterable of parameters); no weight decay on biases and norm weights (1-D)."""
    decay, no_decay = [], []
    for p in (params.parameters() if isinstance(params, torch.nn.Module) else params):
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [g for g in ({"params": decay, "weight_decay": t.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return OPTIMIZERS[t.optimizer].make(groups, t)


@dataclass
class Optim:
    """One optimizer with its scheduler, parameters and clipping (a GAN has two; most jobs one, named "model")."""

    name: str
    optimizer: torch.optim.Optimizer
    scheduler: object
    params: list
    max_grad_norm: Optional[float]


def lr_scale(o: OptimizerSettings, effective: int) -> float:
    """``training.scale_lr``: linear or square-root scaling of the lr from the baseline's batch to this run's."""
    if o.scale_lr == "none":
        return 1.0
    ratio = effective / o.reference_batch_size
    return ratio if o.scale_lr == "linear" else math.sqrt(ratio)


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
    from transformers import get_scheduler  # lazy: 3 s on every command (this module is on each one's path)

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
