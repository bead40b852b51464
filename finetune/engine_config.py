"""The launch's engine config (DeepSpeed, FSDP), as ``accelerate launch`` hands it to the processes: its schema and
the settings finetune refuses, checked in start-up's first stage on every process (``startup.check``), and
DeepSpeed's again in the third with the config Accelerate prepares with. One line each, naming the key; nothing is
written before."""

from __future__ import annotations

import os
from typing import Optional

from accelerate.utils import FullyShardedDataParallelPlugin, constants

from finetune import distributed
from finetune.errors import ConfigError
from finetune.offload import SHIPPED, check_versions, launch_level


def check_engine_config(max_grad_norm: Optional[float], on_nonfinite: str, level: str = "none") -> None:
    """Every engine setting the launch's config holds, checked in stage 1 on every process: a key or value the
    engine would refuse later (with its own traceback, mid set-up), and what it would run differently from the
    recipe (its ``training.max_grad_norm`` and ``training.on_nonfinite``, the two settings an engine can overrule,
    and its ``training.offload`` ``level``). One line each, naming the key; nothing is written before."""
    name = distributed.engine()
    if name == "fsdp":
        check_offload(None, level)
        check_fsdp_config()
        check_sharding_launch()
    elif name == "deepspeed":
        config = read_deepspeed_config()
        check_deepspeed_values(config)
        check_deepspeed(config, max_grad_norm, None, on_nonfinite)
        check_offload(config, level)


def check_offload(config: Optional[dict], level: str) -> None:
    """The recipe's offload ``level`` under a launch with its own engine config (``config``: DeepSpeed's; None:
    FSDP's): the config must offload the same way. (Without one, ``offload.engage`` asked for the launch itself.)"""
    have = launch_level(config) if config is not None else "none"
    if "none" != have or level != "none":  # DeepSpeed's offload is exact only from its version 0.19
        check_versions()
    if level == "none":
        return
    if config is None:
        raise ConfigError(f"training.offload: {level} runs through DeepSpeed, and this launch's accelerate config "
                          f"is FSDP; launch without it (finetune starts DeepSpeed itself) or with {SHIPPED[level]}")
    if have != level:
        raise ConfigError(f"training.offload: {level}, but the launch's deepspeed config (ZeRO-"
                          f"{config['zero_optimization']['stage']}) offloads "
                          f"{'nothing' if have == 'none' else 'the ' + have}; drop the setting to run the launch's "
                          f"config, launch without it (finetune starts DeepSpeed itself) or with {SHIPPED[level]}")


# the accelerate config's deepspeed_config fields that reach the processes as numbers (ACCELERATE_<NAME>)
DEEPSPEED_FIELDS = {"ACCELERATE_DEEPSPEED_ZERO_STAGE": ("zero_stage", int, False),
                    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": ("gradient_accumulation_steps", int, True),
                    "ACCELERATE_GRADIENT_CLIPPING": ("gradient_clipping", float, True)}


def read_deepspeed_config() -> dict:
    """The launch's DeepSpeed config (``distributed.launch_deepspeed_config``): its number fields checked first,
    then a file or field Accelerate cannot read is one line naming it."""
    for env, (key, kind, auto) in DEEPSPEED_FIELDS.items():
        value = os.environ.get(env)
        if value is not None and not (auto and value == "auto") and not parses(value, kind):
            raise ConfigError(f"accelerate config: deepspeed_config.{key} is {value!r}; give "
                              f"{'an integer' if kind is int else 'a number'}{' or auto' if auto else ''}")
    file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    try:
        return distributed.launch_deepspeed_config()
    except (ValueError, KeyError, TypeError, OSError) as error:
        raise ConfigError(f"deepspeed config{f' {file}' if file else ''}: {first_line(error)}") from None


def parses(value: str, kind) -> bool:
    try:
        kind(value)
        return True
    except ValueError:
        return False


# the top-level entries that must be numbers (or "auto", which Accelerate fills in)
DEEPSPEED_NUMBERS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                     "gradient_clipping")


def check_deepspeed_values(config: dict) -> None:
    """The ZeRO section by DeepSpeed's own schema (``DeepSpeedZeroConfig``: the stage, the offload devices, the
    bucket sizes, unknown keys), and the top-level numbers. Entries still "auto" are Accelerate's to fill in."""
    for key in DEEPSPEED_NUMBERS:
        value = config.get(key, "auto")
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"deepspeed config: {key} is {value!r}; give a number or auto")
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        raise ConfigError("deepspeed config: zero_optimization is missing; give its stage (zero_stage: 0, 1, 2 or 3 "
                          "in the accelerate config)")
    if zero.get("stage") not in (0, 1, 2, 3):
        raise ConfigError(f"deepspeed config: zero_optimization.stage is {zero.get('stage')!r}; one of 0, 1, 2, 3 "
                          "(zero_stage in the accelerate config)")
    try:
        import pydantic
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError:  # DeepSpeed itself is not installed: Accelerate says so when it starts the engine
        return
    try:
        DeepSpeedZeroConfig(**without_auto(zero))
    except pydantic.ValidationError as error:
        problem = error.errors()[0]
        where = ".".join(str(x) for x in problem["loc"])
        raise ConfigError(f"deepspeed config: zero_optimization.{where} is {problem.get('input')!r}: "
                          f"{problem['msg']}") from None


def without_auto(section: dict) -> dict:
    """``section`` without its "auto" entries (Accelerate fills them in from the model), nested sections too."""
    return {k: without_auto(v) if isinstance(v, dict) else v for k, v in section.items() if v != "auto"}


def check_deepspeed(config: dict, max_grad_norm: Optional[float], optimizers: Optional[int],
                    on_nonfinite: str) -> None:
    """Refuse what DeepSpeed would run differently from the recipe: its own accumulation (finetune tells the
    engine where each window ends, and a DeepSpeed N > 1 would divide every loss by N once more), a clipping other
    than the recipe's (refused rather than silently overruled), its own optimizer or schedule, a second optimizer,
    and skipping a window. ``optimizers``: None before the task is built. Checked in stage 1 with the launch's
    config, and again in stage 3 with the optimizers and the config Accelerate prepares with."""
    if optimizers not in (None, 1):
        raise ConfigError(f"accelerate config: DeepSpeed drives one model and one optimizer; this task trains "
                          f"{optimizers} optimizers (use DDP: accelerate_configs/multi_gpu.yaml or multi_cpu_2.yaml)")
    if on_nonfinite == "skip":  # the engine steps inside the window's last backward, before finetune sees the norm
        raise ConfigError("training.on_nonfinite: skip cannot drop a window under DeepSpeed (its engine steps inside "
                          "backward); use stop")
    for section in ("optimizer", "scheduler"):
        if section in config:
            raise ConfigError(f"deepspeed config: remove its {section!r} section (finetune builds the optimizer and "
                              "schedule from training.optimizer and training.lr_scheduler)")
    steps = config.get("gradient_accumulation_steps")
    if steps not in (None, "auto", 1):
        raise ConfigError(f"deepspeed config: gradient_accumulation_steps is {steps}; set it to 1 or auto "
                          "(finetune accumulates each window itself: training.gradient_accumulation_steps or "
                          "training.effective_batch_size)")
    clip, named = distributed.deepspeed_clipping(max_grad_norm), config.get("gradient_clipping", "auto")
    if named not in ("auto", None) and clip != "auto" and float(named) != clip:
        raise ConfigError(f"deepspeed config: gradient_clipping is {named} but training.max_grad_norm is "
                          f"{max_grad_norm}; remove gradient_clipping from the accelerate / DeepSpeed config "
                          "(finetune gives DeepSpeed the recipe's clipping) or make them equal")


# fsdp_config keys of an accelerate config (FSDP_<KEY> in the launched processes' environment) and their values
FSDP_CHOICES = {"version": ("1", "2"), "sharding_strategy": None, "auto_wrap_policy": None,
                "backward_prefetch": None, "state_dict_type": None}


def check_fsdp_config() -> None:
    """The launch's ``fsdp_config``: each named choice among Accelerate's, then the rest as Accelerate's plugin
    reads them (a wrong value is one line naming the key, not the plugin's KeyError mid set-up)."""
    for key, allowed in FSDP_CHOICES.items():
        value = os.environ.get(f"FSDP_{key.upper()}")
        allowed = allowed or getattr(constants, f"FSDP_{key.upper()}")
        if value is not None and value.upper() not in allowed and not (value.isdigit() and key != "version"):
            raise ConfigError(f"accelerate config: fsdp_config.fsdp_{key} is {value!r}; one of "
                              f"{', '.join(allowed)}")
    try:
        FullyShardedDataParallelPlugin()
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"accelerate config: fsdp_config: {first_line(error)}") from None


def check_sharding_launch() -> None:
    """Refuse an FSDP launch that would silently not shard. Accelerate starts its FSDP plugin only on GPUs: with
    ``use_cpu: true``, or without a GPU, each process trains on its own, unsynchronised, and exits 0 with a wrong
    step. (DeepSpeed's launch ignores ``use_cpu``; finetune runs it on the CPU over gloo when there is no GPU.)"""
    if distributed.engine() == "fsdp" and (distributed.use_cpu_flag() or not distributed.has_device()):
        raise ConfigError("accelerate config: FSDP does not shard here (with use_cpu: true or without a GPU, "
                          "Accelerate's FSDP leaves each process training alone); run it on GPUs with use_cpu: "
                          "false, or on the CPU use accelerate_configs/deepspeed_zero3.yaml (DeepSpeed over gloo)")


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
