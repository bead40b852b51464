"""What an offloaded run holds in host memory, measured: the process's peak RSS against the planner's host bytes.

    python benchmarks/offload_memory.py            # both levels and the run without offload (3 runs, ~2 min)

Each run: ``finetune run --recipe clm-pydoc`` with a 57 M-parameter GPT-2 built from its config (8 layers of 768,
32-token rows: the model's state dwarfs its activations), 2 optimizer steps at (2, 2), AdamW, fp32, one process, in
a process of its own. On this CPU the "card" is host memory too, so what the engine adds is read as the RSS it
grows by from the model built (just before ``accelerator.prepare``) to the run's peak, and held against what the
planner says the level adds there: its host bytes (``memory.host.host_bytes``) and the gradients the card stages
before they cross to the host (4 B a trainable weight; DeepSpeed's reduce bucket holds them all at this size).
Prints one markdown row per run (docs/memory.md#bigger-than-the-card-exactly).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "{model_type: gpt2, n_layer: 8, n_embd: 768, n_head: 12, n_positions: 64}"
RUN = ["--recipe", "clm-pydoc", "--set", f"model.config={MODEL}", "--set", "model.vocab_size=512", "--set",
       "data.seq_len=32", "--set", "data.limit=16", "--batch-size", "2", "--grad-accum-steps", "2", "--max-steps", "2",
       "--set", "output.tracker=none", "--set", "output.plots=false", "--set", "output.save_model=false"]


def child(out: str, level: str) -> None:
    """In the measured process: the run, with the RSS read when the model is built and the peak at the end."""
    import resource

    import psutil

    from finetune import cli, startup

    marks = {}
    real = startup.with_optimizers

    def measured(accelerator, model, job, t, shape):
        from finetune.memory.host import host_bytes

        marks["model"] = psutil.Process().memory_info().rss
        marks["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        marks["weights"] = sum(p.numel() * p.element_size() for p in model.parameters())
        marks["host"] = host_bytes(model, level, t.optimizer, 1)
        out = real(accelerator, model, job, t, shape)
        marks["prepared"] = psutil.Process().memory_info().rss
        return out

    startup.with_optimizers = measured
    code = cli.main(["run", *RUN, "--offload", level, "--output-dir", str(Path(out).parent / level)])
    marks["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out).write_text(json.dumps({"code": code, **marks}))


def measure(level: str, root: Path) -> dict:
    out = root / f"{level}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_UPDATE_DOWNLOAD_COUNTS": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__, "--child", str(out), level], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=1200)
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-3000:]
    return json.loads(out.read_text())


def predicted(level: str, m: dict) -> int:
    """What the level adds beside the model's own weights, by the planner: its host bytes, and on this CPU the
    card's side too: each gradient whole in backward and DeepSpeed's reduce bucket it is copied into (4 B a
    trainable weight each; the parameters level's weights gathered for forward and backward take the place of those
    it moved to the host). Without offload: the gradients and AdamW's state, where the run keeps them."""
    grads = 4 * m["trainable"]
    if level == "none":
        return grads + 8 * m["trainable"]
    return m["host"] + 2 * grads


def rows(root: Path) -> list[str]:
    out = ["| offload | trainable | RSS grown, model built → peak | planner | measured / planner |",
           "|---|---|---|---|---|"]
    for level in ("none", "optimizer", "parameters"):
        m = measure(level, root)
        grown, plan = m["peak"] - m["model"], predicted(level, m)
        out.append(f"| {level} | {m['trainable'] / 1e6:.1f} M | {grown / 2**30:.2f} GiB | {plan / 2**30:.2f} GiB | "
                   f"{grown / plan:.2f} |")
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3])
    else:
        with tempfile.TemporaryDirectory() as root:
            print("\n".join(rows(Path(root))))
