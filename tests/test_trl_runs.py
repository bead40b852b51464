"""TRL runs people hold, through the CLI only (import → run at a smaller micro-batch → compare), on the tiny chat
model in fp32:

* rows of messages (``{"messages": [...]}``): TRL trains on every token without ``assistant_only_loss``, and
  ``import --data`` says so (``data.train_on: all``) — "equivalent"; the recipe's own ``assistant`` kept differs at
  step 1;
* a packed SFT baseline (``packing=True``): import says it cannot carry it, and compare's verdict names it;
* a DPO baseline: import carries ``DPOConfig``'s ``beta`` and ``loss_type``, and the settings layer checks them (a
  run at another beta differs on the settings layer).
"""

from __future__ import annotations

import json

import torch

from finetune.cli import main
from tests.helpers import tiny_chat_assets, tiny_pairs_assets, train_and_save
from tests.test_trl_baseline import ROWS, SEED


def messages_rows(path) -> str:
    rows = [json.loads(line) for line in open(tiny_chat_assets()["data"])][:ROWS]
    path.write_text("".join(json.dumps({"messages": [m for m in r["messages"] if m["role"] != "system"]}) + "\n"
                            for r in rows))
    return str(path)


def train_sft(out, data, **extra) -> None:
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model_dir = tiny_chat_assets()["model"]
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=4, num_train_epochs=1, learning_rate=5e-4,
                     lr_scheduler_type="cosine", warmup_steps=0.2, max_grad_norm=0.34, logging_steps=1, seed=SEED,
                     bf16=False, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, **extra)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args,
                         train_dataset=load_dataset("json", data_files=data)["train"],
                         processing_class=AutoTokenizer.from_pretrained(model_dir))
    train_and_save(trainer)


def cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().out


def reproduce(capsys, tmp, baseline, data, recipe_name="sft-smollm2", *sets) -> tuple[int, str, str]:
    """(compare's exit code, its last line, import's table)."""
    recipe = tmp / f"{baseline.name}.yaml"
    code, table = cli(capsys, "import", baseline, "--recipe", recipe_name, "--data", data, "--model",
                      tiny_chat_assets()["model"], "-o", recipe, "--force")
    assert code == 0, table
    mine = tmp / f"{baseline.name}-mine{len(sets)}"
    code, out = cli(capsys, "run", "--recipe", recipe, "--batch-size", 2, "--output-dir", mine, "--set",
                    "output.tracker=none", *[x for s in sets for x in ("--set", s)])
    assert code == 0, out
    code, out = cli(capsys, "compare", baseline, mine)
    return code, out.strip().splitlines()[-1], table


def test_rows_of_messages_train_on_every_token_as_trl(tmp_path, capsys):
    data = messages_rows(tmp_path / "messages.jsonl")
    baseline = tmp_path / "trl-messages"
    train_sft(baseline, data)
    code, verdict, table = reproduce(capsys, tmp_path, baseline, data, "sft-smollm2", "model.generate_prompts=0")
    assert "data.train_on" in table and "--data: messages rows, trained on every token by TRL" in table, table
    assert code == 0 and verdict.startswith("verdict: equivalent"), verdict
    # the negative twin: the recipe's assistant-only loss over the same rows
    code, verdict, _ = reproduce(capsys, tmp_path, baseline, data, "sft-smollm2", "model.generate_prompts=0",
                                 "data.train_on=assistant")
    assert code == 1 and "first above at step 1" in verdict, verdict


def test_a_packed_baseline_is_named_in_the_verdict(tmp_path, capsys):
    data = messages_rows(tmp_path / "messages.jsonl")
    baseline = tmp_path / "trl-packed"
    train_sft(baseline, data, packing=True, max_length=128)
    code, verdict, table = reproduce(capsys, tmp_path, baseline, data, "sft-smollm2", "model.generate_prompts=0")
    assert "not carried: packing=True" in table, table
    assert code == 1 and "the baseline's packing=True is not carried by finetune import" in verdict, verdict


def test_a_dpo_baseline_carries_beta_and_the_loss_type(tmp_path, capsys):
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    model_dir = tiny_chat_assets()["model"]
    rows = [json.loads(line) for line in open(tiny_pairs_assets()["data"])]
    explicit = tmp_path / "pairs.jsonl"  # TRL's explicit-prompt layout (conversational and text)
    explicit.write_text("".join(json.dumps(r) + "\n" for r in rows if "prompt" in r))
    data = str(explicit)
    baseline = tmp_path / "trl-dpo"
    args = DPOConfig(output_dir=str(baseline), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3,
                     beta=0.25, loss_type=["hinge"], logging_steps=1, seed=SEED, report_to=[], save_strategy="no",
                     use_cpu=True, disable_tqdm=True, bf16=False, lr_scheduler_type="constant", warmup_steps=0,
                     max_grad_norm=1.0)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args,
                         train_dataset=load_dataset("json", data_files=data)["train"],
                         processing_class=AutoTokenizer.from_pretrained(model_dir))
    train_and_save(trainer)
    recipe = tmp_path / "dpo.yaml"
    code, table = cli(capsys, "import", baseline, "--recipe", "dpo-smollm2", "--data", data, "--model", model_dir,
                      "-o", recipe)
    assert code == 0, table
    import yaml

    model = yaml.safe_load(recipe.read_text().split("\n", 2)[2])["model"]
    assert model["beta"] == 0.25 and model["loss_type"] == "hinge", table
    mine = tmp_path / "mine"
    assert cli(capsys, "run", "--recipe", recipe, "--batch-size", 2, "--output-dir", mine, "--set",
               "output.tracker=none", "--set", "model.beta=0.1")[0] == 0
    code, out = cli(capsys, "compare", baseline, mine)
    assert code == 1 and "settings: model.beta 0.25 in the baseline vs 0.1" in out.strip().splitlines()[-1], out
