"""``finetune import SOURCE [-o recipe.yaml] [--recipe BASE]``: a finetune recipe from a baseline's settings.

``SOURCE`` is any run a source of ``sources.SOURCES`` reads. The recipe gets the baseline's effective
batch, learning rate, schedule and warm-up (a warm-up ratio becomes steps as transformers computes them:
``ceil(steps × ratio)``, or as the source's tool rounds it), epochs or max steps, optimizer, betas, weight decay,
``max_grad_norm``, seed, mixed precision, LoRA, max length / completion-only loss where the task has them,
quantization, and the Trainer's sample order (``training.sample_order: trainer``); rows the baseline's tool shuffled
before training (axolotl) are written beside the recipe in that order. The model, data and everything else come from
``--recipe BASE`` (else a recipe of the task the source says it trained — its objective, read as :mod:`objective`
reads it; ``clm`` when no file says it, said — on the baseline's base model; an objective finetune does not train,
or a file that trains nothing, is refused in one line). One table says each field, its value and where it came
from; each setting that cannot be carried gets one ``not carried:`` line. The micro-batch is yours: run the recipe
with ``--batch-size``.

    finetune import runs/trainer-baseline --recipe examples/trainer-baseline/recipe.yaml -o imported.yaml
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from finetune.card import file_sha256
from finetune.config import TrainingConfig
from finetune.errors import ConfigError
from finetune.loading import apply_overrides, config_from_dict, read_yaml
from finetune.registry import recipe_path, resolve_task, section_class, task_module
from finetune.reproduce.architecture import model_config_of, model_difference
from finetune.reproduce.carry import carry
from finetune.reproduce.objective import said_objective
from finetune.reproduce.record import Baseline, Imported, WholeRecipe
from finetune.reproduce.rows import training_file
from finetune.reproduce.sources import accepted, names, read_baseline
from finetune.schema import build_section


@dataclass(frozen=True)
class Request:
    """What a user asks of ``finetune import`` besides the source: the recipe to import over (``--recipe``), the
    baseline's optimizer steps (``--steps``), its training file (``--data``), its adapters' start
    (``--initial-adapter``), its base model (``--model``), where the recipe goes (beside which the rows go when the
    baseline's tool reordered them), whether to take the tool's own step (``--baseline-step``) and the processes
    it trained on where its files do not say (``--processes``)."""

    base_recipe: Optional[str] = None
    steps: Optional[int] = None
    data: Optional[str] = None
    initial_adapter: Optional[str] = None
    model: Optional[str] = None
    recipe: Optional[Path] = None
    baseline_step: bool = False
    processes: Optional[int] = None


def request_of(args, out: Path) -> Request:
    """The request of ``finetune import`` / ``reproduce``'s command line, the recipe written to ``out``."""
    return Request(args.recipe, getattr(args, "steps", None), args.data, args.initial_adapter, args.model, out,
                   args.baseline_step, args.processes)


def _skeleton(b: Baseline, task: Optional[str]) -> dict:
    """A recipe of the task the baseline trained (clm when no file says it: said in the table) on its base model
    (none when the source does not name it: said as missing)."""
    return {"task": task or "clm", "description": f"imported from {b.path}",
            "model": {"name_or_path": b.base_model} if b.base_model else {}}


def objective_row(b: Baseline, imported: Imported, task: Optional[str], base_recipe: Optional[str], ours) -> None:
    """The objective, first in the table, with where it is said: the recipe's ``task`` (a ``--recipe BASE`` of
    another task keeps its own, said), or that no file says it."""
    objective = said_objective(b)
    if base_recipe is None:
        imported.set("task", task or "clm", objective.where if objective else
                     f"the {b.kind}: its tool's own trainer, {task} (no other trainer's key, log column or tag)"
                     if task else f"not said by the {b.kind} (no trainer's key, log column or tag): a causal LM's "
                     "loss on every token; give --recipe BASE of the task it trained if it is another")
        imported.rows.insert(0, imported.rows.pop())
        if "objective" in b.assumed:
            imported.assumed.append(("task", f"{task} — {b.assumed['objective']}"))
        if objective is None and task is None:
            imported.skip("the objective", "unknown", f"the {b.kind} does not say what it trained; this recipe "
                          "trains clm")
    elif objective is not None and ours != objective.name:
        imported.skip("the objective", objective.name, f"{objective.where}; --recipe {base_recipe} trains {ours}")


def import_recipe(source, request: Request = Request()) -> tuple[dict, Imported, Baseline]:
    """The recipe mapping for baseline ``source`` (a path, or the ``Baseline`` already read), what was carried and the
    baseline. Raises ConfigError (one line) for bad input, a recipe that would not validate, or a model that differs
    from the baseline's. A baseline that names no base model, imported without a base recipe, gives a recipe whose
    ``model.name_or_path`` is missing (``Imported.missing`` says so)."""
    baseline = source if isinstance(source, Baseline) else read_baseline(source, "import", request.processes,
                                                                         request.data)
    base, data, model = request.base_recipe, request.data, request.model
    task = baseline.source.task(baseline)  # an objective finetune does not train is refused here, first
    raw = read_yaml(recipe_path(base)) if base else _skeleton(baseline, task)
    if not isinstance(raw, dict):
        raise ConfigError(f"--recipe: {base} is not a recipe (a YAML mapping)")
    folder = recipe_path(base).parent if base else None
    module = task_module(resolve_task(raw.get("task"), folder))
    model_fields = typing.get_type_hints(section_class(module, "ModelConfig"))  # name → type
    data_fields = set(getattr(section_class(module, "DataConfig"), "__dataclass_fields__", {}))
    imported = carry(baseline, model_fields, data_fields, request.steps, request.initial_adapter,
                     request.baseline_step)
    objective_row(baseline, imported, task, base, raw.get("task"))
    untaken(imported, module, raw.get("task"))
    named = data is None and baseline.data_file is not None  # the file the source names, when no --data is given
    training_file(imported, baseline.data_file[0] if named else data, data_fields, baseline, request.recipe,
                  baseline.data_file[1] if named else "--data")
    if not base and data is None and not named:
        imported.skip("the data set", "unknown", f"not in the {baseline.kind}; this recipe trains on the "
                      f"{raw['task']} task's default data until you set data.source (or give --recipe BASE, or "
                      "--data FILE)")
    ours = ((raw.get("model") or {}).get("name_or_path") if isinstance(raw.get("model"), dict) else None)
    if model is not None:
        imported.set("model.name_or_path", str(model), "--model")
    elif not baseline.base_model and base:
        imported.skip("the base model", "unknown", f"the {baseline.kind} does not name it; the recipe's {ours} is "
                      "kept: give --model if the baseline fine-tuned another")
        imported.assumed.append(("model.name_or_path", f"the {baseline.kind} does not name it: the recipe's {ours}"))
    elif baseline.base_model and base and ours and ours != baseline.base_model and not Path(str(ours)).exists():
        # the same model in another form (the recipe's packaged GGUF, the baseline's hub id) or another model: the
        # baseline's is the one it trained; the architecture check below still refuses a different one
        imported.set("model.name_or_path", baseline.base_model, f"the baseline's base model (the recipe's {ours} "
                     "replaced; its task and data kept)")
    elif baseline.base_model and not base:  # the skeleton's model: said where, like every other field
        imported.set("model.name_or_path", baseline.base_model, baseline.base_model_where or
                     f"the {baseline.kind}'s base model")
    raw = apply_overrides(raw, [(name.split("."), value) for name, value in imported.values.items()])
    check_training_file(module, raw, "data.source" in imported.values)
    if not base:
        raw.setdefault("name", baseline.path.stem)
    if not baseline.base_model and not base and model is None:
        imported.missing.append("model.name_or_path: the baseline does not name the model it fine-tuned; add it "
                                "(--set model.name_or_path=MODEL when you run) or give --recipe BASE")
        return raw, imported, baseline
    cfg = config_from_dict(raw, name=raw.get("name") or "imported", folder=folder)
    diff = model_difference(baseline.model_config, model_config_of(cfg.model))
    if diff:
        raise ConfigError(f"import: the baseline's model ({baseline.path / 'config.json'}) differs from the recipe's "
                          f"model.name_or_path: {diff}")
    return raw, imported, baseline


def untaken(imported: Imported, module, task) -> None:
    """A carried value the recipe's field cannot hold (one of a fixed set of words: TRL's truncation_mode keep_end
    where the task cuts only the end) is not carried, named with the words the task takes, not a refusal."""
    for name, value in list(imported.values.items()):
        section, _, field = name.partition(".")
        owner = {"data": section_class(module, "DataConfig"), "model": section_class(module, "ModelConfig"),
                 "training": TrainingConfig}.get(section)
        kind = typing.get_type_hints(owner).get(field) if owner is not None and dataclasses.is_dataclass(owner) \
            else None
        if typing.get_origin(kind) is typing.Literal and value not in typing.get_args(kind):
            del imported.values[name]
            imported.rows = [r for r in imported.rows if r[0] != name]
            imported.skip(name, value, f"the {task} task takes {' | '.join(map(str, typing.get_args(kind)))}")


def check_training_file(module, raw: dict, named: bool) -> None:
    """The training file import hands the recipe, read as ``finetune run`` reads it (the task module's
    ``load_rows``, which refuses rows that lack the columns the task needs): one line before any recipe is written,
    not a recipe that fails when run. Nothing to read when import named no file (``named``) or the task reads
    none."""
    if not named or not hasattr(module, "load_rows"):
        return
    problems = []
    data = build_section(section_class(module, "DataConfig"), raw.get("data"), "data", problems)
    if not problems:  # a data section that does not validate is refused, in its words, by config_from_dict
        module.load_rows(data)


def rows_beside(out: Path) -> set:
    """The rows files import writes beside the recipe ``out`` (``RECIPE-rows.*``)."""
    return set(out.parent.glob(f"{out.stem}-rows.*"))


def table(imported: Imported, b: Baseline) -> str:
    rows = [("field", "value", "from")] + [(n, _show(v), s) for n, v, s in imported.rows]
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"{b.kind}: {b.path}"] + [f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}" for r in rows]
    return "\n".join(lines + imported.lines())


def _show(v) -> str:
    return "null" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def main(args) -> int:
    out = Path(args.output or f"{Path(args.source).stem if Path(args.source).is_file() else Path(args.source).name}"
                               "-imported.yaml")
    if out.exists() and not args.force:
        raise ConfigError(f"import: -o {out} exists; give another path or --force")
    return write_import(read_baseline(args.source, "import", args.processes, args.data), request_of(args, out), out)


def write_import(baseline: Baseline, request: Request, out: Path) -> int:
    """``finetune import`` of the baseline read: the recipe written to ``out``, the table of what was carried and
    every line on what was not, printed."""
    if baseline.recipe is not None:  # a run that carries its recipe: that recipe, whole
        raw, said = whole_recipe(baseline.recipe, request.data, request.model)
        # --data for a run's own recipe: read as its task reads it, as every other source's is
        check_training_file(task_module(resolve_task(raw.get("task"))), raw, request.data is not None)
        for line in said:
            print(line, file=sys.stderr if line.startswith(("missing:", "not carried:")) else sys.stdout)
        return write_recipe(out, raw, baseline.path, baseline.kind)
    before = rows_beside(out)
    try:
        rows = baseline.source.training_rows(baseline, request.data, out)  # the rows as the tool trained them
        raw, imported, baseline = import_recipe(baseline, dataclasses.replace(request, data=rows))
    except ConfigError:
        for path in rows_beside(out) - before:  # a refused import leaves nothing behind
            path.unlink()
        raise
    print(table(imported, baseline))
    if baseline.unknown:  # listed, not fatal: axolotl grows keys faster than this list
        print(f"warning: {baseline.path.name}: keys finetune does not know, not read: {', '.join(baseline.unknown)}",
              file=sys.stderr)
    write_recipe(out, raw, baseline.path, baseline.kind)
    for line in imported.missing:
        print(f"missing: {line}", file=sys.stderr)
    for name, why in imported.assumed:
        print(f"assumed: {name} — {why}", file=sys.stderr)
    return 0


def whole_recipe(whole: WholeRecipe, data, model) -> tuple:
    """(the recipe a run carries whole, what import says of it): ``data``, ``model`` where the training file and the
    base model are on this machine (``--data``, ``--model``); each line names what was read and how the data stand
    against the run's (sha256)."""
    recipe, said = dict(whole.recipe), [whole.said]
    sections = {k: dict(recipe.get(k) or {}) for k in ("model", "data")}
    if model is not None:
        sections["model"]["name_or_path"] = str(model)
        said.append(f"model.name_or_path  {model}  --model")
    if data is not None:
        sections["data"]["source"] = str(data)
    recipe.update({k: v for k, v in sections.items() if v})
    said.append(data_line(sections["data"].get("source"), whole.data_sha,
                          "--data" if data is not None else "the run's"))
    return recipe, said


def data_line(source, sha: str | None, whose: str) -> str:
    """How ``source`` (the data the recipe will train on) stands against the sha256 the run's card recorded."""
    if sha is None:
        return f"data.source  {source}  {whose} (the card records no file sha256: not a local file)"
    mine = file_sha256(source)
    if mine is None:
        return f"missing: data.source {source} is not on this machine; give --data FILE (sha256 {sha[:12]}…)"
    if mine != sha:
        return (f"not carried: data.source {source} differs from the run's data (sha256 {mine[:12]}… vs "
                f"{sha[:12]}…): the reproduction trains on other data")
    return f"data.source  {source}  {whose}; sha256 {sha[:12]}… matches the run's"


def write_recipe(out: Path, raw: dict, source, kind: str) -> int:
    command = f"finetune run --recipe {out} --batch-size B"
    out.write_text(f"# {command}\n# imported from {source} ({kind}) by finetune import\n"
                   + yaml.safe_dump(raw, sort_keys=False))
    print(f"wrote {out}: run it with {command} (your micro-batch; N = effective batch / B)")
    return 0


def add_arguments(p) -> None:
    p.epilog = f"What is read of each tool — {accepted()}."
    p.add_argument("source", help=f"a run of {names()} (see docs/reproduce/sources.md)")
    p.add_argument("-o", "--output", metavar="RECIPE.yaml", help="where to write the recipe "
                                                                  "(default: <source>-imported.yaml)")
    p.add_argument("--recipe", metavar="BASE", help="keep this recipe's task, model and data (default: a recipe of "
                                                    "the task the source trained, else clm, on its base model)")
    p.add_argument("--model", metavar="MODEL", help="the model the baseline fine-tuned (hub id, folder, gguf:…), "
                                                    "when its folder does not name it or names it in another form")
    p.add_argument("--data", metavar="FILE", help="the baseline's training file (jsonl, json, parquet, csv): trained "
                                                  "whole and in its order (data.val_fraction 0, data.limit null); "
                                                  "default: the one local file the source names, where it names one")
    p.add_argument("--initial-adapter", metavar="DIR", help="the baseline's LoRA adapters saved before its first "
                                                            "step (peft.init_from): the reproduction starts there")
    p.add_argument("--baseline-step", action="store_true", help="train the step the baseline's tool took where it "
                   "is not the big batch's (packed rows, a pure-bf16 step): the reproduction is that run (default: "
                   "finetune's exact big-batch step, the difference named)")
    p.add_argument("--steps", type=int, metavar="N", help="the baseline's optimizer steps, for a warm-up ratio when "
                                                          "the source does not say them")
    p.add_argument("--processes", type=int, metavar="P", help="the processes the baseline trained on (data-parallel: "
                   "its effective batch is per-device × accumulation × P), where its files do not say")
    p.add_argument("--force", action="store_true", help="overwrite the output file")
