"""Every field of the files others published (tests/assets/corpus/, PROVENANCE.md says where each comes from), held
against this test's own reading of each raw file: the learning rate, the effective batch (micro-batch ×
accumulation, × the processes where the file says them), epochs or max steps, the scheduler, the warm-up, LoRA's r,
alpha and modules (or every weight trained) and the model. Each file that imports is imported in this process; each
field is either in the recipe with the file's meaning, or named by a ``not carried:`` / ``assumed:`` / ``missing:``
line of what import printed. The readers below are a few lines of yaml/json each, with each tool's default written
where a file omits a key (and where the tool sets it); they share nothing with the importer. Files the importer
refuses are tests/test_corpus_objective.py's and tests/test_corpus_llamafactory.py's.

    pytest tests/test_corpus_fields.py -q -s   # prints the count per tool (docs/reproduce/sources.md, The corpus)
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from finetune.config import PeftConfig, TrainingConfig
from tests.helpers import cli_in_process as cli
from tests.helpers import edited_yaml

CORPUS = Path(__file__).parent / "assets" / "corpus"
FIELDS = ("lr", "batch", "length", "scheduler", "warmup", "lora", "model")
UNSAID = "unsaid"  # the file does not say it and its tool has no default: import must say so in a line
# the words a line of import's names each field by
WORDS = {"lr": ("learning_rate", "learning rate"), "batch": ("batch", "accumulation"),
         "length": ("epoch", "max_steps", "steps"), "scheduler": ("scheduler",), "warmup": ("warmup", "warm-up"),
         "lora": ("lora", "peft", "adapter"), "model": ("model",)}


def units() -> list:
    """(tool, path) of every config file and run folder of the corpus (a folder's own files are its parts)."""
    found = []
    for tool in ("torchtune", "axolotl", "alignment-handbook", "open-r1", "trl"):
        found += [(tool, p) for p in sorted((CORPUS / tool).iterdir()) if p.is_dir() or p.suffix in (".yaml", ".yml")]
    for version in ("main", "v0.9.3", "v1"):
        found += [(f"llamafactory {version}", p) for p in sorted((CORPUS / "llamafactory" / version).glob("*.yaml"))]
    found += [("llamafactory runs", p) for p in sorted((CORPUS / "llamafactory" / "runs").iterdir())]
    return found


# ---------------------------------------------------------------------------------------------------------------
# the test's own reading of each file: field → value (what the tool trains with)


def want(tool: str, path: Path) -> dict:
    if tool == "llamafactory runs":
        return lf_run(path)
    if path.is_dir():
        return trainer_folder(path)
    raw = yaml.safe_load(path.read_text())
    reader = {"torchtune": torchtune, "axolotl": axolotl}.get(tool) or (lf_config if tool.startswith("llama")
                                                                        else trl_yaml)
    return reader(raw)


def _ratio(ratio, steps, rounding) -> tuple:
    """A warm-up as a ratio of the run's steps (known only where the file says max_steps), rounded as the tool
    rounds it."""
    return ("ratio", float(ratio), steps if steps and steps > 0 else None, rounding)


CEIL = math.ceil  # transformers' TrainingArguments.get_warmup_steps: ceil(ratio × steps)


def axolotl_round(x: float) -> int:
    """axolotl 0.21's core/builders/base.py _configure_warmup_and_logging: int(ratio × steps), then 1 made 2."""
    return 2 if int(x) == 1 else int(x)


def trl_yaml(raw: dict) -> dict:
    """A TRL recipe YAML (TrlParser onto TrainingArguments / SFTConfig / DPOConfig / GRPOConfig and ModelConfig)."""
    lora = None
    if raw.get("use_peft"):  # trl ModelConfig: lora_r 16, lora_alpha 32, lora_target_modules None (peft's default)
        targets = raw.get("lora_target_modules")
        lora = (raw.get("lora_r", 16), raw.get("lora_alpha", 32), sorted(targets) if targets else None)
    steps = raw.get("max_steps", -1)  # TrainingArguments: max_steps -1, num_train_epochs 3.0
    return {"lr": raw.get("learning_rate", UNSAID),  # each TRL config has its own default: the file's, else said
            # TrainingArguments: per_device_train_batch_size 8, gradient_accumulation_steps 1
            "batch": raw.get("per_device_train_batch_size", 8) * raw.get("gradient_accumulation_steps", 1),
            "length": ("max_steps", steps) if steps > 0 else ("epochs", float(raw.get("num_train_epochs", 3.0))),
            "scheduler": raw.get("lr_scheduler_type", "linear"),  # TrainingArguments' default
            # warmup_steps (transformers 5: below 1 a ratio), else warmup_ratio (transformers 4), default 0
            "warmup": _trainer_warmup(raw.get("warmup_steps", 0), raw.get("warmup_ratio"), steps),
            "lora": lora, "model": raw.get("model_name_or_path", UNSAID)}


def _trainer_warmup(steps, ratio, total) -> tuple:
    if 0 < float(steps) < 1:
        return _ratio(steps, total, CEIL)
    if not steps and ratio:
        return _ratio(ratio, total, CEIL)
    return ("steps", int(steps))


def trainer_folder(path: Path) -> dict:
    """A Trainer output folder: training_args.json (TrainingArguments.to_json_string) and trainer_state.json."""
    args_file = path / "training_args.json"
    if not args_file.exists():
        return {}  # only a log: nothing said of the settings
    args = json.loads(args_file.read_text())
    steps = args["max_steps"]
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    return {"lr": args["learning_rate"],
            "batch": args["per_device_train_batch_size"] * args["gradient_accumulation_steps"],
            "length": ("max_steps", steps) if steps > 0 else ("epochs", float(args["num_train_epochs"])),
            "scheduler": args["lr_scheduler_type"],
            "warmup": _trainer_warmup(args.get("warmup_steps", 0), args.get("warmup_ratio"), steps),
            "lora": UNSAID,  # neither file says whether adapters were trained
            "model": config.get("_name_or_path") or UNSAID}


def _interpolated(raw: dict, value):
    """OmegaConf's ``${key}`` in a torchtune config: the top-level key's value."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)\}", lambda m: str(raw.get(m.group(1))), value)
    return value


# torchtune's projection names → Hugging Face's; its MLP's (apply_lora_to_mlp) and output's (apply_lora_to_output)
TT_MODULES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}


def torchtune(raw: dict) -> dict:
    """A torchtune recipe config (recipes/*.py read cfg.batch_size, cfg.gradient_accumulation_steps, cfg.epochs,
    cfg.max_steps_per_epoch; no lr_scheduler: the optimizer's lr throughout)."""
    model = raw.get("model") or {}
    builder = str(model.get("_component_", "")).rsplit(".", 1)[-1]
    lora = None
    if builder.startswith(("lora_", "qlora_")):  # lora_* builders: lora_rank 8, lora_alpha 16 (_model_builders.py)
        targets = {TT_MODULES.get(m, m) for m in model.get("lora_attn_modules") or []}
        targets |= {"gate_proj", "up_proj", "down_proj"} if model.get("apply_lora_to_mlp") else set()
        targets |= {"lm_head"} if model.get("apply_lora_to_output") else set()
        lora = (model.get("lora_rank", 8), model.get("lora_alpha", 16), sorted(targets))
    sched = raw.get("lr_scheduler")
    kind = str((sched or {}).get("_component_", "")).rsplit(".", 1)[-1]
    epochs, per_epoch = raw.get("epochs", 1), raw.get("max_steps_per_epoch")
    return {"lr": raw["optimizer"].get("lr", UNSAID),
            "batch": raw.get("batch_size", UNSAID) if raw.get("batch_size") is None else
            raw["batch_size"] * raw.get("gradient_accumulation_steps", 1),
            # max_steps_per_epoch caps each epoch: the run's steps only when it has one epoch
            "length": ("max_steps", per_epoch) if per_epoch and epochs == 1 else
            ("epochs", float(epochs)) if not per_epoch else UNSAID,
            "scheduler": "constant" if not sched else
            {"get_cosine_schedule_with_warmup": "cosine"}.get(kind, kind),
            "warmup": ("steps", int(sched.get("num_warmup_steps", 0)) if sched else 0),
            "lora": lora, "model": _interpolated(raw, (raw.get("checkpointer") or {}).get("checkpoint_dir"))}


def axolotl(raw: dict) -> dict:
    """An axolotl config (axolotl 0.21 utils/schemas/training.py: micro_batch_size 1, gradient_accumulation_steps 1,
    num_epochs 1.0, lr_scheduler cosine; utils/config normalize_config: accumulation = batch_size // micro_batch_size
    where only batch_size is given)."""
    micro = raw.get("micro_batch_size") or 1
    accumulation = raw.get("gradient_accumulation_steps") or (
        raw["batch_size"] // micro if raw.get("batch_size") else 1)
    steps = raw.get("max_steps")
    lora = None
    if raw.get("adapter") in ("lora", "qlora"):  # loaders/adapter.py: lora_target_linear adds every linear layer
        named = raw.get("lora_target_modules")
        targets = ["all-linear"] if raw.get("lora_target_linear") else \
            sorted(named) if isinstance(named, list) else [named] if named else None
        lora = (raw.get("lora_r"), raw.get("lora_alpha"), targets)
    # core/builders/base.py: warmup_steps as given, else int(warmup_ratio × steps), else min(int(0.03 × steps), 100)
    if raw.get("warmup_steps") is not None and float(raw["warmup_steps"]) >= 1:
        warmup = ("steps", axolotl_round(raw["warmup_steps"]))
    else:
        warmup = _ratio(raw.get("warmup_steps") or raw.get("warmup_ratio") or 0.03, steps, axolotl_round)
        if raw.get("warmup_steps") is None and raw.get("warmup_ratio") is None:
            warmup = warmup[:3] + (lambda x: axolotl_round(min(x, 100)),)
    return {"lr": float(raw["learning_rate"]), "batch": micro * accumulation,
            "length": ("max_steps", steps) if steps else ("epochs", float(raw.get("num_epochs", 1.0))),
            "scheduler": raw.get("lr_scheduler", "cosine"), "warmup": warmup, "lora": lora,
            "model": raw["base_model"]}


def lf_config(raw: dict) -> dict:
    """A LLaMA-Factory YAML: 0.x (TrainingArguments' defaults; finetuning_type lora, lora_rank 8, lora_alpha 2 × rank,
    lora_target all: hparams/finetuning_args.py) or v1 (no lr_scheduler_config: a constant rate; v1's
    TrainingArguments: learning_rate 1e-4, micro_batch_size 1, num_train_epochs 3)."""
    if "model" in raw:
        peft = raw.get("peft_config") or {}
        steps = raw.get("max_steps")
        targets = peft.get("target_modules", "all")
        return {"lr": raw.get("learning_rate", 1e-4),
                "batch": raw.get("global_batch_size") or raw.get("micro_batch_size", 1),
                "length": ("max_steps", steps) if steps else ("epochs", float(raw.get("num_train_epochs", 3))),
                "scheduler": "constant", "warmup": ("steps", 0), "model": raw["model"],
                "lora": (peft.get("r"), peft.get("lora_alpha"), _lf_targets(targets))
                if peft.get("name") == "lora" else None if peft.get("name") is None else UNSAID}
    steps = raw.get("max_steps", -1)
    lora = None
    if raw.get("finetuning_type", "lora") == "lora":
        rank = raw.get("lora_rank", 8)
        lora = (rank, raw.get("lora_alpha", 2 * rank), _lf_targets(raw.get("lora_target", "all")))
    elif raw.get("finetuning_type") != "full":
        lora = UNSAID  # freeze: some layers trained, neither LoRA nor every weight
    return {"lr": raw.get("learning_rate", 5e-5),
            "batch": raw.get("per_device_train_batch_size", 8) * raw.get("gradient_accumulation_steps", 1),
            "length": ("max_steps", steps) if steps > 0 else ("epochs", float(raw.get("num_train_epochs", 3.0))),
            "scheduler": raw.get("lr_scheduler_type", "linear"),
            "warmup": _trainer_warmup(raw.get("warmup_steps", 0), raw.get("warmup_ratio"), steps),
            "lora": lora, "model": raw["model_name_or_path"]}


def _lf_targets(targets) -> list:
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
    return ["all-linear"] if names == ["all"] else sorted(names)


def lf_run(path: Path) -> dict:
    """A LLaMA-Factory output folder without its YAML: the card's hyperparameters list, adapter_config.json and
    trainer_state.json say what they say; the rest is unsaid."""
    card = {}
    if (path / "README.md").exists():
        card = dict(line[2:].split(": ", 1) for line in (path / "README.md").read_text().splitlines()
                    if line.startswith("- ") and ": " in line)
    adapter = json.loads((path / "adapter_config.json").read_text()) if (path / "adapter_config.json").exists() else {}
    state = json.loads((path / "trainer_state.json").read_text()) if (path / "trainer_state.json").exists() else {}
    epochs = card.get("num_epochs") or state.get("num_train_epochs") or _log_epochs(path)
    batch = int(card["total_train_batch_size"]) if "total_train_batch_size" in card else _speed_batch(path)
    warmup = _ratio(card["lr_scheduler_warmup_ratio"], state.get("max_steps"), CEIL) \
        if "lr_scheduler_warmup_ratio" in card else UNSAID
    if (path / "training_args.bin").exists():  # the Trainer's own arguments, unpickled by the installed class
        args = torch.load(path / "training_args.bin", weights_only=False)
        warmup = _trainer_warmup(args.warmup_steps, getattr(args, "warmup_ratio", None), state.get("max_steps"))
    return {"lr": float(card["learning_rate"]) if "learning_rate" in card else UNSAID, "batch": batch,
            "length": ("epochs", float(epochs)) if epochs else UNSAID,
            "scheduler": card.get("lr_scheduler_type", UNSAID), "warmup": warmup,
            "lora": (adapter["r"], int(adapter["lora_alpha"]), sorted(adapter["target_modules"])) if adapter
            else UNSAID,
            # the card's base_model or the adapters' base: the card's front matter names the hub id, adapter_config the
            # path peft loaded it from (a local folder, a tokenizer stage); either is the file's
            "model": tuple(m for m in (_front(path).get("base_model"), adapter.get("base_model_name_or_path")) if m)
            or UNSAID}


def _log_epochs(path: Path):
    """The epoch at trainer_log.jsonl's last line where that line is its last planned step and a whole epoch (a run
    cut mid-epoch by max_steps says no epoch count)."""
    log = path / "trainer_log.jsonl"
    last = json.loads(log.read_text().splitlines()[-1]) if log.exists() else {}
    whole = last.get("current_steps") == last.get("total_steps") and float(last.get("epoch") or 0.5).is_integer()
    return last["epoch"] if whole else None


def _front(path: Path) -> dict:
    text = (path / "README.md").read_text() if (path / "README.md").exists() else ""
    return (yaml.safe_load(text.split("---")[1]) or {}) if text.startswith("---") else {}


def _speed_batch(path: Path):
    """The samples a step, where no file says the batch: the Trainer's speed metrics over the steps its log says."""
    metrics = path / "all_results.json"
    if not metrics.exists():
        return UNSAID
    said = json.loads(metrics.read_text())
    steps = json.loads((path / "trainer_log.jsonl").read_text().splitlines()[-1])["total_steps"]
    return round(said["train_samples_per_second"] * said["train_runtime"] / steps)


# ---------------------------------------------------------------------------------------------------------------
# the recipe's values, with finetune's own defaults where the recipe leaves a field out, and the checker


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def recipe_value(recipe: dict, section: str, key: str):
    cls = {"training": TrainingConfig, "peft": PeftConfig}.get(section)
    part = recipe.get(section) or {}
    return part[key] if key in part else _defaults(cls).get(key) if cls else None


def named(said: str, field: str) -> bool:
    """Whether a line of import's says the field is not carried, assumed or missing."""
    lines = [x.lower() for x in said.splitlines() if x.startswith(("not carried:", "assumed:", "missing:"))]
    return any(w in x for x in lines for w in WORDS[field])


def problems(expected: dict, recipe: dict, said: str) -> list:
    """The fields the recipe carries otherwise than the file means them and no line names: [] when each is held."""
    wrong = []
    for field, value in expected.items():
        ok = held(field, value, recipe)
        if ok is False or (ok is None and not named(said, field)):
            got = {k: recipe_value(recipe, "training", k) for k in ("learning_rate", "effective_batch_size",
                                                                    "epochs", "max_steps", "lr_scheduler",
                                                                    "warmup_steps")}
            shown = got if field != "lora" else recipe.get("peft")
            wrong.append(f"{field}: the file says {value!r}; the recipe {shown}"
                         f"{' / ' + str((recipe.get('model') or {}).get('name_or_path')) if field == 'model' else ''}")
    return wrong


def held(field: str, value, recipe: dict):
    """True: carried with the file's meaning; False: carried otherwise; None: not in the recipe (a line must name
    it). Compared by meaning: epochs as whole epochs (a fraction said in a line), a warm-up ratio as the steps the
    tool rounds it to over the steps the file says, LoRA as (r, alpha, the set of modules; peft's all-linear for
    every linear layer), no LoRA as peft.enabled false."""
    t = lambda key: recipe_value(recipe, "training", key)  # noqa: E731
    if value == UNSAID:
        return None
    if field == "lr":
        return math.isclose(t("learning_rate"), float(value), rel_tol=1e-9)
    if field == "batch":
        return None if t("effective_batch_size") is None else t("effective_batch_size") == value
    if field == "length":
        kind, n = value
        if kind == "max_steps":
            return t("max_steps") == n
        return t("max_steps") is None and t("epochs") == math.ceil(n) and (n == int(n) or None)
    if field == "scheduler":
        return t("lr_scheduler") == value or None
    if field == "warmup":
        if value[0] == "steps":
            return t("warmup_steps") == value[1]
        ratio, total, rounding = value[1:]
        if total is None:  # no step count in the file: the recipe cannot have the steps
            return None if "warmup_steps" not in (recipe.get("training") or {}) else False
        return t("warmup_steps") == rounding(ratio * total)
    if field == "lora":
        p = lambda key: recipe_value(recipe, "peft", key)  # noqa: E731
        if value is None:
            return p("enabled") is False
        r, alpha, targets = value
        return bool(p("enabled")) and (p("r"), p("alpha")) == (r, alpha) and (
            targets is None or sorted(p("target_modules") or []) == sorted(targets))
    if field == "model":
        return (recipe.get("model") or {}).get("name_or_path") in (value if isinstance(value, tuple) else (value,)) or (
            None if "name_or_path" not in (recipe.get("model") or {}) else False)
    raise AssertionError(field)


def imported(capsys, path: Path, out: Path) -> tuple:
    code, said = cli(capsys, "import", path, "-o", out, "--force")
    return code, (yaml.safe_load(out.read_text()) if out.exists() else None), said


# ---------------------------------------------------------------------------------------------------------------

TALLY: dict = {}


@pytest.mark.parametrize("tool,path", units(), ids=lambda x: x if isinstance(x, str) else x.name)
def test_every_field_is_carried_or_named(tool, path, tmp_path, capsys):
    code, recipe, said = imported(capsys, path, tmp_path / "r.yaml")
    assert "Traceback" not in said, said[-3000:]
    tally = TALLY.setdefault(tool, {"files": 0, "imported": 0, "refused": set(), "held": 0, "fields": 0})
    tally["files"] += 1
    if code != 0:  # refused: one line, nothing written (the objective tests say which and why)
        errors = [x for x in said.splitlines() if x.startswith("error: ")]
        assert code == 2 and len(errors) == 1 and recipe is None, said[-1500:]
        tally["refused"].add(refusal_kind(errors[0]))
        return
    expected = want(tool, path)
    wrong = problems(expected, recipe, said)
    tally["imported"] += 1
    tally["fields"] += len(expected)
    tally["held"] += len(expected) - len(wrong)
    assert not wrong, "\n".join(wrong) + "\n" + said[-3000:]


def refusal_kind(line: str) -> str:
    for word in ("trains nothing", "finetune trains", "not supported"):
        if word in line:
            return {"finetune trains": "objective", "not supported": "stage"}.get(word, word)
    return line[:60]


def test_zz_tally():
    """The counts per tool (run last in the file; docs/reproduce/sources.md's table is this)."""
    for tool, t in TALLY.items():
        print(f"| {tool} | {t['files']} | {t['imported']} | {t['files'] - t['imported']} "
              f"({', '.join(sorted(t['refused']))}) | 0 | {t['held']}/{t['fields']} |")


# ---------------------------------------------------------------------------------------------------------------
# negative controls: the checker finds a field carried wrong, and each reader's fix follows the file's key


def test_the_checker_finds_a_field_carried_wrong_or_dropped(tmp_path, capsys):
    path = CORPUS / "axolotl" / "arcee__afm-4.5b-qlora.yaml"
    code, recipe, said = imported(capsys, path, tmp_path / "r.yaml")
    expected = want("axolotl", path)
    assert code == 0 and problems(expected, recipe, said) == []
    for section, key, value in (("training", "learning_rate", 1e-3), ("training", "effective_batch_size", 16),
                                ("training", "epochs", 2), ("training", "lr_scheduler", "linear"),
                                ("peft", "r", 8), ("peft", "target_modules", ["q_proj"]),
                                ("model", "name_or_path", "x")):
        wrong = json.loads(json.dumps(recipe))
        wrong.setdefault(section, {})[key] = value
        assert problems(expected, wrong, said), (section, key)
    # a warm-up ratio with no step count, its line taken out: dropped without a line
    assert problems(expected, recipe, "\n".join(x for x in said.splitlines() if "warmup" not in x))


def _recipe(capsys, path: Path, tmp_path: Path) -> dict:
    code, recipe, said = imported(capsys, path, tmp_path / "control.yaml")
    assert code == 0, said[-1500:]
    return recipe


def test_a_torchtune_interpolation_is_the_value_it_names(tmp_path, capsys):
    source = CORPUS / "torchtune" / "dev__3B_full_grpo.yaml"
    edited = edited_yaml(source, tmp_path, lambda raw: raw.update(base_model_path="/models/other"))
    assert _recipe(capsys, source, tmp_path)["model"]["name_or_path"] == yaml.safe_load(
        source.read_text())["base_model_path"]
    assert _recipe(capsys, edited, tmp_path)["model"]["name_or_path"] == "/models/other"


def test_a_torchtune_lora_builder_without_its_rank_is_lora_at_its_defaults(tmp_path, capsys):
    source = CORPUS / "torchtune" / "llama3_2__1B_lora_single_device.yaml"
    bare = edited_yaml(source, tmp_path, lambda raw: [raw["model"].pop(k) for k in ("lora_rank", "lora_alpha")])
    peft = _recipe(capsys, bare, tmp_path)["peft"]
    assert peft["enabled"] and (peft["r"], peft["alpha"]) == (8, 16)  # torchtune's lora_* builders' defaults
    four = edited_yaml(source, tmp_path, lambda raw: raw["model"].update(lora_rank=4, lora_alpha=4))
    assert (_recipe(capsys, four, tmp_path)["peft"]["r"]) == 4


def test_a_trl_yaml_that_omits_the_batch_trains_trainingarguments_defaults(tmp_path, capsys):
    source = CORPUS / "trl" / "cli_configs__example_config.yaml"
    training = _recipe(capsys, source, tmp_path)["training"]
    assert (training["effective_batch_size"], training["epochs"]) == (8, 3)  # TrainingArguments' 8 × 1, 3 epochs
    edited = edited_yaml(source, tmp_path, lambda raw: raw.update(per_device_train_batch_size=2, num_train_epochs=1,
                                                              gradient_accumulation_steps=3))
    training = _recipe(capsys, edited, tmp_path)["training"]
    assert (training["effective_batch_size"], training["epochs"]) == (6, 1)
    no_lr = edited_yaml(source, tmp_path, lambda raw: raw.pop("learning_rate"))
    assert _recipe(capsys, no_lr, tmp_path)["training"]["learning_rate"] == 2e-5  # SFTConfig's (TRL 1.16)


def test_an_axolotl_warmup_below_one_is_a_ratio(tmp_path, capsys):
    """warmup_steps 0.1 (expert_parallel's) is a ratio of its max_steps, as transformers 5 reads it."""
    source = CORPUS / "axolotl" / "expert_parallel__qwen3_30ba3b_ep_fsdp_fft_4gpu.yaml"
    raw = yaml.safe_load(source.read_text())
    assert _recipe(capsys, source, tmp_path)["training"]["warmup_steps"] == int(raw["warmup_steps"] * raw["max_steps"])
    edited = edited_yaml(source, tmp_path, lambda r: r.update(warmup_steps=0.2))
    assert _recipe(capsys, edited, tmp_path)["training"]["warmup_steps"] == int(0.2 * raw["max_steps"])


def test_a_setting_no_file_says_is_said_so(tmp_path, capsys):
    """NSLLM's folder says no learning rate, scheduler or warm-up: a line for each; a folder whose card says the
    learning rate (control) has none for it."""
    code, recipe, said = imported(capsys, CORPUS / "llamafactory" / "runs" / "nsllm-pt-2025", tmp_path / "a.yaml")
    for name in ("training.learning_rate", "training.lr_scheduler", "training.warmup_steps"):
        assert f"not carried: {name}=unknown" in said, said
    code, recipe, said = imported(capsys, CORPUS / "llamafactory" / "runs" / "luojiu-7b-2023", tmp_path / "b.yaml")
    assert code == 0 and "training.learning_rate=unknown" not in said
