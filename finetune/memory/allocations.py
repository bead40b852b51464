"""A forward and backward that allocates what it would and computes little: how ``finetune plan --model-config``
measures an 8 B model's micro-step on a 2-core CPU in seconds.

A micro-step's peak is the bytes allocated and freed in order — which tensors exist, their sizes and lifetimes —
and no value changes it. Inside ``AllocationsOnly``:

* the ops that cost the time — matrix products, convolutions, bitsandbytes' (de)quantization and 4-bit products, and
  floating-point casts — allocate their outputs, as the op would (shape, strides, dtype from its meta kernel),
  and leave them unwritten;
* ops that only write floating-point values in place (fills, random draws, copies, the optimizers' updates,
  foreach and fused ones included) do nothing;
* everything else runs: integer and boolean work (labels, masks, positions: they set shapes, as ``nonzero`` on the
  labels does in the chunked loss head), views, and the element-wise work between the products, which is cheap.

Untouched allocations are never paged in, so a copy whose weights and logits hold gigabytes stays small in this
machine's memory as well. What it does not record: memory a skipped op allocates for itself inside its kernel. On
a CPU, a bf16 matrix product accumulates in an fp32 buffer of its output's size (a GPU's cuBLAS uses a workspace
instead); ``tests/test_plan_depth.py`` holds every setting's peak to the computed one's — equal in fp32, within
the stated tolerance under bf16 compute.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

# Ops that allocate exactly their outputs and whose time is the step's time. bitsandbytes' ops carry fake kernels
# (shapes without data), so their outputs are known without running them.
PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward",
            "quantize_4bit", "dequantize_4bit", "gemm_4bit", "gemv_4bit", "quantize_blockwise",
            "dequantize_blockwise", "int8_vectorwise_quant", "int8_linear_matmul", "int8_mm_dequant",
            "int8_scaled_mm", "int8_mixed_scaled_mm"}
# In-place ops that write values only (never shapes, strides or storage), skipped on floating-point targets.
VALUE_WRITES = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "exponential_", "add_", "sub_",
                "mul_", "div_", "addcmul_", "addcdiv_", "lerp_", "sqrt_", "clamp_", "masked_fill_",
                "optimizer_update_32bit", "optimizer_update_8bit_blockwise"}


def _meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="meta")
    return value


def _floating(value) -> bool:
    values = value if isinstance(value, (list, tuple)) else [value]
    return bool(values) and all(isinstance(v, torch.Tensor) and v.is_floating_point() for v in values)


def _casts_floats(name: str, args, kwargs) -> bool:
    """A floating-point tensor to another floating dtype on its own device (autocast's casts, ``.float()``)."""
    if name != "_to_copy" or not _floating(args[0]):
        return False
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    return (dtype is None or dtype.is_floating_point) and (device is None or torch.device(device) == args[0].device)


def _written(func, args, kwargs) -> list:
    """The arguments ``func`` writes into, by its schema: ``self`` of an in-place op, ``out`` of an out= one."""
    return [args[i] if i < len(args) else kwargs.get(a.name)
            for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


class AllocationsOnly(TorchDispatchMode):
    """While inside, the costly ops allocate their outputs without computing them (the module's docstring says
    which); ``skipped`` counts them. Values are left unwritten: use it only where bytes are measured."""

    products, value_writes = PRODUCTS, VALUE_WRITES

    def __init__(self):
        super().__init__()
        self.skipped = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        written = _written(func, args, kwargs)
        if written and (name in self.products or self.writes_values(name, written[0])):
            self.skipped += 1  # nothing allocated: the op writes into tensors that exist (in place, or out=)
            returns = len(func._schema.returns)
            return None if not returns else written[0] if returns == 1 else tuple(written[:returns])
        if not written and (name in self.products or _casts_floats(name, args, kwargs)):
            self.skipped += 1
            return self.allocated(func, args, kwargs)
        return func(*args, **kwargs)

    def writes_values(self, name: str, target) -> bool:
        """Whether an op writing into ``target`` writes floating-point values only."""
        in_place = name in self.value_writes or (name.startswith(("_foreach_", "_fused_")) and name.endswith("_"))
        return in_place and _floating(target)

    @staticmethod
    def allocated(func, args, kwargs):
        """``func``'s outputs as its meta kernel shapes them, allocated unwritten on the inputs' device."""
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        meta_kwargs = {k: (torch.device("meta") if k == "device" else _meta(v)) for k, v in kwargs.items()}
        shapes = func(*tree_map(_meta, args), **meta_kwargs)
        return tree_map(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
                        if isinstance(t, torch.Tensor) else t, shapes)
