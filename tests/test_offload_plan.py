"""The planner's host offload (``finetune.memory.host``): its host bytes against DeepSpeed 0.19's own estimators, the
settings' order, and ``finetune plan``'s recommendation with a host that holds the exact route and one that does
not."""

import contextlib
import io
import re

import pytest
import torch

from finetune.memory import host, plan
from finetune.memory.cards import CARDS
from finetune.memory.step import Setting

ASSETS = "tests/assets"


def meta_model(name: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(f"{ASSETS}/{name}")
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)


class Addressed:
    """A meta parameter as DeepSpeed's ``model_to_params`` reads it: meta tensors all have data_ptr 0 (it would
    count them as one), so each parameter's address is its identity — a tied one still counts once."""

    def __init__(self, p):
        self.p = p

    def numel(self):
        return self.p.numel()

    def data_ptr(self):
        return id(self.p)


class Viewed:
    """A module as the estimators walk it: ``parameters`` and ``modules``."""

    def __init__(self, module):
        self.module = module

    def parameters(self, recurse=True):
        return [Addressed(p) for p in self.module.parameters(recurse=recurse)]

    def modules(self):
        return [Viewed(m) for m in self.module.modules()]


def estimated(model, level: str, factor: float) -> tuple[int, int]:
    """(host bytes, card bytes) DeepSpeed's estimator prints for ``level`` (one GPU), from its printed table."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if level == "optimizer":
            estimate_zero2_model_states_mem_needs_all_live(Viewed(model), additional_buffer_factor=factor)
        else:
            estimate_zero3_model_states_mem_needs_all_live(Viewed(model), additional_buffer_factor=factor)
    want = "offload_optimizer=OffloadDeviceEnum.cpu" if level == "optimizer" else \
        "offload_param=OffloadDeviceEnum.cpu, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=1"
    line = next(row for row in out.getvalue().splitlines() if row.rstrip().endswith(want))
    cpu, gpu = re.findall(r"([\d.]+)GB", line)
    return int(float(cpu) * 2**30), int(float(gpu) * 2**30)


@pytest.fixture(scope="module")
def models():
    return {name: meta_model(name) for name in ("llama-3.2-1b", "llama-3.1-8b")}


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3.1-8b"])
@pytest.mark.parametrize("level", host.LEVELS)
def test_host_bytes_match_deepspeeds_estimator_at_its_default_factor(models, name, level):
    ours = host.host_bytes(models[name], level, "adamw", 1)
    theirs, _ = estimated(models[name], level, 1.5)
    assert abs(ours / theirs - 1) < 0.15, (name, level, ours / 2**30, theirs / 2**30)


def test_the_1b_model_with_the_optimizer_offloaded_reads_as_the_issue_says(models):
    model = models["llama-3.2-1b"]
    assert estimated(model, "optimizer", 1.5) == pytest.approx((27.6 * 2**30, 2.3 * 2**30), rel=0.01)
    assert estimated(model, "optimizer", 1.0)[0] == pytest.approx(18.4 * 2**30, rel=0.01)
    # factor 1.0 counts only master + moments + gradients: DeepSpeed's staging and accumulation buffers are real
    assert host.host_bytes(model, "optimizer", "adamw", 1) / estimated(model, "optimizer", 1.0)[0] > 1.15


def test_a_host_formula_without_the_moments_fails_the_estimator_check(models, monkeypatch):
    model = models["llama-3.2-1b"]
    monkeypatch.setattr(host, "optimizer_state_bytes", lambda numels, name: 0)
    ours = host.host_bytes(model, "optimizer", "adamw", 1)
    assert abs(ours / estimated(model, "optimizer", 1.5)[0] - 1) > 0.15


def test_host_bytes_divide_over_the_processes_and_are_zero_without_a_level(models):
    model = models["llama-3.2-1b"]
    one, two = (host.host_bytes(model, "parameters", "adamw", n) for n in (1, 2))
    assert two == pytest.approx(one / 2, rel=1e-6)
    assert host.host_bytes(model, "none", "adamw", 1) == 0
    with pytest.raises(Exception, match="--offload"):
        host.host_bytes(model, "everything", "adamw", 1)


def test_offload_levels_keep_the_step_and_come_before_every_lever():
    exact = [Setting(host=level, checkpointing=c) for level in host.LEVELS for c in (False, True)]
    levers = [Setting(optimizer="adamw8bit"), Setting(lora=True), Setting(lora=True, base="nf4")]
    assert all(plan.keeps_step(s) for s in exact) and not any(plan.keeps_step(s) for s in levers)
    assert max(map(plan.rank, exact)) < min(map(plan.rank, levers))
    assert max(plan.rank(Setting(checkpointing=True, offload=True)), 0) < plan.rank(Setting(host="optimizer"))
    assert list(plan.COST).index("parameter offload") < list(plan.COST).index("8-bit AdamW")
    assert "--offload optimizer" in Setting(host="optimizer").flags()
    assert Setting(host="parameters").label == "parameter offload"


def test_every_card_with_a_peak_names_its_host_link():
    for name, card in CARDS.items():
        if card.half:
            assert card.link_bytes_per_second() > 10e9, name


def test_the_host_step_timing_says_what_it_timed():
    seconds, what = host.host_step_per_element()
    assert seconds > 0 and ("CPU Adam" in what or "AdamW" in what)


def test_link_bytes_grow_with_the_micro_batches_at_the_parameter_level():
    c = host.Counts(weights=4 * 10**6, trainable=10**6, element=4, state=8 * 10**6, largest=1000)
    one, four = (host.link_bytes(c, "parameters", 1, m) for m in (1, 4))
    assert four == 4 * one and host.link_bytes(c, "optimizer", 1, 1) == 2 * 4 * 10**6


def plan_1b(host_memory: str):
    from finetune import plan_command
    from finetune.loading import load_recipe
    from finetune.memory.records import Machine

    cfg = load_recipe("sft-smollm2", ["peft.enabled=false"])
    machine = Machine("16GiB", int(float(host_memory.rstrip("GiB")) * 2**30))
    return plan_command.plan_from_config(cfg, f"{ASSETS}/llama-3.2-1b", machine)


def test_the_1b_full_fine_tune_on_16gib_plans_offload_with_a_big_host_and_levers_with_a_small_one():
    """The feature's proof (two allocation-only plans of a 1.24 B model, about a minute each): with a 64 GiB host
    the exact route, with a 4 GiB one what it would need, and only then a lever."""
    pytest.importorskip("deepspeed")
    big = plan_1b("64GiB")
    assert big.fits and big.setting.host and plan.keeps_step(big.setting), big.note
    table = big.table()
    assert "--offload" in table and "8-bit AdamW is the cheapest" not in table
    assert big.host > 20 * 2**30 and big.step_peak < 16 * 2**30
    assert "time per optimizer step" in table and "host memory" in table
    assert "does not fit" not in big.note and "nothing that keeps" not in big.note
    small = plan_1b("4GiB")
    assert small.fits and not small.setting.host and not plan.keeps_step(small.setting), small.note
    why, cost = small.note.split(". Cost: ")
    assert "nothing that keeps the baseline's step fits" in why
    assert re.search(r"optimizer offload needs [\d.]+ GiB of host memory and at least [\d.]+ GiB on the card", why)
    assert small.host == 0 and "--offload" not in small.table().split("recommendation:")[1].splitlines()[0]


def test_host_memory_and_offload_flags_name_themselves():
    import argparse

    from finetune.errors import ConfigError
    from finetune.loading import load_recipe
    from finetune.memory.cards import parse_size
    from finetune.plan_command import machine_of

    with pytest.raises(ConfigError, match="--host-memory: got 'lots'"):
        parse_size("lots", "--host-memory")
    cfg = load_recipe("sft-smollm2", ["peft.enabled=false"])
    free = machine_of(argparse.Namespace(gpu="16GiB", host_memory="64GiB", offload=None), cfg)
    assert free.host_memory == 64 * 2**30 and free.offload is None  # each level weighed
    forced = load_recipe("sft-smollm2", ["peft.enabled=false", "training.offload=parameters"])
    assert machine_of(argparse.Namespace(gpu="16GiB", host_memory=None, offload="parameters"), forced).offload \
        == "parameters"
    assert machine_of(argparse.Namespace(gpu="16GiB", host_memory=None, offload="none"), cfg).offload == ""
