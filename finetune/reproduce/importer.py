"""``finetune import SOURCE [-o recipe.yaml] [--recipe BASE]``: a finetune recipe from a baseline's settings.

``SOURCE`` is anything :func:`baselines.read_baseline` reads. The recipe gets the baseline's effective
batch, learning rate, schedule and warm-up (a warm-up ratio becomes steps as transformers computes them:
``ceil(steps × ratio)``, or as the source's tool rounds it), epochs or max steps, optimizer, betas, weight decay,
``max_grad_norm``, seed, mixed precision, LoRA, max length / completion-only loss where the task has them,
quantization, and the Trainer's sample order (``training.sample_order: trainer``); rows the baseline's tool shuffled
before training (axolotl) are written beside the recipe in that order. The model, data and everything else come from
``--recipe BASE`` (else a recipe of the task the source says it trained — ``clm`` when it says none — on the
baseline's base model). One table says each field, its value and where it came from; each setting that cannot be
carried gets one ``not carried:`` line. The micro-batch is yours: run the recipe with ``--batch-size``.

    finetune import runs/trainer-baseline --recipe examples/trainer-baseline/recipe.yaml -o imported.yaml
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path

import yaml

from finetune import card as card_io
from finetune.config import (
    apply_overrides,
    config_from_dict,
    read_yaml,
    recipe_path,
    resolve_task,
    section_class,
    task_module,
)
from finetune.errors import ConfigError
from finetune.outputs import read_config, read_metrics
from finetune.reproduce import llamafactory
from finetune.reproduce.baselines import Baseline, read_baseline, trl_task
from finetune.reproduce.settings import Imported, carry, model_config_of, model_difference, training_file


def _skeleton(base: Baseline) -> dict:
    """A recipe of the task the baseline trained (its ``Baseline.task``; clm when the source does not say) on its base
    model (none when the source does not name it: said as missing)."""
    return {"task": base.task or trl_task(base) or "clm", "description": f"imported from {base.path}",
            "model": {"name_or_path": base.base_model} if base.base_model else {}}


def import_recipe(source, base=None, steps=None, data=None, initial_adapter=None,
                  model=None, recipe=None, own_step=False) -> tuple[dict, Imported, Baseline]:
    """The recipe mapping for baseline ``source`` (over recipe ``base`` when given; ``data``: the baseline's training
    file; ``model``: its base model; ``recipe``: where the recipe will be written, beside which the rows go when the
    baseline's tool reordered them; ``own_step``: take the tool's own step where it is not the big batch's), what
    was carried and the baseline. Raises ConfigError (one line) for bad
    input, a recipe that would not validate, or a model that differs from the baseline's. A baseline that names no
    base model, imported without ``base``, gives a recipe whose ``model.name_or_path`` is missing
    (``Imported.missing`` says so)."""
    baseline = read_baseline(source, "import")
    raw = read_yaml(recipe_path(base)) if base else _skeleton(baseline)
    if not isinstance(raw, dict):
        raise ConfigError(f"--recipe: {base} is not a recipe (a YAML mapping)")
    folder = recipe_path(base).parent if base else None
    module = task_module(resolve_task(raw.get("task"), folder))
    model_fields = typing.get_type_hints(section_class(module, "ModelConfig"))  # name → type
    data_fields = set(getattr(section_class(module, "DataConfig"), "__dataclass_fields__", {}))
    imported = carry(baseline, model_fields, data_fields, steps, initial_adapter, own_step)
    named = data is None and baseline.data_file is not None  # the file the source names, when no --data is given
    training_file(imported, baseline.data_file[0] if named else data, data_fields, baseline, recipe,
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
    elif baseline.base_model and base and ours and ours != baseline.base_model and not Path(str(ours)).exists():
        # the same model in another form (the recipe's packaged GGUF, the baseline's hub id) or another model: the
        # baseline's is the one it trained; the architecture check below still refuses a different one
        imported.set("model.name_or_path", baseline.base_model, f"the baseline's base model (the recipe's {ours} "
                     "replaced; its task and data kept)")
    raw = apply_overrides(raw, [(name.split("."), value) for name, value in imported.values.items()])
    if not base:
        raw.setdefault("name", Path(source).stem)
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


def finetune_recipe(source, data=None, model=None) -> tuple[dict, list[str]] | None:
    """The recipe that reproduces a finetune run, from its run folder or its model card (a ``model/`` folder or its
    README.md): the run's resolved recipe whole, its effective batch kept (``card.reproducible``); ``data``,
    ``model``: where the training file and the base model are on this machine. With it, what the import says: each
    line names what was read and how the data stand against the run's (sha256). None when ``source`` is not
    finetune's."""
    p = Path(source)
    run = p if (p / "history.jsonl").is_file() and (p / "config.yaml").is_file() else None
    card = next((c for c in ((p / "model") if run else p, p) if card_io.is_card(c)), None)
    if run is None and card is None:
        return None
    if run is not None:
        recipe = card_io.reproducible(read_config(run), read_metrics(run).get("effective_batch_size"))
    else:
        recipe = card_io.read_recipe(card)
    said = [f"finetune {'run' if run else 'model card'}: {p} (its resolved recipe, whole; effective batch "
            f"{(recipe.get('training') or {}).get('effective_batch_size')} kept, the micro-batch yours)"]
    sections = {k: dict(recipe.get(k) or {}) for k in ("model", "data")}
    if model is not None:
        sections["model"]["name_or_path"] = str(model)
        said.append(f"model.name_or_path  {model}  --model")
    if data is not None:
        sections["data"]["source"] = str(data)
    recipe.update({k: v for k, v in sections.items() if v})
    said.append(data_line(sections["data"].get("source"), card_io.card_data_sha(card) if card else None,
                          "--data" if data is not None else "the run's"))
    return recipe, said


def data_line(source, sha: str | None, whose: str) -> str:
    """How ``source`` (the data the recipe will train on) stands against the sha256 the run's card recorded."""
    if sha is None:
        return f"data.source  {source}  {whose} (the card records no file sha256: not a local file)"
    mine = card_io.file_sha256(source)
    if mine is None:
        return f"missing: data.source {source} is not on this machine; give --data FILE (sha256 {sha[:12]}…)"
    if mine != sha:
        return (f"not carried: data.source {source} differs from the run's data (sha256 {mine[:12]}… vs "
                f"{sha[:12]}…): the reproduction trains on other data")
    return f"data.source  {source}  {whose}; sha256 {sha[:12]}… matches the run's"


def table(imported: Imported, base: Baseline) -> str:
    rows = [("field", "value", "from")] + [(n, _show(v), s) for n, v, s in imported.rows]
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"{base.kind}: {base.path}"] + [f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}" for r in rows]
    return "\n".join(lines + imported.not_carried)


def _show(v) -> str:
    return "null" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def main(args) -> int:
    out = Path(args.output or f"{Path(args.source).stem if Path(args.source).is_file() else Path(args.source).name}"
                               "-imported.yaml")
    if out.exists() and not args.force:
        raise ConfigError(f"import: -o {out} exists; give another path or --force")
    own = finetune_recipe(args.source, args.data, args.model)
    if own is not None:  # a finetune run or its card: its own recipe, whole
        raw, said = own
        for line in said:
            print(line, file=sys.stderr if line.startswith(("missing:", "not carried:")) else sys.stdout)
        return write_recipe(out, raw, args.source, "finetune run")
    args.data = llamafactory.training_rows(args.source, args.data, out, read_baseline)  # rows finetune reads
    raw, imported, baseline = import_recipe(args.source, args.recipe, args.steps, args.data, args.initial_adapter,
                                            args.model, out, args.baseline_step)
    print(table(imported, baseline))
    if baseline.unknown:  # listed, not fatal: axolotl grows keys faster than this list
        print(f"warning: {baseline.path.name}: keys finetune does not know, not read: {', '.join(baseline.unknown)}",
              file=sys.stderr)
    write_recipe(out, raw, args.source, baseline.kind)
    for line in imported.missing:
        print(f"missing: {line}", file=sys.stderr)
    return 0


def write_recipe(out: Path, raw: dict, source, kind: str) -> int:
    command = f"finetune run --recipe {out} --batch-size B"
    out.write_text(f"# {command}\n# imported from {source} ({kind}) by finetune import\n"
                   + yaml.safe_dump(raw, sort_keys=False))
    print(f"wrote {out}: run it with {command} (your micro-batch; N = effective batch / B)")
    return 0


def add_arguments(p) -> None:
    p.add_argument("source", help="an output or checkpoint folder (Trainer, TRL, LLaMA-Factory, torchtune, axolotl), "
                                  "a model card README.md, a config YAML (axolotl, LLaMA-Factory, torchtune, TRL) or "
                                  "a Trainer/TRL arguments JSON")
    p.add_argument("-o", "--output", metavar="RECIPE.yaml", help="where to write the recipe "
                                                                  "(default: <source>-imported.yaml)")
    p.add_argument("--recipe", metavar="BASE", help="keep this recipe's task, model and data (default: a recipe of "
                                                    "the task the source trained, else clm, on its base model)")
    p.add_argument("--model", metavar="MODEL", help="the model the baseline fine-tuned (hub id, folder, gguf:…), "
                                                    "when its folder does not name it or names it in another form")
    p.add_argument("--data", metavar="FILE", help="the baseline's training file (jsonl, json, parquet, csv): trained "
                                                  "whole and in its order (data.val_fraction 0, data.limit null); "
                                                  "default: the one local file the source names (LLaMA-Factory, "
                                                  "axolotl)")
    p.add_argument("--initial-adapter", metavar="DIR", help="the baseline's LoRA adapters saved before its first "
                                                            "step (peft.init_from): the reproduction starts there")
    p.add_argument("--baseline-step", action="store_true", help="train the step the baseline's tool took where it "
                   "is not the big batch's (LLaMA-Factory's packed rows): the reproduction is that run (default: "
                   "finetune's exact big-batch step, the difference named)")
    p.add_argument("--steps", type=int, metavar="N", help="the baseline's optimizer steps, for a warm-up ratio when "
                                                          "the source does not say them (axolotl, args JSON)")
    p.add_argument("--force", action="store_true", help="overwrite the output file")
