"""An axolotl run's settings: its YAML config, or the copy of it that axolotl writes into the model card (under
"See axolotl config"), as TrainingArguments names with their sources (:class:`baselines.Baseline`). What is said here
of axolotl was read in axolotl 0.21.0's source.

axolotl trains with HF Trainer, so its step is the Trainer's (per-device batch × accumulation × processes, the
Trainer's sampler) except where a key changes it: ``sample_packing`` replaces the sampler with axolotl's own
multipack sampler (it packs each batch into ``micro_batch_size`` bins of ``sequence_len`` tokens, per epoch, and
estimates the step count from the most efficient rank: ``sample_packing_eff_est``) — another packing than TRL's bfd
or wrapped, which finetune has; ``context_parallel_size`` splits each sequence over several GPUs;
``dataloader_drop_last`` drops each epoch's incomplete last micro-batch (carried: ``training.drop_last``). Every key
that decides the steps is mapped (:data:`KEYS`, with axolotl's defaults where the config omits one:
:data:`DEFAULTS`) or named as not carried (:data:`NOT_CARRIED`, :data:`CHAT_KEYS` for a data set's); keys that say
where data, models and logs go are read and left (:data:`PLACES`); any other key is listed as unknown.

What axolotl does beyond the Trainer's arguments, carried here:

* it shuffles its training rows once before training, even a single data set (``utils/data/shared.py``,
  ``merge_datasets``: ``ds.shuffle(seed=cfg.seed)`` unless ``shuffle_merged_datasets: false`` or
  ``curriculum_sampling``): ``Baseline.shuffled``, and ``finetune import --data`` writes the rows in that order;
* its warm-up (``core/builders/base.py``, ``_configure_warmup_and_logging``): ``warmup_steps`` as given, else
  ``int(warmup_ratio × steps)`` rounded down, else ``min(int(0.03 × steps), 100)``; a warm-up of 1 becomes 2
  (:func:`warmup`, the source's ``warmup``);
* no ``adapter``: every weight trained (``peft.enabled: false``);
* a ``chat_template`` data set is a conversation trained on the assistant's turns: the task whose hints name it
  (``CompareHints.peer_names["axolotl"]``), rendered with the template axolotl took (:func:`carry_own`) and no
  system message added (``default_system_message`` only replaces a text that 0.21.0's chatml template lacks).

axolotl logs through the Trainer: ``trainer_state.json`` in its output and checkpoint folders (read as a Trainer
folder), and TensorBoard event files under ``output_dir/runs`` (:mod:`finetune.reproduce.sources.tensorboard`).
"""

from __future__ import annotations

import re
from pathlib import Path

import finetune.reproduce.sources.axolotl_rows as axolotl_rows
import finetune.reproduce.sources.files as files
from finetune.errors import ConfigError
from finetune.loading import parse_yaml, read_yaml
from finetune.registry import built_in_hints
from finetune.reproduce.objective import instruction_task, named_task
from finetune.reproduce.record import Baseline, Objective, Where, local_file
from finetune.reproduce.sources.contract import Reader, yaml_mapping

TOOL = "axolotl"  # this tool's name in a task's CompareHints.peer_names (the type of its data sets)

KEYS = {  # axolotl's key → the TrainingArguments name it sets (None: the same name)
    "micro_batch_size": "per_device_train_batch_size", "gradient_accumulation_steps": None,
    "num_epochs": "num_train_epochs", "max_steps": None, "learning_rate": None, "lr_scheduler": "lr_scheduler_type",
    "optimizer": "optim", "adam_beta1": None, "adam_beta2": None,
    "adam_epsilon": None, "weight_decay": None, "max_grad_norm": None, "seed": None, "bf16": None, "fp16": None,
    "tf32": None, "gradient_checkpointing": None, "sequence_len": "max_length",
    "neftune_noise_alpha": None, "logging_steps": None, "group_by_length": None,
    "lr_scheduler_kwargs": None, "label_smoothing_factor": None, "cosine_min_lr_ratio": None,
    "adapter": None, "lora_r": None, "lora_alpha": None, "lora_dropout": None, "lora_target_modules": None,
    "load_in_4bit": None, "load_in_8bit": None, "bnb_4bit_quant_type": None, "eval_steps": None,
    "eval_strategy": None, "deepspeed": None,
}
# axolotl 0.21.0's defaults (its config schema) for keys of KEYS that a config may omit: key → (value, why)
DEFAULTS = {
    "micro_batch_size": (1, "axolotl's default"), "num_epochs": (1, "axolotl's default"),
    "lr_scheduler": ("cosine", "axolotl's default"), "optimizer": ("adamw_torch_fused", "axolotl's default"),
    "weight_decay": (0.0, "axolotl's default"),
    "max_grad_norm": (1.0, "the Trainer's default (axolotl passes none)"),
    "sequence_len": (512, "axolotl's default"),
    "seed": (42, "axolotl's default (it sets 42 when none is given)"),
}
# keys read here into other settings: batch_size (→ accumulation), lora_target_linear (→ the adapted modules),
# dataloader_drop_last (→ training.drop_last), the warm-up (→ axolotl's rule), the shuffle (→ Baseline.shuffled), the
# chat template and precision (→ carry_own, the model's dtype), sample_packing and its companions (named, not carried)
READ_HERE = {"batch_size", "lora_target_linear", "dataloader_drop_last", "sample_packing", "shuffle_merged_datasets",
             "shuffle_before_merging_datasets", "warmup_ratio", "warmup_steps", "chat_template",
             "chat_template_jinja", "default_system_message", "rl", "reward_model", "process_reward_model",
             "pretraining_dataset", "rl_beta", "dpo_beta", "dpo_loss_type", "trl", "train_on_inputs"}
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
    "tokens": (None, "axolotl adds these tokens to the vocabulary (new embeddings): finetune trains the model as "
                     "given"),
    "dataset_exact_deduplication": (False, "axolotl drops rows that repeat another exactly: give --data without "
                                           "them"),
    "excess_length_strategy": ("drop", "finetune drops a conversation longer than sequence_len (data.too_long: "
                                       "drop), as axolotl's default does"),
    "min_sample_len": (None, "axolotl drops rows shorter than this: give --data without them"),
    "chat_template_kwargs": (None, "finetune renders the chat template with no extra arguments"),
    "eot_tokens": (None, "finetune trains each assistant turn's end token, the tokenizer's eos (axolotl's default)"),
}
# a chat_template data set's keys that change which tokens are trained, or the rows: key → (axolotl's default, why)
CHAT_KEYS = {
    "field_messages": ("messages", "finetune reads each row's conversation from its messages column: give --data "
                                   "rows with the conversation there"),
    "roles_to_train": (["assistant"], "finetune trains the assistant's turns (data.train_on: assistant) or every "
                                      "token (data.train_on: all)"),
    "train_on_eos": ("turn", "finetune trains the end token of each trained turn (axolotl's train_on_eos: turn)"),
    "train_on_eot": (None, "finetune trains the end token of each trained turn (axolotl's train_on_eos: turn)"),
    "message_property_mappings": ({}, "axolotl maps other fields onto role and content: give --data rows with role "
                                      "and content"),
    "message_field_role": (None, "give --data rows whose messages have role and content"),
    "message_field_content": (None, "give --data rows whose messages have role and content"),
    "roles": (None, "axolotl maps other role names onto system, user and assistant: give --data rows with those"),
    "drop_system_message": (False, "axolotl drops each conversation's system turn: give --data rows without it"),
    "message_field_training": (None, "axolotl trains the turns each row marks; finetune trains by role"),
    "message_field_training_detail": (None, "axolotl trains the spans each row marks; finetune trains by role"),
    "shards": (None, "axolotl keeps one shard of the shuffled rows: give --data that shard"),
    "weight": (None, "axolotl keeps this share of the shuffled rows: give --data those rows"),
}
# keys that say where data, models and logs go, or how fast, not how a step is taken: read, never carried
PLACES = {
    "base_model", "base_model_config", "model_type", "tokenizer_type", "tokenizer_config", "trust_remote_code",
    "datasets", "test_datasets", "dataset_prepared_path", "output_dir", "pad_to_sequence_len", "wandb_project",
    "wandb_entity", "wandb_watch", "wandb_name", "wandb_log_model", "wandb_run_id", "hub_model_id", "hub_strategy",
    "strict", "special_tokens", "evals_per_epoch", "saves_per_epoch", "save_steps", "save_strategy",
    "resume_from_checkpoint", "local_rank", "logging_dir", "early_stopping_patience", "debug", "fsdp",
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
    "unsloth_cross_entropy_loss", "adapter_path", "profiler_steps", "dataset_num_proc", "lora_mlp_kernel",
    "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel",
}
TARGET_LINEAR = "all-linear"  # peft's name for every linear layer but the output layer (axolotl: all but lm_head)
# axolotl 0.21.0's chatml template (axolotl/utils/chat_templates/templates/chatml.jinja), as it is
CHATML = ("{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
          "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOKENIZER_TEMPLATE = "tokenizer_default"  # axolotl's default: the tokenizer's own template


class Axolotl(Reader):
    name = "axolotl"
    reads = ("its config YAML, or an output / Hub folder or model card whose card holds its config block (\"See "
             "axolotl config\"), with the Trainer's files beside it")

    def recognises(self, path: Path) -> bool:
        card = path / "README.md" if path.is_dir() else path
        if card.suffix.lower() == ".md":
            return card.is_file() and CARD_BLOCK.search(card.read_text(encoding="utf-8", errors="replace")) is not None
        return is_axolotl(yaml_mapping(path))

    def read(self, path: Path, what: str) -> Baseline:
        if path.is_dir():
            return read_folder(path, what)
        if path.suffix.lower() == ".md":
            return read_card(path, what)
        return read_axolotl(path, what)

    def warmup(self, b: Baseline, ratio: float, total: int | None) -> tuple:
        return warmup(ratio, total, b.own["warmup_cap"][0] if "warmup_cap" in b.own else None)

    def adapters_start(self, b: Baseline) -> tuple:
        return False, ("axolotl draws them after set_seed(seed) while it loads the model, which finetune's draw does "
                       "not replay (checked with axolotl 0.21.0, peft 0.21): give --initial-adapter DIR, the adapters "
                       "of axolotl's start replayed (examples/axolotl/initial_adapters.py)")

    def carry_own(self, b: Baseline, out, model_fields: dict, data_fields: set, baseline_step: bool) -> None:
        carry_own(b, out, model_fields, data_fields, baseline_step)

    def training_rows(self, b: Baseline, data, recipe: Path):
        return axolotl_rows.training_rows(b, data, recipe)  # rows in axolotl's formats, as finetune's


SOURCE = Axolotl()
CARD_BLOCK = re.compile(r"See axolotl config</summary>.*?```ya?ml\n(.*?)\n```", re.S)


def read_axolotl(path: Path, what: str) -> Baseline:
    """An axolotl YAML config file."""
    raw = read_yaml(path, what)
    if not is_axolotl(raw):
        raise ConfigError(f"{what}: {path} is not an axolotl config (no base_model, micro_batch_size or datasets)")
    b = Baseline("axolotl YAML", path, base_model=raw.get("base_model"))
    read_config(raw, b, path.name, what)
    return b


def read_card(path: Path, what: str) -> Baseline:
    """A model card axolotl wrote: its config block, and the Trainer's hyperparameters list when it has one."""
    b = Baseline("model card", path, card_only=True)
    text = path.read_text(encoding="utf-8", errors="replace")
    files.read_front(text, path, b)
    card_config(text, path, b)
    if files.card_pairs(text):  # the Trainer's list, which says the run first hand
        files.read_card(path, b, what, required=False)
    return b


def read_folder(folder: Path, what: str) -> Baseline:
    """An axolotl output or Hub folder: the Trainer's files, with what the config block of its card says beyond the
    Trainer's arguments (its task, row order, template, warm-up rounding)."""
    if files.state_file(folder) is None and not files.event_files(folder) and not files.has_args_file(folder):
        b = read_card(folder / "README.md", what)  # a Hub or adapters folder: its card, with the configs beside it
        files.read_model_files(b, [folder], what)
        return b
    b = files.read_folder(folder, what)
    card = Baseline("model card", folder / "README.md")
    text = card.path.read_text(encoding="utf-8", errors="replace")
    files.read_front(text, card.path, card)
    card_config(text, card.path, card)
    b.args = {**card.args, **b.args}  # the Trainer's arguments and list, when present, say it first hand
    b.unknown, b.uncarried = card.unknown, card.uncarried
    if card.base_model:
        b.base_model, b.base_model_where = card.base_model, card.base_model_where
    b.objective, b.own, b.shuffled, b.data_file = card.objective, card.own, card.shuffled, card.data_file
    return b


def is_axolotl(raw) -> bool:
    return isinstance(raw, dict) and bool({"base_model", "micro_batch_size", "datasets"} & set(raw))


def card_config(text: str, path: Path, b: Baseline) -> bool:
    """Read the axolotl YAML block of a model card (axolotl writes its config into every card it makes, under
    "See axolotl config") into ``b``; False when the card has none."""
    block = CARD_BLOCK.search(text)
    if not block:
        return False
    raw = parse_yaml(block.group(1), f"{path}: its 'See axolotl config' block")
    if not is_axolotl(raw):
        return False
    read_config(raw, b, f"{path.name} (axolotl config)", str(path))
    b.base_model = b.base_model or raw.get("base_model")
    return True


def read_config(raw: dict, b: Baseline, source: str, what: str) -> None:
    """axolotl's keys into ``b``: mapped (:data:`KEYS`, :data:`DEFAULTS` for those it omits), read here, named as
    not carried, or listed as unknown; the task its data sets train, the order of its rows and its warm-up rule."""
    where = lambda key: Where(source, key)  # noqa: E731
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
    elif not accumulation:
        b.args["gradient_accumulation_steps"] = (1, f"{where('gradient_accumulation_steps')}: 1, axolotl's default")
    for key, (value, why) in DEFAULTS.items():
        if raw.get(key) is None:
            b.args[KEYS[key] or key] = (value, where(key).said(f": {value}, {why}"))
    if not raw.get("adapter"):
        b.args["adapter"] = (None, f"{source}: no adapter: every weight trained")
    inputs = raw.get("train_on_inputs")  # as finetune's data.train_on: the prompt masked unless it is true
    b.args["train_on"] = ("all" if inputs else "assistant", where("train_on_inputs").said(
        f"={bool(inputs)}" + ("" if inputs is not None else ", axolotl's default")))
    if raw.get("dataloader_drop_last"):
        b.args["drop_last"] = (int(micro or 1), f"{where('dataloader_drop_last')}: each epoch's incomplete last "
                                                "micro-batch of micro_batch_size rows dropped (one process)")
    if raw.get("lora_target_linear"):
        named = raw.get("lora_target_modules") or []
        b.args["lora_target_modules"] = ([TARGET_LINEAR], f"{where('lora_target_linear')}: every linear layer but "
                                         "lm_head (peft's all-linear)" + (f", which holds {named}" if named else ""))
    _precision(raw, b, where)
    _warmup(raw, b, source, where)
    _datasets(raw, b, source, where)
    if raw.get("sample_packing"):
        b.own["sample_packing"] = (True, where("sample_packing"))
        said = ", ".join(f"{k}={raw[k]}" for k in MULTIPACK if raw.get(k) is not None)
        b.uncarried.append(("sample_packing", True, "axolotl packs with its own multipack sampler: each batch is "
                            "micro_batch_size bins of sequence_len tokens, filled per epoch from the shuffled rows' "
                            "lengths, and its step count is estimated from the most efficient rank "
                            "(sample_packing_eff_est)" + (f" ({said})" if said else "") + "; finetune packs as TRL's "
                            "bfd or wrapped, another algorithm (other rows, other steps): the recipe trains unpacked"))


def _precision(raw: dict, b: Baseline, where) -> None:
    """bf16 / fp16: axolotl's ``bf16: auto`` (its default) is bf16 where the GPU has it, else fp16 (said, unless the
    Trainer's arguments beside the config say what it became); with bf16 or fp16 on, axolotl also loads the model in
    that dtype (``utils/config.resolve_dtype``): the frozen base of a LoRA run (peft keeps the adapters in fp32), every
    weight of a full run (not carried: finetune's trainable weights stay fp32)."""
    bf16 = raw.get("bf16", "auto")
    if bf16 == "auto":
        b.args.pop("bf16", None)
        if not raw.get("fp16"):
            b.own["bf16"] = ("auto", where("bf16"))
    if raw.get("tf32") == "auto":  # axolotl passes tf32=False unless it is True
        b.args["tf32"] = (False, f"{where('tf32')}: auto (the Trainer's tf32 off)")
    half = "bf16" if bf16 is True or raw.get("bfloat16") else "fp16" if raw.get("fp16") or raw.get("float16") else None
    if half is None:
        return
    key = "bf16" if bf16 is True else "bfloat16" if raw.get("bfloat16") else "fp16" if raw.get("fp16") else "float16"
    if raw.get("adapter"):
        b.args["model_dtype"] = (half, f"{where(key)} (axolotl loads the frozen base in {half}; peft keeps the "
                                       "adapters in fp32)")
    elif key in ("bf16", "fp16"):  # bfloat16 / float16 are named by NOT_CARRIED
        b.uncarried.append((key, True, f"axolotl loads the model in {half} and trains every weight in it (no fp32 "
                                       "master weights); finetune's trainable weights stay fp32"))


def _warmup(raw: dict, b: Baseline, source: str, where) -> None:
    """axolotl's warm-up keys as the Trainer's, and its rounding of a ratio (:func:`warmup`)."""
    if raw.get("warmup_steps") is not None and 0 < float(raw["warmup_steps"]) < 1:  # transformers 5: a ratio
        b.args["warmup_steps"] = (float(raw["warmup_steps"]), where("warmup_steps"))
    elif raw.get("warmup_steps") is not None:
        steps = int(raw["warmup_steps"])
        b.args["warmup_steps"] = (2 if steps == 1 else steps, where("warmup_steps").said(
            " (1 made 2, as axolotl does)" if steps == 1 else ""))
    elif raw.get("warmup_ratio") is not None:
        b.args["warmup_ratio"] = (float(raw["warmup_ratio"]), where("warmup_ratio"))
    else:
        b.args["warmup_ratio"] = (0.03, Where(source, "no warmup_steps nor warmup_ratio (axolotl's default: 3% of the "
                                                      "steps, at most 100)"))
    if raw.get("warmup_steps") is None and raw.get("warmup_ratio") is None:
        b.own["warmup_cap"] = (100, f"{source}: axolotl's default warm-up, at most 100 steps")


def warmup(ratio: float, total: int | None, cap: int | None = None) -> tuple:
    """(warm-up steps, how they were rounded) as axolotl 0.21.0 turns a ratio into steps
    (``_configure_warmup_and_logging``): ``int(ratio × total)``, rounded down, at most ``cap`` (its default ratio's
    100), and 1 made 2; (None, the formula) when the steps are unknown."""
    if total is None:
        return None, f"int({ratio:g} × N){f', at most {cap}' if cap else ''}, 1 made 2 (axolotl rounds down)"
    steps = int(ratio * total)
    steps = min(steps, cap) if cap else steps
    return (2 if steps == 1 else steps), "rounded down as axolotl does" + (f", at most {cap}" if cap else "") + (
        ", 1 made 2 as axolotl does" if steps == 1 else "")


def _datasets(raw: dict, b: Baseline, source: str, where) -> None:
    """The data sets: the task their type trains, the keys of theirs finetune cannot follow, the template they are
    rendered with, and the one shuffle of their merged rows (``Baseline.shuffled``)."""
    sets = [d for d in raw.get("datasets") or [] if isinstance(d, dict)]
    b.objective = objective(raw, sets, where)
    b.own["datasets"] = (sets, where("datasets"))  # their rows' formats (axolotl_rows)
    if raw.get("rl"):
        preference_args(raw, b, where)
    for n, d in enumerate(sets):
        name = f"datasets[{n}]" if len(sets) > 1 else "datasets"
        if dataset_task({str(d.get("type"))}) is None:
            trained = ", ".join(sorted(h.peer_names[TOOL] for h in built_in_hints().values() if TOOL in h.peer_names))
            b.uncarried.append((f"{name}.type", d.get("type"), f"axolotl formats these rows with its own "
                                f"{d.get('type')} prompt strategy; finetune's tasks train axolotl's {trained} rows"))
        for key, (default, why) in CHAT_KEYS.items():
            value = d.get(key)
            if value is not None and value != default and not (key == "weight" and float(value) >= 1):
                b.uncarried.append((f"{name}.{key}", value, why))
    chats = [d for d in sets if d.get("type") == "chat_template"]
    templates = {(d["chat_template"], d.get("chat_template_jinja")) if d.get("chat_template") else
                 (raw.get("chat_template") or TOKENIZER_TEMPLATE, raw.get("chat_template_jinja")) for d in chats}
    if len(templates) == 1:
        said = "chat_template" if "chat_template" in raw else f"chat_template (axolotl's default {TOKENIZER_TEMPLATE})"
        b.own["chat_template"] = (next(iter(templates)), where(said))
    elif templates:
        b.uncarried.append(("chat_template", sorted(str(t[0]) for t in templates), "its data sets are rendered with "
                            "different templates; finetune renders every row with one"))
    if raw.get("default_system_message"):
        b.own["default_system_message"] = (raw["default_system_message"], where("default_system_message"))
    if len(sets) == 1 and (found := local_file(sets[0].get("path"), b.path)) is not None:
        b.data_file = (found, where("datasets") + f"[0].path {sets[0]['path']}")
    if raw.get("curriculum_sampling") or raw.get("shuffle_merged_datasets", True) is False or not sets:
        return  # the rows in the files' order
    if len(sets) > 1 and raw.get("shuffle_before_merging_datasets"):
        b.uncarried.append(("shuffle_before_merging_datasets", True, "axolotl shuffles each data set (seeded), then "
                            "their merged rows again: give --data the rows in the order axolotl trained them"))
        return
    said = "shuffle_merged_datasets" + ("" if "shuffle_merged_datasets" in raw else " (axolotl's default true)")
    b.shuffled = (int(raw["seed"]) if raw.get("seed") is not None else DEFAULTS["seed"][0],
                  where(said) + (f", its {len(sets)} data sets one after another" if len(sets) > 1 else ""))


# its data sets' prompt strategies (type, before any "." or ":") that train on the whole text, or pairs of a reward
# model, or a process reward model's steps; every other strategy formats instructions or chats and masks the prompt
# (train_on_inputs false, its default): sft
TYPES = {"completion": "clm", "pretrain": "clm", "bradley_terry": "reward model",
         "stepwise_supervised": "process reward model"}


def objective(raw: dict, sets: list, where) -> Objective | None:
    """What an axolotl config trains: its ``rl``, ``reward_model``, ``process_reward_model``,
    ``pretraining_dataset``, else its data sets' type; None when they name no type (pre-tokenized rows)."""
    if raw.get("rl"):
        # its RLType: the task whose objective_names hold it (ipo: the dpo task's loss type), else refused by name
        return Objective(named_task(raw["rl"]) or str(raw["rl"]), where("rl").said(f" {raw['rl']}"))
    for key, name in (("reward_model", "reward model"), ("process_reward_model", "process reward model")):
        if raw.get(key):
            return Objective(name, where(key).said(" true"))
    if raw.get("pretraining_dataset"):
        return Objective("clm", where("pretraining_dataset"))
    kinds = {str(d.get("type") or "") for d in sets}
    if not kinds or "" in kinds:
        return None
    found = {TYPES.get(re.split(r"[.:]", k)[0]) for k in kinds}
    if len(found) != 1:
        return None
    name = found.pop()
    return Objective(name or instruction_task(), where("datasets").said(f" type {', '.join(sorted(kinds))}" + (
        "" if name else " (instructions or chats: the prompt masked unless train_on_inputs)")))


def preference_args(raw: dict, b: Baseline, where) -> None:
    """An axolotl preference run's beta (``rl_beta``, ``trl.beta``, the older ``dpo_beta``) and loss type (``rl:
    ipo``, ``dpo_loss_type``), as DPOConfig's names, which the dpo task's settings take."""
    trl = raw.get("trl") if isinstance(raw.get("trl"), dict) else {}
    for key, value in (("rl_beta", raw.get("rl_beta")), ("trl.beta", trl.get("beta")),
                       ("dpo_beta", raw.get("dpo_beta"))):
        if value is not None:
            b.args["beta"] = (float(value), where(key))
            break
    if raw.get("rl") == "ipo":
        b.args["loss_type"] = ("ipo", where("rl").said(" ipo"))
    elif raw.get("dpo_loss_type") is not None:
        b.args["loss_type"] = (raw["dpo_loss_type"], where("dpo_loss_type"))


def dataset_task(types: set) -> str | None:
    """The built-in task that trains axolotl data sets of these types (the one whose hints name the type), when
    they are all of one type; None otherwise."""
    if len(types) != 1:
        return None
    kind = next(iter(types))
    return next((name for name, h in built_in_hints().items() if h.peer_names.get(TOOL) == kind), None)


def carry_own(b: Baseline, out, model_fields, data_fields: set, baseline_step: bool) -> None:
    """axolotl's own settings onto the recipe (its source's ``carry_own``, called last by ``carry.carry``): the chat
    template it rendered with, no system message, where its adapters started, and its ``bf16: auto`` when nothing
    says what it became. ``baseline_step``: its multipack step is not one finetune takes (said)."""
    own = b.own
    if "chat_template" in own and "chat_template" in model_fields:
        (choice, jinja), where = own["chat_template"]
        if choice == TOKENIZER_TEMPLATE or str(choice).startswith(f"{TOKENIZER_TEMPLATE}_fallback_"):
            out.set("model.chat_template", None, f"{where}: {choice}, the tokenizer's own template")
        elif choice == "jinja" and jinja:
            out.set("model.chat_template", jinja, f"{where}: jinja, its chat_template_jinja")
        elif choice == "chatml":
            out.set("model.chat_template", CHATML, f"{where}: chatml, axolotl 0.21.0's template as it is")
        else:
            out.skip("chat_template", choice, "finetune renders conversations with the tokenizer's template or "
                     f"model.chat_template: set it to axolotl's {choice}.jinja (axolotl/utils/chat_templates/"
                     "templates/)")
    if "system_prompt" in data_fields:
        said = own.get("default_system_message")
        out.set("data.system_prompt", None, f"{said[1]}: axolotl puts it only in place of 'You are a helpful "
                "assistant.' in its chatml template, which 0.21.0's does not hold: no system message added" if said
                else "axolotl adds no system message to a conversation (the template's own default stays)")
    if "bf16" in own and "bf16" not in b.args:
        out.skip("bf16", "auto", "axolotl trains in bf16 where the GPU has it, else in fp16 (auto, its default): "
                 "set training.mixed_precision to what it took")
    if "sample_packing" in own:
        out.other_samples = "the baseline's batches were axolotl's multipack bins"
    if baseline_step and "sample_packing" in own:
        out.not_carried.append("own step: not taken — axolotl's multipack bins rows in the order of a "
                               "RandomSampler that has no generator: each order is seeded from torch's global "
                               "random state at that moment, drawn again for each of its batch-count estimates, "
                               "which nothing outside its process can replay; finetune keeps its exact big-batch "
                               "step")
