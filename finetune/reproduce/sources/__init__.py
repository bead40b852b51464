"""Every tool whose runs finetune reads: one module per tool, each with one ``SOURCE`` that keeps the contract of
:class:`contract.Source`, and :data:`SOURCES`, the table of them in the order they are tried. Adding a tool is one
module here and one line in the table; the commands' help, their refusals and the docs' table of sources are made
from it.

The tools built on the HF Trainer leave its files too (``files`` reads them for all): their sources come before the
Trainer's own forms (``general``), which take what no tool claims."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from finetune.errors import ConfigError
from finetune.loading import read_yaml
from finetune.reproduce.processes import settled
from finetune.reproduce.record import Baseline, Source
from finetune.reproduce.sources import (
    axolotl,
    files,
    finetune_run,
    hub,
    llamafactory,
    msswift,
    tensorboard,
    torchtune,
    trainer,
    trl_config,
)
from finetune.reproduce.task_settings import trl_shuffled

SOURCES: tuple[Source, ...] = (
    finetune_run.SOURCE,
    llamafactory.SOURCE,
    msswift.SOURCE,
    torchtune.SOURCE,
    axolotl.SOURCE,
    trl_config.SOURCE,
    tensorboard.SOURCE,
    hub.SOURCE,
    trainer.SOURCE,
)


def names() -> str:
    """The tools read, for ``--help``: "finetune, LLaMA-Factory, …"."""
    return ", ".join(s.name for s in SOURCES)


def accepted() -> str:
    """What is read of each tool, ``name: what`` per source, for ``--help`` and the docs."""
    return "; ".join(f"{s.name}: {s.reads}" for s in SOURCES)


def recognised_by(path) -> list:
    """The sources that recognise ``path``, in the table's order."""
    return [s for s in SOURCES if s.recognises(Path(path))]


def read_baseline(path, what: str = "baseline", processes: Optional[int] = None, data=None) -> Baseline:
    """The run at ``path``, read whole by the first source that recognises it, its processes settled
    (:func:`processes.settled`: its files', else ``--processes`` ``processes``, else those its steps over ``--data``
    ``data`` show); ConfigError (one line) when it does not exist, when no source does, or when it is unreadable."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{what}: {path} does not exist")
    source = next((s for s in SOURCES if s.recognises(path)), None)  # the first: the others are not looked at
    if source is None:
        if path.suffix.lower() in (".yaml", ".yml"):
            read_yaml(path, what)  # a file that is not YAML is said so first
        said = "holds no trainer_state.json (nor a checkpoint-*/ with one) and no training_args.bin, nor another " \
            "tool's run" + (", and its README.md lists no training hyperparameters" if (path / "README.md").is_file()
                            else "") if path.is_dir() else "is not a run finetune reads"
        raise ConfigError(f"{what}: {path} {said} (a run of {names()}: finetune import --help says what of each)")
    b = source.read(path, what)
    files.unsaid_accumulation(b)  # after the reader: its own config may say what the Trainer's files do not
    files.read_versions(b)  # DeepSpeed's and transformers' where the run's folder says them (its engine's steps)
    b.source = source
    b.shuffled = b.shuffled or trl_shuffled(b)  # a Trainer-based tool's own reader may say it (axolotl, ms-swift)
    b.processes = settled(b, source.processes(b), processes, data)
    return b


def docs_table() -> str:
    """The table of sources in docs/reproduce/sources.md (a test holds the page to it)."""
    rows = [f"| {s.name} | {s.reads} | `{type(s).__module__.replace('.', '/')}.py` |" for s in SOURCES]
    return "\n".join(["| source | what is read | module |", "|---|---|---|", *rows])
