"""Which of LLaMA-Factory's YAMLs a file is: its 0.x configs (``llamafactory-cli train|chat|export|eval``) or its v1
format, known by keys no other tool's YAML holds; and the configs that train nothing (export, chat, benchmark,
predict, eval), refused as such."""

from __future__ import annotations

from pathlib import Path

from finetune.errors import ConfigError
from finetune.reproduce.sources.llamafactory_v1 import is_v1

# keys only LLaMA-Factory's YAMLs hold (beside model_name_or_path): its training, chat, eval and export configs
V0_MARKS = ("stage", "template", "finetuning_type", "export_dir", "infer_backend", "adapter_name_or_path")
# what a file that trains nothing is for, by the key that says so (the first that a file holds names it)
NOT_TRAINING = (
    ("export_dir", "export config (llamafactory-cli export: it merges adapters into the model or quantizes it)"),
    ("infer_backend", "inference config (llamafactory-cli chat / api / webchat)"),
    ("n_shot", "benchmark config (llamafactory-cli eval: MMLU, C-Eval, CMMLU)"),
    ("do_predict", "predict config (do_predict: it generates on eval_dataset)"),
    ("do_eval", "eval config (do_eval: it scores eval_dataset)"),
)


def is_v0(raw: dict) -> bool:
    """LLaMA-Factory's YAML (0.x, the ``llamafactory-cli train|chat|export|eval`` configs): the base model as
    ``model_name_or_path`` and one of its own keys; axolotl names its model ``base_model``, TRL has no template."""
    if "stage" in raw and ("template" in raw or "finetuning_type" in raw):  # a training config, whatever else
        return True
    return "model_name_or_path" in raw and "base_model" not in raw and any(k in raw for k in V0_MARKS) and \
        ("stage" in raw or "template" in raw or "finetuning_type" in raw or "export_dir" in raw)


def refuse_non_training(raw: dict, path: Path, what: str, stages: list) -> None:
    """ConfigError (one line) for a LLaMA-Factory file that trains nothing: an export, chat, benchmark, predict or
    eval config (``do_train`` not true beside them), or a v1 export (``peft_config.export_dir``, no data)."""
    peft = raw.get("peft_config") if isinstance(raw.get("peft_config"), dict) else {}
    v1_export = is_v1(raw) and "export_dir" in peft and "train_dataset" not in raw
    does = next((why for key, why in NOT_TRAINING if raw.get(key) not in (None, False)), None)
    if v1_export:
        does = "export config (v1, peft_config.export_dir: it merges adapters into the model)"
    if does is None or (raw.get("do_train") is True and not v1_export):
        return
    raise ConfigError(f"{what}: {path} is a LLaMA-Factory {does}: it trains nothing; finetune imports a training "
                      f"config (llamafactory-cli train, do_train: true; stages {', '.join(stages)}) or its output "
                      "folder")
