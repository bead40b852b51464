"""The checks across fields of a loaded recipe: each section's declared ranges and needs (``finetune.schema``), then
the combinations no single field can say (``model.quantization`` with the training section, packing with the
loss divisor, …). Each appends one line per problem; ``finetune.loading.config_from_dict`` raises them together."""

from __future__ import annotations

from finetune.config import PretrainedModelConfig, RecipeConfig, TrainingConfig
from finetune.optimizers import EIGHT_BIT
from finetune.schema import check_needs, check_ranges


def validate_training(t: TrainingConfig, problems: list):
    """The training section: each field's declared range and what it needs (a package, another training field);
    appends one line per problem."""
    check_ranges(t, "training", problems)
    check_needs(t, "training", problems)
    if t.loss_divisor == "labels" and t.packing:
        problems.append("training.packing: true hides each sample's first label in its row, which "
                        "training.loss_divisor=labels counts; set training.packing to null or false")


def validate_precision(cfg: RecipeConfig, problems: list) -> None:
    """``model.quantization`` against the training section; appends one line per problem. (What it needs,
    peft.enabled and bitsandbytes, its field declares: ``check_needs``.)"""
    m, t = cfg.model, cfg.training
    if not m.master_weights and m.dtype == "fp32":
        problems.append("model.master_weights: false trains the weights in model.dtype, which is fp32 here; set "
                        "model.dtype to bf16 (or fp16 on CUDA), or master_weights to true")
    # bitsandbytes' 8-bit matmul (0.50) keeps each layer's input on itself, outside autograd's saved tensors, whether
    # or not backward needs it: checkpointing cannot free those inputs and offloading cannot move them.
    for flag in ("gradient_checkpointing", "activation_offloading"):
        if m.quantization == "int8" and getattr(t, flag):
            problems.append(f"model.quantization: int8 layers keep their inputs outside autograd, which "
                            f"training.{flag} cannot {'free' if flag.startswith('gradient') else 'move'}; use nf4 "
                            f"or fp4 with it, or set training.{flag}=false")


def validate_offload(cfg: RecipeConfig, problems: list) -> None:
    """``training.offload`` against the optimizer and the base; appends one line per problem."""
    t, m = cfg.training, cfg.model
    if t.offload == "none":
        return
    if t.optimizer in EIGHT_BIT:  # the host steps fp32 partitions: bitsandbytes' block-wise states are not theirs
        problems.append(f"training.offload: {t.offload} steps the fp32 optimizer on the host; training.optimizer "
                        f"{t.optimizer} keeps 8-bit states on the card instead: use adamw, or training.offload=none")
    # ZeRO-3 partitions each weight's tensor, here bitsandbytes' packed bytes apart from the quantization state they
    # need (peft documents ZeRO-3 QLoRA only with bnb_4bit_quant_storage set to the compute dtype); the optimizer
    # level moves only the trainable adapters' state, measured to train over an nf4 and an int8 base
    if t.offload == "parameters" and getattr(m, "quantization", "none") != "none":
        problems.append(f"training.offload: parameters would partition bitsandbytes' quantized weights "
                        f"(model.quantization {m.quantization}) apart from their quantization state; use "
                        "training.offload=optimizer with it, or a bf16 base (model.quantization=none, "
                        "model.dtype=bf16)")


def refuse_precision_for_new_model(m: PretrainedModelConfig, problems: list) -> None:
    """For a task building a new model from ``model.config`` (random weights, all trained in fp32): one line per
    ``model.dtype`` / ``model.quantization`` that would not apply."""
    for name, default in (("dtype", "fp32"), ("quantization", "none"), ("master_weights", True)):
        if getattr(m, name) != default:
            problems.append(f"model.{name}: {getattr(m, name)} applies to pretrained weights (model.name_or_path); a "
                            f"model built from model.config trains every weight in fp32")


def validate_recipe(cfg: RecipeConfig, problems: list):
    """Every section's field ranges and what its fields need (``check_needs``: packages, other settings), then the
    checks of combinations; appends one line per problem."""
    validate_training(cfg.training, problems)
    sections = {name: getattr(cfg, name) for name in ("model", "data", "training", "output", "peft")}
    for name in ("model", "data", "output"):
        check_ranges(sections[name], name, problems)
    for name in ("model", "data", "output", "peft"):  # training's: validate_training
        check_needs(sections[name], name, problems, sections)
    if isinstance(cfg.model, PretrainedModelConfig):
        validate_precision(cfg, problems)
    validate_offload(cfg, problems)
    # Not field ranges: these depend on peft.enabled.
    p = cfg.peft
    if p.enabled:  # a disabled peft section is never read: its numbers cannot be wrong
        check_ranges(p, "peft", problems)
        if p.init_file is not None and not p.init_file.is_file():
            problems.append(f"peft.init_from: {p.init_file} not found (give a folder with adapter_model.safetensors)")

