"""LLaMA-Factory's stages (``stage: sft|pt|dpo|…``) as finetune's tasks: each task's hints name the stage it
trains (``CompareHints.peer_names``), so nothing here names a task; the stage an output folder without its YAML
trained, from its log."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

from finetune.registry import built_in_hints, section_class, task_module
from finetune.reproduce.record import Objective

TOOL = "llamafactory"  # this tool's name in a task's CompareHints.peer_names


def logged_stage(folder: Path) -> tuple:
    """(the stage an output folder's log shows, how it is known, whether the log shows it): the stage of the task
    whose log marks (``CompareHints.log_marks``: DPO's ``rewards/chosen``) trainer_state's log holds, else
    LLaMA-Factory's default stage (assumed: ``llamafactory-cli train --stage`` may have named another)."""
    try:
        history = json.loads((folder / "trainer_state.json").read_text()).get("log_history") or []
    except (OSError, ValueError):
        history = []
    logged = {key for e in history if isinstance(e, dict) for key in e}
    for hints in built_in_hints().values():
        if TOOL in hints.peer_names and hints.log_marks and set(hints.log_marks) <= logged:
            return hints.peer_names[TOOL], (f"trainer_state.json: its log holds {', '.join(hints.log_marks)}, a "
                                            f"{hints.peer_names[TOOL]} stage"), True
    default = next(h.peer_names[TOOL] for h in built_in_hints().values() if TOOL in h.peer_default)
    return default, (f"no YAML: LLaMA-Factory's default stage, {default} (its log holds none of another stage's "
                     "marks; the command line may have named another)"), False


def stage_task(stage) -> str | None:
    """The built-in task LLaMA-Factory's ``stage`` trains (the one whose hints name it; no stage: LLaMA-Factory's
    default), None for a stage no task trains."""
    for name, hints in built_in_hints().items():
        if (hints.peer_names.get(TOOL) == stage) if stage is not None else TOOL in hints.peer_default:
            return name
    return None


def stage_objective(b) -> Objective | None:
    """The task the run's stage trains (``b.own["stage"]``, else LLaMA-Factory's default stage), with where the
    stage is said; None for a stage no task trains."""
    stage, where = b.own.get("stage", (None, f"{b.path.name}: no stage (LLaMA-Factory's default, {stage_of(None)})"))
    task = stage_task(stage)
    return Objective(task, str(where)) if task else None


def stage_of(task) -> str:
    """LLaMA-Factory's name for a task's stage (None: its default stage's)."""
    hints = built_in_hints()
    return next(h.peer_names[TOOL] for name, h in hints.items() if TOOL in h.peer_names and
                (name == task if task is not None else TOOL in h.peer_default))


def pair_stage() -> str:
    """LLaMA-Factory's stage that trains preference pairs: that of the task whose step depends on a beta."""
    return next(h.peer_names[TOOL] for h in built_in_hints().values() if TOOL in h.peer_names and
                "model.beta" in h.step_settings)


def stages() -> list:
    """The stages of LLaMA-Factory that finetune trains."""
    return [h.peer_names[TOOL] for h in built_in_hints().values() if TOOL in h.peer_names]


def stage_has(b, section: str, name: str) -> bool:
    """Whether the task the baseline's stage trains has the setting ``section.name`` (its hints' tool, not the
    recipe's: a stage's own settings are carried only from the stage that has them)."""
    if b.objective is None:
        return False
    module = task_module(b.objective.name)
    return name in {f.name for f in dataclasses.fields(section_class(module, f"{section.title()}Config"))}


def stage_allows(b, section: str, name: str, value) -> bool:
    """Whether the stage's task takes ``value`` for the setting ``section.name`` (one of its choices)."""
    if not stage_has(b, section, name):
        return False
    hint = typing.get_type_hints(section_class(task_module(b.objective.name), f"{section.title()}Config"))[name]
    return value in typing.get_args(hint)
