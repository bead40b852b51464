"""Processes and the Accelerator: what this machine can run, the process group, and gradient sync per window.

finetune asks Accelerate only through its documented API. The Accelerator is made with
``gradient_accumulation_steps=1``: finetune decides itself which micro-batch ends a window and syncs gradients there,
with ``accelerator.no_sync(model)`` on the window's other micro-batches. (Accelerate's own ``accumulate()`` counts
micro-steps against a fixed N and divides every loss by N, which is wrong for a short tail window or a token-budget
split; see ``steps.loss_weight`` for the weight each micro-batch gets instead.)
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from typing import Callable, Optional

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DistributedType

from finetune.config import TrainingConfig
from finetune.errors import ConfigError, WriteError


def has_device() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return torch.cuda.is_available() or bool(mps and mps.is_available()) or \
        bool(getattr(torch, "xpu", None) and torch.xpu.is_available())


def amp_precision() -> str:
    """What ``use_amp`` (``test_fine_tuning``, ``finetune run --use-amp``) means on this machine: fp16 on CUDA (with
    loss scaling), bf16 elsewhere (CPU autocast has no fp16; ``check_environment`` refuses it)."""
    return "fp16" if torch.cuda.is_available() else "bf16"


def is_main_process() -> bool:
    """Whether this process speaks for the run: rank 0 of a launched run, or the only process.

    Read from the launcher's environment: ``accelerate launch`` (torchrun underneath, for every multi-process config
    here), torchrun and ``finetune run --processes`` set ``RANK``, from which the process group takes this process's
    rank, so the answer is Accelerate's ``is_main_process``. Asking creates nothing, so it holds before the process
    group exists too: in a refusal before set-up, or in a task's ``build``."""
    return int(os.environ.get("RANK", "0")) == 0


def check_environment(t: TrainingConfig, tracker: Optional[str] = None) -> None:
    """Refuse, naming the setting, what this machine cannot run (fail at set-up, not mid-run)."""
    if tracker not in (None, "none"):
        import importlib.util

        if importlib.util.find_spec(tracker) is None:
            raise ConfigError(f"output.tracker: {tracker} is not installed (pip install {tracker}); "
                              "or set output.tracker=none")
    if t.mixed_precision == "fp16" and not torch.cuda.is_available():  # Accelerate would silently train in fp32
        raise ConfigError("training.mixed_precision: fp16 needs a CUDA device; use bf16 or no on this machine")
    if t.activation_offloading and not torch.cuda.is_available():
        raise ConfigError("training.activation_offloading: moves activations from GPU to host memory and needs CUDA; "
                          "on this machine there is no device memory to save")
    for engine in ("FSDP", "DEEPSPEED"):  # Accelerate's plugins for these refuse to start without a GPU
        if os.environ.get(f"ACCELERATE_USE_{engine}", "false").lower() == "true" and not has_device():
            raise ConfigError(f"accelerate config: {engine.lower()} needs GPUs; on CPU use "
                              "accelerate_configs/multi_cpu_2.yaml (DDP over gloo)")


def distributed_state() -> PartialState:
    """The process group Accelerate sets up from the launcher's environment. Without an accelerator we ask for the
    CPU explicitly: several processes then train with gloo DDP (``accelerate launch --multi_gpu`` or torchrun),
    which ``accelerate launch --cpu --num_processes 2`` does not give (it starts one process)."""
    state = PartialState(cpu=not has_device())
    if state.num_processes > 1 and not _shutdown_registered:
        atexit.register(shutdown)
        _shutdown_registered.append(True)
    return state


_shutdown_registered: list = []


def agree(check: Callable, main_only: bool = False):
    """Run ``check()`` on every process and agree on its verdict: when it raises ConfigError (or WriteError) on any
    process, every process raises that error (the lowest refusing rank's), marked ``agreed``. Without this a refusal
    on one process leaves the others waiting in their next collective, and they die with gloo's "Connection closed
    by peer".

    Returns ``check()``'s result on this process; with ``main_only``, ``check`` runs on the main process only and
    every process gets its result (e.g. an output directory named by the main process's clock).

    A collective: every process calls it at the same point. With one process it is ``check()``.
    """
    from accelerate.utils import gather_object

    state = distributed_state()
    if state.num_processes == 1:
        return check()
    value, refusal = None, None
    if is_main_process() or not main_only:
        try:
            value = check()
        except (ConfigError, WriteError) as error:
            refusal = (type(error), error.problems)
    verdicts = gather_object([(value if main_only else None, refusal)])
    refusal = next((r for _, r in verdicts if r), None)
    if refusal:
        kind, problems = refusal
        error = kind(problems)
        error.agreed = True  # every process raises it here: the command line waits for all before exiting
        raise error
    return verdicts[0][0] if main_only else value


def wait_for_everyone() -> None:
    """A barrier over the run's processes (none with one process)."""
    state = distributed_state()
    if state.num_processes > 1:
        state.wait_for_everyone()


GLOO_GRACE_SECONDS = 0.25


def shutdown() -> None:
    """Destroy the process group (local, no collective), then give gloo's worker threads the GIL and the CPU for a
    moment. Runs at exit of every multi-process run, while the interpreter is still whole.

    A gloo worker drops a finished collective's tensors only after the caller's ``wait()`` has returned, and
    dropping a tensor made in Python (an ``accelerator.reduce`` or ``gather_object`` buffer) takes the GIL. If the
    interpreter is finalizing by then, the process aborts ("terminate called without an active exception",
    SIGABRT) after the run succeeded, and the launcher reports a failure. Neither destroying the group (its
    threads live on while anything references it) nor a barrier (it waits for the work to finish, not to be
    dropped) prevents that; the drop needs microseconds of CPU, which a loaded machine may give it late."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        time.sleep(GLOO_GRACE_SECONDS)


def make_accelerator(t: TrainingConfig, log_with=None, project_dir=None) -> Accelerator:
    """An Accelerator for this run: ``t.mixed_precision``, N = 1 (finetune places the window's sync itself). What
    this machine cannot run is refused before, once, by ``check_environment`` (at set-up)."""
    kwargs = dict(mixed_precision=t.mixed_precision, log_with=log_with, project_dir=project_dir, cpu=not has_device())
    try:
        accelerator = Accelerator(**kwargs)
    except ValueError as error:
        if "already been initialized" not in str(error):
            raise
        accelerator = None
    if accelerator is None or not accelerator.sync_gradients:
        restart_accelerate_state()
        accelerator = Accelerator(**kwargs)
    return accelerator


def restart_accelerate_state() -> None:
    """Accelerate keeps process-wide singletons and refuses a second Accelerator with another precision ("restart
    your runtime"); a loop that used ``accumulate()`` may also leave gradient sync off. A Python-API user, a search
    or a test suite trains several times in one process, so this one place starts them afresh through Accelerate's
    own reset — called only when Accelerate refuses, pinned by the accelerate bounds in pyproject, and covered by
    ``tests/test_loop.py::test_two_precisions_in_one_process``. The process group is kept."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def sync_gradients(accelerator: Accelerator, model, sync: bool):
    """Context for one micro-batch's backward: gradients are all-reduced only on the window's last micro-batch
    (``sync``); on the others ``accelerator.no_sync(model)`` keeps them local (a no-op with one process)."""
    return contextlib.nullcontext() if sync else accelerator.no_sync(model)


def configure_deepspeed(accelerator: Accelerator, micro_batch: int) -> None:
    """Before ``accelerator.prepare`` under DeepSpeed. DeepSpeed sizes its engine from the micro-batch, which
    Accelerate reads off a prepared DataLoader; finetune prepares none (its windows are its own), so it says it
    here. DeepSpeed must not accumulate as well: finetune tells it where each window ends (``backward``), and a
    DeepSpeed N > 1 would divide every loss by N once more."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    plugin = accelerator.deepspeed_plugin
    if plugin.is_auto("train_micro_batch_size_per_gpu"):
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch
    steps = plugin.get_value("gradient_accumulation_steps")
    if steps not in (None, "auto", 1):
        raise ConfigError(f"deepspeed config: gradient_accumulation_steps is {steps}; set it to 1 or auto "
                          "(finetune accumulates each window itself: training.gradient_accumulation_steps or "
                          "training.effective_batch_size)")


def backward(accelerator: Accelerator, loss: torch.Tensor, sync: bool) -> None:
    """``accelerator.backward`` (loss scaling for fp16). DeepSpeed's engine keeps its own accumulation boundary and
    steps inside backward, so it is told explicitly whether this micro-batch ends the window (with N = 1 in its
    config it does not rescale the loss). Not exercised without GPUs."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.deepspeed_engine_wrapped.backward(loss, sync_gradients=sync)
    else:
        accelerator.backward(loss)
