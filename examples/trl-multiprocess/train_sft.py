"""A TRL SFTTrainer run on two processes — the baseline ``tests/assets/trl-2proc/`` holds, reproduced on one by
``finetune reproduce`` (tests/test_multiprocess_args.py):

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 \\
        examples/trl-multiprocess/train_sft.py --out tests/assets/trl-2proc/sft

fp32 on the CPU (gloo), the tiny chat model and its 40 chats (tests/assets/llamafactory: model, data/chat.jsonl),
LoRA r 8 on q and v, 2 per device × 2 accumulation × 2 processes = 8 per step, one epoch: 5 steps, every window full.
``--bf16``: the same under bf16 autocast with gradient checkpointing (``tests/assets/trl-2proc/sft-bf16``);
``--rows 38``: the first 38 chats, so that each process's last batch is short (``tests/assets/trl-2proc/sft-short``).
``--process-mean``: with ``average_tokens_across_devices=False``, each process's own token mean averaged
(``tests/assets/trl-2proc/sft-process-mean``).
``--zero 2`` / ``--zero 3``: under DeepSpeed ZeRO-2 / ZeRO-3 (``tests/assets/trl-2proc/sft-zero2``, ``sft-zero3``),
launched with the Trainer's ``deepspeed`` argument and torchrun (DeepSpeed on the CPU over gloo; the Trainer's
AdamW, reduced in fp32):

    torchrun --nproc_per_node 2 examples/trl-multiprocess/train_sft.py --zero 2 --out tests/assets/trl-2proc/sft-zero2

Rows of varied length (``examples/trl-multiprocess/varied_chats.py``), bf16 with checkpointing, 4 per device × 2
accumulation × 2 processes = 16 per step, 3 steps: ``tests/assets/trl-2proc/sft-bf16-varied``, and the same with
TRL's collator padding each micro-batch to a multiple of 16 (``sft-bf16-varied-pad16``):

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/trl-multiprocess/train_sft.py \\
        --bf16 --data tests/assets/trl-2proc/varied.jsonl --per-device 4 --accumulation 2 \\
        --out tests/assets/trl-2proc/sft-bf16-varied  # and --pad-to-multiple-of 16 --out …-pad16

The same on a model as wide as SmolLM2, where the bf16 kernels' shapes can matter: ``tests/test_trl_replay.py`` builds
it (``wider_model.py --hidden 576 --layers 2 --out M``) and trains this baseline itself, on the CPU it tests on (a
baseline's step 1 replays bit for bit on its own CPU kind), with ``--model M`` and accelerate's default threads.
"""

import argparse
import os
from pathlib import Path

import torch
from accelerate import PartialState
from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

INPUTS = Path(__file__).resolve().parents[2] / "tests" / "assets" / "llamafactory"

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--data", default=str(INPUTS / "data" / "chat.jsonl"))
p.add_argument("--model", default=str(INPUTS / "model"), help="the base model's folder")
p.add_argument("--bf16", action="store_true", help="bf16 autocast, with gradient checkpointing")
p.add_argument("--rows", type=int, help="train on the first ROWS rows only")
p.add_argument("--process-mean", action="store_true", help="average_tokens_across_devices=False")
p.add_argument("--per-device", type=int, default=2, help="per_device_train_batch_size")
p.add_argument("--accumulation", type=int, default=2, help="gradient_accumulation_steps")
p.add_argument("--pad-to-multiple-of", type=int, help="the collator pads each micro-batch to a multiple of this")
p.add_argument("--zero", type=int, choices=(1, 2, 3), help="train under DeepSpeed ZeRO at this stage")
opts = p.parse_args()
# the Trainer fills each "auto" from its own arguments; with no optimizer section DeepSpeed wraps the Trainer's AdamW
if opts.zero:  # on the CPU the Trainer would start DeepSpeed with no backend (a world of one): start it on gloo
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
zero = {"zero_optimization": {"stage": opts.zero}, "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto"}
args = SFTConfig(output_dir=opts.out, per_device_train_batch_size=opts.per_device,
                 gradient_accumulation_steps=opts.accumulation,
                 num_train_epochs=1, learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=0.2,
                 max_grad_norm=0.5, logging_steps=1, seed=42, bf16=opts.bf16, gradient_checkpointing=opts.bf16,
                 report_to=[], save_strategy="no",
                 use_cpu=not opts.zero, deepspeed=zero if opts.zero else None, disable_tqdm=True,
                 accelerator_config={"use_configured_state": bool(opts.zero)},
                 assistant_only_loss=False, average_tokens_across_devices=not opts.process_mean,
                 **({"pad_to_multiple_of": opts.pad_to_multiple_of} if opts.pad_to_multiple_of else {}))
model_dir = opts.model
rows = load_dataset("json", data_files=opts.data)["train"]
trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=args,
                     train_dataset=rows.select(range(opts.rows)) if opts.rows else rows,
                     processing_class=AutoTokenizer.from_pretrained(model_dir),
                     peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
trainer.train()
trainer.save_model()
trainer.save_state()
trainer.create_model_card()
