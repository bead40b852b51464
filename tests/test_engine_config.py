"""Bad launch configs (DeepSpeed, FSDP): every engine setting the launch hands the processes is checked in start-up's
first stage, before anything is written — one ``error:`` line naming the key, exit 2, no traceback, and the output
directory as it was. The shipped configs pass the same checks (the control), and only start-up refuses an engine
config (a guard with a planted violation)."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from finetune.cli import main
from finetune.errors import ConfigError
from tests.helpers import ACCELERATE, ENV, ROOT, TINY, assert_one_error_line

DS = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
FSDP = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
# what `accelerate launch --config_file` puts in each process's environment → the key the one line must name
BAD_ENV = {
    "zero_stage 7": ({**DS, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "7"}, "zero_optimization.stage is 7"),
    "zero_stage not a number": ({**DS, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "two"}, "deepspeed_config.zero_stage"),
    "offload_optimizer_device gpu": ({**DS, "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "gpu"},
                                     "zero_optimization.offload_optimizer.device is 'gpu'"),
    "offload_param_device disk": ({**DS, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                                   "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "disk"},
                                  "zero_optimization.offload_param.device is 'disk'"),
    "gradient_clipping a word": ({**DS, "ACCELERATE_GRADIENT_CLIPPING": "lots"}, "deepspeed_config.gradient_clipping"),
    "gradient_accumulation_steps 4": ({**DS, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
                                      "gradient_accumulation_steps is 4"),
    "fsdp_sharding_strategy": ({**FSDP, "FSDP_SHARDING_STRATEGY": "SHARD_EVERYTHING"},
                               "fsdp_config.fsdp_sharding_strategy is 'SHARD_EVERYTHING'"),
    "fsdp_version 7": ({**FSDP, "FSDP_VERSION": "7"}, "fsdp_config.fsdp_version is '7'"),
    "fsdp_auto_wrap_policy": ({**FSDP, "FSDP_AUTO_WRAP_POLICY": "EVERY_LAYER"}, "fsdp_config.fsdp_auto_wrap_policy"),
    "fsdp_state_dict_type": ({**FSDP, "FSDP_STATE_DICT_TYPE": "PICKLE"}, "fsdp_config.fsdp_state_dict_type"),
    "fsdp_backward_prefetch": ({**FSDP, "FSDP_BACKWARD_PREFETCH": "SOMETIMES"}, "fsdp_config.fsdp_backward_prefetch"),
}
# a DeepSpeed config file (deepspeed_config_file in the accelerate config) → the key the line must name
BAD_FILES = {
    "bucket size a word": ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}},
                           "zero_optimization.reduce_bucket_size is 'big'"),
    "unknown zero key": ({"zero_optimization": {"stage": 2, "overlap_everything": True}},
                         "zero_optimization.overlap_everything"),
    "stage 5": ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage is 5"),
    "micro-batch a word": ({"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": "eight"},
                           "train_micro_batch_size_per_gpu is 'eight'"),
    "its own optimizer": ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam"}},
                          "remove its 'optimizer' section"),
    "not JSON": ("{stage: 2", "deepspeed config"),
}


def refused(capsys, out: Path) -> str:
    """Run the tiny recipe into ``out`` in this process; return its stderr after asserting a refusal (exit 2)."""
    capsys.readouterr()
    assert main(["run", "--recipe", TINY, "--output-dir", str(out), "--max-steps", "1"]) == 2
    return capsys.readouterr().err


def untouched(out: Path) -> bool:
    return not out.exists() or not any(out.iterdir())


@pytest.fixture
def launch_env(monkeypatch):
    pytest.importorskip("deepspeed")
    for key in [k for k in ENV if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(key, raising=False)

    def set_env(env: dict):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
    return set_env


@pytest.mark.parametrize("case", sorted(BAD_ENV))
def test_a_bad_launch_setting_is_one_line_before_anything_is_written(launch_env, capsys, tmp_path, case):
    env, key = BAD_ENV[case]
    launch_env(env)
    out = tmp_path / "run"
    assert_one_error_line(refused(capsys, out), key)
    assert untouched(out)


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_deepspeed_config_file_is_one_line_before_anything_is_written(launch_env, capsys, tmp_path, case):
    body, key = BAD_FILES[case]
    file = tmp_path / "ds.json"
    file.write_text(body if isinstance(body, str) else json.dumps(body))
    launch_env({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(file)})
    out = tmp_path / "run"
    assert_one_error_line(refused(capsys, out), key)
    assert untouched(out)


def test_the_shipped_configs_pass_the_engine_checks(launch_env):
    """The control: the DeepSpeed configs finetune ships, as their launch hands them over, are not refused."""
    from finetune.config import TrainingConfig
    from finetune.engine_config import check_engine_config

    names = {"zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
             "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
             "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
             "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT"}
    for path in sorted((ROOT / "accelerate_configs").glob("deepspeed_zero*.yaml")):
        fields = yaml.safe_load(path.read_text())["deepspeed_config"]
        launch_env({"ACCELERATE_USE_DEEPSPEED": "true",
                    **{names[k]: str(v).lower() for k, v in fields.items() if k in names}})
        check_engine_config(TrainingConfig().max_grad_norm, TrainingConfig().on_nonfinite)


def test_a_launched_bad_config_is_one_line_on_two_processes(tmp_path):
    """The path a user takes: ``accelerate launch`` of a ZeRO config with ``zero_stage: 7`` on two processes. One
    error line (the main process speaks for both), both workers exit 2, no traceback of finetune's or DeepSpeed's
    (torchrun, which ``accelerate launch`` hands a failed run to, adds its own ChildFailedError report: the
    launcher's, outside the workers), and the output directory as it was, so the corrected rerun is not refused."""
    pytest.importorskip("deepspeed")
    config = yaml.safe_load((ROOT / "accelerate_configs" / "deepspeed_zero2.yaml").read_text())
    config["deepspeed_config"]["zero_stage"] = 7
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    proc = subprocess.run([ACCELERATE, "launch", "-q", "--config_file", str(tmp_path / "bad.yaml"),
                           "--main_process_port", "29571", "finetune/run.py", "--recipe", TINY, "--output-dir",
                           str(out), "--max-steps", "1"], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=600)
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "deepspeed config: zero_optimization.stage is 7" in lines[0], proc.stderr[-3000:]
    assert proc.stderr.count("Traceback") <= 1 and "ValidationError" not in proc.stderr, proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr and "exitcode  : 1" not in proc.stderr  # every worker refused alike
    assert untouched(out)


# ---------------------------------------------------------------------------------------------------------------
# only engine_config.py (start-up's first and third stages call it) refuses an engine config


ENGINE_WORDS = ("deepspeed config", "accelerate config", "fsdp_config")


def engine_refusals(package: Path) -> list:
    """``file:line`` of every ConfigError whose message is about the launch's engine config, outside
    engine_config.py."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "engine_config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                    ast.unparse(node.exc.func).endswith("ConfigError") and node.exc.args:
                text = ast.unparse(node.exc.args[0]).lower()
                if any(word in text for word in ENGINE_WORDS):
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno}")
    return found


def test_only_start_up_refuses_engine_configs(tmp_path):
    package = ROOT / "finetune"
    assert engine_refusals(package) == []
    copy = tmp_path / "finetune"  # planted: a DeepSpeed refusal back in distributed.py
    shutil.copytree(package, copy)
    planted = copy / "distributed.py"
    planted.write_text(planted.read_text() + "\n\ndef check():\n    raise ConfigError('deepspeed config: no')\n")
    assert engine_refusals(copy) == [f"finetune/distributed.py:{len(planted.read_text().splitlines())}"]


@pytest.mark.parametrize("name", ["deepspeed", "fsdp"])
def test_fp16_under_an_engine_on_the_cpu_is_one_line(monkeypatch, name):
    """finetune's CPU loss scale serves one process or DDP; under DeepSpeed or FSDP on a CPU, fp16 is refused naming
    the engine (bf16 is not: the control)."""
    from finetune.config import TrainingConfig
    from finetune.startup import check_environment

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setenv(f"ACCELERATE_USE_{name.upper()}", "true")
    monkeypatch.setattr("finetune.startup.check_engine_config", lambda *a: None)  # the engine's own config: not here
    with pytest.raises(ConfigError, match=f"training.mixed_precision: fp16 under {name} needs a CUDA device"):
        check_environment(TrainingConfig(mixed_precision="fp16"))
    check_environment(TrainingConfig(mixed_precision="bf16"))
