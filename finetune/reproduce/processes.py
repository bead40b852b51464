"""How many processes a baseline trained on, settled once when it is read (``sources.read_baseline``, the one writer
of ``Baseline.processes``): what its tool's files say (its source's ``processes``), else the user's
``--processes``, else the one count that makes its logged steps per epoch over the rows of ``--data``."""

from __future__ import annotations

import math
from typing import Optional

from finetune.errors import ConfigError
from finetune.reproduce.record import Baseline
from finetune.reproduce.rows import row_change, row_count


def settled(b: Baseline, said: Optional[tuple], given: Optional[int], data) -> Optional[tuple]:
    """(processes, where that is said) of the baseline ``b`` whose files say ``said`` (None: they do not), with
    ``--processes`` ``given`` and ``--data`` ``data`` (None: not given); ConfigError (one line) where ``given``
    contradicts the files or is not a count, or several counts fit the steps."""
    if given is not None:
        if given < 1:
            raise ConfigError(f"--processes: {given}; give the number of processes the baseline trained on (1 or "
                              "more)")
        if said is not None and said[0] != given:
            raise ConfigError(f"--processes: {given}, but the baseline trained on {said[0]} ({said[1]})")
        return said or (given, "--processes")
    return said or from_steps(b, data)


def from_steps(b: Baseline, data) -> Optional[tuple]:
    """Where no file says the processes: the count that makes the steps the run took per epoch, over the rows of
    ``data`` (a local file; the rows its tool kept of it, :func:`row_change`: a shuffle keeps them all, a split
    fewer), the Trainer's ceil(rows / (per-device × accumulation × processes)) — taken when exactly one count fits and
    it is not 1; several that fit, none of them 1, are refused in one line (``--processes`` says which)."""
    epochs, steps, per_device = b.get("num_train_epochs"), b.get("schedule_steps"), b.get("per_device_train_batch_size")
    if data is None or b.get("dataloader_drop_last") or \
            not (epochs and steps and per_device) or float(epochs) != int(epochs) or int(steps) % int(epochs):
        return None
    rows, change = row_count(data), row_change(b)
    if rows is not None and change is not None:
        rows = len(change[3](rows))
    per_epoch, window = int(steps) // int(epochs), int(per_device) * int(b.get("gradient_accumulation_steps") or 1)
    if rows is None or rows < window:
        return None
    fits = [p for p in range(1, rows // window + 2) if math.ceil(rows / (window * p)) == per_epoch]
    if 1 in fits or not fits:
        return None  # maybe one process, or another training set than this file: compare says what differs
    where = f"{b.args['schedule_steps'][1]}: {per_epoch} steps per epoch over the {rows} rows of {data}"
    if len(fits) > 1:
        raise ConfigError(f"import: {where} fit {', '.join(map(str, fits))} processes; give --processes P")
    return fits[0], where
