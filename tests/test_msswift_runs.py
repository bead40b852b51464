"""An ms-swift run (``swift sft`` 4.6.0, LoRA, fp32, on the tiny chat model; examples/msswift/make_baselines.sh),
reproduced through ``finetune reproduce`` at micro-batch 1: equivalent, and its one-word twin differs; swift's own
settings are carried or named."""

from __future__ import annotations

import json

import pytest

from tests.helpers import (
    ROOT,
    one_torch_thread,  # noqa: F401  (the module's fixture, by name)
)
from tests.helpers import cli_in_process as cli

RUN = ROOT / "tests" / "assets" / "msswift" / "sft-lora"
LF = ROOT / "tests" / "assets" / "llamafactory"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reproduce(capsys, out, data) -> tuple[int, str]:
    code, said = cli(capsys, "reproduce", RUN, "--model", LF / "model", "--data", data, "--batch-size", 1, "-o", out,
                     "--set", "model.generate_prompts=0")
    return code, said


def test_an_msswift_run_is_reproduced_and_its_one_word_twin_differs(tmp_path, capsys):
    code, said = reproduce(capsys, tmp_path / "same", LF / "data" / "chat.jsonl")
    verdict = next(line for line in said.splitlines() if line.startswith("verdict:"))
    assert code == 0 and verdict.startswith("verdict: equivalent"), said[-3000:]
    assert "lr schedule      identical at all 5 logged steps" in said  # its lr read back one step
    for line in ("args.json: template: chatml renders ChatML", "args.json: loss_scale", "adapters' start: replayed"):
        assert line in said, line
    rows = [json.loads(line) for line in open(LF / "data" / "chat.jsonl")]
    answer = next(m for m in rows[3]["messages"] if m["role"] == "assistant")
    answer["content"] = answer["content"].replace(" is ", " was ", 1)
    changed = tmp_path / "chat.jsonl"
    changed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, said = reproduce(capsys, tmp_path / "word", changed)
    verdict = next(line for line in said.splitlines() if line.startswith("verdict:"))
    assert code == 1 and verdict.startswith("verdict: differs"), verdict


def test_what_it_does_that_finetune_does_not_is_named(tmp_path, capsys):
    args = json.loads((RUN / "args.json").read_text())
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "args.json").write_text(json.dumps({**args, "dataset_shuffle": True, "truncation_strategy": "split"}))
    (folder / "logging.jsonl").write_text((RUN / "logging.jsonl").read_text())
    code, said = cli(capsys, "import", folder, "--model", LF / "model", "-o", tmp_path / "r.yaml")
    assert code == 0, said
    assert "not carried: dataset_shuffle=True — ms-swift shuffles the rows once" in said, said
    assert "not carried: truncation_strategy=split" in said, said
