"""Video regression: a per-frame CNN encoder, a temporal transformer and scalar inputs → one number (the
``video-motion`` recipe).

Data: generated clips of a ball moving at constant speed and bouncing elastically off the walls, filmed at a
frame interval that differs per clip (1/30 to 1/10 s) with sensor noise. The target is the ball's speed in
pixels per second; the frame interval is the scalar input. Neither the frames alone (pixels per frame) nor the
interval alone gives the speed, so the metric — MAE in px/s, beside the MAE of always predicting the training
mean — says whether the model measured the motion.

Memory / speed options: ``checkpoint_frames`` (or ``training.gradient_checkpointing``) encodes each frame under
``torch.utils.checkpoint`` and recomputes its activations in backward; ``training.compile`` compiles the model.
Every layer works per sample (GroupNorm, LayerNorm), so micro-batches add up exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from finetune.config import BaseDataConfig, BaseModelConfig
from finetune.data import split_samples
from finetune.evaluation import load_metric
from finetune.job import Job
from finetune.models.forward import set_dropout
from finetune.schema import doc, in_range

SPEED_SCALE = 100.0  # px/s; the model regresses speed / SPEED_SCALE


@dataclass
class ModelConfig(BaseModelConfig):
    channels: int = doc("channels of the frame encoder's first convolution (then ×2, ×4)", 16, at_least=4)
    dim: int = doc("token width of the temporal transformer", 64, at_least=1)
    layers: int = doc("temporal transformer layers", 2, at_least=1)
    heads: int = doc("attention heads", 4, at_least=1)
    checkpoint_frames: bool = doc("encode each frame under activation checkpointing (recomputed in backward)", False)


@dataclass
class DataConfig(BaseDataConfig):
    clips: int = doc("clips generated (before the split)", 1200, at_least=2)
    frames: int = doc("frames per clip", 8, at_least=2)
    size: int = doc("frame side in pixels", 32, at_least=8)
    min_speed: float = doc("slowest ball, px/s", 20.0, above=0)
    max_speed: float = doc("fastest ball, px/s", 120.0, above=0)
    min_interval: float = doc("shortest frame interval, s", 1 / 30, above=0)
    max_interval: float = doc("longest frame interval, s", 1 / 10, above=0)
    noise: float = doc("sensor noise (standard deviation; the ball's peak is 1)", 0.05)
    generate_seed: int = doc("seed of the generated clips", 0)


def validate(cfg, problems: list) -> None:
    m, d = cfg.model, cfg.data
    # Not field ranges: multiples, and bounds set by another field.
    if ((in_range(m, "channels") and m.channels % 4)
            or (in_range(m, "dim") and in_range(m, "heads") and m.dim % m.heads)):
        problems.append("model.channels must be a multiple of 4 and model.dim a multiple of model.heads")
    if (all(in_range(d, name) for name in ("min_speed", "max_speed", "min_interval", "max_interval"))
            and (d.min_speed > d.max_speed or d.min_interval > d.max_interval)):
        problems.append("data.min_speed <= max_speed and data.min_interval <= max_interval are needed")


# ---------------------------------------------------------------------------------------------------------------
# data


def bounce(p: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """Positions of a point moving freely on a line, folded back into [lo, hi] by elastic reflections."""
    span = hi - lo
    q = torch.remainder(p - lo, 2 * span)
    return lo + torch.where(q > span, 2 * span - q, q)


def make_clips(d: DataConfig) -> list:
    """Samples {"frames": [T, 1, S, S], "scalars": [frame interval (s) / 0.1], "speed": px/s}."""
    g = torch.Generator().manual_seed(d.generate_seed)
    n, T, S, r = d.clips, d.frames, d.size, 1.5
    u = lambda lo, hi: lo + (hi - lo) * torch.rand(n, generator=g)  # noqa: E731
    speed, interval, angle = u(d.min_speed, d.max_speed), u(d.min_interval, d.max_interval), u(0, 2 * math.pi)
    x0, y0 = u(r, S - 1 - r), u(r, S - 1 - r)
    t = torch.arange(T)[None] * interval[:, None]  # [n, T] seconds
    x = bounce(x0[:, None] + speed[:, None] * torch.cos(angle)[:, None] * t, r, S - 1 - r)
    y = bounce(y0[:, None] + speed[:, None] * torch.sin(angle)[:, None] * t, r, S - 1 - r)
    grid = torch.arange(S, dtype=torch.float32)
    frames = torch.exp(-((grid[None, None, None, :] - x[..., None, None]) ** 2
                         + (grid[None, None, :, None] - y[..., None, None]) ** 2) / (2 * r * r))
    frames = frames + d.noise * torch.randn(frames.shape, generator=g)
    return [{"frames": frames[i, :, None], "scalars": (interval[i:i + 1] / 0.1), "speed": speed[i]}
            for i in range(n)]


# ---------------------------------------------------------------------------------------------------------------
# model


class FrameEncoder(nn.Module):
    """One frame → a token. Where things are: K keypoint maps at full resolution, each reduced by a spatial
    soft-argmax to its expected (x, y). What they are: three convolutions (two strided), mean-pooled."""

    def __init__(self, c: int, dim: int, keypoints: int = 8):
        super().__init__()
        self.keypoints = nn.Conv2d(1, keypoints, 5, 1, 2)
        self.sharpness = nn.Parameter(torch.tensor(10.0))  # softmax temperature⁻¹ of the keypoint maps
        self.net = nn.Sequential(nn.Conv2d(1, c, 3, 2, 1), nn.GroupNorm(4, c), nn.SiLU(),
                                 nn.Conv2d(c, 2 * c, 3, 2, 1), nn.GroupNorm(4, 2 * c), nn.SiLU(),
                                 nn.Conv2d(2 * c, 4 * c, 3, 1, 1))
        self.out = nn.Linear(2 * keypoints + 4 * c, dim)

    def forward(self, x):
        k = self.keypoints(x)
        b, n, s, _ = k.shape
        weights = (k.flatten(2) * self.sharpness).softmax(-1).view(b, n, s, s)
        coords = torch.linspace(-1, 1, s, device=x.device, dtype=x.dtype)
        ex, ey = (weights.sum(2) * coords).sum(-1), (weights.sum(3) * coords).sum(-1)
        return self.out(torch.cat([ex, ey, self.net(x).mean((2, 3))], 1))


class VideoRegressor(nn.Module):
    """forward(frames [B, T, 1, S, S], scalars [B, k], speed [B]) → {"loss": mean squared error of speed / 100,
    "pred": px/s}. Trained on squared error (L1 stalls at the median early on); reported as MAE."""

    def __init__(self, m: ModelConfig, frames: int, n_scalars: int = 1):
        super().__init__()
        self.encoder = FrameEncoder(m.channels, m.dim)
        self.scalars = nn.Linear(2 * n_scalars, m.dim)
        self.position = nn.Parameter(torch.zeros(frames + 1, m.dim))
        layer = nn.TransformerEncoderLayer(m.dim, m.heads, 2 * m.dim, dropout=0.1, batch_first=True, norm_first=True)
        self.temporal = nn.TransformerEncoder(layer, m.layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(m.dim), nn.Linear(m.dim, 1))
        self.checkpoint_frames = m.checkpoint_frames

    def encode_frames(self, frames):
        b, t = frames.shape[:2]
        if self.checkpoint_frames and torch.is_grad_enabled():
            # per frame: only the frame is kept for backward; its activations are recomputed there
            return torch.stack([torch.utils.checkpoint.checkpoint(self.encoder, frames[:, i], use_reentrant=False)
                                for i in range(t)], 1)
        return self.encoder(frames.flatten(0, 1)).view(b, t, -1)

    def forward(self, frames, scalars, speed=None):
        tokens = self.encode_frames(frames)
        lead = self.scalars(torch.cat([scalars, 1 / scalars], -1))[:, None]  # interval and rate
        h = self.temporal(torch.cat([lead, tokens], 1) + self.position)
        pred = self.head(h[:, 0]).squeeze(-1) * SPEED_SCALE
        out = {"pred": pred}
        if speed is not None:
            out["loss"] = F.mse_loss(pred / SPEED_SCALE, speed / SPEED_SCALE)  # per-sample terms, averaged
        return out


# ---------------------------------------------------------------------------------------------------------------
# the job


def build(cfg) -> Job:
    m, d = cfg.model, cfg.data
    train, val = split_samples(make_clips(d), d.val_fraction, d.split_seed, d.limit)
    model = VideoRegressor(m, d.frames)
    set_dropout(model, m.dropout)
    mae = load_metric("mae")
    mean_speed = float(torch.stack([s["speed"] for s in train]).mean())

    def eval_step(model, batch, outputs):
        return outputs["pred"].tolist(), batch["speed"].tolist()

    def compute_metrics(preds, refs):
        out = mae.compute(predictions=preds, references=refs)
        out["mae_mean_predictor"] = mae.compute(predictions=[mean_speed] * len(refs), references=refs)["mae"]
        return out

    def checkpoint_frames(model):  # training.gradient_checkpointing
        model.checkpoint_frames = True

    return Job(model=model, train_data=train, val_data=val, eval_step=eval_step, compute_metrics=compute_metrics,
               enable_gradient_checkpointing=checkpoint_frames)
