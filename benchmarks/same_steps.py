"""Every shipped recipe for 3 optimizer steps with one checkout, and two such collections compared bit for bit:
what a refactor must leave unchanged (history, metrics and saved weights; timing and memory fields left out, and a
field only one side records).

    python benchmarks/same_steps.py run CHECKOUT OUT     # OUT/<recipe>/, one finetune run per recipe
    python benchmarks/same_steps.py diff OUT_A OUT_B     # exit 1 when any recipe differs
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VOLATILE = ("seconds", "mem_", "rss", "peak", "time", "per_s", "wall")


def run(checkout: str, out: str) -> None:
    """Each recipe of ``checkout`` for 3 steps, with that checkout's code, into ``out/<recipe>``."""
    recipes = sorted(p.stem for p in (Path(checkout) / "recipes").glob("*.yaml"))
    env = dict(os.environ, PYTHONPATH=checkout, HF_HUB_OFFLINE="1", HF_UPDATE_DOWNLOAD_COUNTS="0",
               TOKENIZERS_PARALLELISM="false", FINETUNE_RECIPES=str(Path(checkout) / "recipes"))
    for recipe in recipes:
        dest = Path(out) / recipe
        if (dest / "metrics.json").exists():
            continue
        start = time.time()
        done = subprocess.run([sys.executable, "-m", "finetune", "run", "--recipe", recipe, "--max-steps", "3",
                               "--output-dir", str(dest)], env=env, cwd=checkout, capture_output=True, text=True)
        print(recipe, done.returncode, f"{time.time() - start:.0f}s",
              done.stderr.strip().splitlines()[-1:] if done.returncode else "", flush=True)


def steady(x):
    """``x`` without the fields that change from run to run (timings, memory)."""
    if isinstance(x, dict):
        return {k: steady(v) for k, v in x.items() if not any(s in k for s in VOLATILE)}
    return [steady(v) for v in x] if isinstance(x, list) else x


def shared(a, b) -> tuple:
    """``a`` and ``b`` restricted to the keys both hold: a field one side adds is not a changed step."""
    if isinstance(a, dict) and isinstance(b, dict):
        pairs = {k: shared(a[k], b[k]) for k in a if k in b}
        return {k: p[0] for k, p in pairs.items()}, {k: p[1] for k, p in pairs.items()}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        pairs = [shared(x, y) for x, y in zip(a, b)]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    return a, b


def weights(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*.safetensors")) if "checkpoint" not in str(p)}


def same(a: Path, b: Path) -> list:
    """[history, metrics, weights] of one recipe's two runs: each True when bit-identical."""
    history = [[steady(json.loads(line)) for line in (r / "history.jsonl").read_text().splitlines()] for r in (a, b)]
    metrics = [steady(json.loads((r / "metrics.json").read_text())) for r in (a, b)]
    wa, wb = weights(a), weights(b)
    return [len(history[0]) == len(history[1]) and shared(*history)[0] == shared(*history)[1],
            shared(*metrics)[0] == shared(*metrics)[1], bool(wa) and wa == wb]


def diff(out_a: str, out_b: str) -> int:
    bad = 0
    for a in sorted(Path(out_a).iterdir()):
        b = Path(out_b) / a.name
        if not (a / "metrics.json").exists() or not (b / "metrics.json").exists():
            print(f"{a.name:24s} missing")
            bad += 1
            continue
        checks = same(a, b)
        print(f"{a.name:24s} " + "  ".join(f"{what} {'same' if ok else 'DIFF'}" for what, ok in
                                           zip(("history", "metrics", "weights"), checks)))
        bad += not all(checks)
    print("all identical" if not bad else f"{bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit({"run": run, "diff": diff}[sys.argv[1]](*sys.argv[2:]) or 0)
