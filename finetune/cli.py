"""The ``finetune`` command (also ``python -m finetune``).

    finetune run --recipe minilm-sentiment [...]     train (same flags as finetune/run.py)
    finetune ls                                       the recipes, one a line
    finetune validate RECIPE [--set k=v ...]          load + validate, every problem listed
    finetune plan --recipe R --gpu 8GiB               memory plan: micro-batch, N, checkpointing
    finetune compare RUN_A RUN_B                      did two runs take the same optimizer steps?
    finetune plot RUN                                 redraw a run's PNGs from its history
    finetune search --recipe R --trials K --param lr=loguniform:1e-5:1e-3 ...   optuna search
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from finetune.config import ConfigError, list_recipes, load_recipe


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def cmd_ls(args) -> int:
    for name, desc in list_recipes():
        print(f"{name:<24} {desc}")
    return 0


def cmd_validate(args) -> int:
    cfg = load_recipe(args.recipe, args.set)
    t = cfg.training
    batch = f"effective batch {t.effective_batch_size}" if t.effective_batch_size else \
        f"N {t.gradient_accumulation_steps}"
    print(f"{cfg.name}: ok (task {cfg.task}; micro-batch {t.batch_size}, {batch}, {t.epochs} epochs, "
          f"{t.optimizer} lr {t.learning_rate:g})")
    return 0


def cmd_compare(args) -> int:
    from finetune.compare import compare_runs, plot_comparison

    result = compare_runs(args.run_a, args.run_b, weight_rtol=args.rtol, loss_rtol=args.loss_rtol)
    print(result.report())
    if args.plot:
        print(f"curves: {plot_comparison(args.run_a, args.run_b, args.plot)}")
    return 0 if result.equivalent else 1


def cmd_plot(args) -> int:
    from finetune import outputs

    run = Path(args.run)
    history_file = run / "history.jsonl"
    if not history_file.is_file():
        raise ConfigError(f"plot: {run} is not a run directory (no history.jsonl)")
    history = [json.loads(x) for x in history_file.read_text().splitlines() if x.strip()]
    metrics = json.loads((run / "metrics.json").read_text()) if (run / "metrics.json").is_file() else {}
    for path in outputs.write_plots(history, run, metrics.get("val_history", [])):
        print(path)
    return 0


def cmd_plan(args) -> int:
    from finetune import memory

    return memory.main(args)


def cmd_search(args) -> int:
    from finetune import search

    return search.main(args)


def build_parser() -> argparse.ArgumentParser:
    from finetune import run

    p = _Parser(prog="finetune", description="Reproduce a big-batch fine-tuning baseline with exact accumulation.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    sub.add_parser("run", help="train a recipe (same flags as finetune/run.py)", add_help=False)
    sub.add_parser("ls", help="list the recipes").set_defaults(func=cmd_ls)
    v = sub.add_parser("validate", help="load and validate a recipe, listing every problem")
    v.add_argument("recipe")
    v.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    v.set_defaults(func=cmd_validate)
    c = sub.add_parser("compare", help="did two runs take the same optimizer steps?")
    c.add_argument("run_a")
    c.add_argument("run_b")
    c.add_argument("--rtol", type=float, default=1e-5, help="weights: max relative difference allowed")
    c.add_argument("--loss-rtol", type=float, default=1e-4, help="loss curve: max relative difference allowed")
    c.add_argument("--plot", metavar="PNG", help="write both runs' loss and lr curves here")
    c.set_defaults(func=cmd_compare)
    pl = sub.add_parser("plot", help="redraw a run's loss / lr / grad-norm PNGs")
    pl.add_argument("run")
    pl.set_defaults(func=cmd_plot)
    from finetune import memory, search

    memory.add_arguments(sub.add_parser("plan", help="memory plan for a recipe on a GPU size"))
    sub.choices["plan"].set_defaults(func=cmd_plan)
    search.add_arguments(sub.add_parser("search", help="optuna search over recipe fields"))
    sub.choices["search"].set_defaults(func=cmd_search)
    del run
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        from finetune import run

        return run.main(argv[1:], prog="finetune run")
    args = build_parser().parse_args(argv)
    if not getattr(args, "func", None):
        build_parser().print_help()
        return 2
    try:
        return args.func(args)
    except ConfigError as e:
        for problem in e.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
