"""Latent ODE: activation memory and step time against the number of solver steps, per memory mode.

    python benchmarks/ode_memory.py [--batch 8 --hidden 64 --solver rk4 --steps 10 20 40 --repeats 5 --threads 1]

One forward + backward of the ``ode-latent`` model (``finetune/tasks/latent_ode.py``) on [B, 4, 32, 32] digit
latents, for ode_memory = none (the baseline: backprop through every step), checkpoint and adjoint. Memory is
counted by ``live_bytes.LiveBytes`` (every tensor storage the step creates, forward and backward): "kept" is what
the graph holds for backward at the end of forward, "peak" the most the step held at once. Prints a markdown table,
then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.live_bytes import best_seconds, machine, measure, training_step  # noqa: E402
from finetune.tasks.latent_ode import DataConfig, LatentODE, ModelConfig, make_latents  # noqa: E402

MODES = ("none", "checkpoint", "adjoint")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--solver", default="rk4", choices=["euler", "rk4"])
    p.add_argument("--steps", type=int, nargs="+", default=[10, 20, 40])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier times on a shared machine)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    samples = make_latents(DataConfig())[:args.batch]
    batch = {k: torch.stack([s[k] for s in samples]) for k in ("z0", "z1")}
    rows = []
    for steps in args.steps:
        for mode in MODES:
            model = LatentODE(ModelConfig(hidden_channels=args.hidden, solver=args.solver,
                                          ode_integration_steps=steps, ode_memory=mode))
            with torch.no_grad():  # a non-trivial flow (the task starts from the zero flow)
                model.velocity.net[-1].weight.normal_(0, 0.05)

            step = training_step(model, batch)
            step()  # warm-up
            model.velocity.evaluations = 0
            step()
            evaluations = model.velocity.evaluations
            mem = measure(step)
            rows.append({"steps": steps, "mode": mode, "kept_mb": mem["kept"] / 2**20, "peak_mb": mem["peak"] / 2**20,
                         "seconds": best_seconds(step, args.repeats), "evaluations": evaluations})

    base = {r["steps"]: r for r in rows if r["mode"] == "none"}
    print(f"Latent ODE, batch {args.batch} × [4, 32, 32], velocity net {args.hidden} channels, {args.solver}; "
          f"{machine()}; {time.strftime('%Y-%m-%d')}\n")
    print("| steps | ode_memory | kept for backward (MB) | peak in step (MB) | peak vs none "
          f"| step time, best of {args.repeats} (s) | time vs none | f evaluations |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b = base[r["steps"]]
        print(f"| {r['steps']} | {r['mode']} | {r['kept_mb']:.1f} | {r['peak_mb']:.1f} | "
              f"{r['peak_mb'] / b['peak_mb']:.2f} | {r['seconds']:.3f} | {r['seconds'] / b['seconds']:.2f} | "
              f"{r['evaluations']} |")
    lo, hi = min(args.steps), max(args.steps)
    growth = {m: next(r["peak_mb"] for r in rows if r["mode"] == m and r["steps"] == hi)
              / next(r["peak_mb"] for r in rows if r["mode"] == m and r["steps"] == lo) for m in MODES}
    print(f"\npeak at {hi} steps / peak at {lo} steps: " + ", ".join(f"{m} {g:.2f}×" for m, g in growth.items())
          + f" (steps × {hi / lo:g})")
    summary = {"benchmark": "ode_memory", "batch": args.batch, "hidden": args.hidden, "solver": args.solver,
               "threads": args.threads, "rows": rows, "peak_growth": growth}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
