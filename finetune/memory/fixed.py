"""The fixed part of a step — weights, gradients and the optimizer's state — counted from a model's structure.

``finetune plan`` prices settings it does not build: a model many times larger than the machine that plans is built
on the meta device (no storage), and its bytes are counted here for the dtype its frozen weights would be kept in,
their bitsandbytes quantization and the optimizer (its state from the optimizer table, ``finetune.optimizers``). The
same counts on a real model (``held_bytes``, ``state_bytes``) are what a run allocates; ``tests/test_plan_depth.py``
holds the two equal.

bitsandbytes' layouts (0.50), as its layers allocate them (its 8-bit optimizers': ``finetune.optimizers``):

* 4-bit (nf4 / fp4, double quantization, blocks of 64): the packed weight (2 weights a byte), one 8-bit absmax per
  block, their fp32 absmax per 256 blocks with a 256-entry fp32 code, the 4-bit code (16 fp32) and an fp32 offset;
* int8 (LLM.int8()): one byte a weight and one fp32 scale per output row.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from finetune.models.precision import is_quantized
from finetune.optimizers import OPTIMIZERS

BLOCK_4BIT, BLOCK_NESTED, CODE_NESTED, CODE_4BIT = 64, 256, 256, 16


def quantized_weight_bytes(numel: int, out_features: int, quantization: str) -> int:
    """Bytes of one linear layer's weight of ``numel`` elements under ``quantization`` (nf4 / fp4 / int8)."""
    if quantization == "int8":
        return numel + 4 * out_features
    blocks = math.ceil(numel / BLOCK_4BIT)
    return math.ceil(numel / 2) + blocks + 4 * math.ceil(blocks / BLOCK_NESTED) + 4 * CODE_NESTED + 4 * CODE_4BIT + 4


def is_quantizable(name: str, module: torch.nn.Module, skip: Iterable[str]) -> bool:
    """Whether transformers' bitsandbytes loading quantizes ``module``: a frozen plain linear layer (not an adapter)
    whose name has no part in ``skip`` (the heads, peft's modules_to_save)."""
    parts = set(name.split("."))
    return type(module) is torch.nn.Linear and not module.weight.requires_grad and not parts & set(skip)


def planned_weight_bytes(model: torch.nn.Module, quantization: str = "none", skip: Iterable[str] = ()) -> int:
    """Bytes of ``model``'s parameters and buffers (a meta-device build works) once its frozen linear layers are
    quantized (``quantization``: none / nf4 / fp4 / int8); storage shared between parameters (tied weights) once."""
    skip = tuple(skip)
    total, seen = 0, set()
    for name, module in model.named_modules():
        quantize = quantization != "none" and is_quantizable(name, module, skip)
        for pname, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if id(t) in seen:
                continue
            seen.add(id(t))
            if quantize and pname == "weight":
                total += quantized_weight_bytes(t.numel(), t.shape[0], quantization)
            else:
                total += t.numel() * t.element_size()
    return total


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes a real model holds: its parameters, buffers and bitsandbytes' quantization state, each storage once."""
    storages = {}

    def add(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storages[(t.device, t.untyped_storage().data_ptr())] = t.untyped_storage().nbytes()

    for t in list(model.parameters()) + list(model.buffers()):
        add(t)
        if is_quantized(t):
            for state in (getattr(t, "quant_state", None), getattr(getattr(t, "quant_state", None), "state2", None)):
                for v in vars(state).values() if state is not None else ():
                    add(v)
            add(getattr(t, "SCB", None))
    return sum(storages.values())


def optimizer_state_bytes(numels: list, optimizer: str, momentum: float = 0.0) -> int:
    """Bytes of the state ``optimizer`` (training.optimizer) holds for trainable tensors of ``numels`` elements
    (fp32 master weights) once it has stepped: the optimizer table's count."""
    return OPTIMIZERS[optimizer].state_bytes(numels, momentum)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a real optimizer's state, each storage once (bitsandbytes shares its maps between tensors)."""
    storages = {}
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                storages[(v.device, v.untyped_storage().data_ptr())] = v.untyped_storage().nbytes()
    return sum(storages.values())


def fixed_part(model: torch.nn.Module, quantization: str, skip: Iterable[str], optimizer: str,
               momentum: float = 0.0) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) in bytes of training ``model`` (a meta-device build works): its frozen
    linear layers quantized as ``quantization`` says, what trains in fp32 with fp32 gradients."""
    trainable = [p.numel() for p in model.parameters() if p.requires_grad]
    return (planned_weight_bytes(model, quantization, skip), 4 * sum(trainable),
            optimizer_state_bytes(trainable, optimizer, momentum))

