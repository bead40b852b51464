"""A TRL DPOTrainer run on two processes — the baseline ``tests/assets/trl-2proc/dpo`` holds, reproduced on one by
``finetune reproduce`` (tests/test_multiprocess_args.py):

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 \\
        examples/trl-multiprocess/train_dpo.py --out tests/assets/trl-2proc/dpo

fp32 on the CPU (gloo): the tiny chat model (tests/assets/llamafactory/model), every weight trained, against its
frozen copy; 12 conversational preference pairs (``tests/assets/trl-2proc/pairs.jsonl``), sigmoid loss at beta 0.25;
1 pair per device × 2 accumulation × 2 processes = 4 per step, one epoch: 3 steps. TRL averages each micro-batch's
pairs and the processes' gradients are averaged: every micro-batch full, that is the window's mean.
"""

import argparse
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

ASSETS = Path(__file__).resolve().parents[2] / "tests" / "assets"

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--data", default=str(ASSETS / "trl-2proc" / "pairs.jsonl"))
opts = p.parse_args()
args = DPOConfig(output_dir=opts.out, per_device_train_batch_size=1, gradient_accumulation_steps=2,
                 num_train_epochs=1, learning_rate=1e-3, beta=0.25, loss_type=["sigmoid"], lr_scheduler_type="constant",
                 warmup_steps=0, max_grad_norm=1.0, logging_steps=1, seed=42, report_to=[], save_strategy="no",
                 use_cpu=True, disable_tqdm=True, bf16=False)
model_dir = str(ASSETS / "llamafactory" / "model")
trainer = DPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args,
                     train_dataset=load_dataset("json", data_files=opts.data)["train"],
                     processing_class=AutoTokenizer.from_pretrained(model_dir))
trainer.train()
trainer.save_model()
trainer.save_state()
trainer.create_model_card()
