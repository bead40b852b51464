"""A latent ODE: a velocity network integrated with torchdiffeq's fixed-step solvers (the ``ode-latent`` recipe).

Data: scikit-learn's 1 797 handwritten digits (8×8), upsampled to ``size``×``size`` and encoded by a fixed random
convolution (seeded, never trained) into ``[4, size, size]`` latents ``z0``. The target ``z1`` is ``z0`` after
diffusion: the heat equation ``dz/dt = κ_c Δz`` run for ``diffusion_time`` with a different diffusivity per channel,
solved exactly in Fourier space (periodic borders). The velocity network must learn that flow; the metric is the
MAE of the integrated latent against the exact target, reported beside the MAE of doing nothing.

Loss, per sample and then averaged (so that a micro-batch's loss is a mean over its samples — the loop's condition
for exact accumulation): a sliced Wasserstein distance between the output's and the target's patches (local
texture) plus a content term (MSE to the target). The SWD's random projections and patch subset are drawn from a
generator seeded by the optimizer step, so every micro-batch of a window sees the same ones.

Memory (``model.ode_memory``): ``none`` backpropagates through every solver step (activations grow with the steps),
``checkpoint`` recomputes each step in backward (keeps one latent per step), ``adjoint`` solves the adjoint ODE
backwards (``odeint_adjoint``: memory independent of the steps). Only fixed-step solvers are offered: an adaptive
one picks its steps from an error norm over the whole batch, which couples the samples of a micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from finetune.config import BaseDataConfig, BaseModelConfig
from finetune.data import split_samples
from finetune.evaluation import load_metric
from finetune.job import Job
from finetune.models.forward import set_dropout
from finetune.schema import Needs, always, doc, in_range
from finetune.seeding import step_seed

# scikit-learn (optional: finetune[examples]; 1.6 s) and torchdiffeq (optional: finetune[ode]) are imported in
# the functions that use them: `finetune validate` imports this module to check a recipe.

CHANNELS = 4


@dataclass
class ModelConfig(BaseModelConfig):
    hidden_channels: int = doc("channels of the velocity network's hidden convolutions", 64, at_least=8)
    solver: Literal["euler", "rk4"] = doc("torchdiffeq fixed-step method", "rk4",
                                          needs=Needs(package=("torchdiffeq", "'finetune[ode]'"), when=always))
    ode_integration_steps: int = doc("solver steps from t=0 to t=1", 10, at_least=1)
    ode_memory: Literal["none", "checkpoint", "adjoint"] = doc(
        "none: backprop through every step; checkpoint: recompute each step in backward; adjoint: odeint_adjoint",
        "checkpoint")
    swd_weight: float = doc("weight of the sliced Wasserstein term", 1.0)
    content_weight: float = doc("weight of the content term (MSE to the target latent)", 1.0)
    swd_projections: int = doc("random projections of the SWD (drawn anew every optimizer step)", 32, at_least=1)
    swd_max_samples: int = doc("patches per sample the SWD compares (a subset drawn every optimizer step)", 256,
                               at_least=1)
    swd_patch: int = doc("patch side in latent pixels (stride: half of it)", 4)


@dataclass
class DataConfig(BaseDataConfig):
    size: int = doc("latent side in pixels (digits are upsampled to it)", 32, at_least=8)
    diffusivity: list = doc("heat-equation diffusivity per latent channel (pixels² per unit time)",
                            length=CHANNELS, at_least=0, default_factory=lambda: [0.25, 0.5, 1.0, 2.0])
    diffusion_time: float = doc("how long the target latents diffuse (the ODE runs from t=0 to t=1)", 1.0)
    encoder_seed: int = doc("seed of the fixed random encoder that turns digits into latents", 0)


def validate(cfg, problems: list) -> None:
    m, d = cfg.model, cfg.data
    # Not field ranges: a multiple, a bound set by another field, a combination.
    if in_range(m, "hidden_channels") and m.hidden_channels % 8:
        problems.append(f"model.hidden_channels: got {m.hidden_channels}; must be a multiple of 8 (GroupNorm)")
    if in_range(d, "size") and not 1 <= m.swd_patch <= d.size:
        problems.append(f"model.swd_patch: got {m.swd_patch}; must be in [1, data.size]")
    if m.ode_memory == "adjoint" and m.dropout:
        problems.append("model.dropout: must be 0 or null with ode_memory=adjoint (the backward solve would "
                        "redraw the masks)")


# ---------------------------------------------------------------------------------------------------------------
# data


def heat_flow(z: torch.Tensor, diffusivity, time: float) -> torch.Tensor:
    """Exact solution of ``dz/dt = κ_c Δz`` (5-point Laplacian, periodic borders) after ``time``, per channel."""
    h, w = z.shape[-2:]
    ky = 2 * torch.cos(2 * torch.pi * torch.fft.fftfreq(h, dtype=torch.float64)) - 2
    kx = 2 * torch.cos(2 * torch.pi * torch.fft.fftfreq(w, dtype=torch.float64)) - 2
    eig = ky[:, None] + kx[None, :]  # eigenvalues of the discrete Laplacian, <= 0
    kappa = torch.tensor(diffusivity, dtype=torch.float64)[:, None, None]
    decay = torch.exp(kappa * eig * time)
    return torch.fft.ifft2(torch.fft.fft2(z.double()) * decay).real.to(z.dtype)


def make_latents(d: DataConfig) -> list:
    """Digits → fixed random encoder → (z0, z1 = heat flow of z0) samples."""
    from sklearn.datasets import load_digits

    images = torch.tensor(load_digits().images, dtype=torch.float32)[:, None] / 16.0  # [n, 1, 8, 8] in [0, 1]
    images = F.interpolate(images, size=(d.size, d.size), mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(d.encoder_seed)
    weight = torch.randn(CHANNELS, 1, 3, 3, generator=g) / 3
    bias = torch.randn(CHANNELS, generator=g) * 0.1
    with torch.no_grad():
        z0 = torch.tanh(F.conv2d(F.pad(images, (1, 1, 1, 1), mode="circular"), weight, bias) * 2)
        z1 = heat_flow(z0, d.diffusivity, d.diffusion_time)
    return [{"z0": a, "z1": b} for a, b in zip(z0, z1)]


# ---------------------------------------------------------------------------------------------------------------
# model


class Velocity(nn.Module):
    """f(t, z): convolutions over [z, t] with periodic padding and per-sample GroupNorm (no batch statistics)."""

    def __init__(self, hidden: int):
        super().__init__()

        def conv(i, o):
            return nn.Conv2d(i, o, 3, padding=1, padding_mode="circular")

        self.net = nn.Sequential(conv(CHANNELS + 1, hidden), nn.GroupNorm(8, hidden), nn.SiLU(), nn.Dropout(0.0),
                                 conv(hidden, hidden), nn.GroupNorm(8, hidden), nn.SiLU(), conv(hidden, CHANNELS))
        nn.init.zeros_(self.net[-1].weight)  # start as the identity flow (dz/dt = bias only)
        nn.init.zeros_(self.net[-1].bias)
        self.evaluations = 0  # function evaluations since the last reset (benchmarks read it)

    def forward(self, t, z):
        self.evaluations += 1
        plane = t.to(z.dtype).expand(z.shape[0], 1, *z.shape[2:])
        return self.net(torch.cat([z, plane], 1))


class LatentODE(nn.Module):
    """forward(z0, z1) → {"loss", "swd", "content", "pred"}: integrate z0 from t=0 to 1, compare with z1."""

    def __init__(self, m: ModelConfig, seed: int = 0):
        super().__init__()
        self.velocity = Velocity(m.hidden_channels)
        self.cfg = m
        self.seed = seed
        self.swd_key = -1  # set to the optimizer step before each window; -1 (evaluation) is a fixed draw

    def integrate(self, z0: torch.Tensor) -> torch.Tensor:
        from torchdiffeq import odeint, odeint_adjoint

        m = self.cfg
        grid = torch.linspace(0.0, 1.0, m.ode_integration_steps + 1, device=z0.device, dtype=z0.dtype)
        if m.ode_memory == "checkpoint" and torch.is_grad_enabled():
            z = z0
            for i in range(m.ode_integration_steps):
                z = torch.utils.checkpoint.checkpoint(self._one_step, z, grid[i:i + 2], use_reentrant=False)
            return z
        # Ask for t=0 and t=1 only: a full-grid output would keep one latent per step alive (adjoint included).
        options = {"grid_constructor": lambda func, y0, t: torch.linspace(float(t[0]), float(t[-1]), len(grid),
                                                                          device=t.device, dtype=t.dtype)}
        ends = grid[[0, -1]]
        if m.ode_memory == "adjoint" and torch.is_grad_enabled():
            return odeint_adjoint(self.velocity, z0, ends, method=m.solver, options=options,
                                  adjoint_params=tuple(self.velocity.parameters()))[-1]
        return odeint(self.velocity, z0, ends, method=m.solver, options=options)[-1]

    def _one_step(self, z, span):
        from torchdiffeq import odeint

        # clone: the solution tensor holds both ends; keep only the new latent for the next step's checkpoint
        return odeint(self.velocity, z, span, method=self.cfg.solver)[-1].clone()

    def forward(self, z0, z1):
        z = self.integrate(z0)
        content = (z - z1).pow(2).flatten(1).mean(1)
        key = self.swd_key if self.training else -1  # evaluation: one fixed draw
        swd = sliced_wasserstein(z, z1, self.cfg, torch.Generator().manual_seed(step_seed(self.seed, key)))
        per_sample = self.cfg.content_weight * content + self.cfg.swd_weight * swd
        return {"loss": per_sample.mean(), "swd": swd.mean(), "content": content.mean(), "pred": z}


def sliced_wasserstein(x: torch.Tensor, y: torch.Tensor, m: ModelConfig, generator: torch.Generator) -> torch.Tensor:
    """Per-sample sliced Wasserstein distance (squared, 1-D W2 averaged over projections) between the patches of
    ``x[i]`` and those of ``y[i]``. The projections and the patch subset come from ``generator`` and are the same
    for every sample, so a sample's value doesn't depend on which micro-batch it is in. Returns shape ``[B]``."""
    stride = max(1, m.swd_patch // 2)
    px = F.unfold(x, m.swd_patch, stride=stride)  # [B, C·p·p, L]
    py = F.unfold(y, m.swd_patch, stride=stride)
    dim, count = px.shape[1], px.shape[2]
    proj = torch.randn(dim, m.swd_projections, generator=generator)
    proj = (proj / proj.norm(dim=0, keepdim=True)).to(x)
    keep = torch.randperm(count, generator=generator)[:m.swd_max_samples].to(x.device)
    sx = torch.einsum("bdl,dk->blk", px[:, :, keep], proj).sort(dim=1).values
    sy = torch.einsum("bdl,dk->blk", py[:, :, keep], proj).sort(dim=1).values
    return (sx - sy).pow(2).flatten(1).mean(1)


# ---------------------------------------------------------------------------------------------------------------
# the job


def build(cfg) -> Job:
    m, d = cfg.model, cfg.data
    train, val = split_samples(make_latents(d), d.val_fraction, d.split_seed, d.limit)
    model = LatentODE(m, seed=cfg.training.seed)
    set_dropout(model, m.dropout)
    mae = load_metric("mae")
    # what doing nothing scores: the gap the ODE has to close
    identity = float(torch.stack([(s["z0"] - s["z1"]).abs().mean() for s in val]).mean()) if val else float("nan")

    def before_window(state):  # one SWD draw per optimizer step, whatever N
        model.swd_key = state.optimizer_step

    def eval_step(model, batch, outputs):
        return outputs["pred"].flatten().tolist(), batch["z1"].flatten().tolist()

    def compute_metrics(preds, refs):
        out = mae.compute(predictions=preds, references=refs)
        return {**out, "mae_identity": identity, "gap_closed": 1 - out["mae"] / identity}

    def checkpoint_steps(model):  # training.gradient_checkpointing: recompute every solver step
        model.cfg.ode_memory = "checkpoint"

    return Job(model=model, train_data=train, val_data=val, before_window=before_window, eval_step=eval_step,
               compute_metrics=compute_metrics, enable_gradient_checkpointing=checkpoint_steps)
