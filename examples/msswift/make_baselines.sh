#!/usr/bin/env bash
# The ms-swift baseline in tests/assets/msswift/, trained by ms-swift itself (4.6.0, CPU, fp32) on the LLaMA-Factory
# runs' inputs (tests/assets/llamafactory/model and data/chat.jsonl: the tiny chat model and its rows):
#   bash examples/msswift/make_baselines.sh            (from the repository root, ~1 min once installed)
# ms-swift pins its own transformers (5.19), trl (0.29) and peft (0.20): it gets an environment of its own
# (SWIFT_VENV); torch is the CPU wheel, installed first so pip pulls no CUDA.
set -euo pipefail
SWIFT_VENV=${SWIFT_VENV:-/work/swift-venv}
OUT=tests/assets/msswift
INPUTS=tests/assets/llamafactory
if [ ! -x "$SWIFT_VENV/bin/swift" ]; then
  python3 -m venv "$SWIFT_VENV"
  "$SWIFT_VENV/bin/pip" install -q "torch==2.13.0+cpu"
  "$SWIFT_VENV/bin/pip" install -q "ms-swift==4.6.0"
fi
rm -rf "$OUT/sft-lora"
# --dataset_shuffle false: swift would shuffle the rows once with a seed drawn from a numpy random state, which
# finetune names as not carried; --fp16/--bf16 false: the run in fp32 (its default turns fp16 on); --lora_dropout 0:
# every step deterministic. Everything else is swift's default (cosine, no warm-up, AdamW betas 0.9/0.95, weight
# decay 0.1, all-linear LoRA r 8 alpha 32, the chatml template, the loss on the assistant's turns).
CUDA_VISIBLE_DEVICES="" HF_HUB_OFFLINE=1 "$SWIFT_VENV/bin/swift" sft --model "$INPUTS/model" --model_type llama \
  --template chatml --tuner_type lora --torch_dtype float32 --fp16 false --bf16 false --split_dataset_ratio 0 \
  --dataset "$INPUTS/data/chat.jsonl" --dataset_shuffle false --per_device_train_batch_size 4 \
  --gradient_accumulation_steps 2 --num_train_epochs 1 --logging_steps 1 --learning_rate 1e-3 --seed 42 \
  --lora_dropout 0 --save_only_model true --report_to none --add_version false --output_dir "$OUT/sft-lora"
rm -rf "$OUT/sft-lora/last-checkpoint"  # a copy of the last checkpoint-*/
