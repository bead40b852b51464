"""``finetune reproduce SOURCE [--data FILE] [-o DIR]``: import, train, compare and report in one command.

What a user types for whatever was published (any run a source of ``sources.SOURCES`` reads): the recipe is imported
(``finetune import``; the base recipe from the task the source trained), trained at a micro-batch that fits this
machine (``--batch-size auto`` unless given: the planner's pick, shrunk on an out-of-memory error, the effective batch
kept; a mixed-precision baseline's micro-batches are replayed whole where they fit, and on a CPU with the threads
each of its processes had, so that step 1 runs its kernels: :mod:`replay`), compared with the source's own logs
(``finetune compare``) and written up in ``DIR/report.md`` — the verdict, each layer, the curves side by side
(``DIR/curves.png``) and the commands that did it. In mixed precision the rounding floor is measured, not assumed: a
twin run (the same recipe at another micro-batch) is trained too and passed to compare as its floor — for a baseline
whose padding the run replays (``training.replay_padding``), a twin that replays the baseline's rounding whole
(:func:`twin_layout`). The three commands stay for those who want each step; this one runs them.

    finetune reproduce runs/llamafactory-sft --model path/to/base -o reproduced
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from finetune.card import record_verdict
from finetune.errors import ConfigError
from finetune.registry import task_hints
from finetune.reproduce import importer, plots
from finetune.reproduce import replay as kernels
from finetune.reproduce.baseline_check import compare_with_baseline
from finetune.reproduce.compare import compare_runs
from finetune.reproduce.record import Baseline
from finetune.reproduce.runs import Run, read_run
from finetune.reproduce.sources import names, read_baseline
from finetune.reproduce.update_settings import setting
from finetune.reproduce.verdict import Comparison


def base_recipe(b: Baseline) -> str | None:
    """The recipe to import over (its model, data and loss builders; the numbers are imported): the base recipe of
    the task the source says it trained (its ``task``: LLaMA-Factory's stage, the TRL arguments a TRL folder holds:
    ``CompareHints.trl_marks``), else none (a clm recipe)."""
    task = b.source.task(b)
    return task_hints(task).base_recipe if task else None


def refuse_assumed(b: Baseline, args) -> None:
    """ConfigError (one line) where the baseline's files do not say its model (and the user names none) or its
    effective batch: a reproduction of an assumed model or batch would compare another run."""
    # --recipe BASE names the model the user means; finetune's own run carries its recipe
    if not b.base_model and args.model is None and args.recipe is None and b.run is None:
        raise ConfigError(f"reproduce: {args.source}: the baseline's files do not name the model it fine-tuned (the "
                          f"task's default recipe would train its own); give --model MODEL or --recipe BASE")
    if "gradient_accumulation_steps" in b.assumed and b.effective_batch() is not None and not \
            b.get("total_train_batch_size") and not b.get("speed_batch"):
        raise ConfigError(f"reproduce: {args.source}: the effective batch is unknown — "
                          f"{b.assumed['gradient_accumulation_steps']}")


def main(args, finetune) -> int:
    """Run ``finetune reproduce``; ``finetune``: the command line's ``main`` (a list of arguments → exit code). The
    source is read once, here, and handed to import and compare."""
    out = Path(args.output or f"reproduce-{Path(args.source).stem}")
    if out.exists() and any(out.iterdir()) and not args.force:
        raise ConfigError(f"reproduce: -o {out} exists and is not empty; give another folder or --force")
    baseline = read_baseline(args.source, "reproduce", args.processes, args.data)
    default = base_recipe(baseline)  # an objective finetune does not train is refused here, before any folder
    if args.data is None and args.recipe is None and baseline.run is None and \
            baseline.data_file is None:  # a recipe's own data would reproduce nothing
        raise ConfigError(f"reproduce: {args.source}: the baseline's training data is unknown (its files name no "
                          "local training file); give --data FILE, the file it trained on (or --recipe BASE whose "
                          "data it is)")
    refuse_assumed(baseline, args)
    out.mkdir(parents=True, exist_ok=True)
    recipe = out / "recipe.yaml"
    args.recipe = args.recipe or default
    commands = [import_command(args, recipe)]
    code = importer.write_import(baseline, importer.request_of(args, recipe), recipe)
    if code:
        return code
    run_dir, micro = out / "run", args.batch_size or "auto"
    train = ["run", "--recipe", str(recipe), "--batch-size", str(micro), "--output-dir", str(run_dir),
             "--set", "output.tracker=none", *[x for s in args.set for x in ("--set", s)]]
    commands.append(train)
    with kernels.threads(cpu_threads(baseline)):
        code = finetune(train)
    if code:
        return code
    twin, mine = None, read_run(run_dir)  # the run read once: the twin's layout, the comparison, the curves
    if _below_fp32(mine) or mine.dropout_layers:  # an assumed floor errs both ways: measure it on this machine
        twin = out / "twin"
        # in fp32 the twin keeps the run's layout: its masks are what differ (its rounding is fp32's)
        other, rounding = twin_layout(mine, args.batch_size not in (None, "auto")) if _below_fp32(mine) else \
            (micro, [])
        rounding = rounding + other_dropout_seed(mine)
        if other is None:
            print("reproduce: no other micro-batch divides the effective batch; the floor stays assumed",
                  file=sys.stderr)
            twin = None
        else:
            commands.append(train[:4] + [str(other), "--output-dir", str(twin)] + train[7:] + rounding)
            with kernels.threads(cpu_threads(baseline)):
                code = finetune(commands[-1])
            if code:
                return code
    own = baseline.run
    if own is not None:  # finetune's own run: run against run
        theirs = read_run(own)
        result = compare_runs(theirs, mine, twin=twin)
        curves = plots.plot_comparison(theirs, mine, out / "curves.png")
    else:
        result = compare_with_baseline(baseline, mine, twin=twin)
        curves = plots.plot_against_baseline(baseline, mine, out / "curves.png")
    commands.append(["compare", str(own or args.source), str(run_dir), *(["--floor", str(twin)] if twin else [])])
    print(result.report())
    write_report(out / "report.md", args.source, result, curves, commands)
    record_verdict(run_dir, result.verdict.line, args.source)
    print(f"report: {out / 'report.md'}")
    return result.exit_code


def import_command(args, recipe: Path) -> list:
    """The ``finetune import`` command that writes the same recipe (for the report: each step can be run alone)."""
    return ["import", str(args.source), "-o", str(recipe), "--force",
            *(["--recipe", args.recipe] if args.recipe else []), *(["--data", str(args.data)] if args.data else []),
            *(["--model", str(args.model)] if args.model else []),
            *(["--initial-adapter", str(args.initial_adapter)] if args.initial_adapter else []),
            *(["--baseline-step"] if args.baseline_step else []),
            *(["--processes", str(args.processes)] if args.processes else [])]


def cpu_threads(b: Baseline) -> int | None:
    """The threads each of the baseline's processes had, for a run on this machine's CPU (None on a GPU: its
    kernels do not split by them): what replays its kernels (:func:`replay.baseline_threads`)."""
    return None if torch.cuda.is_available() else kernels.baseline_threads(b)[0]


def other_dropout_seed(run: Run) -> list:
    """The twin's settings that draw other dropout masks over the same samples, order and init (none without
    dropout): its floor is then dropout's noise, which another tool's masks cannot replay, beside the rounding."""
    if not run.dropout_layers:
        return []
    return ["--set", f"training.dropout_seed={(int(run.dropout_seed or 0) + 1) % 2 ** 32}"]


def _below_fp32(run: Run) -> bool:
    """Whether the run rounds below fp32: mixed precision, or weights trained in bf16 (no master weights)."""
    config = run.recipe
    return (config.get("training") or {}).get("mixed_precision") not in (None, "no") or \
        (config.get("model") or {}).get("master_weights") is False


def twin_layout(run: Run, chosen: bool) -> tuple[int | None, list]:
    """The twin's micro-batch and the settings it adds. A run replaying its baseline's padding
    (``training.replay_padding``) gets a twin that replays the baseline's rounding whole: at the baseline's own
    micro-batch (its shapes in backward too: a micro-batch of one sample runs other kernels, 1e-3 apart in the
    gradients of a hidden-size-384 Llama where 2 and 4 agree to 2e-7) — or at the run's where that is smaller and the
    run's was sized to fit (``chosen``: given by the user) — with each micro-batch's weight-gradient sums rounded to
    bf16 as the baseline's autocast rounded them. The floor is then the rounding the two tools differ by. A run
    that is itself the replay (it ran the baseline's micro-batch: :mod:`replay`) gets the layout that differs: the
    largest micro-batch dividing the baseline's below it, rounded as the baseline's. Else another micro-batch
    (:func:`twin_batch_size`)."""
    replay = setting(run.config, "training.replay_padding")
    m = run.metrics
    if not replay or not m.get("effective_batch_size") or not m.get("gradient_accumulation_steps"):
        return twin_batch_size(run), []
    rounding = ["--set", "training.fp32_grad_sums=false"]
    if kernels.micro_batch_ran(run) == replay[0]:  # the run is the replay: the twin is the layout that differs
        below = next((b for b in range(replay[0] - 1, 0, -1) if replay[0] % b == 0), None)
        return below or replay[0], rounding
    micro = m["effective_batch_size"] // m["gradient_accumulation_steps"]
    own = replay[0] if chosen or replay[0] <= micro else micro
    return own, rounding


def twin_batch_size(run: Run) -> int | None:
    """Another micro-batch for the twin: the largest divisor of the effective batch below the run's."""
    m = run.metrics
    total, n = m.get("effective_batch_size"), m.get("gradient_accumulation_steps")
    if not total or not n:
        return None
    micro = total // n
    return next((b for b in range(int(micro) - 1, 0, -1) if total % b == 0), None) or \
        next((b for b in range(int(micro) + 1, total + 1) if total % b == 0), None)


def write_report(path: Path, source, result: Comparison, curves: Path, commands: list) -> None:
    """``report.md``: the verdict of ``result`` (the comparison with ``source``), each layer, the curves and the
    commands that did it."""
    report, verdict = result.report(), result.verdict.line
    lines = [f"# Reproducing {source}", "", f"**{verdict}**", "", "## Each layer", "", "```", report, "```", "",
             "## The curves", "", f"![loss and learning rate, the source's and this run's]({curves.name})", "",
             "## The commands", "", "```"] + ["finetune " + " ".join(c) for c in commands] + ["```", ""]
    path.write_text("\n".join(lines))


def add_arguments(p) -> None:
    p.add_argument("source", help=f"what was published: a run of {names()} (see docs/reproduce/sources.md)")
    p.add_argument("--data", metavar="FILE", help="the baseline's training file (default: the one local file the "
                                                  "source names, where it names one)")
    p.add_argument("--model", metavar="MODEL", help="the model the baseline fine-tuned, when the source names it in "
                                                    "another form")
    p.add_argument("--recipe", metavar="BASE", help="the recipe to import over (default: the source's task's)")
    p.add_argument("--initial-adapter", metavar="DIR", help="the baseline's LoRA adapters saved before its first "
                                                            "step (peft.init_from)")
    p.add_argument("--baseline-step", action="store_true", help="train the step the baseline's tool took where it "
                   "is not the big batch's (see finetune import --help)")
    p.add_argument("--processes", type=int, metavar="P", help="the processes the baseline trained on, where its files "
                   "do not say (see finetune import --help)")
    p.add_argument("--batch-size", metavar="B", help="the micro-batch (default auto: the largest that fits here)")
    p.add_argument("-o", "--output", metavar="DIR", help="where the recipe, the run, the curves and report.md go")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a field of the imported recipe for the run (repeatable)")
    p.add_argument("--force", action="store_true", help="write into a folder that is not empty")

