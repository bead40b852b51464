"""An axolotl run's settings: its YAML config, or the copy of it that axolotl writes into the model card (under
"See axolotl config"), as TrainingArguments names with their sources (:class:`baselines.Baseline`).

axolotl trains with HF Trainer, so its step is the Trainer's (per-device batch × accumulation × processes, the
Trainer's sampler) except where a key changes it: ``sample_packing`` replaces the sampler with axolotl's own
multipack sampler (it packs each batch into ``micro_batch_size`` bins of ``sequence_len`` tokens, per epoch, and
estimates the step count from the most efficient rank: ``sample_packing_eff_est``) — another packing than TRL's bfd
or wrapped, which finetune has; ``context_parallel_size`` splits each sequence over several GPUs;
``dataloader_drop_last`` drops each epoch's incomplete last micro-batch (carried: ``training.drop_last``). Every key
that decides the steps is mapped (:data:`KEYS`) or named as not carried (:data:`NOT_CARRIED`); keys that say where
data, models and logs go are read and left (:data:`PLACES`); any other key is listed as unknown.

axolotl logs through the Trainer: ``trainer_state.json`` in its output and checkpoint folders (read as a Trainer
folder), and TensorBoard event files under ``output_dir/runs`` (:mod:`finetune.reproduce.tensorboard`).
"""

from __future__ import annotations

import re
from pathlib import Path

from finetune.errors import ConfigError
from finetune.reproduce.record import Baseline, load_yaml

KEYS = {  # axolotl's key → the TrainingArguments name it sets (None: the same name)
    "micro_batch_size": "per_device_train_batch_size", "gradient_accumulation_steps": None,
    "num_epochs": "num_train_epochs", "max_steps": None, "learning_rate": None, "lr_scheduler": "lr_scheduler_type",
    "warmup_ratio": None, "warmup_steps": None, "optimizer": "optim", "adam_beta1": None, "adam_beta2": None,
    "adam_epsilon": None, "weight_decay": None, "max_grad_norm": None, "seed": None, "bf16": None, "fp16": None,
    "tf32": None, "gradient_checkpointing": None, "sequence_len": "max_length",
    "train_on_inputs": None, "neftune_noise_alpha": None, "logging_steps": None, "group_by_length": None,
    "lr_scheduler_kwargs": None, "label_smoothing_factor": None, "cosine_min_lr_ratio": None,
    "adapter": None, "lora_r": None, "lora_alpha": None, "lora_dropout": None, "lora_target_modules": None,
    "load_in_4bit": None, "load_in_8bit": None, "bnb_4bit_quant_type": None, "eval_steps": None,
    "eval_strategy": None,
}
# keys read here into other settings: batch_size (→ accumulation), lora_target_linear (→ the adapted modules),
# dataloader_drop_last (→ training.drop_last), sample_packing and its companions (named, not carried)
READ_HERE = {"batch_size", "lora_target_linear", "dataloader_drop_last", "sample_packing", "shuffle_merged_datasets"}
MULTIPACK = ("multipack_real_batches", "sample_packing_eff_est", "sample_packing_group_size",
             "sample_packing_bin_size", "sample_packing_sequentially", "sample_packing_drop_attention_mask",
             "eval_sample_packing", "pretrain_multipack_attn", "pretrain_multipack_buffer_size")
# keys that change the steps and that finetune has no counterpart for: key → (axolotl's default, why)
NOT_CARRIED = {
    "context_parallel_size": (1, "axolotl splits each sequence over this many GPUs (ring attention) and trains on "
                                 "processes ÷ it data-parallel ranks: finetune has no context parallelism"),
    "sequence_parallel_degree": (1, "axolotl's older name for context_parallel_size: each sequence split over this "
                                    "many GPUs; finetune has no context parallelism"),
    "val_set_size": (0, "axolotl holds out this share of the rows (its own seeded split) before training: give "
                        "--data the rows it trained on"),
    "curriculum_sampling": (False, "axolotl draws the rows in order (a sequential sampler) for curriculum learning; "
                                   "set training.shuffle=false if the data are already in that order"),
    "shuffle_before_merging_datasets": (False, "axolotl shuffles each data set (seeded) before training: the rows' "
                                               "order is not the file's; give --data the rows in axolotl's order"),
    "bfloat16": (False, "axolotl loads the model in bf16 and trains it so (no fp32 master weights); finetune's "
                        "trainable weights stay fp32"),
    "float16": (False, "axolotl loads the model in fp16 and trains it so; finetune's trainable weights stay fp32"),
    "loraplus_lr_ratio": (None, "LoRA+ (another learning rate for the B matrices): finetune has one learning rate"),
    "use_rslora": (False, "rank-stabilised LoRA scales by alpha/√r: finetune's adapters scale by alpha/r"),
    "use_dora": (False, "DoRA adapters: finetune trains LoRA"),
    "lora_modules_to_save": (None, "finetune takes peft.modules_to_save: set it to these"),
    "peft_layers_to_transform": (None, "finetune adapts every layer of the named modules"),
    "unfrozen_parameters": (None, "finetune trains all weights or the adapters, not a chosen set"),
    "relora_steps": (None, "ReLoRA merges and restarts the adapters: finetune's adapters train through"),
    "lr_div_factor": (None, "finetune passes no scheduler arguments"),
    "cosine_constant_lr_ratio": (None, "finetune passes no scheduler arguments"),
    "noisy_embedding_alpha": (None, "finetune has no NEFTune"),
    "rl": (None, "an axolotl RL run (DPO, ORPO, KTO, GRPO): import its TRL trainer's arguments instead"),
    "tokens": (None, "axolotl adds these tokens to the vocabulary (new embeddings): finetune trains the model as "
                     "given"),
}
# keys that say where data, models and logs go, or how fast, not how a step is taken: read, never carried
PLACES = {
    "base_model", "base_model_config", "model_type", "tokenizer_type", "tokenizer_config", "trust_remote_code",
    "datasets", "test_datasets", "dataset_prepared_path", "output_dir", "pad_to_sequence_len", "wandb_project",
    "wandb_entity", "wandb_watch", "wandb_name", "wandb_log_model", "wandb_run_id", "hub_model_id", "hub_strategy",
    "strict", "special_tokens", "evals_per_epoch", "saves_per_epoch", "save_steps", "save_strategy",
    "resume_from_checkpoint", "local_rank", "logging_dir", "early_stopping_patience", "debug", "deepspeed", "fsdp",
    "fsdp_config", "fsdp_version", "flash_attention", "sdp_attention", "xformers_attention", "flex_attention",
    "chat_template", "lora_model_dir", "lora_fan_in_fan_out", "plugins", "auto_resume_from_checkpoints",
    "save_total_limit", "gradient_checkpointing_kwargs", "eval_batch_size", "torch_compile", "dataset_processes",
    "save_safetensors", "use_tensorboard", "use_wandb", "use_mlflow", "mlflow_tracking_uri", "mlflow_experiment_name",
    "gptq", "bnb_4bit_use_double_quant", "bnb_4bit_compute_dtype", "use_qlora", "load_best_model_at_end",
    "eval_max_new_tokens", "eval_table_size", "do_causal_lm_eval", "save_first_step", "bf16_full_eval",
    "fp16_full_eval", "ddp_timeout", "ddp_find_unused_parameters", "dataloader_num_workers", "dataloader_pin_memory",
    "dataloader_prefetch_factor", "skip_prepare_dataset", "quantization_config", "max_memory", "gpu_memory_limit",
    "low_cpu_mem_usage", "device_map", "is_llama_derived_model", "is_mistral_derived_model", "is_qwen_derived_model",
    "liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_fused_linear_cross_entropy", "cut_cross_entropy",
    "unsloth_cross_entropy_loss", "adapter_path", "chat_template_jinja", "default_system_message",
    "dataset_exact_deduplication", "profiler_steps",
}
TARGET_LINEAR = "all-linear"  # peft's name for every linear layer but the output layer (axolotl: all but lm_head)


def read_axolotl(path: Path, what: str) -> Baseline:
    """An axolotl YAML config file."""
    raw = load_yaml(path, what)
    if not is_axolotl(raw):
        raise ConfigError(f"{what}: {path} is not an axolotl config (no base_model, micro_batch_size or datasets)")
    b = Baseline("axolotl YAML", path, base_model=raw.get("base_model"))
    read_config(raw, b, path.name, what)
    return b


def is_axolotl(raw) -> bool:
    return isinstance(raw, dict) and bool({"base_model", "micro_batch_size", "datasets"} & set(raw))


def card_config(text: str, path: Path, b: Baseline) -> bool:
    """Read the axolotl YAML block of a model card (axolotl writes its config into every card it makes, under
    "See axolotl config") into ``b``; False when the card has none."""
    import yaml

    block = re.search(r"See axolotl config</summary>.*?```ya?ml\n(.*?)\n```", text, re.S)
    if not block:
        return False
    try:
        raw = yaml.safe_load(block.group(1))
    except yaml.YAMLError:
        raise ConfigError(f"{path}: its 'See axolotl config' block is not valid YAML") from None
    if not is_axolotl(raw):
        return False
    read_config(raw, b, f"{path.name} (axolotl config)", str(path))
    b.base_model = b.base_model or raw.get("base_model")
    return True


def read_config(raw: dict, b: Baseline, source: str, what: str) -> None:
    """axolotl's keys into ``b``: mapped (:data:`KEYS`), read here, named as not carried, or listed as unknown."""
    where = lambda key: f"{source}: {key}"  # noqa: E731
    for key, value in raw.items():
        if key in KEYS:
            b.args[KEYS[key] or key] = (value, where(key))
        elif key in NOT_CARRIED:
            default, why = NOT_CARRIED[key]
            if value not in (default, None, [], {}):
                b.uncarried.append((key, value, why))
        elif key not in PLACES and key not in READ_HERE and key not in MULTIPACK:
            b.unknown.append(key)
    micro, accumulation, batch = raw.get("micro_batch_size"), raw.get("gradient_accumulation_steps"), \
        raw.get("batch_size")
    if batch and not accumulation:  # axolotl: gradient_accumulation_steps = batch_size // micro_batch_size
        if not micro:
            raise ConfigError(f"{what}: batch_size needs micro_batch_size (axolotl derives the accumulation from both)")
        b.args["gradient_accumulation_steps"] = (int(batch) // int(micro),
                                                 f"{where('batch_size')} {batch} ÷ micro_batch_size {micro}")
    if raw.get("dataloader_drop_last"):
        b.args["drop_last"] = (int(micro or 1), f"{where('dataloader_drop_last')}: each epoch's incomplete last "
                                                "micro-batch of micro_batch_size rows dropped (one process)")
    if raw.get("lora_target_linear"):
        named = raw.get("lora_target_modules") or []
        b.args["lora_target_modules"] = ([TARGET_LINEAR], f"{where('lora_target_linear')}: every linear layer but "
                                         "lm_head (peft's all-linear)" + (f", which holds {named}" if named else ""))
    if len(raw.get("datasets") or []) > 1 and raw.get("shuffle_merged_datasets", True):
        b.uncarried.append(("shuffle_merged_datasets", raw.get("shuffle_merged_datasets", True), "axolotl shuffles "
                            "its merged data sets (seeded) before training: give --data the merged rows in that order"))
    if raw.get("sample_packing"):
        said = ", ".join(f"{k}={raw[k]}" for k in MULTIPACK if raw.get(k) is not None)
        b.uncarried.append(("sample_packing", True, "axolotl packs with its own multipack sampler: each batch is "
                            "micro_batch_size bins of sequence_len tokens, filled per epoch from the shuffled rows' "
                            "lengths, and its step count is estimated from the most efficient rank "
                            "(sample_packing_eff_est)" + (f" ({said})" if said else "") + "; finetune packs as TRL's "
                            "bfd or wrapped, another algorithm (other rows, other steps): the recipe trains unpacked"))
