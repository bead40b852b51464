"""A TRL ``SFTTrainer`` baseline at TRL's defaults — bf16 autocast and gradient checkpointing — reproduced through
the CLI only: ``finetune import`` → ``finetune run --batch-size 2`` and its twin at ``--batch-size 1`` →
``finetune compare BASELINE RUN --floor TWIN``, full fine-tuning and LoRA. The twin rounds as TRL does
(``training.fp32_grad_sums=false``: each step's weight gradients rounded to bf16), so the floor measured between the
two on this machine is the rounding the tools differ by, and the baseline is held to 4× it.

Negative twin: the same reproduction on data with one answer changed by one word reads "differs"."""

from __future__ import annotations

import json

import pytest

from finetune.cli import main
from tests.helpers import tiny_chat_assets
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
