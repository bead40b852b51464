"""The per-step log in TensorBoard event files, as HF Trainer's ``TensorBoardCallback`` writes it (what axolotl's runs
keep under ``output_dir/runs/``): scalars ``train/loss``, ``train/learning_rate``, ``train/grad_norm`` and
``eval/loss`` at the Trainer's ``global_step``, and the text ``args`` (``TrainingArguments.to_json_string()``).
Read with TensorBoard's own reader (``event_accumulator``), not by parsing the records."""

from __future__ import annotations

import json
from pathlib import Path

from finetune.errors import ConfigError
from finetune.reproduce.record import Baseline

TRAIN = {"train/loss": "loss", "train/learning_rate": "learning_rate", "train/grad_norm": "grad_norm"}


def event_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("events.out.tfevents.*"))


def read_events(files: list[Path], b: Baseline) -> None:
    """The Trainer's log in ``files`` into ``b``: ``logs`` (one entry per logged step), ``evals``, and the arguments
    (source: the event file) where no arguments file says them."""
    try:  # lazy: 0.1 s on every command (this module is on each one's path); only a TensorBoard log needs it
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError:
        raise ConfigError(f"{b.path}: reading its TensorBoard event files needs the tensorboard package "
                          "(pip install tensorboard)") from None
    steps, evals = {}, {}
    for path in files:
        acc = event_accumulator.EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
        try:
            acc.Reload()
        except Exception as e:  # a truncated or foreign file: said in one line
            raise ConfigError(f"{b.path}: {path.name} is not a readable TensorBoard event file "
                              f"({type(e).__name__})") from None
        tags = acc.Tags()
        for tag, name in TRAIN.items():
            for event in acc.Scalars(tag) if tag in tags.get("scalars", []) else []:
                steps.setdefault(event.step, {"step": event.step})[name] = float(event.value)
        for event in acc.Scalars("eval/loss") if "eval/loss" in tags.get("scalars", []) else []:
            evals[event.step] = float(event.value)
        if "args/text_summary" in tags.get("tensors", []):
            text = acc.Tensors("args/text_summary")[-1].tensor_proto.string_val[0].decode("utf-8", "replace")
            try:
                args = json.loads(text)
            except ValueError:
                args = {}
            where = f"{path.parent.name}/{path.name[:24]}…: args"
            b.args.update({k: (v, where) for k, v in args.items() if k not in b.args})
    b.logs = [steps[s] for s in sorted(steps) if "loss" in steps[s]]
    b.evals = sorted(evals.items())
    b.lr_rounding = 1.2e-7  # a scalar event holds an fp32: the lr rounded to 2^-23 of itself
    if b.logs and not b.max_steps and int(b.get("logging_steps") or 1) == 1:
        b.max_steps = b.logs[-1]["step"]
        b.args.setdefault("schedule_steps", (b.max_steps, f"{files[0].name[:24]}…: the last logged step"))
