"""The certificate's rounding floor: how far layouts of the same sft-smollm2 run end apart, per layer.

    python benchmarks/floor.py                    # LoRA and full at 8 steps, LoRA at 32, 64 and 128 (about an hour)
    python benchmarks/floor.py --steps 8 --quick  # LoRA at 8 steps, (8,1) vs (4,2) only
    python benchmarks/floor.py --precision bf16 --steps 8 --control            # bf16 layouts, and the one-word control
    python benchmarks/floor.py --precision fp16 --steps 8 --control            # the same in fp16 (its loss scale)
    python benchmarks/floor.py --precision bf16 --steps 8 --control --unfixed  # the same without fp32_grad_sums and
                                                                                # pad_to_window (before they existed)
    python benchmarks/floor.py --precision bf16 --steps 8 --set training.packing=false   # any recipe override

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

CASES = [("LoRA", 8, (8, 4, 2)), ("full", 8, (8, 2)), ("LoRA", 32, (8, 4)), ("LoRA", 64, (8, 4, 2)),
         ("LoRA", 128, (8, 4))]


def train(out: Path, kind: str, steps: int, b: int, extra=()) -> Path:
    args = ["--recipe", "sft-smollm2", "--batch-size", str(b), "--effective-batch-size", "8", "--max-steps",
            str(steps), "--output-dir", str(out)]
    for s in ("model.dropout=0", "model.generate_prompts=0", "training.eval_at_start=false",
              f"data.limit={8 * steps}", "output.plots=false", *(["peft.enabled=false"] if kind == "full" else []),
              *extra):
        args += ["--set", s]
    args += ["--lr", "5e-5"] if kind == "full" else []
    subprocess.run([sys.executable, "-m", "finetune", "run", *args], check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_UPDATE_DOWNLOAD_COUNTS": "0"})
    return out


def one_word_changed(folder: Path, steps: int) -> Path:
    """The recipe's stdlib rows as a prompt/completion file, one trained answer with one word changed."""
    import json

    from finetune.data import split_samples
    from finetune.loading import load_recipe
    from finetune.tasks.chat import stdlib_qa

    rows = [dict(r) for r in stdlib_qa()]
    d = load_recipe("sft-smollm2").data
    trained = split_samples(list(range(len(rows))), d.val_fraction, d.split_seed, 8 * steps)[0]
    row = next(rows[i] for i in trained[7:] if " is " in rows[i]["completion"])
    row["completion"] = row["completion"].replace(" is ", " was ", 1)
    path = folder / "one-word.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def row(label: str, layouts: str, c) -> str:
    m = c.measured
    first = f"; first: {c.first_difference}" if not c.equivalent and c.first_difference else ""
    return (f"| {label} | {layouts} | {m.get('loss curve', float('nan')):.1e} | {m.get('grad norm', float('nan')):.1e} "
            f"| {m.get('weights L2', float('nan')):.1e} | {m.get('weights largest', float('nan')):.1e} | "
            f"{c.verdict.kind + first} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, nargs="*", help="only these run lengths")
    p.add_argument("--quick", action="store_true", help="two layouts per case")
    p.add_argument("--kind", choices=["LoRA", "full"], help="only this kind of run")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                   help="bf16 / fp16: autocast (CPU or GPU; fp16 with its loss scale)")
    p.add_argument("--unfixed", action="store_true", help="bf16 / fp16 without fp32_grad_sums and pad_to_window")
    p.add_argument("--control", action="store_true", help="also (4,2) on data with one answer changed by one word")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another recipe override")
    p.add_argument("--keep", type=Path, metavar="DIR", help="write the runs here (kept), not to a temporary folder")
    args = p.parse_args()
    extra = ([f"training.mixed_precision={args.precision}"] if args.precision != "fp32" else []) + \
        (["training.fp32_grad_sums=false", "training.pad_to_window=false"] if args.unfixed else []) + args.set
    print("| run | layouts | loss | grad norm | weights, relative L2 | weights, largest element | verdict |\n"
          "|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        for kind, steps, layouts in CASES:
            if (args.steps and steps not in args.steps) or (args.kind and kind != args.kind):
                continue
            layouts = layouts[:2] if args.quick else layouts
            label = f"{kind}, {steps} steps, {args.precision}" + (" unfixed" if args.unfixed else "") + \
                "".join(f", {x}" for x in args.set)
            runs = {b: train(Path(tmp) / f"{kind}{steps}-{b}", kind, steps, b, extra) for b in layouts}
            for x, y in itertools.combinations(layouts, 2):
                print(row(label, f"({x},{8 // x}) vs ({y},{8 // y})", compare_runs(runs[x], runs[y])), flush=True)
            if args.control:
                data = one_word_changed(Path(tmp), steps)
                other = train(Path(tmp) / f"{kind}{steps}-word", kind, steps, 4, [*extra, f"data.source={data}"])
                print(row(label, f"({layouts[0]},{8 // layouts[0]}) vs (4,2), one word changed",
                          compare_runs(runs[layouts[0]], other)), flush=True)
                if len(layouts) > 2:  # verdicts against a floor measured on a twin of the first run at the
                    a, b, twin = layouts[0], layouts[1], layouts[2]  # smallest micro-batch
                    for name, run in ((f"({b},{8 // b})", runs[b]), ("(4,2), one word changed", other)):
                        c = compare_runs(runs[a], run, twin=runs[twin])
                        print(row(label, f"({a},{8 // a}) vs {name}, floor measured on ({twin},{8 // twin})", c),
                              flush=True)


if __name__ == "__main__":
    main()
