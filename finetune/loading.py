"""Reading a recipe: the one YAML reader (duplicate keys refused), dotted ``section.key=value`` overrides, the
sections built from the schema (``finetune.config``, ``finetune.schema``) and validated (``finetune.validation``),
every problem reported at once.

    >>> cfg = load_recipe("minilm-sentiment", ["training.batch_size=16"])
    >>> cfg.training.batch_size
    16
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Optional

import yaml

from finetune.config import OutputConfig, PeftConfig, RecipeConfig, TrainingConfig
from finetune.errors import ConfigError
from finetune.registry import recipe_path, resolve_task, section_class, task_module
from finetune.schema import build_section
from finetune.validation import validate_recipe


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"training.lr_scheduler=cosine"`` → (["training", "lr_scheduler"], "cosine"); values are parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"--set {item}: expected section.key=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides) -> dict:
    for item in overrides or []:
        keys, value = parse_override(item) if isinstance(item, str) else item
        if len(keys) == 1 and keys[0] in ("task", "name", "description"):
            raw[keys[0]] = value
            continue
        if len(keys) != 2 or keys[0] not in ("model", "data", "training", "output", "peft"):
            raise ConfigError(f"--set {'.'.join(keys)}: expected model|data|training|output|peft.key=value")
        section = raw.setdefault(keys[0], {})
        if not isinstance(section, dict):
            raise ConfigError(f"{keys[0]}: must be a mapping of keys to values")
        section[keys[1]] = value
    return raw


def config_from_dict(raw: dict, name: str = "custom", folder: Optional[Path] = None) -> RecipeConfig:
    """Validate a recipe mapping; ConfigError lists every problem. A ``task`` file given by a relative path is taken
    from ``folder`` (the recipe's; else the working directory) and kept as its absolute path."""
    if not isinstance(raw, dict):
        raise ConfigError("recipe: must be a YAML mapping with task, model, data, training, output")
    problems = []
    extra = set(raw) - {"task", "name", "description", "model", "data", "training", "output", "peft"}
    problems += [f"{k}: unknown top-level key; allowed: task, description, model, data, training, output, peft"
                 for k in sorted(extra)]
    task = resolve_task(raw.get("task"), folder)
    module = task_module(task)
    classes = section_classes(module)
    raw, notes = carry_moved(raw, classes, problems)
    sections = {s: build_section(cls, raw.get(s), s, problems) for s, cls in classes.items()}
    cfg = RecipeConfig(task=task, **sections, name=str(raw.get("name") or name),
                       description=str(raw.get("description") or ""), notes=notes)
    if not problems:
        validate_recipe(cfg, problems)
        if hasattr(module, "validate"):
            module.validate(cfg, problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def section_classes(module) -> dict:
    """section → the dataclass of a recipe's section for the task ``module``."""
    return {"model": section_class(module, "ModelConfig"), "data": section_class(module, "DataConfig"),
            "training": TrainingConfig, "output": OutputConfig, "peft": PeftConfig}


def moved_keys(task: str) -> dict:
    """old flat key → its flat key now (``data.packing`` → ``data.concatenate``), for ``task``'s sections: a
    checkpoint's settings, saved before a move, are compared under the new names."""
    try:
        classes = section_classes(task_module(task))
    except ConfigError:  # a task that is gone: nothing to carry
        return {}
    return {old: f"{section}.{key}" for section, cls in classes.items()
            for key, old in getattr(cls, "MOVED", {}).items()}


def carry_moved(raw: dict, classes: dict, problems: list) -> tuple[dict, list]:
    """Keys a release moved into another section, carried there from their old place for a release. A section's
    class names them in ``MOVED`` (its key → the old ``section.key``). Returns the recipe with each carried (a copy;
    ``raw`` is left as given) and one note per key carried; the two places given different values is a problem
    naming both."""
    notes = []
    for section, cls in classes.items():
        for key, old in getattr(cls, "MOVED", {}).items():
            old_section, old_key = old.split(".")
            source, target = raw.get(old_section), raw.get(section) or {}
            if not isinstance(source, dict) or old_key not in source or not isinstance(target, dict):
                continue  # nothing to carry, or a section that is not a mapping (build_section says so)
            value, new = source[old_key], f"{section}.{key}"
            raw = {**raw, old_section: {k: v for k, v in source.items() if k != old_key}}
            target = raw[section] if section == old_section else target  # a key renamed in its own section
            if key in target and target[key] != value:
                problems.append(f"{new}: {target[key]!r} here and {value!r} in {old}, its old place; give {new} "
                                "only")
                continue
            raw[section] = {**target, key: value}
            notes.append(f"note: {old} moved to {new}; the old key still works in this release and will be "
                         f"removed in a later one")
    return raw, notes


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the last one, silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then a key: an override, on purpose
                    continue
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if isinstance(key, typing.Hashable) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice (lines {seen[key]} and {line}); keep one",
                        key_node.start_mark)
                if isinstance(key, typing.Hashable):
                    seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path, what: str = "recipe") -> Any:
    """The YAML document in ``path`` (duplicate keys refused); ConfigError naming ``what``, the file and the line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what}: {path} is not a text file (not UTF-8); give a YAML file") from None
    return parse_yaml(text, f"{what}: {path}")


def parse_yaml(text: str, where: str) -> Any:
    """The YAML document ``text`` (duplicate keys refused): the one YAML reader of recipes, runs and configs.
    ConfigError ``"{where} is not valid YAML line N"`` (one line) when it is not YAML."""
    try:
        return yaml.load(text, Loader=_RecipeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None)
        why = f": {problem}" if problem and "given twice" in problem else ""
        raise ConfigError(f"{where} is not valid YAML{line}{why}") from None


def load_recipe(name_or_path: str, overrides=None) -> RecipeConfig:
    """Load ``recipes/<name>.yaml`` (or a path), apply ``section.key=value`` overrides, validate. A
    ``data.val_fraction`` among the overrides turns ``data.val_minimum`` off (unless that is given too)."""
    path = recipe_path(name_or_path)
    raw = read_yaml(path)
    if raw is None:
        raise ConfigError(f"recipe: {path} is empty; a recipe is a YAML mapping of task, model, data, training, "
                          "output")
    if not isinstance(raw, dict):
        raise ConfigError(f"recipe: {path} holds a YAML {type(raw).__name__}; a recipe is a mapping of task, model, "
                          "data, training, output")
    raw = apply_overrides(raw, overrides)
    cfg = config_from_dict(raw, name=path.stem, folder=path.parent)
    given = {".".join(parse_override(o)[0] if isinstance(o, str) else o[0]) for o in overrides or []}
    if "data.val_fraction" in given and "data.val_minimum" not in given and hasattr(cfg.data, "val_minimum"):
        cfg.data.val_minimum = False  # a fraction the user gave is theirs: held out as given
    return cfg
