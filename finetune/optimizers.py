"""Every optimizer ``training.optimizer`` can name, in one table: how it is made, the bytes its state holds, whether
it is adaptive or 8-bit, what it needs installed, and which Hugging Face ``TrainingArguments.optim`` names are it.

The recipe schema takes its choices from here, ``finetune.optim`` makes the optimizer, the memory model sizes its
state (``finetune plan``, ``batch_size: auto``), ``finetune compare`` judges its weights and ``finetune import``
carries a baseline's ``optim``. So an entry added to ``OPTIMIZERS`` is usable by all of them; every reader looks the
table up when it needs it, never a copy taken at import.

    >>> OPTIMIZERS["adamw"].state_bytes([10, 4], momentum=0.0)  # two fp32 moments and a step count per tensor
    120
    >>> "lion" in ADAPTIVE, "sgd" in ADAPTIVE, "adamw8bit" in EIGHT_BIT
    (True, False, True)

Kept free of torch and of the recipe schema at import: ``finetune.config`` reads it while loading a recipe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

# bitsandbytes' 8-bit AdamW (0.50): both moments in 8 bits with one fp32 absmax per 256 elements, and two 256-entry
# fp32 maps shared by every tensor; tensors under 4096 elements keep fp32 moments.
BLOCK_8BIT_OPTIM, MIN_8BIT_SIZE, QMAP = 256, 4096, 256


@dataclass(frozen=True)
class Optimizer:
    """One entry of the table."""

    make: Callable          # (parameter groups, TrainingConfig) → the torch optimizer
    state_bytes: Callable   # (element counts of the trainable fp32 tensors, momentum) → bytes of its state once stepped
    about: str              # what the recipe schema's help says of it
    # its step scales each element by the element's own history (AdamW's moments, Lion's sign), so a rounding-level
    # gradient difference becomes a full-size step of either sign: compare judges its weights by relative L2
    adaptive: bool = True
    eight_bit: bool = False  # its state is block-quantized: never the fp32 update, compare does not judge its weights
    needs: Optional[tuple[str, str]] = None  # (the module it imports, what to pip install for it)
    trainer_names: tuple = ()  # TrainingArguments.optim values that are this optimizer (finetune import)


# ---------------------------------------------------------------------------------------------------------------
# making them


def make_adamw(groups, t):
    import torch

    # The fused kernel (one pass over all parameters): torch's default on a CPU is a loop over the tensors,
    # ~6× slower for MiniLM's 22.7 M parameters. Not with fp16: the GradScaler then hands a fused optimizer its
    # inf check, and Accelerate could no longer tell a skipped step.
    fused = t.mixed_precision != "fp16" and all(p.is_floating_point() for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=t.learning_rate, betas=tuple(t.betas), fused=fused or None)


def make_bitsandbytes(name: str) -> Callable:
    """The maker of bitsandbytes' optimizer class ``name`` (its AdamW with both moments stored block-wise in 8 bits;
    tensors under 4096 elements keep fp32 state). The update rounds differently from fp32 AdamW: not the baseline's
    step (compare says so)."""
    def make(groups, t):
        import bitsandbytes as bnb  # missing: refused on load, as the entry's needs say (schema.check_needs)

        return getattr(bnb.optim, name)(groups, lr=t.learning_rate, betas=tuple(t.betas))
    return make


def make_sgd(groups, t):
    import torch

    return torch.optim.SGD(groups, lr=t.learning_rate, momentum=t.momentum)


def make_lion(groups, t):
    from lion_pytorch import Lion

    return Lion(groups, lr=t.learning_rate, betas=tuple(t.betas))


# ---------------------------------------------------------------------------------------------------------------
# the bytes of their state, for trainable fp32 tensors of ``numels`` elements (tests/test_plan_depth.py holds each
# equal to what the real optimizer allocates)


def adamw_state(numels: list, momentum: float = 0.0) -> int:
    return sum(8 * n + 4 for n in numels)  # two moments and an fp32 step count per tensor


def eight_bit_state(numels: list, momentum: float = 0.0) -> int:
    small = [n for n in numels if n < MIN_8BIT_SIZE]
    large = [n for n in numels if n >= MIN_8BIT_SIZE]
    maps = 2 * 4 * QMAP if large else 0
    return sum(8 * n for n in small) + sum(2 * n + 8 * math.ceil(n / BLOCK_8BIT_OPTIM) for n in large) + maps


def sgd_state(numels: list, momentum: float = 0.0) -> int:
    return sum(4 * n for n in numels) if momentum else 0  # a momentum buffer, only with momentum


def lion_state(numels: list, momentum: float = 0.0) -> int:
    return sum(4 * n for n in numels)  # one moment


BITSANDBYTES = ("bitsandbytes", "'finetune[quant]'")

OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer(make_adamw, adamw_state, "AdamW, no decay on biases and norms",
                       trainer_names=("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw")),
    "sgd": Optimizer(make_sgd, sgd_state, "SGD with training.momentum", adaptive=False, trainer_names=("sgd",)),
    "lion": Optimizer(make_lion, lion_state, "Lion, from lion-pytorch", needs=("lion_pytorch", "lion-pytorch"),
                      trainer_names=("lion_32bit", "lion")),
    "adamw8bit": Optimizer(make_bitsandbytes("AdamW8bit"), eight_bit_state,
                           "bitsandbytes' AdamW, its state block-quantized to 8 bits: not the fp32 AdamW update",
                           eight_bit=True, needs=BITSANDBYTES,
                           trainer_names=("adamw_bnb_8bit", "adamw_8bit", "bnb_8bit")),
    "paged_adamw8bit": Optimizer(make_bitsandbytes("PagedAdamW8bit"), eight_bit_state,
                                 "the same, its state paged to host memory when the GPU runs short",
                                 eight_bit=True, needs=BITSANDBYTES, trainer_names=("paged_adamw_8bit",)),
}


def needs_of(name: str) -> Optional[tuple[str, str]]:
    """What optimizer ``name`` needs installed, (module, pip), or None (a name not in the table: the schema's
    choices refuse it)."""
    entry = OPTIMIZERS.get(name)
    return entry.needs if entry is not None else None


def names() -> tuple:
    """The names ``training.optimizer`` accepts, in the table's order."""
    return tuple(OPTIMIZERS)


def described() -> str:
    """``name: what it is`` for every entry: the recipe schema's help text."""
    return "; ".join(f"{name}: {o.about}" for name, o in OPTIMIZERS.items())


class Names:
    """The names of the entries whose ``flag`` is set, read from the table at each use (an entry added later
    counts): ``name in ADAPTIVE``."""

    def __init__(self, flag: str):
        self.flag = flag

    def __contains__(self, name) -> bool:
        entry = OPTIMIZERS.get(name) if isinstance(name, str) else None
        return entry is not None and getattr(entry, self.flag)

    def __iter__(self):
        return iter([name for name, o in OPTIMIZERS.items() if getattr(o, self.flag)])

    def __repr__(self) -> str:
        return f"{{{', '.join(map(repr, self))}}}"


ADAPTIVE = Names("adaptive")
EIGHT_BIT = Names("eight_bit")
