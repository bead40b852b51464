"""``finetune plan``: its arguments, and the plan of a recipe's own model (``plan``) or of an architecture from its
config alone (``depth``)."""

from __future__ import annotations

import json
from dataclasses import asdict

from finetune.config import load_recipe
from finetune.errors import ConfigError
from finetune.memory import sharded
from finetune.memory.depth import plan_from_config
from finetune.memory.plan import plan_recipe


def add_arguments(p) -> None:
    p.add_argument("--recipe", required=True, help="recipe name or YAML path")
    p.add_argument("--gpu", required=True, help="card memory: 8GiB, 24GB, or a name (t4, rtx4070, a100-40gb, …)")
    p.add_argument("--processes", type=int, default=1, help="processes (GPUs) sharing the effective batch")
    p.add_argument("--zero-stage", default="0", metavar="{" + ",".join(map(str, sharded.ZERO_STAGES)) + "}",
                   help="how the processes share the fixed part: " + "; ".join(
                       f"{stage}: {text}" for stage, text in sharded.ZERO_STAGES.items()))
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--model-config", metavar="SOURCE",
                   help="plan for this architecture instead of the recipe's model (a folder with config.json, or a hub "
                        "id): its fixed part counted on the meta device, a micro-step measured on a few of its blocks "
                        "and extrapolated; the full model is never built")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def main(args) -> int:
    """The command: the recipe's own model, or with ``--model-config`` an architecture from its config alone."""

    cfg = load_recipe(args.recipe, args.set)
    if args.processes < 1:
        raise ConfigError(f"--processes: got {args.processes}; must be >= 1")
    layout = sharded.Layout(args.processes, sharded.parse_zero_stage(args.zero_stage))
    if args.model_config:
        plan = plan_from_config(cfg, args.model_config, args.gpu, layout)
    else:
        plan = plan_recipe(cfg, args.gpu, layout)
    if args.json:
        record = asdict(plan)
        record.pop("profiles")
        print(json.dumps(record))
    else:
        print(plan.table())
    return 0 if plan.fits else 1
