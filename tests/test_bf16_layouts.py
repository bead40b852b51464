"""bf16 layouts of one run (docs/exact-steps.md#bf16): under bf16 autocast finetune pads every micro-batch to its
window's longest sample and sums each trainable linear layer's weight gradient in fp32, so (4, 1) and (2, 2) of the
sft recipe on the tiny chat model (unpacked, plain loss head) take the same steps to fp32 rounding, and (1, 4) reads
"equivalent" at the fp32 tolerances.

Negative twins: the same layouts without the two (``fp32_grad_sums=false``, ``pad_to_window=false``) are more than
10× further apart, and a run with one answer changed by one word reads "differs" with the fixes on."""

from __future__ import annotations

import pytest
import torch

from finetune.models import precision
from finetune.reproduce.compare import compare_runs
from finetune.steps import pad_to_window
from tests.helpers import SMALL, cpu_kernels, one_word_changed, recipe_runs, tiny_chat_assets

BASE = [*SMALL["sft-smollm2"], "model.dropout=0", "data.limit=22", "training.effective_batch_size=4",
        "model.generate_prompts=0", "training.eval_at_start=false", "output.plots=false",
        "training.mixed_precision=bf16", "training.max_grad_norm=0.34", "peft.enabled=false",
        "training.learning_rate=5e-4", "training.packing=false", "training.chunked_loss=false"]
UNFIXED = ["training.fp32_grad_sums=false", "training.pad_to_window=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tiny_chat_assets()
    return recipe_runs(tmp_path_factory.mktemp("bf16"), "sft-smollm2", BASE)


@pytest.mark.parametrize("b", [2, 1])
def test_bf16_layouts_of_the_same_run_are_equivalent(runs, b):
    c = compare_runs(runs("fixed-4", 4), runs(f"fixed-{b}", b))
    assert c.equivalent, (cpu_kernels(), c.report())


def test_the_fixes_take_the_layout_noise_to_fp32_rounding(runs):
    """(4, 1) against (2, 2): the same grad norms with the fixes (measured 0 apart), more than 1e-5 apart without
    (measured 1.4e-4): the bf16-rounded partial sums and the per-micro-batch padding were the noise."""
    fixed = compare_runs(runs("fixed-4", 4), runs("fixed-2", 2)).measured
    unfixed = compare_runs(runs("unfixed-4", 4, *UNFIXED), runs("unfixed-2", 2, *UNFIXED)).measured
    assert fixed["grad norm"] <= 1e-6 and fixed["loss curve"] <= 1e-6, fixed
    assert unfixed["grad norm"] > 1e-5 and unfixed["grad norm"] > 10 * fixed["grad norm"], (unfixed, fixed)


def test_one_word_in_one_answer_still_differs_in_bf16(runs, tmp_path):
    data = one_word_changed(tmp_path)
    # against the floor measured on a twin ((2, 2): 0 apart here), not the looser assumed bf16 floor
    c = compare_runs(runs("fixed-4", 4), runs("word-2", 2, f"data.source={data}"), twin=runs("fixed-2", 2))
    assert c.verdict.kind == "differs" and c.first_difference.startswith("window content: step "), c.report()
    by_name = {name: ok for name, ok, _, _ in c.checks}
    assert by_name["loss curve"] is False or by_name["grad norm"] is False, c.report()  # against the twin's floor
    assert "first above at step 1:" not in c.report()  # the steps before its window agree


def test_fp32_grad_sums_keep_autocast_forward_and_input_gradient():
    """The switched layer computes autocast's forward and input gradient to the bit, and the fp32 sum of its
    bf16 products as the weight gradient: two micro-batches add up to the whole batch's to fp32 rounding, where
    autocast's rounded partial sums are ~1e-3 apart (the negative control)."""
    torch.manual_seed(0)
    x = torch.randn(8, 5, 32)

    def layer(switch: bool):
        torch.manual_seed(1)
        m = torch.nn.Linear(32, 16)
        if switch:
            assert precision.sum_weight_grads_in_fp32(m) == 1
        return m

    def grads(switch: bool, parts: int):
        m, inputs = layer(switch), x.clone().requires_grad_()
        outs = []
        for part in inputs.chunk(parts):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = m(part)
            (out.float() ** 2).sum().backward()
            outs.append(out)
        return torch.cat(outs), inputs.grad, m.weight.grad

    (y0, gx0, _), (y1, gx1, _) = grads(False, 1), grads(True, 1)
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1), cpu_kernels()
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(grads(True, 4)[2], grads(True, 1)[2]) < 1e-6
    assert rel(grads(False, 4)[2], grads(False, 1)[2]) > 1e-4


def test_pad_to_window_pads_to_the_longest_with_masked_tokens():
    from accelerate import Accelerator

    short = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long),
             "labels": torch.ones(2, 3, dtype=torch.long), "pairs": 2}
    long = {k: (torch.ones(2, 5, dtype=torch.long) if torch.is_tensor(v) else v) for k, v in short.items()}
    a, b = pad_to_window(Accelerator(cpu=True), [short, long])
    assert a["input_ids"].shape == (2, 5) and torch.equal(b["input_ids"], long["input_ids"])
    assert a["attention_mask"][:, 3:].eq(0).all() and a["labels"][:, 3:].eq(-100).all() and a["pairs"] == 2
    assert pad_to_window(Accelerator(cpu=True), [{"x": torch.ones(2, 3)}])[0]["x"].shape == (2, 3)  # not text
