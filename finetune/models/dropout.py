"""Dropout keyed by sample: each sample's mask is a function of the run's seed, the sample's epoch, the sample, the
layer and the element's place in the sample — not of the micro-batch it rides in, nor of what ran before it.

torch's dropout draws a micro-batch's masks from the global generator in the order the layers run, so one
micro-batch of 4 and two of 2 draw other masks for the same samples, and the layouts of a run take other steps with
dropout on. Keyed, every layout (micro-batch × accumulation × processes) draws the same masks: the steps agree to
fp32 rounding, a layer that gradient checkpointing recomputes in backward draws the mask its forward drew, and a
resumed run the uninterrupted one's.

Each row's mask is drawn by a generator seeded with the (row, layer) key, at a shape the layout does not change:
the row's own shape, its sequence (second) dimension lengthened to the window's longest sample where the loop pads
text (a generator's draws for an element depend on the tensor's size on a GPU), then cut to the micro-batch's padded
length. What is keyed: every ``nn.Dropout`` module with p > 0 applied to a tensor whose first dimension is the
micro-batch's rows (LoRA's, residual and embedding dropout, a custom model's). What is not: dropout inside an
attention kernel (its probability passed to ``scaled_dot_product_attention``), and a module applied to another
shape; those fall back to torch's draw.
"""

from __future__ import annotations

import hashlib

import torch

from finetune.seeding import step_seed


def name_key(name: str) -> int:
    """A layer's key from its name, the same in every process and Python session."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def row_seed(row: int, layer: int) -> int:
    """The generator seed of one row at one layer: 32 bits, as a CPU generator keeps only a seed's low 32."""
    return step_seed(row, layer) & 0xFFFFFFFF


class SampleKeys:
    """The keys of the rows the model's next forward sees, one per row, and the length its text rows are drawn at:
    set by the loop (``window`` once per window, ``see`` before each micro-batch: their one writer) and read by every
    ``KeyedDropout`` of the model. A plain object, not a context variable: on a GPU, backward (and the layers
    checkpointing recomputes there) runs on autograd's own threads. Host integers only: seeding a generator needs
    no sync."""

    def __init__(self, seed: int, length_of=None):
        self.seed, self.length_of = seed, length_of  # length_of: sample index → tokens (None: not text)
        self.layers = 0      # how many layers read these keys (the banner says it)
        self.unkeyed = ""    # the attention dropout left to torch's draw (the banner says it)
        self.epoch = 0
        self.rows = None     # a key per row; None outside the loop
        self.generators = {}  # one per device, shared by the layers: reseeded for every row they draw
        self.length = None   # what text rows are drawn at (None: each row at its own shape)

    def window(self, epoch: int, samples) -> None:
        """A window starts: its epoch, and its longest sample rounded up to 64 tokens (room for a collator's
        ``pad_to_multiple_of``): no micro-batch of the window, in any layout, is padded past it."""
        self.epoch = epoch
        longest = max(map(self.length_of, samples)) if self.length_of is not None and samples else None
        self.length = -(-longest // 64) * 64 if longest else None

    def see(self, rows) -> None:
        """``rows``: the micro-batch's sample indices in row order (a packed row: its samples' tuple)."""
        self.rows = [step_seed(self.seed, self.epoch, *(r if isinstance(r, tuple) else (r,))) for r in rows]

    def clear(self) -> None:
        self.rows = None

    def generator(self, device: torch.device) -> torch.Generator:
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device)
        return self.generators[device]


class KeyedDropout(torch.nn.Dropout):
    """``nn.Dropout`` whose mask for each row is drawn from its ``SampleKeys`` key and this layer's name; torch's
    own draw where no keys are set (outside the loop) or the input's rows are not the micro-batch's."""

    def __init__(self, p: float, name: str, keys: SampleKeys):
        super().__init__(p)
        self.layer = name_key(name)
        self.keys = keys  # shared with the model's other keyed layers and the loop (not a submodule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, length = self.keys.rows, self.keys.length
        if not self.training or self.p == 0 or rows is None or x.dim() < 2 or x.shape[0] != len(rows):
            return super().forward(x)
        shape = list(x.shape[1:])
        if length is not None and x.dim() >= 3 and shape[0] <= length:  # [rows, tokens, …]: drawn at the window's
            shape[0] = length
        keep = torch.empty((len(rows), *shape), dtype=x.dtype, device=x.device)
        g = self.keys.generator(x.device)
        for i, row in enumerate(rows):
            g.manual_seed(row_seed(row, self.layer))
            keep[i].bernoulli_(1 - self.p, generator=g)
        return x * (keep[:, :x.shape[1]] / (1 - self.p))


def key_by_sample(model: torch.nn.Module, seed: int, length_of=None):
    """Replace every ``nn.Dropout`` of ``model`` with p > 0 by a ``KeyedDropout``, keyed from ``seed``
    (``length_of``: sample index → tokens, for text). Returns the ``SampleKeys`` the loop sets, or None where the
    model has no such layer."""
    keys, found = SampleKeys(seed, length_of), []
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if type(child) is torch.nn.Dropout and child.p > 0:  # noqa: E721 (a subclass keeps its own draw)
                found.append((parent, name, f"{parent_name}.{name}".lstrip(".")))
    for parent, name, full in found:
        setattr(parent, name, KeyedDropout(getattr(parent, name).p, full, keys))
    keys.layers, keys.unkeyed = len(found), attention_dropout(model)
    return keys if found else None


def attention_dropout(model: torch.nn.Module) -> str:
    """The attention dropout a model's config names above 0 (``attention_probs_dropout_prob``, ``attention_dropout``,
    ``attn_pdrop``): drawn inside the attention kernel from torch's generator, not keyed. "" where none."""
    cfg = getattr(model, "config", None)
    found = {k: v for k, v in (cfg.to_dict().items() if hasattr(cfg, "to_dict") else ())
             if ("attention" in k or "attn" in k) and ("drop" in k) and isinstance(v, float) and v > 0}
    return ", ".join(f"{k}={v:g}" for k, v in found.items())
