"""``finetune compare --plot`` and ``finetune reproduce``'s curves: two runs', or a baseline's and a run's, loss and
learning rate side by side."""

from __future__ import annotations

from pathlib import Path

from finetune.outputs import pyplot
from finetune.reproduce.record import Baseline
from finetune.reproduce.runs import read_run


def plot_comparison(run_a, run_b, path) -> Path:
    """Two runs' (folders, or ``runs.Run`` already read) loss, lr and grad norm at each step."""
    plt = pyplot()
    a, b = read_run(run_a), read_run(run_b)
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.5))
    for hist, name, style in ((a.history, a.path.name, "-"), (b.history, b.path.name, "--")):
        for ax, key in zip(axes, ("loss", "lr", "grad_norm")):
            ax.plot([h["step"] for h in hist], [h[key] for h in hist], style, label=name)
    return save_curves(fig, axes, ("window loss", "learning rate", "grad norm (before clipping)"), path)


def plot_against_baseline(b: Baseline, run, path) -> Path:
    """The baseline's logged loss and lr over this run's (a folder, or a ``runs.Run``; its loss as the same means
    over the logged steps)."""
    plt = pyplot()
    mine = read_run(run)
    hist, name = mine.history, mine.path.name
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    logs = b.logs or [{"step": s, "loss": v} for s, v in b.card_losses]
    axes[0].plot([e["step"] for e in logs], [e["loss"] for e in logs], "-", label=f"{b.kind} {b.path.name}")
    axes[0].plot([h["step"] for h in hist], [h["loss"] for h in hist], "--", label=name)
    if b.evals:
        axes[0].plot([s for s, _ in b.evals], [v for _, v in b.evals], "o", label="baseline eval")
    if any("learning_rate" in e for e in logs):
        axes[1].plot([e["step"] for e in logs], [e["learning_rate"] for e in logs], "-", label="baseline")
    axes[1].plot([h["step"] for h in hist], [h["lr"] for h in hist], "--", label=name)
    return save_curves(fig, axes, ("training loss", "learning rate"), path)


def save_curves(fig, axes, titles, path) -> Path:
    """Title, label and save the side-by-side curves of ``compare --plot``."""
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return Path(path)
