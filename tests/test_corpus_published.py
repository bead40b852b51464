"""Run folders and model cards that users published in their own repositories (tests/assets/corpus/published/, one
folder per run, PROVENANCE.md says where each comes from: HF Trainer, TRL, Unsloth, axolotl, LLaMA-Factory and
ms-swift outputs, 2023 to 2026), imported as a new user would: ``finetune import FOLDER``. Each is held against this
test's own reading of the folder's raw files (JSON and YAML read here, the card's front matter and hyperparameter
list parsed here): the objective, the learning rate, the effective batch, the length, the schedule, LoRA's r and
alpha and the base model are each either the value the files say, or named in the printed table as not carried or
assumed — never a value no file says, shown as if it were said. A folder that says no run is refused in one line,
exit 2, nothing written. Negative controls take out of a copy the one thing that says a value and see it go."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.helpers import cli_in_process as cli

PUBLISHED = Path(__file__).parent / "assets" / "corpus" / "published"
UNITS = sorted(p for p in PUBLISHED.glob("*/*") if p.is_dir())


# ---------------------------------------------------------------------------------------------------------------
# the test's own reading of a folder's raw files


def _json(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text()) if (folder / name).is_file() else {}


def _card(folder: Path) -> tuple[dict, dict, dict]:
    """(front matter, the "Training hyperparameters" list, axolotl's config block) of the folder's README.md."""
    text = (folder / "README.md").read_text() if (folder / "README.md").is_file() else ""
    front = re.match(r"\s*---\n(.*?)\n---", text, re.S)  # front matter opens the card
    front = yaml.safe_load(front.group(1)) if front else {}
    listed = re.search(r"### Training hyperparameters\n(.*?)\n#", text, re.S)
    pairs = dict(re.findall(r"^- ([a-z_]+): (.+)$", listed.group(1), re.M)) if listed else {}
    block = re.search(r"See axolotl config</summary>.*?```yaml\n(.*?)\n```", text, re.S)
    return front or {}, pairs, (yaml.safe_load(block.group(1)) if block else {}) or {}


def raw(folder: Path) -> dict:
    """Everything the folder's files say, read here."""
    front, pairs, axolotl = _card(folder)
    state = _json(folder, "trainer_state.json")
    swift = _json(folder, "args.json")
    return {"args": _json(folder, "training_args.json") or swift, "swift": swift, "state": state,
            "logged": {k for e in state.get("log_history", []) for k in e}, "adapter": _json(folder,
                                                                                              "adapter_config.json"),
            "config": _json(folder, "config.json"), "results": _json(folder, "all_results.json"), "front": front,
            "pairs": pairs, "axolotl": axolotl,
            "lf_yaml": yaml.safe_load((folder / "training_args.yaml").read_text()) if (
                folder / "training_args.yaml").is_file() else None,
            "lf_log": (folder / "trainer_log.jsonl").is_file(), "lf_steps": _logged_steps(folder), "folder": folder}


def _logged_steps(folder: Path):
    """LLaMA-Factory's trainer_log.jsonl: the total_steps its lines count to."""
    log = folder / "trainer_log.jsonl"
    lines = log.read_text().splitlines() if log.is_file() else []
    return json.loads(lines[-1]).get("total_steps") if lines else None


def _log_epochs(r: dict):
    """LLaMA-Factory's trainer_log.jsonl: the epoch at its last line when that is its last planned step and a whole
    epoch (a run cut mid-epoch says no epoch count)."""
    log = r["folder"] / "trainer_log.jsonl"
    lines = log.read_text().splitlines() if log.is_file() else []
    last = json.loads(lines[-1]) if lines else {}
    whole = last.get("current_steps") == last.get("total_steps") and float(last.get("epoch") or 0.5).is_integer()
    return last["epoch"] if whole else None


def said_run(r: dict) -> bool:
    """Whether the files hold a run at all: the Trainer's state or arguments, a tool's own config, a card's list."""
    return bool(r["state"] or r["args"] or r["pairs"] or r["axolotl"] or r["lf_yaml"] or r["lf_log"])


def objective(r: dict) -> tuple:
    """("task", name) as the files say it (None: no file says it), or ("refused", a word of the refusal)."""
    if not said_run(r):
        return "refused", "holds no trainer_state.json"
    if r["lf_yaml"] is not None and r["lf_yaml"].get("do_predict") and not r["lf_yaml"].get("do_train"):
        return "refused", "trains nothing"
    heads = [a for a in r["config"].get("architectures") or [] if a.endswith(("ForMaskedLM", "Classification"))]
    if heads:
        return "refused", "which finetune does not"
    if "log_odds_ratio" in r["logged"]:  # ORPOTrainer's own column
        return "refused", "ORPO"
    if r["axolotl"]:
        return "task", "dpo" if r["axolotl"].get("rl") in ("dpo", "ipo") else "sft"
    if "num_generations" in r["args"] or "reward_std" in r["logged"]:
        return "task", "grpo"
    if "beta" in r["args"] or "rewards/chosen" in r["logged"]:
        return "task", "dpo"
    if r["swift"] or r["lf_log"] or "mean_token_accuracy" in r["logged"]:
        return "task", "sft"  # swift sft / LLaMA-Factory's default stage / SFTTrainer's own column
    tags = set(r["front"].get("tags") or [])  # TRL writes its trainer's name into its cards' tags
    found = next((t for t in ("dpo", "grpo", "sft") if t in tags), None)
    if found:
        return "task", found
    if any(str(a).endswith("ForCausalLM") for a in r["config"].get("architectures") or []):
        return "task", "clm"
    return "task", None


def _number(v):
    return float(v) if v is not None else None


def said(r: dict) -> dict:
    """The step's settings the files say, each None where none says it: recipe field → value."""
    a, p, x, s = r["args"], r["pairs"], r["axolotl"], r["state"]
    lr = a.get("learning_rate", p.get("learning_rate", x.get("learning_rate")))
    scheduler = a.get("lr_scheduler_type", p.get("lr_scheduler_type", x.get("lr_scheduler")))
    if "total_train_batch_size" in p:
        batch = int(p["total_train_batch_size"])
    elif "per_device_train_batch_size" in a and "gradient_accumulation_steps" in a:
        batch = int(a["per_device_train_batch_size"]) * int(a["gradient_accumulation_steps"])
    elif "micro_batch_size" in x and "gradient_accumulation_steps" in x:
        batch = int(x["micro_batch_size"]) * int(x["gradient_accumulation_steps"])
    else:  # the speed metrics, else trainer_state.json's per-device batch with the accumulation unsaid
        batch = _speed_batch(r) or s.get("train_batch_size")
    steps = a.get("max_steps") if (a.get("max_steps") or -1) > 0 else p.get("training_steps", x.get("max_steps"))
    epochs = None if steps else a.get("num_train_epochs", p.get("num_epochs", x.get("num_epochs",
                                                                                  s.get("num_train_epochs"))))
    epochs = epochs or (None if steps else _log_epochs(r))
    lora = r["adapter"] if r["adapter"].get("peft_type", "LORA") == "LORA" else {}
    loaded = r["adapter"].get("base_model_name_or_path")
    # the adapters' base where it is a hub id (owner/name, not a path of the machine it trained on): what they load on
    hub = loaded if loaded and re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(loaded)) else None
    model = r["swift"].get("model") or hub or r["front"].get("base_model") or x.get("base_model") or loaded
    return {"training.learning_rate": _number(lr), "training.lr_scheduler": scheduler,
            "training.effective_batch_size": batch, "training.max_steps": int(steps) if steps else None,
            "training.epochs": math.ceil(float(epochs)) if epochs else None, "peft.r": lora.get("r"),
            "peft.alpha": lora.get("lora_alpha"), "model.name_or_path": model}


def _accumulation_unsaid(r: dict) -> bool:
    """Only trainer_state.json says the batch: its per-device one, no file the accumulation."""
    a, x = r["args"], r["axolotl"]
    return not ("total_train_batch_size" in r["pairs"] or "gradient_accumulation_steps" in a or
                "gradient_accumulation_steps" in x or _speed_batch(r)) and "train_batch_size" in r["state"]


def _speed_batch(r: dict):
    """The Trainer's speed metrics: samples a second × seconds ÷ optimizer steps, where it is a whole number."""
    rate, runtime = r["results"].get("train_samples_per_second"), r["results"].get("train_runtime")
    steps = r["state"].get("max_steps") or r["state"].get("global_step") or r["lf_steps"]
    if not (rate and runtime and steps):
        return None
    batch = rate * runtime / steps
    return round(batch) if abs(batch - round(batch)) <= 0.01 * batch + 0.0005 * runtime / steps else None


# ---------------------------------------------------------------------------------------------------------------


def _import(capsys, source: Path, out: Path) -> tuple:
    return cli(capsys, "import", source, "-o", out, "--force")


def _named(said_text: str, field: str) -> bool:
    """Whether the table names ``field`` as not carried or assumed."""
    return any(line.startswith(("not carried:", "assumed:")) and field.split(".")[-1].split(" ")[0] in line
               for line in said_text.splitlines())


def _value(recipe: dict, field: str):
    section, name = field.split(".")
    return (recipe.get(section) or {}).get(name)


VERDICTS: dict = {}  # folder → what import did, for the printed table


@pytest.mark.parametrize("folder", UNITS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_each_published_folder_is_read_as_its_files_say(folder, tmp_path, capsys):
    r, out = raw(folder), tmp_path / "r.yaml"
    want = objective(r)
    code, text = _import(capsys, folder, out)
    assert "Traceback" not in text, text[-2000:]
    if want[0] == "refused":
        errors = [x for x in text.splitlines() if x.startswith("error: ")]
        assert code == 2 and len(errors) == 1 and want[1] in errors[0], text[-1500:]
        assert not out.exists()
        VERDICTS[folder.name] = "refused: " + want[1]
        return
    assert code == 0, text[-1500:]
    recipe = yaml.safe_load(out.read_text())
    rows = {x.split()[0]: x for x in text.splitlines() if x and not x.startswith((" ", "not carried", "assumed"))}
    if want[1] is None:  # no file says it: clm, said so
        assert recipe["task"] == "clm" and _named(text, "the objective"), text[:1500]
    else:
        assert recipe["task"] == want[1], rows.get("task")
    shown = []
    for field, value in said(r).items():
        got = _value(recipe, field)
        if value is None:  # no file says it: the recipe's own, named (LoRA's r where no adapters are said)
            if field in ("training.max_steps", "training.epochs"):
                continue  # the length: one of the two, checked below
            named = _named(text, "LoRA") if field.startswith("peft.") else _named(text, field)
            assert got is None or named, f"{field}={got} shown as said: {rows.get(field)}"
            shown.append(f"{field}: not said")
        elif field == "training.effective_batch_size" and _accumulation_unsaid(r):
            assert got == value and _named(text, "effective_batch_size"), (got, value, text[-800:])
            shown.append(f"{field}={got} assumed accumulation")
        else:
            assert got == pytest.approx(value) if isinstance(value, float) else got == value, \
                (field, got, value, rows.get(field))
            assert field in rows, f"{field} carried with no row saying where"
            shown.append(f"{field}={got}")
    length = said(r)
    if not length["training.max_steps"] and not length["training.epochs"]:
        assert _named(text, "epochs / max_steps"), text[-1500:]
    VERDICTS[folder.name] = f"{recipe['task']}: " + ", ".join(shown)


def test_the_published_corpus_spans_tools_years_and_objectives():
    """At least 25 folders of 5 tools, whose verdicts hold imports of sft, clm, dpo and grpo and refusals; the
    verdicts of the folders imported before it are printed (pytest -s shows them)."""
    tools = {p.parent.name for p in UNITS}
    assert len(UNITS) >= 25 and len(tools - {"none"}) >= 5, (len(UNITS), tools)
    wants = {objective(raw(p)) for p in UNITS}
    assert {("task", t) for t in ("sft", "clm", "dpo", "grpo")} <= wants and any(w[0] == "refused" for w in wants)
    provenance = (PUBLISHED / "PROVENANCE.md").read_text()
    assert all(p.name in provenance for p in UNITS)
    for name, verdict in sorted(VERDICTS.items()):
        print(f"{name}: {verdict}")


# ---------------------------------------------------------------------------------------------------------------
# negative controls: the one thing that says a value, taken out of a copy, and the value goes with it


def _copy(folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    return copy


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _recipe(capsys, folder: Path, tmp_path: Path) -> tuple[dict, str]:
    code, text = _import(capsys, folder, tmp_path / "control.yaml")
    assert code == 0, text[-1500:]
    return yaml.safe_load((tmp_path / "control.yaml").read_text()), text


DPO_CHECKPOINT = PUBLISHED / "trl" / "SteveHong1901__reasoning__models__dpo-clean__checkpoint-500"


def test_the_log_columns_are_what_say_dpo(tmp_path, capsys):
    copy = _copy(DPO_CHECKPOINT, tmp_path)
    (copy / "README.md").unlink()  # its tags say dpo too
    assert _recipe(capsys, copy, tmp_path)[0]["task"] == "dpo"
    _edit_json(copy / "trainer_state.json", lambda s: s.update(log_history=[
        {k: v for k, v in e.items() if not k.startswith(("rewards/", "logps/", "logits/"))} for e in s["log_history"]]))
    recipe, text = _recipe(capsys, copy, tmp_path)
    assert recipe["task"] == "clm" and "not carried: the objective" in text


def test_the_accumulation_is_assumed_only_where_no_file_says_it(tmp_path, capsys):
    copy = _copy(DPO_CHECKPOINT, tmp_path)
    recipe, text = _recipe(capsys, copy, tmp_path)
    per_device = json.loads((copy / "trainer_state.json").read_text())["train_batch_size"]
    assert recipe["training"]["effective_batch_size"] == per_device and "assumed: training.effective_batch" in text
    (copy / "training_args.json").write_text(json.dumps({"per_device_train_batch_size": per_device,
                                                         "gradient_accumulation_steps": 4, "learning_rate": 5e-6}))
    recipe, text = _recipe(capsys, copy, tmp_path)
    assert recipe["training"]["effective_batch_size"] == 4 * per_device and "assumed: training.effective" not in text
    assert recipe["training"]["learning_rate"] == 5e-6 and "training.learning_rate=unknown" not in text


def test_a_seq2seq_arguments_class_says_nothing_of_a_decoder(tmp_path, capsys):
    """LLaMA-Factory and ms-swift save Seq2SeqTrainingArguments for causal LMs: its fields refuse only a model whose
    own config says encoder-decoder."""
    copy = _copy(DPO_CHECKPOINT, tmp_path)
    (copy / "training_args.json").write_text(json.dumps({"learning_rate": 1e-5, "predict_with_generate": False}))
    assert _recipe(capsys, copy, tmp_path)[0]["task"] == "dpo"
    (copy / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"],
                                                  "is_encoder_decoder": True}))
    code, text = _import(capsys, copy, tmp_path / "refused.yaml")
    assert code == 2 and "encoder-decoder" in text and not (tmp_path / "refused.yaml").exists()


def test_a_card_folder_is_read_by_its_hyperparameter_list(tmp_path, capsys):
    folder = PUBLISHED / "trainer" / "ludyhasby__fine-tune-LLM__src__model"
    copy = _copy(folder, tmp_path)
    recipe, _ = _recipe(capsys, copy, tmp_path)
    assert recipe["training"]["learning_rate"] == float(_card(folder)[1]["learning_rate"])
    card = copy / "README.md"
    card.write_text(card.read_text().replace("### Training hyperparameters", "### Notes"))
    code, text = _import(capsys, copy, tmp_path / "refused.yaml")
    assert code == 2 and len([x for x in text.splitlines() if x.startswith("error:")]) == 1
    assert not (tmp_path / "refused.yaml").exists()


def test_adapters_target_modules_that_are_no_list_are_named_not_carried(tmp_path, capsys):
    copy = _copy(DPO_CHECKPOINT, tmp_path)
    _edit_json(copy / "adapter_config.json", lambda a: a.update(target_modules={"_content": [{"_val": "q_proj"}]}))
    recipe, text = _recipe(capsys, copy, tmp_path)
    assert recipe["peft"]["r"] == 16 and "target_modules" not in recipe["peft"]
    assert "not carried: target_modules" in text
    _edit_json(copy / "adapter_config.json", lambda a: a.update(target_modules=["q_proj"]))
    assert _recipe(capsys, copy, tmp_path)[0]["peft"]["target_modules"] == ["q_proj"]


def test_a_truncation_the_task_cannot_take_is_named_not_refused(tmp_path, capsys):
    copy = _copy(DPO_CHECKPOINT, tmp_path)
    args = {"beta": 0.1, "max_length": 512, "truncation_mode": "keep_end", "learning_rate": 1e-6,
            "max_prompt_length": 128}  # DPOConfig's: TRL cuts longer pairs
    (copy / "training_args.json").write_text(json.dumps(args))
    recipe, text = _recipe(capsys, copy, tmp_path)
    assert "too_long" not in recipe.get("data", {}) and "not carried: data.too_long=keep_end" in text
    (copy / "training_args.json").write_text(json.dumps({**args, "truncation_mode": "keep_start"}))
    assert _recipe(capsys, copy, tmp_path)[0]["data"]["too_long"] == "keep_start"


def test_ms_swift_args_json_says_the_trainer_arguments(tmp_path, capsys):
    copy = _copy(PUBLISHED / "ms-swift" / "lgc-FINANCE__DeepClima-R1__root", tmp_path)
    args = json.loads((copy / "args.json").read_text())
    recipe, _ = _recipe(capsys, copy, tmp_path)
    assert recipe["training"]["learning_rate"] == args["learning_rate"]
    _edit_json(copy / "args.json", lambda a: a.pop("learning_rate"))
    recipe, text = _recipe(capsys, copy, tmp_path)
    assert "learning_rate" not in recipe["training"] and "training.learning_rate=unknown" in text


def test_a_task_head_in_config_json_is_what_refuses_a_masked_lm(tmp_path, capsys):
    copy = _copy(PUBLISHED / "trainer" / "Francis-xsc__BERT_Weibo_Rumor__root", tmp_path)
    code, text = _import(capsys, copy, tmp_path / "refused.yaml")
    assert code == 2 and "BertForMaskedLM" in text and not (tmp_path / "refused.yaml").exists()
    _edit_json(copy / "config.json", lambda c: c.update(architectures=["BertLMHeadModelForCausalLM"]))
    assert _recipe(capsys, copy, tmp_path)[0]["task"] == "clm"


def test_an_argument_saved_as_none_is_unset_not_a_setting_finetune_lacks(tmp_path, capsys):
    """axolotl's training_args.bin saves group_by_length None: the Trainer's default order, nothing to name."""
    copy = _copy(DPO_CHECKPOINT, tmp_path)
    (copy / "training_args.json").write_text(json.dumps({"learning_rate": 1e-6, "group_by_length": None}))
    assert "group_by_length" not in _recipe(capsys, copy, tmp_path)[1]
    (copy / "training_args.json").write_text(json.dumps({"learning_rate": 1e-6, "group_by_length": True}))
    assert "not carried: group_by_length=True" in _recipe(capsys, copy, tmp_path)[1]


def test_grpo_top_k_none_filters_nothing_like_finetunes_top_k_0(tmp_path, capsys):
    """Older TRL's GRPOConfig saves top_k None (no top-k filtering): finetune's sampling, not a difference."""
    run = "tatami-galaxy__rl-math-unsloth__experiments__rl_training__rl_runs__checkpoint-100"
    copy = _copy(PUBLISHED / "unsloth" / run, tmp_path)
    args = {"learning_rate": 5e-6, "num_generations": 4, "top_k": None}
    (copy / "training_args.json").write_text(json.dumps(args))
    recipe, text = _recipe(capsys, copy, tmp_path)
    assert recipe["task"] == "grpo" and "not carried: top_k" not in text
    (copy / "training_args.json").write_text(json.dumps({**args, "top_k": 50}))
    assert "not carried: top_k=50" in _recipe(capsys, copy, tmp_path)[1]
