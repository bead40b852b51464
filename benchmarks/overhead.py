"""Does finetune cost anything over the loop a user would write? Throughput against three peers, in one run.

    PYTHONPATH=. python benchmarks/overhead.py --quick     # ~2 min on 2 CPU cores
    PYTHONPATH=. python benchmarks/overhead.py             # more steps and repetitions

Two parts, on the pretrained MiniLM (sequence classification of VADER's rated words; samples/s) and the clm-pydoc
recipe's GPT-2 (one Python-docs paragraph a sample, padded per micro-batch; tokens/s):

1. **Identical work.** A raw torch loop, the hand-written Accelerate loop with ``accumulate()``, HF ``Trainer`` and
   finetune train the same model on the same micro-batches — same order (no shuffling), same dynamic padding, the
   same optimizer object type built the same way (AdamW as finetune builds it), the same linear schedule and
   clipping, fp32. The runs check that every tool saw the same samples and tokens in every step. Repetitions are
   interleaved (the order rotates); each step's time is the median over repetitions, the first step (warm-up) is
   left out, and the throughput is the step units summed over the summed median step times — on two clocks: the
   process's CPU time (one torch thread: the CPU time is the work; it barely moves when other jobs take the cores)
   and the wall clock. The raw loop runs twice as two tools: the ratio of the two copies shows how far identical
   runs drift on the machine of the day.
2. **Everyone's defaults.** finetune as its text tasks run it (windows sorted by length, dynamic padding) against
   Trainer as its documentation sets it up (random sampler, padding collator, its default optimizer), same
   micro-batch, N, learning rate and epoch of the same text; real (non-padding) tokens per second.
3. **Fixed cost per optimizer step**: the same four loops on a 6-16-1 MLP, where the model's work is ~nothing, so
   what is left is each tool's own machinery per step (CPU µs).

The last line printed is one JSON object: ``finetune_vs_raw``, ``finetune_vs_accelerate``, ``finetune_vs_trainer``
(throughput ratios at identical work on CPU time, the lower of the two models; > 1: finetune faster) and
``finetune_defaults_vs_trainer_defaults`` (real tokens/s ratio with defaults, CPU time, the lower of the two models),
then every number per model and on both clocks (``*_wall``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common as C  # noqa: E402
import torch  # noqa: E402

TOOLS = {"raw torch": C.run_raw, "hand Accelerate": C.run_accelerate, "HF Trainer": C.run_trainer,
         "finetune": C.run_finetune}
# the raw loop a second time: its ratio to the first shows how far two identical runs drift on this machine
CONTROL = "raw torch (again)"
KEYS = {"raw torch": "raw", "hand Accelerate": "accelerate", "HF Trainer": "trainer"}


def workloads(quick: bool) -> dict:
    """name → the model, data, collate, micro-batch, N, learning rate and the unit its throughput counts."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

    minilm, mtok = C.minilm()
    ptok = C.pydoc_tokenizer()
    gpt2 = C.tiny_gpt2(ptok)
    steps = {"minilm": 5 if quick else 16, "gpt2": 5 if quick else 12}
    gpt2_b = 4 if quick else 8
    vader = C.vader_samples(mtok, 16 * 2 * steps["minilm"])
    pydoc = C.pydoc_samples(ptok, gpt2_b * 4 * steps["gpt2"])
    return {
        "MiniLM classification": dict(
            model=minilm, data=vader, collate=DataCollatorWithPadding(mtok), b=16, n=2, lr=1e-4, unit="samples",
            trainer_collate=None, tokenizer=mtok),
        "GPT-2 causal LM": dict(
            model=gpt2, data=pydoc, collate=C.clm_collate(ptok), b=gpt2_b, n=4, lr=2e-3, unit="tokens",
            trainer_collate=DataCollatorForLanguageModeling(ptok, mlm=False), tokenizer=ptok),
    }


def identical_work(w: dict, reps: int) -> dict:
    runs = C.interleaved(
        {name: (lambda fn: lambda model, *a: fn(model, *a, lr=w["lr"]))(fn)
         for name, fn in {**TOOLS, CONTROL: C.run_raw}.items()},
        reps, lambda: (C.copy_model(w["model"]), w["data"], w["collate"], w["b"], w["n"]))
    reference = runs["raw torch"][0]
    for name, rs in runs.items():  # the same micro-batches in every step, for every tool and repetition
        for r in rs:
            same = (r.samples, r.tokens, r.padded) == (reference.samples, reference.tokens, reference.padded)
            assert same, f"{name} did not train on the same micro-batches as the raw loop"
    units = sum(reference.units(w["unit"])[1:])
    out = {}
    for name, rs in runs.items():
        out[name] = {"wall_s": C.median([r.wall for r in rs])}
        for clock in ("cpu", "wall"):  # each step's median over the repetitions, summed over steps 2..
            per_rep = [r.durations(clock)[1:] for r in rs]
            steps = [C.median(x) for x in zip(*per_rep)]
            out[name][clock] = units / sum(steps)
            out[name][f"{clock}_step_ms"] = 1000 * C.median(steps)
            # the fastest repetition of each step: interference from other jobs only ever adds time
            out[name][f"{clock}_min"] = units / sum(min(x) for x in zip(*per_rep))
        out[name]["cpu_step_ms_per_rep"] = [[round(1000 * d, 1) for d in r.durations("cpu")] for r in rs]
    return out


def defaults(w: dict, reps: int) -> dict:
    lengths = C.lengths_of(w["data"])
    runners = {
        "HF Trainer (defaults)": lambda model: C.run_trainer(
            model, w["data"], w["trainer_collate"], w["b"], w["n"], lr=w["lr"], optimizer=None, sampling="random",
            tokenizer=w["tokenizer"]),
        "finetune (defaults)": lambda model: C.run_finetune(
            model, w["data"], w["collate"], w["b"], w["n"], lr=w["lr"], shuffle=True, lengths=lengths, sort=None),
    }
    runs = C.interleaved(runners, reps, lambda: (C.copy_model(w["model"]),))
    out = {}
    for name, rs in runs.items():
        out[name] = {"cpu": C.median([r.rate("tokens", clock="cpu") for r in rs]),
                     "wall": C.median([r.rate("tokens", clock="wall") for r in rs]),
                     "samples_cpu": C.median([r.rate("samples", clock="cpu") for r in rs]),
                     "padding": C.median([1 - sum(r.tokens) / sum(r.padded) for r in rs]),
                     "wall_s": C.median([r.wall for r in rs])}
    return out


def fixed_cost(reps: int, steps: int) -> dict:
    """Each tool's own cost per optimizer step, where the model costs ~nothing: a 6-16-1 MLP, 4 micro-batches of 4
    samples a step, AdamW. Median CPU µs of the steps after the first, the median over repetitions."""
    from equivalence import MLP, regression_data, torch_default_collate

    torch.manual_seed(0)
    model, data = MLP(), regression_data(16 * steps, torch.float32)
    runs = C.interleaved({name: (lambda fn: lambda m: fn(m, data, torch_default_collate, 4, 4, lr=1e-3))(fn)
                          for name, fn in TOOLS.items()}, reps, lambda: (C.copy_model(model),))
    return {name: 1e6 * C.median([C.median(r.durations("cpu")[1:]) for r in rs]) for name, rs in runs.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and repetitions (~2 min on 2 CPU cores)")
    p.add_argument("--reps", type=int, default=None, help="repetitions of each tool (default 3, or 7)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared machine a second thread waits on busy cores)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    reps = args.reps or (3 if args.quick else 7)
    start = time.perf_counter()
    print(f"# Overhead\n\n{C.machine()}\n`{' '.join(['python', *sys.argv])}`; {reps} interleaved repetitions\n")

    record = {"benchmark": "overhead", "quick": args.quick, "reps": reps, "threads": args.threads, "models": {}}
    ratios = {k: [] for k in KEYS.values()}
    default_ratios = []
    for model_name, w in workloads(args.quick).items():
        unit = w["unit"]
        same = identical_work(w, reps)
        ft = same["finetune"]
        rows = [[name, f"{r['cpu']:.1f}", f"{ft['cpu'] / r['cpu']:.3f}", f"{r['wall']:.1f}",
                 f"{ft['wall'] / r['wall']:.3f}", f"{r['wall_step_ms']:.0f}"] for name, r in same.items()
                if name != CONTROL]
        noise = same[CONTROL]["cpu"] / same["raw torch"]["cpu"]
        rows.append([f"*control: {CONTROL}*", f"{same[CONTROL]['cpu']:.1f}", f"raw ÷ raw again: {1 / noise:.3f}",
                     f"{same[CONTROL]['wall']:.1f}", "", f"{same[CONTROL]['wall_step_ms']:.0f}"])
        print(f"## {model_name}: identical work (b={w['b']}, N={w['n']}, {len(w['data'])} samples, "
              f"{len(w['data']) // (w['b'] * w['n'])} steps)\n")
        print(C.table(["tool", f"{unit}/s (CPU time)", "finetune ÷ tool", f"{unit}/s (wall)", "finetune ÷ tool (wall)",
                       "median step ms (wall)"], rows))
        dflt = defaults(w, reps)
        f, t = dflt["finetune (defaults)"], dflt["HF Trainer (defaults)"]
        print(f"\n## {model_name}: everyone's defaults (same text, b={w['b']}, N={w['n']})\n")
        print(C.table(["set-up", "real tokens/s (CPU time)", "real tokens/s (wall)", "samples/s (CPU time)",
                       "padding share", "wall s (set-up incl.)"],
                      [[name, f"{r['cpu']:.0f}", f"{r['wall']:.0f}", f"{r['samples_cpu']:.1f}", f"{r['padding']:.0%}",
                        f"{r['wall_s']:.2f}"] for name, r in dflt.items()]))
        ratio_defaults = f["cpu"] / t["cpu"]
        print(f"\nfinetune defaults ÷ Trainer defaults, real tokens/s: **{ratio_defaults:.2f}** (CPU time), "
              f"{f['wall'] / t['wall']:.2f} (wall)\n")
        record["models"][model_name] = {
            "unit": unit, **{f"finetune_vs_{KEYS[k]}": ft["cpu"] / r["cpu"] for k, r in same.items() if k in KEYS},
            **{f"finetune_vs_{KEYS[k]}_wall": ft["wall"] / r["wall"] for k, r in same.items() if k in KEYS},
            **{f"finetune_vs_{KEYS[k]}_fastest": ft["cpu_min"] / r["cpu_min"] for k, r in same.items() if k in KEYS},
            "raw_vs_raw_again": 1 / noise,
            "identical_work": same,
            "finetune_defaults_vs_trainer_defaults": ratio_defaults,
            "finetune_defaults_vs_trainer_defaults_wall": f["wall"] / t["wall"],
            "defaults": dflt}
        for k, key in KEYS.items():
            ratios[key].append(ft["cpu"] / same[k]["cpu"])
        default_ratios.append(ratio_defaults)
    fixed = fixed_cost(reps, 32 if args.quick else 96)
    raw = fixed["raw torch"]
    print("## Fixed cost per optimizer step (a 6-16-1 MLP: the tools' own work; b = 4, N = 4, AdamW)\n")
    print(C.table(["tool", "µs per step (CPU time)", "over the raw loop µs"],
                  [[name, f"{us:.0f}", f"{us - raw:+.0f}"] for name, us in fixed.items()]))
    print()
    record["per_step_us"] = fixed
    record.update({f"finetune_vs_{k}": min(v) for k, v in ratios.items()})
    record["finetune_defaults_vs_trainer_defaults"] = min(default_ratios)
    record["seconds"] = round(time.perf_counter() - start, 1)
    print(f"Total {record['seconds']} s.\n")
    C.emit_json({k: record[k] for k in ("finetune_vs_raw", "finetune_vs_accelerate", "finetune_vs_trainer",
                                        "finetune_defaults_vs_trainer_defaults")} | record)
    return record


if __name__ == "__main__":
    main()
