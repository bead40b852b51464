"""A run's model card: ``model/README.md`` (and ``model-merged/README.md``), what a hub shows and what
``finetune import`` reads back to reproduce the run.

The card carries the hub's metadata header (``base_model`` as the user named it, when that is a hub id — never a
path of this machine), then what anyone needs to reproduce and check the run: the task, the effective batch and the
layout it ran at, precision and device, the data (source, rows, a sha256 of a local file, and a digest of the
content of every window trained), the framework versions, the loss / evaluation table per epoch, the commands, the
resolved recipe whole (a ``yaml`` block between markers, read back by :func:`read_recipe`), and — once ``finetune
compare`` has judged the run — its verdict (:func:`record_verdict`).

    finetune import runs/sft/model -o sft.yaml && finetune run --recipe sft.yaml --batch-size 2
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
from pathlib import Path

import yaml

from finetune.config import gguf_hub_id, names_gguf
from finetune.errors import ConfigError
from finetune.loading import parse_yaml, read_yaml

RECIPE_START, RECIPE_END = "<!-- finetune recipe -->", "<!-- end of finetune recipe -->"
VERDICT_START, VERDICT_END = "<!-- finetune verdict -->", "<!-- end of finetune verdict -->"
TAG = "finetune"
FRAMEWORKS = ("finetune", "torch", "transformers", "accelerate", "peft", "datasets", "trl", "bitsandbytes")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hub_id(name) -> str | None:
    """``name`` when it reads as a hub repository id and is not a folder or file of this machine; else None."""
    if not isinstance(name, str) or not HUB_ID.match(name) or Path(name).expanduser().exists():
        return None
    return name


def base_model_id(name) -> str | None:
    """The hub id of the model the run fine-tuned: the recipe's name when it is one, a GGUF file's source model
    (``config.gguf_hub_id``), else the one a local model folder's ``config.json`` names (``_name_or_path``), else
    None."""
    if hub_id(name):
        return name
    if names_gguf(name):
        return gguf_hub_id(name)
    config = Path(str(name)).expanduser() / "config.json"
    if config.is_file():
        try:
            return hub_id(json.loads(config.read_text()).get("_name_or_path"))
        except (ValueError, AttributeError):
            return None
    return None


def local_path(value) -> bool:
    """Whether ``value`` names a file or folder of this machine by a path (one with a folder in it, or ``~``)."""
    return isinstance(value, str) and ("/" in value or value.startswith("~")) and Path(value).expanduser().exists()


def portable(value, base: str | None = None):
    """A recipe (or one of its values) as a published card holds it: no path of this machine — a local file or
    folder named by its last part (import's ``--data`` / ``--model`` say where it is elsewhere), a local base model
    by its hub id ``base`` when it has one."""
    if isinstance(value, dict):
        return {k: portable(v, base) if k != "name_or_path" or not base or not local_path(v) else base
                for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v, base) for v in value]
    return Path(value).expanduser().name if local_path(value) else value


def recipe_data(name) -> object:
    """The data source finetune's recipe ``name`` trains on by default (None when ``name`` is not one of its
    recipes)."""
    from finetune.registry import recipe_path  # lazy: the registry imports every task module's names

    try:
        raw = read_yaml(recipe_path(str(name)), "recipe") if name and "/" not in str(name) else None
    except ConfigError:
        return None
    return ((raw or {}).get("data") or {}).get("source") if isinstance(raw, dict) else None


def file_sha256(path) -> str | None:
    """The sha256 of a local file (None when ``path`` is not one)."""
    p = Path(str(path)).expanduser()
    if not p.is_file():
        return None
    h = hashlib.sha256()
    with p.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def trained_digest(history: list) -> str | None:
    """One sha256 over every step's ``content_hash``, in order: what the run trained on, step by step."""
    hashes = [h.get("content_hash") for h in history]
    if not hashes or None in hashes:
        return None
    return hashlib.sha256(",".join(hashes).encode()).hexdigest()


def versions() -> dict:
    out = {}
    for name in FRAMEWORKS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def per_epoch(history: list, val_history: list) -> list[dict]:
    """One row per epoch: its last step, the mean of its steps' training losses, and its last evaluation."""
    rows = []
    for epoch in sorted({h["epoch"] for h in history}):
        steps = [h for h in history if h["epoch"] == epoch]
        evals = [v for v in val_history if v.get("epoch") == epoch and v.get("step")]
        row = {"epoch": epoch + 1, "step": steps[-1]["step"],
               "training loss": sum(h["loss"] for h in steps) / len(steps)}
        row.update({f"eval {k}": v for k, v in (evals[-1] if evals else {}).items() if k not in ("step", "epoch")})
        rows.append(row)
    return rows


def held_out_line(metrics: dict) -> str:
    """What the evaluation numbers rest on: the held-out rows, none, or not recorded (a run from before they were)."""
    rows = metrics.get("val_samples")
    if rows is None:
        return "held-out rows: not recorded"
    if not rows:
        return "no held-out rows: no evaluation numbers"
    return f"{rows} held-out row{'s' if rows > 1 else ''}: the evaluation numbers below rest on " + \
        ("them" if rows > 1 else "it")


def _table(rows: list[dict]) -> str:
    if not rows:
        return "(no optimizer step was taken)"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    show = lambda v: f"{v:.4f}" if isinstance(v, float) else "" if v is None else str(v)  # noqa: E731
    return "\n".join(["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)] +
                     ["| " + " | ".join(show(r.get(k)) for k in keys) + " |" for r in rows])


def card_text(settings: dict, metrics: dict, history: list, merged: bool = False) -> str:
    """The model card of a run whose resolved recipe is ``settings`` (its config.yaml), whose ``metrics.json`` and
    history are given; ``merged``: the card of ``model-merged/`` (the adapters merged into the base)."""
    # lazy: huggingface_hub's model card module costs 0.13 s, and this module is imported by every command
    from huggingface_hub import ModelCard, ModelCardData

    model, data, t = (settings.get(k) or {} for k in ("model", "data", "training"))
    peft = (settings.get("peft") or {}).get("enabled", False)
    name = model.get("name_or_path")
    base = base_model_id(name)
    effective, n = metrics.get("effective_batch_size"), metrics.get("gradient_accumulation_steps")
    micro = history[-1].get("micro_batch_size") if history else t.get("batch_size")
    processes = effective // (micro * n) if effective and micro and n else None
    arithmetic = metrics.get("arithmetic") or {}
    source = data.get("source")
    sha = file_sha256(source) if source else None
    meta = ModelCardData(base_model=base, library_name="peft" if peft and not merged else "transformers",
                         tags=[TAG, settings.get("task") or "custom", *(["lora"] if peft else [])],
                         pipeline_tag=None)
    recipe = yaml.safe_dump(portable(reproducible(described(settings), effective), base), sort_keys=False)
    what = "LoRA adapters" if peft and not merged else "LoRA merged into the base" if peft else "every weight"
    body = f"""
# {title(settings, base)}

{intro(settings, base, what)}

## Training

- effective batch **{effective}** per optimizer step, run as micro-batch {micro} × {n} accumulation steps × \
{processes} process(es); {metrics.get("optimizer_steps")} optimizer steps, {t.get("epochs")} epoch(s)
- precision: mixed precision `{t.get("mixed_precision") or "no"}`, weights `{model.get("dtype", "fp32")}`\
{", quantization " + model["quantization"] if model.get("quantization") not in (None, "none") else ""}; \
device: {arithmetic.get("device", "?")} ({arithmetic.get("name", "?")}{", TF32" if arithmetic.get("tf32") else ""})
- optimizer `{t.get("optimizer")}`, learning rate {t.get("learning_rate")}, schedule `{t.get("lr_scheduler")}`, \
seed {t.get("seed")}

## Data

- source: `{portable(source)}`{f" (sha256 `{sha}`)" if sha else ""}
- {metrics.get("train_samples")} training rows
- {held_out_line(metrics)}
- content digest of every window trained, in order: `{trained_digest(history)}` (sha256 over each step's \
`content_hash`; a run of the same data at any micro-batch records the same)

## Results

{_table(per_epoch(history, metrics.get("val_history") or []))}

## Reproduce it

```bash
finetune import THIS_FOLDER -o recipe.yaml           # the recipe below; --data FILE where the data is elsewhere
finetune run --recipe recipe.yaml --batch-size B      # any micro-batch B: the effective batch stays {effective}
finetune compare THE_ORIGINAL_RUN runs/…/NEW_RUN      # the certificate, step by step
```

## Certificate

{VERDICT_START}
Not compared yet: `finetune compare BASELINE RUN` writes its verdict here.
{VERDICT_END}

## Framework versions

{chr(10).join(f"- {k} {v}" for k, v in versions().items())}

## The recipe, resolved

{RECIPE_START}
```yaml
{recipe}```
{RECIPE_END}
"""
    # the body is text, not Jinja: a recipe's inline chat template ({{ … }}) must come out as written
    return str(ModelCard.from_template(meta, template_str="---\n{{ card_data }}\n---\n{% raw %}" + body +
                                       "{% endraw %}"))


def title(settings: dict, base: str | None) -> str:
    """The card's title: the base model and the data this run trained on (not the recipe's own name alone, which
    describes the recipe's data)."""
    name = (settings.get("model") or {}).get("name_or_path")
    model = (base or str(portable(name) or "a model")).split("/")[-1]
    data = (settings.get("data") or {}).get("source")
    return f"{model} fine-tuned on {portable(data)}" if data else f"{model}, {settings.get('name') or 'a finetune run'}"


def data_replaced(settings: dict) -> bool:
    """Whether the run trained on other data than its built-in recipe's own (whose description then describes
    data the run never saw)."""
    default = recipe_data(settings.get("name")) if settings.get("name") else None
    return default is not None and default != (settings.get("data") or {}).get("source")


def described(settings: dict) -> dict:
    """The settings the card embeds: the recipe's description dropped where it describes data the run did not
    train on (``data_replaced``), so that a recipe imported from the card does not carry it either."""
    return {k: v for k, v in settings.items() if k != "description"} if data_replaced(settings) else settings


def intro(settings: dict, base: str | None, what: str) -> str:
    """What was trained from which base on which data, and where the settings came from: the recipe's own
    description only when the run trained on the recipe's own data."""
    name = (settings.get("model") or {}).get("name_or_path")
    model = f"`{base}`" if base else f"`{portable(name)}` (a local model without a hub id)" if name else "a model"
    if base and name != base:  # a GGUF file or a local copy: the hub model is what the adapters load onto
        rounded = ", a quantized file: its weights are the hub model's rounded" if str(name).lower().endswith(
            ".gguf") else ""
        model += f" (trained from `{portable(name)}`{rounded})"
    source, recipe = (settings.get("data") or {}).get("source"), settings.get("name")
    own = described(settings).get("description")
    settings_from = (f"Settings from finetune's recipe `{recipe}`" + (
        "; its data replaced by this run's" if data_replaced(settings) else f": {own}" if own else "") + ".") \
        if recipe else ""
    return (f"{model}, fine-tuned with finetune (task `{settings.get('task')}`, {what}) on `{portable(source)}`. "
            f"{settings_from}").strip()


def reproducible(settings: dict, effective: int | None) -> dict:
    """The run's resolved recipe as a recipe that reproduces it at any micro-batch: its effective batch kept (N is
    then derived from the ``--batch-size`` given), its output section left to the new run."""
    recipe = {k: v for k, v in settings.items() if k != "output"}
    if effective:
        recipe["training"] = {**(recipe.get("training") or {}), "effective_batch_size": effective,
                              "gradient_accumulation_steps": None}
    return recipe


def write_cards(out_dir: Path, settings: dict, metrics: dict, history: list) -> list[Path]:
    """The card in the run's ``model/`` and ``model-merged/`` (those that exist), replacing peft's template card;
    the adapters' base named as the card names it (``name_adapters_base``)."""
    written, base = [], base_model_id((settings.get("model") or {}).get("name_or_path"))
    for folder, merged in (("model", False), ("model-merged", True)):
        if (out_dir / folder).is_dir():
            path = out_dir / folder / "README.md"
            path.write_text(card_text(settings, metrics, history, merged))
            written.append(path)
            name_adapters_base(out_dir / folder, base)
    return written


def name_adapters_base(folder: Path, base: str | None) -> None:
    """``adapter_config.json``'s ``base_model_name_or_path`` as the hub id ``base`` (peft wrote the folder the
    weights were loaded from, a path of this machine: the adapters would load nowhere else); null where the base
    has no hub id (``PeftModel.from_pretrained`` on a base the user loads still works)."""
    config = folder / "adapter_config.json"
    if not config.is_file():
        return
    values = json.loads(config.read_text())
    named = values.get("base_model_name_or_path")
    if named == base or (named is not None and not local_path(named) and not Path(str(named)).is_absolute()):
        return  # already a hub id (or a name that is no path)
    values["base_model_name_or_path"] = base
    config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def is_card(path) -> bool:
    """Whether ``path`` (a README.md or a folder holding one) is a finetune run's card."""
    p = Path(path)
    p = p / "README.md" if p.is_dir() else p
    return p.is_file() and p.suffix.lower() == ".md" and RECIPE_START in p.read_text(errors="replace")


def read_recipe(path) -> dict:
    """The resolved recipe a finetune card carries (``path``: the card or its folder); ConfigError when the block is
    missing or not a YAML mapping."""
    p = Path(path)
    p = p / "README.md" if p.is_dir() else p
    text = p.read_text(errors="replace")
    block = text.split(RECIPE_START, 1)[-1].split(RECIPE_END, 1)[0]
    found = re.search(r"```yaml\n(.*?)```", block, re.S)
    try:
        recipe = parse_yaml(found.group(1), str(p)) if found else None
    except ConfigError:
        recipe = None
    if not isinstance(recipe, dict):
        raise ConfigError(f"import: {p} holds no readable finetune recipe between its {RECIPE_START} markers")
    return recipe


def card_data_sha(path) -> str | None:
    """The sha256 of the training file a finetune card names (None when the data were not a local file)."""
    p = Path(path)
    p = p / "README.md" if p.is_dir() else p
    found = re.search(r"^- source: `.*?` \(sha256 `([0-9a-f]{64})`\)", p.read_text(errors="replace"), re.M)
    return found.group(1) if found else None


def record_verdict(run, verdict: str, against) -> list[Path]:
    """Write ``finetune compare``'s verdict of ``run`` against ``against`` into the run's cards (those it has)."""
    written = []
    for folder in ("model", "model-merged"):
        path = Path(run) / folder / "README.md"
        if not path.is_file() or VERDICT_START not in path.read_text():
            continue
        head, rest = path.read_text().split(VERDICT_START, 1)
        tail = rest.split(VERDICT_END, 1)[-1]
        path.write_text(f"{head}{VERDICT_START}\n`finetune compare {Path(against).name} {Path(run).name}`:\n\n"
                        f"{verdict}\n{VERDICT_END}{tail}")
        written.append(path)
    return written
