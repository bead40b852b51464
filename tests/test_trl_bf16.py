"""A TRL ``SFTTrainer`` baseline at TRL's defaults — bf16 autocast and gradient checkpointing — reproduced through
the CLI only: ``finetune import`` → ``finetune run --batch-size 2`` and its twin at ``--batch-size 1`` →
``finetune compare BASELINE RUN --floor TWIN``, full fine-tuning and LoRA. The twin rounds as TRL does
(``training.fp32_grad_sums=false``: each step's weight gradients rounded to bf16), so the floor measured between the
two on this machine is the rounding the tools differ by, and the baseline is held to 4× it.

Negative twin: the same reproduction on data with one answer changed by one word reads "differs"."""

from __future__ import annotations

import json
import re

import pytest

from finetune.cli import main
from tests.helpers import ROOT, tiny_chat_assets
from tests.helpers import cli_in_process as cli
from tests.test_trl_baseline import ROWS, prompt_completion, train_trl


def reproduce_bf16(tmp, baseline, data, b: int, name: str, *sets) -> str:
    recipe = tmp / f"{baseline.name}.yaml"
    if not recipe.exists():
        assert main(["import", str(baseline), "--recipe", "sft-smollm2", "--data", data, "--model",
                     tiny_chat_assets()["model"], "-o", str(recipe)]) == 0
    out = tmp / name
    assert main(["run", "--recipe", str(recipe), "--batch-size", str(b), "--output-dir", str(out), "--set",
                 "model.generate_prompts=0", "--set", "output.plots=false", "--set", "output.tracker=none",
                 *[x for s in sets for x in ("--set", s)]]) == 0
    return str(out)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_bf16_trl_baseline_with_checkpointing_is_equivalent_and_one_word_differs(tmp_path, lora, capsys):
    data = prompt_completion(tmp_path / "rows.jsonl")
    baseline = tmp_path / ("trl-bf16-lora" if lora else "trl-bf16-full")
    train_trl(baseline, data, lora, bf16=True)
    recipe_out = capsys.readouterr().out
    mine = reproduce_bf16(tmp_path, baseline, data, 2, "mine")
    imported = (tmp_path / f"{baseline.name}.yaml").read_text()
    assert "mixed_precision: bf16" in imported and "gradient_checkpointing: true" in imported, recipe_out
    # the twin rounds as TRL does (each step's weight gradients rounded to bf16): the floor is the rounding the two
    # tools differ by
    twin = reproduce_bf16(tmp_path, baseline, data, 1, "twin", "training.fp32_grad_sums=false")
    capsys.readouterr()
    code = main(["compare", str(baseline), mine, "--floor", twin])
    out = capsys.readouterr().out
    verdict = out.strip().splitlines()[-1]
    assert code == 0 and verdict.startswith("verdict: equivalent") and "floor measured on twin" in verdict, out

    rows = [json.loads(line) for line in open(data)]
    answer = rows[ROWS // 2]["completion"][0]
    answer["content"] = answer["content"].replace(" is ", " was ", 1)
    changed = tmp_path / "word.jsonl"
    changed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    other = reproduce_bf16(tmp_path, baseline, data, 2, "word", f"data.source={changed}")
    # its own twin: the floor is measured for the run under test
    other_twin = reproduce_bf16(tmp_path, baseline, data, 1, "word-twin", f"data.source={changed}",
                                "training.fp32_grad_sums=false")
    capsys.readouterr()
    code = main(["compare", str(baseline), other, "--floor", other_twin])
    out = capsys.readouterr().out
    assert code == 1 and out.strip().splitlines()[-1].startswith("verdict: differs — "), out


TWO = ROOT / "tests" / "assets" / "trl-2proc"
VARIED = TWO / "varied.jsonl"  # examples/trl-multiprocess/varied_chats.py
NUMBERS = ("loss curve", "grad norm", "weights")  # the layers the rounding band judges


def verdict(said: str) -> str:
    return next((line for line in said.splitlines() if line.startswith("verdict:")), said[-2000:])


def layers(said: str) -> dict:
    """Each layer of compare's report → its mark (ok, DIFF, …)."""
    marks = {}
    for line in said.splitlines():
        found = re.match(r"^(\S+)\s+(\S+(?: \S+)*?)\s{2,}", line)
        if found:
            marks[found.group(2)] = found.group(1)
    return marks


def test_a_two_process_bf16_trl_run_on_varied_lengths_is_equivalent_and_one_word_lr_and_warmup_differ(tmp_path,
                                                                                                        capsys):
    """TRL SFTTrainer on 2 processes, bf16 autocast + gradient checkpointing, 4 per device × 2 accumulation × 2 =
    16, 48 chats of 32–138 tokens (``tests/assets/trl-2proc/sft-bf16-varied``, made by
    examples/trl-multiprocess/train_sft.py; the command is in its docstring), reproduced on one process at
    micro-batch 2: each micro-batch padded as its baseline micro-batch was; the twin replays the baseline's rounding
    whole (its micro-batch of 4, its padding, weight-gradient sums rounded to bf16 per micro-batch). Both
    directions: the reproduction reads equivalent; the same with one word of one answer changed, the lr 2 % higher,
    or no warm-up, reads differs — and by a layer the rounding band judges (the loss, grad norm or weights), not
    only the settings or the lr logged."""
    def reproduce(name, *sets, data=VARIED):
        return cli(capsys, "reproduce", TWO / "sft-bf16-varied", "--model", tiny_chat_assets()["model"], "--data",
                   data, "--batch-size", 2, "-o", tmp_path / name, "--set", "model.generate_prompts=0", "--set",
                   "output.plots=false", *[x for s in sets for x in ("--set", s)])

    code, said = reproduce("same")
    assert code == 0 and verdict(said).startswith("verdict: equivalent"), said
    assert "training.replay_padding" in said and "[4, 1]" in said, said  # import said it
    # the twin replays the baseline's rounding whole: its micro-batch, its padding, its bf16-rounded gradient sums
    assert "floor measured on twin at micro-batch 4, padded as the baseline's micro-batches of 4, weight-gradient " \
           "sums rounded per micro-batch" in said, said
    assert all(layers(said)[k] == "ok" for k in NUMBERS), said

    rows = [json.loads(line) for line in open(VARIED)]
    answer = rows[20]["messages"][1]
    answer["content"] = answer["content"].replace(" is ", " was ", 1)
    word = tmp_path / "word.jsonl"
    word.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, sets, data in (("word", (), word), ("lr", ("training.learning_rate=0.00102",), VARIED),
                             ("warm-up", ("training.warmup_steps=0",), VARIED)):
        code, said = reproduce(name, *sets, data=data)
        marks = layers(said)
        assert code == 1 and verdict(said).startswith("verdict: differs"), (name, said)
        assert any(marks[k] == "DIFF" for k in NUMBERS), (name, said)


def test_a_baseline_padded_to_a_multiple_is_replayed_at_that_multiple(tmp_path, capsys):
    """The same run with TRL's collator padding each micro-batch to a multiple of 16
    (``tests/assets/trl-2proc/sft-bf16-varied-pad16``): import carries the multiple, the reproduction pads to it and
    reads equivalent."""
    code, said = cli(capsys, "reproduce", TWO / "sft-bf16-varied-pad16", "--model", tiny_chat_assets()["model"],
                     "--data", VARIED, "--batch-size", 2, "-o", tmp_path / "r", "--set", "model.generate_prompts=0",
                     "--set", "output.plots=false")
    assert code == 0 and verdict(said).startswith("verdict: equivalent"), said
    assert "[4, 16]" in said and "a multiple of 16 (pad_to_multiple_of)" in said, said
    assert "padded as the baseline's micro-batches of 4, to a multiple of 16, weight-gradient sums" in said, said
