"""``training.offload``: DeepSpeed's ZeRO offload asked for in one setting, trained exactly, refused in one line.

The certificate (benchmarks/offload.py, its whole table in docs/memory.md): on the tiny chat model as a full
fine-tune, an offloaded run reads "equivalent" against the same run without offload at another micro-batch, and
one word of the data changed reads "differs"; under offload N = 4 against N = 1 is equivalent (all of a window's
micro-batches reach the step); a run resumed under offload ends bit-identical. The refusals run in this process up
to the point where the launch would be asked for, the environment restored after each."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

from benchmarks import offload as certificate
from finetune import engine_config, offload, startup
from finetune.cli import run_main
from finetune.config import TrainingConfig
from finetune.errors import ConfigError
from finetune.loading import load_recipe
from finetune.loop import Reporting
from finetune.registry import recipes_dir
from tests.helpers import SMALL, assert_one_error_line, tiny_chat_assets, tiny_pairs_assets

pytest.importorskip("deepspeed")
TRANSFORMER_RECIPES = ("clm-pydoc", "clm-lion-long", "sft-smollm2", "dpo-smollm2", "grpo-smollm2", "minilm-sentiment",
                       "minilm-sentiment-lora", "minilm-valence")


# ---------------------------------------------------------------------------------------------------------------
# the certificate's runs (subprocesses: each offloaded run starts DeepSpeed in its own process)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tiny_chat_assets()
    root = tmp_path_factory.mktemp("offload")
    made = {}

    def run(name, b, *overrides, **kw):
        if name not in made:
            made[name] = certificate.train(root / name, b, *overrides, **kw)
        return made[name]
    run.root = root
    return run


def test_optimizer_offload_takes_the_step_without_it_and_a_changed_word_differs(runs):
    plain = runs("plain", 4)
    offloaded = runs("optimizer", 2, *certificate.SAVING)
    assert "Processes: 1, DeepSpeed ZeRO-2 (optimizer offloaded to cpu" in certificate.said(offloaded)
    assert certificate.verdict(plain, offloaded).startswith("verdict: equivalent")
    twin = runs("one-word", 4, f"data.source={certificate.one_word_changed(runs.root)}")
    assert certificate.verdict(twin, offloaded).startswith("verdict: differs")  # the negative control


def test_a_run_resumed_under_offload_ends_bit_identical(runs):
    uninterrupted = runs("optimizer", 2, *certificate.SAVING)
    again = certificate.resumed(runs.root, uninterrupted, 2, *certificate.SAVING)
    assert certificate.same_bytes(uninterrupted, again)
    assert not certificate.same_bytes(runs("plain", 4), again)  # the check can fail: rounding differs from plain


def test_parameter_offload_accumulates_every_micro_batch_in_bf16(runs):
    """N = 4 against N = 1 under ZeRO-3 offload, bf16 autocast: a window's every micro-batch reaches the step."""
    bf16 = "training.mixed_precision=bf16"
    n4 = runs("parameters-N4", 1, bf16, "training.offload=parameters")
    n1 = runs("parameters-N1", 4, bf16, "training.offload=parameters")
    twin = runs("plain-bf16-b2", 2, bf16)
    assert certificate.verdict(n1, n4, "--floor", str(twin)).startswith("verdict: equivalent")


# ---------------------------------------------------------------------------------------------------------------
# what every shipped transformer recipe accepts, and what is refused


def test_every_shipped_transformer_recipe_accepts_each_level():
    assert set(TRANSFORMER_RECIPES) <= {p.stem for p in recipes_dir().glob("*.yaml")}
    for name in TRANSFORMER_RECIPES:
        for level in ("optimizer", "parameters"):
            assert load_recipe(name, [f"training.offload={level}"]).training.offload == level


@pytest.mark.parametrize("overrides, message", [
    (["training.optimizer=adamw8bit"], "training.offload: optimizer steps the fp32 optimizer on the host"),
    (["model.quantization=nf4", "training.offload=parameters"], "training.offload: parameters would partition"),
    (["training.offload_device=nvme"], "training.offload_path: offload_device nvme swaps into a folder"),
    (["training.offload_device=nvme", "training.offload_path=/no/such/folder"],
     "training.offload_path: /no/such/folder is not a folder"),
])
def test_what_offload_cannot_run_is_one_line_and_writes_nothing(capsys, tmp_path, overrides, message):
    tiny_chat_assets()
    out = tmp_path / "run"
    sets = [x for o in (*SMALL["sft-smollm2"], "training.offload=optimizer", *overrides) for x in ("--set", o)]
    with mock.patch.dict(os.environ):  # a refusal comes before the launch is asked for; restored regardless
        capsys.readouterr()
        code = run_main(["--recipe", "sft-smollm2", *sets, "--output-dir", str(out)])
        assert os.environ.get("ACCELERATE_USE_DEEPSPEED") is None
    assert code == 2
    assert_one_error_line(capsys.readouterr().err, message)
    assert not out.exists() or not any(out.iterdir())


def test_an_nvme_folder_this_process_cannot_write_is_refused(tmp_path):
    # asked of the OS as the process that swaps would ask (a root user writes anywhere: the answer is mocked)
    with mock.patch.object(os, "access", lambda path, mode: False):
        with pytest.raises(ConfigError, match=f"training.offload_path: {tmp_path} is not writable"):
            offload.check_nvme(str(tmp_path))


DEEPSPEED_LAUNCH = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}


@pytest.mark.parametrize("launch, level, refused", [
    ({"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none"}, "optimizer", "offloads nothing"),
    ({"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, "parameters", "offloads the optimizer"),
    ({"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, "optimizer", None),  # the same level: runs
    ({"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}, "none", None),  # the launch's own offload
])
def test_a_deepspeed_launch_must_offload_as_the_recipe_says(launch, level, refused):
    with mock.patch.dict(os.environ, {**DEEPSPEED_LAUNCH, **launch}):
        if refused:
            with pytest.raises(ConfigError, match=f"training.offload: {level}, but .* {refused}"):
                engine_config.check_engine_config(1.0, "stop", level)
        else:
            engine_config.check_engine_config(1.0, "stop", level)


def test_an_fsdp_launch_with_offload_is_refused():
    with mock.patch.dict(os.environ, {"ACCELERATE_USE_FSDP": "true"}):
        with pytest.raises(ConfigError, match="training.offload: optimizer runs through DeepSpeed.*FSDP"):
            engine_config.check_engine_config(1.0, "stop", "optimizer")


def test_the_launch_a_level_asks_for():
    o = TrainingConfig(offload="parameters").host_offload
    env = offload.environment(o)
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3" and env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "cpu"
    env = offload.environment(TrainingConfig(offload="optimizer").host_offload)
    assert env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2" and env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == "none"
    assert offload.launch_level({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}) == \
        "parameters"
    assert offload.launch_level({"zero_optimization": {"stage": 2}}) == "none"


@pytest.mark.parametrize("package, have, refused", [("deepspeed", "0.18.9", True), ("deepspeed", "0.19.0", False),
                                                     ("accelerate", "1.7.0", True)])
def test_what_exactness_needs_of_the_engine_is_pinned(package, have, refused):
    from importlib import metadata

    real = metadata.version
    with mock.patch.object(metadata, "version", lambda name: have if name == package else real(name)):
        if refused:
            with pytest.raises(ConfigError, match=f"(?i)training.offload: {package} {have} is installed"):
                offload.check_versions()
        else:
            offload.check_versions()


def test_the_python_api_points_to_the_command_line():
    with pytest.raises(ConfigError, match="training.offload: optimizer runs through DeepSpeed, which starts with "
                                          "the process: finetune run --offload optimizer"):
        startup.check_job(TrainingConfig(offload="optimizer"), Reporting())


def test_the_shipped_configs_are_the_levels():
    import yaml

    for level, path in offload.SHIPPED.items():
        config = yaml.safe_load((Path(certificate.ROOT) / path).read_text())["deepspeed_config"]
        asked = offload.environment(TrainingConfig(offload=level).host_offload)
        assert str(config["zero_stage"]) == asked["ACCELERATE_DEEPSPEED_ZERO_STAGE"]
        assert config["offload_param_device"] == asked["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"]
        assert config["offload_optimizer_device"] == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("name", TRANSFORMER_RECIPES)
def test_every_shipped_transformer_recipe_trains_under_offload(tmp_path, name):
    """Each one for two optimizer steps under --offload optimizer (ZeRO-2 on the host), in its own process."""
    import subprocess
    import sys

    tiny_pairs_assets()  # the chat recipes' model and data
    sets = [x for o in (*SMALL[name], "output.tracker=none", "output.save_model=false") for x in ("--set", o)]
    cmd = [sys.executable, "-m", "finetune", "run", "--recipe", name, *sets, "--max-steps", "2", "--offload",
           "optimizer", "--output-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=certificate.ENV, cwd=certificate.ROOT,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "DeepSpeed ZeRO-2 (optimizer offloaded to cpu" in proc.stdout and "done:" in proc.stdout


@pytest.mark.parametrize("available, refused", [(2**20, True), (2**40, False)])
def test_a_host_too_small_for_the_level_is_refused(available, refused):
    """Stage 3's check, with the model built: the level's host bytes (memory.host) against what is available."""
    import torch

    from finetune.memory.host import host_bytes

    model = torch.nn.Linear(512, 512)  # 1 MiB of fp32 weights: its offloaded state is several MiB
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert host_bytes(model, "optimizer", "adamw", 1) > 2**20
    with mock.patch("psutil.virtual_memory", lambda: mock.Mock(available=available)):
        if refused:
            with pytest.raises(ConfigError, match="training.offload: optimizer keeps .* in host memory and this "
                                                  "machine has 1.0 MiB available"):
                offload.check_host(model, config, "adamw", 1)
        else:
            offload.check_host(model, config, "adamw", 1)
        offload.check_host(model, {"zero_optimization": {"stage": 2}}, "adamw", 1)  # no offload: nothing asked


class Stop(Exception):
    """Raised in place of the process group: what start-up set before it is all a test looks at."""


@pytest.mark.parametrize("level, alone", [("none", False), ("optimizer", True)])
def test_only_the_deepspeed_offload_asks_for_gets_a_process_group_of_one(tmp_path, level, alone):
    """A launch's own DeepSpeed variables without a launcher (a test, a notebook) are not turned into a launcher's:
    the process group of one is for the DeepSpeed that training.offload asks for (once set, RANK and LOCAL_RANK would
    make every later Accelerator in the process a distributed one)."""
    from finetune import distributed

    cfg = load_recipe("clm-pydoc", [*SMALL["clm-pydoc"], f"training.offload={level}"])
    with mock.patch.dict(os.environ, {"ACCELERATE_USE_DEEPSPEED": "true"}), \
            mock.patch.object(distributed, "process_group", side_effect=Stop):
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            os.environ.pop(name, None)
        with pytest.raises(Stop):
            startup.check(cfg)
        assert ("LOCAL_RANK" in os.environ) == alone and ("RANK" in os.environ) == alone
