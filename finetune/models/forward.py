"""Running a task's model: its loss on a batch, its dropout, and activation checkpointing."""

from __future__ import annotations

import contextlib

import torch

from finetune.errors import ConfigError
from finetune.items import is_causal_lm
from finetune.models.loss_head import chunked_loss_enabled, enable_chunked_loss, unsupported_reason


def compute_loss(model, batch, loss_fn=None):
    """Run the model on ``batch``; return (mean loss, dict of extra 0-d loss terms to log, outputs).

    ``loss_fn(model, batch)`` when given, else ``model(**batch)`` with its ``.loss`` / ``["loss"]``.
    """
    out = loss_fn(model, batch) if loss_fn is not None else model(**batch)
    loss = out if isinstance(out, torch.Tensor) else \
        out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    who = "loss_fn" if loss_fn is not None else "model"
    if loss is None:
        raise ConfigError(f"{who}: it returned no loss; pass labels in the batch, or give a loss_fn")
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(f"{who}: its loss is a {type(loss).__name__}; expected a tensor")
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise ConfigError(f"{who}: its loss has no gradient (computed under no_grad, detached, or from frozen "
                          "parameters only)")
    if isinstance(out, torch.Tensor):
        return out, {}, None
    # other 0-d tensors of a dict output (loss terms such as "kl" or "d_loss") are logged beside the loss
    extras = {k: v for k, v in out.items() if k != "loss" and isinstance(v, torch.Tensor) and v.dim() == 0} \
        if isinstance(out, dict) else {}
    return loss, extras, out


def set_dropout(model: torch.nn.Module, p) -> None:
    """Set every dropout probability of ``model`` to ``p`` (``None`` keeps the model's own).

    Covers ``nn.Dropout*`` modules, float ``*dropout*`` attributes that attention reads directly
    (``nn.MultiheadAttention.dropout``, HF's ``attention_dropout`` copied from the config at init) and the float
    ``*dropout*`` fields of an HF config. ``p = 0`` is what an exact reproduction check needs."""
    if p is None:
        return
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            m.p = p
        for key, value in vars(m).items():
            if "dropout" in key and isinstance(value, float):
                setattr(m, key, float(p))
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "to_dict"):
            for key, value in cfg.to_dict().items():
                if "dropout" in key and isinstance(value, float):
                    setattr(cfg, key, p)


def enable_gradient_checkpointing(model: torch.nn.Module, hook=None) -> None:
    """Activation checkpointing: the task's hook, else the HF API (new name first), else a ConfigError."""
    if hook is not None:
        hook(model)
    elif hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ConfigError("training.gradient_checkpointing: this model has no checkpointing support "
                          "(give the task an enable_gradient_checkpointing hook)")
    # LoRA / frozen embeddings: checkpointed blocks need an input that requires grad to rebuild the graph.
    if hasattr(model, "enable_input_require_grads") and any(not p.requires_grad for p in model.parameters()):
        model.enable_input_require_grads()


def enable_chunked_head(model: torch.nn.Module, requested) -> str:
    """``training.chunked_loss``: the exact chunked loss head (``finetune.models.loss_head``) on a supported causal LM.
    Returns the banner's word on it. Must run before ``accelerator.prepare`` (Accelerate wraps forward in autocast;
    the head sits beneath)."""
    if chunked_loss_enabled(model):
        return "chunked (enabled on the model given)"
    if requested is False:
        return "plain (training.chunked_loss=false)"
    reason = "the model is not a causal LM" if not is_causal_lm(model) else unsupported_reason(model)
    if reason is None:
        enable_chunked_loss(model)
        return "chunked (no [tokens, vocab] logits held)"
    if requested:
        raise ConfigError(f"training.chunked_loss: {reason}; set training.chunked_loss=false")
    return f"plain ({reason})" if is_causal_lm(model) else ""  # nothing to say for other models


def offload_activations(enabled: bool):
    """``training.activation_offloading``: the tensors autograd saves for backward go to pinned host memory and come
    back when backward needs them (torch's ``save_on_cpu``)."""
    return torch.autograd.graph.save_on_cpu(pin_memory=True) if enabled else contextlib.nullcontext()


def shards_weights(model) -> bool:
    """Whether this process holds only a part of ``model``'s weights right now (ZeRO-3's partitions, FSDP2's
    DTensor shards): a forward then needs every process (``generate(synced_gpus=True)``)."""
    return any(str(getattr(p, "ds_status", "")).endswith("NOT_AVAILABLE") or hasattr(p, "device_mesh")
               for p in model.parameters())
