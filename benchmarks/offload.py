"""The offload certificate: ``training.offload`` trains the step the run takes without it.

    python benchmarks/offload.py            # the whole table (17 runs, about 10 minutes on 2 CPU cores)
    python benchmarks/offload.py --quick    # 1 process only

Each run: ``finetune run --recipe sft-smollm2`` on the tiny chat model as a full fine-tune (LoRA off), 22 samples
in windows of 4 (the last window holds 2), AdamW, cosine, clipping, the chunked head and packing as the recipe has
them, ``--offload optimizer`` (DeepSpeed ZeRO-2, the optimizer on the host) or ``--offload parameters`` (ZeRO-3, the
weights too), on 1 process or 2 (``--processes 2``), fp32 or bf16 autocast. Each offloaded run is held by
``finetune compare`` against the same run without offload at another micro-batch (bf16: against the floor measured
between two plain layouts, ``--floor``); then the negative control (one word of one answer changed, against the
offloaded run), accumulation N = 4 against N = 1 under offload (what DeepSpeed 0.15.2–0.18.9 got wrong: all but the
last micro-batch's gradients dropped), and a run resumed from its step-2 checkpoint against the uninterrupted one,
byte for byte. Prints the markdown table of docs/memory.md#bigger-than-the-card-exactly.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/offload.py` from a checkout imports this checkout's finetune
    sys.path.insert(0, str(ROOT))

from tests.helpers import SMALL, one_word_changed, tiny_chat_assets  # noqa: E402

BASE = [*SMALL["sft-smollm2"], "peft.enabled=false", "model.dropout=0", "data.limit=22",
        "training.effective_batch_size=4", "model.generate_prompts=0", "training.eval_at_start=false",
        "output.plots=false", "output.tracker=none", "training.max_grad_norm=0.34"]
# an offloaded run that keeps every checkpoint (6 steps, one every 2)
SAVING = ("training.offload=optimizer", "output.save_every=2", "output.keep_checkpoints=3")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_UPDATE_DOWNLOAD_COUNTS": "0", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": str(ROOT)}


def train(out: Path, b: int, *overrides: str, processes: int = 1, args: tuple = ()) -> Path:
    """``finetune run`` of the certificate's recipe at micro-batch ``b`` into ``out`` (a subprocess: an offloaded
    run starts DeepSpeed in its own process). Returns ``out``; AssertionError with the run's last lines if it
    fails."""
    sets = [x for o in (*BASE, *overrides) for x in ("--set", o)]
    cmd = [sys.executable, "-m", "finetune", "run", "--recipe", "sft-smollm2", "--batch-size", str(b), *sets,
           *(["--processes", str(processes)] if processes > 1 else []), *args, "--output-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**ENV, "FINETUNE_TEST_ASSETS": assets()},
                          cwd=ROOT, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    log(out).write_text(proc.stdout)
    return out


def log(out: Path) -> Path:
    return out.parent / f"{out.name}.stdout"


def said(out: Path) -> str:
    """What the run printed."""
    return log(out).read_text()


def assets() -> str:
    """Where the tiny chat model lives, made once (the tests' own)."""
    return str(Path(tiny_chat_assets()["data"]).parent.parent)


def short(line: str) -> str:
    """A verdict line as the table shows it: its word, the weights' relative L2 against its tolerance, the floor
    it rests on, or what differs."""
    import re

    kind, _, rest = line.removeprefix("verdict: ").partition(" — ")
    if kind != "equivalent":
        return f"**{kind}**: {rest.split(':')[0]}"
    weights = re.search(r"weights L2 (\S+ ≤ [0-9.e+-]+)", rest)
    floor = "; floor measured" if "floor measured" in rest else ""
    return f"equivalent (weights L2 {weights.group(1) if weights else '-'}{floor})"


def verdict(a: Path, b: Path, *extra: str) -> str:
    """``finetune compare a b``'s verdict line."""
    proc = subprocess.run([sys.executable, "-m", "finetune", "compare", str(a), str(b), *extra], capture_output=True,
                          text=True, env=ENV, cwd=ROOT, timeout=600)
    return next(line for line in proc.stdout.splitlines() if line.startswith("verdict:"))


def same_bytes(a: Path, b: Path) -> bool:
    """Whether two runs saved the same model, tensor for tensor."""
    import torch
    from safetensors.torch import load_file

    x, y = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def resumed(root: Path, uninterrupted: Path, b: int, *overrides: str) -> Path:
    """A run continued from ``uninterrupted``'s step-2 checkpoint, as if it had stopped there."""
    import shutil

    out = root / f"{uninterrupted.name}-resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(uninterrupted / "checkpoints" / "step-000002", out / "checkpoints" / "step-000002")
    (out / "checkpoints" / "latest").write_text("step-000002\n")
    return train(out, b, *overrides, args=("--resume", "latest"))


def table(root: Path, processes=(1, 2)) -> list[str]:
    """The certificate's rows, as markdown."""
    rows = ["| offload | processes | precision | against | verdict |", "|---|---|---|---|---|"]
    plain = {p: train(root / f"plain-{p}", 4, f"training.mixed_precision={p}") for p in ("no", "bf16")}
    floor = train(root / "plain-bf16-twin", 1, "training.mixed_precision=bf16")
    for level in ("optimizer", "parameters"):
        for n in processes:
            for p in ("no", "bf16"):
                run = train(root / f"{level}-{n}-{p}", 2 // n, f"training.mixed_precision={p}",
                            f"training.offload={level}", processes=n)
                said = short(verdict(plain[p], run, *(["--floor", str(floor)] if p == "bf16" else [])))
                rows.append(f"| {level} | {n} | {'fp32' if p == 'no' else p} | no offload, micro-batch 4 | {said} |")
    twin = train(root / "one-word", 4, f"data.source={one_word_changed(root)}")
    rows.append(f"| — | 1 | fp32 | one word changed, no offload | {short(verdict(twin, root / 'optimizer-1-no'))} |")
    n4, n1 = (train(root / f"parameters-N{k}", 4 // k, "training.offload=parameters") for k in (4, 1))
    rows.append(f"| parameters | 1 | fp32 | N = 4 against N = 1, both offloaded | {short(verdict(n1, n4))} |")
    saving = train(root / "saving", 2, *SAVING)
    again = resumed(root, saving, 2, *SAVING)
    rows.append(f"| optimizer | 1 | fp32 | resumed at step 2 against uninterrupted | "
                f"{'bit-identical' if same_bytes(saving, again) else 'DIFFERENT BYTES'} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 process only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        print("\n".join(table(Path(root), (1,) if args.quick else (1, 2))))


if __name__ == "__main__":
    main()
