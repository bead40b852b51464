"""Where tasks and recipes are found: ``finetune/tasks/<name>.py`` and ``recipes/<name>.yaml``.

Recipes are edited in the checkout's ``recipes/`` folder and installed with the package (``finetune.recipes``
package data), so a wheel or ``pip install .`` finds the same files. ``FINETUNE_RECIPES`` points elsewhere.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import yaml

from finetune.errors import ConfigError


def recipes_dir() -> Path:
    """The recipe folder: ``$FINETUNE_RECIPES``, else the checkout's ``recipes/``, else the installed copy."""
    if os.environ.get("FINETUNE_RECIPES"):
        return Path(os.environ["FINETUNE_RECIPES"])
    here = Path(__file__).resolve().parent
    checkout = here.parent / "recipes"
    return checkout if checkout.is_dir() else here / "recipes"  # installed: finetune/recipes/*.yaml


def available_tasks() -> list[str]:
    return sorted(p.stem for p in (Path(__file__).parent / "tasks").glob("*.py") if not p.stem.startswith("_"))


def task_module(name: str):
    """Import ``finetune.tasks.<name>``; ConfigError naming the field when there is no such task."""
    if name is None:
        raise ConfigError(f"task: missing; give one of: {', '.join(available_tasks())}")
    if not isinstance(name, str) or not name.isidentifier() or name not in available_tasks():
        raise ConfigError(f"task: got {name!r}; allowed: {', '.join(available_tasks())}")
    return importlib.import_module(f"finetune.tasks.{name}")


def list_recipes() -> list[tuple[str, str]]:
    """(name, description) for every recipe in the recipe folder."""
    out = []
    for path in sorted(recipes_dir().glob("*.yaml")):
        try:
            desc = (yaml.safe_load(path.read_text()) or {}).get("description", "")
        except (yaml.YAMLError, AttributeError):
            desc = "(unreadable YAML)"
        out.append((path.stem, " ".join(str(desc).split())))
    return out


def recipe_path(name_or_path: str) -> Path:
    """A recipe name (``minilm-sentiment``) or a YAML path → the file; ConfigError when there is none."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if path.is_dir():
            raise ConfigError(f"recipe: {name_or_path} is a directory; give a YAML file or a recipe name")
        if not path.is_file():
            raise ConfigError(f"recipe: file {name_or_path} not found")
        return path
    path = recipes_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        names = ", ".join(n for n, _ in list_recipes())
        raise ConfigError(f"recipe: unknown recipe {name_or_path!r}; available: {names}")
    return path
