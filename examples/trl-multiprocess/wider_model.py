"""A wider, deeper random Llama with the tiny chat model's tokenizer, for measuring bf16 rounding at sizes where it
shows (docs/exact-steps.md#bf16-the-baselines-padding-replayed): hidden size H, 2H in the MLP, heads of 32, seeded.

    python examples/trl-multiprocess/wider_model.py --hidden 384 --layers 6 --out /tmp/m384
"""

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TINY = Path(__file__).resolve().parents[2] / "tests" / "assets" / "llamafactory" / "model"

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--hidden", type=int, default=384)
p.add_argument("--layers", type=int, default=6)
opts = p.parse_args()
cfg = AutoConfig.from_pretrained(TINY)
cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = opts.hidden, 2 * opts.hidden, 32
cfg.num_attention_heads, cfg.num_key_value_heads = opts.hidden // 32, opts.hidden // 64
cfg.num_hidden_layers = opts.layers
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg).save_pretrained(opts.out)
for f in TINY.iterdir():
    if "token" in f.name or "template" in f.name:
        shutil.copy(f, opts.out)
