"""The baseline's kernels replayed: its per-device micro-batch, its padding and, on a CPU, its threads — and the proof
at the first logged step.

A bf16 (or fp16) forward depends on each product's shape and, on a CPU, on the threads its kernels split the work
over (oneDNN partitions a reduction by both), not on the processes around it. So a reproduction on one process that
runs the baseline's per-device micro-batches, padded as its collator padded them (``training.replay_padding``), with
the threads each baseline process had, runs the baseline's kernels on the baseline's shapes: its loss at step 1,
computed before any update, is the baseline's to the last bit — where the tokens, the model and torch's kernels are
the same. A changed word then stands out against zero, not against a band.

Each process of a CPU baseline had the threads ``accelerate launch`` gives a CPU process when ``OMP_NUM_THREADS`` is
unset (accelerate 1.15, ``commands/launch.py``): the physical cores over the local processes, at least 1 — torchrun
sets 1 for several processes, which is the same on a machine with no more cores than processes. The baseline's files
do not say its machine's cores, so this machine's are taken, and the verdict says the threads it ran with.
"""

from __future__ import annotations

import struct
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import psutil
import torch

from finetune.reproduce.carry import trained_device
from finetune.reproduce.record import Baseline
from finetune.reproduce.runs import Run
from finetune.reproduce.update_settings import setting


def baseline_threads(b: Baseline) -> tuple[int, str]:
    """(threads each of the baseline's CPU processes had, why): accelerate's default for a CPU process — this
    machine's physical cores over the baseline's processes, at least 1."""
    cores = psutil.cpu_count(logical=False) or torch.get_num_threads()
    processes = b.process_count()
    return max(1, cores // processes), (f"accelerate launch's default for {processes} CPU process"
                                        f"{'es' if processes > 1 else ''}: {cores} physical cores // {processes}")


@contextmanager
def threads(n: Optional[int]):
    """Run the block with ``n`` intra-op threads (None: as they are), then restore them."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class Kernels:
    """What a run's step 1 ran as against the baseline's: ``differs`` names each difference (empty: the baseline's
    kernels replayed); ``ran``: the run's shapes and threads, for the verdict; ``impossible``: why the replay is not
    possible on this machine, where the run was free to pick its micro-batch and the baseline's did not fit."""

    differs: tuple
    ran: str
    impossible: Optional[str] = None

    @property
    def replayed(self) -> bool:
        return not self.differs


def per_device(b: Baseline) -> Optional[int]:
    size = b.get("per_device_train_batch_size")
    return int(size) if isinstance(size, (int, float)) and not isinstance(size, bool) and size else None


def micro_batch_ran(mine: Run) -> Optional[float]:
    """The samples per micro-batch of the run's first window (its recorded ``micro_batches``): with
    ``training.replay_padding`` the micro-batches are cut from the baseline's, whatever ``batch_size: auto`` set."""
    first = mine.history[0] if mine.history else {}
    n, samples = first.get("micro_batches"), first.get("samples")
    processes = (mine.metrics or {}).get("processes") or 1
    return samples / (n * processes) if n and samples else None


def kernels(b: Baseline, mine: Run) -> Kernels:
    """How the run's step 1 ran against the baseline's: its micro-batch, its padding, its device, its threads (a
    CPU) and torch's version (where the baseline's card says it)."""
    size, ran = per_device(b), micro_batch_ran(mine)
    arithmetic = (mine.metrics or {}).get("arithmetic") or {}
    differs = []
    if size is None or ran is None:
        differs.append("the micro-batch (not recorded on both sides)")
    elif ran != size:
        differs.append(f"the micro-batch: {ran:g} here, the baseline's {size}")
    if not setting(mine.recipe, "training.replay_padding"):
        differs.append("the padding (training.replay_padding off: each sample at another padded length)")
    device, here = trained_device(b), arithmetic.get("device")
    if device and here and device[0] != here:
        differs.append(f"the device: {here} here, {device[0]} in the baseline ({device[1]})")
    threads_there = baseline_threads(b)
    cpu = here == "cpu" and (device is None or device[0] == "cpu")
    if cpu and arithmetic.get("threads") != threads_there[0]:
        differs.append(f"the threads: {arithmetic.get('threads', 'unrecorded')} here, {threads_there[0]} per "
                       f"baseline process ({threads_there[1]})")
    if mine.dropout_layers:
        differs.append("the dropout masks (keyed by sample here, the baseline's drawn by its own generator)")
    version, ours = b.get("pytorch_version") or b.get("torch_version"), arithmetic.get("torch")
    if version and ours and str(ours).split("+")[0] != str(version).split("+")[0]:
        differs.append(f"torch's kernels: {ours} here, {version} in the baseline")
    said = f"micro-batch {ran:g}" if ran else "micro-batch unknown"
    said += ", padded as the baseline's" if setting(mine.recipe, "training.replay_padding") else ""
    said += f", {arithmetic['threads']} thread{'s' if arithmetic['threads'] > 1 else ''}" if cpu and \
        arithmetic.get("threads") else ""
    impossible = None
    if size and ran and ran < size and setting(mine.recipe, "training.batch_size") == "auto":
        impossible = (f"the replay is not possible here: the baseline's micro-batch of {size} does not fit this "
                      f"machine (batch_size auto ran {ran:g})")
    return Kernels(tuple(differs), said, impossible)


def logged_digits(value: float) -> int:
    """The decimals a logged value shows (its shortest repr, as JSON and the Trainer write it)."""
    text = repr(float(value))
    if "e" in text:
        mantissa, exponent = text.split("e")
        return max(0, len(mantissa.split(".")[1]) if "." in mantissa else 0) - int(exponent)
    return len(text.split(".")[1]) if "." in text else 0


def same_to_logged_digits(theirs: float, ours: float) -> bool:
    """``ours`` is ``theirs`` to the digits it was logged with: a float32 logged in full (the Trainer's JSON) bit for
    bit, a value logged rounded (a card's 4 decimals) at its decimals."""
    if struct.unpack("f", struct.pack("f", theirs))[0] == theirs:  # a float32 as it is: every bit was logged
        return float(ours) == float(theirs)
    return round(float(ours), logged_digits(theirs)) == float(theirs)


def step_one(c, b: Baseline, mine: Run) -> Optional[Kernels]:
    """The replay's proof, a layer of ``c`` (a ``verdict.Comparison``): where the run ran the baseline's kernels
    (:func:`kernels`), its loss at step 1 — before any update — must be the baseline's to its logged digits (a
    float32 logged in full: bit for bit; measured so, the Trainer's fp32 mean over its processes landing on this
    run's fp32 sum of the same per-device losses: docs/exact-steps.md#bf16-the-baselines-kernels-replayed), else the
    tokens or the model differ; where it did not, what differs is said and step 1 is held to the loss band like
    every step. Returns how the run's step 1 ran (None: step 1 not logged)."""
    theirs = next((e for e in b.logs if e.get("step") == 1 and isinstance(e.get("loss"), float)), None)
    ours = next((h for h in mine.history if h.get("step") == 1), None)
    if theirs is None or ours is None or not isinstance(ours.get("loss"), float):
        c.add("step 1", None, "not checkable: a side logs no loss of step 1 alone")
        return None
    k = kernels(b, mine)
    if not k.replayed:
        c.add("step 1", None, f"the baseline's kernels not replayed — {k.impossible or '; '.join(k.differs)}: step 1 "
                              f"({ours['loss']:.7g} vs the baseline's {theirs['loss']:.7g}) held to the loss band")
        return k
    same = same_to_logged_digits(theirs["loss"], ours["loss"])
    if same:
        c.power["step-1 loss"] = 0.0
    apart = abs(ours["loss"] - theirs["loss"]) / max(abs(theirs["loss"]), 1e-12)
    c.add("step 1", same, f"forward replayed bit for bit at step 1: loss {ours['loss']!r}, the baseline's ({k.ran})"
          if same else f"the baseline's kernels replayed ({k.ran}), yet step 1's loss before any update is "
          f"{ours['loss']!r} vs the baseline's {theirs['loss']!r} ({apart:.1e} apart, where a replay is exact): the "
          "tokens or the model differ", step=1, basis="forward replayed bit for bit at step 1")
    return k
