"""What every reader of another tool's runs shares beyond the contract it keeps (``record.Source``, beside the
``Baseline`` it fills): :class:`Reader` gives the answers of a tool that does as the HF Trainer does, which a source
overrides where its tool does otherwise; the task a run trained is its objective (:mod:`objective`). Each tool
finetune reads has one module in this package holding one ``SOURCE``, and ``sources.SOURCES`` lists them in the order
they are tried; nothing else names a tool."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from finetune.errors import ConfigError
from finetune.loading import parse_yaml
from finetune.reproduce.objective import task_of
from finetune.reproduce.record import Baseline, Where, file_of


class Reader:
    """The answers of a tool that does as the HF Trainer does; a source overrides those where its tool differs."""

    general = False

    def carry_own(self, b: Baseline, out, model_fields: dict, data_fields: set, baseline_step: bool) -> None:
        return None

    def warmup(self, b: Baseline, ratio: float, total: Optional[int]) -> Optional[tuple]:
        return None

    def task(self, b: Baseline) -> Optional[str]:
        return task_of(b)

    def processes(self, b: Baseline) -> Optional[tuple]:
        """Where the Trainer's files say it: accelerate's state pickled in ``training_args.bin``
        (``distributed_state.num_processes``), the card's ``num_devices``, or its ``total_train_batch_size`` over the
        per-device batch × accumulation. ConfigError (one line) when two of them disagree."""
        return agreed(trainer_processes(b), b.path)

    def adapters_start(self, b: Baseline) -> tuple:
        if b.trl:
            return True, ("TRL draws them right after set_seed(seed) and finetune seeds the same way before building "
                          "the model (checked with TRL 1.16, peft 0.21)")
        return False, ("a Trainer baseline drew them in its own script: the same only if it called set_seed(seed) "
                       "right before get_peft_model; else give --initial-adapter DIR (its adapters saved before the "
                       "first step)")

    def training_rows(self, b: Baseline, data, recipe: Path):
        return data


def yaml_mapping(path: Path) -> Optional[dict]:
    """A YAML file's mapping, to recognise a tool's config by its keys; None for anything else (not YAML, not a
    mapping, unreadable): the source that reads it says why."""
    if not (path.is_file() and path.suffix.lower() in (".yaml", ".yml")):
        return None
    try:
        raw = parse_yaml(path.read_text(encoding="utf-8", errors="replace"), str(path))
    except (ConfigError, OSError):
        return None
    return raw if isinstance(raw, dict) else None


def trainer_processes(b: Baseline) -> list:
    """(processes, where) for each place of the Trainer's files that says how many processes trained the run."""
    found = []
    state = b.get("distributed_state")
    if isinstance(state, dict) and state.get("num_processes"):
        found.append((int(state["num_processes"]), Where(file_of(b.args["distributed_state"][1]),
                                                         "distributed_state.num_processes")))
    if b.get("num_devices"):
        found.append((int(b.get("num_devices")), b.args["num_devices"][1]))
    total, per = b.get("total_train_batch_size"), b.get("per_device_train_batch_size")
    if total and per:
        share, left = divmod(int(total), int(per) * int(b.get("gradient_accumulation_steps") or 1))
        if share and not left:
            found.append((share, f"{b.args['total_train_batch_size'][1]}: total_train_batch_size ÷ per-device batch "
                                 "× accumulation"))
    return found


def agreed(found: list, path) -> Optional[tuple]:
    """The one number of processes the places in ``found`` say; ConfigError naming two that differ."""
    other = next((f for f in found if f[0] != found[0][0]), None) if found else None
    if other is not None:
        raise ConfigError(f"baseline: {path}: the number of processes is {found[0][0]} ({found[0][1]}) but "
                          f"{other[0]} ({other[1]}); give a folder whose files agree")
    return found[0] if found else None
