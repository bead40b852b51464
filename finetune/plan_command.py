"""``finetune plan``: its arguments, and the plan of a recipe's own model (``memory.plan``) or of an architecture
from its config alone (``memory.depth``). Above the loop and the memory model alike: it builds the recipe's job
through start-up (``startup.build_job``, ``startup.split_batch``) and hands the planner what it needs, so that
``finetune.memory`` imports neither. ``training_peak`` measures a real step through the same stages."""

from __future__ import annotations

import gc
import json

import torch

from finetune import flags, loop, startup
from finetune.errors import ConfigError
from finetune.loading import load_recipe
from finetune.memory import depth, host, sharded
from finetune.memory import plan as planner
from finetune.memory.cards import parse_size
from finetune.memory.measure import PeakMeter
from finetune.memory.records import Machine


def add_arguments(p) -> None:
    p.add_argument("--recipe", required=True, help="recipe name or YAML path")
    p.add_argument("--gpu", required=True, help="card memory: 8GiB, 24GB, or a name (t4, rtx4070, a100-40gb, …)")
    p.add_argument("--processes", type=int, default=1, help="processes (GPUs) sharing the effective batch")
    p.add_argument("--zero-stage", default="0", metavar="{" + ",".join(map(str, sharded.ZERO_STAGES)) + "}",
                   help="how the processes share the fixed part: " + "; ".join(
                       f"{stage}: {text}" for stage, text in sharded.ZERO_STAGES.items()))
    flags.add_field_flags(p, ["training.effective_batch_size"])  # as ``finetune run`` takes them: one source
    flags.add_data_flag(p)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--model-config", metavar="SOURCE",
                   help="plan for this architecture instead of the recipe's model (a folder with config.json, or a hub "
                        "id): its fixed part counted on the meta device, a micro-step measured on a few of its blocks "
                        "and extrapolated; the full model is never built")
    p.add_argument("--host-memory", metavar="SIZE",
                   help="the host's memory, every process together: 64GiB, 128GB (default: this machine's RAM); what "
                        "an offload level keeps there must fit it (docs/memory.md#bigger-than-the-card-exactly)")
    flags.add_field_flags(p, ["training.offload"])  # as ``finetune run`` takes it; given, the plan keeps to it
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def main(args) -> int:
    """The command: the recipe's own model, or with ``--model-config`` an architecture from its config alone."""

    cfg = load_recipe(args.recipe, flags.field_overrides(args) + args.set)
    if args.processes < 1:
        raise ConfigError(f"--processes: got {args.processes}; must be >= 1")
    layout = sharded.Layout(args.processes, sharded.parse_zero_stage(args.zero_stage))
    machine = machine_of(args, cfg)
    gc.freeze()  # the planner's collections (PeakMeter) then walk what planning makes, not every module imported
    if args.model_config:
        plan = plan_from_config(cfg, args.model_config, machine, layout)
    else:
        plan = plan_recipe(cfg, machine, layout)
    if args.json:
        print(json.dumps(plan.record()))
    else:
        print(plan.table())
    return 0 if plan.fits else 1


def machine_of(args, cfg) -> Machine:
    """The card, the host's memory (``--host-memory``) and the host level the plan keeps to: the one ``--offload``
    or the recipe names (training.offload), else None (each weighed)."""
    level = cfg.training.offload
    forced = None if args.offload is None and level == "none" else host.parse_level(level)
    memory = parse_size(args.host_memory, "--host-memory") if args.host_memory else 0
    return Machine(args.gpu, memory, forced)


def plan_recipe(cfg, gpu: str, layout: sharded.Layout = sharded.Layout()):
    """The plan of ``cfg``'s own model on ``gpu``, per process of ``layout`` (every setting measured at full
    depth)."""
    return planner.plan_recipe(cfg, gpu, layout, startup.build_job, effective_batch(cfg, layout))


def plan_from_config(cfg, source: str, gpu: str, layout: sharded.Layout = sharded.Layout()):
    """The plan of ``cfg`` with its model replaced by ``source``'s architecture (never built whole)."""
    return depth.plan_from_config(cfg, source, gpu, layout, startup.build_job, effective_batch(cfg, layout))


def effective_batch(cfg, layout: sharded.Layout) -> int:
    """The effective batch the plan is for: the recipe's, split over the layout's processes as a run splits it."""
    return startup.split_batch(cfg.training, layout.processes).effective


def training_peak(job, t) -> tuple[int, object]:
    """(the most bytes allocated at any moment of training ``job`` with ``t`` through start-up and the loop, weights
    included; its TrainResult). With ``t.max_steps`` ≥ 2 that is the peak of a steady optimizer step (the
    optimizer's state exists from the first on), which is what ``finetune plan`` predicts. A model on the CPU that
    trains on a GPU comes to it inside the run."""
    device = next(job.model.parameters()).device
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    held = 0 if device.type == "cuda" and next(job.model.parameters()).device.type != "cuda" else \
        sum(x.numel() * x.element_size() for x in list(job.model.parameters()) + list(job.model.buffers()))
    with PeakMeter(device) as meter:
        result = startup.train_job(job, t, loop.Reporting(banner=False))
    return held + meter.peak, result
