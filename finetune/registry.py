"""Where tasks and recipes are found.

A recipe's ``task`` names a built-in task (``finetune/tasks/<name>.py``), any importable module
(``mypackage.my_task``), or a Python file (``./my_task.py``, relative to the recipe's folder): a task lives in the
user's own folder, not in a fork. Recipes are ``recipes/<name>.yaml``, edited in the checkout's ``recipes/`` folder
and installed with the package (``finetune.recipes`` package data), so a wheel or ``pip install .`` finds the same
files. ``FINETUNE_RECIPES`` points elsewhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from typing import Optional

import yaml

from finetune.errors import ConfigError
from finetune.job import CompareHints

# what a task module defines (a dataclass for each of the recipe's own sections)
TASK_API = ("build(cfg) -> Job, and ModelConfig / DataConfig dataclasses for the recipe's model / data sections "
            "if it has settings there")


def recipes_dir() -> Path:
    """The recipe folder: ``$FINETUNE_RECIPES``, else the checkout's ``recipes/``, else the installed copy."""
    if os.environ.get("FINETUNE_RECIPES"):
        return Path(os.environ["FINETUNE_RECIPES"])
    here = Path(__file__).resolve().parent
    checkout = here.parent / "recipes"
    return checkout if checkout.is_dir() else here / "recipes"  # installed: finetune/recipes/*.yaml


# The built-in tasks: modules of finetune/tasks (chat is what sft, dpo and grpo share, not a task).
BUILT_IN_TASKS = ("clm", "dpo", "grpo", "latent_ode", "sentiment", "sft", "vae_gan", "video")


def available_tasks() -> list[str]:
    return list(BUILT_IN_TASKS)


def allowed_tasks() -> str:
    return (f"one of {', '.join(available_tasks())}, an importable module (mypackage.my_task) or a .py file "
            "(./my_task.py, relative to the recipe's folder)")


def is_task_file(name: str) -> bool:
    return name.endswith(".py") or "/" in name or os.sep in name


def resolve_task(name, relative_to: Optional[Path] = None) -> str:
    """The recipe's ``task`` as the run keeps it: a built-in name or a module name as given, a file as its absolute
    path (a relative one taken from ``relative_to``, the recipe's folder; else the working directory), so that the
    run's ``config.yaml`` names the same file from anywhere. ConfigError when it is none of these."""
    if name is None:
        raise ConfigError(f"task: missing; give {allowed_tasks()}")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"task: got {name!r}; allowed: {allowed_tasks()}")
    if not is_task_file(name):
        if not all(part.isidentifier() for part in name.split(".")):
            raise ConfigError(f"task: got {name!r}; allowed: {allowed_tasks()}")
        return name
    path = Path(name).expanduser()
    path = (path if path.is_absolute() else Path(relative_to or ".") / path).resolve()
    if path.suffix != ".py":
        raise ConfigError(f"task: got {name!r}; a task file is a Python file ending in .py; allowed: "
                          f"{allowed_tasks()}")
    if not path.is_file():
        raise ConfigError(f"task: file {path} not found; allowed: {allowed_tasks()}")
    return str(path)


def task_module(name, relative_to: Optional[Path] = None):
    """Import the task ``name`` names (see ``resolve_task``): ``finetune.tasks.<name>``, a module, or a file. It must
    define ``build``; ``ModelConfig`` and ``DataConfig``, when it defines them, must be dataclasses (a task without
    them has empty model and data sections). ConfigError naming ``task`` when it is not found, does not import (a
    syntax error, a missing dependency, an exception) or is not a task."""
    name = resolve_task(name, relative_to)
    if name in available_tasks():
        module = importlib.import_module(f"finetune.tasks.{name}")
    elif is_task_file(name):
        module = _import_file(Path(name))
    else:
        module = _import_module(name)
    if not callable(getattr(module, "build", None)):
        raise ConfigError(f"task: {name} has no {'callable ' if hasattr(module, 'build') else ''}build; a task "
                          f"module defines {TASK_API}")
    not_dataclasses = [a for a in ("ModelConfig", "DataConfig") if not _is_dataclass_type(section_class(module, a))]
    if not_dataclasses:
        raise ConfigError(f"task: {name}: {' and '.join(not_dataclasses)} must be a dataclass; a task module defines "
                          f"{TASK_API}")
    return module


def task_hints(name) -> CompareHints:
    """What compare and reproduce know of the task ``name`` (a run's ``task``): its module's ``COMPARE_HINTS``; the
    defaults for a task that declares none, and for one that no longer imports here (a run's task file since moved:
    its runs still compare, with the settings every task has)."""
    try:
        module = task_module(name)
    except ConfigError:
        return CompareHints()
    return getattr(module, "COMPARE_HINTS", CompareHints())


def built_in_hints() -> dict[str, CompareHints]:
    """Each built-in task's hints, by name: what reproduce searches for the task a baseline trained."""
    return {name: task_hints(name) for name in available_tasks()}


@dataclasses.dataclass
class NoSettings:
    """The model or data section of a task that declares none: it holds no keys."""


def section_class(module, name: str) -> type:
    """The dataclass of a task's ``model`` or ``data`` section (``name``: ModelConfig or DataConfig)."""
    return getattr(module, name, NoSettings)


def _is_dataclass_type(obj) -> bool:
    return isinstance(obj, type) and dataclasses.is_dataclass(obj)


def _import_module(name: str):
    """``importlib.import_module(name)``; ConfigError when the module (or its package) is not there or fails to
    import."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):  # the task itself is missing
            raise ConfigError(f"task: got {name!r}; allowed: {allowed_tasks()}; no module {name} is importable "
                              "here (is its folder on PYTHONPATH?)") from None
        raise ConfigError(f"task: {name} does not import: {_why(e)}") from None
    except Exception as e:  # the user's module failed while importing: say where, in one line
        raise ConfigError(f"task: {name} does not import: {_why(e)}") from None


def _import_file(path: Path):
    """Import the task file at ``path`` (absolute) once per process, as a module of its own (its folder is not put on
    ``sys.path``: a ``datasets.py`` beside the recipe must not shadow the library)."""
    key = f"finetune_task_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # before running it: dataclasses and typing look their module up there
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[key]
        raise ConfigError(f"task: {path} does not import: {_why(e)}") from None
    return module


def _why(e: BaseException) -> str:
    """``SyntaxError: invalid syntax (my_task.py, line 3)``: the error and the line of the user's code that raised
    it."""
    if isinstance(e, SyntaxError):
        where = f"{Path(e.filename or '?').name}, line {e.lineno}"
        return f"{type(e).__name__}: {e.msg} ({where})"
    frames = traceback.extract_tb(e.__traceback__)
    libraries = {sys.prefix, sys.base_prefix, str(Path(__file__).resolve().parent)}
    frames = [f for f in frames if not f.filename.startswith("<frozen")
              and not any(f.filename.startswith(p) for p in libraries)] or frames  # the user's own line
    where = f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if frames else ""
    message = " ".join(str(e).split())
    return f"{type(e).__name__}: {message}{where}" if message else f"{type(e).__name__}{where}"


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
