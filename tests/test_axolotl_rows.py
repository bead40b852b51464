"""An axolotl data set's rows in its own formats, written as the rows finetune's task reads
(``finetune/reproduce/sources/axolotl_rows.py``). The configs are axolotl's examples (``tests/assets/corpus/axolotl``)
or a few lines written here; the rows are axolotl's own test rows (``tests/assets/corpus/axolotl-rows``, its
PROVENANCE.md). Each written file is held against this test's own reading of the raw rows (turns, roles, content,
order within a row; the rows as a set, since axolotl's default shuffle reorders them), a preference config's rows are
read by the dpo task's own loader, and bad rows or unknown types are said in one line. Import only, no training."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.helpers import ROOT
from tests.helpers import cli_in_process as cli

CORPUS = ROOT / "tests" / "assets" / "corpus" / "axolotl"
DATA = ROOT / "tests" / "assets" / "corpus" / "axolotl-rows"  # beside the configs: corpus/axolotl holds units only
ROLES = {"human": "user", "gpt": "assistant", "system": "system", "assistant": "assistant", "user": "user"}


def imported(capsys, config, tmp_path, data) -> tuple:
    """(exit code, recipe mapping, what import said, the rows it wrote or None) of ``finetune import CONFIG --data``."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "recipe.yaml"
    code, said = cli(capsys, "import", config, "-o", out, "--data", data)
    recipe = yaml.safe_load(out.read_text()) if out.is_file() else {}
    rows = tmp_path / "recipe-rows.jsonl"
    return code, recipe, said, [json.loads(x) for x in rows.read_text().splitlines()] if rows.is_file() else None


def config(tmp_path, name="axolotl.yaml", **dataset) -> Path:
    """A small axolotl config of one data set (the keys given), written for this test."""
    raw = {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "micro_batch_size": 2, "num_epochs": 1,
           "learning_rate": 1e-5, "datasets": [{"path": "rows.jsonl", **dataset}]}
    if dataset.pop("_rl", None) or "rl" in dataset:
        raw["rl"] = raw["datasets"][0].pop("rl")
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def raw_rows(path: Path) -> list:
    text = path.read_text()
    rows = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines() if x.strip()]
    return [rows] if isinstance(rows, dict) else rows


def same(ours: list, theirs: list) -> bool:
    """The same rows, in any order (axolotl shuffles its rows once; import writes them in that order)."""
    key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
    return sorted(map(key, ours)) == sorted(map(key, theirs))


def not_carried(said: str) -> list:
    return [line for line in said.splitlines() if line.startswith("not carried: datasets")]


def test_a_chat_template_config_with_legacy_fields_writes_messages(tmp_path, capsys):
    """LiquidAI's example reads ``conversations`` of from/value turns (field_messages, message_field_role /
    _content): axolotl's conversation fixture, a human/gpt sharegpt row, becomes user/assistant messages."""
    data = DATA / "conversation.json"
    code, recipe, said, rows = imported(capsys, CORPUS / "LiquidAI__lfm2-350m-fft.yaml", tmp_path, data)
    theirs = [{"messages": [{"role": ROLES[t["from"]], "content": t["value"]} for t in r["conversations"]]}
              for r in raw_rows(data)]
    assert code == 0 and recipe["task"] == "sft" and rows == theirs, said
    assert len(theirs[0]["messages"]) > 4 and {m["role"] for m in theirs[0]["messages"]} == {"user", "assistant"}
    assert recipe["data"]["source"] == str(tmp_path / "recipe-rows.jsonl")
    assert not_carried(said) == [], said  # the fields and roles are carried by the rows


def test_property_mappings_roles_and_a_dropped_system_turn(tmp_path, capsys):
    data = DATA / "basic_dataset.jsonl"
    path = config(tmp_path, type="chat_template", field_messages="conversations",
                  message_property_mappings={"role": "from", "content": "value"},
                  roles={"user": ["human"], "assistant": ["assistant"]}, drop_system_message=True)
    code, recipe, said, rows = imported(capsys, path, tmp_path, data)
    theirs = [{"messages": [{"role": ROLES[t["from"]], "content": t["value"]} for t in r["conversations"]
                            if t["from"] != "system"]} for r in raw_rows(data)]
    assert code == 0 and same(rows, theirs), said
    assert raw_rows(data)[0]["conversations"][0]["from"] == "system"  # the dropped turn was there


def test_the_older_sharegpt_type_writes_messages(tmp_path, capsys):
    data = DATA / "sharegpt_dataset.jsonl"
    code, recipe, said, rows = imported(capsys, config(tmp_path, type="sharegpt"), tmp_path, data)
    theirs = [{"messages": [{"role": ROLES[t["from"]], "content": t["value"]} for t in r["conversations"]]}
              for r in raw_rows(data)]
    assert code == 0 and recipe["task"] == "sft" and same(rows, theirs), said


def test_rows_already_finetune_s_are_read_as_they_are(tmp_path, capsys):
    """Messages of user / assistant roles under the default keys: nothing converted (the rows written are the
    import's shuffle of them), and the same with the shuffle off: the file itself."""
    data = DATA / "assistant_dataset.jsonl"
    code, recipe, said, rows = imported(capsys, config(tmp_path, type="chat_template"), tmp_path, data)
    assert code == 0 and "axolotl's chat_template rows written" not in said and same(rows, raw_rows(data)), said
    path = config(tmp_path, type="chat_template")
    path.write_text(path.read_text() + "shuffle_merged_datasets: false\n")
    code, recipe, said, rows = imported(capsys, path, tmp_path / "kept", data)
    assert code == 0 and rows is None and recipe["data"]["source"] == str(data), said


def alpaca_turns(row: dict, columns=("instruction", "input", "output")) -> list:
    """This test's reading of an instruct row: AlpacaPrompter's system text, the instruction and input, the answer."""
    system = ("Below is an instruction that describes a task, paired with an input that provides further context. "
              "Write a response that appropriately completes the request." if row.get(columns[1]) else
              "Below is an instruction that describes a task. Write a response that appropriately completes the "
              "request.")
    user = row[columns[0]] + (f"\n{row[columns[1]]}" if row.get(columns[1]) else "")
    return [{"role": "system", "content": system}, {"role": "user", "content": user},
            {"role": "assistant", "content": row[columns[2]]}]


def test_alpaca_rows_are_turns_and_its_prompt_text_is_said_not_carried(tmp_path, capsys):
    """axolotl's relora example trains ``type: alpaca``: its fixture rows become turns, and the one line on the type
    says the turns are carried and its '### Instruction:' text is not."""
    data = DATA / "alpaca.json"
    code, recipe, said, rows = imported(capsys, CORPUS / "llama-2__relora.yml", tmp_path, data)
    assert code == 0 and recipe["task"] == "sft" and same(rows, [{"messages": alpaca_turns(r)}
                                                                 for r in raw_rows(data)]), said
    lines = not_carried(said)
    assert len(lines) == 1 and "datasets.type=alpaca" in lines[0] and "### Instruction:" in lines[0], lines


def test_gpteacher_and_oasst_rows_by_their_columns(tmp_path, capsys):
    source = raw_rows(DATA / "alpaca.json")
    for kind, columns in (("gpteacher", ("instruction", "input", "response")),
                          ("oasst", ("INSTRUCTION", None, "RESPONSE"))):
        rows = [{columns[0]: r["instruction"], **({columns[1]: r["input"]} if columns[1] else {}),
                 columns[2]: r["output"]} for r in source]
        data = tmp_path / f"{kind}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        code, _, said, out = imported(capsys, config(tmp_path, type=f"{kind}:chatml"), tmp_path / kind, data)
        want = [{"messages": alpaca_turns(r, columns if columns[1] else (columns[0], "-", columns[2]))}
                for r in rows]
        assert code == 0 and same(out, want), said
        assert "its chatml prompt text" in not_carried(said)[0]


def test_completion_rows_become_text(tmp_path, capsys):
    data = tmp_path / "stories.jsonl"
    data.write_text("".join(json.dumps({"body": f"story {i}", "id": i}) + "\n" for i in range(3)))
    code, recipe, said, rows = imported(capsys, config(tmp_path, type="completion", field="body"), tmp_path, data)
    assert code == 0 and recipe["task"] == "clm" and same(rows, [{"text": f"story {i}"} for i in range(3)]), said


def dpo_rows(recipe: Path) -> list:
    """The rows of an imported recipe as the dpo task reads them: its loader, then its row reader."""
    from finetune.loading import load_recipe
    from finetune.tasks import dpo

    cfg = load_recipe(str(recipe), [])
    return [dpo.to_pair(row, cfg.data.system_prompt) for row in dpo.load_rows(cfg.data)]


def test_a_dpo_config_s_rows_are_pairs_the_dpo_task_reads(tmp_path, capsys):
    """axolotl's dpo fixture with its configured test's keys (``test_llama3_configured``: conversation, better /
    worse, speaker / text, human / agent roles) under ``rl: dpo``: the pairs the dpo task reads are the same turns."""
    data = DATA / "dpo_custom_assistant_dataset.jsonl"
    path = config(tmp_path, type="chat_template.default", rl="dpo", field_messages="conversation",
                  field_chosen="better", field_rejected="worse", message_field_role="speaker",
                  message_field_content="text", roles={"user": ["human"], "assistant": ["agent"]})
    code, recipe, said, rows = imported(capsys, path, tmp_path, data)
    assert code == 0 and recipe["task"] == "dpo", said
    roles = {"human": "user", "agent": "assistant"}
    for (prompt, chosen, rejected), raw in zip(dpo_rows(tmp_path / "recipe.yaml"), raw_rows(data)):
        assert prompt == [{"role": roles[t["speaker"]], "content": t["text"]} for t in raw["conversation"]]
        assert chosen == [{"role": "assistant", "content": raw["better"]["text"]}]
        assert rejected == [{"role": "assistant", "content": raw["worse"]["text"]}]
    assert not_carried(said) == [], said


def test_qwen2_s_dpo_example_reads_its_conversation_field(tmp_path, capsys):
    source = raw_rows(DATA / "dpo_assistant_dataset.jsonl")
    data = tmp_path / "pairs.jsonl"  # axolotl's fixture with the field the example names (conversation)
    data.write_text("".join(json.dumps({"conversation": r["messages"], **r}) + "\n" for r in source))
    code, recipe, said, rows = imported(capsys, CORPUS / "qwen2__dpo.yaml", tmp_path, data)
    want = [{"prompt": r["messages"], "chosen": [r["chosen"]], "rejected": [r["rejected"]]} for r in source]
    assert code == 0 and recipe["task"] == "dpo" and same(rows, want), said


def test_chatml_pairs_are_turns_and_their_text_is_said_not_carried(tmp_path, capsys):
    argilla = DATA / "dpo_argilla_chat_dataset.jsonl"
    code, _, said, rows = imported(capsys, config(tmp_path, type="chatml.argilla_chat", rl="dpo"), tmp_path, argilla)
    raw = raw_rows(argilla)[0]
    assert code == 0 and rows == [{"prompt": [raw["chosen"][0]], "chosen": [raw["chosen"][1]],
                                   "rejected": [raw["rejected"][1]]}], said
    data = tmp_path / "intel.jsonl"  # rows of Intel's orca pairs' columns, written here
    data.write_text(json.dumps({"system": "Be kind.", "question": "2+2?", "chosen": "4", "rejected": "5"}) + "\n" +
                    json.dumps({"system": "", "question": "3+3?", "chosen": "6", "rejected": "7"}) + "\n")
    code, _, said, rows = imported(capsys, config(tmp_path, type="llama3.intel", rl="dpo"), tmp_path / "i", data)
    assert code == 0 and same(rows, [
        {"prompt": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "2+2?"}],
         "chosen": [{"role": "assistant", "content": "4"}], "rejected": [{"role": "assistant", "content": "5"}]},
        {"prompt": [{"role": "user", "content": "3+3?"}],  # an empty system is none, as axolotl's
         "chosen": [{"role": "assistant", "content": "6"}], "rejected": [{"role": "assistant", "content": "7"}]}])
    assert len(not_carried(said)) == 1 and "writes llama3's text itself" in not_carried(said)[0], said


def test_a_row_missing_its_field_is_one_line_and_nothing_is_written(tmp_path, capsys):
    rows = raw_rows(DATA / "alpaca.json")
    del rows[1]["output"]
    data = tmp_path / "alpaca.json"
    data.write_text(json.dumps(rows))
    out = tmp_path / "out"
    out.mkdir()
    code, recipe, said, written = imported(capsys, CORPUS / "llama-2__relora.yml", out, data)
    assert code == 2 and written is None and recipe == {} and list(out.iterdir()) == [], said
    assert f"{data} row 2 has no output" in said and "Traceback" not in said
    # the control: the same rows with the field import
    rows[1]["output"] = "done"
    data.write_text(json.dumps(rows))
    assert imported(capsys, CORPUS / "llama-2__relora.yml", out, data)[0] == 0


def test_a_turn_missing_its_content_names_the_row_and_turn(tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]}) + "\n")
    code, _, said, written = imported(capsys, config(tmp_path, type="sharegpt"), tmp_path, data)
    assert code == 2 and written is None and f"{data} row 1 turn 1 has no value" in said, said


def test_a_type_not_converted_keeps_its_not_carried_line(tmp_path, capsys):
    """metharme (a prompt strategy of its own text) is not converted: its one line stays, the rows are as given."""
    data = DATA / "assistant_dataset.jsonl"
    code, recipe, said, rows = imported(capsys, config(tmp_path, type="metharme"), tmp_path, data)
    lines = not_carried(said)
    assert code == 0 and "rows written as" not in said and same(rows, raw_rows(data)), said
    assert len(lines) == 1 and "datasets.type=metharme" in lines[0] and "prompt strategy" in lines[0], lines


def test_a_row_of_another_shape_is_one_line(tmp_path, capsys):
    data = tmp_path / "argilla.jsonl"
    data.write_text(json.dumps({"chosen": "just text", "rejected": "more text"}) + "\n")
    code, _, said, written = imported(capsys, config(tmp_path, type="chatml.argilla_chat", rl="dpo"), tmp_path, data)
    assert code == 2 and written is None and f"{data} row 1 is not of axolotl's chatml.argilla_chat shape" in said
    assert "Traceback" not in said
