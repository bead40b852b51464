"""``finetune search``: optuna over recipe fields, pruning on per-epoch validation.

    finetune search --recipe minilm-sentiment --trials 20 \\
        --param lr=loguniform:1e-5:1e-3 --param gradient_accumulation_steps=choice:1,2,4,8

Each trial is a normal run (its own output directory under ``--output-dir``); the best trial's parameters and
metric are printed and saved to ``best.json``. ``--param`` names a recipe field (``section.key``, or a training
field alone, ``lr`` for the learning rate) and a distribution: ``loguniform:LO:HI``, ``uniform:LO:HI``,
``int:LO:HI`` or ``choice:A,B,…``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

import torch
import yaml

from finetune import runlock
from finetune.config import TrainingConfig, fields_with
from finetune.errors import ConfigError
from finetune.loading import load_recipe
from finetune.models.forward import compute_loss
from finetune.startup import build_job, check, run_recipe

ALIASES = {alias: name for name, alias in fields_with("alias").items()}  # lr → training.learning_rate, …


def parse_param(spec: str) -> tuple[str, str, list]:
    """``"lr=loguniform:1e-5:1e-3"`` → ("training.learning_rate", "loguniform", [1e-5, 1e-3])."""
    if "=" not in spec or ":" not in spec.split("=", 1)[1]:
        raise ConfigError(f"--param {spec}: expected NAME=DIST:ARGS, e.g. lr=loguniform:1e-5:1e-3")
    name, dist = spec.split("=", 1)
    kind, _, rest = dist.partition(":")
    field = ALIASES.get(name, name if "." in name else f"training.{name}")
    if "." not in name and name not in ALIASES and name not in TrainingConfig.__dataclass_fields__:
        raise ConfigError(f"--param {name}: not a training field; use section.key for model / data fields")
    if kind == "choice":
        values = [yaml.safe_load(v) for v in rest.split(",") if v != ""]
    elif kind in ("loguniform", "uniform", "int"):
        try:
            lo, hi = (float(x) for x in rest.split(":"))
        except ValueError:
            raise ConfigError(f"--param {spec}: {kind} takes LO:HI") from None
        if not lo < hi or (kind == "loguniform" and lo <= 0):
            raise ConfigError(f"--param {spec}: needs LO < HI (and LO > 0 for loguniform)")
        values = [int(lo), int(hi)] if kind == "int" else [lo, hi]
    else:
        raise ConfigError(f"--param {spec}: distribution {kind!r}; allowed: loguniform, uniform, int, choice")
    if not values:
        raise ConfigError(f"--param {spec}: choice needs at least one value")
    return field, kind, values


def suggest(trial, field: str, kind: str, values: list):
    if kind == "choice":
        return trial.suggest_categorical(field, values)
    if kind == "int":
        return trial.suggest_int(field, values[0], values[1])
    return trial.suggest_float(field, values[0], values[1], log=kind == "loguniform")


def reported_metrics(cfg) -> list:
    """The validation metrics ``cfg`` reports: its job built once and the untrained model evaluated on a few
    validation samples (seconds, where a trial takes minutes). Empty without a validation set."""
    job = build_job(cfg)
    if job.val_data is None or len(job.val_data) == 0:
        return []
    batch = (job.collate_fn or torch.utils.data.default_collate)([job.val_data[i]
                                                                   for i in range(min(4, len(job.val_data)))])
    model = job.model.eval()
    names = ["loss"]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # metrics of four samples from an untrained model may be degenerate
        loss, _, outputs = compute_loss(model, batch, job.loss_fn)
        if job.val_loss_metrics is not None:
            names += list(job.val_loss_metrics(float(loss)))
        if job.eval_step is not None and job.compute_metrics is not None:
            preds, refs = job.eval_step(model, batch, outputs)
            names += list(job.compute_metrics(list(preds), list(refs)))
    return names


def add_arguments(p) -> None:
    p.add_argument("--recipe", required=True, help="recipe name or YAML path")
    p.add_argument("--trials", type=int, default=10, help="number of trials")
    p.add_argument("--param", action="append", default=[], metavar="NAME=DIST:ARGS",
                   help="a searched field, e.g. lr=loguniform:1e-5:1e-3 (repeatable)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="fixed overrides")
    p.add_argument("--metric", default="loss", help="validation metric to optimize (loss, accuracy, mae, …)")
    p.add_argument("--direction", choices=["minimize", "maximize"], help="default: minimize loss-like metrics")
    p.add_argument("--output-dir", default=None, help="where the trials go (default runs/<recipe>-search)")
    p.add_argument("--seed", type=int, default=0, help="seed of the search's sampler")


def main(args) -> int:
    try:  # optional (finetune[search]): only this command needs it
        import optuna
    except ImportError:
        raise ConfigError("search: needs optuna (pip install 'finetune[search]')") from None
    if args.trials < 1:
        raise ConfigError(f"--trials: got {args.trials}; must be >= 1")
    params = [parse_param(p) for p in args.param]
    if not params:
        raise ConfigError("--param: give at least one, e.g. --param lr=loguniform:1e-5:1e-3")
    base = load_recipe(args.recipe, args.set)  # validates the fixed part once, before any trial
    if args.metric != "loss":
        reported = reported_metrics(base)
        if args.metric not in reported:
            raise ConfigError(f"--metric: the recipe reports no validation {args.metric!r}; it reports "
                              + (", ".join(reported) if reported else "nothing (it has no validation set)"))
    direction = args.direction or ("maximize" if args.metric in ("accuracy", "pearson", "f1") else "minimize")
    root = Path(args.output_dir or Path("runs") / f"{base.name}-search")
    if root.is_dir() and any(root.iterdir()):
        raise ConfigError(f"--output-dir: {root} already holds files; pick a new directory")

    def objective(trial):
        overrides = list(args.set)
        for field, kind, values in params:
            overrides.append(f"{field}={suggest(trial, field, kind, values)}")
        if any(f.endswith("gradient_accumulation_steps") for f, _, _ in params):
            overrides.append("training.effective_batch_size=null")  # a searched N replaces the recipe's batch
        trial_dir = root / f"trial-{trial.number:03d}"
        cfg = load_recipe(args.recipe, overrides)
        cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, dir=str(trial_dir)))

        def report(record):  # per evaluation: report, and let the pruner stop a hopeless trial
            value = record.get(args.metric)
            if value is not None and math.isfinite(value):
                trial.report(value, record["step"])
                if trial.should_prune():
                    raise optuna.TrialPruned()

        try:  # each trial is a normal run: checked, in its own locked directory
            result = run_recipe(cfg, check(cfg), on_eval=report)
        finally:
            runlock.release(trial_dir)
        value = (result["final_metrics"] or {}).get(args.metric)
        if value is None:
            raise ConfigError(f"--metric: the recipe reports no validation {args.metric!r}; it reports "
                              f"{', '.join(k for k in result['final_metrics'] if k not in ('step', 'epoch'))}")
        return value

    study = optuna.create_study(direction=direction, sampler=optuna.samplers.TPESampler(seed=args.seed),
                                pruner=optuna.pruners.MedianPruner(n_warmup_steps=0))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=args.trials, catch=())
    best = study.best_trial
    summary = {"metric": args.metric, "direction": direction, "value": best.value, "params": best.params,
               "trial": best.number, "output_dir": str(root / f"trial-{best.number:03d}"),
               "trials": [{"number": t.number, "state": t.state.name, "value": t.value, "params": t.params}
                          for t in study.trials]}
    (root / "best.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"best trial {best.number}: {args.metric}={best.value:.4f} with "
          + ", ".join(f"{k}={v}" for k, v in best.params.items()) + f" (saved {root / 'best.json'})")
    return 0
