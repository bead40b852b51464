"""Train a recipe: ``accelerate launch finetune/run.py --recipe minilm-sentiment [--batch-size 8 ...]``.

parse → load + validate the recipe → build the task → train (finetune.loop) → write the outputs.
Bad input ends with one line ``error: <field>: <what is allowed>`` and exit code 2, before anything is written.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: import the package, not this folder's modules as top-level names
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

import argparse
import time

from finetune.config import ConfigError, dump_config, list_recipes, load_recipe

# CLI flag → recipe field
FLAGS = {
    "batch_size": "training.batch_size",
    "grad_accum_steps": "training.gradient_accumulation_steps",
    "effective_batch_size": "training.effective_batch_size",
    "epochs": "training.epochs",
    "max_steps": "training.max_steps",
    "lr": "training.learning_rate",
    "mixed_precision": "training.mixed_precision",
    "seed": "training.seed",
    "output_dir": "output.dir",
    "save_every": "output.save_every",
    "keep_last": "output.keep_checkpoints",
}
# fields whose change between a checkpoint and its resumption changes the result (the micro-batch split does not:
# the effective batch is compared instead)
_NEUTRAL = {"training.batch_size", "training.gradient_accumulation_steps", "training.effective_batch_size",
            "training.num_workers", "training.gradient_checkpointing", "training.cudnn_benchmark",
            "training.ema_beta", "training.eval_every", "training.eval_at_start", "training.on_nonfinite", "output.dir", "output.overwrite",
            "output.save_every", "output.keep_checkpoints", "output.plots", "output.tracker", "output.save_model",
            "description", "name"}
SWITCHES = {"gradient_checkpointing": "training.gradient_checkpointing", "compile": "training.compile"}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage block too)
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def build_parser(prog=None) -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="Fine-tune a recipe with exact gradient accumulation.")
    p.add_argument("--recipe", help="recipe name (see --list-recipes) or path to a YAML file")
    p.add_argument("--list-recipes", action="store_true", help="list the recipes, one a line, and exit")
    p.add_argument("--batch-size", help="micro-batch: samples per process per forward/backward")
    p.add_argument("--grad-accum-steps", help="N: micro-batches per optimizer step")
    p.add_argument("--effective-batch-size", help="samples per optimizer step (all processes); derives N exactly")
    p.add_argument("--epochs", help="passes over the training data")
    p.add_argument("--max-steps", help="stop after this many optimizer steps")
    p.add_argument("--lr", help="peak learning rate")
    p.add_argument("--mixed-precision", help="no | fp16 | bf16")
    p.add_argument("--use-amp", action="store_true", help="mixed precision: fp16 on CUDA, bf16 otherwise")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--seed", help="seed of init, sample order and dropout")
    p.add_argument("--output-dir", help="where config.yaml, history.jsonl, metrics.json, plots and the model go")
    p.add_argument("--save-every", help="checkpoint every K optimizer steps and at the end")
    p.add_argument("--keep-last", help="keep the newest M checkpoints (default 2)")
    p.add_argument("--resume", metavar="latest|PATH",
                   help="continue a run: 'latest' checkpoint of --output-dir, or a checkpoint directory")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any recipe field (repeatable), e.g. --set training.warmup_steps=10")
    return p


def overrides_from_args(args) -> list[str]:
    out = [f"{field}={getattr(args, flag)}" for flag, field in FLAGS.items() if getattr(args, flag) is not None]
    out += [f"{field}=true" for flag, field in SWITCHES.items() if getattr(args, flag)]
    if args.effective_batch_size is not None and args.grad_accum_steps is not None:
        raise ConfigError("--effective-batch-size: give it or --grad-accum-steps, not both")
    if args.grad_accum_steps is not None:  # an explicit N replaces the recipe's effective batch
        out.append("training.effective_batch_size=null")
    if args.use_amp and args.mixed_precision is None:
        import torch

        out.append(f"training.mixed_precision={'fp16' if torch.cuda.is_available() else 'bf16'}")
    return out + list(args.set)


def output_dir_for(cfg, resume=None) -> Path:
    """The run's output directory; refused (before anything is written) if it would overwrite another run."""
    if resume is not None and resume != "latest" and not cfg.output.dir:
        return Path(resume).resolve().parent.parent  # <run>/checkpoints/step-…
    if resume == "latest" and not cfg.output.dir:
        raise ConfigError("resume: 'latest' needs --output-dir (the run to continue)")
    out = Path(cfg.output.dir) if cfg.output.dir else Path("runs") / cfg.name / time.strftime("%Y%m%d-%H%M%S")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output.dir: {out} is a file; give a directory")
    if resume is None and out.is_dir() and any(out.iterdir()) and not cfg.output.overwrite:
        raise ConfigError(f"output.dir: {out} already holds files; pick a new directory or set output.overwrite=true")
    return out


def main(argv=None, prog=None) -> int:
    args = build_parser(prog).parse_args(argv)
    if args.list_recipes:
        for name, desc in list_recipes():
            print(f"{name:<24} {desc}")
        return 0
    if not args.recipe:
        print("error: --recipe: required (one of: " + ", ".join(n for n, _ in list_recipes()) + ")",
              file=sys.stderr)
        return 2
    from finetune.loop import NonFiniteError

    try:
        return _run(args)
    except ConfigError as e:
        for problem in e.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    except NonFiniteError as e:  # the run diverged: say where; the last checkpoint is intact
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(args) -> int:
    from accelerate.utils import broadcast_object_list

    from finetune import checkpoint, loop

    cfg = load_recipe(args.recipe, overrides_from_args(args))
    state = loop.distributed_state()
    out_dir = [output_dir_for(cfg, args.resume) if state.is_main_process else None]
    if state.num_processes > 1:  # every process writes to the same place (timestamps differ between them)
        broadcast_object_list(out_dir)
    out_dir = out_dir[0]
    resume_from = None
    if args.resume is not None:
        resume_from = checkpoint.find_checkpoint(args.resume, out_dir)  # refuses a missing / corrupt checkpoint
        if state.is_main_process:
            warn_if_result_changes(resume_from, cfg, state.num_processes)
    loop.check_environment(cfg.training, cfg.output.tracker)  # fail on what this machine can't run, on a bad
    loop.resolve_accumulation(cfg.training, state.num_processes)  # effective batch, before building anything

    execute(cfg, out_dir, resume_from)
    return 0


def execute(cfg, out_dir: Path, resume_from=None, on_eval=None) -> dict:
    """Build the recipe's task, train it through the shared loop, write the outputs; return the loop's result."""
    from accelerate.utils import set_seed

    from finetune import checkpoint, loop, outputs
    from finetune.config import task_module

    state = loop.distributed_state()
    if not state.is_main_process:  # one process speaks: the others keep quiet about loading and mapping
        import datasets
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        datasets.disable_progress_bars()
    set_seed(cfg.training.seed)  # model init (new heads) is part of the reproduction
    job = task_module(cfg.task).build(cfg)
    loop.check_job(job, cfg.training)
    config_text = dump_config(cfg)
    if state.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        checkpoint.atomic_write_text(out_dir / "config.yaml", config_text)
    start = time.perf_counter()
    result = loop.train(job, cfg.training, output_dir=out_dir,
                        log_with=None if cfg.output.tracker == "none" else cfg.output.tracker,
                        tracker_config=cfg.to_dict(), save_every=cfg.output.save_every,
                        keep_checkpoints=cfg.output.keep_checkpoints, resume_from=resume_from,
                        config_text=config_text, on_eval=on_eval)
    result["extra_metrics"] = {"train_seconds": round(time.perf_counter() - start, 2), "recipe": cfg.name}
    accelerator = result["accelerator"]
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if job.summarize is not None:
            result["extra_metrics"].update(job.summarize(result["model"], out_dir))
        outputs.write_metrics(result, out_dir)
        if cfg.output.plots and result["history"]:
            outputs.write_plots(result["history"], out_dir, result["val_history"])
        if cfg.output.save_model:
            outputs.save_model(result["model"], out_dir, job.tokenizer, job.save)
        final = " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in result["final_metrics"].items())
        pad = f"; padding efficiency {result['tokens'] / result['padded_tokens']:.0%}" \
            if result.get("padded_tokens") else ""
        print(f"done: {result['optimizer_steps']} optimizer steps in {result['extra_metrics']['train_seconds']} s;"
              f" {final}{pad}; outputs in {out_dir}", flush=True)
    return result


def warn_if_result_changes(path: Path, cfg, processes: int) -> None:
    """One line naming the settings that differ from the checkpoint's and change the result."""
    import json

    import yaml

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out

    try:
        old = flat(yaml.safe_load((path / "config.yaml").read_text()) or {})
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        return
    new = flat(cfg.to_dict())
    changed = [f"{k} ({old.get(k)!r} → {new.get(k)!r})" for k in sorted(set(old) | set(new))
               if k not in _NEUTRAL and old.get(k) != new.get(k)]
    t = cfg.training
    from finetune.loop import resolve_accumulation

    effective = t.batch_size * resolve_accumulation(t, processes) * processes
    if manifest.get("effective_batch_size") not in (None, effective):
        changed.insert(0, f"effective batch ({manifest['effective_batch_size']} → {effective})")
    if changed:
        print("warning: resuming with settings that change the result: " + ", ".join(changed), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
