"""What ``training.fp32_grad_sums`` and ``training.pad_to_window`` cost under bf16 autocast: step time and peak
tensor memory of one window's forward + backward, with and without, on the same model and data in one run.

    python benchmarks/bf16_sums.py            # a 4-layer Llama from a config (SmolLM2's widths), 4 × 2 micro-batches
    python benchmarks/bf16_sums.py --device cuda

Each case runs the loop's own pieces: ``sum_weight_grads_in_fp32`` on the model, ``pad_to_window`` on the window's
micro-batches (lengths drawn from 64 to 256 tokens), bf16 autocast, backward of each micro-batch; timed over
``--repeats`` windows after one warm-up, the peak measured by ``finetune.memory.measure.PeakMeter`` on one window.
Prints one markdown row per case, with tokens/s (real tokens) and the ratios to the plain case.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch


def model_and_window(device, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).to(device)
    lengths = torch.randint(64, 257, (8,)).tolist()
    batches = []
    for part in (lengths[:4], lengths[4:]):
        longest = max(part)
        ids = torch.zeros(len(part), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(part):
            ids[i, :n] = torch.randint(1, cfg.vocab_size, (n,))
            mask[i, :n] = 1
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return model, batches, sum(lengths)


def window(model, batches, device):
    for b in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(**{k: v.to(device) for k, v in b.items()}, use_cache=False)
        out.loss.backward()
    model.zero_grad(set_to_none=True)


def measure(case, base_model, batches, device, repeats):
    from accelerate import Accelerator

    from finetune.memory.measure import PeakMeter
    from finetune.models.precision import sum_weight_grads_in_fp32
    from finetune.steps import pad_to_window

    model = copy.deepcopy(base_model)
    if "sums" in case:
        sum_weight_grads_in_fp32(model)
    if "pad" in case:
        batches = pad_to_window(Accelerator(cpu=device.type == "cpu"), batches)
    window(model, batches, device)  # warm-up
    with PeakMeter(device) as meter:
        window(model, batches, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(repeats):
        window(model, batches, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - began) / repeats, meter.peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    device = torch.device(args.device)
    model, batches, tokens = model_and_window(device)
    cases = ["plain autocast", "fp32 sums", "padded to the window", "fp32 sums + padded to the window"]
    keys = {"plain autocast": "", "fp32 sums": "sums", "padded to the window": "pad",
            "fp32 sums + padded to the window": "sums pad"}
    results = {c: measure(keys[c], model, batches, device, args.repeats) for c in cases}
    seconds0, peak0 = results["plain autocast"]
    print(f"| case ({device.type}) | tokens/s | × plain | peak tensor memory | × plain |\n|---|---|---|---|---|")
    for c in cases:
        s, peak = results[c]
        print(f"| {c} | {tokens / s:.0f} | {seconds0 / s:.2f} | {peak / 2**20:.0f} MiB | {peak / peak0:.2f} |")


if __name__ == "__main__":
    main()
