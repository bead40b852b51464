#!/usr/bin/env bash
# The LLaMA-Factory baselines in tests/assets/llamafactory/, trained by LLaMA-Factory itself (0.9.5, CPU, fp32):
#   bash examples/llamafactory/make_baselines.sh            (from the repository root, ~1.5 min)
# LLaMA-Factory pins transformers <= 5.6, trl <= 0.24, accelerate <= 1.11, datasets <= 4.0, peft <= 0.18.1: it gets
# an environment of its own (LF_VENV). torch is the CPU wheel, installed first so pip pulls no CUDA; torchvision is
# left out and torchaudio is a stand-in module (no build of either matches torch 2.13 CPU; LLaMA-Factory imports
# torchaudio for audio data only).
set -euo pipefail
LF_VENV=${LF_VENV:-/work/lf-venv}
PY=${FINETUNE_PYTHON:-python}          # finetune's environment (writes the tiny model and the rows)
OUT=tests/assets/llamafactory
if [ ! -x "$LF_VENV/bin/llamafactory-cli" ]; then
  python3 -m venv "$LF_VENV"
  "$LF_VENV/bin/pip" install -q "torch==2.13.0+cpu" "llamafactory==0.9.5"
  "$LF_VENV/bin/pip" uninstall -y -q torchvision torchaudio || true
  SP=$("$LF_VENV/bin/python" -c "import site; print(site.getsitepackages()[0])")
  mkdir -p "$SP/torchaudio"
  echo '"""A stand-in: LLaMA-Factory imports torchaudio for audio data only."""' > "$SP/torchaudio/__init__.py"
fi
rm -rf "$OUT"
"$PY" examples/llamafactory/tiny_inputs.py "$OUT"
for run in sft-lora sft-val sft-prompt sft-packed sft-neat dpo-lora; do
  HF_HUB_OFFLINE=1 DISABLE_VERSION_CHECK=1 "$LF_VENV/bin/llamafactory-cli" train "examples/llamafactory/$run.yaml"
  cp "examples/llamafactory/$run.yaml" "$OUT/$run/training_args.yaml"   # as LLaMA-Factory's web UI saves it
  rm -f "$OUT/$run"/{all_results.json,train_results.json,training_loss.png}
done
# the rows LLaMA-Factory packed, by its own loader: data.pack=knapsack must lay out the same
HF_HUB_OFFLINE=1 DISABLE_VERSION_CHECK=1 "$LF_VENV/bin/python" examples/llamafactory/packed_rows.py \
  examples/llamafactory/sft-packed.yaml "$OUT/sft-packed/packed_rows.jsonl"
