"""The contract every reader of another tool's runs keeps: :class:`Source`. Each tool finetune reads has one module in
this package holding one ``SOURCE`` that implements it, and ``sources.SOURCES`` lists them in the order they are tried;
nothing else names a tool. :class:`Reader` gives the answers of a tool that does as the HF Trainer does, which a
source overrides where its tool does otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Protocol

import yaml

from finetune.registry import built_in_hints
from finetune.reproduce.record import Baseline


class Source(Protocol):
    """One tool whose runs finetune reads.

    Attributes:
        name: what the tool is called in messages and in ``--help`` (``LLaMA-Factory``).
        reads: one line on what of it is read (``--help``, the refusals that list what is accepted, the docs' table).
        general: whether it is a form every tool built on the HF Trainer leaves (its output folder, a Hub folder,
            TensorBoard logs), which a more specific source before it in ``SOURCES`` may claim first.
    """

    name: str
    reads: str
    general: bool

    def recognises(self, path: Path) -> bool:
        """Whether ``path`` is a run of this tool (looked at, not read whole)."""

    def read(self, path: Path, what: str) -> Baseline:
        """The run at ``path`` as a ``Baseline``; ConfigError (one line naming the file) when unreadable."""

    def carry_own(self, b: Baseline, out, model_fields: dict, data_fields: set, baseline_step: bool) -> None:
        """The tool's own settings onto the recipe being imported (``out``: ``carry.Imported``; the recipe's model
        fields, name → type, and data fields), last, after the TrainingArguments'. ``baseline_step``: take the tool's
        own step where it is not the big batch's."""

    def warmup(self, b: Baseline, ratio: float, total: Optional[int]) -> Optional[tuple]:
        """(warm-up steps or None, how) for a warm-up ``ratio`` of ``total`` steps, as the tool rounds it; None: as
        the Trainer does."""

    def task(self, b: Baseline) -> Optional[str]:
        """The built-in task the run trained, by the tool's own names for tasks (the tasks' hints say them)."""

    def processes(self, b: Baseline) -> Optional[tuple]:
        """(the number of processes the run trained on, where that is said) where the tool's files say it."""

    def training_rows(self, b: Baseline, data, recipe: Path):
        """The file ``import`` trains on for ``--data`` ``data`` (None: not given): the rows as the tool trained them,
        written beside ``recipe`` when they had to be rewritten."""

    def whole_recipe(self, b: Baseline, data, model) -> Optional[tuple]:
        """(a recipe that reproduces the run whole, the lines ``import`` says of it) for a tool whose runs carry
        their own recipe (finetune's), ``data`` and ``model`` where they are on this machine; None: the run's
        settings are carried onto a base recipe."""

    def run_folder(self, b: Baseline) -> Optional[Path]:
        """The run folder when the run is finetune's own, compared run against run; None for another tool's."""


class Reader:
    """The answers of a tool that does as the HF Trainer does; a source overrides those where its tool differs."""

    general = False

    def carry_own(self, b: Baseline, out, model_fields: dict, data_fields: set, baseline_step: bool) -> None:
        return None

    def warmup(self, b: Baseline, ratio: float, total: Optional[int]) -> Optional[tuple]:
        return None

    def task(self, b: Baseline) -> Optional[str]:
        return b.task or trl_task(b)

    def processes(self, b: Baseline) -> Optional[tuple]:
        """The Trainer's card says ``num_devices`` (with several processes)."""
        return (int(b.get("num_devices")), b.args["num_devices"][1]) if b.get("num_devices") else None

    def training_rows(self, b: Baseline, data, recipe: Path):
        return data

    def whole_recipe(self, b: Baseline, data, model) -> Optional[tuple]:
        return None

    def run_folder(self, b: Baseline) -> Optional[Path]:
        return None


def trl_task(b: Baseline) -> Optional[str]:
    """The built-in task a TRL run trained: the one whose marks (its trainer's own arguments) the run holds all of,
    the one with the most marks first — a GRPOConfig holds DPOConfig's beta and loss_type too."""
    if not b.trl:
        return None
    held = [(len(h.trl_marks), name) for name, h in built_in_hints().items()
            if h.base_recipe and h.trl_marks is not None and all(b.get(m) is not None for m in h.trl_marks)]
    return max(held)[1] if held else None


def yaml_mapping(path: Path) -> Optional[dict]:
    """A YAML file's mapping, to recognise a tool's config by its keys; None for anything else (not YAML, not a
    mapping, unreadable): the source that reads it says why."""
    if not (path.is_file() and path.suffix.lower() in (".yaml", ".yml")):
        return None
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8", errors="replace"))
    except (yaml.YAMLError, OSError):
        return None
    return raw if isinstance(raw, dict) else None
