"""The command-line flags that set recipe fields, for every command that takes them (``finetune run``, ``finetune
plan``): each is generated from its field's documentation (``schema.doc(..., flag=...)``) and becomes one
``section.key=value`` override, applied before ``--set``, so a flag means the same on every command.

    add_field_flags(parser, ["training.effective_batch_size"])   # --effective-batch-size, as run takes it
    add_data_flag(parser)                                         # --data FILE
    cfg = load_recipe(args.recipe, field_overrides(args) + args.set)
"""

from __future__ import annotations

import argparse
from typing import Optional

from finetune.config import documented_fields
from finetune.errors import ConfigError

DATA_FIELD = "data.source"  # a task's own data section: every task that reads a file names it so


def flag_fields(names: Optional[list] = None) -> list:
    """(flag, ``section.field``, dataclass field) for the recipe fields that have a flag (``names``: only these)."""
    out = [(f.metadata["flag"], name, f) for name, f in documented_fields() if f.metadata.get("flag")]
    return [row for row in out if names is None or row[1] in names]


def add_field_flags(p: argparse.ArgumentParser, names: Optional[list] = None) -> None:
    """Add the flags of ``names`` (default: every field that has one) to ``p``."""
    for flag, name, f in flag_fields(names):
        if f.type in (bool, "bool"):
            p.add_argument(flag, action="store_true", help=f"{f.metadata['help']} ({name})")
        else:
            p.add_argument(flag, help=f"{f.metadata['help']} ({name})")


def add_data_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", metavar="FILE", help=f"train on this file instead of the recipe's data ({DATA_FIELD}: "
                                                  "a jsonl / json / parquet / csv file the task reads)")


def field_overrides(args) -> list[str]:
    """The field flags ``args`` was given (those its parser has), as ``section.key=value`` overrides.

    Raises:
        ConfigError: both --effective-batch-size and --grad-accum-steps.
    """
    out = []
    for flag, name, f in flag_fields():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if f.type in (bool, "bool"):
            out += [f"{name}=true"] if value else []
        elif value is not None:
            out.append(f"{name}={value}")
    effective, n = getattr(args, "effective_batch_size", None), getattr(args, "grad_accum_steps", None)
    if effective is not None and n is not None:
        raise ConfigError("--effective-batch-size: give it or --grad-accum-steps, not both")
    if n is not None:  # an explicit N replaces the recipe's effective batch
        out.append("training.effective_batch_size=null")
    if effective is not None:  # and an explicit effective batch the recipe's N
        out.append("training.gradient_accumulation_steps=null")
    if getattr(args, "data", None) is not None:
        out.append(f"{DATA_FIELD}={args.data}")
    return out
