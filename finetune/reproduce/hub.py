"""A Hub-style folder: what ``push_to_hub`` of a TRL (or axolotl) run leaves in a model repo — the weights or
adapters, ``training_args.bin`` and the card — with no ``trainer_state.json`` (neither TRL nor axolotl pushes one).

Its settings come across whole (``training_args.bin`` is the full TrainingArguments / SFTConfig), so ``finetune
import`` writes the same recipe as from the output folder; what it lacks is a per-step log, so ``finetune compare``
certifies what it can (the settings, each window's samples from the seed, the card's evaluation, the trained weights)
and says in one line that no step can be held against the baseline's."""

from __future__ import annotations

from pathlib import Path

from finetune.errors import ConfigError
from finetune.reproduce.record import Baseline

KIND = "Hub folder"
ARGS_FILES = ("training_args.json", "training_args.bin")


def hub_folder(folder: Path, what: str, events_too: bool = False) -> Baseline:
    """The baseline of a folder without ``trainer_state.json``: a Hub folder when it holds the arguments file (or,
    ``events_too``, the Trainer's TensorBoard event files, which hold them too); the caller reads the rest as for a
    Trainer folder. ConfigError (one line) when it holds neither."""
    if not events_too and not any((folder / name).is_file() for name in ARGS_FILES):
        raise ConfigError(f"{what}: {folder} holds no trainer_state.json (nor a checkpoint-*/ with one) and no "
                          "training_args.bin; give a Trainer/TRL output or checkpoint folder, a Hub folder with its "
                          "training_args.bin, or its model card README.md")
    return Baseline(KIND, folder)


def no_step_log(base: Baseline) -> str | None:
    """The one line ``compare`` says of a baseline that logged no step (None when it did)."""
    if base.logs:
        return None
    why = " (TRL and axolotl push no trainer_state.json)" if base.kind == KIND else ""
    return (f"no per-step log in the {base.kind}{why}: no step's loss, lr or grad norm is certified against the "
            "baseline's, only what it holds")
