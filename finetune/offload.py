"""``training.offload``: the optimizer's state (and the weights) in host memory, through DeepSpeed ZeRO's offload
as Accelerate runs it, with no DeepSpeed or accelerate config to write.

A level is a ZeRO stage and its offload devices, asked of Accelerate the way ``accelerate launch`` asks it (its
``ACCELERATE_DEEPSPEED_*`` environment, set before the process group exists), so that everything finetune does under
a DeepSpeed launch — the window's end told to the engine, the recipe's clipping, DeepSpeed's checkpoints, a ZeRO-3
model made whole after the run — holds for it unchanged:

* ``optimizer``: ZeRO-2, ``offload_optimizer`` on the host: the fp32 master weights, the optimizer's state and the
  accumulated gradients live there, and the host steps them with the recipe's own optimizer (torch's fused AdamW
  on the CPU: the update the run takes without offload). Not DeepSpeed's CPU Adam: it keeps beta^t as a running
  product that a resumed run recomputes as a power, so a run resumed under it ends a rounding apart from the
  uninterrupted one (measured: the grad norm two steps after the resume, in its 7th digit);
* ``parameters``: ZeRO-3 with ``offload_param`` too: the weights live there and are streamed to the card layer by
  layer.

With ``offload_device: nvme`` DeepSpeed swaps them to files in ``offload_path`` (ZeRO-3 for both levels: DeepSpeed
offloads to nvme only there). The same levels ship as accelerate configs (``accelerate_configs/
deepspeed_zero2_offload.yaml``, ``deepspeed_zero3_offload.yaml``) for users who launch themselves; a launch whose
DeepSpeed config offloads is read back here (``launch_level``), whatever the recipe says.
"""

from __future__ import annotations

import os
from typing import Optional

from finetune import distributed
from finetune.config import OFFLOAD_STAGES, Offload
from finetune.errors import ConfigError

# what exactness needs of the engine: DeepSpeed 0.15.2 to 0.18.9 dropped all but the last micro-batch's gradients
# under optimizer offload with accumulation (its PRs #7967, #7981); Accelerate 1.8 first takes ``sync_gradients``
# in ``DeepSpeedEngineWrapper.backward``, which ``distributed.backward`` passes
DEEPSPEED_AT_LEAST, ACCELERATE_AT_LEAST = "0.19.0", "1.8.0"
SHIPPED = {"optimizer": "accelerate_configs/deepspeed_zero2_offload.yaml",
           "parameters": "accelerate_configs/deepspeed_zero3_offload.yaml"}


def engage(o: Offload) -> None:
    """Start-up's first act, on every process and before the process group: turn the recipe's level into the
    DeepSpeed launch Accelerate reads. One line each for what cannot run: DeepSpeed missing or too old, an nvme
    folder missing or not writable, a CPU-only launch on a machine with a card. A launch with its own engine config
    is checked against the level with that config (``engine_config.check_offload``)."""
    if not o.on:
        return
    check_versions()
    if o.offload_device == "nvme":
        check_nvme(o.offload_path)
    if distributed.engine() is not None:  # the launch's own engine: checked with its config (engine_config)
        return
    if distributed.use_cpu_flag():
        if distributed.has_device():
            raise ConfigError("training.offload: offloads from the card to the host, and this launch says use_cpu: "
                              "true (Accelerate would then turn DeepSpeed off); launch without it")
        os.environ.pop("ACCELERATE_USE_CPU")  # no card here: DeepSpeed runs on the CPU over gloo either way
    os.environ.update(environment(o))


def environment(o: Offload) -> dict:
    """The ``ACCELERATE_*`` variables of a DeepSpeed launch at level ``o`` (what ``accelerate launch`` exports for
    a config's ``deepspeed_config``)."""
    stage, weights = OFFLOAD_STAGES[o.offload], o.offload == "parameters"
    nvme = o.offload_device == "nvme"
    env = {"ACCELERATE_USE_DEEPSPEED": "true",
           "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(3 if nvme else stage),
           "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": o.offload_device,
           "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": o.offload_device if weights else "none",
           "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false"}
    if nvme:
        path = os.path.abspath(o.offload_path)
        env["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"] = path
        if weights:
            env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"] = path
    return env


def launch_level(config: dict) -> str:
    """The level a DeepSpeed config runs at: "parameters" (the weights offloaded), "optimizer", or "none"."""
    zero = config.get("zero_optimization", {})
    if distributed.offloaded_to(zero, "param") != "none":
        return "parameters"
    return "optimizer" if distributed.offloaded_to(zero, "optimizer") != "none" else "none"


def check_host(model, config: dict, optimizer: str, processes: int) -> None:
    """Stage 3, the model built and nothing written: refuse a level whose host share does not fit this machine's
    available memory (``memory.host.host_bytes`` per process, times the processes on this machine). ``config``: the
    launch's DeepSpeed config, whose offload is the run's (``launch_level``)."""
    import psutil

    from finetune.memory.host import host_bytes
    from finetune.memory.records import size

    level = launch_level(config)
    if level == "none":
        return
    here = int(os.environ.get("LOCAL_WORLD_SIZE", processes))
    need, free = host_bytes(model, level, optimizer, processes) * here, psutil.virtual_memory().available
    if need > free:
        each = f" ({here} processes on this machine)" if here > 1 else ""
        raise ConfigError(f"training.offload: {level} keeps {size(need)} in host memory{each} and this machine has "
                          f"{size(free)} available; free memory, use more processes or machines, or plan another "
                          "setting (finetune plan --host-memory)")


def check_versions() -> None:
    """DeepSpeed installed and recent enough for an exact offloaded step, and Accelerate too."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        have = version("deepspeed")
    except PackageNotFoundError:
        raise ConfigError("training.offload: runs through DeepSpeed, which is not installed: pip install "
                          "'finetune[deepspeed]'") from None
    if Version(have) < Version(DEEPSPEED_AT_LEAST):
        raise ConfigError(f"training.offload: DeepSpeed {have} is installed; offload needs >= {DEEPSPEED_AT_LEAST} "
                          "(0.15.2 to 0.18.9 drop all but the last micro-batch's gradients under optimizer offload): "
                          "pip install 'finetune[deepspeed]'")
    accelerate = version("accelerate")
    if Version(accelerate) < Version(ACCELERATE_AT_LEAST):
        raise ConfigError(f"training.offload: accelerate {accelerate} is installed; DeepSpeed's window end needs "
                          f">= {ACCELERATE_AT_LEAST}: pip install -U accelerate")


def check_nvme(path: Optional[str]) -> None:
    """``offload_device: nvme``: a folder that exists and this process can write, and DeepSpeed's async I/O op."""
    if not path:
        raise ConfigError("training.offload_path: offload_device nvme swaps into a folder; give a writable one")
    if not os.path.isdir(path):
        raise ConfigError(f"training.offload_path: {path} is not a folder; give an existing, writable one")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"training.offload_path: {path} is not writable by this process; give one that is")
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise ConfigError("training.offload_device: nvme needs DeepSpeed's async I/O op, which cannot be built here "
                          "(libaio: apt install libaio-dev); use cpu")
