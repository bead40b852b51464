"""What ``finetune import`` carries for a baseline's bf16 / fp16: what its run trained with on its device, not what
its arguments asked. accelerate (1.15) runs fp16 autocast only off the CPU, so a TRL run with ``fp16=True,
use_cpu=True`` trained in fp32: it is imported as ``training.mixed_precision: no``, its row naming the device its files
say, and reproduced equivalent. bf16 autocast runs on a CPU and stays bf16; where the files say CUDA, or say nothing
of the device, or DeepSpeed cast the run, the arguments' word is kept (the negative controls)."""

from __future__ import annotations

import json
import re

import pytest

from finetune.reproduce.carry import trained_precision
from finetune.reproduce.sources.files import read_file
from tests.helpers import ROOT
from tests.test_trl_baseline import prompt_completion, reproduce, train_trl

ASSETS = ROOT / "tests" / "assets"
SWIFT_FP16 = ASSETS / "msswift" / "sft-lora-defaults" / "checkpoint-5" / "training_args.bin"  # fp16, on the CPU
TRL_BF16 = ASSETS / "trl-2proc" / "sft-bf16" / "training_args.bin"  # bf16, two CPU processes
ZERO2 = ASSETS / "trl-2proc" / "sft-zero2" / "training_args.bin"  # DeepSpeed ZeRO-2, on the CPU
DEVICE = ("distributed_state", "_setup_devices")  # where a training_args.bin says the device


def test_a_trl_run_with_fp16_on_the_cpu_trained_fp32_and_is_imported_and_reproduced_so(tmp_path, capsys):
    data = prompt_completion(tmp_path / "rows.jsonl")
    baseline, fp32 = tmp_path / "trl-fp16", tmp_path / "trl-fp32"
    train_trl(baseline, data, lora=False, fp16=True)
    train_trl(fp32, data, lora=False)
    assert _losses(baseline) == _losses(fp32)  # what accelerate did with fp16=True here: the fp32 run, to the bit
    capsys.readouterr()
    code, _ = reproduce(tmp_path, baseline, data)
    out = capsys.readouterr().out
    assert code == 0 and out.strip().splitlines()[-1].startswith("verdict: equivalent"), out[-3000:]
    assert re.search(r"training\.mixed_precision +no +training_args\.bin: fp16 true, on a CPU \(training_args\.bin: "
                     r"distributed_state\.device cpu\): accelerate trains fp16 as fp32 there", out), out[:4000]
    assert "mixed_precision: 'no'" in (tmp_path / "trl-fp160.yaml").read_text()  # the recipe reproduce() imported


def _losses(run) -> list:
    return [e["loss"] for e in json.loads((run / "trainer_state.json").read_text())["log_history"] if "loss" in e]


def _without_device(b):
    for name in DEVICE:
        b.args.pop(name)
    return b


def _on_cuda(b):
    state, where = b.args["distributed_state"]
    b.args["distributed_state"] = ({**state, "device": "cuda:0", "_cpu": False}, where)
    b.args["_setup_devices"] = ("cuda:0", b.args["_setup_devices"][1])
    return b


def _use_cpu(b):
    b.args["use_cpu"] = (True, b.args["use_cpu"][1])
    return _without_device(b)


def _fp16(b):
    b.args["fp16"] = (True, b.args["fp16"][1])
    return b


# real files (the source of each above), each with what a run elsewhere would have said instead
CASES = {
    "fp16 on the CPU": (SWIFT_FP16, None, "no"),
    "fp16, use_cpu true, no accelerate state (a training_args.json)": (SWIFT_FP16, _use_cpu, "no"),
    "fp16 on CUDA": (SWIFT_FP16, _on_cuda, "fp16"),
    "fp16, nothing of the device": (SWIFT_FP16, _without_device, "fp16"),
    "bf16 on the CPU": (TRL_BF16, None, "bf16"),
    "fp16 under DeepSpeed on the CPU": (ZERO2, _fp16, "fp16"),
}


@pytest.mark.parametrize("case", CASES)
def test_the_arguments_precision_is_kept_unless_the_device_trained_it_otherwise(case):
    path, change, trained = CASES[case]
    b = read_file(path, "baseline")
    b = change(b) if change else b
    got = trained_precision(b)
    assert got[0] == trained, got
    assert ("on a CPU" in got[1]) == (trained == "no"), got  # the why, only where the arguments were overruled


def test_an_args_json_with_use_cpu_names_it_in_the_import_table(tmp_path, capsys):
    from tests.helpers import cli_in_process as cli

    args = tmp_path / "training_args.json"
    for use_cpu, expected in ((True, r"no +training_args\.json: fp16 true, on a CPU \(training_args\.json: use_cpu "
                                     r"true\)"), (False, r"fp16 +training_args\.json\n")):
        args.write_text(json.dumps({"fp16": True, "bf16": False, "use_cpu": use_cpu, "learning_rate": 1e-3}))
        code, said = cli(capsys, "import", args, "--recipe", "sft-smollm2", "-o", tmp_path / "r.yaml", "--force")
        assert code == 0 and re.search(r"training\.mixed_precision +" + expected, said), said


def test_a_llamafactory_yaml_with_use_cpu_is_read_so(tmp_path, capsys):
    """LLaMA-Factory's YAML takes the TrainingArguments' use_cpu: with fp16 true, fp32 (its output folder, which
    would say the device itself, is not there)."""
    from tests.helpers import cli_in_process as cli

    text = (ASSETS / "llamafactory" / "sft-lora" / "training_args.yaml").read_text()
    text = re.sub(r"(?m)^output_dir: .*$", "output_dir: elsewhere", text).replace("bf16: false", "fp16: true")
    for use_cpu, expected in ((True, r"no +lf\.yaml: fp16 true, on a CPU \(lf\.yaml: use_cpu true\)"),
                              (False, r"fp16 +lf\.yaml: fp16\n")):
        (tmp_path / "lf.yaml").write_text(text + f"use_cpu: {str(use_cpu).lower()}\n")
        code, said = cli(capsys, "import", tmp_path / "lf.yaml", "--model", ASSETS / "llamafactory" / "model", "-o",
                         tmp_path / "r.yaml", "--force")
        assert code == 0 and re.search(r"training\.mixed_precision +" + expected, said), said
