"""LLaMA-Factory's files as others wrote them (``tests/assets/corpus/llamafactory/``, PROVENANCE.md names each one's
repository, path and commit): the example configs of its main branch, of 0.9.3 and of its v1 format, its demo data
and four run folders published in 2023-2025. Each is imported in-process and held against this test's own reading of
the same file (a few lines of yaml/json, not the importer's code): learning rate, effective batch, epochs or steps,
scheduler, LoRA r and alpha, the task its stage trains. Files that train nothing are refused in one line; every file
is recognised as LLaMA-Factory's and no other tool's file is; its alpaca and sharegpt rows are written as finetune's.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import yaml

from finetune.reproduce.sources import recognised_by
from tests.helpers import ROOT
from tests.helpers import cli_in_process as cli

CORPUS = ROOT / "tests" / "assets" / "corpus" / "llamafactory"
TRAINING = sorted(p for p in CORPUS.glob("*/*.yaml") if p.parent.name in ("main", "v0.9.3", "v1") and
                  not any(w in p.name for w in ("merge", "export", "inference", "predict", "eval")))
# files that train nothing, with the word the refusal must say of each
NOT_TRAINING = {"main/merge_lora_qwen3_lora_sft.yaml": "export", "main/merge_lora_qwen3_gptq.yaml": "export",
                "main/inference_qwen3_lora_sft.yaml": "inference", "v0.9.3/merge_lora_llama3_lora_sft.yaml": "export",
                "v0.9.3/merge_lora_llama3_gptq.yaml": "export",
                "v0.9.3/train_lora_llama3_lora_eval.yaml": "benchmark",
                "main/extras_nlg_eval_llama3_lora_predict.yaml": "predict",
                "v0.9.3/extras_nlg_eval_llama3_lora_predict.yaml": "predict",
                "v1/train_lora_export_lora.yaml": "export"}
# LLaMA-Factory's stages and the tasks finetune trains them with; the stages it has no task for
TASKS = {"sft": "sft", "dpo": "dpo", "pt": "clm"}
REFUSED_STAGES = {"kto", "rm", "ppo"}


def _v1_pairs(raw: dict) -> bool:
    """Whether a v1 YAML's data sets (its train_dataset YAML, here under data/) are all converted as pairs."""
    data = CORPUS / "data" / Path(str(raw.get("train_dataset"))).name
    sets = yaml.safe_load(data.read_text()) if data.is_file() else {}
    return bool(sets) and all(v.get("converter") == "pair" for v in sets.values())


def expected(raw: dict) -> dict:
    """What a LLaMA-Factory YAML says, read here: 0.x keys (TrainingArguments' defaults where absent), or v1's."""
    if "model" in raw:  # v1: its TrainingArguments' defaults, a constant rate, one micro-batch a step
        peft = raw.get("peft_config") or {}
        lora = peft.get("name") == "lora"
        return {"lr": raw.get("learning_rate", 1e-4), "batch": raw.get("global_batch_size") or
                raw.get("micro_batch_size", 1), "max_steps": raw.get("max_steps"),
                "epochs": None if raw.get("max_steps") else raw.get("num_train_epochs", 3),
                "scheduler": "constant", "lora": (peft.get("r"), peft.get("lora_alpha")) if lora else None,
                "task": "dpo" if _v1_pairs(raw) else "sft", "model": raw["model"]}
    lora = raw.get("finetuning_type", "lora") == "lora"
    rank = raw.get("lora_rank", 8)
    return {"lr": raw.get("learning_rate", 5e-5), "batch": raw.get("per_device_train_batch_size", 8) *
            raw.get("gradient_accumulation_steps", 1), "max_steps": raw.get("max_steps"),
            "epochs": raw.get("num_train_epochs", 3.0), "scheduler": raw.get("lr_scheduler_type", "linear"),
            "lora": (rank, raw.get("lora_alpha", 2 * rank)) if lora else None,
            "task": TASKS.get(raw.get("stage")), "model": raw["model_name_or_path"]}


def imported(capsys, source, tmp_path, *flags) -> tuple[int, dict, str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "recipe.yaml"
    code, said = cli(capsys, "import", source, "-o", out, *flags)
    recipe = yaml.safe_load(out.read_text()) if out.is_file() else {}
    return code, recipe, said


@pytest.mark.parametrize("path", TRAINING, ids=[f"{p.parent.name}/{p.name}" for p in TRAINING])
def test_every_training_config_imports_as_it_reads(path, tmp_path, capsys):
    raw = yaml.safe_load(path.read_text())
    want = expected(raw)
    code, recipe, said = imported(capsys, path, tmp_path)
    if raw.get("stage") in REFUSED_STAGES:  # a stage with no task: one line naming it and the stages taken
        assert code == 2 and said.strip().splitlines() == [
            f"error: import: stage: {raw['stage']} in {path} is not supported (supported: pt, dpo, sft)"], said
        return
    assert code == 0, said
    training, peft = recipe["training"], recipe.get("peft") or {}
    assert recipe["task"] == want["task"] and recipe["model"]["name_or_path"] == want["model"], recipe
    assert training["learning_rate"] == pytest.approx(want["lr"]) and \
        training["effective_batch_size"] == want["batch"], (training, want)
    assert training.get("max_steps") == want["max_steps"]
    if want["epochs"] is not None:
        assert training["epochs"] == math.ceil(float(want["epochs"]))
    assert training.get("lr_scheduler") == want["scheduler"]
    if want["lora"] is None:
        assert peft.get("enabled") is False, peft
    else:
        assert peft["enabled"] is True and (peft["r"], peft["alpha"]) == want["lora"], peft
        assert "LoRA or not" not in said


def test_a_v1_yaml_is_llamafactorys_with_its_lora(tmp_path, capsys):
    """The v1 format (no ``stage``, ``peft_config``) is LLaMA-Factory's, not axolotl's; its LoRA is carried."""
    path = CORPUS / "v1" / "train_lora_train_lora_sft.yaml"
    assert [s.name for s in recognised_by(path)][:1] == ["LLaMA-Factory"]
    code, recipe, said = imported(capsys, path, tmp_path)
    peft = yaml.safe_load(path.read_text())["peft_config"]
    assert code == 0 and recipe["peft"]["r"] == peft["r"] and recipe["peft"]["dropout"] == peft["lora_dropout"]
    assert recipe["peft"]["target_modules"] == ["all-linear"], recipe["peft"]


def test_the_dpo_data_of_a_v1_yaml_makes_it_a_dpo_run(tmp_path, capsys):
    """v1's stage is its command's: its data set's ``converter: pair`` shows a dpo run; an sft one (control) sft."""
    folder = tmp_path / "v1"
    (folder / "examples").mkdir(parents=True)
    (folder / "data").mkdir()
    for name, converter in (("sft", "alpaca"), ("dpo", "pair")):
        (folder / "data" / f"{name}.yaml").write_text(f"x:\n  path: x.jsonl\n  converter: {converter}\n")
        text = (CORPUS / "v1" / "train_lora_train_lora_sft.yaml").read_text()
        (folder / "examples" / f"{name}.yaml").write_text(text.replace("data/v1_sft_demo.yaml", f"data/{name}.yaml"))
        code, recipe, said = imported(capsys, folder / "examples" / f"{name}.yaml", tmp_path / name)
        assert code == 0 and recipe["task"] == name, said


@pytest.mark.parametrize("name", sorted(NOT_TRAINING))
def test_a_file_that_trains_nothing_is_refused_as_such(name, tmp_path, capsys):
    code, recipe, said = imported(capsys, CORPUS / name, tmp_path)
    lines = said.strip().splitlines()
    assert code == 2 and len(lines) == 1 and not recipe, said
    assert f"is a LLaMA-Factory {NOT_TRAINING[name]}" in lines[0] and "trains nothing" in lines[0] and \
        "llamafactory-cli train" in lines[0], lines[0]
    assert not list(tmp_path.iterdir())  # nothing written


def test_the_same_file_with_do_train_imports(tmp_path, capsys):
    """Negative control of the refusal: the predict config with ``do_train: true`` and a data set trains."""
    raw = yaml.safe_load((CORPUS / "main" / "extras_nlg_eval_llama3_lora_predict.yaml").read_text())
    raw.update(do_train=True, dataset="alpaca_en_demo")
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(raw))
    code, recipe, said = imported(capsys, path, tmp_path)
    assert code == 0 and recipe["task"] == "sft", said


def test_every_file_is_llamafactorys_and_no_other_tools_is():
    files = [*(p for d in ("main", "v0.9.3", "v1") for p in (CORPUS / d).glob("*.yaml")), *(CORPUS / "runs").iterdir()]
    assert len(files) > 25
    wrong = [str(p) for p in files if [s.name for s in recognised_by(p)][:1] != ["LLaMA-Factory"]]
    assert not wrong, wrong
    others = [p for p in (ROOT / "tests" / "assets").rglob("*.yaml") if "llamafactory" not in p.parts and
              "training_args.yaml" != p.name]
    claimed = [str(p) for p in others if any(s.name == "LLaMA-Factory" for s in recognised_by(p))]
    assert others and not claimed, claimed


def _log(folder: Path) -> list:
    return [json.loads(line) for line in (folder / "trainer_log.jsonl").read_text().splitlines() if line.strip()]


def test_a_2023_log_with_nulls_imports(tmp_path, capsys):
    """luojiu (LLaMA-Factory of Nov 2023): every log line holds eval_loss, predict_loss, reward: null."""
    folder = CORPUS / "runs" / "luojiu-7b-2023"
    assert any(e.get("eval_loss", 0) is None for e in _log(folder))
    code, recipe, said = imported(capsys, folder, tmp_path)
    card = dict(line[2:].split(": ", 1) for line in (folder / "README.md").read_text().splitlines()
                if line.startswith("- ") and ": " in line)
    adapter = json.loads((folder / "adapter_config.json").read_text())
    assert code == 0 and recipe["peft"]["r"] == adapter["r"] and recipe["peft"]["alpha"] == adapter["lora_alpha"]
    assert "total_train_batch_size" not in card or recipe["training"]["effective_batch_size"] == \
        int(card["total_train_batch_size"])


def test_the_effective_batch_is_the_speed_metrics_where_no_file_says_the_accumulation(tmp_path, capsys):
    """NSLLM (2025, no YAML): trainer_state's per-device batch is 4, its speed metrics say ~1536 a step."""
    folder = CORPUS / "runs" / "nsllm-pt-2025"
    metrics = json.loads((folder / "all_results.json").read_text())
    steps = _log(folder)[-1]["total_steps"]
    want = round(metrics["train_samples_per_second"] * metrics["train_runtime"] / steps)
    code, recipe, said = imported(capsys, folder, tmp_path)
    assert code == 0 and recipe["training"]["effective_batch_size"] == want, said
    assert "speed metrics" in said and "assumed: task" in said and "missing: model.name_or_path" in said


def test_without_speed_metrics_the_accumulation_is_said_as_assumed_and_reproduce_refuses(tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    for name in ("trainer_log.jsonl", "trainer_state.json"):
        shutil.copy(CORPUS / "runs" / "nsllm-pt-2025" / name, folder / name)
    code, recipe, said = imported(capsys, folder, tmp_path)
    per_device = json.loads((folder / "trainer_state.json").read_text())["train_batch_size"]
    assert code == 0 and recipe["training"]["effective_batch_size"] == per_device, said
    assert "accumulation 1 ASSUMED" in said and "assumed: training.effective_batch_size" in said, said
    data = tmp_path / "rows.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    code, said = cli(capsys, "reproduce", folder, "--model", "m", "--data", data, "-o", tmp_path / "out")
    assert code == 2 and "the effective batch is unknown" in said.strip().splitlines()[-1], said
    assert not (tmp_path / "out").exists()


def test_a_stage_no_file_says_is_said_as_assumed(tmp_path, capsys):
    """No YAML and no stage's marks in the log: LLaMA-Factory's default stage, said as assumed (the command line may
    have named another; compare's verdict shows one that differs); a log with DPO's columns (control) says its
    stage, assumed by nothing."""
    folder = tmp_path / "run"
    shutil.copytree(CORPUS / "runs" / "nsllm-pt-2025", folder)
    code, recipe, said = imported(capsys, folder, tmp_path / "sft")
    assert code == 0 and "assumed: task" in said and "command line may have named another" in said, said
    state = json.loads((folder / "trainer_state.json").read_text())
    for entry in state["log_history"]:
        if "loss" in entry:
            entry.update({"rewards/chosen": 0.1, "rewards/rejected": -0.1, "rewards/accuracies": 0.5,
                          "rewards/margins": 0.2, "logps/chosen": -1.0, "logps/rejected": -2.0})
    (folder / "trainer_state.json").write_text(json.dumps(state))
    code, recipe, said = imported(capsys, folder, tmp_path / "dpo")
    assert code == 0 and "assumed: task" not in said and "rewards/chosen" in said, said


def test_reproduce_refuses_a_run_that_names_no_model(tmp_path, capsys):
    folder = CORPUS / "runs" / "nsllm-pt-2025"
    code, said = cli(capsys, "reproduce", folder, "--data", CORPUS / "data" / "alpaca_en_demo.json",
                     "-o", tmp_path / "out")
    assert code == 2 and "do not name the model" in said.strip().splitlines()[-1], said


def test_adapter_config_beside_the_log_says_lora(tmp_path, capsys):
    """qwen-medical (2025): no trainer_state.json, no YAML; adapter_config.json beside the log."""
    folder = CORPUS / "runs" / "qwen-medical-2025"
    adapter = json.loads((folder / "adapter_config.json").read_text())
    code, recipe, said = imported(capsys, folder, tmp_path)
    assert code == 0 and recipe["peft"]["enabled"] is True and recipe["peft"]["r"] == adapter["r"], said
    assert "LoRA or not" not in said


def test_a_card_that_says_peft_says_lora(tmp_path, capsys):
    """The card's ``library_name: peft`` without adapter_config.json: LoRA, its r said as unknown; without it
    (control) LoRA or not is assumed."""
    folder = tmp_path / "run"
    shutil.copytree(CORPUS / "runs" / "mistral-translator-2024", folder)
    (folder / "adapter_config.json").unlink()
    code, recipe, said = imported(capsys, folder, tmp_path / "a")
    assert code == 0 and recipe["peft"]["enabled"] is True and "LoRA r and alpha=unknown" in said, said
    card = folder / "README.md"
    card.write_text(card.read_text().replace("library_name: peft\n", ""))
    code, recipe, said = imported(capsys, folder, tmp_path / "b")
    assert code == 0 and "assumed: peft" in said, said


def _turns(row: dict) -> list:
    """A sharegpt row of the demo data as role/content turns (its default tags)."""
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": roles[t["from"]], "content": t["value"]} for t in row["conversations"]]


def _rows(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_sharegpt_preference_rows_are_written_as_pairs(tmp_path, capsys, monkeypatch):
    """The dpo example names ``dpo_en_demo`` (sharegpt, ranking): run from LLaMA-Factory's root (data/ beside)."""
    monkeypatch.chdir(CORPUS)
    code, recipe, said = imported(capsys, CORPUS / "main" / "train_lora_qwen3_lora_dpo.yaml", tmp_path)
    source = json.loads((CORPUS / "data" / "dpo_en_demo.json").read_text())
    rows = _rows(tmp_path / "recipe-rows.jsonl")
    assert code == 0 and recipe["task"] == "dpo" and len(rows) == len(source), said
    for row, raw in zip(rows, source):
        assert row["prompt"] == _turns(raw) and row["chosen"] == [{"role": "assistant",
                                                                   "content": raw["chosen"]["value"]}]
        assert row["rejected"][0]["content"] == raw["rejected"]["value"]
    assert rows[1]["prompt"][0]["role"] == "system"  # a system turn first stays the system's


def test_alpaca_rows_are_written_as_messages(tmp_path, capsys):
    source = json.loads((CORPUS / "data" / "alpaca_en_demo.json").read_text())
    code, recipe, said = imported(capsys, CORPUS / "main" / "train_lora_qwen3_lora_sft.yaml", tmp_path, "--data",
                                  CORPUS / "data" / "alpaca_en_demo.json")
    rows = _rows(tmp_path / "recipe-rows.jsonl")
    assert code == 0 and len(rows) == len(source), said
    for row, raw in zip(rows, source):
        prompt = raw["instruction"] + ("\n" + raw["input"] if raw["input"] else "")
        assert row["messages"] == [{"role": "user", "content": prompt}, {"role": "assistant", "content": raw["output"]}]
    assert any(r["input"] for r in source)  # the joined input is tested


def test_sharegpt_rows_are_written_as_messages(tmp_path, capsys):
    data = CORPUS / "data" / "glaive_toolcall_en_demo.json"
    code, recipe, said = imported(capsys, CORPUS / "main" / "train_lora_qwen3_lora_sft.yaml", tmp_path, "--data", data)
    source = json.loads(data.read_text())
    assert code == 0 and [r["messages"] for r in _rows(tmp_path / "recipe-rows.jsonl")] == [_turns(r) for r in source]


def test_a_tool_call_turn_is_refused_in_one_line(tmp_path, capsys):
    source = json.loads((CORPUS / "data" / "glaive_toolcall_en_demo.json").read_text())
    source[0]["conversations"].insert(1, {"from": "function_call", "value": "{}"})
    data = tmp_path / "data" / "glaive_toolcall_en_demo.json"
    data.parent.mkdir()
    data.write_text(json.dumps(source))
    shutil.copy(CORPUS / "data" / "dataset_info.json", data.parent)
    code, recipe, said = imported(capsys, CORPUS / "main" / "train_lora_qwen3_lora_sft.yaml", tmp_path, "--data", data)
    assert code == 2 and said.strip().splitlines()[-1].startswith(f"error: data: {data} row 1: a function_call turn")
    assert not list(tmp_path.glob("recipe*"))


def test_a_card_and_adapter_config_naming_two_base_models_take_the_loaded_one_and_say_the_other(tmp_path, capsys):
    """luojiu (2023): the card's hand-written ``base_model: Meta/Llama2``, adapter_config.json's hub id the adapters
    were trained on — that one, the card's named in a line; an adapter base that is a path of the training machine
    (control) leaves the card's, the path named."""
    folder = tmp_path / "run"
    shutil.copytree(CORPUS / "runs" / "luojiu-7b-2023", folder)
    adapter = json.loads((folder / "adapter_config.json").read_text())
    card = re.search(r"^base_model: (\S+)", (folder / "README.md").read_text(), re.M).group(1)
    assert adapter["base_model_name_or_path"] != card
    code, recipe, said = imported(capsys, folder, tmp_path / "a")
    assert code == 0 and recipe["model"]["name_or_path"] == adapter["base_model_name_or_path"], said
    assert f"not carried: the card's base model={card}" in said
    adapter["base_model_name_or_path"] = "/root/models/llama2"
    (folder / "adapter_config.json").write_text(json.dumps(adapter))
    code, recipe, said = imported(capsys, folder, tmp_path / "b")
    assert code == 0 and recipe["model"]["name_or_path"] == card, said
    assert "not carried: adapter_config.json's base model=/root/models/llama2" in said


def test_the_epochs_are_the_epoch_its_last_planned_step_ends(tmp_path, capsys):
    """qwen-medical (2025, no YAML): its log's last line, at total_steps, says the epoch; a log whose last planned
    step ends mid-epoch (control: a run cut by max_steps) says no epoch count."""
    folder = tmp_path / "run"
    shutil.copytree(CORPUS / "runs" / "qwen-medical-2025", folder)
    last = _log(folder)[-1]
    assert last["current_steps"] == last["total_steps"]
    code, recipe, said = imported(capsys, folder, tmp_path / "a")
    assert code == 0 and recipe["training"]["epochs"] == int(last["epoch"]), said
    lines = (folder / "trainer_log.jsonl").read_text().splitlines()
    lines[-1] = json.dumps({**json.loads(lines[-1]), "epoch": last["epoch"] - 0.5})
    (folder / "trainer_log.jsonl").write_text("\n".join(lines) + "\n")
    code, recipe, said = imported(capsys, folder, tmp_path / "b")
    assert code == 0 and "not carried: training.epochs / max_steps=unknown" in said, said
