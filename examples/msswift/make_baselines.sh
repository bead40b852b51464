#!/usr/bin/env bash
# The ms-swift baseline in tests/assets/msswift/, trained by ms-swift itself (4.6.0, CPU, fp32) on the LLaMA-Factory
# runs' inputs (tests/assets/llamafactory/model and data/chat.jsonl: the tiny chat model and its 40 rows, written by
# examples/llamafactory/tiny_inputs.py):
#   bash examples/msswift/make_baselines.sh            (from the repository root, ~1 min once installed)
# ms-swift pins its own transformers (5.19), trl (0.29) and peft (0.20): it gets an environment of its own
# (SWIFT_VENV); torch is the CPU wheel, installed first so pip pulls no CUDA (no torchvision or torchaudio: swift
# imports neither for text).
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
# Changed from swift's defaults: --dataset_shuffle false (swift would shuffle the rows once, with a seed drawn from
# np.random.RandomState(data_seed), which finetune names as not carried); --fp16/--bf16 false (with torch_dtype
# float32 swift turns fp16 on); --lora_dropout 0 (every step deterministic); --split_dataset_ratio 0 (all 40 rows
# trained). The rest is swift's default, spelled out so that the run says it: the sampler draws
# torch.randperm(40) from data_seed + epoch; chatml adds no system message; loss_scale default trains the assistant's
# turns with the <|im_end|>\n after each; right padding; max_length 256 (the model's), a longer row deleted; cosine,
# no warm-up, AdamW (fused) betas 0.9/0.95, weight decay 0.1, clipping at 1.0; LoRA r 8, alpha 32 on all linear layers.
ARGS=(--model "$INPUTS/model" --model_type llama --template chatml --tuner_type lora --torch_dtype float32
  --fp16 false --bf16 false --dataset "$INPUTS/data/chat.jsonl" --split_dataset_ratio 0 --dataset_shuffle false
  --train_dataloader_shuffle true --data_seed 42 --seed 42 --loss_scale default --padding_side right
  --max_length 256 --truncation_strategy delete --per_device_train_batch_size 4 --gradient_accumulation_steps 2
  --num_train_epochs 1 --learning_rate 1e-3 --lr_scheduler_type cosine --warmup_ratio 0 --weight_decay 0.1
  --adam_beta1 0.9 --adam_beta2 0.95 --max_grad_norm 1.0 --lora_rank 8 --lora_alpha 32 --lora_dropout 0
  --target_modules all-linear --logging_steps 1 --save_only_model true --report_to none --add_version false
  --output_dir "$OUT/sft-lora")
CUDA_VISIBLE_DEVICES="" HF_HUB_OFFLINE=1 "$SWIFT_VENV/bin/swift" sft "${ARGS[@]}"
rm -rf "$OUT/sft-lora/last-checkpoint"  # a copy of the last checkpoint-*/
# what it trained, micro-batch by micro-batch (rows, tokens, labels, the window's token count), recorded by swift
# itself in the same run again; it prints one row as swift's template renders it
CUDA_VISIBLE_DEVICES="" HF_HUB_OFFLINE=1 "$SWIFT_VENV/bin/python" examples/msswift/trained_batches.py \
  "$OUT/sft-lora-batches.jsonl" "$OUT/sft-lora" -- "${ARGS[@]}"
