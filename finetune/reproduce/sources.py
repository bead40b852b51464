"""Which tool wrote a YAML config: torchtune (its ``_component_`` paths), axolotl (``base_model``,
``micro_batch_size``, ``datasets``) or TRL's command line (``trl sft --config x.yaml``: TrainingArguments / SFTConfig
names beside ``model_name_or_path`` and ``dataset_name``). Each is read by its own module."""

from __future__ import annotations

from pathlib import Path

from finetune.errors import ConfigError
from finetune.reproduce import axolotl, hub, tensorboard, torchtune, trl_config
from finetune.reproduce.record import Baseline, load_yaml


def read_yaml_source(path: Path, what: str) -> Baseline:
    """The baseline a YAML config file describes; ConfigError (one line) when it is not YAML or no known tool's."""
    raw = load_yaml(path, what)
    if torchtune.is_torchtune(raw):
        return torchtune.read_torchtune(path, raw, what)
    if trl_config.is_trl_config(raw):
        return trl_config.read_trl_config(path, raw, what)
    if axolotl.is_axolotl(raw):
        return axolotl.read_axolotl(path, what)
    raise ConfigError(f"{what}: {path} is not a config finetune reads (torchtune: _component_ paths; axolotl: "
                      "base_model, micro_batch_size, datasets; TRL's command line: model_name_or_path and its "
                      "TrainingArguments)")


def read_other_folder(folder: Path, what: str) -> Baseline:
    """A folder without ``trainer_state.json``: a torchtune output folder (read whole), or a Hub-style folder, whose
    per-step log, if any, is the TensorBoard event files the Trainer wrote (axolotl's logs)."""
    if torchtune.is_run(folder):
        return torchtune.read_run(folder, what)
    events = tensorboard.event_files(folder)
    b = hub.hub_folder(folder, what, events_too=bool(events))
    if events:
        tensorboard.read_events(events, b)
    return b
