"""A Hub-style folder of a TRL run (what ``push_to_hub`` uploads: the adapters, ``training_args.bin`` and TRL's model
card, which has no hyperparameters and no results table; no ``trainer_state.json``), through the CLI: ``finetune
import`` carries the run's settings from ``training_args.bin``; the reproduction at another micro-batch is certified
on what the folder holds (the settings, each window's samples from the seed, the adapters), and ``compare`` says in
one line that there is no per-step log to certify against. A twin trained on data with one word changed differs.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_chat_assets
from tests.test_trl_baseline import SEED, prompt_completion
from tests.test_trl_runs import cli


@pytest.fixture(scope="module")
def hub(trl_hub_run):
    return trl_hub_run


@pytest.fixture(scope="module")
def events(trl_events_run):
    return trl_events_run


def trl_run(root, report_to):
    """A TRL SFTTrainer LoRA run (2 × 2, one epoch of 22 prompt/completion rows) saved as a push leaves it:
    ``save_model()`` and TRL's card, nothing else (and ``runs/`` with ``report_to`` tensorboard)."""
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    data = prompt_completion(root / "rows.jsonl")
    model_dir = tiny_chat_assets()["model"]
    args = SFTConfig(output_dir=str(root / "trl-hub"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     num_train_epochs=1, learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=0.2,
                     max_grad_norm=0.15, logging_steps=1, seed=SEED, bf16=False, report_to=report_to,
                     save_strategy="no",
                     use_cpu=True, disable_tqdm=True)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args,
                         train_dataset=load_dataset("json", data_files=data)["train"],
                         processing_class=AutoTokenizer.from_pretrained(model_dir),
                         peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trainer.train()
    trainer.save_model()
    trainer.create_model_card()  # TRL's card, as push_to_hub writes it
    folder = root / "trl-hub"
    assert not (folder / "trainer_state.json").exists() and (folder / "training_args.bin").is_file()
    assert "Training hyperparameters" not in (folder / "README.md").read_text()
    return root, folder, data


def test_a_hub_folder_is_imported_and_certified_without_a_step_log(hub, capsys):
    import yaml

    root, folder, data = hub
    recipe = root / "hub.yaml"
    code, table = cli(capsys, "import", folder, "--recipe", "sft-smollm2", "--data", data, "--model",
                      tiny_chat_assets()["model"], "-o", recipe, "--force")
    assert code == 0, table
    assert table.splitlines()[0] == f"Hub folder: {folder}"
    t = yaml.safe_load(recipe.read_text())["training"]
    assert (t["effective_batch_size"], t["learning_rate"], t["lr_scheduler"], t["max_grad_norm"], t["seed"],
            t["sample_order"]) == (4, 0.001, "cosine", 0.15, SEED, "trainer")
    assert "training_args.bin" in table.split("training.learning_rate")[1].splitlines()[0]
    code, out, verdict = replay(capsys, recipe, root / "mine", folder)
    assert code == 0 and verdict.startswith("verdict: equivalent"), out
    assert "no per-step log in the Hub folder (TRL and axolotl push no trainer_state.json)" in verdict, verdict
    assert "weights L2" in verdict and "the Trainer's samples in all 6 windows" in verdict, verdict
    # the twin on data with one word changed: the same settings and windows, other adapters
    code, out, verdict = replay(capsys, recipe, root / "mine-one-word", folder,
                                f"data.source={one_word_changed(data, root / 'one-word.jsonl')}")
    assert code in (1, 3) and verdict.startswith(("verdict: differs — weights", "verdict: not certified — weights")), \
        out
    assert "no per-step log in the Hub folder" in verdict


def replay(capsys, recipe, out, baseline, *overrides) -> tuple:
    """``finetune run`` of the imported ``recipe`` at micro-batch 1 into ``out`` (with ``overrides``), then
    ``finetune compare baseline out``: (compare's exit code, its report, its verdict line)."""
    sets = [a for o in ("output.tracker=none", "model.generate_prompts=0", *overrides) for a in ("--set", o)]
    code, printed = cli(capsys, "run", "--recipe", recipe, "--batch-size", 1, "--output-dir", out, *sets)
    assert code == 0, printed
    code, report = cli(capsys, "compare", baseline, out)
    return code, report, next(line for line in report.splitlines() if line.startswith("verdict:"))


def one_word_changed(data, out) -> str:
    """The rows with one completion changed by one word (" is " → " was "): the negative control."""
    import json

    rows = [json.loads(line) for line in open(data)]
    row = next(r for r in rows if " is " in r["completion"][0]["content"])
    row["completion"][0]["content"] = row["completion"][0]["content"].replace(" is ", " was ", 1)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(out)


def test_a_folder_with_neither_state_nor_arguments_is_refused(tmp_path, capsys):
    from finetune.cli import main
    from tests.helpers import assert_one_error_line

    (tmp_path / "README.md").write_text("---\nbase_model: x\n---\n# a model\n")
    capsys.readouterr()
    assert main(["import", str(tmp_path), "-o", str(tmp_path / "r.yaml")]) == 2
    assert not (tmp_path / "r.yaml").exists()
    assert_one_error_line(capsys.readouterr().err, "holds no trainer_state.json (nor a checkpoint-*/ with one) and no "
                                                   "training_args.bin")


def test_tensorboard_events_are_the_per_step_log(events, capsys):
    """A folder whose only log is the Trainer's TensorBoard event files: compare holds every step's loss, lr and
    grad norm from them (TensorBoard's own reader), "equivalent"; the events' args are read too."""
    from finetune.reproduce.sources import read_baseline

    root, folder, data = events
    assert list(folder.rglob("events.out.tfevents.*"))
    base = read_baseline(folder)
    assert len(base.logs) == 6 and {"loss", "learning_rate", "grad_norm"} <= set(base.logs[0])
    recipe = root / "events.yaml"
    code, table = cli(capsys, "import", folder, "--recipe", "sft-smollm2", "--data", data, "--model",
                      tiny_chat_assets()["model"], "-o", recipe, "--force")
    assert code == 0, table
    code, out, verdict = replay(capsys, recipe, root / "mine", folder)
    assert code == 0 and verdict.startswith("verdict: equivalent"), out
    assert "loss ≤ 1e-04" in verdict and "no per-step log" not in verdict, verdict
    assert "identical at all 6 logged steps" in out
