"""The certificate (`finetune compare`) right both ways on the recipe's own defaults (LoRA or full fine-tuning,
AdamW, cosine with warm-up, clipping), on the tiny chat model:

* layouts of the same run — (4, 1), (2, 2), (1, 4), a short last window included — are "equivalent";
* runs that keep the windows, the lr and the settings but change the numbers are "differs", naming the step: one
  training answer changed by one word, the short last window weighted as a plain micro-batch mean (Accelerate's
  ``accumulate()``), clipping active on one side only;
* the weights' tolerance, made wider for adaptive optimizers, still catches a small real difference.
"""

from __future__ import annotations

import json
import shutil

import pytest

from finetune.reproduce.compare import compare_runs
from finetune.reproduce.floor import FP32
from tests.helpers import SMALL, one_word_changed, recipe_runs, tail_weighted_as_mean, tiny_chat_assets

CLIP = 0.34  # the tiny model's grad norms are 0.3–0.5: some steps clip, some do not
BASE = [*SMALL["sft-smollm2"], "model.dropout=0", "data.limit=22", "training.effective_batch_size=4",
        "model.generate_prompts=0", "training.eval_at_start=false", "output.plots=false",
        f"training.max_grad_norm={CLIP}"]
FULL = ["peft.enabled=false", "training.learning_rate=5e-4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run ``name`` of the sft recipe at micro-batch ``b`` (N = 4 / b) with ``overrides``, once per module."""
    tiny_chat_assets()
    return recipe_runs(tmp_path_factory.mktemp("certificate"), "sft-smollm2", BASE)


def verdict(a, b):
    c = compare_runs(a, b)
    return c, c.report().splitlines()[-1]


def first_step_apart(a, b, key) -> int:
    """The first step at which the histories' ``key`` differ beyond its per-step tolerance (read directly)."""
    ha, hb = ([json.loads(line) for line in open(r / "history.jsonl")] for r in (a, b))
    rtol = {"loss": FP32["loss"], "grad_norm": FP32["grad norm"]}[key]
    return next((x["step"] for x, y in zip(ha, hb)
                 if abs(x[key] - y[key]) > rtol * max(abs(x[key]), abs(y[key]))), len(ha) + 1)


@pytest.mark.parametrize("name, extra", [("lora", []), ("full", FULL)])
def test_layouts_of_the_same_run_are_equivalent(runs, name, extra):
    big = runs(f"{name}-4", 4, *extra)
    for b in (2, 1):
        c, line = verdict(big, runs(f"{name}-{b}", b, *extra))
        assert c.equivalent, c.report()
        assert line.startswith("verdict: equivalent — rests on settings; samples and lr at all 6 steps; the "
                               "content of all 6 windows; token counts at 6 steps; loss ≤ "
                               "1e-04; grad norm ≤ 1e-03; clipping; weights L2 "), line
    history = [json.loads(line) for line in open(big / "history.jsonl")]
    assert history[-1]["samples"] == 2 and any(h["grad_norm"] > CLIP for h in history)  # a tail; clipping active


def test_one_word_in_one_answer_differs_at_its_step(runs, tmp_path):
    theirs = runs("lora-word", 2, f"data.source={one_word_changed(tmp_path)}")
    c, line = verdict(runs("lora-4", 4), theirs)
    step = min(first_step_apart(runs("lora-4", 4), theirs, key) for key in ("loss", "grad_norm"))
    assert not c.equivalent and step > 1  # the steps before the changed answer's window are the same
    # the content hash names the step the numbers first part at, read independently from the histories
    assert line.startswith(f"verdict: differs — window content: step {step} "), c.report()
    ok = {name: mark for name, mark, _, _ in c.checks}
    assert ok["window samples"] and ok["lr schedule"] and ok["settings"]  # the same samples, by index
    assert ok["window content"] is False and ok["loss curve"] is False, c.report()  # the numbers moved too


def test_a_tail_weighted_as_a_micro_batch_mean_differs_at_the_last_step(runs, monkeypatch):
    """Accelerate's accumulate() divides every micro-batch by N: the short last window (one micro-batch of 2 at
    N = 2) gets half its gradient. Only that window is mis-weighted here; the others are exact."""
    tail_weighted_as_mean(monkeypatch)
    c, line = verdict(runs("lora-4", 4), runs("lora-tail", 2))
    assert not c.equivalent
    assert line.startswith("verdict: differs — grad norm:") and "first above at step 6:" in line, c.report()


def test_clipping_on_one_side_only_differs_at_the_first_clipped_step(runs):
    theirs = runs("lora-noclip", 2, "training.max_grad_norm=null")
    c, line = verdict(runs("lora-4", 4), theirs)
    history = [json.loads(line) for line in open(theirs / "history.jsonl")]
    first = next(h["step"] for h in history if h["grad_norm"] > CLIP)
    assert not c.equivalent
    assert line.startswith(f"verdict: differs — clipping: step {first}: scaled by "), c.report()
    assert line.endswith(f"vs not clipped (max_grad_norm {CLIP} vs None)")


def test_the_adaptive_weight_tolerance_still_catches_a_small_difference(runs, tmp_path):
    """Negative twin of the wider (relative L2) weight tolerance: every weight moved by 3e-4 of itself, nothing else
    changed, reads "differs" on the weights."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "nudged"
    shutil.copytree(runs("lora-2", 2), copy)
    path = copy / "model" / "adapter_model.safetensors"
    save_file({k: v * (1 + 3e-4) for k, v in load_file(str(path)).items()}, str(path))
    c, line = verdict(runs("lora-4", 4), copy)
    assert line.startswith("verdict: differs — weights: relative L2 3.0"), c.report()


def moved(weights: dict, count: int, step: float, seed: int = 0) -> dict:
    """``weights`` with ``count`` elements, drawn at random over all tensors, each moved by ``step``."""
    import torch

    flat = torch.cat([v.flatten() for v in weights.values()])
    flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed))[:count]] += step
    out, start = {}, 0
    for name, v in weights.items():
        out[name] = flat[start:start + v.numel()].view_as(v).clone()
        start += v.numel()
    return out


def test_a_few_elements_a_step_apart_are_rounding_and_many_are_not(runs, tmp_path):
    """AdamW sends an element whose gradient is near zero a full step either way on rounding, so the weights' relative
    L2 leaves out the FLIP_SHARE largest element differences: that many elements moved, 10× the tolerance in the L2 of
    every element, read "equivalent"; ten times as many, each moved the same, "differs" (the negative twin)."""
    import math

    from safetensors.torch import load_file, save_file

    from finetune.reproduce.weight_diff import FLIP_SHARE

    base = runs("full-2", 2, *FULL)
    path = base / "model" / "model.safetensors"
    weights = load_file(str(path))
    k = int(FLIP_SHARE * sum(v.numel() for v in weights.values()))
    assert k >= 2, k
    norm = math.sqrt(sum(float(v.double().square().sum()) for v in weights.values()))
    step = 10 * FP32["weights L2"] * norm / math.sqrt(k)
    for count, equivalent in ((k, True), (10 * k, False)):
        copy = tmp_path / f"moved-{count}"
        shutil.copytree(base, copy)
        save_file(moved(weights, count, step), str(copy / "model" / "model.safetensors"))
        c, line = verdict(runs("full-4", 4, *FULL), copy)
        assert c.equivalent == equivalent, c.report()
        assert c.measured["weights largest"] > 10 * FP32["weights L2"]  # the moved elements are there
        if not equivalent:
            assert line.startswith("verdict: differs — weights: relative L2 "), line
