"""A Hub-style folder: what ``push_to_hub`` of a TRL (or axolotl) run leaves in a model repo — the weights or
adapters, ``training_args.bin`` and the card — with no ``trainer_state.json`` (neither TRL nor axolotl pushes one).

Its settings come across whole (``training_args.bin`` is the full TrainingArguments / SFTConfig), so ``finetune
import`` writes the same recipe as from the output folder; what it lacks is a per-step log, so ``finetune compare``
certifies what it can (the settings, each window's samples from the seed, the card's evaluation, the trained weights)
and says in one line that no step can be held against the baseline's."""

from __future__ import annotations

from pathlib import Path

import finetune.reproduce.sources.files as files
from finetune.reproduce.record import Baseline
from finetune.reproduce.sources.contract import Reader


class Hub(Reader):
    name = "Hub folder"
    reads = ("a pushed model repo: training_args.bin (or .json), the card and the weights, no trainer_state.json; "
             "or an adapters folder whose card lists the Trainer's hyperparameters (adapter_config.json beside it)")
    general = True

    def recognises(self, path: Path) -> bool:
        return path.is_dir() and files.state_file(path) is None and not files.event_files(path) and \
            (files.has_args_file(path) or files.is_card_folder(path))

    def read(self, path: Path, what: str) -> Baseline:
        return files.read_folder(path, what)


SOURCE = Hub()


def no_step_log(b: Baseline) -> str | None:
    """The one line ``compare`` says of a baseline that logged no step (None when it did)."""
    if b.logs:
        return None
    why = " (TRL and axolotl push no trainer_state.json)" if b.source is SOURCE else ""
    return (f"no per-step log in the {b.kind}{why}: no step's loss, lr or grad norm is certified against the "
            "baseline's, only what it holds")
