"""``finetune plan --recipe R --gpu 8GiB``: will the baseline fit on my card, and with what?

The planner predicts the **peak of one optimizer step** — the most bytes allocated at any moment — for each
combination of the memory settings (``step.Profile``: weights, gradients, the optimizer's state and step,
and the micro-batch's measured peak: saved activations, the loss head, backward's temporaries), and recommends the
cheapest that fits the card: the settings are tried in the order of what they cost (``COST``), each with the largest
micro-batch that divides the window and fits. It builds the recipe's model on this machine and measures its
micro-batches of the longest training samples rather than guessing.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from finetune import schema  # schema.installed, looked up when called (a test replaces it for a missing package)
from finetune.config import PretrainedModelConfig
from finetune.errors import ConfigError
from finetune.items import is_causal_lm
from finetune.memory import host, sharded
from finetune.memory.cards import CARDS, parse_gpu
from finetune.memory.measure import GiB
from finetune.memory.records import CONTEXT, Plan, PlanRequest, Pricing, SettingPlan, as_machine, size
from finetune.memory.sharded import Layout
from finetune.memory.speed import Speed, estimate, work_of
from finetune.memory.step import Profile, Setting, longest_batches, measure, without_saved
from finetune.models import forward
from finetune.models.loss_head import (
    chunked_loss_enabled,
    disable_chunked_loss,
    enable_chunked_loss,
    unsupported_reason,
)

# ---------------------------------------------------------------------------------------------------------------
# what each setting costs


# What each setting costs, in the order the planner tries them (cheapest first). The first six keep the baseline's
# step — the host steps the recipe's own fp32 optimizer, so the offload levels do too; the rest (the levers) train
# something else, so they are tried only when nothing exact fits the card and the host, in this order.
COST = {
    "plain": "no extra compute",
    "chunked loss": "the same FLOPs (the loss head runs in chunks; exact)",
    "checkpointing": "recomputes each block's forward in backward (about 1/3 more compute)",
    "offloading": "copies saved activations to host memory and back (PCIe traffic, partly overlapped)",
    "optimizer offload": "the optimizer's fp32 step on the host (DeepSpeed ZeRO-2 offload): the same update; "
                         "gradients down and weights up the host link every step",
    "parameter offload": "the weights on the host too, streamed to the card layer by layer in every forward and "
                         "backward (DeepSpeed ZeRO-3 offload): the same update, the most host-link traffic",
    "8-bit AdamW": "AdamW's moments kept block-wise in 8 bits: not the same update as fp32 AdamW (compare says so)",
    "LoRA": "trains adapters only: a different run from a full fine-tune baseline",
    "bf16 base": "the frozen weights rounded to bf16: the baseline's step only if its base was bf16 too",
    "nf4 base": "the frozen linear layers in 4 bits (QLoRA): the baseline's step only if the baseline was QLoRA too",
    "bf16 compute": "computes in bf16 (autocast): the baseline's step only if it computed in bf16 too",
}
LEVERS = ("8-bit AdamW", "LoRA", "bf16 base", "nf4 base", "bf16 compute")
EXACT_RANKS = 4 * (1 + len(host.LEVELS))  # the activation settings (4) at each host level (none, then LEVELS)


def rank(setting: Setting) -> int:
    """Where ``setting`` stands in the order of ``COST`` (the head's chunking costs nothing): the activation settings
    0–3 without a host level, again at each level of ``host.LEVELS`` (4–7, 8–11), then the costliest lever it
    uses."""
    levers = [i for i, name in enumerate(LEVERS) if name in setting.parts]
    if levers:
        return EXACT_RANKS + max(levers)
    level = 1 + host.LEVELS.index(setting.host) if setting.host else 0
    return 4 * level + 2 * setting.offload + setting.checkpointing


def keeps_step(setting: Setting) -> bool:
    """Whether ``setting`` trains the baseline's step (it uses no lever)."""
    return rank(setting) < EXACT_RANKS


def measuring_order(can_chunk: bool, can_checkpoint: bool) -> list[Setting]:
    """Every setting to weigh, in the order they can be measured on one model: checkpointing is only ever switched
    on, so the settings without it come first. Offloading keeps the chunked head when there is one."""
    heads = [False, True] if can_chunk else [False]
    out = [Setting(chunked_loss=h) for h in heads] + [Setting(chunked_loss=can_chunk, offload=True)]
    if can_checkpoint:
        out += [Setting(checkpointing=True, chunked_loss=h) for h in heads]
        out.append(Setting(checkpointing=True, chunked_loss=can_chunk, offload=True))
    return out


def switch(model, setting: Setting, enable_gradient_checkpointing: Optional[Callable]) -> None:
    """Put ``model`` in ``setting`` (checkpointing is only ever switched on: see ``measuring_order``)."""
    if setting.chunked_loss and not chunked_loss_enabled(model):
        enable_chunked_loss(model)
    elif not setting.chunked_loss and chunked_loss_enabled(model):
        disable_chunked_loss(model)
    if setting.checkpointing and not getattr(model, "_planned_checkpointing", False):
        enable_gradient_checkpointing(model)
        model._planned_checkpointing = True


class Subject:
    """What the planner measures settings on: a model of the recipe (or of one of its levers) with the micro-batches,
    training settings and loss it trains with, priced per process of ``layout``. ``fixed`` (weights + gradients +
    optimizer state, per process) is None when only measuring tells it; a subject that knows it is not measured
    where that alone exceeds the card."""

    fixed: Optional[int] = None

    def __init__(self, model, batches: list, t, loss_fn=None, enable_gradient_checkpointing: Optional[Callable] = None,
                 pricing: Pricing = Pricing()):
        self.model, self.batches, self.t, self.loss_fn = model, batches, t, loss_fn
        self.enable_gradient_checkpointing = enable_gradient_checkpointing
        self.pricing = pricing
        self.can_chunk = bool(is_causal_lm(model) and unsupported_reason(model) is None
                              and (loss_fn is None or t.chunked_loss))
        self.can_checkpoint = enable_gradient_checkpointing is not None
        self._whole: dict = {}  # one process's Profile of each setting measured, by setting without host level

    def measure(self, setting: Setting) -> Optional[Profile]:
        """The Profile of ``setting``, or None when the model cannot checkpoint after all. A host level changes
        where the fixed part lives, not the micro-steps: they are measured once for every level."""
        key = dataclasses.replace(setting, host="")
        if key not in self._whole:
            self._whole[key] = self.measure_whole(key)
        if self._whole[key] is None:
            return None
        whole = dataclasses.replace(self._whole[key], setting=setting)
        return host.price(whole, self.pricing.layout, sharded.sizes_of(self.model))

    def measure_whole(self, setting: Setting) -> Optional[Profile]:
        """``setting``'s Profile as one process holding everything has it (None: no checkpointing after all)."""
        try:
            switch(self.model, setting, self.enable_gradient_checkpointing)
        except ConfigError:
            return None
        return measure(self.model, self.batches, setting, self.t, self.loss_fn, self.pricing.per_process)


def make_plan(model, batches: list, request: PlanRequest, loss_fn=None,
              enable_gradient_checkpointing: Optional[Callable] = None, lora_model: Optional[Callable] = None) -> Plan:
    """Measure the settings until the cheapest that fits ``request.gpu`` is known; recommend it with its micro-batch.

    ``batches``: two micro-batches of different sizes (samples), same sequence length, on the model's device.
    ``request``: the card, the effective batch and its layout (every number is one process's), the training settings,
    the levers to try after LoRA. ``enable_gradient_checkpointing(model)``: switches checkpointing on (None: not
    available). ``lora_model()``: a fresh LoRA model of the recipe, tried first of the levers, only when nothing that
    trains every weight fits (None: not offered).

    Example: ``make_plan(model, [batch(1), batch(2)], PlanRequest("8GiB", effective=32)).table()``
    """
    t, pricing = request.training, request.pricing
    subject = Subject(model, batches, t, loss_fn, enable_gradient_checkpointing, pricing)
    if lora_model is not None and not any("lora_" in name for name, _ in model.named_parameters()):
        lora = (Setting(lora=True), lambda: Subject(lora_model().to(next(model.parameters()).device), batches, t,
                                                    loss_fn, enable_gradient_checkpointing, pricing))
        request = dataclasses.replace(request, levers=(lora, *request.levers))
    return plan_subjects(subject, request)


def plan_subjects(subject, request: PlanRequest) -> Plan:
    """``make_plan`` on subjects: the recipe's exact settings, cheapest first — without a host level, then at each
    of ``request.host_levels`` — then ``request.levers``', in order. A setting fits when its step fits the card and
    its host part the host (``PlanRequest.host_budget``)."""
    budget, every_setting = request.budget, request.every_setting
    can_chunk = subject.can_chunk
    fits = lambda p: request.micro_batch_of(p) > 0  # noqa: E731
    # with the chunked head available, the settings without it are measured only to show what it saves
    pick = lambda: min((p for p in profiles if fits(p) and p.setting.chunked_loss == can_chunk),  # noqa: E731
                       key=lambda p: rank(p.setting), default=None)
    profiles = []
    for level in request.host_levels:
        if pick() is not None and not every_setting:
            break
        weigh(subject, level, profiles, pick, request)
    checkpointing = any(p.setting.checkpointing for p in profiles)
    for lever, build in request.levers:
        if pick() is not None and not every_setting:
            break
        profiles.append(measure_lever(build(), dataclasses.replace(lever, checkpointing=checkpointing,
                                                                    chunked_loss=can_chunk), budget))
    return finish_plan(request, profiles, pick())


def weigh(subject, level: str, profiles: list, pick: Callable, request: PlanRequest) -> None:
    """Add ``subject``'s activation settings at host ``level`` ("" none) to ``profiles``, measured cheapest first
    until no cheaper one than ``pick()`` is left; one priced from its fixed part where that alone exceeds the card
    or its host part the host."""
    can_chunk = subject.can_chunk
    if subject.fixed is not None:
        priced = subject.unmeasured(Setting(checkpointing=subject.can_checkpoint, chunked_loss=can_chunk, host=level))
        if fixed_part(priced) > request.budget or priced.host > request.host_budget:
            profiles.append(priced)
            return
    # at a host level the head's chunking is not shown again: only the settings the planner may pick
    order = [dataclasses.replace(s, host=level) for s in measuring_order(can_chunk, subject.can_checkpoint)
             if not level or s.chunked_loss == can_chunk]
    for i, setting in enumerate(order):
        chosen = pick()
        if chosen and not request.every_setting and all(rank(s) >= rank(chosen.setting) for s in order[i:]):
            break
        profile = subject.measure(setting)
        if profile is None:  # no checkpointing support after all
            break
        profiles.append(profile)
        if setting.offload:
            base = next(p for p in profiles if p.setting == dataclasses.replace(setting, offload=False))
            profiles[-1].floor = without_saved(base)


def measure_lever(subject, setting: Setting, budget: float) -> Profile:
    """A lever's Profile, with the memory settings of the recipe's most frugal one (checkpointing only where the
    model has it); priced from its fixed part alone where that already exceeds ``budget``."""
    if subject.fixed is not None and subject.fixed > budget:
        return subject.unmeasured(setting)
    profile = subject.measure(setting)
    return profile if profile is not None else subject.measure(dataclasses.replace(setting, checkpointing=False))


def finish_plan(request: PlanRequest, profiles: list, chosen: Optional[Profile]) -> Plan:
    """The Plan of ``profiles`` (every setting weighed, in order), recommending ``chosen`` (None: nothing fits)."""
    per_process, gpu_bytes, layout = request.per_process, request.gpu_bytes, request.layout

    def at_largest(p: Profile) -> tuple[int, int]:
        b = request.micro_batch_of(p)
        return b, p.step_peak(b or 1, per_process // (b or 1))

    last = chosen or profiles[-1]
    b, peak = at_largest(last)
    return Plan(gpu=request.gpu, gpu_bytes=gpu_bytes, parameters=last.parameters, trainable_parameters=last.trainable,
                weights=last.weights, gradients=last.gradients, optimizer=last.optimizer_state,
                activations_per_sample=last.per_sample(last.saved)[1],
                activations_fixed=last.per_sample(last.saved)[0],
                sequence_length=request.sequence_length, precision=request.training.mixed_precision,
                effective_batch_size=request.effective, micro_batch_size=b,
                gradient_accumulation_steps=per_process // b if b else 0, setting=last.setting, step_peak=peak,
                fits=chosen is not None, processes=layout.processes, zero_stage=layout.zero_stage,
                headroom=int(gpu_bytes - CONTEXT - peak), speed=speed_of(chosen, request),
                note=explain(chosen, profiles, request),
                settings=[SettingPlan(p.setting, *at_largest(p), p.measured, keeps_step(p.setting), p.host)
                          for p in profiles],
                profiles=profiles, host=last.host, host_memory=request.host_bytes)


def speed_of(chosen: Optional[Profile], request: PlanRequest) -> Optional[Speed]:
    """The recommendation's speed on the request's card (``memory.speed``); None where nothing fits or the rows have
    no tokens."""
    if chosen is None or request.work is None or not chosen.multiplying[0]:
        return None
    s = chosen.setting
    speed = estimate(request.gpu, s.compute or request.training.mixed_precision, chosen.multiplying, s.checkpointing,
                     request.work, chosen.here_flops)
    if not s.host:
        return speed
    b = chosen.largest_micro_batch(request.per_process, request.budget)
    steps = -(-request.work.rows // request.effective)
    card = CARDS.get(speed.card) or CARDS.get(request.gpu.strip().lower())
    offload = host.offload_time(chosen, request.layout.processes, request.per_process // b, card, steps)
    added = steps * offload.seconds
    return dataclasses.replace(speed, offload=offload, seconds=speed.seconds + added if speed.seconds else 0.0,
                               here_seconds=speed.here_seconds + added if speed.here_seconds else 0.0)


def fixed_part(p: Profile) -> int:
    return p.weights + p.gradients + p.optimizer_state


def needs(p: Profile, per_process: int) -> str:
    """What ``p``'s setting would need: its step on the card (at 1 sample, or its fixed part where not measured),
    and, at a host level, its host part."""
    if not p.setting.host:
        return f"{p.setting.label} needs " + (f"{size(p.step_peak(1, per_process))} at 1 sample" if p.measured else
                                              f"{size(fixed_part(p))} for weights, gradients and optimizer state alone")
    card = f"{size(p.step_peak(1, per_process))} on the card at 1 sample" if p.measured else \
        f"at least {size(p.step_peak(1, per_process))} on the card"
    return f"{p.setting.label} needs {size(p.host)} of host memory and {card}"


def explain(chosen: Optional[Profile], profiles: list, request: PlanRequest) -> str:
    """Why this recommendation: what the cheaper settings would have needed (on each process of the request's
    layout)."""
    gpu_bytes, budget, per_process, layout = request.gpu_bytes, request.budget, request.per_process, request.layout
    if gpu_bytes <= CONTEXT:
        return (f"does not fit: {gpu_bytes / GiB:.1f} GiB is no more than the {CONTEXT / GiB:.1f} GiB the CUDA "
                "context takes before any tensor")
    short = [needs(p, per_process) for p in profiles if not request.micro_batch_of(p)]
    room = f"{size(budget)} for tensors" + ("" if layout == Layout() else f" on each process: {layout.describe()}")
    if any(p.setting.host for p in profiles):
        room += f", {size(request.host_budget)} of host memory" + (" each" if layout.processes > 1 else "")
    if chosen is None:
        fixed = min(fixed_part(p) for p in profiles)
        sharding = "FSDP or DeepSpeed (accelerate_configs/; price it with --processes and --zero-stage)" \
            if layout.zero_stage < 3 else "more processes"
        hint = f"use a shorter sequence, {sharding}, or a bigger card" if fixed < budget \
            else f"weights, gradients and optimizer state alone do not fit: {sharding} or a bigger card"
        return f"does not fit ({room}): " + "; ".join(short) + f" — {hint}"
    b = chosen.largest_micro_batch(per_process, budget)
    changed = "" if keeps_step(chosen.setting) else " — nothing that keeps the baseline's step fits"
    why = f"why: {chosen.setting.label} is the cheapest setting that fits ({room}){changed}" \
        + "".join(f"; {x}" for x in short) + ". Cost: " \
        + "; ".join(f"{x}: {COST[x]}" for x in chosen.setting.parts or ("plain",))
    if b == per_process:
        return why + ". The whole window fits in one micro-batch: no accumulation needed"
    return why + f". {per_process // b} micro-batches of {b} take the same steps as one batch of {request.effective}"


# ---------------------------------------------------------------------------------------------------------------
# the command
def plan_recipe(cfg, gpu, layout: Layout, build: Callable, effective: int) -> Plan:
    """``finetune plan`` for a recipe whose model this machine can build: every setting measured at full depth.
    ``gpu``: the card, or a ``Machine`` (the card, the host); ``build(cfg)``: the recipe's job (start-up's, given
    by the command); ``effective``: the batch planned for."""
    machine = as_machine(gpu)
    parse_gpu(machine.gpu)  # before building the model
    job = build(cfg)
    plannable(job)
    planned_window(effective, job)
    batches, seq = longest_batches(job, sizes=(1, 2))
    t = cfg.training
    remake = rebuilder(job, build)
    pricing = Pricing(layout, effective // layout.processes)

    def subject(variant, built=None):
        built = built or remake(variant)
        return Subject(built.model, batches, variant.training, built.loss_fn, checkpointing_of(built), pricing)

    levers = tuple((lever, lambda lever=lever: subject(with_lever(cfg, lever))) for lever in recipe_levers(cfg))
    return plan_subjects(subject(cfg, job), PlanRequest(machine.gpu, effective, t, layout, seq, levers,
                                                        work=work_of(job, t, effective, job.model),
                                                        host_memory=machine.host_memory, offload=machine.offload))


def rebuilder(job, build: Callable) -> Callable:
    """``variant`` → its job: ``job`` with the model its task builds for ``variant`` (``Job.model_for``), the data
    built once; where the task offers no such builder, the whole ``build(variant)``."""
    if job.model_for is None:
        return build
    return lambda variant: dataclasses.replace(job, model=job.model_for(variant))


def plannable(job) -> None:
    """ConfigError when the task's micro-steps cannot be measured before a run (``Job.unplannable``)."""
    if job.unplannable:
        raise ConfigError(f"plan: {job.unplannable}; nothing is planned for it")


def planned_window(effective: int, job) -> None:
    """ConfigError when the effective batch planned for is larger than the training set."""
    n_train = len(job.train_data)
    if effective > n_train:  # every window would be the whole set: a micro-batch above it is never used
        raise ConfigError(f"training.effective_batch_size: {effective} is larger than the {n_train} training "
                          f"samples; plan for at most {n_train} (one optimizer step per epoch)")


def checkpointing_of(job) -> Callable:
    return lambda m: forward.enable_gradient_checkpointing(m, job.enable_gradient_checkpointing)


def recipe_levers(cfg) -> list[Setting]:
    """The levers that can make ``cfg`` fit, in ``LEVERS`` order, each cumulative with LoRA where it needs it: an
    8-bit AdamW (full fine-tuning with AdamW), LoRA (a recipe that trains every weight), then for a pretrained
    Hugging Face model a bf16 base, a 4-bit nf4 base, and computing in bf16. bitsandbytes' levers only where it is
    installed, LoRA's only where peft is (the levers' recipes are not validated: what they need is asked here)."""
    m, t, lora = cfg.model, cfg.training, cfg.peft.enabled
    quant = schema.installed("bitsandbytes")
    out = []
    if quant and t.optimizer == "adamw" and not lora:
        out.append(Setting(optimizer="adamw8bit"))
    if not lora and not schema.installed("peft"):  # every lever below trains LoRA adapters
        return out
    if not lora:
        out.append(Setting(lora=True))
    if not (isinstance(m, PretrainedModelConfig) and m.name_or_path):
        return out
    if m.dtype == "fp32" and m.quantization == "none":
        out.append(Setting(lora=not lora, base="bf16"))
    nf4 = "nf4" if m.quantization == "none" and quant else ""
    if nf4:
        out.append(Setting(lora=not lora, base=nf4))
    if t.mixed_precision == "no" and (nf4 or m.quantization != "none"):
        out.append(Setting(lora=not lora, base=nf4, compute="bf16"))
    return out


def with_lever(cfg, lever: Setting):
    """``cfg`` with the fields ``lever`` changes (``Setting.overrides``)."""
    sections = {}
    for key, value in lever.overrides.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **fields)
                                       for section, fields in sections.items()})
