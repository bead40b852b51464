"""``finetune compare RUN_A RUN_B``: did two runs take the same optimizer steps?

Checks, in order, and stops at the first that differs: effective batch, number of optimizer steps, the samples each
window held (the history's order-free hash of each window's sample ids), the learning rate of every step, the loss
curve, and finally the trained weights (max relative difference). Exit code 0 when equivalent within tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Comparison:
    checks: list = field(default_factory=list)   # (name, ok, detail)
    first_difference: str | None = None

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append((name, ok, detail))
        if not ok and self.first_difference is None:
            self.first_difference = f"{name}: {detail}"

    @property
    def equivalent(self) -> bool:
        return self.first_difference is None

    def report(self) -> str:
        width = max(len(n) for n, _, _ in self.checks) if self.checks else 10
        lines = [f"{'ok' if ok else 'DIFF':<4}  {name:<{width}}  {detail}" for name, ok, detail in self.checks]
        lines.append("verdict: equivalent" if self.equivalent else f"verdict: differs — {self.first_difference}")
        return "\n".join(lines)


def read_run(run: Path) -> dict:
    from finetune.outputs import read_history, read_metrics

    return {"history": read_history(run, "compare"), "metrics": read_metrics(run), "weights": _weights(run)}


def _weights(run: Path) -> dict | None:
    from safetensors.torch import load_file

    for name in ("model/model.safetensors", "model/adapter_model.safetensors", "model-merged/model.safetensors"):
        if (run / name).is_file():
            return load_file(str(run / name))
    shards = sorted((run / "model").glob("model-*.safetensors")) if (run / "model").is_dir() else []
    if shards:
        out = {}
        for s in shards:
            out.update(load_file(str(s)))
        return out
    return None


def flat(model, trainable_only: bool = False) -> torch.Tensor:
    """The parameters of ``model`` flattened into one fp64 tensor on the CPU; ``trainable_only``: those that train
    (a LoRA model's adapters), as a benchmark of what trains compares them."""
    return torch.cat([p.detach().flatten().double().cpu() for p in model.parameters()
                      if p.requires_grad or not trainable_only])


def rel_diff(a, b, trainable_only: bool = False) -> float:
    """max |a − b| / max |b|: how far weights ``a`` are from ``b``, relative to the largest of ``b``. ``a``, ``b``:
    models (their parameters, see :func:`flat`) or flat tensors.

        >>> rel_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
        0.5
    """
    a = a if isinstance(a, torch.Tensor) else flat(a, trainable_only)
    b = b if isinstance(b, torch.Tensor) else flat(b, trainable_only)
    return float((a - b).abs().max() / b.abs().max())


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def compare_runs(run_a, run_b, weight_rtol: float = 1e-5, loss_rtol: float = 1e-4) -> Comparison:
    a, b = read_run(Path(run_a)), read_run(Path(run_b))
    ha, hb = a["history"], b["history"]
    c = Comparison()

    ea, eb = a["metrics"].get("effective_batch_size"), b["metrics"].get("effective_batch_size")
    split = lambda m: f"{m.get('effective_batch_size')} ({m.get('gradient_accumulation_steps')} micro-batches/step)"
    c.add("effective batch", ea == eb, f"{split(a['metrics'])} vs {split(b['metrics'])}")
    c.add("optimizer steps", len(ha) == len(hb), f"{len(ha)} vs {len(hb)}")
    n = min(len(ha), len(hb))

    bad = next((i for i in range(n) if ha[i].get("window_hash") != hb[i].get("window_hash")), None)
    c.add("window samples", bad is None, f"all {n} windows held the same samples" if bad is None else
          f"step {ha[bad]['step']} (epoch {ha[bad]['epoch']}, window {ha[bad]['window']}) held different samples")

    bad = next((i for i in range(n) if _rel(ha[i]["lr"], hb[i]["lr"]) > 1e-9), None)
    c.add("lr schedule", bad is None, "identical" if bad is None else
          f"step {ha[bad]['step']}: {ha[bad]['lr']:.6g} vs {hb[bad]['lr']:.6g}")

    diffs = [_rel(ha[i]["loss"], hb[i]["loss"]) for i in range(n)
             if math.isfinite(ha[i]["loss"]) and math.isfinite(hb[i]["loss"])]
    worst = max(diffs, default=0.0)
    bad = next((i for i, d in enumerate(diffs) if d > loss_rtol), None)
    c.add("loss curve", bad is None, f"max relative difference {worst:.2e}" + (
        "" if bad is None else f", first above {loss_rtol:g} at step {ha[bad]['step']}"))

    wa, wb = a["weights"], b["weights"]
    if wa is None or wb is None:
        c.add("weights", False, "a run has no saved model to compare")
    elif wa.keys() != wb.keys():
        c.add("weights", False, "different parameter names")
    else:
        num = max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa)
        den = max(float(wb[k].double().abs().max()) for k in wb)
        rel = num / max(den, 1e-30)
        c.add("weights", rel <= weight_rtol, f"max relative difference {rel:.2e} (tolerance {weight_rtol:g})")
    return c


def plot_comparison(run_a, run_b, path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b = read_run(Path(run_a))["history"], read_run(Path(run_b))["history"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for hist, name, style in ((a, Path(run_a).name, "-"), (b, Path(run_b).name, "--")):
        axes[0].plot([h["step"] for h in hist], [h["loss"] for h in hist], style, label=name)
        axes[1].plot([h["step"] for h in hist], [h["lr"] for h in hist], style, label=name)
    for ax, title in zip(axes, ("window loss", "learning rate")):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
