#!/usr/bin/env bash
# The ms-swift baselines in tests/assets/msswift/, trained by ms-swift itself (4.6.0, CPU) on the LLaMA-Factory
# runs' inputs (tests/assets/llamafactory/model and data/chat.jsonl: the tiny chat model and its 40 rows, written by
# examples/llamafactory/tiny_inputs.py):
#   bash examples/msswift/make_baselines.sh                      (from the repository root, ~1 min once installed)
#   bash examples/msswift/make_baselines.sh sft-lora-defaults    (one of them: sft-lora, sft-lora-defaults,
#                                                                 sft-lora-shuffled, sft-lora-dropout, row-orders)
# ms-swift pins its own transformers (5.19), trl (0.29) and peft (0.20): it gets an environment of its own
# (SWIFT_VENV); torch is the CPU wheel, installed first so pip pulls no CUDA (no torchvision or torchaudio: swift
# imports neither for text).
set -euo pipefail
SWIFT_VENV=${SWIFT_VENV:-/work/swift-venv}
OUT=tests/assets/msswift
INPUTS=tests/assets/llamafactory
RUNS=${*:-sft-lora sft-lora-defaults sft-lora-shuffled sft-lora-dropout row-orders}
if [ ! -x "$SWIFT_VENV/bin/swift" ]; then
  python3 -m venv "$SWIFT_VENV"
  "$SWIFT_VENV/bin/pip" install -q "torch==2.13.0+cpu"
  "$SWIFT_VENV/bin/pip" install -q "ms-swift==4.6.0"
fi
# Changed from swift's defaults in every run: --lora_dropout 0 (every step deterministic); --split_dataset_ratio 0 (all
# 40 rows trained). sft-lora and sft-lora-defaults also --dataset_shuffle false (the rows in the file's order);
# sft-lora-shuffled keeps swift's default, the rows shuffled once with a seed drawn from
# np.random.RandomState(data_seed), which finetune import replays. The rest is swift's default, spelled out so that the
# run says it: the sampler draws torch.randperm(40) from data_seed + epoch; chatml adds no system message; loss_scale
# default trains the assistant's turns with the <|im_end|>\n after each; right padding; max_length 256 (the model's),
# a longer row deleted; cosine, no warm-up, AdamW (fused) betas 0.9/0.95, weight decay 0.1, clipping at 1.0; LoRA r 8,
# alpha 32 on all linear layers.
COMMON=(--model "$INPUTS/model" --model_type llama --template chatml --tuner_type lora
  --dataset "$INPUTS/data/chat.jsonl" --split_dataset_ratio 0
  --train_dataloader_shuffle true --data_seed 42 --seed 42 --loss_scale default --padding_side right
  --max_length 256 --truncation_strategy delete --per_device_train_batch_size 4 --gradient_accumulation_steps 2
  --num_train_epochs 1 --learning_rate 1e-3 --lr_scheduler_type cosine --warmup_ratio 0 --weight_decay 0.1
  --adam_beta1 0.9 --adam_beta2 0.95 --max_grad_norm 1.0 --lora_rank 8 --lora_alpha 32 --lora_dropout 0
  --target_modules all-linear --logging_steps 1 --save_only_model true --report_to none --add_version false)

swift_sft() {  # swift_sft NAME ARGS…: one run into $OUT/NAME, without the copy of its last checkpoint
  rm -rf "${OUT:?}/$1"
  CUDA_VISIBLE_DEVICES="" HF_HUB_OFFLINE=1 "$SWIFT_VENV/bin/swift" sft "${@:2}" --output_dir "$OUT/$1"
  rm -rf "$OUT/$1/last-checkpoint"  # a copy of the last checkpoint-*/
}

for run in $RUNS; do
  case "$run" in
    sft-lora)
      # fp32 said outright: --torch_dtype float32 --fp16 false --bf16 false (with torch_dtype float32 swift turns
      # fp16 on)
      ARGS=("${COMMON[@]}" --dataset_shuffle false --torch_dtype float32 --fp16 false --bf16 false)
      swift_sft sft-lora "${ARGS[@]}"
      # what it trained, micro-batch by micro-batch (rows, tokens, labels, the window's token count), recorded by
      # swift itself in the same run again; it prints one row as swift's template renders it
      CUDA_VISIBLE_DEVICES="" HF_HUB_OFFLINE=1 "$SWIFT_VENV/bin/python" examples/msswift/trained_batches.py \
        "$OUT/sft-lora-batches.jsonl" "$OUT/sft-lora" -- "${ARGS[@]}" --output_dir "$OUT/sft-lora" ;;
    sft-lora-defaults)
      # swift's defaults for precision: no --torch_dtype, --fp16, --bf16. It takes the model's float32 and records
      # fp16: true, which accelerate (1.15) trains in fp32 on this CPU (no autocast, no GradScaler): the run that
      # finetune import must read as fp32 (its checkpoint's training_args.bin names the device, cpu)
      swift_sft sft-lora-defaults "${COMMON[@]}" --dataset_shuffle false ;;
    sft-lora-shuffled)
      # sft-lora-defaults with swift's default data order: the 40 rows shuffled once before training (data_seed 42),
      # then the sampler's randperm over them
      swift_sft sft-lora-shuffled "${COMMON[@]}" --dataset_shuffle true ;;
    sft-lora-dropout)
      # swift at its defaults throughout: sft-lora-shuffled with its default --lora_dropout 0.05 (a later flag wins)
      swift_sft sft-lora-dropout "${COMMON[@]}" --dataset_shuffle true --lora_dropout 0.05 ;;
    row-orders)
      # the orders swift's own load_dataset gives a few files at a few data seeds (tests/test_msswift_order.py)
      HF_HUB_OFFLINE=1 "$SWIFT_VENV/bin/python" examples/msswift/row_orders.py "$OUT/row-orders.json" ;;
    *) echo "make_baselines.sh: unknown run $run (sft-lora, sft-lora-defaults, sft-lora-shuffled, sft-lora-dropout," \
         "row-orders)" >&2
       exit 2 ;;
  esac
done
