"""Other tools' configs as their users write them, through ``finetune import``: TRL's command-line YAML, an axolotl
model card's "See axolotl config" block with the keys that decide its steps, a torchtune YAML and its metric log;
and ``training.drop_last`` (torchtune's dropped tail), which keeps (b, N) and (b·N, 1) the same run."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from finetune.cli import main
from tests.helpers import assert_one_error_line


def imported(capsys, tmp_path, source, *args) -> tuple[dict, str]:
    """(the recipe ``finetune import SOURCE`` wrote, what it printed)."""
    capsys.readouterr()
    out = tmp_path / "r.yaml"
    assert main(["import", str(source), "-o", str(out), "--force", *map(str, args)]) == 0
    said = capsys.readouterr()
    return yaml.safe_load(out.read_text()), said.out + said.err


TRL_SFT = """\
# trl sft --config sft.yaml
model_name_or_path: HuggingFaceTB/SmolLM2-135M-Instruct
dtype: bfloat16
dataset_name: trl-lib/Capybara
dataset_train_split: train
learning_rate: 2.0e-4
num_train_epochs: 1
per_device_train_batch_size: 4
gradient_accumulation_steps: 8
gradient_checkpointing: true
lr_scheduler_type: cosine
warmup_steps: 30
max_length: 1024
logging_steps: 25
seed: 7
bf16: true
use_peft: true
lora_r: 32
lora_target_modules: all-linear
output_dir: SmolLM2-135M-SFT
report_to: none
"""


def test_a_trl_command_line_config(tmp_path, capsys):
    source = tmp_path / "sft.yaml"
    source.write_text(TRL_SFT)
    raw, said = imported(capsys, tmp_path, source)
    t, peft = raw["training"], raw["peft"]
    assert said.startswith(f"TRL config YAML: {source}")
    assert raw["model"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (t["effective_batch_size"], t["learning_rate"], t["lr_scheduler"], t["warmup_steps"], t["seed"],
            t["mixed_precision"], t["gradient_checkpointing"]) == (32, 2e-4, "cosine", 30, 7, "bf16", True)
    assert (peft["enabled"], peft["r"], peft["alpha"], peft["dropout"]) == (True, 32, 32, 0.05)
    assert peft["target_modules"] == ["all-linear"] and "sft.yaml: learning_rate" in said
    from finetune.reproduce.sources import read_baseline

    assert read_baseline(source).args["lora_alpha"] == (32, "sft.yaml: TRL ModelConfig's default lora_alpha")
    full = tmp_path / "full.yaml"
    full.write_text(TRL_SFT.replace("use_peft: true\n", ""))
    _, said = imported(capsys, tmp_path, full)
    assert "not carried: dtype=bfloat16 — TRL loads and trains every weight in bf16" in said, said
    raw, said = imported(capsys, tmp_path, full, "--baseline-step")  # TRL's pure bf16 step, taken
    assert (raw["model"]["dtype"], raw["model"]["master_weights"], raw["training"]["mixed_precision"]) == \
        ("bf16", False, "bf16") and "not carried: dtype" not in said, said  # its bf16: true autocast kept
    assert raw["task"] == "sft", raw  # an SFT config: the sft task (a DPO one, with beta: dpo)
    dpo = tmp_path / "dpo.yaml"
    dpo.write_text(TRL_SFT.replace("use_peft: true\n", "beta: 0.2\nloss_type: sigmoid\n"))
    raw, said = imported(capsys, tmp_path, dpo)
    assert raw["task"] == "dpo" and raw["model"]["beta"] == 0.2 and raw["peft"]["enabled"] is False, said


AXOLOTL_CARD = """\
---
library_name: peft
base_model: {model}
tags:
- generated_from_trainer
model-index:
- name: outputs/tiny-out
  results: []
---

<!-- This model card has been generated automatically according to the information the Trainer had access to. -->

[<img src="https://raw.githubusercontent.com/axolotl-ai-cloud/axolotl/main/image/axolotl-badge-web.png" \
alt="Built with Axolotl" width="200" height="32"/>](https://github.com/axolotl-ai-cloud/axolotl)
<details><summary>See axolotl config</summary>

axolotl version: `0.11.0`
```yaml
base_model: {model}
model_type: AutoModelForCausalLM
tokenizer_type: AutoTokenizer

datasets:
  - path: data/chat.jsonl
    type: chat_template
val_set_size: 0.0
output_dir: ./outputs/tiny-out

adapter: lora
lora_r: 16
lora_alpha: 32
lora_dropout: 0.0
lora_target_linear: true

sequence_len: 256
sample_packing: {packing}
multipack_real_batches: true
sample_packing_eff_est: 0.93
pad_to_sequence_len: true
dataloader_drop_last: true
context_parallel_size: {cp}

micro_batch_size: 2
batch_size: 8
num_epochs: 2
optimizer: adamw_torch
lr_scheduler: cosine
learning_rate: 0.0002
seed: 3
```

</details><br>

# outputs/tiny-out

## Training procedure

### Training hyperparameters

The following hyperparameters were used during training:
- learning_rate: 0.0002
- train_batch_size: 2
- eval_batch_size: 2
- seed: 3
- gradient_accumulation_steps: 4
- total_train_batch_size: 8
- optimizer: Use adamw_torch with betas=(0.9,0.999) and epsilon=1e-08 and optimizer_args=No additional \
optimizer arguments
- lr_scheduler_type: cosine
- num_epochs: 2

### Framework versions

- PEFT 0.15.2
"""


@pytest.mark.parametrize("packing", [True, False])
def test_an_axolotl_card_carries_its_config_block(tmp_path, capsys, packing):
    """The card's YAML block is read beside its hyperparameter list: every key that decides the steps is carried or
    named — multipack is never turned into TRL's packing."""
    from tests.helpers import tiny_chat_assets

    card = tmp_path / "README.md"
    card.write_text(AXOLOTL_CARD.format(model=tiny_chat_assets()["model"], packing=str(packing).lower(), cp=2))
    raw, said = imported(capsys, tmp_path, card)
    t, peft = raw["training"], raw["peft"]
    assert (t["effective_batch_size"], t["drop_last"], t["epochs"], t["seed"]) == (8, 2, 2, 3)
    assert (peft["enabled"], peft["r"], peft["target_modules"]) == (True, 16, ["all-linear"])
    from finetune.reproduce.sources import read_baseline

    args = read_baseline(card).args
    assert args["lora_target_modules"][1].startswith("README.md (axolotl config): lora_target_linear: every linear "
                                                     "layer but lm_head")
    assert "README.md (axolotl config): dataloader_drop_last" in said
    assert "not carried: context_parallel_size=2 — axolotl splits each sequence over this many GPUs" in said
    assert "pack" not in str(raw.get("data", {})) and "TRL packed" not in said
    if packing:
        assert "not carried: sample_packing=True — axolotl packs with its own multipack sampler" in said
        assert "(multipack_real_batches=True, sample_packing_eff_est=0.93)" in said
    else:
        assert "sample_packing" not in said
    assert "keys finetune does not know" not in said


def test_axolotl_batch_size_sets_the_accumulation(tmp_path, capsys):
    from tests.test_trainer_baselines import AXOLOTL

    raw = yaml.safe_load(AXOLOTL.read_text())
    del raw["gradient_accumulation_steps"]
    source = tmp_path / "axolotl.yaml"
    source.write_text(yaml.safe_dump({**raw, "batch_size": 32}))
    recipe, said = imported(capsys, tmp_path, source)
    assert recipe["training"]["effective_batch_size"] == 32
    from finetune.reproduce.sources import read_baseline

    assert read_baseline(source).args["gradient_accumulation_steps"] == (4, "axolotl.yaml: batch_size 32 ÷ "
                                                                            "micro_batch_size 8")


TORCHTUNE = """\
output_dir: /tmp/torchtune/tiny/lora
model:
  _component_: torchtune.models.llama3_2.lora_llama3_2_1b
  lora_attn_modules: ['q_proj', 'v_proj', 'output_proj']
  apply_lora_to_mlp: True
  lora_rank: 8
  lora_alpha: 16
  lora_dropout: 0.0
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: /tmp/Llama-3.2-1B-Instruct/original/tokenizer.model
  max_seq_len: 512
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: /tmp/Llama-3.2-1B-Instruct/
  checkpoint_files: [model.safetensors]
  output_dir: ${output_dir}
  model_type: LLAMA3_2
dataset:
  _component_: torchtune.datasets.alpaca_cleaned_dataset
  packed: False
  train_on_input: False
seed: 1234
shuffle: True
batch_size: 4
optimizer:
  _component_: torch.optim.AdamW
  fused: True
  weight_decay: 0.01
  lr: 3e-4
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: 100
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
epochs: {epochs}
max_steps_per_epoch: null
gradient_accumulation_steps: 8
clip_grad_norm: 1.0
compile: False
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${{output_dir}}/logs
log_every_n_steps: 1
device: cuda
dtype: {dtype}
"""


@pytest.mark.parametrize("epochs, dtype", [(1, "fp32"), (2, "bf16")])
def test_a_torchtune_config(tmp_path, capsys, epochs, dtype):
    source = tmp_path / "1B_lora_single_device.yaml"
    source.write_text(TORCHTUNE.replace("${output_dir}", "${{output_dir}}").format(epochs=epochs, dtype=dtype))
    raw, said = imported(capsys, tmp_path, source)
    t, peft = raw["training"], raw["peft"]
    assert said.startswith("torchtune config: ")
    assert raw["model"]["name_or_path"] == "/tmp/Llama-3.2-1B-Instruct/"
    assert (t["effective_batch_size"], t["drop_last"], t["learning_rate"], t["weight_decay"], t["lr_scheduler"],
            t["warmup_steps"], t["max_grad_norm"], t["seed"], t["sample_order"], t["epochs"]) == \
        (32, 32, 3e-4, 0.01, "cosine", 100, 1.0, 0, "trainer", epochs)
    assert peft["target_modules"] == sorted(["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert "torchtune drops each epoch's incomplete last window" in said
    assert "not carried: seed=1234 — it seeds torchtune's model and adapters; its sampler draws the order from 0" \
        in said
    assert ("not carried: dtype=bf16 — torchtune loads and trains every weight in bf16" in said) == \
        (dtype == "bf16")
    assert ("torchtune adds their gradients to the next epoch's first step" in said) == (epochs > 1)
    assert "not carried: dataset=alpaca_cleaned_dataset — torchtune formats its rows with its own prompt" in said
    assert "quantization" not in raw["model"], raw  # lora_llama3_2_1b: an unquantized base
    qlora = tmp_path / "qlora.yaml"  # its qlora_ builder is the lora_ one with quantize_base=True
    qlora.write_text(source.read_text().replace(".lora_llama3_2_1b", ".qlora_llama3_2_1b"))
    raw, said = imported(capsys, tmp_path, qlora)
    assert raw["model"]["quantization"] == "nf4" and "not carried: quantize_base=True" in said, said


def test_a_torchtune_chat_dataset_file_is_the_training_file(tmp_path, capsys):
    """chat_dataset on a local json file, messages in openai style: that file is the training data without --data
    (a hub source is not: control)."""
    rows = tmp_path / "chat.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    text = TORCHTUNE.replace("${output_dir}", "${{output_dir}}").format(epochs=1, dtype="fp32").replace(
        "  _component_: torchtune.datasets.alpaca_cleaned_dataset\n",
        f"  _component_: torchtune.datasets.chat_dataset\n  source: json\n  data_files: {rows}\n"
        "  conversation_style: openai\n")
    source = tmp_path / "chat.yaml"
    source.write_text(text)
    raw, said = imported(capsys, tmp_path, source, "--recipe", "sft-smollm2")
    assert raw["data"]["source"] == str(rows) and f"chat.yaml: dataset.data_files {rows}" in said, said
    assert "not carried: dataset=" not in said, said
    source.write_text(text.replace("source: json", "source: someone/chats"))
    raw, said = imported(capsys, tmp_path, source, "--recipe", "sft-smollm2")
    assert raw["data"]["source"] != str(rows), said


def test_a_torchtune_log_is_read_with_its_lr_shifted_back(tmp_path):
    """DiskLogger's lines (torchtune 0.6.1: loss and grad norm as tensors, the lr read after the scheduler stepped)."""
    from finetune.reproduce.sources import read_baseline

    folder = tmp_path / "tt"
    (folder / "logs").mkdir(parents=True)
    (folder / "torchtune_config.yaml").write_text(
        TORCHTUNE.replace("${output_dir}", "${{output_dir}}").format(epochs=1, dtype="fp32"))
    (folder / "logs" / "log_1764280000.txt").write_text(textwrap.dedent("""\
        Step 1 | loss:tensor(5.7681) lr:3e-06 tokens_per_second_per_gpu:tensor(812.4) grad_norm:tensor(0.1411)
        Step 2 | loss:5.7791 lr:6e-06 tokens_per_second_per_gpu:830.1 grad_norm:0.1257
        Step 3 | loss:5.7590 lr:9e-06 tokens_per_second_per_gpu:801.0 grad_norm:0.1501
        """))
    b = read_baseline(folder)
    assert b.kind == "torchtune run" and b.max_steps == 3
    assert [(e["step"], e["loss"], e["learning_rate"], e["grad_norm"]) for e in b.logs] == [
        (1, 5.7681, 0.0, 0.1411), (2, 5.7791, 3e-06, 0.1257), (3, 5.759, 6e-06, 0.1501)]


def test_bad_tool_configs_are_refused_with_one_line(tmp_path, capsys):
    source = tmp_path / "x.yaml"
    source.write_text("foo: 1\nbar: [2]\n")
    capsys.readouterr()
    assert main(["import", str(source), "-o", str(tmp_path / "r.yaml")]) == 2
    assert_one_error_line(capsys.readouterr().err, "is not a run finetune reads (a run of ")
    source.write_text(TORCHTUNE.replace("batch_size: 4", "batch_size: four").replace("${output_dir}", "${{output_dir}}")
                      .format(epochs=1, dtype="fp32"))
    assert main(["import", str(source), "-o", str(tmp_path / "r.yaml")]) == 2
    assert_one_error_line(capsys.readouterr().err, "batch_size is 'four', not a whole number")
    assert not (tmp_path / "r.yaml").exists()


def test_drop_last_keeps_the_big_batch_equal_to_its_micro_batches():
    """training.drop_last at the effective batch (torchtune's tail): 18 of the sft recipe's 22 training rows at
    batch 6 → 3 steps, not 4, and (2, 3) takes the same steps as (6, 1); unit-level: the windows are the order's
    prefix."""
    from finetune.windows import WindowSpec
    from tests.helpers import assert_same_history, sft_recipe_run, tiny_chat_assets

    spec = WindowSpec(samples=22, micro_batch=2, accumulation=3, processes=1, seed=0, drop_last=6)
    windows = spec.epoch(0)
    assert spec.per_epoch == 3 and sum(len(w.samples) for w in windows) == 18
    assert WindowSpec(samples=22, micro_batch=2, accumulation=1, processes=1, seed=0, drop_last=2).per_epoch == 11
    tiny_chat_assets()
    two, _ = sft_recipe_run(2, 3, "training.drop_last=6")
    one, _ = sft_recipe_run(6, 1, "training.drop_last=6")
    assert len(one.history) == len(two.history) == 6  # 3 per epoch, 2 epochs
    assert all(h["samples"] == 6 for h in one.history)
    assert_same_history(two.history, one.history, same_split=False)
