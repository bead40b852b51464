"""Whether two models are the same architecture: a baseline's ``config.json`` against the model a recipe names."""

from __future__ import annotations

import json
from pathlib import Path

from finetune.models.hf import resolve_model_path

ARCHITECTURE = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "n_embd", "n_layer", "n_head")


def model_config_of(model_section) -> dict | None:
    """The architecture a recipe's model section names: its checkpoint's config.json, or ``model.config``."""
    name = getattr(model_section, "name_or_path", None)
    if name:
        folder = Path(resolve_model_path(name)) if not name.startswith("gguf:") else None
        if folder is not None and (folder / "config.json").is_file():
            return {**json.loads((folder / "config.json").read_text()), **(getattr(model_section, "config", None)
                                                                          or {})}
        return None
    return getattr(model_section, "config", None)


def model_difference(baseline: dict | None, mine: dict | None) -> str | None:
    """``hidden_size 64 vs 128`` for the first architecture field both name and disagree on; None when none."""
    if not baseline or not mine:
        return None
    for key in ARCHITECTURE:
        if key in baseline and key in mine and baseline[key] != mine[key]:
            return f"{key} {baseline[key]} vs {mine[key]}"
    return None
