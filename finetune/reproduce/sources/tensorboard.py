"""The per-step log in TensorBoard event files, as HF Trainer's ``TensorBoardCallback`` writes it (what axolotl's runs
keep under ``output_dir/runs/``): scalars ``train/loss``, ``train/learning_rate``, ``train/grad_norm`` and
``eval/loss`` at the Trainer's ``global_step``, and the text ``args`` (``TrainingArguments.to_json_string()``). A
folder that holds them and no ``trainer_state.json`` is read as a Hub folder whose log they are
(:func:`files.read_events`, with TensorBoard's own reader)."""

from __future__ import annotations

from pathlib import Path

import finetune.reproduce.sources.files as files
from finetune.reproduce.record import Baseline
from finetune.reproduce.sources.contract import Reader


class TensorBoard(Reader):
    name = "TensorBoard logs"
    reads = "a folder of the Trainer's TensorBoard event files (runs/: loss, lr, grad norm, its arguments)"
    general = True

    def recognises(self, path: Path) -> bool:
        return path.is_dir() and files.state_file(path) is None and bool(files.event_files(path))

    def read(self, path: Path, what: str) -> Baseline:
        return files.read_folder(path, what)


SOURCE = TensorBoard()
