"""Baselines trained under a DeepSpeed offload config import with their step unchanged and the offload named as a
local choice; where the baseline's engine itself took another step, import names it from the files that show it
(finetune/reproduce/engine.py). The DeepSpeed configs and tool configs are the tools' own files
(tests/assets/corpus/deepspeed/PROVENANCE.md); the run folders are built here the way each tool writes them."""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from finetune.cli import main
from finetune.reproduce.engine import SHIPPED, offloaded
from finetune.reproduce.sources import read_baseline

CORPUS = Path(__file__).parent / "assets" / "corpus"
DS = CORPUS / "deepspeed"
# the corpus copy of each shipped config the engine knows by name (PROVENANCE.md: repository, path, commit)
COPIES = {"examples/deepspeed/ds_z3_offload_config.json": "LLaMA-Factory__examples__deepspeed__ds_z3_offload_config",
          "examples/deepspeed/ds_z2_offload_config.json": "LLaMA-Factory__examples__deepspeed__ds_z2_offload_config",
          "examples/deepspeed/ds_z3_config.json": "LLaMA-Factory__examples__deepspeed__ds_z3_config",
          "deepspeed_configs/zero3_bf16_cpuoffload_all.json": "axolotl__deepspeed_configs__zero3_bf16_cpuoffload_all",
          "deepspeed_configs/zero3_bf16_cpuoffload_params.json":
              "axolotl__deepspeed_configs__zero3_bf16_cpuoffload_params",
          "deepspeed_configs/zero2.json": "axolotl__deepspeed_configs__zero2",
          "deepspeed_configs/zero3_bf16.json": "axolotl__deepspeed_configs__zero3_bf16",
          "zero3_offload": "ms-swift__swift__config__zero3_offload",
          "zero2_offload": "ms-swift__swift__config__zero2_offload", "zero3": "ms-swift__swift__config__zero3"}


def imported(source, tmp_path, capsys) -> tuple:
    """(what import printed, the recipe it wrote) for ``source``."""
    out = tmp_path / "recipe.yaml"
    assert main(["import", str(source), "-o", str(out), "--force"]) == 0
    printed = capsys.readouterr()
    return printed.out + printed.err, yaml.safe_load(out.read_text())


def local_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("local:")]


def engine_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("engine:")]


def held_state(config: dict) -> tuple:
    """An independent reading of a DeepSpeed config: (stage, optimizer's device, parameters' device)."""
    zero = config.get("zero_optimization") or {}
    devices = [(zero.get(f"offload_{what}") or {}).get("device") for what in ("optimizer", "param")]
    return (zero.get("stage"), *[None if d in (None, "none") else d for d in devices])  # ms-swift writes "none"


@pytest.mark.parametrize("key", sorted(COPIES))
def test_each_shipped_config_the_engine_knows_by_name_is_the_tools_file(key):
    real = json.loads((DS / f"{COPIES[key]}.json").read_text())
    _, zero = SHIPPED[key]
    assert held_state(real) == (zero.get("stage"), offloaded(zero, "optimizer"), offloaded(zero, "param"))


def no_offload_in(recipe: dict) -> bool:
    """The recipe asks for no offload, stage or device: the step is the baseline's, where the state lives is ours."""
    training = recipe.get("training") or {}
    return not any(k.startswith("offload") for k in training) and "deepspeed" not in json.dumps(training)


def test_an_axolotl_config_under_zero3_cpuoffload_all_names_the_offload_as_local(tmp_path, capsys):
    text, recipe = imported(DS / "axolotl__examples__alst__llama3-8b-deepspeed-alst.yaml", tmp_path, capsys)
    [line] = local_lines(text)
    assert "ZeRO-3, optimizer and parameters offloaded to cpu (zero3_bf16_cpuoffload_all.json" in line
    assert "not the step; here: training.offload=parameters" in line
    assert "not carried: deepspeed" not in text
    assert no_offload_in(recipe) and recipe["training"]["effective_batch_size"] == 1


def test_parameters_offload_alone_is_the_parameters_level(tmp_path, capsys):
    text, _ = imported(DS / "axolotl__examples__mistral__bigstral__bigstral-ds-zero3.yaml", tmp_path, capsys)
    [line] = local_lines(text)
    assert "ZeRO-3, parameters offloaded to cpu (zero3_bf16_cpuoffload_params.json" in line


def llamafactory_yaml(tmp_path, config: str) -> Path:
    """LLaMA-Factory's own full-SFT example, its deepspeed line naming ``config`` (its docs' other choices)."""
    real = (CORPUS / "llamafactory" / "main" / "train_full_qwen3_full_sft.yaml").read_text()
    path = tmp_path / "qwen3_full_sft.yaml"
    path.write_text(real.replace("examples/deepspeed/ds_z3_config.json", f"examples/deepspeed/{config}"))
    return path


def test_llamafactory_offload_config_by_name_and_its_control(tmp_path, capsys):
    text, recipe = imported(llamafactory_yaml(tmp_path, "ds_z3_offload_config.json"), tmp_path, capsys)
    [line] = local_lines(text)
    assert "(ds_z3_offload_config.json, LLaMA-Factory's shipped examples/deepspeed/ds_z3_offload_config.json)" in line
    assert no_offload_in(recipe)
    plain, plain_recipe = imported(CORPUS / "llamafactory" / "main" / "train_full_qwen3_full_sft.yaml", tmp_path,
                                   capsys)
    assert local_lines(plain) == [] and "offloaded" not in plain  # ZeRO-3 without offload: nothing to name
    assert plain_recipe["training"] == recipe["training"]  # the offload changed nothing of the step


def test_a_config_beside_the_yaml_is_read_over_the_name(tmp_path, capsys):
    """A ds_z3_offload_config.json beside the YAML that offloads nothing (the user's edit) is what trained."""
    path = llamafactory_yaml(tmp_path, "ds_z3_offload_config.json")
    edited = json.loads((DS / "LLaMA-Factory__examples__deepspeed__ds_z3_config.json").read_text())
    (tmp_path / "ds_z3_offload_config.json").write_text(json.dumps(edited))
    text, _ = imported(path, tmp_path, capsys)
    assert local_lines(text) == []


def trainer_run(tmp_path, deepspeed, accumulation: int, freeze: dict, transformers_saved: str = "5.24.0") -> Path:
    """A TRL SFT run folder as TRL writes it (tests/assets/corpus/trl/sft-config-run: SFTConfig.to_json_string()),
    trained under ``deepspeed`` (the argument: a path or a dict, as TrainingArguments.to_json_string keeps it) with
    ``accumulation``, and wandb's pip freeze of its run (``wandb/run-*/files/requirements.txt``) pinning ``freeze``."""
    folder = tmp_path / "run"
    shutil.copytree(CORPUS / "trl" / "sft-config-run", folder)
    args = json.loads((folder / "training_args.json").read_text())
    args.update(deepspeed=deepspeed, gradient_accumulation_steps=accumulation)
    (folder / "training_args.json").write_text(json.dumps(args, indent=2))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "transformers_version": transformers_saved}))
    files = folder / "wandb" / "run-20250101_000000-abcd1234" / "files"
    files.mkdir(parents=True)
    (files / "requirements.txt").write_text("".join(f"{k}=={v}\n" for k, v in {"accelerate": "1.2.1", **freeze}
                                                    .items()))
    return folder


def ds_config(name: str) -> dict:
    return json.loads((DS / f"{name}.json").read_text())


def test_dropped_gradients_are_named_only_for_the_versions_and_the_accumulation_that_dropped_them(tmp_path, capsys):
    offload = ds_config("ms-swift__swift__config__zero2_offload")
    text, recipe = imported(trainer_run(tmp_path, offload, 4, {"deepspeed": "0.16.4"}, "4.57.1"), tmp_path, capsys)
    [line] = engine_lines(text)
    assert "wandb/run-20250101_000000-abcd1234/files/requirements.txt: deepspeed 0.16.4" in line
    assert "zero_optimization.offload_optimizer cpu" in line and "gradient_accumulation_steps 4" in line
    assert "DeepSpeed PRs #7967, #7981" in line and line.endswith("expect differs")
    [local] = local_lines(text)
    assert "ZeRO-2, optimizer offloaded to cpu (training_args.json: deepspeed, a dict in the arguments)" in local
    assert "training.offload=optimizer" in local and no_offload_in(recipe)
    for controls in ({"deepspeed": "0.19.0"}, {}):  # the fixed release; no version in the files (nothing guessed)
        text, _ = imported(trainer_run(tmp_path / str(len(controls)), offload, 4, controls, "4.57.1"), tmp_path,
                           capsys)
        assert engine_lines(text) == [] and len(local_lines(text)) == 1
    text, _ = imported(trainer_run(tmp_path / "one", offload, 1, {"deepspeed": "0.16.4"}, "4.57.1"), tmp_path, capsys)
    assert engine_lines(text) == []  # accumulation 1: one micro-batch a step, nothing to drop
    no_offload = ds_config("ms-swift__swift__config__zero3")
    text, _ = imported(trainer_run(tmp_path / "none", no_offload, 4, {"deepspeed": "0.16.4"}, "4.57.1"), tmp_path,
                       capsys)
    assert engine_lines(text) == [] and local_lines(text) == []


def test_transformers_5_under_deepspeed_with_loss_kwargs_is_named_and_4_is_not(tmp_path, capsys):
    no_offload = ds_config("LLaMA-Factory__examples__deepspeed__ds_z3_config")
    text, _ = imported(trainer_run(tmp_path, no_offload, 8, {}, "5.24.0"), tmp_path, capsys)
    [line] = engine_lines(text)
    assert "config.json: transformers_version 5.24.0" in line and "architectures LlamaForCausalLM" in line
    assert "transformers#45305" in line and "about 8×" in line
    text, _ = imported(trainer_run(tmp_path / "4", no_offload, 8, {}, "4.57.1"), tmp_path, capsys)
    assert engine_lines(text) == []
    text, _ = imported(trainer_run(tmp_path / "none", None, 8, {}, "5.24.0"), tmp_path, capsys)
    assert engine_lines(text) == []  # no DeepSpeed: the Trainer's own accumulation averages


def test_a_path_that_is_not_here_nor_shipped_is_said_unknown_and_one_in_the_folder_is_read(tmp_path, capsys):
    text, _ = imported(trainer_run(tmp_path, "/cluster/configs/my_ds.json", 4, {}, "4.57.1"), tmp_path, capsys)
    [line] = local_lines(text)
    assert "my_ds.json" in line and "not here" in line and "unknown" in line
    folder = trainer_run(tmp_path / "beside", "/cluster/configs/my_ds.json", 4, {}, "4.57.1")
    shutil.copy(DS / "axolotl__deepspeed_configs__zero2.json", folder / "my_ds.json")
    text, _ = imported(folder, tmp_path, capsys)
    [line] = local_lines(text)
    assert "ZeRO-2, optimizer offloaded to cpu (my_ds.json, read from" in line


def test_bf16_master_weights_are_named(tmp_path, capsys):
    config = ds_config("axolotl__deepspeed_configs__zero3_bf16_cpuoffload_all")
    config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True}
    text, _ = imported(trainer_run(tmp_path, config, 1, {}, "4.57.1"), tmp_path, capsys)
    [line] = engine_lines(text)
    assert "bf16.bf16_master_weights_and_grads true" in line and "not fp32" in line


def msswift_run(tmp_path, deepspeed) -> Path:
    """ms-swift's published run (corpus/published/ms-swift) as swift writes args.json under --deepspeed NAME: the
    shipped config resolved into a dict (swift/arguments/sft_args.py, _init_deepspeed)."""
    folder = tmp_path / "swift"
    shutil.copytree(CORPUS / "published" / "ms-swift" / "lgc-FINANCE__DeepClima-R1__root", folder)
    args = json.loads((folder / "args.json").read_text())
    args["deepspeed"] = deepspeed
    (folder / "args.json").write_text(json.dumps(args, indent=2))
    return folder


def test_msswift_zero3_offload_is_local_and_its_plain_run_names_none(tmp_path, capsys):
    text, recipe = imported(msswift_run(tmp_path, ds_config("ms-swift__swift__config__zero3_offload")), tmp_path,
                            capsys)
    [line] = local_lines(text)
    assert "ZeRO-3, optimizer and parameters offloaded to cpu (args.json: deepspeed, a dict in the arguments)" in line
    assert no_offload_in(recipe)
    text, _ = imported(CORPUS / "published" / "ms-swift" / "lgc-FINANCE__DeepClima-R1__root", tmp_path, capsys)
    assert local_lines(text) == [] and engine_lines(text) == []


def test_torchtune_optimizer_in_backward_is_a_note_not_a_difference(tmp_path, capsys):
    text, _ = imported(CORPUS / "torchtune" / "llama3_2__1B_full_single_device.yaml", tmp_path, capsys)
    [note] = [line for line in text.splitlines() if "optimizer_in_bwd" in line]
    assert note.startswith("note:") and "no clipping" in note and engine_lines(text) == []


def test_torchao_cpu_offload_optimizer_over_bf16_is_named(tmp_path, capsys):
    """torchtune's memory tutorial's optimizer (docs/source/tutorials/memory_optimizations.rst) in its 1B config."""
    raw = (CORPUS / "torchtune" / "llama3_2__1B_full_single_device.yaml").read_text()
    path = tmp_path / "1B_full_single_device.yaml"
    path.write_text(raw.replace("bitsandbytes.optim.PagedAdamW8bit",
                                "torchao.prototype.low_bit_optim.CPUOffloadOptimizer"))
    text, _ = imported(path, tmp_path, capsys)
    [line] = engine_lines(text)
    assert "optimizer._component_ torchao.prototype.low_bit_optim.CPUOffloadOptimizer" in line
    assert "in bf16, no fp32 master" in line
    assert read_baseline(CORPUS / "torchtune" / "llama3_2__1B_full_single_device.yaml").get("optim") != \
        read_baseline(path).get("optim")
