"""What the HF Trainer writes, read into a ``Baseline``: every source of a tool built on the Trainer (TRL, axolotl,
LLaMA-Factory, ms-swift) reads its files here, and this module knows none of those tools.

* an output or checkpoint folder: ``trainer_state.json`` (its ``log_history``; the newest ``checkpoint-*`` folder's
  when the top folder has none), else the TensorBoard event files of its ``TensorBoardCallback``, else the arguments
  alone (a Hub folder); the arguments from ``training_args.json`` or else ``training_args.bin``
  (:mod:`pickled_args`); the model card; ``config.json``, ``adapter_config.json`` and the saved weights;
* a model card ``README.md``: its "Training hyperparameters" list and "Training results" table (transformers writes
  both into every Trainer-pushed card); alone, or as the one record of a folder published without its arguments
  (``adapter_config.json`` and ``config.json`` read beside it);
* the arguments alone: ``TrainingArguments.to_json_string()`` or ``training_args.bin``.

Every value is kept with its source (``Baseline.args[name] = (value, source)``), so ``finetune import`` can say
where each setting came from. Bad input raises ConfigError with one line naming the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from finetune.card import HUB_ID
from finetune.errors import ConfigError
from finetune.reproduce.record import Baseline, Where, file_of
from finetune.reproduce.sources.pickled_args import read_arguments

CARD = "README.md (model card)"
ARGS_FILES = ("training_args.json", "training_args.bin")
STATE = "trainer_state.json"
HUB_FOLDER = "Hub folder"


def numbered(folder: Path, prefix: str) -> list[Path]:
    """The subfolders ``PREFIX<n>`` of ``folder`` (``checkpoint-``, torchtune's ``epoch_``), in the order of n."""
    found = [(int(p.name[len(prefix):]), p) for p in folder.glob(f"{prefix}*") if p.name[len(prefix):].isdigit()]
    return [p for _, p in sorted(found)]


def state_file(folder: Path) -> Path | None:
    """The folder's ``trainer_state.json``, else its newest checkpoint's; None when neither is there."""
    if (folder / STATE).is_file():
        return folder / STATE
    checkpoints = [p / STATE for p in numbered(folder, "checkpoint-") if (p / STATE).is_file()]
    return checkpoints[-1] if checkpoints else None


def event_files(folder: Path) -> list[Path]:
    """The TensorBoard event files under ``folder`` (the Trainer's ``TensorBoardCallback`` writes them in runs/)."""
    return sorted(folder.rglob("events.out.tfevents.*"))


def has_args_file(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ARGS_FILES)


def read_file(path: Path, what: str) -> Baseline:
    """A model card (``.md``), an arguments JSON or a ``training_args.bin`` on its own."""
    suffix = path.suffix.lower()
    if suffix == ".md":
        b = Baseline("model card", path, card_only=True)
        read_card(path, b, what, required=True)
        return b
    b = Baseline("args JSON" if suffix == ".json" else "training_args.bin", path)
    if suffix == ".json":
        b.args.update(sourced(json_object(path, what), path.name))
    else:
        read_bin(b, path, what)
    return b


def read_bin(b: Baseline, path: Path, what: str) -> None:
    """A ``training_args.bin``'s fields into ``b.args``, and its class (the trainer's config names its objective)."""
    name, values = read_arguments(path, what)
    b.args.update(sourced(values, path.name))
    b.args_class = (name, path.name)


def read_folder(folder: Path, what: str) -> Baseline:
    """An output, checkpoint or Hub folder as the Trainer wrote it (the module docstring says which files)."""
    state, events = state_file(folder), event_files(folder)
    b = Baseline("Trainer folder" if state else HUB_FOLDER, folder)
    if state is not None:
        read_trainer_state(state, b, what)
    elif events:
        read_events(events, b)
    elif not has_args_file(folder) and is_card_folder(folder):
        return read_card_folder(folder, what)
    elif not has_args_file(folder):
        raise ConfigError(f"{what}: {folder} holds no trainer_state.json (nor a checkpoint-*/ with one) and no "
                          "training_args.bin; give a Trainer/TRL output or checkpoint folder, a Hub folder with its "
                          "training_args.bin, or its model card README.md")
    where = state.parent if state is not None else folder
    read_args_file(b, [where, folder], what)
    if (folder / "README.md").is_file():
        card = Baseline("model card", folder / "README.md")
        read_card(folder / "README.md", card, what, required=False)
        b.args = {**card.args, **b.args}  # the arguments files, when present, say it first hand
        b.base_model, b.base_model_where = card.base_model, card.base_model_where
        b.tags = card.tags
        if not b.evals:
            b.evals = card.evals
    read_model_files(b, [folder, where], what)
    speed_batch(folder, b, what)
    return b


# where a run's files say the versions it trained with: pip's freeze (wandb saves it as files/requirements.txt)
FREEZE = re.compile(r"^(deepspeed|transformers)==(\d+(?:\.\d+)*)", re.M | re.I)
CARD_VERSION = re.compile(r"^- (DeepSpeed|Pytorch):? v?(\d+(?:\.\d+)*)", re.M)  # Transformers': read_front


def read_versions(b: Baseline) -> None:
    """``deepspeed_version``, ``transformers_version`` and ``pytorch_version`` (the card's: its kernels, which a
    replay needs the same) into ``b.args`` from what the run's folder holds, where
    nothing the source read said them: pip's freeze (``requirements.txt``, wandb's ``wandb/*/files/
    requirements.txt``), the card's Framework versions. Only in a run's folder: a config's own folder is its
    project's, whose pins need not be the run's."""
    folder = b.path
    if not folder.is_dir():
        return
    for path in [folder / "requirements.txt", *sorted(folder.glob("wandb/*/files/requirements.txt"))]:
        if path.is_file():
            for name, version in FREEZE.findall(path.read_text(encoding="utf-8", errors="replace")):
                b.args.setdefault(f"{name.lower()}_version", (version, Where(_shown(path, folder), name.lower())))
    card = folder / "README.md"
    if card.is_file():
        for name, version in CARD_VERSION.findall(card.read_text(encoding="utf-8", errors="replace")):
            b.args.setdefault(f"{name.lower()}_version", (version, f"{card.name}: Framework versions"))


def _shown(path: Path, folder: Path) -> str:
    return str(path.relative_to(folder)) if path.is_relative_to(folder) else path.name



def unsaid_accumulation(b: Baseline) -> None:
    """Where only trainer_state.json says the batch (its train_batch_size, the per-device one) and no file the
    source read says the accumulation, the total batch or the speed metrics that give it: the accumulation is
    assumed 1, said so (a tool's config that leaves it at its default 1 says it; a folder without arguments does
    not). Run after the source's reader, which may read its own config over the Trainer's files."""
    said = ("gradient_accumulation_steps", "total_train_batch_size", "speed_batch")
    where = b.args.get("per_device_train_batch_size", (None, ""))[1]
    if str(file_of(where)).endswith(STATE) and not any(k in b.args for k in said):
        b.assumed.setdefault("gradient_accumulation_steps", f"no arguments file, card list nor speed metrics of "
                             f"the {b.kind} says the accumulation: 1 taken")


def is_card_folder(folder: Path) -> bool:
    """A folder whose only record of the run is its model card (a Hub or adapters folder pushed without
    training_args.bin): its README.md lists the Trainer's hyperparameters."""
    card = folder / "README.md"
    return card.is_file() and bool(card_pairs(card.read_text(encoding="utf-8", errors="replace")))


def read_card_folder(folder: Path, what: str) -> Baseline:
    """A folder read as its model card, with the adapters' and model's configs beside it (their LoRA settings and
    base model, which the card does not list)."""
    b = Baseline("model card", folder / "README.md", card_only=True)
    read_card(folder / "README.md", b, what, required=True)
    read_model_files(b, [folder], what)
    return b


def read_args_file(b: Baseline, places: list, what: str) -> None:
    """The first arguments file in ``places``: JSON first, as it says the same without a pickle."""
    found = next((p / n for p in places for n in ARGS_FILES if (p / n).is_file()), None)
    if found is not None and found.suffix == ".json":
        b.args.update(sourced(json_object(found, what), found.name))
    elif found is not None:
        read_bin(b, found, what)


def read_model_files(b: Baseline, places: list, what: str) -> None:
    """``config.json``, ``adapter_config.json`` and the weights or adapters, from the first of ``places`` that
    holds each; the adapters' base model where nothing else named it."""
    for name, attr in (("config.json", "model_config"), ("adapter_config.json", "adapter_config")):
        found = next((p / name for p in places if (p / name).is_file()), None)
        if found is not None:
            setattr(b, attr, json_object(found, what))
    for where in places:
        found = [where / n for n in ("model.safetensors", "adapter_model.safetensors") if (where / n).is_file()]
        if found:
            b.weights = found[0]
            break
    loaded = (b.adapter_config or {}).get("base_model_name_or_path")
    if loaded and b.base_model and loaded != b.base_model:
        base_models_differ(b, loaded)
    elif loaded and not b.base_model:
        b.base_model, b.base_model_where = loaded, "adapter_config.json: base_model_name_or_path"


def base_models_differ(b: Baseline, loaded: str) -> None:
    """The card names one base model and ``adapter_config.json`` another (``loaded``: what peft loaded the
    adapters onto): that one where it is a hub id (a card's ``base_model`` is written by hand, or a family's
    name), else the card's — the other named in a line either way."""
    named = b.base_model
    if HUB_ID.match(loaded) and not Path(loaded).is_absolute():
        b.base_model, b.base_model_where = loaded, "adapter_config.json: base_model_name_or_path"
    if b.base_model == loaded:
        b.uncarried.append(("the card's base model", named, f"the recipe takes adapter_config.json's {loaded}, the "
                            "model the adapters were trained on: give --model if the baseline fine-tuned the other"))
    else:
        b.uncarried.append(("adapter_config.json's base model", loaded, f"a path of the machine it trained on; the "
                            f"recipe takes the card's {named}: give --model if the baseline fine-tuned another"))


def speed_batch(folder: Path, b, what: str) -> None:
    """The samples a step, from the Trainer's speed metrics (``all_results.json`` / ``train_results.json``:
    train_samples_per_second × train_runtime = the samples it trained, ÷ its optimizer steps), where no file says the
    accumulation: ``Baseline.args['speed_batch']``. Taken only when it is a whole number to the metrics' rounding (a
    short last step of an epoch makes it less)."""
    if "gradient_accumulation_steps" in b.args or b.get("total_train_batch_size"):
        return
    found = next((folder / n for n in ("all_results.json", "train_results.json") if (folder / n).is_file()), None)
    steps = b.get("schedule_steps") or b.max_steps
    if found is None or not steps:
        return
    metrics = json_object(found, what)
    rate, runtime = metrics.get("train_samples_per_second"), metrics.get("train_runtime")
    if not rate or not runtime:
        return
    batch = float(rate) * float(runtime) / int(steps)
    slack = 0.0005 * float(runtime) / int(steps) + 0.01 * batch  # the rate's 3 decimals; a short last step
    if round(batch) >= 1 and abs(batch - round(batch)) <= slack:
        b.args["speed_batch"] = (round(batch), Where(found.name, f"train_samples_per_second {rate} × train_runtime "
                                                                 f"{runtime} s ÷ {steps} steps"))


def read_trainer_state(path: Path, b: Baseline, what: str) -> None:
    state = json_object(path, what)
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


def json_object(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except ValueError as e:
        raise ConfigError(f"{what}: {path} is not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} holds a JSON {type(data).__name__}, not an object")
    return data


def sourced(values: dict, source: str) -> dict:
    return {k: (v, Where(source)) for k, v in values.items()}


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


def read_front(text: str, path: Path, b: Baseline) -> None:
    """What a card says before its hyperparameters: its base model (front matter) and transformers' version."""
    # front matter opens the card, or follows a line or two that its author put above it (a note, a badge)
    front = re.match(r"(?:[^\n]*\n){0,4}?---\n(.*?)\n---", text, re.S)
    if front:
        base = re.search(r"^base_model:\s*(?:\n\s*-\s*)?(\S+)", front.group(1), re.M)
        if base:
            b.base_model, b.base_model_where = base.group(1).strip("'\""), f"{path.name}: base_model"
        tags = re.search(r"^tags:\s*\n((?:\s*-\s*.+\n?)+)", front.group(1) + "\n", re.M)
        b.tags = tuple(t.strip().strip("'\"") for t in re.findall(r"-\s*(.+)", tags.group(1))) if tags else b.tags
        library = re.search(r"^library_name:\s*(\S+)", front.group(1), re.M)
        if library:  # peft: the card of a run that trained adapters (peft writes it)
            b.args["library_name"] = (library.group(1).strip("'\""), Where(path.name, "library_name"))
    version = re.search(r"^- Transformers:? v?(\d+\.\d+(?:\.\d+)?)", text, re.M)  # its Framework versions
    if version:
        b.args["transformers_version"] = (version.group(1), f"{path.name}: Framework versions")


def card_pairs(text: str) -> list:
    """The (name, value) lines of a card's "Training hyperparameters" list."""
    section = re.search(r"^#+\s*Training hyperparameters\s*$(.*?)(?=^#+\s)", text + "\n# end", re.M | re.S)
    return re.findall(r"^- ([a-z_]+): (.+)$", section.group(1), re.M) if section else []


def read_card(path: Path, b: Baseline, what: str, required: bool) -> None:
    """A Trainer's card into ``b``: its front matter, hyperparameters and results table; ``required``: ConfigError
    when it lists no hyperparameters."""
    text = path.read_text(encoding="utf-8", errors="replace")
    read_front(text, path, b)
    pairs = card_pairs(text)
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


# ---------------------------------------------------------------------------------------------------------------
# TensorBoard event files


TRAIN = {"train/loss": "loss", "train/learning_rate": "learning_rate", "train/grad_norm": "grad_norm",
         "train/num_tokens": "num_tokens", "train/num_input_tokens_seen": "num_input_tokens_seen"}


def read_events(files: list[Path], b: Baseline) -> None:
    """The Trainer's log in ``files`` into ``b``: ``logs`` (one entry per logged step), ``evals``, and the arguments
    (source: the event file) where no arguments file says them."""
    try:  # lazy: 0.1 s on every command (this module is on each one's path); only a TensorBoard log needs it
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError:
        raise ConfigError(f"{b.path}: reading its TensorBoard event files needs the tensorboard package "
                          "(pip install tensorboard)") from None
    steps, evals = {}, {}
    for path in files:
        acc = event_accumulator.EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
        try:
            acc.Reload()
        except Exception as e:  # a truncated or foreign file: said in one line
            raise ConfigError(f"{b.path}: {path.name} is not a readable TensorBoard event file "
                              f"({type(e).__name__})") from None
        tags = acc.Tags()
        for tag, name in TRAIN.items():
            for event in acc.Scalars(tag) if tag in tags.get("scalars", []) else []:
                steps.setdefault(event.step, {"step": event.step})[name] = float(event.value)
        for event in acc.Scalars("eval/loss") if "eval/loss" in tags.get("scalars", []) else []:
            evals[event.step] = float(event.value)
        if "args/text_summary" in tags.get("tensors", []):
            text = acc.Tensors("args/text_summary")[-1].tensor_proto.string_val[0].decode("utf-8", "replace")
            try:
                args = json.loads(text)
            except ValueError:
                args = {}
            where = Where(f"{path.parent.name}/{path.name[:24]}…", "args")
            b.args.update({k: (v, where) for k, v in args.items() if k not in b.args})
    b.logs = [steps[s] for s in sorted(steps) if "loss" in steps[s]]
    b.evals = sorted(evals.items())
    b.lr_rounding = 1.2e-7  # a scalar event holds an fp32: the lr rounded to 2^-23 of itself
    if b.logs and not b.max_steps and int(b.get("logging_steps") or 1) == 1:
        b.max_steps = b.logs[-1]["step"]
        b.args.setdefault("schedule_steps", (b.max_steps, f"{files[0].name[:24]}…: the last logged step"))
