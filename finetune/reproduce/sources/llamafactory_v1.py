"""LLaMA-Factory's v1 YAML (``llamafactory-cli v1 sft|dpo``, ``llamafactory.v1``): the model as ``model``, its
plug-in sections (``peft_config``, ``dist_config``, ``optim_config``, …) and its own trainer's keys
(``micro_batch_size``, ``global_batch_size``), read onto the TrainingArguments names the LLaMA-Factory source carries;
the stage is the caller's (the command names it, the data's converter shows it: :func:`trains_pairs`)."""

from __future__ import annotations

from pathlib import Path

from finetune.reproduce.record import Baseline, Where
from finetune.reproduce.sources.contract import yaml_mapping

# keys of its v1 format (llamafactory.v1: ``model`` and plug-in sections), which no other tool's YAML holds
V1_MARKS = ("model_class", "peft_config", "dist_config", "kernel_config", "train_dataset", "quant_config")

def is_v1(raw: dict) -> bool:
    """LLaMA-Factory's v1 YAML (``llamafactory-cli v1 sft|dpo``): the model as ``model`` and its plug-in keys."""
    return isinstance(raw.get("model"), str) and "base_model" not in raw and any(k in raw for k in V1_MARKS)


# LLaMA-Factory v1's TrainingArguments defaults (llamafactory/v1/config/training_args.py) for what decides the steps
V1_DEFAULTS = {"learning_rate": 1e-4, "num_train_epochs": 3, "max_grad_norm": 1.0, "bf16": True, "seed": 42,
               "cutoff_len": 2048}
# v1 keys read below, or that change no step
V1_READ = {"model", "model_class", "peft_config", "train_dataset", "output_dir", "micro_batch_size",
           "global_batch_size", "cutoff_len", "learning_rate", "num_train_epochs", "max_steps", "max_grad_norm",
           "bf16", "seed", "optim_config", "lr_scheduler_config", "kernel_config", "dist_config", "quant_config",
           "save_steps", "save_epochs", "save_total_limit", "save_ckpt_as_hf", "logging_steps", "sample_backend",
           "max_new_tokens", "trust_remote_code", "flash_attn", "resume_from_checkpoint", "batching_workers",
           "enable_activation_checkpointing", "dist_timeout", "init_config", "pref_beta", "pref_loss",
           "batching_strategy", "dp_size", "cp_size", "cp_mode", "mp_replicate_size", "mp_shard_size"}


def read_v1(raw: dict, path: Path, kind: str) -> Baseline:
    """LLaMA-Factory's v1 YAML: its own trainer (no HF Trainer), torch's AdamW and a constant learning rate unless a
    plug-in says otherwise, ``micro_batch_size`` per process and ``global_batch_size`` a step (unset: one
    micro-batch a step on each process)."""
    b = Baseline(kind, path)
    src = lambda key: Where(path.name, key)  # noqa: E731
    default = lambda key: Where(path.name, f"{key} (LLaMA-Factory v1's default)")  # noqa: E731
    b.base_model = raw.get("model")
    b.own["format"] = ("v1", src("model"))
    for key, name in (("learning_rate", "learning_rate"), ("num_train_epochs", "num_train_epochs"),
                      ("max_grad_norm", "max_grad_norm"), ("bf16", "bf16"), ("seed", "seed"),
                      ("cutoff_len", "max_length")):
        b.args[name] = (raw[key], src(key)) if key in raw else (V1_DEFAULTS[key], default(key))
    if raw.get("max_steps"):
        b.args["max_steps"] = (int(raw["max_steps"]), src("max_steps"))
    b.args["per_device_train_batch_size"] = (int(raw.get("micro_batch_size", 1)), src("micro_batch_size") if
                                             "micro_batch_size" in raw else default("micro_batch_size"))
    if raw.get("global_batch_size"):
        b.args["total_train_batch_size"] = (int(raw["global_batch_size"]), src("global_batch_size"))
    else:
        b.args["gradient_accumulation_steps"] = (1, Where(path.name, "global_batch_size unset: one micro-batch a "
                                                                     "step on each process"))
    if raw.get("optim_config") is None:
        b.args["optim"] = ("adamw_torch", Where(path.name, "optim_config unset: torch.optim.AdamW"))
        b.args["weight_decay"] = (0.01, Where(path.name, "optim_config unset: torch AdamW's weight_decay"))
    else:
        b.uncarried.append(("optim_config", raw["optim_config"], "finetune does not read LLaMA-Factory v1's "
                                                                "optimizer plug-ins"))
    if raw.get("lr_scheduler_config") is None:
        b.args["lr_scheduler_type"] = ("constant", Where(path.name, "lr_scheduler_config unset: a constant rate"))
    else:
        b.uncarried.append(("lr_scheduler_config", raw["lr_scheduler_config"], "finetune does not read LLaMA-Factory "
                                                                              "v1's scheduler plug-ins"))
    b.args["train_sampling_strategy"] = ("llamafactory-v1", src("batching_strategy"))
    b.uncarried.append(("sample order", "LLaMA-Factory v1's", "its data engine draws its own order, not the HF "
                                                            "Trainer's; finetune's order differs"))
    _v1_peft(raw, b, src)
    if raw.get("quant_config"):
        b.uncarried.append(("quant_config", raw["quant_config"], "finetune does not read LLaMA-Factory v1's "
                                                                "quantization plug-ins"))
    b.unknown.extend(k for k in raw if k not in V1_READ)
    return b


def _v1_peft(raw: dict, b, src) -> None:
    """v1's ``peft_config``: LoRA (its r, alpha, dropout, target modules), freeze tuning (not carried), or none
    (every weight trained)."""
    peft = raw.get("peft_config")
    if not isinstance(peft, dict):
        b.args["adapter"] = (None, Where(src("peft_config").file, "no peft_config: every weight trained"))
        return
    if str(peft.get("name")) != "lora":
        b.args["adapter"] = (None, Where(src("peft_config").file, f"peft_config.name: {peft.get('name')}, no adapters"))
        b.uncarried.append(("peft_config.name", peft.get("name"), "finetune trains every weight or LoRA adapters"))
        return
    where = src("peft_config")
    b.args["adapter"] = ("lora", where)
    for key, name in (("r", "lora_r"), ("lora_alpha", "lora_alpha"), ("lora_dropout", "lora_dropout")):
        if key in peft:
            b.args[name] = (peft[key], where.said(f".{key}"))
    target = peft.get("target_modules", "all")
    b.args["lora_target_modules"] = ("all-linear" if target == "all" else
                                     [t.strip() for t in str(target).split(",")] if isinstance(target, str) else
                                     list(target), where.said(".target_modules"))


def trains_pairs(raw: dict, path: Path) -> bool:
    """Whether a v1 YAML trains preference pairs: its DPO keys, or its ``train_dataset`` YAML (where it is here)
    converts each data set with ``converter: pair``."""
    if "pref_beta" in raw or "pref_loss" in raw:
        return True
    name = raw.get("train_dataset")
    if not isinstance(name, str):
        return False
    found = next((f for f in (Path(name), path.parent / name, path.parent.parent / name,
                              path.parent.parent / Path(name).name) if f.is_file()), None)
    data = yaml_mapping(found) if found is not None else None
    return bool(data) and all(isinstance(v, dict) and v.get("converter") == "pair" for v in data.values())
