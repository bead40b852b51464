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
import functools
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DeepSpeedPlugin, DistributedType, GradScalerKwargs, InitProcessGroupKwargs, gather_object

from finetune.errors import ConfigError, WriteError


def has_device() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return torch.cuda.is_available() or bool(mps and mps.is_available()) or \
        bool(getattr(torch, "xpu", None) and torch.xpu.is_available())


if not has_device():  # said, DeepSpeed (whoever imports it) does not warn on every process that it guessed the CPU
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def amp_precision() -> str:
    """What ``use_amp`` (``test_fine_tuning``, ``finetune run --use-amp``) means on this machine: fp16 on CUDA (with
    loss scaling), bf16 elsewhere (a CPU runs fp16 too, but slowly: bf16 is its fast half precision)."""
    return "fp16" if torch.cuda.is_available() else "bf16"


def engine() -> Optional[str]:
    """The sharding engine the launcher asked Accelerate for (``accelerate launch --config_file`` with
    ``distributed_type: DEEPSPEED`` or ``FSDP``): "deepspeed", "fsdp", or None (DDP, or one process)."""
    for name in ("deepspeed", "fsdp"):
        if os.environ.get(f"ACCELERATE_USE_{name.upper()}", "false").lower() == "true":
            return name
    return None


def launch_engine() -> str:
    """What writes a run's checkpoints, by this launch: "ddp" (DDP or one process: Accelerate's files), "fsdp",
    or "deepspeed-zero<stage>" (DeepSpeed's own files, partitioned per process)."""
    name = engine()
    if name == "deepspeed":
        return f"deepspeed-zero{launch_deepspeed_config()['zero_optimization']['stage']}"
    return name or "ddp"


def use_cpu_flag() -> bool:
    """The launch config's ``use_cpu`` (Accelerate then makes every process a CPU process, whatever else it asks)."""
    return os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("true", "1", "yes")


def deepspeed_on_cpu() -> bool:
    """DeepSpeed on a machine without an accelerator: DeepSpeed runs on the CPU, its processes joined over gloo.
    Accelerate starts its DeepSpeed plugin only for a non-CPU Accelerator, so finetune asks for one (``cpu=False``)
    and names the backend, which Accelerate would otherwise leave unset without a GPU."""
    return engine() == "deepspeed" and not has_device()


def group_of_one() -> None:
    """A DeepSpeed process started without a launcher (``finetune run`` or ``python finetune/run.py`` under
    ``training.offload``, which asks for DeepSpeed itself: ``offload.engage``): DeepSpeed joins a process group even
    for one process, from the launcher's variables; give it a group of one on this machine. A launched process
    (torchrun, ``accelerate launch``, ``--processes``) has its own."""
    if engine() != "deepspeed" or "LOCAL_RANK" in os.environ:
        return
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state_kwargs() -> dict:
    """What Accelerate's process-group set-up is given: the CPU (gloo) without an accelerator; gloo explicitly for
    DeepSpeed on the CPU."""
    if deepspeed_on_cpu():
        return {"cpu": False, "backend": "gloo"}
    return {"cpu": not has_device()}


def is_main_process() -> bool:
    """Whether this process speaks for the run: rank 0 of a launched run, or the only process.

    Read from the launcher's environment: ``accelerate launch`` (torchrun underneath, for every multi-process config
    here), torchrun and ``finetune run --processes`` set ``RANK``, from which the process group takes this process's
    rank, so the answer is Accelerate's ``is_main_process``. Asking creates nothing, so it holds before the process
    group exists too: in a refusal before set-up, or in a task's ``build``."""
    return int(os.environ.get("RANK", "0")) == 0


def process_group() -> PartialState:
    """The process group Accelerate sets up from the launcher's environment. Without an accelerator we ask for the
    CPU explicitly: several processes then train with gloo DDP (``accelerate launch --multi_gpu`` or torchrun),
    which ``accelerate launch --cpu --num_processes 2`` does not give (it starts one process)."""
    group = PartialState(**_state_kwargs())
    if group.num_processes > 1 and not _shutdown_registered:
        atexit.register(shutdown)
        _shutdown_registered.append(True)
    return group


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
    group = process_group()
    if group.num_processes == 1:
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
    group = process_group()
    if group.num_processes > 1:
        group.wait_for_everyone()


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


@dataclass(frozen=True)
class LossScale:
    """fp16's dynamic loss scale (``training.initial_loss_scale``, ``training.loss_scale_growth_interval``); the
    rest as torch's GradScaler (and so the Trainer) has it: halved on an overflow, doubled after ``growth_interval``
    steps without one."""

    initial: float = 2.0 ** 16
    growth_interval: int = 2000

    def kwargs(self) -> dict:
        return {"init_scale": self.initial, "growth_interval": self.growth_interval}


def make_accelerator(mixed_precision: str = "no", log_with=None, project_dir=None,
                     loss_scale: LossScale = LossScale()) -> Accelerator:
    """An Accelerator for this run: ``mixed_precision`` (training.mixed_precision; fp16 with ``loss_scale``), N = 1
    (finetune places the window's sync itself). What this machine cannot run is refused before, once, by
    ``check_environment`` (at set-up)."""
    state = _state_kwargs()
    handlers = [InitProcessGroupKwargs(backend=state["backend"])] if "backend" in state else []
    if mixed_precision == "fp16":
        handlers.append(GradScalerKwargs(**loss_scale.kwargs()))
    kwargs = dict(mixed_precision=accelerate_precision(mixed_precision), log_with=log_with, project_dir=project_dir,
                  cpu=state["cpu"], kwargs_handlers=handlers or None)
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


def accelerate_precision(mixed_precision: str) -> str:
    """The precision Accelerate is asked for. Under DeepSpeed, bf16 is finetune's own autocast over the fp32 engine
    (``own_autocast``): Accelerate would turn on DeepSpeed's bf16, which trains bf16 weights, a step other than the
    recipe's (autocast over fp32 weights, as without the engine)."""
    return "no" if mixed_precision == "bf16" and engine() == "deepspeed" else mixed_precision


def own_autocast(accelerator: Accelerator, mixed_precision: str) -> bool:
    """Whether finetune autocasts the forward to bf16 itself: where Accelerate was asked for none
    (``accelerate_precision``)."""
    return mixed_precision == "bf16" and accelerator.mixed_precision == "no"


def loss_scaler(accelerator: Accelerator, mixed_precision: str, loss_scale: LossScale = LossScale()):
    """fp16's dynamic loss scale for the run: Accelerate's GradScaler where it runs one (CUDA: it scales every
    backward and unscales in ``clip_grad_norm_``), else finetune's own on a CPU (one process or DDP), where Accelerate
    trains fp16 silently as fp32 though torch runs fp16 autocast and a GradScaler there: a card without bf16 (T4,
    V100) trains fp16, and its steps can only be certified here if they run here. finetune's own is saved with the
    checkpoint (``checkpoint.scaler_held``) and used with ``models.precision.autocast_forward``. None without fp16,
    or where an engine scales (DeepSpeed)."""
    if mixed_precision != "fp16":
        return None
    if accelerator.scaler is not None:
        return accelerator.scaler
    if accelerator.device.type != "cpu" or accelerator.distributed_type not in (DistributedType.NO,
                                                                              DistributedType.MULTI_CPU):
        return None
    return torch.amp.GradScaler("cpu", **loss_scale.kwargs())


def fp16_kernels(accelerator: Accelerator, scaler):
    """The kernels finetune's own fp16 on a CPU (:func:`loss_scaler`) computes with: torch's own, oneDNN's off.
    Where the CPU does fp16 arithmetic (``avx512_fp16``, AMX-fp16: torch's ``mkldnn_fp16_device_check``), torch sends
    fp16 matmuls and convolutions to oneDNN, which picks its kernel, and so a sample's rounding, by the micro-batch's
    shape: an ODE layout at micro-batch 4 stood 8.9e-4 from 8 and 2 there. torch's own fp16 kernels (what every other
    CPU runs) widen to fp32 per output element, the same at any micro-batch. A no-op elsewhere; undone when the run
    ends (bf16, which replays a baseline's oneDNN kernels, keeps them)."""
    if not own_scaler(accelerator, scaler) or accelerator.device.type != "cpu":
        return contextlib.nullcontext()
    return torchs_own_kernels()


@contextlib.contextmanager
def lomo_asked_once():
    """For the run, Accelerate's optimizer wrapper asks once whether ``lomo_optim`` is installed. Its ``step`` asks
    twice every optimizer step (``is_lomo_available``: importlib's ``find_spec`` over every ``sys.path`` entry),
    about a quarter of the loop's fixed cost per step on a 2-core CPU; the answer cannot change within a run.
    Accelerate's own function is put back when the run ends, so a hand-written Accelerate loop in the same process
    (the overhead benchmark's) pays what it paid before."""
    import accelerate.optimizer as wrapper

    asked = getattr(wrapper, "is_lomo_available", None)
    if asked is None:  # another Accelerate: nothing to spare
        yield
        return
    wrapper.is_lomo_available = functools.cache(asked)
    try:
        yield
    finally:
        wrapper.is_lomo_available = asked


def torchs_own_kernels():
    """oneDNN off until the context ends (its other settings as they were: None keeps each)."""
    return torch.backends.mkldnn.flags(False, None, None, None)


def own_scaler(accelerator: Accelerator, scaler) -> bool:
    """Whether ``scaler`` is finetune's (:func:`loss_scaler`): then finetune scales the loss and unscales the
    gradients itself, which Accelerate does with its own."""
    return scaler is not None and scaler is not accelerator.scaler


def restart_accelerate_state() -> None:
    """Accelerate keeps process-wide singletons and refuses a second Accelerator with another precision ("restart
    your runtime"); a loop that used ``accumulate()`` may also leave gradient sync off. A Python-API user, a search
    or a test suite trains several times in one process, so this one place starts them afresh through Accelerate's
    own reset — called only when Accelerate refuses, pinned by the accelerate bounds in pyproject, and covered by
    ``tests/test_loop.py::test_two_precisions_in_one_process``. The process group is kept."""
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def is_fsdp2(model) -> bool:
    """Whether ``model`` is sharded with torch's ``fully_shard`` (FSDP2): by Accelerate's FSDP2 plugin, or by the
    task itself (``Job.model`` already sharded on a device mesh, which is how FSDP2 runs on the CPU)."""
    from torch.distributed.fsdp import FSDPModule  # lazy: 0.8 s on every command (torch does not load it)

    return isinstance(model, FSDPModule)


def describe_engine(accelerator: Accelerator, model) -> str:
    """What shards the run, for the banner: "DeepSpeed ZeRO-2 (clipping 1.0)", "FSDP2", or "" (DDP, one process)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        config = accelerator.deepspeed_plugin.deepspeed_config
        clip, zero = config.get("gradient_clipping") or 0, config["zero_optimization"]
        held = [f"{name} offloaded to {offloaded_to(zero, what)}" for what, name in
                (("optimizer", "optimizer"), ("param", "weights")) if offloaded_to(zero, what) != "none"]
        held.append(f'clipping at {clip:g}' if clip else 'no clipping')
        return f"DeepSpeed ZeRO-{zero['stage']} ({', '.join(held)})"
    if is_fsdp2(model):
        return "FSDP2 (fully_shard)"
    return "FSDP1" if accelerator.distributed_type == DistributedType.FSDP else ""


def sync_gradients(accelerator: Accelerator, model, sync: bool):
    """Context for one micro-batch's backward: gradients are reduced only on the window's last micro-batch
    (``sync``); on the others they stay local: ``no_sync`` for DDP, FSDP2's ``set_requires_gradient_sync(False)``
    (which skips the reduce-scatters; Accelerate's ``no_sync`` does it only for a model its plugin sharded), a no-op
    with one process. DeepSpeed is told the window's end in ``backward``."""
    if sync:
        return contextlib.nullcontext()
    if is_fsdp2(model):
        return _fsdp2_no_sync(model)
    return accelerator.no_sync(model)


@contextlib.contextmanager
def _fsdp2_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def configure_deepspeed(accelerator: Accelerator, micro_batch: int, optims: list) -> None:
    """Before ``accelerator.prepare`` under DeepSpeed, say in its config what finetune's recipe decides:

    * the micro-batch: DeepSpeed sizes its engine from it, which Accelerate reads off a prepared DataLoader; finetune
      prepares none (its windows are its own);
    * no accumulation of DeepSpeed's own (refused at start-up otherwise: ``startup.check_deepspeed``);
    * the clipping: ``training.max_grad_norm`` (None or 0: none, which DeepSpeed spells 0). Accelerate drops a
      falsy ``gradient_clipping`` from its config and then fills in 1.0, so a run that asked for no clipping would
      be clipped.
    """
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    plugin = accelerator.deepspeed_plugin
    if plugin.is_auto("train_micro_batch_size_per_gpu"):
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch
    plugin.deepspeed_config["gradient_clipping"] = deepspeed_clipping(optims[0].max_grad_norm)
    # an offloaded optimizer is the recipe's own, stepping the host's fp32 partitions (``finetune.offload``); forced
    # (DeepSpeed's default), Accelerate would replace it with DeepSpeed's CPU Adam made from the lr and decay alone,
    # with DeepSpeed's default betas
    if offloaded_to(plugin.deepspeed_config["zero_optimization"], "optimizer") != "none":
        plugin.deepspeed_config["zero_force_ds_cpu_optimizer"] = False


def offloaded_to(zero: dict, what: str) -> str:
    """Where a DeepSpeed ``zero_optimization`` section offloads ``what`` ("optimizer" or "param"): "cpu", "nvme", or
    "none" (no such section, or its device left out)."""
    return (zero.get(f"offload_{what}") or {}).get("device") or "none"


def launch_deepspeed_config() -> dict:
    """The DeepSpeed config this launch gives Accelerate (its config file, or the accelerate config's fields)."""
    return DeepSpeedPlugin().deepspeed_config


def deepspeed_clipping(max_grad_norm: Optional[float]) -> float:
    """DeepSpeed's ``gradient_clipping`` for the recipe's ``max_grad_norm``: DeepSpeed clips when it is above 0."""
    return float(max_grad_norm or 0.0)


def release_sharding(accelerator: Accelerator, model) -> None:
    """After the last step, on every process: a ZeRO-3 model is made whole on each process and left a plain module
    (DeepSpeed's hooks removed), so that what follows the run — saving it, a generated sample, an evaluation on the
    main process alone — needs no collective. The engine is not used again."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED or \
            accelerator.deepspeed_plugin.deepspeed_config["zero_optimization"]["stage"] != 3:
        return
    import deepspeed  # optional (finetune[deepspeed]), and only a ZeRO-3 run gets here

    params = [p for p in accelerator.unwrap_model(model).parameters() if hasattr(p, "ds_tensor")]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        whole = [p.data.clone() for p in params]
    accelerator.deepspeed_engine_wrapped.engine.destroy()
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for p, data in zip(params, whole):
        p.data = data
        p.ds_status = ZeroParamStatus.AVAILABLE  # whole from here: reading it gathers nothing


@contextlib.contextmanager
def whole_model(model):
    """Inside it, every process's FSDP2 ``model`` holds all its weights, unsharded, and keeps them so through
    forwards: to save it, generate with it or read it on one process (a forward on one process must not ask the
    others for shards). A collective: every process enters and leaves it together. Other models (ZeRO-3 after
    ``release_sharding``, ZeRO-1/2, DDP, one process) hold whole weights already."""
    sharded = [m for m in model.modules() if is_fsdp2(m)]
    for m in sharded:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in sharded:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def backward(accelerator: Accelerator, loss: torch.Tensor, sync: bool, scaler=None) -> None:
    """``accelerator.backward`` (loss scaling for fp16: Accelerate's, or finetune's own ``scaler`` on a CPU).
    DeepSpeed's engine keeps its own accumulation boundary and steps inside backward, so it is told explicitly
    whether this micro-batch ends the window (with N = 1 in its config it does not rescale the loss)."""
    if own_scaler(accelerator, scaler):
        loss = scaler.scale(loss)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.deepspeed_engine_wrapped.backward(loss, sync_gradients=sync)
    else:
        accelerator.backward(loss)
