"""A convolutional VAE on real digits, with an optional discriminator, R1 penalty and perceptual loss (the
``vae-digits`` recipe).

Data: scikit-learn's 1 797 handwritten digits (8×8, grey levels 0–16), upsampled to 16×16 and scaled to [-1, 1].

One loss drives two optimizers (``Job.param_groups``): the generator (encoder + decoder) and the discriminator.
Each term reaches one side only — the generator's adversarial term goes through the discriminator with detached
parameters, the discriminator sees the reconstruction detached — so each optimizer steps on its own gradient.

Schedules are keyed on optimizer steps through ``before_window``, so they are the same for any N:
* KL warm-up: the KL weight is ``kl_weight × min(1, optimizer_step / kl_warmup_steps)``;
* lazy R1: on windows where ``optimizer_step % r1_interval == 0`` the discriminator's loss gets
  ``r1_interval × r1_gamma / 2 × |∇ₓ D(x)|²`` on real images (scaled by the interval, so its average strength
  doesn't depend on it). The input gradient is taken with ``create_graph`` and no ``retain_graph``: the graph lives
  until the loss's backward and nothing keeps it after the micro-step.

The reparameterisation noise of sample ``i`` at optimizer step ``s`` comes from a generator seeded by
(training seed, s, i): the same whichever micro-batch the sample lands in.

The perceptual term compares fixed features of the reconstruction and the image. ``perceptual: edges`` is a built-in
fixed filter bank (Sobel at two scales); ``perceptual: package.module:factory`` plugs in any feature network (e.g.
LPIPS or VGG features where their weights are available): ``factory()`` returns an ``nn.Module`` mapping
``[B, 1, H, W]`` images in [-1, 1] to a tensor or a list of tensors. Its parameters are frozen; with
``checkpoint_perceptual`` (or ``training.gradient_checkpointing``) its activations are recomputed in backward.

Metrics: pixel MAE of the reconstructions in the digits' grey levels (0–16, at 8×8), and the accuracy of a
5-nearest-neighbour digit classifier (over the training images) on the reconstructions — beside its accuracy
on the real images, the ceiling.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from finetune.config import BaseDataConfig, BaseModelConfig
from finetune.data import split_samples
from finetune.errors import ConfigError
from finetune.evaluation import load_metric
from finetune.job import Job
from finetune.models.forward import set_dropout
from finetune.schema import doc, in_range
from finetune.seeding import step_seed

# scikit-learn (optional: finetune[examples]; 2 s) is imported in the functions that use it: `finetune validate`
# imports this module to check a recipe.

SIDE = 16


@dataclass
class ModelConfig(BaseModelConfig):
    channels: int = doc("channels of the first convolution (the second has twice as many)", 32, at_least=8)
    latent_dim: int = doc("VAE latent dimensions", 16, at_least=1)
    kl_weight: float = doc("KL weight after the warm-up (1: the ELBO with per-pixel variance 1/2)", 1.0, at_least=0)
    kl_warmup_steps: int = doc("optimizer steps over which the KL weight rises linearly from 0 (0: no warm-up)", 100,
                               at_least=0)
    gan: bool = doc("train a discriminator and add an adversarial term to the generator", True)
    adv_weight: float = doc("weight of the generator's adversarial term", 0.05, at_least=0)
    d_channels: int = doc("channels of the discriminator's first convolution", 32, at_least=8)
    d_learning_rate: Optional[float] = doc("discriminator learning rate (null: training.learning_rate)", None)
    d_betas: list = doc("discriminator adamw betas", length=2, at_least=0, below=1,
                         default_factory=lambda: [0.5, 0.999])
    r1_gamma: float = doc("R1 penalty strength γ (0: off)", 1.0, at_least=0)
    r1_interval: int = doc("apply R1 on windows where optimizer_step % r1_interval == 0 (optimizer steps)", 4,
                           at_least=1)
    perceptual: str = doc("none, edges (built-in fixed filter bank) or package.module:factory", "edges")
    perceptual_weight: float = doc("weight of the perceptual term", 0.5, at_least=0)
    checkpoint_perceptual: bool = doc("recompute the feature network's activations in backward", False)


@dataclass
class DataConfig(BaseDataConfig):
    pass


def validate(cfg, problems: list) -> None:
    m = cfg.model
    # Not field ranges: multiples, and a name that must have a given shape.
    if any(in_range(m, name) and getattr(m, name) % 8 for name in ("channels", "d_channels")):
        problems.append("model.channels / model.d_channels: must be multiples of 8 (GroupNorm)")
    if m.perceptual not in ("none", "edges") and ":" not in m.perceptual:
        problems.append(f"model.perceptual: got {m.perceptual!r}; allowed: none, edges, package.module:factory")


# ---------------------------------------------------------------------------------------------------------------
# data


def load_images():
    """(images [n, 1, 16, 16] in [-1, 1], labels [n]) from scikit-learn's digits."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 8.0 - 1.0
    images = F.interpolate(images, size=(SIDE, SIDE), mode="bilinear", align_corners=False)
    return images, torch.tensor(digits.target)


def to_grey_levels(images: torch.Tensor) -> torch.Tensor:
    """[B, 1, 16, 16] in [-1, 1] → [B, 64]: back to the digits' 8×8 grid and 0–16 grey levels."""
    return ((F.avg_pool2d(images, 2) + 1) * 8).flatten(1)


# ---------------------------------------------------------------------------------------------------------------
# model


def _gn(c):
    return nn.GroupNorm(8, c)


class EdgeFeatures(nn.Module):
    """A fixed perceptual feature bank: Sobel x/y responses at full and half resolution (no parameters)."""

    def __init__(self):
        super().__init__()
        sobel = torch.tensor([[1.0, 0.0, -1.0], [2.0, 0.0, -2.0], [1.0, 0.0, -1.0]]) / 8  # unit slope → 1
        self.register_buffer("kernel", torch.stack([sobel, sobel.T])[:, None], persistent=False)

    def forward(self, x):
        return [F.conv2d(x, self.kernel, padding=1), F.conv2d(F.avg_pool2d(x, 2), self.kernel, padding=1)]


def feature_network(spec: str) -> Optional[nn.Module]:
    if spec == "none":
        return None
    if spec == "edges":
        return EdgeFeatures()
    module, _, name = spec.partition(":")
    try:
        net = getattr(importlib.import_module(module), name)()
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"model.perceptual: cannot load {spec!r} ({e})") from None
    return net.requires_grad_(False).eval()


class Discriminator(nn.Module):
    """Per-sample (no batch statistics), so R1's input gradient of D(x).sum() is each sample's own."""

    def __init__(self, c: int):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, c, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(c, 2 * c, 4, 2, 1),
                                 nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(2 * c * (SIDE // 4) ** 2, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)


class VAEGAN(nn.Module):
    """forward(image, index, label) → {"loss", "recon", "kl", "kl_weight", "perceptual", "adv", "d_loss", "r1",
    "reconstruction"}; the 0-dim terms are logged per optimizer step."""

    def __init__(self, m: ModelConfig, seed: int = 0):
        super().__init__()
        c, z, q = m.channels, m.latent_dim, SIDE // 4
        self.encoder = nn.Sequential(nn.Conv2d(1, c, 3, 2, 1), _gn(c), nn.SiLU(), nn.Conv2d(c, 2 * c, 3, 2, 1),
                                     _gn(2 * c), nn.SiLU(), nn.Flatten(), nn.Dropout(0.0),
                                     nn.Linear(2 * c * q * q, 2 * z))
        self.decoder = nn.Sequential(nn.Linear(z, 2 * c * q * q), nn.Unflatten(1, (2 * c, q, q)), nn.SiLU(),
                                     nn.ConvTranspose2d(2 * c, c, 4, 2, 1), _gn(c), nn.SiLU(),
                                     nn.ConvTranspose2d(c, 1, 4, 2, 1), nn.Tanh())
        self.disc = Discriminator(m.d_channels) if m.gan else None
        self.features = feature_network(m.perceptual)
        self.cfg, self.seed = m, seed
        # set by before_window from the optimizer step
        self.step, self.kl_now, self.r1_now = 0, 0.0, False

    def generator_parameters(self):
        return [*self.encoder.parameters(), *self.decoder.parameters()]

    def noise(self, index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Reparameterisation noise: row i from a generator seeded by (seed, optimizer step, sample index)."""
        return torch.stack([torch.randn(like.shape[1], generator=torch.Generator().manual_seed(
            step_seed(self.seed, self.step, i))) for i in index.tolist()]).to(like)

    def perceptual(self, fake, real):
        def distance(x):
            feats = self.features(x)
            feats = feats if isinstance(feats, (list, tuple)) else [feats]
            with torch.no_grad():
                targets = self.features(real)
                targets = targets if isinstance(targets, (list, tuple)) else [targets]
            return sum((f - t).pow(2).flatten(1).mean(1) for f, t in zip(feats, targets)) / len(feats)

        if self.cfg.checkpoint_perceptual and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(distance, fake, use_reentrant=False)
        return distance(fake)

    def forward(self, image, index, label=None):
        m = self.cfg
        mu, logvar = self.encoder(image).chunk(2, dim=1)
        z = mu + (0.5 * logvar).exp() * self.noise(index, mu) if self.training else mu
        fake = self.decoder(z)
        zero = image.new_zeros(image.shape[0])
        # per-sample terms (pixel means; KL in nats per pixel), averaged over the micro-batch at the end
        recon = (fake - image).pow(2).flatten(1).mean(1)
        kl = 0.5 * (mu.pow(2) + logvar.exp() - 1 - logvar).sum(1) / image[0].numel()
        perc = self.perceptual(fake, image) if self.features is not None else zero
        adv = d_loss = r1 = zero
        if self.disc is not None:
            frozen = {k: v.detach() for k, v in self.disc.named_parameters()}
            adv = F.softplus(-torch.func.functional_call(self.disc, frozen, (fake,)))  # no gradient to D
            real = image.detach().requires_grad_(self.r1_now and torch.is_grad_enabled())
            d_real = self.disc(real)
            d_loss = F.softplus(-d_real) + F.softplus(self.disc(fake.detach()))  # no gradient to G
            if real.requires_grad:
                (grad,) = torch.autograd.grad(d_real.sum(), real, create_graph=True)
                r1 = m.r1_interval * m.r1_gamma / 2 * grad.pow(2).flatten(1).sum(1)
        generator = recon + self.kl_now * kl + m.perceptual_weight * perc + m.adv_weight * adv
        per_sample = generator + d_loss + r1
        return {"loss": per_sample.mean(), "recon": recon.mean(), "kl": kl.mean(),
                "kl_weight": image.new_tensor(float(self.kl_now)), "perceptual": perc.mean(), "adv": adv.mean(),
                "d_loss": d_loss.mean(), "r1": r1.mean(), "reconstruction": fake}


# ---------------------------------------------------------------------------------------------------------------
# the job


def kl_weight_at(m: ModelConfig, optimizer_step: int) -> float:
    """The KL weight for the window after ``optimizer_step`` updates."""
    if m.kl_warmup_steps == 0:
        return m.kl_weight
    return m.kl_weight * min(1.0, optimizer_step / m.kl_warmup_steps)


def build(cfg) -> Job:
    from sklearn.neighbors import KNeighborsClassifier

    m, d = cfg.model, cfg.data
    images, labels = load_images()
    samples = [{"image": x, "index": torch.tensor(i), "label": y} for i, (x, y) in enumerate(zip(images, labels))]
    train, val = split_samples(samples, d.val_fraction, d.split_seed, d.limit)
    model = VAEGAN(m, seed=cfg.training.seed)
    set_dropout(model, m.dropout)

    def before_window(state):  # schedules keyed on optimizer steps: the same for any N
        model.step = state.optimizer_step
        model.kl_now = kl_weight_at(m, state.optimizer_step)
        model.r1_now = m.gan and m.r1_gamma > 0 and state.optimizer_step % m.r1_interval == 0

    groups = {"generator": {"params": model.generator_parameters()}}
    if m.gan:
        groups["discriminator"] = {"params": list(model.disc.parameters()), "betas": list(m.d_betas),
                                   **({"learning_rate": m.d_learning_rate} if m.d_learning_rate else {})}

    # a digit classifier over the training images: does a reconstruction keep its digit?
    train_x = torch.stack([s["image"] for s in train])
    classifier = KNeighborsClassifier(n_neighbors=5).fit(to_grey_levels(train_x).numpy(),
                                                         torch.stack([s["label"] for s in train]).numpy())
    mae, accuracy = load_metric("mae"), load_metric("accuracy")

    def eval_step(model, batch, outputs):
        fake, real = to_grey_levels(outputs["reconstruction"]).cpu(), to_grey_levels(batch["image"]).cpu()
        return list(zip(fake.tolist(), real.tolist())), batch["label"].tolist()

    def compute_metrics(preds, refs):
        fake = [p for f, _ in preds for p in f]
        real = [p for _, r in preds for p in r]
        out = mae.compute(predictions=fake, references=real)
        guess = classifier.predict([f for f, _ in preds]).tolist()
        out["recon_accuracy"] = accuracy.compute(predictions=guess, references=refs)["accuracy"]
        out["real_accuracy"] = accuracy.compute(predictions=classifier.predict([r for _, r in preds]).tolist(),
                                                references=refs)["accuracy"]
        return out

    def checkpoint_perceptual(model):  # training.gradient_checkpointing
        model.cfg.checkpoint_perceptual = True

    return Job(model=model, train_data=train, val_data=val, param_groups=groups, before_window=before_window,
               eval_step=eval_step, compute_metrics=compute_metrics,
               enable_gradient_checkpointing=checkpoint_perceptual)
