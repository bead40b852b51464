"""Runs that axolotl 0.21.0 trained itself, through its own CLI (``axolotl train``, Python 3.12, fp32 on the CPU), kept
in ``tests/assets/axolotl-*`` and made again by ``examples/axolotl/make_baselines.sh``: the tiny chat model on 40 chat
rows (``type: chat_template``), 4 × 2, AdamW, cosine with ``warmup_ratio: 0.2``, clipping at 0.5, seed 42. Each is
reproduced through finetune's CLI only — import (no ``--recipe``: the data sets' type names the task) with the rows
in their file's order, run at micro-batch 2, compare:

* LoRA, from axolotl's own initial adapters (replayed: ``tests/assets/axolotl-lora-initial``) — "equivalent"; the same
  rows with one word of one answer changed — "differs";
* full fine-tuning (no ``adapter``: peft off) — "equivalent";
* sample packing (axolotl's multipack) — finetune keeps its big-batch step, and the verdict names ``sample_packing``
  as not carried (and not the adapters' start, which the run was given).

Import alone, on axolotl's YAMLs as users write them: its shuffle of the rows (datasets' ``Dataset.shuffle``, one data
set or several), its warm-up rounding, no system message, the full run's peft, and what it cannot carry, named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers import cli_in_process as cli
from tests.helpers import one_torch_thread  # noqa: F401  (the module's fixture, by name)

ASSETS = Path(__file__).parent / "assets"
INPUTS = ASSETS / "axolotl-inputs"
YAMLS = Path(__file__).parent.parent / "examples" / "axolotl"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reproduce(capsys, tmp: Path, kind: str, data: Path = INPUTS / "chat.jsonl") -> tuple[int, str, str, Path]:
    """(compare's exit code, its verdict line, import's table, the recipe) for tests/assets/axolotl-<kind>, its rows
    given in their file's order (import writes them in axolotl's)."""
    baseline, recipe = ASSETS / f"axolotl-{kind}", tmp / f"{kind}-{data.stem}.yaml"
    start = ["--initial-adapter", ASSETS / "axolotl-lora-initial"] if kind != "full" else []
    code, table = cli(capsys, "import", baseline, "--model", INPUTS / "model", "--data", data, "-o", recipe, *start)
    assert code == 0, table
    mine = tmp / f"{kind}-{data.stem}-run"
    code, out = cli(capsys, "run", "--recipe", recipe, "--batch-size", 2, "--output-dir", mine, "--set",
                    "output.tracker=none", "--set", "model.generate_prompts=0", "--set", "peft.merge=false")
    assert code == 0, out
    code, out = cli(capsys, "compare", baseline, mine)
    return code, next(line for line in out.splitlines() if line.startswith("verdict:")), table, recipe


def test_an_axolotl_lora_run_is_reproduced_and_a_one_word_twin_differs(tmp_path, capsys):
    code, verdict, table, recipe = reproduce(capsys, tmp_path, "lora")
    assert code == 0 and verdict.startswith("verdict: equivalent"), verdict
    raw = yaml.safe_load(recipe.read_text())
    assert raw["task"] == "sft" and raw["data"]["system_prompt"] is None, raw
    # the rows written in axolotl's order are the ones axolotl trained (its own shuffle, kept beside the fixtures)
    assert Path(raw["data"]["source"]).read_text() == (INPUTS / "chat-axolotl-order.jsonl").read_text()
    assert "shuffle_merged_datasets (axolotl's default true): the rows are shuffled once" in table, table
    assert "(--data) as it trained on them" in table, table
    rows = [json.loads(line) for line in (INPUTS / "chat.jsonl").read_text().splitlines()]
    answer = next(m for m in rows[5]["messages"] if m["role"] == "assistant")
    answer["content"] = answer["content"].replace(" is ", " was ", 1)
    twin = tmp_path / "one-word.jsonl"
    twin.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, verdict, _, _ = reproduce(capsys, tmp_path, "lora", twin)
    assert code == 1 and verdict.startswith("verdict: differs"), verdict


def test_without_data_the_file_its_config_names_is_read(tmp_path, capsys, monkeypatch):
    """No --data: the one local file the card's config names (datasets[0].path, relative to where axolotl ran) is the
    training file, its rows written in axolotl's order; from another folder, where that path is not a file, the data
    set stays unknown (said)."""
    root = Path(__file__).parent.parent
    monkeypatch.chdir(root)
    recipe = tmp_path / "named.yaml"
    code, table = cli(capsys, "import", ASSETS / "axolotl-full", "--model", INPUTS / "model", "-o", recipe)
    assert code == 0 and "datasets[0].path tests/assets/axolotl-inputs/chat.jsonl" in table, table
    source = yaml.safe_load(recipe.read_text())["data"]["source"]
    assert Path(source).read_text() == (INPUTS / "chat-axolotl-order.jsonl").read_text()
    monkeypatch.chdir(tmp_path)
    code, table = cli(capsys, "import", ASSETS / "axolotl-full", "--model", INPUTS / "model", "-o", tmp_path / "x.yaml")
    assert code == 0 and "datasets[0].path" not in table and "give --data FILE" in table, table


def test_its_multipack_step_is_not_taken_and_says_why(tmp_path, capsys):
    code, table = cli(capsys, "import", ASSETS / "axolotl-packed", "--model", INPUTS / "model", "--data",
                      INPUTS / "chat.jsonl", "-o", tmp_path / "p.yaml", "--baseline-step")
    assert code == 0 and "own step: not taken — axolotl's multipack bins rows in the order of a RandomSampler" in \
        table, table
    assert "not carried: sample_packing=True" in table, table


def test_an_axolotl_full_finetune_is_reproduced(tmp_path, capsys):
    code, verdict, table, recipe = reproduce(capsys, tmp_path, "full")
    assert "README.md (axolotl config): no adapter: every weight trained" in table.split("peft.enabled")[1], table
    assert yaml.safe_load(recipe.read_text())["peft"]["enabled"] is False
    assert code == 0 and verdict.startswith("verdict: equivalent"), verdict


def test_a_packed_run_keeps_the_big_batch_step_and_the_verdict_names_the_packing(tmp_path, capsys):
    code, verdict, table, recipe = reproduce(capsys, tmp_path, "packed")
    # the Trainer's warmup_steps 0 (in its event files) is what it took; the config's warmup_ratio does not override it
    assert yaml.safe_load(recipe.read_text())["training"]["warmup_steps"] == 0
    assert "not carried: sample_packing=True — axolotl packs with its own multipack sampler" in table, table
    assert code == 1 and "the baseline's sample_packing=True is not carried by finetune import" in verdict, verdict
    assert "lr schedule" not in verdict and "adapters' start" not in verdict, verdict  # given: peft.init_from


@pytest.mark.parametrize("kind, warmup, peft", [("lora", 2, True), ("full", 2, False), ("packed", 0, True)])
def test_an_axolotl_card_alone(tmp_path, capsys, kind, warmup, peft):
    """The model card without the event files: its hyperparameter list's warm-up where it lists one (2), else the
    config block's ratio as axolotl rounds it (int(0.2 × 4) = 0, the packed run's); no adapter: peft off."""
    recipe = tmp_path / "r.yaml"
    code, said = cli(capsys, "import", ASSETS / f"axolotl-{kind}" / "README.md", "--model", INPUTS / "model", "-o",
                     recipe)
    assert code == 0, said
    raw = yaml.safe_load(recipe.read_text())
    assert (raw["task"], raw["training"]["warmup_steps"], raw["peft"]["enabled"]) == ("sft", warmup, peft), said


def imported(capsys, tmp: Path, config: dict, *extra) -> tuple[dict, str]:
    """(the recipe, what import said) for axolotl's sft-full.yaml changed by ``config`` (a key set to None: removed),
    its rows given in their file's order."""
    raw = yaml.safe_load((YAMLS / "sft-full.yaml").read_text())
    raw = {k: v for k, v in {**raw, **config}.items() if v is not None}
    source, recipe = tmp / "axolotl.yaml", tmp / "recipe.yaml"
    source.write_text(yaml.safe_dump(raw))
    code, said = cli(capsys, "import", source, "--model", INPUTS / "model", "--force", "-o", recipe, *extra)
    assert code == 0, said
    return yaml.safe_load(recipe.read_text()), said


def test_an_axolotl_yaml_as_axolotl_trains_it(tmp_path, capsys):
    """Over a base recipe with a system prompt and LoRA: no system message, peft off, the task's own data; the
    rows in axolotl's order; warm-up as axolotl rounds it (int(0.2 × 5) = 1, made 2)."""
    raw, said = imported(capsys, tmp_path, {}, "--recipe", "sft-smollm2", "--steps", 5, "--data",
                         INPUTS / "chat.jsonl")
    assert (raw["data"]["system_prompt"], raw["peft"]["enabled"], raw["training"]["warmup_steps"]) == \
        (None, False, 2), said
    assert Path(raw["data"]["source"]).read_text() == (INPUTS / "chat-axolotl-order.jsonl").read_text()
    sets = yaml.safe_load((YAMLS / "sft-full.yaml").read_text())["datasets"]
    hub = [{**sets[0], "path": "someone/chats"}]  # not a file here: no --data, the order is said, not carried
    raw, said = imported(capsys, tmp_path, {"datasets": hub}, "--steps", 5)
    assert raw["task"] == "sft" and "not carried: the rows' order=shuffled with seed 42" in said, said


@pytest.mark.parametrize("keys, steps, warmup", [
    ({"warmup_ratio": 0.3}, 10, 3), ({"warmup_ratio": 0.15}, 10, 2), ({"warmup_ratio": 0.05}, 10, 0),
    ({"warmup_ratio": None, "warmup_steps": 1}, 10, 2), ({"warmup_ratio": None, "warmup_steps": 4}, 10, 4),
    ({"warmup_ratio": None}, 200, 6), ({"warmup_ratio": None}, 5000, 100), ({"warmup_ratio": None}, 40, 2),
    ({"warmup_ratio": None}, 20, 0)])
def test_axolotl_s_warmup_rule(tmp_path, capsys, keys, steps, warmup):
    """core/builders/base.py _configure_warmup_and_logging: warmup_steps as given, else int(ratio × steps), else
    min(int(0.03 × steps), 100); 1 becomes 2."""
    raw, said = imported(capsys, tmp_path, keys, "--steps", steps)
    assert raw["training"]["warmup_steps"] == warmup, said


def test_the_rows_order_follows_axolotl_s_keys(tmp_path, capsys):
    """Two data sets: their rows one after another, shuffled once; shuffle_merged_datasets false or
    curriculum_sampling: the file's order; each set shuffled before merging: named, not carried."""
    from datasets import Dataset

    data = ["--data", INPUTS / "chat.jsonl"]
    two = {"datasets": [{"path": "a.jsonl", "type": "chat_template"}, {"path": "b.jsonl", "type": "chat_template"}],
           "seed": 7}
    raw, said = imported(capsys, tmp_path, two, *data)
    lines = (INPUTS / "chat.jsonl").read_text().splitlines()
    order = Dataset.from_dict({"i": range(len(lines))}).shuffle(seed=7)["i"]
    assert Path(raw["data"]["source"]).read_text().splitlines() == [lines[i] for i in order]
    assert "its 2 data sets one after another" in said, said
    for keys in ({"shuffle_merged_datasets": False}, {"curriculum_sampling": True}):
        raw, said = imported(capsys, tmp_path, keys, *data)
        assert raw["data"]["source"] == str(INPUTS / "chat.jsonl") and "rows' order" not in said, said
    raw, said = imported(capsys, tmp_path, {**two, "shuffle_before_merging_datasets": True}, *data)
    assert raw["data"]["source"] == str(INPUTS / "chat.jsonl"), raw
    assert "not carried: shuffle_before_merging_datasets=True — axolotl shuffles each data set" in said, said


def test_what_an_axolotl_config_does_that_finetune_does_not_is_named(tmp_path, capsys):
    """Each setting that changes axolotl's steps and that finetune cannot take gets its one line."""
    chat = {"path": "chat.jsonl", "type": "chat_template", "roles_to_train": ["user", "assistant"],
            "train_on_eos": "all", "field_messages": "conversation"}
    raw, said = imported(capsys, tmp_path, {"datasets": [chat], "bf16": None, "fp16": None, "use_rslora": True,
                                            "chat_template": "llama3", "adapter": "lora", "lora_r": 8})
    for line in ("datasets.roles_to_train=['user', 'assistant'] — finetune trains the assistant's turns",
                 "datasets.train_on_eos=all — ", "datasets.field_messages=conversation — ",
                 "use_rslora=True — ", "chat_template=llama3 — ", "bf16=auto — axolotl trains in bf16 where the GPU"):
        assert f"not carried: {line}" in said, said
    raw, said = imported(capsys, tmp_path, {"datasets": [{"path": "t.jsonl", "type": "alpaca"}],
                                            "chat_template": "chatml", "bf16": True})
    # instruction rows train the response, the prompt masked: sft (its rows, axolotl's prompt strategy, named)
    assert raw["task"] == "sft" and "not carried: datasets.type=alpaca — " in said, said
    assert "not carried: bf16=True — axolotl loads the model in bf16 and trains every weight in it" in said, said


def test_an_8bit_lora_config_with_checkpointing_imports_without_the_checkpointing(tmp_path, capsys):
    """axolotl's own examples pair load_in_8bit with gradient_checkpointing; finetune's int8 layers keep their inputs
    where checkpointing cannot free them. Checkpointing changes memory, not the step: the recipe is written without
    it, said as a note (not a refusal of the whole import)."""
    pytest.importorskip("bitsandbytes")
    raw, said = imported(capsys, tmp_path, {"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "load_in_8bit": True,
                                            "lora_target_linear": True, "gradient_checkpointing": True},
                         "--data", INPUTS / "chat.jsonl")
    assert raw["model"]["quantization"] == "int8" and "gradient_checkpointing" not in raw["training"], raw
    assert "note: gradient_checkpointing=True left off — int8 layers keep their inputs" in said, said
    raw, said = imported(capsys, tmp_path, {"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "load_in_4bit": True,
                                            "lora_target_linear": True, "gradient_checkpointing": True},
                         "--data", INPUTS / "chat.jsonl")
    assert raw["training"]["gradient_checkpointing"] is True and "left off" not in said, said  # nf4: kept
