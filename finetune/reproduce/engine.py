"""The engine a baseline trained under, as its files show it: the DeepSpeed config its tool named (a dict in its
arguments, a JSON in its folder or beside its config, else one of the tools' shipped configs known by the path the
tool names it by), and the versions of DeepSpeed and transformers that trained it.

What ``finetune import`` says of it, one line each (:func:`engine_lines`):

* ``local:`` the config's offload (ZeRO-Offload of the optimizer state, of the parameters): where the weights and
  the optimizer state lived, not the step. The recipe keeps ``training.offload`` at its default: offload is a
  choice of this machine's memory, which ``finetune plan`` makes; the baseline's stage and devices are no
  requirement of its step.
* ``engine:`` where the baseline's engine itself took another step than the big batch's, and only where the files
  show each part of it (no version guessed): a DeepSpeed between 0.15.2 and 0.18.9 with the optimizer offloaded and
  accumulation > 1 (DeepSpeed PRs #7967, #7981: all but the last micro-batch's gradients dropped); the HF Trainer
  with DeepSpeed on transformers 5 with a model whose forward takes loss kwargs and accumulation > 1 (transformers
  #45305: the loss not averaged over the accumulation, a grad norm about N× the big batch's); an optimizer state
  with no fp32 master (DeepSpeed's ``bf16.bf16_master_weights_and_grads``, torchao's ``CPUOffloadOptimizer``).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import NamedTuple, Optional

from finetune.reproduce.record import Baseline, EngineStep, Where, file_of
from finetune.reproduce.sources.files import json_object

# the tools' shipped DeepSpeed configs, by the path their configs name them with (LLaMA-Factory's YAML, axolotl's
# config) or the word the tool takes for one (ms-swift's --deepspeed): what of each decides where the state lives and
# how it is kept. Each is the file at the commit named in tests/assets/corpus/deepspeed/PROVENANCE.md; a test holds
# these entries to those copies.
OFFLOAD_BOTH = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
SHIPPED = {
    "examples/deepspeed/ds_z3_offload_config.json": ("LLaMA-Factory", OFFLOAD_BOTH),
    "examples/deepspeed/ds_z2_offload_config.json": ("LLaMA-Factory",
                                                     {"stage": 2, "offload_optimizer": {"device": "cpu"}}),
    "examples/deepspeed/ds_z3_config.json": ("LLaMA-Factory", {"stage": 3}),
    "examples/deepspeed/ds_z2_config.json": ("LLaMA-Factory", {"stage": 2}),
    "examples/deepspeed/ds_z0_config.json": ("LLaMA-Factory", {"stage": 0}),
    "deepspeed_configs/zero3_bf16_cpuoffload_all.json": ("axolotl", OFFLOAD_BOTH),
    "deepspeed_configs/zero3_bf16_cpuoffload_params.json": ("axolotl",
                                                            {"stage": 3, "offload_param": {"device": "cpu"}}),
    "deepspeed_configs/zero2.json": ("axolotl", {"stage": 2, "offload_optimizer": {"device": "cpu"}}),
    "deepspeed_configs/zero3_bf16.json": ("axolotl", {"stage": 3}),
    "deepspeed_configs/zero3.json": ("axolotl", {"stage": 3}),
    "deepspeed_configs/zero1.json": ("axolotl", {"stage": 1}),
    "zero3_offload": ("ms-swift", OFFLOAD_BOTH),
    "zero2_offload": ("ms-swift", {"stage": 2, "offload_optimizer": {"device": "cpu"}}),
    "zero3": ("ms-swift", {"stage": 3}), "zero2": ("ms-swift", {"stage": 2}), "zero1": ("ms-swift", {"stage": 1}),
}
# the DeepSpeed releases whose ZeRO optimizer offload kept only the last micro-batch's gradients of a window
DROPPED = ((0, 15, 2), (0, 18, 9))
OFFLOADED = ("cpu", "nvme")


class DeepSpeedConfig(NamedTuple):
    """The DeepSpeed config a baseline trained under: ``zero`` its ``zero_optimization`` (None: named by a path
    that is neither here nor a shipped config), ``config`` the whole (None for a shipped one), ``name`` the file
    or word it was named by, ``where`` the file and key that name it, ``read`` how it was read."""

    zero: Optional[dict]
    config: Optional[dict]
    name: str
    where: str
    read: str


def deepspeed_config(b: Baseline) -> Optional[DeepSpeedConfig]:
    """The DeepSpeed config the baseline's arguments name (``deepspeed``: a dict, or a path or word), read from its
    folder or beside its config where it is there, else one of :data:`SHIPPED`; None where none is named."""
    value = b.get("deepspeed")
    if not value:
        return None
    where = str(Where(file_of(b.args["deepspeed"][1]), "deepspeed"))
    if isinstance(value, dict):
        return DeepSpeedConfig(_zero(value), value, where, where, "a dict in the arguments")
    name = str(value)
    folder = b.path if b.path.is_dir() else b.path.parent
    found = next((p for p in (Path(name), folder / name, folder / Path(name).name) if p.is_file()), None)
    if found is not None:
        config = json_object(found, "baseline")
        return DeepSpeedConfig(_zero(config), config, Path(name).name, where, f"read from {found}")
    key = next((k for k in SHIPPED if name == k or name.endswith("/" + k)), None)
    if key is None:
        return DeepSpeedConfig(None, None, Path(name).name, where, "not here")
    tool, zero = SHIPPED[key]
    return DeepSpeedConfig(zero, None, Path(name).name, where, f"{tool}'s shipped {key}")


def _zero(config: dict) -> dict:
    zero = config.get("zero_optimization")
    return zero if isinstance(zero, dict) else {}


def offloaded(zero: Optional[dict], what: str) -> Optional[str]:
    """The device ``zero_optimization.offload_<what>`` (optimizer, param) puts it on, None where it stays."""
    device = ((zero or {}).get(f"offload_{what}") or {}).get("device") if isinstance(
        (zero or {}).get(f"offload_{what}"), dict) else None
    return str(device) if str(device) in OFFLOADED else None


def engine_lines(b: Baseline, out) -> None:
    """What import says of the baseline's engine (the module's docstring): its offload as a local choice, and each
    step of its engine that is not the big batch's, onto ``out`` (``carry.Imported``)."""
    ds = deepspeed_config(b)
    if ds is not None:
        local = offload_line(ds)
        if local:
            out.not_carried.append(local)
    for step in engine_steps(b, ds):
        out.not_carried.append(step)
    if b.get("optimizer_in_bwd"):
        out.not_carried.append(f"note: {b.args['optimizer_in_bwd'][1]} true — each parameter stepped as soon as "
                               "its gradient was made, with accumulation 1 and no clipping (torchtune refuses both "
                               "with it): the same update as one step after the whole batch, which finetune takes "
                               "over its micro-batches")


def offload_line(ds: DeepSpeedConfig) -> Optional[str]:
    """``local: deepspeed ZeRO-3, optimizer and parameters offloaded to cpu (NAME) — …``; None without offload."""
    if ds.zero is None:
        return (f"local: deepspeed {ds.name} ({ds.where}) is not here and not a tool's shipped config: its stage "
                "and offload are unknown — where the weights and optimizer state live, not the step")
    optimizer, param = offloaded(ds.zero, "optimizer"), offloaded(ds.zero, "param")
    if not optimizer and not param:
        return None
    held = " and ".join(w for w, d in (("optimizer", optimizer), ("parameters", param)) if d)
    device = param or optimizer
    level = "parameters" if param else "optimizer"
    here = f"training.offload={level}" + (" training.offload_device=nvme" if device == "nvme" else "")
    return (f"local: deepspeed ZeRO-{ds.zero.get('stage', '?')}, {held} offloaded to {device} ({ds.name}, "
            f"{ds.read}) — where the weights and optimizer state live, not the step; here: {here} if it does "
            "not fit (finetune plan)")


def engine_steps(b: Baseline, ds: Optional[DeepSpeedConfig]) -> list:
    """Each step of the baseline's engine that is not the big batch's, as its files show it (``EngineStep``)."""
    steps = [dropped_gradients(b, ds), unaveraged_loss(b, ds), low_master(b, ds)]
    return [s for s in steps if s is not None]


def _version(b: Baseline, name: str) -> Optional[tuple]:
    """(the version of ``name`` the run trained with as numbers, as said: ``FILE: key X``) where its files say it
    (``files.read_versions``; transformers' also from ``config.json``, which the version that trained the model
    wrote); None where they do not (nothing guessed)."""
    value, where = b.get(f"{name}_version"), b.args.get(f"{name}_version", (None, None))[1]
    saved = (b.model_config or {}).get("transformers_version") if name == "transformers" else None
    if value is None and saved:
        value, where = saved, "config.json: transformers_version"
    parts = re.findall(r"\d+", str(value or ""))[:3]
    if not parts:
        return None
    return tuple(int(p) for p in parts) + (0,) * (3 - len(parts)), f"{where} {value}"


def _accumulation(b: Baseline) -> int:
    return int(b.get("gradient_accumulation_steps") or 1)


def dropped_gradients(b: Baseline, ds: Optional[DeepSpeedConfig]) -> Optional[EngineStep]:
    """DeepSpeed 0.15.2–0.18.9 with the optimizer offloaded and accumulation > 1 (DeepSpeed PRs #7967, #7981)."""
    version = _version(b, "deepspeed")
    device = offloaded(ds.zero, "optimizer") if ds is not None else None
    if version is None or device is None or _accumulation(b) < 2 or not DROPPED[0] <= version[0] <= DROPPED[1]:
        return None
    return EngineStep(f"{version[1]}, {ds.name}: "
                      f"zero_optimization.offload_optimizer {device}, {b.args['gradient_accumulation_steps'][1]}: "
                      f"gradient_accumulation_steps {_accumulation(b)}",
                      "DeepSpeed 0.15.2–0.18.9 kept only the last micro-batch's gradients of each step under "
                      "optimizer offload (DeepSpeed PRs #7967, #7981)")


def unaveraged_loss(b: Baseline, ds: Optional[DeepSpeedConfig]) -> Optional[EngineStep]:
    """The HF Trainer with DeepSpeed on transformers 5 and a model whose forward takes loss kwargs (transformers
    #45305): each micro-batch's loss is divided by the window's items and DeepSpeed divides it by the accumulation
    again, or not at all: not the window's mean."""
    version = _version(b, "transformers")
    if ds is None or version is None or version[0][0] != 5 or _accumulation(b) < 2:
        return None
    model = takes_loss_kwargs(b.model_config)
    if model is None:
        return None
    return EngineStep(f"{version[1]}, {ds.where}, "
                      f"config.json: architectures {model}, gradient_accumulation_steps {_accumulation(b)}",
                      "transformers 5's Trainer under DeepSpeed, with a model whose forward takes loss kwargs, does "
                      "not average the loss over the accumulation (transformers#45305): its gradients and grad norm "
                      f"are about {_accumulation(b)}× the big batch's")


def takes_loss_kwargs(model_config: Optional[dict]) -> Optional[str]:
    """The architecture of ``config.json`` where the installed transformers' class takes loss kwargs as the
    Trainer tells (its ``accepts_loss_kwargs``, else a ``**kwargs`` in its forward); None where it does not, or the
    class is not installed (nothing guessed)."""
    names = (model_config or {}).get("architectures") or []
    if not names:
        return None
    import transformers  # lazy: only a baseline under DeepSpeed on transformers 5 asks

    cls = getattr(transformers, str(names[0]), None)
    if cls is None:
        return None
    if hasattr(cls, "accepts_loss_kwargs"):
        return str(names[0]) if cls.accepts_loss_kwargs else None
    params = inspect.signature(cls.forward).parameters.values()
    return str(names[0]) if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params) else None


def low_master(b: Baseline, ds: Optional[DeepSpeedConfig]) -> Optional[EngineStep]:
    """An optimizer whose master weights and state are not fp32: DeepSpeed's ``bf16_master_weights_and_grads``,
    torchao's ``CPUOffloadOptimizer`` over a model in bf16 (its states take the weights' dtype)."""
    bf16 = (ds.config or {}).get("bf16") if ds is not None else None
    if isinstance(bf16, dict) and bf16.get("bf16_master_weights_and_grads"):
        return EngineStep(f"{ds.name}: bf16.bf16_master_weights_and_grads true",
                          "DeepSpeed kept the master weights and gradients in bf16, not fp32: each update is "
                          "rounded to bf16")
    optim = str(b.get("optim") or "")
    if optim.endswith("CPUOffloadOptimizer"):
        dtype = b.own.get("dtype", (None, None))
        kept = f"in {dtype[0]}, no fp32 master" if dtype[0] in ("bf16", "fp16") else "in the weights' dtype"
        return EngineStep(f"{file_of(b.args['optim'][1])}: optimizer._component_ {optim}",
                          f"torchao's CPUOffloadOptimizer steps on the host with its states {kept}, and clips no "
                          "gradient it offloads")
    return None
