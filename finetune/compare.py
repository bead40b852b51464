"""``finetune compare RUN_A RUN_B``: did two runs take the same optimizer steps?

Checks, in order, and stops at the first that differs: the optimizer (from each run's ``config.yaml``, when it has
one), effective batch, number of optimizer steps, the samples each window held (the history's order-free hash of each
window's sample ids), the learning rate of every step, the loss curve, and finally the trained weights (max relative
difference). Exit code 0 when equivalent within tolerance.

Runs with an 8-bit optimizer (``adamw8bit``, ``paged_adamw8bit``) are never called equivalent: their optimizer state
is quantized block-wise, so gradients equal to fp32 rounding (``(b, N)`` against ``(b·N, 1)``) can round to
neighbouring 8-bit codes, and the weights drift apart by far more than fp32 rounding (SmolLM2 QLoRA: 1.6e-3 after 6
steps; docs/low-precision.md). The report says so, checks the windows, the schedule and the loss
curve (at ``EIGHT_BIT_LOSS_RTOL``), and prints how far the weights ended apart without judging them (unless
``weight_rtol`` is given). Exit code 0 then means: the same windows and schedule, loss curves close.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

FP32_WEIGHT_RTOL, FP32_LOSS_RTOL = 1e-5, 1e-4
# The loss curves of two runs of the same steps with an 8-bit optimizer (their weights drift apart, see above).
EIGHT_BIT_LOSS_RTOL = 1e-2


@dataclass
class Comparison:
    checks: list = field(default_factory=list)   # (name, ok, detail); ok None: reported, not judged
    first_difference: str | None = None
    eight_bit: str | None = None                 # the 8-bit optimizer a run used: no fp32 equivalence to claim

    def add(self, name: str, ok, detail: str) -> None:
        self.checks.append((name, ok, detail))
        if ok is False and self.first_difference is None:
            self.first_difference = f"{name}: {detail}"

    @property
    def equivalent(self) -> bool:
        return self.first_difference is None

    def report(self) -> str:
        width = max(len(n) for n, _, _ in self.checks) if self.checks else 10
        mark = {True: "ok", False: "DIFF", None: "info"}
        lines = [f"{mark[ok]:<4}  {name:<{width}}  {detail}" for name, ok, detail in self.checks]
        if not self.equivalent:
            lines.append(f"verdict: differs — {self.first_difference}")
        elif self.eight_bit:
            lines.append(f"verdict: the same windows and schedule, loss curves close; no fp32 equivalence "
                         f"claimed — {self.eight_bit}: 8-bit optimizer: not the fp32 step")
        else:
            lines.append("verdict: equivalent")
        return "\n".join(lines)


def read_run(run: Path) -> dict:
    from finetune.outputs import read_history, read_metrics

    return {"history": read_history(run, "compare"), "metrics": read_metrics(run), "weights": _weights(run),
            "optimizer": _optimizer(run)}


def _optimizer(run: Path) -> str | None:
    """``training.optimizer`` from the run's ``config.yaml`` (every ``finetune run`` writes one); None if unknown."""
    import yaml

    try:
        training = (yaml.safe_load((run / "config.yaml").read_text()) or {}).get("training") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return training.get("optimizer") if isinstance(training, dict) else None


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


def compare_runs(run_a, run_b, weight_rtol: float | None = None, loss_rtol: float | None = None) -> Comparison:
    """Compare two run directories at fp32's tolerances (``FP32_WEIGHT_RTOL``, ``FP32_LOSS_RTOL``) unless given; a
    run with an 8-bit optimizer is compared as the module's docstring says."""
    from finetune.optim import EIGHT_BIT

    a, b = read_run(Path(run_a)), read_run(Path(run_b))
    ha, hb = a["history"], b["history"]
    c = Comparison()

    oa, ob = a["optimizer"], b["optimizer"]
    c.eight_bit = next((o for o in (oa, ob) if o in EIGHT_BIT), None)
    judge_weights = weight_rtol is not None or not c.eight_bit
    weight_rtol = weight_rtol if weight_rtol is not None else FP32_WEIGHT_RTOL
    loss_rtol = loss_rtol if loss_rtol is not None else EIGHT_BIT_LOSS_RTOL if c.eight_bit else FP32_LOSS_RTOL
    if oa is not None and ob is not None:
        c.add("optimizer", oa == ob, f"{oa} vs {ob}" if oa != ob else
              f"{oa}{' (8-bit optimizer: not the fp32 step)' if c.eight_bit else ''}")

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
        c.add("weights", rel <= weight_rtol if judge_weights else None, f"max relative difference {rel:.2e} " + (
            f"(tolerance {weight_rtol:g})" if judge_weights else
            f"(not judged: 8-bit optimizer: not the fp32 step, no fp32 tolerance {FP32_WEIGHT_RTOL:g} applies)"))
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
