"""The HF Trainer's own runs (TRL's too, which train with it): an output or checkpoint folder, its model card, its
arguments JSON or ``training_args.bin``. Read by :mod:`files`, which every Trainer-based tool's source shares."""

from __future__ import annotations

from pathlib import Path

import finetune.reproduce.sources.files as files
from finetune.reproduce.record import Baseline
from finetune.reproduce.sources.contract import Reader

FILE_FORMS = (".md", ".json", ".bin")


class Trainer(Reader):
    name = "Trainer / TRL"
    reads = ("an output or checkpoint folder (trainer_state.json, training_args.json or .bin, the card, the weights), "
             "its model card README.md, or its arguments as JSON or training_args.bin")
    general = True

    def recognises(self, path: Path) -> bool:
        if path.is_dir():
            return files.state_file(path) is not None
        return path.is_file() and path.suffix.lower() in FILE_FORMS

    def read(self, path: Path, what: str) -> Baseline:
        return files.read_folder(path, what) if path.is_dir() else files.read_file(path, what)


SOURCE = Trainer()
