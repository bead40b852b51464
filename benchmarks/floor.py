"""The certificate's rounding floor: how far layouts of the same sft-smollm2 run end apart, per layer.

    python benchmarks/floor.py                    # LoRA and full at 8 steps, LoRA at 32 and 128 (about 40 min, 2 CPUs)
    python benchmarks/floor.py --steps 8 --quick  # LoRA at 8 steps, (8,1) vs (4,2) only

Each run: ``finetune run --recipe sft-smollm2 --batch-size B --effective-batch-size 8 --max-steps S --set
data.limit=8·S --set model.dropout=0 --set model.generate_prompts=0 --set training.eval_at_start=false`` (full
fine-tuning adds ``--set peft.enabled=false --lr 5e-5``), then ``finetune compare`` of each pair of layouts. Prints one
markdown row per pair: the largest per-step loss and grad-norm differences and the weights' relative L2 and largest
element (docs/exact-steps.md#the-certificate).
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from finetune.reproduce.compare import compare_runs

CASES = [("LoRA", 8, (8, 4, 2)), ("full", 8, (8, 2)), ("LoRA", 32, (8, 4)), ("LoRA", 128, (8, 4))]


def train(out: Path, kind: str, steps: int, b: int) -> Path:
    args = ["--recipe", "sft-smollm2", "--batch-size", str(b), "--effective-batch-size", "8", "--max-steps",
            str(steps), "--output-dir", str(out)]
    for s in ("model.dropout=0", "model.generate_prompts=0", "training.eval_at_start=false",
              f"data.limit={8 * steps}", "output.plots=false", *(["peft.enabled=false"] if kind == "full" else [])):
        args += ["--set", s]
    args += ["--lr", "5e-5"] if kind == "full" else []
    subprocess.run([sys.executable, "-m", "finetune", "run", *args], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_UPDATE_DOWNLOAD_COUNTS": "0"})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, nargs="*", help="only these run lengths")
    p.add_argument("--quick", action="store_true", help="two layouts per case")
    args = p.parse_args()
    print("| run | layouts | loss | grad norm | weights, relative L2 | weights, largest element | verdict |\n"
          "|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for kind, steps, layouts in CASES:
            if args.steps and steps not in args.steps:
                continue
            layouts = layouts[:2] if args.quick else layouts
            runs = {b: train(Path(tmp) / f"{kind}{steps}-{b}", kind, steps, b) for b in layouts}
            for x, y in itertools.combinations(layouts, 2):
                m = (c := compare_runs(runs[x], runs[y])).measured
                print(f"| {kind}, {steps} steps | ({x},{8 // x}) vs ({y},{8 // y}) | {m['loss curve']:.1e} | "
                      f"{m['grad norm']:.1e} | {m['weights L2']:.1e} | {m['weights largest']:.1e} | "
                      f"{'equivalent' if c.equivalent else 'differs'} |", flush=True)


if __name__ == "__main__":
    main()
