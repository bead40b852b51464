"""An exact chunked loss head for causal LMs: the training loss without the ``[tokens, vocab]`` logits.

A causal LM's largest buffers in a training step are often its logits and their gradient (SmolLM2 at 8 × 512 tokens:
0.8 GB each in fp32). Here the last hidden states go through the LM head and cross-entropy a chunk of tokens at a
time, and only the loss and the gradients leave the head:

    >>> model = enable_chunked_loss(model)           # before accelerator.prepare / torch.compile
    >>> out = model(input_ids=ids, labels=ids)       # in train mode: out.loss as the plain head, out.logits None
    >>> out.loss.backward()                          # the same gradients as the plain head, to fp32 rounding

How: each chunk's logits are computed, turned in place into their loss and their gradient (softmax − one-hot) in the
forward, and freed; only the gradients of the hidden states ``[tokens, hidden]`` and of the head's weight
``[vocab, hidden]`` (accumulated in place, chunk after chunk) are kept until backward, which scales them by the
incoming gradient. We keep gradients rather than recompute each chunk's logits in backward: the head then costs the
plain head's three matmuls, not four, and what it holds is what backward would allocate anyway (the weight's gradient)
plus ``[tokens, hidden]``. The ops and dtypes are the plain head's: the linear in the autocast dtype when autocast is
on, the loss in fp32 on the upcast logits, the linear's backward in the logits' dtype. Under bf16 / fp16 autocast the
gradients are taken in backward instead (``_ChunkedLowPrecisionCrossEntropy``, one more matmul per chunk): the plain
head rounds its logits' gradient to bf16 after scaling it by the upstream gradient, which the forward cannot know;
there a head switched by ``models.precision.sum_weight_grads_in_fp32`` (``training.fp32_grad_sums``) also sums its
weight's low-precision products in fp32, as the body's linear layers do. Tokens whose label is ignored
(-100, padding, each row's last position) are left out before the head: the plain head gives them exactly zero
gradient too.

Memory of the head at its peak (besides the body's activations): the weight's gradient (``vocab × hidden``, fp32),
twice ``counted tokens × hidden`` (their hidden states and gradient) and one fp32 ``[chunk, vocab]`` buffer (under
bf16 autocast about twice that). On a 2-layer Llama at SmolLM2's widths, 4 × 512 tokens in fp32 on CPU, a forward +
backward peaked at 370 MB instead of 1724 MB (248 MB with checkpointing, instead of 1559 MB), in about the plain
step's time (0.9–1.0× its CPU time; wall times on a busy machine varied more).

``torch.nn.functional.linear_cross_entropy`` (torch 2.13) also chunks and precomputes its gradients, but does not fit
exactly: its ``mean`` makes an item-less micro-batch's gradient NaN (the plain head's is zero, and the loop multiplies
such a loss by 0), and with bf16 inputs it computes the logits in fp32 where the plain head rounds them to bf16 under
autocast. In the measurement above it peaked at 408 MB and took 2.6× the plain step's time.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from finetune.models.precision import sums_weight_grads_in_fp32

# transformers' modules are imported where a transformers model is at hand (so already loaded): at the top they
# would cost every command 1.3 s.

# Default chunk: as many tokens as make 64 MiB of fp32 logits (SmolLM2's 49 152 words: 341 tokens). Smaller chunks
# cost time in per-chunk overhead (and on CUDA, in smaller matmuls), larger ones memory; on CPU 128 to 1024 tokens
# took the same time within the noise of the measurement.
CHUNK_LOGIT_BYTES = 64 * 2 ** 20


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk when none is given: 64 MiB of fp32 logits."""
    return max(1, CHUNK_LOGIT_BYTES // (4 * vocab_size))


# Classes whose forward in transformers 5.23 is the Llama (or GPT-2) one: body → lm_head → self.loss_function,
# nothing between the head and the loss (no logit soft-capping or scaling); tests/test_loss_head.py checks that their
# forward still reads so. Gemma 2/3 (soft-capping), Cohere and Granite (logit scaling) and the rest are refused.
SUPPORTED = frozenset({
    "GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "GemmaForCausalLM", "PhiForCausalLM", "Phi3ForCausalLM", "OlmoForCausalLM", "Olmo2ForCausalLM",
    "SmolLM3ForCausalLM", "Starcoder2ForCausalLM",
})


# ---------------------------------------------------------------------------------------------------------------
# the head


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Σ cross_entropy(linear(hidden, weight, bias).float(), targets) / divisor, one chunk of rows at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor, chunk_tokens, grad_enabled):
        wants = [grad_enabled and t is not None and t.requires_grad for t in (hidden, weight, bias)]
        # The ops and dtypes of the plain head under the caller's autocast state: a linear (in the autocast dtype
        # when autocast is on), cross-entropy on its output upcast to fp32; backward of the linear in the logits'
        # dtype, gradients cast back to the dtypes of hidden, weight and bias.
        w, b = _autocast(weight, hidden.device), _autocast(bias, hidden.device)
        frozen_low = not weight.requires_grad and weight.dtype != hidden.dtype
        if frozen_low and not torch.is_autocast_enabled(hidden.device.type):
            # a frozen head kept in bf16 / fp16 under fp32 compute (models.precision): used in the hidden states'
            # dtype, as the plain head uses it
            w, b = w.to(hidden.dtype), None if b is None else b.to(hidden.dtype)
        grad_h = torch.empty_like(hidden) if wants[0] else None
        # bf16 / fp16 weights: accumulate their gradient over chunks in fp32, as one plain matmul would internally.
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if wants[1] else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if wants[2] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            h = _autocast(hidden[rows], hidden.device)
            loss, grad_logits = _cross_entropy_sum(F.linear(h, w, b), targets[rows], any(wants))
            total += loss
            if wants[0]:
                grad_h[rows] = grad_logits @ w
            if wants[1]:
                if grad_w.dtype == grad_logits.dtype:
                    grad_w.addmm_(grad_logits.T, h)  # accumulated in place: no second [vocab, hidden] buffer
                else:
                    grad_w += grad_logits.T @ h
            if wants[2]:
                grad_b += grad_logits.sum(0)
            del grad_logits  # before the next chunk's logits: one [chunk, vocab] buffer at a time in fp32
        ctx.grads = [grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                     None if grad_b is None else grad_b.to(bias.dtype)]
        ctx.empty = hidden.shape[0] == 0
        ctx.divisor = divisor
        return total / divisor

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("the chunked loss head keeps its gradients for one backward only "
                               "(retain_graph / double backward are not supported)")
        grads, ctx.grads = ctx.grads, None
        if ctx.empty:  # no counted token: the plain head's gradient is exactly zero, whatever 0 / 0 gives
            grads = [None if g is None else g.zero_() for g in grads]
        else:
            scale = grad_out / ctx.divisor
            grads = [None if g is None else g.mul_(scale.to(g.dtype)) for g in grads]
        return *grads, None, None, None, None


class _ChunkedLowPrecisionCrossEntropy(torch.autograd.Function):
    """The same loss under bf16 / fp16 autocast, its gradients taken in backward (each chunk's logits computed
    again): the plain head rounds the gradient of its logits to bf16 *after* it is scaled by the upstream gradient
    and the divisor (``grad_out / divisor · (softmax − one-hot)``), and a gradient kept from the forward could only be
    rounded before that scale was known (a 1e-3 difference in the grad norm from the plain head in bf16, measured
    against TRL's). One more ``[chunk, hidden] × [hidden, vocab]`` matmul per chunk than the fp32 path."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, divisor, chunk_tokens, fp32_sums):
        dtype = torch.get_autocast_dtype(hidden.device.type)
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            total += _cross_entropy_sum(F.linear(hidden[rows].to(dtype), w, b), targets[rows], False)[0]
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.dtype, ctx.chunk_tokens, ctx.divisor, ctx.fp32_sums = dtype, chunk_tokens, divisor, fp32_sums
        return total / divisor

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets = ctx.saved_tensors
        wants, dtype = ctx.needs_input_grad[:3], ctx.dtype
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        grad_h = torch.zeros_like(hidden) if wants[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if wants[1] else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if wants[2] else None
        scale = grad_out.float() / ctx.divisor
        with torch.autocast(hidden.device.type, enabled=False):  # the forward's dtypes, cast explicitly
            for start in range(0, hidden.shape[0], ctx.chunk_tokens):
                rows = slice(start, start + ctx.chunk_tokens)
                h = hidden[rows].to(dtype)
                g = F.linear(h, w, b).float().softmax(1)
                g.scatter_add_(1, targets[rows, None], g.new_full((h.shape[0], 1), -1.0))
                g = g.mul_(scale).to(dtype)  # scaled, then rounded: the plain head's order
                if wants[0]:
                    grad_h[rows] = (g @ w).to(hidden.dtype)
                if wants[1]:
                    if ctx.fp32_sums:
                        grad_w.addmm_(g.T.float(), h.float())
                    else:
                        grad_w += g.T @ h
                if wants[2]:
                    grad_b += g.float().sum(0) if ctx.fp32_sums else g.sum(0)
                del g
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None)


def _cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, grad: bool):
    """(Σ cross_entropy(logits.float(), targets), its gradient w.r.t. ``logits`` in their dtype or None).

    The arithmetic of ``log_softmax`` + ``nll_loss`` and their backward (loss = max + log Σ exp(x − max) − x_t,
    gradient = softmax − one-hot) in one fp32 ``[rows, classes]`` buffer, where they take four: fp32 ``logits`` are
    overwritten (the caller has no further use for them).
    """
    x = logits.float()
    top = x.amax(1, keepdim=True)
    picked = x.gather(1, targets[:, None])
    e = x.sub_(top).exp_()
    total = e.sum(1, keepdim=True)
    loss = (top + total.log() - picked).sum()
    if not grad:
        return loss, None
    probs = e.div_(total)
    probs.scatter_add_(1, targets[:, None], probs.new_full((len(targets), 1), -1.0))
    return loss, probs.to(logits.dtype)


def sums_in_fp32(head: torch.nn.Module) -> bool:
    """Whether ``head`` was switched to sum its weight's gradient in fp32 (``training.fp32_grad_sums``): the chunked
    head then does the same for it."""
    return sums_weight_grads_in_fp32(head)


@dataclass(frozen=True)
class Head:
    """The output layer a loss is computed through: its ``weight`` (``[classes, in_features]``), ``bias``
    (``[classes]`` or None) and ``fp32_sums``: under bf16 / fp16 autocast, sum the weight's gradient in fp32
    (``training.fp32_grad_sums``) rather than round each chunk's sum as the plain head rounds its one."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    fp32_sums: bool = False

    @classmethod
    def of(cls, linear: torch.nn.Module) -> "Head":
        """The head of a model's output layer (an ``nn.Linear``), switched or not to fp32 gradient sums."""
        return cls(linear.weight, linear.bias, sums_in_fp32(linear))


def chunked_linear_cross_entropy(hidden: torch.Tensor, head: Head, targets: torch.Tensor, *, divisor=None,
                                 chunk_tokens: Optional[int] = None, ignore_index: int = -100) -> torch.Tensor:
    """``cross_entropy(linear(hidden, head.weight, head.bias).float(), targets)`` without the ``[rows, classes]``
    logits.

    Args:
        hidden: ``[rows, in_features]``. head: the output layer (``Head``: weight, bias, fp32 gradient sums).
        targets: ``[rows]`` class indices; ``ignore_index`` rows count for nothing.
        divisor: the sum of the counted rows' losses is divided by it (a number or a 0-d tensor, as HF's
            ``num_items_in_batch``); None: by the number of counted rows (the mean; NaN when there is none).
        chunk_tokens: rows per chunk (None: ``default_chunk_tokens(classes)``); the head holds one
            ``[chunk_tokens, classes]`` fp32 buffer at a time (about two under bf16 autocast), besides the gradients.

    Returns:
        The fp32 loss; its gradients w.r.t. ``hidden``, ``weight`` and ``bias`` are the plain head's, to rounding.

    Example:
        >>> h, w = torch.randn(10, 4, requires_grad=True), torch.randn(50, 4, requires_grad=True)
        >>> y = torch.tensor([1, 2, -100, 3, 4, 5, 6, 7, 8, 9])
        >>> loss = chunked_linear_cross_entropy(h, Head(w), y, chunk_tokens=3)
        >>> torch.allclose(loss, F.cross_entropy(h @ w.T, y))
        True
    """
    weight, bias = head.weight, head.bias
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0])
    elif chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: {chunk_tokens} must be a positive number of tokens")
    keep = (targets != ignore_index).nonzero().squeeze(1)
    if divisor is None:
        divisor = keep.numel()
    # Rows that count for nothing get no logits at all; index_select's backward scatters zeros to them.
    hidden, targets = hidden.index_select(0, keep), targets.index_select(0, keep)
    if torch.is_grad_enabled() and torch.is_autocast_enabled(hidden.device.type) and \
            torch.get_autocast_dtype(hidden.device.type) in (torch.bfloat16, torch.float16):
        return _ChunkedLowPrecisionCrossEntropy.apply(hidden, weight, bias, targets, divisor, chunk_tokens,
                                                      head.fp32_sums)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, divisor, chunk_tokens,
                                            torch.is_grad_enabled())


def causal_lm_loss(hidden_states: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, *,
                   num_items_in_batch=None, ignore_index: int = -100, shift_labels: Optional[torch.Tensor] = None,
                   chunk_tokens: Optional[int] = None, **unused) -> torch.Tensor:
    """HF's causal-LM loss (``transformers.loss.loss_utils.ForCausalLMLoss``) of ``head(hidden_states)``.

    Labels are shifted by one inside (or ``shift_labels`` given already shifted), ``ignore_index`` is ignored, and the
    loss is the mean over counted tokens — or their sum ÷ ``num_items_in_batch`` when that is given.

    Example:
        >>> loss = causal_lm_loss(out.last_hidden_state, model.lm_head, batch["labels"])
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(hidden.device)
    return chunked_linear_cross_entropy(hidden, Head.of(head), targets, divisor=num_items_in_batch,
                                        chunk_tokens=chunk_tokens, ignore_index=ignore_index)


# ---------------------------------------------------------------------------------------------------------------
# per-sequence log-probabilities (preference losses)


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """log softmax(linear(hidden, weight, bias).float())[row, target] for every row, one chunk of rows at a time.

    Unlike the loss above, the output is a vector: a preference loss weights each sequence's log-probability by its
    own factor, so the head's gradient cannot be summed ahead of backward. Backward recomputes each chunk's logits
    (one more matmul than the loss head) and scales each row by its incoming gradient; no ``[rows, vocab]`` buffer
    outlives a chunk in either pass."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens, fp32_sums=False):
        dtype = _compute_dtype(hidden, weight)
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            x = F.linear(hidden[rows].to(dtype), w, b).float()
            out[rows] = x.gather(1, targets[rows, None]).squeeze(1) - x.logsumexp(1)
            del x
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.dtype, ctx.chunk_tokens, ctx.fp32_sums = dtype, chunk_tokens, fp32_sums
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets = ctx.saved_tensors
        wants = ctx.needs_input_grad[:3]
        dtype, chunk = ctx.dtype, ctx.chunk_tokens
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        grad_h = torch.zeros_like(hidden) if wants[0] else None
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if wants[1] else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if wants[2] else None
        with torch.autocast(hidden.device.type, enabled=False):  # the forward's dtypes, cast explicitly
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                h = hidden[rows].to(dtype)
                # d log p_t / d logits = one-hot − softmax, times each row's incoming gradient
                g = F.linear(h, w, b).float().softmax(1).neg_()
                g.scatter_add_(1, targets[rows, None], g.new_ones((h.shape[0], 1)))
                g = g.mul_(grad_out[rows, None].float()).to(dtype)
                if wants[0]:
                    grad_h[rows] = (g @ w).to(hidden.dtype)
                if wants[1] and ctx.fp32_sums:  # bf16 products summed in fp32, as in the head above
                    grad_w.addmm_(g.T.to(acc), h.to(acc))
                elif wants[1]:
                    grad_w += (g.T @ h).to(acc)
                if wants[2]:
                    grad_b += g.sum(0).to(acc)
                del g
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the plain head's linear runs in: autocast's when it is on (for fp32 / bf16 / fp16 inputs), else the
    hidden states' (a frozen bf16 / fp16 head under fp32 compute is used in fp32, as ``models.precision`` does)."""
    if torch.is_autocast_enabled(hidden.device.type) and hidden.is_floating_point() and hidden.dtype != torch.float64:
        return torch.get_autocast_dtype(hidden.device.type)
    return hidden.dtype


def sequence_log_probs(hidden_states: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, *,
                       chunk_tokens: Optional[int] = None, ignore_index: int = -100) -> torch.Tensor:
    """Σ log p(label) over each row's counted tokens: ``[batch]`` fp32, differentiable, without the
    ``[tokens, vocab]`` logits.

    Labels are shifted by one inside, as in ``causal_lm_loss`` (position t predicts label t + 1); ``ignore_index``
    positions (prompt, padding) count for nothing. The same numbers and gradients as
    ``log_softmax(head(hidden_states).float())`` gathered at the labels and summed per row, to fp32 rounding.

    Example:
        >>> logps = sequence_log_probs(out.last_hidden_state, model.lm_head, labels)   # [batch]
    """
    shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(hidden_states.device)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = shift.reshape(-1)
    keep = (targets != ignore_index).nonzero().squeeze(1)
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(head.weight.shape[0])
    tokens = _ChunkedTokenLogProbs.apply(hidden.index_select(0, keep), head.weight, head.bias,
                                         targets.index_select(0, keep), chunk_tokens, sums_in_fp32(head))
    rows = torch.div(keep, shift.shape[-1], rounding_mode="floor")
    return torch.zeros(shift.shape[0], dtype=torch.float32, device=tokens.device).index_add(0, rows, tokens)


def model_sequence_log_probs(model: torch.nn.Module, batch: dict, *, chunk_tokens: Optional[int] = None
                             ) -> torch.Tensor:
    """``sequence_log_probs`` of a causal LM on ``batch`` (``input_ids``, ``attention_mask``, ``labels``): ``[batch]``.

    The model is called through its own forward (``model(...)``, so that DDP sees the forward it syncs gradients
    for) with ``logits_to_keep=1`` (the last position's logits only); the body's last hidden states are taken by a
    hook and go through the head in chunks. ``model`` may be wrapped (DDP, compile, peft)."""
    lm = _causal_lm(_unwrapped(model))
    body = getattr(lm, lm.base_model_prefix)
    seen = []
    handle = body.register_forward_hook(lambda module, args, out: seen.append(out[0]))
    try:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=1,
              use_cache=False)
    finally:
        handle.remove()
    return sequence_log_probs(seen[-1], lm.lm_head, batch["labels"], chunk_tokens=chunk_tokens)


# ---------------------------------------------------------------------------------------------------------------
# switching a model over


def enable_chunked_loss(model: torch.nn.Module, chunk_tokens: Optional[int] = None) -> torch.nn.Module:
    """Make ``model(**batch)`` compute its training loss through the chunked head.

    Replaces the forward of the causal LM instance (inside a peft ``PeftModel`` when given one), so the model is still
    called through its top-level forward (DDP syncs gradients only for forwards through its wrapper). In train mode
    with grad enabled and ``labels`` given, the output's ``loss`` is HF's causal-LM loss (same shift, -100,
    ``num_items_in_batch``) with ``logits=None``; otherwise (eval, no grad, no labels, ``logits_to_keep``) the
    model's own forward runs and returns its logits. Call it before ``accelerator.prepare`` / ``torch.compile``.

    Args:
        model: a supported HF causal LM (``SUPPORTED``), or a ``PeftModel`` around one.
        chunk_tokens: tokens per chunk (None: ``default_chunk_tokens(vocab)``, 64 MiB of fp32 logits); the head
            holds one ``[chunk_tokens, vocab]`` fp32 buffer at a time (about two under bf16 autocast), besides the
            gradients of its weight and of the hidden states.

    Returns:
        ``model`` itself (changed in place). ``disable_chunked_loss(model)`` restores it.

    Raises:
        ValueError: the model is not one whose loss this head reproduces exactly (see ``unsupported_reason``), or its
            forward is already wrapped.

    Example:
        >>> model = enable_chunked_loss(LlamaForCausalLM(config), chunk_tokens=512)
        >>> model.train()(input_ids=ids, labels=ids).loss.backward()
    """
    reason = unsupported_reason(model)
    if reason:
        raise ValueError(f"chunked loss: {reason}")
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"chunked loss: chunk_tokens={chunk_tokens!r} must be a positive number of tokens")
    lm = _causal_lm(model)
    lm.forward = types.MethodType(_chunked_forward, lm)
    lm._chunked_loss_tokens = chunk_tokens
    return model


def _chunked_forward(self, *args, **kwargs):
    """The forward ``enable_chunked_loss`` installs (a module-level function: a deep copy of the model rebinds it)."""
    plain = type(self).forward
    signature, var_keyword = _signature(plain)
    call = signature.bind(self, *args, **kwargs).arguments
    call.pop("self")
    extra = dict(call.pop(var_keyword, {}))
    labels, keep = call.pop("labels", None), call.pop("logits_to_keep", 0)
    if labels is None or not self.training or not torch.is_grad_enabled() or not _is_zero(keep):
        return plain(self, *args, **kwargs)
    return_dict = extra.pop("return_dict", None)  # as transformers' can_return_tuple
    if return_dict is None:
        return_dict = self.config.return_dict
    # As the plain forward: every other argument goes to the body, and the loss reads its keywords from the same
    # **kwargs (num_items_in_batch, ignore_index, shift_labels).
    out = getattr(self, self.base_model_prefix)(**call, **extra)
    loss = causal_lm_loss(out.last_hidden_state, self.lm_head, labels, chunk_tokens=self._chunked_loss_tokens, **extra)
    result = _output_class(out)(loss=loss, logits=None, **{k: v for k, v in out.items() if k != "last_hidden_state"})
    return result if return_dict else result.to_tuple()


def _signature(forward) -> tuple:
    """(signature of a model class's forward, the name of its ``**kwargs``), computed once per class."""
    if forward not in _SIGNATURES:
        signature = inspect.signature(forward)
        _SIGNATURES[forward] = signature, next(k for k, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD)
    return _SIGNATURES[forward]


_SIGNATURES: dict = {}


def disable_chunked_loss(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``enable_chunked_loss``: the model's own forward again (its logits, its loss). Returns ``model``."""
    lm = _causal_lm(model)
    if lm is None or "_chunked_loss_tokens" not in vars(lm):
        raise ValueError(f"chunked loss: {type(lm or model).__name__} does not have it enabled (or is wrapped)")
    if not _is_ours(lm.forward):
        raise ValueError(f"chunked loss: the forward of {type(lm).__name__} was wrapped after enable_chunked_loss "
                         "(by accelerator.prepare?); disable it on a fresh model instead")
    del lm.forward, lm._chunked_loss_tokens
    return model


def chunked_loss_enabled(model: torch.nn.Module) -> bool:
    """True when ``enable_chunked_loss`` was applied to ``model`` (or the causal LM inside it, through DDP, compile
    and peft wrappers)."""
    lm = _causal_lm(_unwrapped(model))
    return lm is not None and "_chunked_loss_tokens" in vars(lm)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while isinstance(getattr(model, "module", None) or getattr(model, "_orig_mod", None), torch.nn.Module):
        model = getattr(model, "module", None) or model._orig_mod
    return model


def chunk_size(model: torch.nn.Module) -> int:
    """Tokens per chunk of the head ``enable_chunked_loss`` put on ``model`` (0: none): its buffers grow with a
    micro-batch's tokens up to one chunk, then stay."""
    if not chunked_loss_enabled(model):
        return 0
    lm = _causal_lm(_unwrapped(model))
    return lm._chunked_loss_tokens or default_chunk_tokens(lm.config.vocab_size)


def unsupported_reason(model: torch.nn.Module) -> Optional[str]:
    """Why ``enable_chunked_loss`` refuses ``model`` (one line naming its class), or None when it can be enabled."""
    lm = _causal_lm(model)
    if lm is None:
        return (f"{type(model).__name__} wraps the model; call enable_chunked_loss on the model before "
                "accelerator.prepare / torch.compile")
    name = type(lm).__name__
    if name not in SUPPORTED or not type(lm).__module__.startswith("transformers."):
        return (f"{name} is not a model whose loss this head reproduces exactly; supported: "
                f"{', '.join(sorted(SUPPORTED))} (and peft models around them)")
    from transformers.loss.loss_utils import LOSS_MAPPING

    if lm.loss_function is not LOSS_MAPPING["ForCausalLM"]:
        return f"{name} has a custom loss_function (loss_type={getattr(lm, 'loss_type', None)!r})"
    if getattr(lm.config, "final_logit_softcapping", None) is not None:
        return f"{name} soft-caps its logits (config.final_logit_softcapping)"
    head = lm.lm_head
    if type(head) is not torch.nn.Linear:
        return (f"{name}.lm_head is a {type(head).__name__}, not a torch.nn.Linear (an adapter or quantization on "
                "the head); leave lm_head out of the adapter's target modules")
    if head._forward_hooks or head._forward_pre_hooks:
        return f"{name}.lm_head has forward hooks (device-map offloading?) that the chunked head would bypass"
    if head.out_features != lm.config.vocab_size:
        return f"{name}.lm_head has {head.out_features} outputs but config.vocab_size is {lm.config.vocab_size}"
    if "forward" in vars(lm):
        by = "enable_chunked_loss" if _is_ours(lm.forward) else "accelerator.prepare or another wrapper"
        return f"the forward of {name} is already replaced (by {by}); call enable_chunked_loss once, before prepare"
    return None


def _causal_lm(model):
    """The causal LM inside a peft wrapper, the model itself otherwise; None for DDP / compile wrappers."""
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        model = model.get_base_model()
    if hasattr(model, "module") or hasattr(model, "_orig_mod"):
        return None
    return model


def _output_class(body_output):
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions, CausalLMOutputWithPast

    fields = getattr(body_output, "__dataclass_fields__", {})
    return CausalLMOutputWithCrossAttentions if "cross_attentions" in fields else CausalLMOutputWithPast


def _is_zero(logits_to_keep) -> bool:
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


def _is_ours(forward) -> bool:
    return getattr(forward, "__func__", None) is _chunked_forward


def _autocast(t: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """``t`` in the autocast dtype when autocast is on for ``device`` (as ``F.linear`` would cast it), else ``t``."""
    if t is None or not torch.is_autocast_enabled(device.type):
        return t
    if not t.is_floating_point() or t.dtype == torch.float64:  # autocast leaves these as they are
        return t
    return t.to(torch.get_autocast_dtype(device.type))
