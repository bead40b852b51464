"""What does accumulation cost in memory, and what does gradient checkpointing save (and cost in time)?

    PYTHONPATH=. python benchmarks/memory.py --quick     # ~1-2 min on 2 CPU cores
    PYTHONPATH=. python benchmarks/memory.py             # a larger grid

Models: the pretrained MiniLM (sequence classification) and the clm-pydoc recipe's GPT-2, on Python-docs paragraphs
padded or cut to 128 tokens (every micro-batch the same shape, so memory is a function of b alone).

* **Peak of one optimizer step**, through finetune's loop (one window of N micro-batches of b samples, AdamW):
  parameters + the most bytes allocated at any moment of the step (gradients, AdamW's two moments, activations,
  temporaries, the window's collated inputs). On CUDA ``torch.cuda.max_memory_allocated``; on a CPU the same
  quantity from the allocator's own record (``torch.profiler`` with ``profile_memory``: every allocation and free,
  in order) — deterministic, unlike the process's RSS, which also holds the allocator's cache and the libraries.
* **Activation bytes of one micro-batch**: what a training-mode forward leaves allocated for the backward (saved
  activations and outputs), measured the same way.
* **Gradient checkpointing** on and off: activation bytes, step peak and time per step (interleaved repetitions,
  medians).

Accumulation keeps only one micro-batch's activations alive at a time; what it adds over a single micro-batch is
the gradient buffer during the second and later forwards (at N = 1 the step's peak comes before the gradients exist)
and the window's inputs, which the loop collates ahead to count its items. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402
import torch  # noqa: E402

from finetune import loop  # noqa: E402
from finetune.config import TrainingConfig  # noqa: E402
from finetune.job import Job  # noqa: E402
from finetune.modeling import enable_checkpointing  # noqa: E402

MB = 2 ** 20
SEQ = 128


class Meter:
    """Bytes allocated inside the block: ``peak`` (the most at any moment) and ``net`` (still allocated at the end),
    both relative to the start. CUDA: the caching allocator's counters; CPU: the profiler's allocation record."""

    def __enter__(self):
        if C.DEVICE.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = self.start = torch.cuda.memory_allocated()
        else:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if C.DEVICE.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
            self.net = torch.cuda.memory_allocated() - self.base
            return
        self.prof.__exit__(*exc)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            self.prof.export_chrome_trace(path)
            events = json.load(open(path))["traceEvents"]
        deltas = sorted((e["ts"], e["args"].get("Ev Idx", 0), e["args"]["Bytes"]) for e in events
                        if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0)
        now = peak = 0
        for *_, nbytes in deltas:
            now += nbytes
            peak = max(peak, now)
        self.peak, self.net = peak, now


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def fixed_length(samples, tokenizer, pad_to: int = SEQ) -> list:
    """Every sample exactly ``pad_to`` tokens (cut, or padded with attention_mask 0): equal micro-batches."""
    out = []
    for s in samples:
        ids = list(s["input_ids"][:pad_to])
        mask = [1] * len(ids) + [0] * (pad_to - len(ids))
        out.append({**s, "input_ids": ids + [tokenizer.pad_token_id] * (pad_to - len(ids)), "attention_mask": mask})
    return out


def workloads(n: int) -> dict:
    """name → (model, data of n samples of SEQ tokens, collate)."""
    from transformers import default_data_collator

    minilm, mtok = C.minilm()
    ptok = C.pydoc_tokenizer()
    gpt2 = C.tiny_gpt2(ptok)
    texts = C.pydoc_samples(mtok, n, seq_len=SEQ)  # the same paragraphs, in MiniLM's tokens, with a class label
    cls = fixed_length([{**s, "labels": i % 2} for i, s in enumerate(texts)], mtok)

    def clm(samples):
        batch = default_data_collator(samples)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch

    return {"MiniLM": (minilm, cls, default_data_collator),
            "GPT-2": (gpt2, fixed_length(C.pydoc_samples(ptok, n, seq_len=SEQ), ptok), clm)}


def adamw_state_bytes(model) -> int:
    """AdamW's two moments and its per-tensor step counter, for the trainable parameters."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return sum(2 * p.numel() * p.element_size() + 4 for p in trainable)


def finetune_steps(model, data, collate, b: int, n: int, steps: int, checkpointing: bool = False,
                   before_window=None) -> dict:
    """finetune's loop over ``steps`` windows of b × N samples (AdamW); returns its result."""
    t = TrainingConfig(batch_size=b, gradient_accumulation_steps=n, max_steps=steps, learning_rate=1e-5,
                       shuffle=False, sort_within_window=False, gradient_checkpointing=checkpointing)
    job = Job(model=model, train_data=data[:b * n * steps], collate_fn=collate, before_window=before_window)
    with C.quiet():
        return loop.train(job, t, print_banner=False)


def accelerate_steps(model, data, collate, b: int, n: int, steps: int, before_window=None) -> None:
    """The documented Accelerate loop (``accumulate()``, prepared DataLoader) over ``steps`` windows, AdamW."""
    from accelerate import Accelerator

    C.restart_accelerate_state()
    accelerator = Accelerator(gradient_accumulation_steps=n, cpu=C.DEVICE.type == "cpu")
    opt = C.optimizer_for(model.parameters(), "adamw", 1e-5)
    loader = torch.utils.data.DataLoader(data[:b * n * steps], batch_size=b, collate_fn=collate)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    model.train()
    for i, batch in enumerate(loader):
        if i % n == 0 and before_window is not None:
            before_window(i // n)
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch)["loss"])
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()


def step_peak(model, data, collate, b: int, n: int, checkpointing: bool = False, tool: str = "finetune") -> int:
    """The most bytes allocated at any moment of a steady optimizer step (the second: AdamW's moments exist):
    parameters + moments (alive when the step starts; gradients are freed after each step) + the step's peak."""
    model = C.copy_model(model).to(C.DEVICE)
    meter = Meter()

    def start_second(step):
        if step == 1:
            meter.__enter__()

    if tool == "finetune":
        finetune_steps(model, data, collate, b, n, 2, checkpointing, lambda state: start_second(state.optimizer_step))
    else:
        accelerate_steps(model, data, collate, b, n, 2, start_second)
    meter.__exit__(None, None, None)
    alive = meter.start if C.DEVICE.type == "cuda" else param_bytes(model) + adamw_state_bytes(model)
    return alive + meter.peak


def activation_bytes(model, data, collate, b: int, checkpointing: bool = False) -> int:
    """Bytes a training-mode forward of one micro-batch leaves allocated for its backward."""
    model = C.copy_model(model).to(C.DEVICE).train()
    if checkpointing:
        enable_checkpointing(model)
    batch = {k: v.to(C.DEVICE) for k, v in collate(data[:b]).items()}
    with Meter() as m:
        out = model(**batch)
    del out
    return m.net


def step_seconds(model, data, collate, b: int, checkpointing: bool, steps: int) -> float:
    """Median time of finetune's optimizer steps after the first (N = 1)."""
    result = finetune_steps(C.copy_model(model).to(C.DEVICE), data, collate, b, 1, steps, checkpointing)
    return C.median([h["seconds"] for h in result["history"][1:]])


def plot(path, record: dict, b: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(record["models"]), figsize=(4.2 * len(record["models"]), 3.4))
    for ax, (name, res) in zip(axes, record["models"].items()):
        acc = [r for r in res["accumulation"] if r["micro_batch"] == b]
        big = [r for r in res["accumulation"] if r["accum"] == 1]
        ax.plot([r["micro_batch"] * r["accum"] for r in acc], [r["peak_mb"] for r in acc], "o-",
                label=f"micro-batch {b}, N accumulation steps")
        ax.plot([r["micro_batch"] for r in big], [r["peak_mb"] for r in big], "s--", label="one micro-batch (N = 1)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("samples per optimizer step")
        ax.set_ylabel("step peak MB")
        ax.set_title(f"{name} ({res['params_mb']:.0f} MB of parameters)", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"![step peak]({Path(path).name})\n")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller grid (~1-2 min on 2 CPU cores)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (memory does not depend on it)")
    p.add_argument("--plot", metavar="PNG", help="also draw step peak against samples per step into this file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    b = 4 if args.quick else 8
    accums = [1, 4] if args.quick else [1, 2, 4, 8]
    reps = 3 if args.quick else 5
    loads = workloads(b * max(accums) * 2)
    print(f"# Memory\n\n{C.machine()}\n`{' '.join(['python', *sys.argv])}`; sequences of {SEQ} tokens, AdamW, "
          f"fp32; {'CUDA max_memory_allocated' if C.DEVICE.type == 'cuda' else 'CPU allocator record'}\n")
    record = {"benchmark": "memory", "quick": args.quick, "device": C.DEVICE.type, "models": {}}
    worst = 0.0
    for name, (model, data, collate) in loads.items():
        params = param_bytes(model)
        res = {"params_mb": params / MB, "accumulation": [], "checkpointing": {}}
        base = step_peak(model, data, collate, b, 1)
        rows = []
        for mb, n in [(b, n) for n in accums] + [(b * n, 1) for n in accums[1:]]:
            peak = base if (mb, n) == (b, 1) else step_peak(model, data, collate, mb, n)
            hand = step_peak(model, data, collate, mb, n, tool="accelerate") if mb == b and n > 1 else None
            act = activation_bytes(model, data, collate, mb)
            rows.append([f"{mb} × {n}", mb * n, f"{act / MB:.1f}", f"{peak / MB:.1f}", f"{peak / base:.3f}",
                         f"{hand / MB:.1f}" if hand else ""])
            res["accumulation"].append({"micro_batch": mb, "accum": n, "activation_mb": act / MB,
                                        "peak_mb": peak / MB, "peak_vs_one_micro_batch": peak / base,
                                        "hand_accelerate_peak_mb": hand / MB if hand else None})
            if mb == b and n > 1:
                worst = max(worst, peak / base)
        print(f"## {name} ({params / MB:.1f} MB of parameters): accumulation vs a bigger micro-batch\n")
        print(C.table(["b × N", "samples / step", "activations of one micro-batch MB", "finetune step peak MB",
                       f"÷ peak of {b} × 1", "hand Accelerate step peak MB"], rows))

        ck_rows, times = [], {False: [], True: []}
        for r in range(reps):  # time: interleaved, memory: once (it is deterministic)
            for flag in ((False, True) if r % 2 == 0 else (True, False)):
                times[flag].append(step_seconds(model, data, collate, b, flag, steps=2 if args.quick else 4))
        for flag in (False, True):
            act = activation_bytes(model, data, collate, b, flag)
            peak = step_peak(model, data, collate, b, 1, flag)
            sec = C.median(times[flag])
            res["checkpointing"]["on" if flag else "off"] = {"activation_mb": act / MB, "peak_mb": peak / MB,
                                                            "step_s": sec}
            ck_rows.append(["on" if flag else "off", f"{act / MB:.1f}", f"{peak / MB:.1f}", f"{sec * 1000:.0f}"])
        off, on = res["checkpointing"]["off"], res["checkpointing"]["on"]
        ck_rows.append(["on ÷ off", f"{on['activation_mb'] / off['activation_mb']:.2f}",
                        f"{on['peak_mb'] / off['peak_mb']:.2f}", f"{on['step_s'] / off['step_s']:.2f}"])
        print(f"\n## {name}: gradient checkpointing (b = {b}, N = 1; step time: median of {reps} interleaved "
              "runs)\n")
        print(C.table(["checkpointing", "activations of one micro-batch MB", "step peak MB", "step ms"], ck_rows))
        print()
        record["models"][name] = res
    if args.plot:
        plot(args.plot, record, b)
    record["accumulation_peak_vs_one_micro_batch"] = worst
    record["seconds"] = round(time.perf_counter() - start, 1)
    print(f"Largest step peak of {b} × N over {b} × 1: {worst:.3f}. Total {record['seconds']} s.\n")
    C.emit_json(record)
    return record


if __name__ == "__main__":
    main()
