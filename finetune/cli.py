"""The ``finetune`` command (also ``python -m finetune`` and ``accelerate launch finetune/run.py``).

    finetune run --recipe minilm-sentiment [...]     train (the flags below; finetune/run.py takes the same)
    finetune run --processes 2 --recipe R [...]       the same with 2 processes on this machine (finetune.launch)
    finetune ls                                       the recipes, one a line
    finetune validate RECIPE [--set k=v ...]          load + validate, every problem listed
    finetune plan --recipe R --gpu 8GiB               memory plan: micro-batch, N, checkpointing, headroom, speed
                  [--effective-batch-size N] [--data FILE]   ... for run's effective batch and data
    finetune compare RUN_A RUN_B                      did two runs take the same optimizer steps? (exit 0 / 1 / 3)
    finetune compare BASELINE RUN                     ... BASELINE: a run another tool trained (its folder, card…)
    finetune import SOURCE [-o R.yaml] [--recipe B]   a recipe from a run another tool trained
    finetune reproduce SOURCE [--data F] [-o DIR]     import, train, compare, report.md — in one command
    finetune plot RUN                                 redraw a run's PNGs from its history
    finetune search --recipe R --trials K --param lr=loguniform:1e-5:1e-3 ...   optuna search

Bad input ends with one line ``error: <field>: <what is allowed>`` and exit code 2, before anything is written
(with several processes, from the main one only).
The ``run`` flags are generated from the recipe schema (``schema.doc(..., flag=...)``, ``finetune.flags``): one
source per field, shared with ``plan``.
The reproduce package (its sources, the certificate) is imported only by the commands that use it — compare,
import, reproduce — so that ``finetune run``'s start does not pay for it (docs/code-map.md has the times).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from finetune import distributed, flags, outputs, plan_command, runlock, search
from finetune.card import record_verdict
from finetune.config import TrainingConfig
from finetune.durable import disk_full
from finetune.errors import ConfigError, WriteError
from finetune.launch import check_processes, launch, launched_processes
from finetune.loading import load_recipe
from finetune.registry import list_recipes
from finetune.startup import check, run_recipe
from finetune.steps import NonFiniteError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage block too)
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


# ---------------------------------------------------------------------------------------------------------------
# finetune run


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", help="recipe name (see --list-recipes) or path to a YAML file")
    p.add_argument("--list-recipes", action="store_true", help="list the recipes, one a line, and exit")
    flags.add_field_flags(p)
    flags.add_data_flag(p)
    p.add_argument("--use-amp", action="store_true", help="mixed precision: fp16 on CUDA, bf16 otherwise")
    p.add_argument("--resume", metavar="latest|PATH",
                   help="continue a run: 'latest' checkpoint of --output-dir, or a checkpoint directory")
    p.add_argument("--processes", type=int, metavar="N",
                   help="train with N processes on this machine (DDP; gloo on CPU), checked before they start")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any recipe field (repeatable), e.g. --set training.warmup_steps=10")


def overrides_from_args(args) -> list[str]:
    """The run flags as ``section.key=value`` overrides, applied before ``--set``."""
    out = flags.field_overrides(args)
    if args.use_amp and args.mixed_precision is None:
        out.append(f"training.mixed_precision={distributed.amp_precision()}")
    return out + list(args.set)


def cmd_run(args) -> int:
    if args.list_recipes:
        return cmd_ls(args)
    if not args.recipe:
        raise ConfigError("--recipe: required (one of: " + ", ".join(n for n, _ in list_recipes()) + ")")
    check_processes(args.processes)

    def load():
        return load_recipe(args.recipe, overrides_from_args(args))

    cfg = load() if launched_processes() == 1 else distributed.agree(load)  # launched: every process stops alike
    if (args.processes or 1) > 1 and launched_processes() == 1:  # start the processes, then each runs the rest
        return launch(cfg, args.resume, args.argv, args.processes)
    try:
        run_recipe(cfg, check(cfg, args.resume))  # check takes the run directory's lock (main process)
    finally:
        runlock.release_all()
    return 0


# ---------------------------------------------------------------------------------------------------------------
# the other commands


def cmd_ls(args) -> int:
    for name, desc in list_recipes():
        print(f"{name:<24} {desc}")
    return 0


def cmd_validate(args) -> int:
    cfg = load_recipe(args.recipe, args.set)
    for note in cfg.notes:  # one process: it speaks
        print(note, file=sys.stderr)
    t = cfg.training
    batch = f"effective batch {t.effective_batch_size}" if t.effective_batch_size else \
        f"N {t.gradient_accumulation_steps or 1}"
    print(f"{cfg.name}: ok (task {cfg.task}; micro-batch {t.batch_size}, {batch}, {t.epochs} epochs, "
          f"{t.optimizer} lr {t.learning_rate:g})")
    return 0


def cmd_compare(args) -> int:
    from finetune.reproduce.baseline_check import compare_with_baseline
    from finetune.reproduce.compare import compare_runs
    from finetune.reproduce.plots import plot_against_baseline, plot_comparison
    from finetune.reproduce.runs import read_run
    from finetune.reproduce.sources import read_baseline

    # RUN_A may be a run another tool trained (any the sources read): checked against its logs, read once
    baseline = read_baseline(args.run_a, "compare")
    runs = baseline.run is not None  # finetune's own run (or its card's run here): run against run
    compare, plot = (compare_runs, plot_comparison) if runs else (compare_with_baseline, plot_against_baseline)
    first = read_run(baseline.run) if runs else baseline
    run_b = read_run(args.run_b)  # once: for the comparison and the curves
    result = compare(first, run_b, weight_rtol=args.rtol, loss_rtol=args.loss_rtol, twin=args.floor)
    print(result.report())
    for card in record_verdict(args.run_b, result.verdict.line, args.run_a):
        print(f"verdict recorded in {card}", file=sys.stderr)  # the verdict stays the report's last line
    if args.plot:
        print(f"curves: {plot(first, run_b, args.plot)}")
    return result.exit_code  # 0 equivalent, 1 differs, 3 not certified


def cmd_import(args) -> int:
    from finetune.reproduce import importer

    return importer.main(args)


def cmd_reproduce(args) -> int:
    from finetune.reproduce import command

    return command.main(args, main)


def cmd_plot(args) -> int:
    run = Path(args.run)
    history = outputs.read_history(run, "plot")
    if not history:
        raise ConfigError(f"plot: {run / 'history.jsonl'} holds no optimizer steps yet")
    # the run's own smoothing; a run without config.yaml gets the field's default
    beta = ((outputs.read_config(run) or {}).get("training") or {}).get("ema_beta", TrainingConfig.ema_beta)
    for path in outputs.write_plots(history, run, outputs.read_metrics(run).get("val_history", []), beta):
        print(path)
    return 0


def cmd_plan(args) -> int:
    return plan_command.main(args)


def cmd_search(args) -> int:
    return search.main(args)


# the commands that never use the reproduce package: parsing one of them does not import it (its parsers' help
# names the sources it reads, which takes importing them all)
LIGHT = ("run", "ls", "validate", "plot", "plan", "search")


def add_reproduce_commands(sub) -> None:
    """``compare``, ``import`` and ``reproduce``: the commands of the reproduce package, which is imported here."""
    from finetune.reproduce import command, importer
    from finetune.reproduce.sources import names

    c = sub.add_parser("compare", help=f"did two runs take the same optimizer steps? (RUN_A: also a run of {names()})")
    c.add_argument("run_a", metavar="RUN_A|BASELINE")
    c.add_argument("run_b")
    c.add_argument("--rtol", type=float, default=None,
                   help="weights: max relative difference allowed (default 1e-5; 8-bit optimizer: only reported)")
    c.add_argument("--loss-rtol", type=float, default=None,
                   help="loss curve: max relative difference allowed (default 1e-4; 1e-2 with an 8-bit optimizer)")
    c.add_argument("--floor", metavar="TWIN", help="a twin run (RUN_A's recipe at another --batch-size; against a "
                                                   "baseline, RUN_B's): the rounding floor is measured between them "
                                                   "and each step held to 4× it")
    c.add_argument("--plot", metavar="PNG", help="write both runs' loss and lr curves here")
    c.epilog = "exit code 0 equivalent, 1 differs, 3 not certified (outside an assumed floor: measure it with --floor)"
    c.set_defaults(func=cmd_compare)
    i = sub.add_parser("import", help=f"a recipe from a run of {names()}")
    importer.add_arguments(i)
    i.set_defaults(func=cmd_import)
    command.add_arguments(sub.add_parser("reproduce", help="import, train, compare and report in one command"))
    sub.choices["reproduce"].set_defaults(func=cmd_reproduce)


def build_parser(prog: str = "finetune", command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser; ``command``: the one about to be parsed — for one of ``LIGHT`` the reproduce
    commands are left out (None: every command, as ``--help`` lists them)."""
    p = _Parser(prog=prog, description="Reproduce a big-batch fine-tuning baseline with exact accumulation.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    r = sub.add_parser("run", help="train a recipe")
    add_run_arguments(r)
    r.set_defaults(func=cmd_run)
    sub.add_parser("ls", help="list the recipes").set_defaults(func=cmd_ls)
    v = sub.add_parser("validate", help="load and validate a recipe, listing every problem")
    v.add_argument("recipe")
    v.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    v.set_defaults(func=cmd_validate)
    if command not in LIGHT:
        add_reproduce_commands(sub)
    pl = sub.add_parser("plot", help="redraw a run's loss / lr / grad-norm PNGs")
    pl.add_argument("run")
    pl.set_defaults(func=cmd_plot)
    plan_command.add_arguments(sub.add_parser("plan", help="memory plan for a recipe on a GPU size"))
    sub.choices["plan"].set_defaults(func=cmd_plan)
    search.add_arguments(sub.add_parser("search", help="optuna search over recipe fields"))
    sub.choices["search"].set_defaults(func=cmd_search)
    return p


def main(argv=None, prog: str = "finetune") -> int:
    """Parse and run one command; a ConfigError is printed as one line per problem and exits 2. With several
    processes only the main one prints, and a refusal they agreed on (``distributed.agree``) ends them together."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog, argv[0] if argv else None)
    args = parser.parse_args(argv)
    args.argv = argv
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except ConfigError as e:
        return _stop(e.problems, 2, together=getattr(e, "agreed", False))
    except WriteError as e:  # a full disk: said with the directory; the previous checkpoint is intact
        return _stop(e.problems, 1, together=getattr(e, "agreed", False))
    except NonFiniteError as e:  # the run diverged: say where; the last checkpoint is intact. Every process
        return _stop([str(e)], 1, together=True)  # raises it at the same step (the grad norm is global)
    except OSError as e:
        if not disk_full(e):
            raise
        where = f" writing {e.filename}" if e.filename else ""
        return _stop([f"output.dir: no space left on device{where}"], 1)


def _stop(problems: list, code: int, together: bool = False) -> int:
    """Print ``problems`` (main process only); with ``together``, wait for the run's other processes, which stop
    for the same reason, so that none is killed by its launcher before the main process has said why."""
    if distributed.is_main_process():
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr, flush=True)
    if together and launched_processes() > 1:
        distributed.wait_for_everyone()
    return code


def run_main(argv=None) -> int:
    """``finetune/run.py [flags]`` = ``finetune run [flags]``."""
    return main(["run", *(sys.argv[1:] if argv is None else argv)], prog="finetune/run.py")


if __name__ == "__main__":
    sys.exit(main())
