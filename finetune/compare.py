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

import json
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
    qualifier: str | None = None                 # what an "equivalent" verdict rests on (a band, unchecked items)

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
            lines.append("verdict: equivalent" + (f" — {self.qualifier}" if self.qualifier else ""))
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
    return save_curves(fig, axes, ("window loss", "learning rate"), path)


# ---------------------------------------------------------------------------------------------------------------
# a baseline another tool trained: an HF Trainer / TRL folder or its model card

# Where the baseline's loss cannot be replayed exactly, the band it is held to, and why.
MIXED_PRECISION_BAND = 1e-2   # bf16 / fp16 autocast rounds the two runs' matmuls differently
DROPOUT_BAND = 5e-2           # other dropout masks: only the expectation of the loss matches
CARD_ROUNDING = 5e-5          # a model card prints losses with 4 decimals


def is_finetune_run(path) -> bool:
    return (Path(path) / "history.jsonl").is_file()


def _mine(run: Path) -> dict:
    import yaml

    out = read_run(run)
    try:
        out["config"] = yaml.safe_load((run / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        out["config"] = {}
    config = run / "model" / "config.json"
    out["model_config"] = json.loads(config.read_text()) if config.is_file() else None
    return out


def loss_band(b, mine: dict) -> tuple[float, str | None]:
    """The relative tolerance of the training loss, and why it is wider than an exact replay's (None: exact)."""
    t = mine["config"].get("training") or {}
    precision = "bf16" if b.get("bf16") else "fp16" if b.get("fp16") else None
    ours = t.get("mixed_precision")
    if precision or ours not in (None, "no"):
        return MIXED_PRECISION_BAND, (f"mixed precision ({precision or 'fp32'} baseline, {ours or 'no'} here) "
                                      "rounds each side differently")
    cfg, adapter = b.model_config or {}, b.adapter_config or {}
    drops = {k: v for k, v in cfg.items() if ("dropout" in k or k.endswith("pdrop")) and
             isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}
    if adapter.get("lora_dropout"):
        drops["lora_dropout"] = adapter["lora_dropout"]
    if drops:
        return DROPOUT_BAND, (f"the baseline trained with dropout ({', '.join(f'{k}={v}' for k, v in drops.items())})"
                              ": other masks, only the expectation of the loss matches")
    return FP32_LOSS_RTOL, None


def compare_with_baseline(baseline, run, weight_rtol: float | None = None,
                          loss_rtol: float | None = None) -> Comparison:
    """Check finetune run ``run`` against a baseline another tool trained (``finetune.baselines``), in order:
    effective batch, optimizer steps, the samples of every window (the Trainer's order recomputed from the
    baseline's seed), the lr and the training loss at every logged step (our mean over the steps each log entry
    covers: ``logging_steps`` > 1 logs a mean), the evaluation loss, the weights. What the baseline does not show
    (a model card has no lr, no weights) is reported as not checkable. Raises ConfigError when the two models differ
    or the baseline is unreadable."""
    from finetune.baselines import read_baseline
    from finetune.errors import ConfigError
    from finetune.recipe_import import model_difference

    b, mine = read_baseline(baseline, "compare"), _mine(Path(run))
    diff = model_difference(b.model_config, mine["model_config"])
    if diff:
        raise ConfigError(f"compare: the baseline's model differs from {run}'s: {diff}")
    history, c, unchecked = mine["history"], Comparison(), []
    card = b.kind == "model card"

    eb, em = b.effective_batch(), mine["metrics"].get("effective_batch_size")
    c.add("effective batch", eb == em if eb is not None else None,
          f"{eb} ({b.kind}) vs {em} ({mine['metrics'].get('gradient_accumulation_steps')} micro-batches/step)"
          if eb is not None else f"not in the {b.kind}")
    steps = b.max_steps or b.get("schedule_steps")
    c.add("optimizer steps", steps == len(history) if steps else None,
          f"{steps} vs {len(history)}" if steps else f"not in the {b.kind}")
    _check_windows(c, b, history, mine, unchecked)

    by_step = {h["step"]: h for h in history}
    logs = [e for e in b.logs if e["step"] in by_step]
    if not b.logs:
        unchecked.append("lr schedule")
        c.add("lr schedule", None, f"not checkable: the {b.kind} logs no learning rate")
    else:
        bad = next((e for e in logs if _rel(e.get("learning_rate", float("nan")), by_step[e["step"]]["lr"]) > 1e-9),
                   None)
        c.add("lr schedule", bad is None and len(logs) == len(b.logs),
              f"identical at all {len(logs)} logged steps" if bad is None and len(logs) == len(b.logs) else
              f"step {bad['step']}: {bad.get('learning_rate'):.6g} vs {by_step[bad['step']]['lr']:.6g}" if bad else
              f"{len(b.logs) - len(logs)} logged steps are past this run's last step")

    band, why = loss_band(b, mine)
    band = loss_rtol if loss_rtol is not None else band
    if b.logs:
        _check_logged_loss(c, b.logs, history, band, why, int(b.get("logging_steps") or 1))
    elif b.card_losses:
        unchecked.append("training loss")
        c.add("loss curve", None, "not checkable: the card's Training Loss is the mean over logging_steps, which "
                                  "the card does not say")
    _check_eval(c, b, mine, band, CARD_ROUNDING if card else 0.0)

    if b.weights is None:
        unchecked.append("weights")
        c.add("weights", None, f"not checkable: the {b.kind} holds no weights")
    else:
        _check_weights(c, b.weights, mine["weights"], weight_rtol if weight_rtol is not None else FP32_WEIGHT_RTOL)
    notes = ([f"loss held to {band:g}, not {FP32_LOSS_RTOL:g}: {why}"] if why else []) + \
        ([f"not checkable from the {b.kind}: {', '.join(unchecked)}"] if unchecked else [])
    c.qualifier = "; ".join(notes) or None
    return c


def _check_windows(c: Comparison, b, history: list, mine: dict, unchecked: list) -> None:
    """Each window's samples against the Trainer's batch: its order recomputed from the baseline's seed (data_seed
    when set) and effective batch over this run's training set."""
    from finetune.windows import membership_hash, plan_epoch

    seed = b.get("data_seed") if b.get("data_seed") is not None else b.get("seed")
    size, epochs = b.effective_batch(), sorted({h["epoch"] for h in history})
    n = sum(h["samples"] for h in history if h["epoch"] == 0) if len(epochs) > 1 else None
    if seed is None or not size or n is None:
        what = "seed" if seed is None else "effective batch" if not size else "training-set size (one epoch run)"
        unchecked.append("window samples")
        c.add("window samples", None, f"not checkable: the baseline's {what} is unknown")
        return
    trainer = {(e, w.index): membership_hash(w.samples) for e in epochs
               for w in plan_epoch(n, size, 1, 1, 0, int(seed), e, sample_order="trainer")}
    bad = next((h for h in history if trainer.get((h["epoch"], h["window"])) != h.get("window_hash")), None)
    order = (mine["config"].get("training") or {}).get("sample_order", "finetune")
    c.add("window samples", bad is None, f"all {len(history)} windows held the Trainer's batches (seed {seed})"
          if bad is None else f"step {bad['step']} (epoch {bad['epoch']}, window {bad['window']}) held different "
          f"samples than the Trainer's batch (this run: sample_order {order}, seed "
          f"{(mine['config'].get('training') or {}).get('seed')}; the baseline's seed {seed})")


def _check_logged_loss(c: Comparison, logs: list, history: list, rtol: float, why, every: int) -> None:
    """Each logged training loss against our mean over the steps it covers (since the previous log entry: the
    Trainer logs the mean over its ``logging_steps`` = ``every`` steps, and over fewer at the end)."""
    worst, bad, previous = 0.0, None, 0
    for e in logs:
        ours = [h["loss"] for h in history if previous < h["step"] <= e["step"]]
        previous = e["step"]
        if not ours or not math.isfinite(e["loss"]):
            continue
        mean = sum(ours) / len(ours)
        d = _rel(e["loss"], mean)
        worst = max(worst, d)
        if d > rtol and bad is None:
            bad = (e["step"], e["loss"], mean)
    per = f" (each a mean over the {every} steps since the previous log)" if every > 1 else ""
    c.add("loss curve", bad is None, f"max relative difference {worst:.2e} at {len(logs)} logged steps{per}, "
          f"tolerance {rtol:g}" + (f" (band: {why})" if why else "") + (
              "" if bad is None else f"; first above at step {bad[0]}: {bad[1]:.6g} vs {bad[2]:.6g}"))


def _check_eval(c: Comparison, b, mine: dict, rtol: float, rounding: float) -> None:
    ours = {v["step"]: v["loss"] for v in mine["metrics"].get("val_history", []) if "loss" in v}
    pairs = [(s, loss, ours[s]) for s, loss in b.evals if s in ours]
    if not b.evals:
        c.add("eval loss", None, f"the {b.kind} holds no evaluation")
        return
    if not pairs:
        c.add("eval loss", False, f"this run evaluated at none of the baseline's steps ({[s for s, _ in b.evals]})")
        return
    worst = max(_rel(x, y) for _, x, y in pairs)
    bad = next(((s, x, y) for s, x, y in pairs if abs(x - y) > rtol * abs(y) + rounding), None)
    c.add("eval loss", bad is None, f"max relative difference {worst:.2e} at steps {[s for s, _, _ in pairs]}" + (
        " (the card's 4 decimals allowed)" if rounding else "") + (
        "" if bad is None else f"; step {bad[0]}: {bad[1]:.6g} vs {bad[2]:.6g} (the Trainer averages per-batch "
                               "means: equal to finetune's token mean when the set is one eval batch)"))


def _check_weights(c: Comparison, path: Path, mine: dict | None, rtol: float) -> None:
    from safetensors.torch import load_file

    theirs = load_file(str(path))
    if mine is None:
        c.add("weights", False, "this run saved no model to compare")
    elif theirs.keys() != mine.keys():
        c.add("weights", False, f"different parameter names ({len(theirs)} vs {len(mine)} tensors)")
    else:
        num = max(float((mine[k].double() - theirs[k].double()).abs().max()) for k in theirs)
        den = max(float(theirs[k].double().abs().max()) for k in theirs)
        rel = num / max(den, 1e-30)
        c.add("weights", rel <= rtol, f"max relative difference {rel:.2e} against {path.name} (tolerance {rtol:g})")


def plot_against_baseline(baseline, run, path) -> Path:
    """The baseline's logged loss and lr over this run's (its loss as the same means over the logged steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from finetune.baselines import read_baseline

    b, hist = read_baseline(baseline, "compare"), read_run(Path(run))["history"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    logs = b.logs or [{"step": s, "loss": v} for s, v in b.card_losses]
    axes[0].plot([e["step"] for e in logs], [e["loss"] for e in logs], "-", label=f"{b.kind} {Path(baseline).name}")
    axes[0].plot([h["step"] for h in hist], [h["loss"] for h in hist], "--", label=Path(run).name)
    if b.evals:
        axes[0].plot([s for s, _ in b.evals], [v for _, v in b.evals], "o", label="baseline eval")
    if any("learning_rate" in e for e in logs):
        axes[1].plot([e["step"] for e in logs], [e["learning_rate"] for e in logs], "-", label="baseline")
    axes[1].plot([h["step"] for h in hist], [h["lr"] for h in hist], "--", label=Path(run).name)
    return save_curves(fig, axes, ("training loss", "learning rate"), path)


def save_curves(fig, axes, titles, path) -> Path:
    """Title, label and save the side-by-side curves of ``compare --plot``."""
    import matplotlib.pyplot as plt

    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
