"""The YAML that TRL's command line takes (``trl sft --config sft.yaml``, ``trl dpo …``): the trainer's config fields
(TrainingArguments / SFTConfig / DPOConfig names, read as they are), TRL's ``ModelConfig`` (``model_name_or_path``,
``dtype``, ``use_peft`` and its ``lora_*`` fields, ``load_in_4bit`` …) and the script's (``dataset_name`` …).

``use_peft: true`` trains LoRA with ModelConfig's defaults where the file does not say (r 16, alpha 32, dropout 0.05,
peft's default modules for the architecture); its ``lora_*`` names become the adapter settings. A model loaded in
bf16 / fp16 (``dtype``) and trained whole keeps no fp32 master weights: not carried (finetune's trainable weights
stay fp32); under LoRA the frozen base is kept so (``model.dtype``).
"""

from __future__ import annotations

from pathlib import Path

from finetune.loading import read_yaml
from finetune.registry import task_hints
from finetune.reproduce.objective import instruction_task, said_objective
from finetune.reproduce.record import Baseline, Where, pure_precision
from finetune.reproduce.sources.contract import Reader, yaml_mapping

# TRL ModelConfig's LoRA fields → (the adapter setting finetune's importer reads, TRL 1.16's default)
LORA = {"lora_r": ("lora_r", 16), "lora_alpha": ("lora_alpha", 32), "lora_dropout": ("lora_dropout", 0.05),
        "lora_target_modules": ("lora_target_modules", None)}
# ModelConfig / script fields that change the steps and that finetune has no counterpart for: name → (default, why)
NOT_CARRIED = {
    "use_rslora": (False, "rank-stabilised LoRA scales by alpha/√r: finetune's adapters scale by alpha/r"),
    "use_dora": (False, "DoRA adapters: finetune trains LoRA"),
    "lora_modules_to_save": (None, "finetune takes peft.modules_to_save: set it to these"),
    "lora_target_parameters": (None, "finetune adapts modules, not parameters"),
    "use_bnb_nested_quant": (False, "finetune's 4-bit weights use double quantization always"),
}
# the names that tell TRL's command-line config from another tool's
MARKS = {"model_name_or_path", "dataset_name", "per_device_train_batch_size", "use_peft", "dataset_train_split"}


def is_trl_config(raw) -> bool:
    """TRL's names beside its script's; no other tool's (axolotl's micro_batch_size, LLaMA-Factory's stage)."""
    return isinstance(raw, dict) and bool(MARKS & set(raw)) and not {"micro_batch_size", "stage"} & set(raw)


class TrlConfig(Reader):
    name = "TRL config"
    reads = "the YAML of TRL's command line (trl sft, dpo or grpo --config): its trainer's config, ModelConfig, script"
    trl = True  # TRL trained it, whatever keys it holds

    def recognises(self, path: Path) -> bool:
        return is_trl_config(yaml_mapping(path))

    def read(self, path: Path, what: str) -> Baseline:
        return read_trl_config(path, read_yaml(path, what), what)

    def carry_own(self, b: Baseline, out, model_fields: dict, data_fields: set, baseline_step: bool) -> None:
        """A full fine-tuning config that loads the model in bf16 / fp16 trains every weight in it (no fp32 master
        weights): the pure step, taken with ``baseline_step`` (``record.pure_precision``)."""
        for key, setting in b.own.items():
            half = {"bfloat16": "bf16", "float16": "fp16"}[setting[0]]
            pure_precision(out, setting, half, "TRL", baseline_step, model_fields)


SOURCE = TrlConfig()


def read_trl_config(path: Path, raw: dict, what: str) -> Baseline:
    """The baseline of a TRL command-line YAML config (every value with ``path.name: key`` as its source)."""
    b = Baseline("TRL config YAML", path, base_model=raw.get("model_name_or_path"))
    where = lambda key: Where(path.name, key)  # noqa: E731
    for key, value in raw.items():
        if key in NOT_CARRIED:
            default, why = NOT_CARRIED[key]
            if value not in (default, None, []):
                b.uncarried.append((key, value, why))
        elif key not in LORA and key != "use_peft":
            b.args[key] = (value, where(key))
    # TRL's configs say TRL trained it (the importer's TRL rules follow: truncation, TRL's LoRA start)
    b.source = SOURCE  # TRL's: with no other trainer's key, its SFTTrainer's
    b.objective = said_objective(b)  # from its keys, before any default of one trainer's is added
    trainer_defaults(raw, b, path)
    if b.objective.name == instruction_task():  # an SFT config: SFTConfig's default
        b.args.setdefault("completion_only_loss", (None, f"{path.name}: TRL's default (SFTConfig)"))
    if not raw.get("use_peft"):  # TRL's ModelConfig: use_peft false by default, every weight trained
        b.args["adapter"] = (None, f"{where('use_peft')}: false" if "use_peft" in raw else
                             f"{path.name}: no use_peft (TRL's default false): every weight trained")
    else:
        b.args["adapter"] = ("lora", where("use_peft"))
        for key, (name, default) in LORA.items():
            if raw.get(key) is not None:
                b.args[name] = (raw[key], where(key))
            elif default is not None:
                b.args[name] = (default, f"{path.name}: TRL ModelConfig's default {key}")
    _dtype(raw, b, path)
    return b


# TrainingArguments' defaults (transformers 5.24) of what shapes the steps, where the YAML leaves them out; warmup_steps
# only where no warmup_ratio is given either (an older TrainingArguments' ratio, read as such)
TRAINER_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "num_train_epochs": 3.0,
                    "lr_scheduler_type": "linear", "warmup_steps": 0}
# the learning rate of TRL 1.16's trainer configs (each sets its own: trl/trainer/*_config.py)
TRL_LEARNING_RATES = {"SFTConfig": 2e-5, "DPOConfig": 1e-6, "GRPOConfig": 1e-6}


def trainer_defaults(raw: dict, b: Baseline, path: Path) -> None:
    """The arguments TRL trains with where the YAML does not say them: TrainingArguments' defaults, and the
    learning rate of the config class of the objective (the class its task's hints name)."""
    for key, value in TRAINER_DEFAULTS.items():
        if key not in raw and not (key == "warmup_steps" and "warmup_ratio" in raw):
            b.args[key] = (value, Where(path.name, key).said(f": {value}, TrainingArguments' default"))
    if "learning_rate" not in raw and b.objective is not None:
        config = next((n for n in task_hints(b.objective.name).objective_names if n in TRL_LEARNING_RATES), None)
        if config is not None:
            b.args["learning_rate"] = (TRL_LEARNING_RATES[config], Where(path.name, "learning_rate").said(
                f": {TRL_LEARNING_RATES[config]:g}, {config}'s default (TRL 1.16)"))


def _dtype(raw: dict, b: Baseline, path: Path) -> None:
    """``dtype`` (``torch_dtype`` before TRL 0.20): the weights TRL loads and trains."""
    key = "dtype" if "dtype" in raw else "torch_dtype"
    dtype = str(raw.get(key) or "float32").removeprefix("torch.")
    half = {"bfloat16": "bf16", "float16": "fp16"}.get(dtype)
    if half is None:
        return
    if raw.get("use_peft"):
        b.args["model_dtype"] = (half, f"{path.name}: {key} (the frozen base; peft keeps the adapters in fp32)")
    else:  # every weight trained in it: the pure step, taken on request (carry_own)
        b.own[key] = (dtype, Where(path.name, key))

