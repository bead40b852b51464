#!/usr/bin/env bash
# The axolotl baselines in tests/assets/axolotl-{lora,full,packed}, trained by axolotl itself (0.21.0, CPU, fp32)
# through its own CLI (`axolotl train`, which runs `accelerate launch -m axolotl.cli.train`):
#   FINETUNE_PYTHON=.venv/bin/python bash examples/axolotl/make_baselines.sh   (from the repository root; 5–7 min on 2 shared cores)
# axolotl 0.21.0 needs Python >= 3.12 and pins transformers 5.20.1, peft 0.21.2, trl 1.14.1, accelerate 1.15.0,
# datasets 5.0.1: it gets an environment of its own (AX_VENV, made with PYTHON312 the first time). No CPU build of
# torch 2.13 for Python 3.12 is reachable here, so pip takes PyPI's CUDA build (torch 2.13.0+cu130 and its nvidia-*
# wheels: 4.7 GB; 6.9 GB with axolotl), which trains on the CPU all the same. README.md beside this file says what
# each run is and how finetune reproduces it.
set -euo pipefail
AX_VENV=${AX_VENV:-/work/ax-venv}
PY=${FINETUNE_PYTHON:-python}          # finetune's environment (writes the tiny model and the rows)
PYTHON312=${PYTHON312:-python3.12}
IN=tests/assets/axolotl-inputs
if [ ! -x "$AX_VENV/bin/axolotl" ]; then
  "$PYTHON312" -m venv "$AX_VENV"
  "$AX_VENV/bin/pip" install -q "torch==2.13.0" "axolotl==0.21.0"
fi
# `axolotl train` starts `accelerate launch` from PATH; offline (no hub), no telemetry, no wandb
export PATH="$AX_VENV/bin:$PATH" HF_HUB_OFFLINE=1 HF_UPDATE_DOWNLOAD_COUNTS=0 HF_HUB_DISABLE_TELEMETRY=1 \
  AXOLOTL_DO_NOT_TRACK=1 WANDB_MODE=disabled
rm -rf "$IN" /tmp/axolotl-prepared
PYTHONPATH=. "$PY" examples/axolotl/tiny_inputs.py "$IN"
for run in lora full packed; do
  rm -rf "tests/assets/axolotl-$run"
  axolotl train "examples/axolotl/sft-$run.yaml"
done
# the adapters the LoRA runs started from (axolotl saves none): its own start replayed (sft-packed draws the same)
rm -rf tests/assets/axolotl-lora-initial
"$AX_VENV/bin/python" examples/axolotl/initial_adapters.py examples/axolotl/sft-lora.yaml tests/assets/axolotl-lora-initial
rm -f tests/assets/axolotl-lora-initial/{README.md,debug.log}   # peft's empty card, axolotl's log of the replay
