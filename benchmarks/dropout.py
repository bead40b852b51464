"""What dropout keyed by sample costs (finetune/models/dropout.py): a forward and backward of a LoRA model at
SmolLM2-135M's width with lora_dropout 0.1 on every projection, each layer's masks drawn per sample from its key,
against torch's own dropout on the same model and micro-batch. Repetitions interleave the two; medians of each
step's process CPU time (one torch thread: the work itself, steady when other jobs share the cores) and wall time.

    PYTHONPATH=. python benchmarks/dropout.py --quick    # ~1 min on 2 CPU cores
    PYTHONPATH=. python benchmarks/dropout.py            # 8 layers, more repetitions

The last line is one JSON object: ``keyed_vs_torch`` (step time ratio, CPU time; > 1: keyed is slower).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from finetune.models.dropout import key_by_sample


def lora_model(layers: int):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=1024)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=16, lora_alpha=32, lora_dropout=0.1,
                                                              target_modules=targets))
    model.train()
    return model


def step_seconds(model, ids, keys, keyed: bool) -> tuple:
    if keyed:
        keys.window(0, range(len(ids)))
        keys.see(range(len(ids)))
    else:
        keys.clear()  # no keys: every KeyedDropout falls back to torch's draw
    cpu, wall = time.process_time(), time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    return time.process_time() - cpu, time.perf_counter() - wall


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    opts = p.parse_args(argv)
    torch.set_num_threads(1)
    layers, reps, rows, tokens = (2, 5, 4, 128) if opts.quick else (8, 9, 4, 256)
    model = lora_model(layers)
    keys = key_by_sample(model, seed=0, length_of=lambda i: tokens)
    ids = torch.randint(0, 4096, (rows, tokens), generator=torch.Generator().manual_seed(1))
    times = {True: [], False: []}
    step_seconds(model, ids, keys, True)  # warm-up
    for r in range(reps):
        for keyed in ((True, False) if r % 2 == 0 else (False, True)):
            times[keyed].append(step_seconds(model, ids, keys, keyed))
            model.zero_grad(set_to_none=True)
    med = {k: [statistics.median(t[i] for t in v) for i in (0, 1)] for k, v in times.items()}
    out = {"benchmark": "dropout", "quick": opts.quick, "layers": layers, "keyed_layers": keys.layers,
           "micro_batch": [rows, tokens], "reps": reps, "threads": 1,
           "keyed_step_s": round(med[True][0], 4), "torch_step_s": round(med[False][0], 4),
           "keyed_vs_torch": round(med[True][0] / med[False][0], 3),
           "keyed_vs_torch_wall": round(med[True][1] / med[False][1], 3)}
    print(f"| dropout | step (CPU s) | step (wall s) |\n|---|---|---|\n"
          f"| keyed by sample | {med[True][0]:.4f} | {med[True][1]:.4f} |\n"
          f"| torch's own | {med[False][0]:.4f} | {med[False][1]:.4f} |")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
