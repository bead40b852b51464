"""A finetune run as ``finetune compare`` and ``finetune reproduce`` read it: its folder read once into a :class:`Run`
(its history, metrics, config, rollouts, model config and where its weights are), which every layer, the floor, the
twin's layout and the curves take instead of reading the folder again."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Optional

from safetensors.torch import load_file

from finetune.outputs import read_config, read_history, read_metrics

# where a run saves its weights, in the order they are looked for (a LoRA run's adapters, a merged copy)
WEIGHT_FILES = ("model/model.safetensors", "model/adapter_model.safetensors", "model-merged/model.safetensors")


@dataclass(frozen=True)
class Run:
    """One finetune run's folder, read once. ``config``: its config.yaml (None without one); ``weight_files``: the
    safetensors files of its trained weights (empty: none saved), loaded on first use by :attr:`weights`."""

    path: Path
    history: list
    metrics: dict
    config: Optional[dict]
    rollouts: Optional[list]            # a GRPO run's rollouts.jsonl, one record per generation batch
    model_config: Optional[dict]        # its model/config.json (the architecture a baseline's is checked against)
    weight_files: tuple = ()

    @property
    def recipe(self) -> dict:
        """The config's sections ({} without a config.yaml)."""
        return self.config or {}

    @property
    def dropout_layers(self) -> int:
        """How many of its layers drew dropout masks keyed by sample (0: none, or a run from before they were
        counted)."""
        return (self.metrics or {}).get("dropout_layers") or 0

    @property
    def dropout_seed(self):
        """The seed its masks were keyed by: ``training.dropout_seed``, else ``training.seed`` (None: no config)."""
        training = self.recipe.get("training") or {}
        return training.get("seed") if training.get("dropout_seed") is None else training["dropout_seed"]

    @cached_property
    def weights(self) -> dict | None:
        """The trained weights (name → tensor), read once; None when the run saved none."""
        if not self.weight_files:
            return None
        out = {}
        for path in self.weight_files:
            out.update(load_file(str(path)))
        return out


def read_run(run, command: str = "compare") -> Run:
    """The run at ``run`` (a folder, or a ``Run`` already read: returned as it is); ConfigError naming ``command``
    when it holds no history.jsonl."""
    if isinstance(run, Run):
        return run
    path = Path(run)
    config = path / "model" / "config.json"
    return Run(path, read_history(path, command), read_metrics(path), read_config(path), _rollouts(path),
               json.loads(config.read_text()) if config.is_file() else None, _weight_files(path))


def _weight_files(run: Path) -> tuple:
    """The first of ``WEIGHT_FILES`` the run has, else its sharded model's files, else none."""
    single = next((run / name for name in WEIGHT_FILES if (run / name).is_file()), None)
    if single is not None:
        return (single,)
    return tuple(sorted((run / "model").glob("model-*.safetensors"))) if (run / "model").is_dir() else ()


def _rollouts(run: Path) -> list | None:
    """A GRPO run's rollouts.jsonl (one record per generation batch); None without one."""
    path = run / "rollouts.jsonl"
    if not path.is_file():
        return None
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
