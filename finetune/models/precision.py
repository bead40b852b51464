"""Low-precision frozen weights: kept in bf16 / fp16 (``model.dtype``) or quantized by bitsandbytes
(``model.quantization``), and what the loop, checkpoints and exports need to know about them.

Only frozen weights are kept in low precision. Everything that trains (LoRA adapters, ``modules_to_save``, every
weight in full fine-tuning) is an fp32 master weight, so an optimizer step adds its update to fp32 numbers exactly as
the baseline's does. Computing follows ``training.mixed_precision``: bf16 / fp16 autocast casts the frozen weights as
it casts fp32 ones; without mixed precision they are used in fp32 (bf16 and fp16 numbers convert to fp32 exactly, so
the model computes as the fp32 model whose frozen weights hold those values).

The quantized classes are recognised by name, so nothing here imports bitsandbytes (which takes seconds).
"""

from __future__ import annotations

from types import MethodType

import torch

from finetune.errors import ConfigError

# bitsandbytes and peft (optional; 3-4 s, and bitsandbytes warns on import on some CPUs: finetune/__init__.py)
# and transformers (0.7 s) are imported in the functions that use them: every command imports this module.

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COMPUTE = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # training.mixed_precision → dtype
QUANTIZED_WEIGHTS = ("Params4bit", "Int8Params")  # bitsandbytes' 4-bit and 8-bit weight classes


def is_quantized(tensor) -> bool:
    """A bitsandbytes 4-bit or 8-bit weight."""
    return type(tensor).__name__ in QUANTIZED_WEIGHTS


def quantized_modules(model: torch.nn.Module) -> list:
    """(name, module) of every module holding a weight quantized by bitsandbytes (``Linear4bit``, ``Linear8bitLt``;
    not the adapter layers around them, whose ``weight`` property hands out their base layer's)."""
    return [(name, m) for name, m in model.named_modules()
            if is_quantized(dict(m.named_parameters(recurse=False)).get("weight"))]


def is_peft_model(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


# ---------------------------------------------------------------------------------------------------------------
# training a model with quantized weights


def prepare_quantized(model: torch.nn.Module) -> None:
    """What training needs of a model with bitsandbytes-quantized weights; nothing for other models.

    * Quantized weights cannot train: such a model trains adapters on them (peft). A model in which every other
      weight trains (full fine-tuning, as ``from_pretrained`` returns it) would silently leave its linear layers
      as they are and train only embeddings, norms and head: refused.
    * bitsandbytes (0.50) repacks a 4-bit weight for a faster bf16 CPU kernel the first time the layer runs in eval
      mode without gradients (an evaluation, a generated sample); the repacked weight has no backward and computes in
      bf16, so every later training step would lose the gradients through it. Its switch is turned off, and a weight
      already repacked is put back.

    Raises ConfigError (``model: …``) for full fine-tuning of quantized weights.
    """
    modules = quantized_modules(model)
    if not modules:
        return
    others = [p for p in model.parameters() if not is_quantized(p)]
    if not is_peft_model(model) and all(p.requires_grad for p in others):
        kind = type(modules[0][1].weight).__name__
        raise ConfigError(f"model: its linear layers are quantized ({kind}, bitsandbytes) and cannot train, and every "
                          "other weight trains (full fine-tuning); train LoRA adapters on it (peft.get_peft_model)")
    for _, module in modules:
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
        _unpack_cpu_weight(module.weight)


def _unpack_cpu_weight(weight) -> None:
    state = getattr(weight, "quant_state", None)
    if state is not None and getattr(state, "packing_format_for_cpu", False):
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)


def describe(model: torch.nn.Module) -> str:
    """The banner's line on a model with weights below fp32 ("frozen 103.2 M nf4 + 28.3 M fp32; trainable 4.9 M
    fp32"), '' for an fp32 model."""
    frozen, trainable = {}, {}
    for p in model.parameters():
        kind, count = _kind(p)
        into = trainable if p.requires_grad else frozen
        into[kind] = into.get(kind, 0) + count
    if set(frozen) <= {"fp32"} and set(trainable) <= {"fp32"}:
        return ""
    say = lambda counts: " + ".join(f"{_count(n)} {k}" for k, n in sorted(counts.items(), key=lambda x: -x[1]))
    pure = " (no fp32 master weights: each step rounds to them)" if set(trainable) - {"fp32"} else ""
    return f"frozen {say(frozen) or 'none'}; trainable {say(trainable) or 'none'}{pure}"


def _count(n: int) -> str:
    return f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.1f} k" if n >= 1e3 else str(n)


def _kind(p) -> tuple:
    """(what a parameter holds: nf4 / fp4 / int8 / bf16 / fp16 / fp32 …, how many weights)."""
    if type(p).__name__ == "Params4bit":
        state = p.quant_state
        return getattr(p, "quant_type", "4-bit"), state.shape.numel() if state is not None else p.numel() * 2
    if type(p).__name__ == "Int8Params":
        return "int8", p.numel()
    names = {v: k for k, v in DTYPES.items()}
    return names.get(p.dtype, str(p.dtype).replace("torch.", "")), p.numel()


def dequantized(module: torch.nn.Module) -> torch.Tensor:
    """The fp32 weight a bitsandbytes layer computes with (``[out_features, in_features]``)."""
    from peft.utils.integrations import dequantize_bnb_weight

    _unpack_cpu_weight(module.weight)
    return dequantize_bnb_weight(module.weight, getattr(module, "state", None)).float()


def quantized_state_keys(model: torch.nn.Module) -> set:
    """The state-dict keys of ``model``'s quantized layers: their frozen weights, quantization state and biases.

    A checkpoint leaves them out: they never change, the run loads them again from its model source (a checkpoint of
    a 4-bit 8 B model would otherwise hold 5 GB of constants), and ``torch``'s ``load_state_dict`` cannot load
    bitsandbytes' quantization state back into a quantized layer.
    """
    keys = set()
    for name, module in quantized_modules(model):
        keys |= set(module.state_dict(prefix=f"{name}." if name else ""))
    return keys


# ---------------------------------------------------------------------------------------------------------------
# trainable weights in fp32, frozen low-precision weights computed in fp32


def keep_trainable_in(model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> None:
    """Make every trainable parameter ``dtype``: an fp32 master weight (e.g. ``modules_to_save`` copied from a bf16
    base, LoRA adapters peft made fp32 over one), or with no master weights the model's own dtype."""
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def trained_dtype(m) -> torch.dtype:
    """The dtype what trains is kept in, for a model section: fp32 (master weights) unless ``master_weights`` is
    off, then ``model.dtype``."""
    return torch.float32 if getattr(m, "master_weights", True) else DTYPES[m.dtype]


def compute_in_fp32(model: torch.nn.Module) -> int:
    """Make the modules whose frozen weights are kept in bf16 / fp16 compute in fp32 (training without mixed
    precision); returns how many were switched.

    * ``nn.Linear`` and transformers' ``Conv1D`` multiply by their weight converted on the fly, keeping the low-
      precision weight (not an fp32 copy) for backward;
    * ``nn.Embedding`` hands out its rows converted to fp32;
    * any other module (norms) runs with fp32 copies of its own frozen parameters.

    Quantized layers are left alone: their compute dtype is set when they are loaded. A module whose weights train
    is left alone too (they are fp32). The forward is swapped on the instance, as a bound method (copies of the
    model stay correct).
    """
    from transformers.pytorch_utils import Conv1D

    switched = 0
    for module in model.modules():
        own = dict(module.named_parameters(recurse=False))
        if not any(map(_low_precision_frozen, own.values())) or is_quantized(own.get("weight")) \
                or "forward" in vars(module):
            continue
        if type(module) in (torch.nn.Linear, Conv1D):
            module.forward = MethodType(_linear_forward, module)
        elif type(module) is torch.nn.Embedding:
            module.forward = MethodType(_embedding_forward, module)
        else:
            module.forward = MethodType(_fp32_params_forward, module)
        switched += 1
    return switched


def _low_precision_frozen(p) -> bool:
    return p.is_floating_point() and p.dtype in (torch.bfloat16, torch.float16) and not p.requires_grad


class _FrozenMatmul(torch.autograd.Function):
    """``x @ weight.T`` (``x @ weight`` for a ``Conv1D``) in ``x``'s dtype, for a frozen weight kept in a lower
    precision: backward converts the weight again rather than keeping an fp32 copy alive until then."""

    @staticmethod
    def forward(ctx, x, weight, transposed: bool):
        ctx.save_for_backward(weight)
        ctx.transposed = transposed
        w = weight.to(x.dtype)
        return x @ w if transposed else x @ w.T

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        w = weight.to(grad.dtype)
        return (grad @ w.T if ctx.transposed else grad @ w), None, None


def _linear_forward(self, x):
    if self.weight.requires_grad or x.dtype == self.weight.dtype or torch.is_autocast_enabled(x.device.type):
        return type(self).forward(self, x)
    out = _FrozenMatmul.apply(x, self.weight, type(self) is not torch.nn.Linear)
    return out if self.bias is None else out + self.bias.to(out.dtype)


def _embedding_forward(self, ids):
    out = type(self).forward(self, ids)
    return out if self.weight.requires_grad or torch.is_autocast_enabled(out.device.type) else out.float()


def _fp32_params_forward(self, *args, **kwargs):
    kept = {n: p for n, p in self._parameters.items() if p is not None and _low_precision_frozen(p)}
    if not kept or any(torch.is_autocast_enabled(p.device.type) for p in kept.values()):
        return type(self).forward(self, *args, **kwargs)
    # Module.__getattr__ reads _parameters: the forward sees the fp32 copies, the module keeps its own weights.
    self._parameters.update({n: p.float() for n, p in kept.items()})
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        self._parameters.update(kept)


# ---------------------------------------------------------------------------------------------------------------
# mixed precision: weight gradients summed in fp32


def sum_weight_grads_in_fp32(model: torch.nn.Module) -> int:
    """Under bf16 / fp16 autocast, make every trainable ``nn.Linear`` and transformers ``Conv1D`` return its weight
    (and bias) gradient summed in fp32 from the low-precision products, instead of rounded to bf16 / fp16; returns
    how many layers were switched.

    Why: autocast computes a layer's weight gradient as one low-precision matmul over the micro-batch's tokens and
    rounds the sum to bf16 before it is added to the fp32 ``.grad``. The big batch rounds the sum over the whole
    window once; N micro-batches round N partial sums, so the layouts of one run differ by bf16 rounding of the
    gradient (about 1e-3 of the grad norm). bf16 × bf16 products are exact in fp32, so the fp32 matmul of the
    low-precision operands is the autocast product with fp32 sums: the layouts then differ only by fp32 summation
    order, as in fp32 training. The forward and the input's gradient are autocast's own, to the bit.
    """
    from transformers.pytorch_utils import Conv1D

    switched = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        # an fp32 master weight only: a weight trained in bf16 (model.master_weights: false) keeps bf16 gradients
        if not (isinstance(weight, torch.nn.Parameter) and weight.requires_grad and weight.dtype == torch.float32):
            continue
        if type(module) in (torch.nn.Linear, Conv1D) and "forward" not in vars(module):
            module.forward = MethodType(_fp32_grad_forward, module)
            switched += 1
        elif type(module) in CONVOLUTIONS and "_conv_forward" not in vars(module):
            module._conv_forward = MethodType(_fp32_grad_conv_forward, module)
            switched += 1
    return switched


# Convolutions sum their weight gradient over the batch and every position (an ODE's or a VAE's layers): the same
# rounding of a partial sum per micro-batch, and under fp16 an overflow that a big batch's sum meets and a small one's
# does not. (Transposed convolutions keep autocast's.)
CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def sums_weight_grads_in_fp32(module: torch.nn.Module) -> bool:
    """Whether ``sum_weight_grads_in_fp32`` switched ``module``."""
    forward = vars(module).get("forward") or vars(module).get("_conv_forward")
    return getattr(forward, "__func__", None) in (_fp32_grad_forward, _fp32_grad_conv_forward)


def _fp32_grad_conv_forward(self, x, weight, bias):
    """``nn.Conv*d._conv_forward`` (its padding mode included) with ``_Fp32GradConv`` under autocast."""
    device = x.device.type
    if not (torch.is_grad_enabled() and torch.is_autocast_enabled(device)):
        return type(self)._conv_forward(self, x, weight, bias)
    padding = self.padding
    if self.padding_mode != "zeros":  # the module's own non-zero padding, then a convolution without any
        x = torch.nn.functional.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
        padding = (0,) * len(self.kernel_size)
    if isinstance(padding, str):  # "same" / "valid": the numbers the functional form works out
        return type(self)._conv_forward(self, x, weight, bias)
    shape = (tuple(self.stride), tuple(padding), tuple(self.dilation), self.groups)
    return _Fp32GradConv.apply(x, weight, bias, torch.get_autocast_dtype(device), shape)


class _Fp32GradConv(torch.autograd.Function):
    """A convolution in ``dtype`` as autocast computes it (``shape``: stride, padding, dilation, groups); its backward
    gives the input autocast's gradient and the weight and bias their fp32 sums (``sum_weight_grads_in_fp32``):
    products of low-precision numbers are exact in fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype, shape):
        stride, padding, dilation, groups = shape
        with torch.autocast(x.device.type, enabled=False):
            low_x, low_w = x.to(dtype), weight.to(dtype)
            out = torch.convolution(low_x, low_w, None if bias is None else bias.to(dtype), stride, padding, dilation,
                                    False, [0] * len(stride), groups)
        ctx.save_for_backward(low_x, low_w)
        ctx.shape, ctx.x_dtype, ctx.has_bias = shape, x.dtype, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        low_x, low_w = ctx.saved_tensors
        stride, padding, dilation, groups = ctx.shape
        conv = (stride, padding, dilation, False, [0] * len(stride), groups)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.convolution_backward(grad, low_x, low_w, None, *conv,
                                                         [True, False, False])[0].to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = torch.ops.aten.convolution_backward(grad.float(), low_x.float(), low_w.float(), None, *conv,
                                                         [False, True, False])[1]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.float().sum([d for d in range(grad.dim()) if d != 1])
        return grad_x, grad_w, grad_b, None, None


def _fp32_grad_forward(self, x):
    device = x.device.type
    if not (torch.is_grad_enabled() and torch.is_autocast_enabled(device)):
        return type(self).forward(self, x)
    dtype = torch.get_autocast_dtype(device)
    return _Fp32GradMatmul.apply(x, self.weight, self.bias, dtype, type(self) is not torch.nn.Linear)


class _Fp32GradMatmul(torch.autograd.Function):
    """``x @ weight.T + bias`` (``x @ weight + bias`` for a ``Conv1D``) in ``dtype``, as autocast computes it; its
    backward gives ``x`` autocast's gradient and the weight and bias their fp32 sums (``sum_weight_grads_in_fp32``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype, transposed: bool):
        with torch.autocast(x.device.type, enabled=False):  # the kernels autocast calls, on its casts
            low_x, low_w = x.to(dtype), weight.to(dtype)
            low_b = None if bias is None else bias.to(dtype)
            if transposed:  # Conv1D's own forward
                flat = low_x.reshape(-1, low_x.shape[-1])
                out = (flat @ low_w if low_b is None else torch.addmm(low_b, flat, low_w))
                out = out.view(*low_x.shape[:-1], low_w.shape[-1])
            else:
                out = torch.nn.functional.linear(low_x, low_w, low_b)
        ctx.save_for_backward(low_x, low_w)
        ctx.x_dtype, ctx.transposed, ctx.has_bias = x.dtype, transposed, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        low_x, low_w = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ low_w.T if ctx.transposed else grad @ low_w).to(ctx.x_dtype)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            flat_x = low_x.reshape(-1, low_x.shape[-1])
            grad_w = fp32_sum_matmul(flat_x.T, flat_grad) if ctx.transposed else fp32_sum_matmul(flat_grad.T, flat_x)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat_grad.float().sum(0)
        return grad_x, grad_w, grad_b, None, None


def fp32_sum_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of low-precision matrices with the products summed and returned in fp32. On CUDA one bf16 / fp16
    GEMM writing fp32 (``torch.mm(out_dtype=)``, at the low-precision GEMM's speed); elsewhere the fp32 product of the
    upcast operands, which is the same number (low-precision products are exact in fp32) at fp32 matmul speed: on
    the 2-core CPU a bf16 window's step took 1.6× as long (benchmarks/README.md#bf16-layouts)."""
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):  # a torch or a GPU without that kernel
            pass
    return a.float() @ b.float()


def autocast_forward(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Run ``model``'s forward under autocast to ``dtype`` on its device, its outputs in fp32, as Accelerate's
    ``prepare`` wraps a model where it autocasts itself (fp16 on a CPU: ``distributed.loss_scaler``). Before
    ``prepare``: a DDP wrapper then calls the wrapped forward."""
    from accelerate.utils import convert_outputs_to_fp32

    device = next(model.parameters()).device.type
    forward = model.forward
    inner = getattr(forward, "__func__", None)  # a bound method, or a function set on the module before
    autocast = torch.autocast(device_type=device, dtype=dtype)
    model.forward = MethodType(convert_outputs_to_fp32(autocast(inner)), model) if inner else \
        convert_outputs_to_fp32(autocast(forward))
