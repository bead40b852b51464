"""Reading a baseline someone else trained: what its tool wrote, as TrainingArguments names with where each came from.

A baseline is one of:

* an HF Trainer / TRL output or checkpoint folder: ``trainer_state.json`` (its ``log_history``; the newest
  ``checkpoint-*`` folder's when the top folder has none), the arguments from ``training_args.json`` or else
  ``training_args.bin`` (:func:`read_training_args_bin`) or else the model card, ``config.json``,
  ``adapter_config.json`` and the saved weights;
* a model card ``README.md`` alone: its "Training hyperparameters" list and "Training results" table (transformers
  writes both into every Trainer-pushed card);
* an axolotl YAML (its keys mapped to the TrainingArguments names, :data:`AXOLOTL`);
* a Trainer / TRL arguments JSON (``TrainingArguments.to_json_string()``).

Every value is kept with its source (``Baseline.args[name] = (value, source)``), so ``finetune import`` can say
where each setting came from. Bad input raises ConfigError with one line naming the file.
"""

from __future__ import annotations

import io
import json
import pickle
import re
import zipfile
from pathlib import Path

from finetune.errors import ConfigError
from finetune.registry import built_in_hints
from finetune.reproduce import llamafactory
from finetune.reproduce.axolotl import card_config
from finetune.reproduce.record import TRL_ARGS, Baseline  # noqa: F401  (the record every reader fills)
from finetune.reproduce.sources import read_other_folder, read_yaml_source

CARD = "README.md (model card)"


def read_baseline(path, what: str = "baseline") -> Baseline:
    """The baseline at ``path`` (a folder, a model card, an axolotl YAML or an arguments JSON); ConfigError when
    it is none of them or is unreadable."""
    path = Path(path)
    if llamafactory.is_llamafactory(path):
        return llamafactory.read(path, what, Baseline, read_folder)
    if path.is_dir():
        return read_folder(path, what)
    if not path.is_file():
        raise ConfigError(f"{what}: {path} does not exist")
    if path.suffix.lower() == ".md":
        b = Baseline("model card", path)
        read_card(path, b, what, required=True)
        return b
    if path.suffix.lower() in (".yaml", ".yml"):
        return read_yaml_source(path, what)
    if path.suffix.lower() == ".json":
        b = Baseline("args JSON", path)
        b.args.update(_sourced(_json_object(path, what), path.name))
        return b
    if path.suffix.lower() == ".bin":
        b = Baseline("training_args.bin", path)
        b.args.update(_sourced(read_training_args_bin(path, what), path.name))
        return b
    raise ConfigError(f"{what}: {path} is not a Trainer/TRL folder, a model card (.md), an axolotl YAML or an "
                      "arguments JSON")


# ---------------------------------------------------------------------------------------------------------------
# a Trainer / TRL output or checkpoint folder


def read_folder(folder: Path, what: str) -> Baseline:
    b = Baseline("Trainer folder", folder)
    state_file = folder / "trainer_state.json"
    if not state_file.is_file():
        checkpoints = sorted(folder.glob("checkpoint-*/trainer_state.json"),
                             key=lambda p: int(p.parent.name.split("-")[-1]) if p.parent.name.split("-")[-1].isdigit()
                             else -1)
        state_file = checkpoints[-1] if checkpoints else None
    if state_file is None:
        if (folder / "history.jsonl").is_file():
            raise ConfigError(f"{what}: {folder} is a finetune run, not a Trainer/TRL folder")
        b, state_file = read_other_folder(folder, what), folder / "trainer_state.json"
        if b.kind != "Hub folder":  # another tool's output folder, read whole by its module
            return b
    else:
        read_trainer_state(state_file, b, what)
    places = [state_file.parent / n for n in ("training_args.json", "training_args.bin")] + \
        [folder / n for n in ("training_args.json", "training_args.bin")]
    args_file = next((p for p in places if p.is_file()), None)  # JSON first: it says the same without a pickle
    if args_file is not None and args_file.suffix == ".json":
        b.args.update(_sourced(_json_object(args_file, what), args_file.name))
    elif args_file is not None:
        b.args.update(_sourced(read_training_args_bin(args_file, what), args_file.name))
    if (folder / "README.md").is_file():
        card = Baseline("model card", folder / "README.md")
        read_card(folder / "README.md", card, what, required=False)
        b.args = {**card.args, **b.args}  # the arguments files, when present, say it first hand
        b.unknown, b.uncarried = card.unknown, card.uncarried
        b.base_model = card.base_model
        # what the card's tool config says beyond the arguments (axolotl's task, row order, warm-up rounding)
        b.task, b.own, b.carry_own = card.task, card.own, card.carry_own
        b.warmup_of, b.shuffled, b.data_file = card.warmup_of, card.shuffled, card.data_file
        if not b.evals:
            b.evals = card.evals
    for name, attr in (("config.json", "model_config"), ("adapter_config.json", "adapter_config")):
        for where in (folder, state_file.parent):
            if (where / name).is_file():
                setattr(b, attr, _json_object(where / name, what))
                break
    for where in (folder, state_file.parent):
        found = [where / n for n in ("model.safetensors", "adapter_model.safetensors") if (where / n).is_file()]
        if found:
            b.weights = found[0]
            break
    if b.adapter_config and not b.base_model:
        b.base_model = b.adapter_config.get("base_model_name_or_path")
    return b


def read_trainer_state(path: Path, b: Baseline, what: str) -> None:
    state = _json_object(path, what)
    history = state.get("log_history")
    if not isinstance(history, list):
        raise ConfigError(f"{what}: {path} has no log_history (a Trainer writes one into every trainer_state.json)")
    b.logs = [e for e in history if isinstance(e, dict) and "loss" in e and "step" in e]
    b.evals = [(e["step"], e["eval_loss"]) for e in history if isinstance(e, dict) and "eval_loss" in e]
    b.max_steps = state.get("global_step") or None
    src = path.name if path.parent == b.path else f"{path.parent.name}/{path.name}"
    # max_steps here is the length the scheduler was sized with (the arguments' max_steps is -1 for epochs)
    for key, name in (("logging_steps", "logging_steps"), ("train_batch_size", "per_device_train_batch_size"),
                      ("num_train_epochs", "num_train_epochs"), ("max_steps", "schedule_steps")):
        if state.get(key) is not None:
            b.args[name] = (state[key], src)


def _json_object(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except ValueError as e:
        raise ConfigError(f"{what}: {path} is not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} holds a JSON {type(data).__name__}, not an object")
    return data


def _sourced(values: dict, source: str) -> dict:
    return {k: (v, source) for k, v in values.items()}


# ---------------------------------------------------------------------------------------------------------------
# training_args.bin: a pickle, read by a restricted unpickler


# The classes a TrainingArguments pickle holds: the arguments class itself (TRL's configs derive from it), its enums
# and the records it keeps (accelerate's state, its accelerator config, a torch.device). Each becomes an inert stand-in:
# nothing from transformers, TRL or accelerate is imported or called while reading.
ARGS_MODULES = ("transformers.", "trl.", "llamafactory.")
ARGS_CLASSES = {"TrainingArguments", "Seq2SeqTrainingArguments"}
ENUMS = {"IntervalStrategy", "SaveStrategy", "HubStrategy", "SchedulerType", "OptimizerNames", "FSDPOption",
         "DebugOption", "ParallelMode", "DistributedType", "EvaluationStrategy", "ExplicitEnum"}
RECORDS = {("transformers.trainer_pt_utils", "AcceleratorConfig"), ("accelerate.state", "PartialState"),
           ("torch", "device")}


class _Record:
    """A stand-in object: pickle's BUILD hands it the state it had; nothing else runs."""

    def __setstate__(self, state):
        self.state = state[1] if isinstance(state, tuple) and len(state) == 2 and state[0] is None else state


def _enum_value(value, *rest):
    return value


class _ArgsUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith(ARGS_MODULES) and (name in ARGS_CLASSES or module.startswith("trl.") and
                                                name.endswith("Config")):
            return type(name, (_Record,), {})
        if name in ENUMS and module.startswith(ARGS_MODULES + ("accelerate.",)):
            return _enum_value
        if (module, name) in RECORDS:
            return str if name == "device" else type(name, (_Record,), {})
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(f"a tensor storage ({pid!r})")


def read_training_args_bin(path: Path, what: str = "baseline") -> dict:
    """The fields of a ``training_args.bin`` (``torch.save`` of a TrainingArguments or a TRL config), read with a
    restricted unpickler that accepts only those classes, their enums and the records they hold, each as an inert
    stand-in. Any other class (or a tensor) refuses the whole file with one line: nothing from it runs.

    Raises ConfigError for a foreign class or a file that is not a ``torch.save`` zip of one object."""
    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                raise ConfigError(f"{what}: {path} is not a torch.save file of training arguments")
            data = z.read(names[0])
    except zipfile.BadZipFile:
        raise ConfigError(f"{what}: {path} is not a torch.save zip file (training arguments are saved as one since "
                          "torch 1.6); give training_args.json or the model card") from None
    try:
        obj = _ArgsUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise ConfigError(f"{what}: {path} holds {e}, which is not a TrainingArguments class or one of its enums; "
                          "refused, nothing from it was run") from None
    except Exception as e:  # a malformed pickle: said in one line, never run
        raise ConfigError(f"{what}: {path} is not a readable pickle of training arguments ({type(e).__name__})") \
            from None
    if not isinstance(obj, _Record) or not isinstance(getattr(obj, "state", None), dict):
        raise ConfigError(f"{what}: {path} does not hold a TrainingArguments object")
    return {k: v for k, v in obj.state.items() if not isinstance(v, _Record)}


# ---------------------------------------------------------------------------------------------------------------
# a model card


CARD_KEYS = {  # the card's hyperparameter names → TrainingArguments'
    "learning_rate": "learning_rate", "train_batch_size": "per_device_train_batch_size", "seed": "seed",
    "gradient_accumulation_steps": "gradient_accumulation_steps", "total_train_batch_size": "total_train_batch_size",
    "num_devices": "num_devices", "lr_scheduler_type": "lr_scheduler_type", "num_epochs": "num_train_epochs",
    "training_steps": "max_steps", "lr_scheduler_warmup_steps": "warmup_steps",
    "lr_scheduler_warmup_ratio": "warmup_ratio", "label_smoothing_factor": "label_smoothing_factor",
    "mixed_precision_training": "mixed_precision_training", "eval_batch_size": "per_device_eval_batch_size",
    "distributed_type": "distributed_type", "total_eval_batch_size": "total_eval_batch_size",
}


def read_card(path: Path, b: Baseline, what: str, required: bool) -> None:
    text = path.read_text(encoding="utf-8", errors="replace")
    front = re.match(r"---\n(.*?)\n---", text, re.S)
    if front:
        base = re.search(r"^base_model:\s*(?:\n\s*-\s*)?(\S+)", front.group(1), re.M)
        b.base_model = base.group(1).strip("'\"") if base else None
    version = re.search(r"^- Transformers:? v?(\d+\.\d+(?:\.\d+)?)", text, re.M)  # its Framework versions
    if version:
        b.args["transformers_version"] = (version.group(1), f"{path.name}: Framework versions")
    section = re.search(r"^#+\s*Training hyperparameters\s*$(.*?)(?=^#+\s)", text + "\n# end", re.M | re.S)
    pairs = re.findall(r"^- ([a-z_]+): (.+)$", section.group(1), re.M) if section else []
    if card_config(text, path, b) and not pairs:
        return  # axolotl's card: its YAML block says the run (and no Trainer results table follows)
    if required and not pairs:
        raise ConfigError(f"{what}: {path} has no 'Training hyperparameters' list (transformers writes one into the "
                          "card of every Trainer run); give the Trainer's output folder or its arguments JSON")
    for key, raw in pairs:
        if key == "optimizer":
            b.args.update(_card_optimizer(raw))
        elif key in CARD_KEYS:
            b.args[CARD_KEYS[key]] = (_number(raw), CARD)
        else:
            b.args[key] = (_number(raw), CARD)
    if b.get("mixed_precision_training"):
        b.args["fp16"] = (True, CARD)  # the card says "Native AMP" for fp16 only
    rows = _results_table(text)
    b.evals = [(int(r["Step"]), float(r["Validation Loss"])) for r in rows
               if _is_number(r.get("Step")) and _is_number(r.get("Validation Loss"))]
    b.card_losses = [(int(r["Step"]), float(r["Training Loss"])) for r in rows
                     if _is_number(r.get("Step")) and _is_number(r.get("Training Loss"))]
    # the last row at the last epoch is the last step: the length the schedule was sized with
    if rows and _is_number(rows[-1].get("Epoch")) and _is_number(rows[-1].get("Step")) and \
            float(rows[-1]["Epoch"]) == float(b.get("num_train_epochs") or -1):
        b.args["schedule_steps"] = (int(rows[-1]["Step"]), f"{CARD}: the results table's last row")


def _card_optimizer(raw: str) -> dict:
    """``Use OptimizerNames.ADAMW_TORCH with betas=(0.9,0.999) and epsilon=1e-08 and …`` → optim, betas, eps."""
    out = {}
    name = re.match(r"Use (?:OptimizerNames\.)?(\w+)", raw)
    if name:
        out["optim"] = (name.group(1).lower(), CARD)
    betas = re.search(r"betas=\(([\d.e-]+),\s*([\d.e-]+)\)", raw)
    if betas:
        out["adam_beta1"], out["adam_beta2"] = (float(betas.group(1)), CARD), (float(betas.group(2)), CARD)
    eps = re.search(r"epsilon=([\d.e+-]+)", raw)
    if eps:
        out["adam_epsilon"] = (float(eps.group(1)), CARD)
    return out


def _results_table(text: str) -> list:
    section = re.search(r"^#+\s*Training results\s*$(.*?)(?=^#+\s|\Z)", text, re.M | re.S)
    if not section:
        return []
    lines = [x.strip() for x in section.group(1).splitlines() if x.strip().startswith("|")]
    if len(lines) < 3:
        return []
    cells = lambda line: [c.strip() for c in line.strip("|").split("|")]
    head = cells(lines[0])
    return [dict(zip(head, cells(line))) for line in lines[2:]]


def _is_number(s) -> bool:
    try:
        float(s)
        return True
    except (TypeError, ValueError):
        return False


def _number(raw: str):
    raw = raw.strip()
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def trl_task(b) -> str | None:
    """The built-in task a TRL folder trained: the one whose marks (its trainer's own arguments) the folder holds
    all of, the one with the most marks first — a GRPOConfig holds DPOConfig's beta and loss_type too."""
    if not b.trl:
        return None
    held = [(len(h.trl_marks), name) for name, h in built_in_hints().items()
            if h.base_recipe and h.trl_marks is not None and all(b.get(m) is not None for m in h.trl_marks)]
    return max(held)[1] if held else None
