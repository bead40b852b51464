"""The README's equivalence claim, checked: finetune takes the big-batch step, Accelerate's accumulate() does not."""

import importlib.util

import torch

from tests.helpers import ROOT


def _equivalence():
    spec = importlib.util.spec_from_file_location("equivalence", ROOT / "benchmarks" / "equivalence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_equivalence_benchmark_core():
    eq = _equivalence()
    cases = ["MLP, tail window 16/16/5", "GPT-2, padded lengths 2–12, N = 3"]
    res = eq.measure(torch.float64, only=cases, tools=["Accelerate accumulate()", "finetune"])
    for case in cases:
        assert res[case]["finetune"]["weights"] <= 1e-12, (case, res[case])
        assert res[case]["Accelerate accumulate()"]["weights"] > 1e-3, (case, res[case])
