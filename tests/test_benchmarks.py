"""The benchmarks' claims, checked on small cases: finetune takes the big-batch step, Accelerate's accumulate() does
not; the memory benchmark's low-precision rows count what they say."""

import importlib.util

import pytest
import torch

from tests.helpers import ROOT, tiny_chat_assets

pytestmark = pytest.mark.usefixtures("frozen_heap")  # the benchmarks' gc passes walk only this module's objects


def _benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _equivalence():
    return _benchmark("equivalence")


def test_equivalence_benchmark_core():
    eq = _equivalence()
    cases = ["MLP, tail window 16/16/5", "GPT-2, padded lengths 2–12, N = 3"]
    res = eq.measure(torch.float64, only=cases, tools=["Accelerate accumulate()", "finetune"])
    for case in cases:
        assert res[case]["finetune"]["weights"] <= 1e-12, (case, res[case])
        assert res[case]["Accelerate accumulate()"]["weights"] > 1e-3, (case, res[case])


def _memory():
    return _benchmark("memory")


def test_low_precision_benchmark_rows_and_json_on_a_tiny_model():
    """The low-precision section of benchmarks/memory.py on the tiny chat model (its SmolLM2 rows take minutes): every
    row measured, the fixed part counted right, and the --quick JSON's three keys (the TRL ratios None without trl)."""
    pytest.importorskip("bitsandbytes")
    memory = _memory()
    record, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # as the benchmark runs: tiny ops on a second thread of a busy machine wait for a core
    try:
        memory.low_precision_section(record, 1, 48, 1, 2, 1,
                                     base=[f"model.name_or_path={tiny_chat_assets()['model']}"])
    finally:
        torch.set_num_threads(threads)
    rows = record["low_precision"]["rows"]
    assert list(rows) == list(memory.LOW_PRECISION_ROWS)
    lora, bf16, nf4, full, eight = (rows[k] for k in ("fp32 base + LoRA", "bf16 base + LoRA", "NF4 base + LoRA",
                                                      "full, AdamW", "full, AdamW8bit"))
    assert all(r["peak_mb"] > r["fixed_mb"] > 0 and r["step_s"] > 0 for r in rows.values())
    # AdamW keeps two fp32 moments per trainable weight (and a step count per tensor): twice the gradients; the
    # 8-bit state is smaller
    assert lora["optimizer_mb"] == pytest.approx(2 * lora["gradients_mb"], rel=1e-2)
    assert full["optimizer_mb"] == pytest.approx(2 * full["gradients_mb"], rel=1e-2)
    assert eight["optimizer_mb"] < 0.9 * full["optimizer_mb"] and eight["gradients_mb"] == full["gradients_mb"]
    # the same adapters on every base; a bf16 base holds its frozen weights in half the bytes
    assert lora["gradients_mb"] == bf16["gradients_mb"] == nf4["gradients_mb"]
    frozen_fp32 = lora["weights_mb"] - lora["gradients_mb"]
    assert bf16["weights_mb"] == pytest.approx(lora["gradients_mb"] + frozen_fp32 / 2, rel=1e-3)  # buffers stay fp32
    assert nf4["weights_mb"] < lora["weights_mb"]
    assert record["qlora_fixed_ratio"] == pytest.approx(nf4["fixed_mb"] / lora["fixed_mb"]) and \
        record["qlora_fixed_ratio"] < 1
    try:
        import trl  # noqa: F401
    except ImportError:
        assert record["qlora_peak_vs_trl"] is None and record["qlora_speed_vs_trl"] is None
    else:
        assert record["qlora_peak_vs_trl"] > 0 and record["qlora_speed_vs_trl"] > 0
        assert [len(runs) for runs in record["trl"]["tokens_per_s_wall_cpu"].values()] == [1, 1]


def test_weight_bytes_count_the_4bit_quantization_state():
    """A 4-bit weight's block scales are attributes of the weight, not parameters: counted, or the NF4 rows' fixed
    part would come out too small (the control: parameters alone miss them)."""
    pytest.importorskip("bitsandbytes")
    memory = _memory()
    model, _, _ = memory.sft_model([f"model.name_or_path={tiny_chat_assets()['model']}", "model.quantization=nf4"])
    scales = memory.tensor_bytes(memory.quant_state_tensors(model))
    assert scales > 0
    held = memory.tensor_bytes([*model.parameters(), *model.buffers()])
    assert memory.weight_bytes(model) == held + scales > held


def test_grpo_trl_benchmark_core_on_a_tiny_model(tmp_path):
    """benchmarks/grpo_trl.py's measurement on the tiny Llama, one case (two optimizer steps per generation batch,
    steps_per_generation ≠ N) at a small size: finetune's (b, N) takes its (b·N, 1) step for bnpo; TRL's
    bnpo, which normalises each micro-batch by its own tokens, is told apart on the same uneven completions (the
    negative control)."""
    pytest.importorskip("trl")
    grpo_trl = _benchmark("grpo_trl")
    path = grpo_trl.smollm2_path(True, tmp_path)
    res = grpo_trl.measure(path, tmp_path, 2, 2, 2, 6, 0.1, loss_types=("bnpo",), case_names=("spg ≠ N",),
                           memory=False, log=lambda *_: None)
    lengths = res["lengths"]["spg ≠ N"]
    assert len(set(lengths)) > 1, lengths  # uneven completions, or bnpo's reductions would agree
    e = res["errors"]
    assert e[("spg ≠ N", "bnpo", "finetune")] <= 1e-5, e
    assert e[("spg ≠ N", "bnpo", "TRL GRPOTrainer")] > 1e-3, e
    assert res["tokens_per_s"]["finetune"] > 0 and res["tokens_per_s"]["TRL GRPOTrainer"] > 0
