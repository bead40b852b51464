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
from dataclasses import dataclass, field
from typing import Callable, Optional

from finetune import config  # config.installed, looked up when called (a test replaces it for a missing package)
from finetune.config import PretrainedModelConfig, TrainingConfig
from finetune.errors import ConfigError
from finetune.items import is_causal_lm
from finetune.memory import sharded
from finetune.memory.cards import parse_gpu
from finetune.memory.measure import GiB
from finetune.memory.sharded import PERSISTENCE_THRESHOLD, REDUCE_BUCKET, Layout
from finetune.memory.speed import Speed, Work, estimate, work_of
from finetune.memory.step import HEADROOM, Profile, Setting, longest_batches, measure, without_saved
from finetune.models import forward
from finetune.models.loss_head import (
    chunked_loss_enabled,
    disable_chunked_loss,
    enable_chunked_loss,
    unsupported_reason,
)

CONTEXT = 0.6 * GiB   # CUDA context, cuBLAS workspaces and the allocator's slack, reserved before any tensor


def size(nbytes: float) -> str:
    """Bytes for people: GiB from 1 GiB up, MiB below."""
    return f"{nbytes / GiB:.2f} GiB" if abs(nbytes) >= GiB else f"{nbytes / 2**20:.1f} MiB"


def budget_for(gpu_bytes: float) -> float:
    """Bytes of tensors a card of ``gpu_bytes`` can hold: what the context leaves, less the headroom."""
    return (gpu_bytes - CONTEXT) * HEADROOM


# ---------------------------------------------------------------------------------------------------------------
# what each setting costs


# What each setting costs, in the order the planner tries them (cheapest first). The first four keep the baseline's
# step; the rest (the levers) train something else, so they are tried only when nothing exact fits, in this order.
COST = {
    "plain": "no extra compute",
    "chunked loss": "the same FLOPs (the loss head runs in chunks; exact)",
    "checkpointing": "recomputes each block's forward in backward (about 1/3 more compute)",
    "offloading": "copies saved activations to host memory and back (PCIe traffic, partly overlapped)",
    "8-bit AdamW": "AdamW's moments kept block-wise in 8 bits: not the same update as fp32 AdamW (compare says so)",
    "LoRA": "trains adapters only: a different run from a full fine-tune baseline",
    "bf16 base": "the frozen weights rounded to bf16: the baseline's step only if its base was bf16 too",
    "nf4 base": "the frozen linear layers in 4 bits (QLoRA): the baseline's step only if the baseline was QLoRA too",
    "bf16 compute": "computes in bf16 (autocast): the baseline's step only if it computed in bf16 too",
}
LEVERS = ("8-bit AdamW", "LoRA", "bf16 base", "nf4 base", "bf16 compute")


# ---------------------------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class Pricing:
    """How a subject's profiles are priced: as one process of ``layout`` holds them, its micro-batches measured up
    to ``per_process`` samples (the largest micro-batch a process's window can use)."""

    layout: Layout = Layout()
    per_process: int = 1


@dataclass(frozen=True)
class PlanRequest:
    """What a plan is asked for: the card, the effective batch and how processes share it, the recipe's training
    settings (optimizer, precision, whether the chunked head may be used), and the levers to try when nothing that
    keeps the step fits."""

    gpu: str                       # card memory or a name (``cards.parse_gpu``)
    effective: int                 # the effective batch planned for, every process together
    training: TrainingConfig = field(default_factory=TrainingConfig)
    layout: Layout = Layout()      # the processes sharing ``effective`` and their ZeRO stage
    sequence_length: Optional[int] = None   # the longest training sample's, for the table (None: not told)
    levers: tuple = ()             # (Setting, a function returning its Subject), in ``LEVERS`` order
    every_setting: bool = False    # measure them all (``Plan.predict`` then answers for any), not only until the pick
    work: Optional[Work] = None    # what the run computes, for the speed estimate (None: none)

    @property
    def per_process(self) -> int:
        return self.effective // self.layout.processes

    @property
    def pricing(self) -> Pricing:
        return Pricing(self.layout, self.per_process)

    @property
    def gpu_bytes(self) -> int:
        return parse_gpu(self.gpu)

    @property
    def budget(self) -> float:
        return budget_for(self.gpu_bytes)


@dataclass(frozen=True)
class SettingPlan:
    """One setting the planner weighed: the largest micro-batch that fits (0: none), the step peak there (at 1
    where none fits), whether it was measured (else priced from its fixed part) and whether it keeps the step."""

    setting: Setting
    micro_batch: int
    step_peak: int
    measured: bool
    exact: bool

    def record(self) -> dict:
        return {"setting": self.setting.label, "micro_batch": self.micro_batch, "step_peak": self.step_peak,
                "measured": self.measured, "exact": self.exact}


@dataclass(frozen=True)
class Plan:
    gpu: str
    gpu_bytes: int
    parameters: int
    trainable_parameters: int
    weights: int                   # bytes, of the recommended setting (LoRA adds adapters)
    gradients: int
    optimizer: int
    activations_per_sample: int    # saved for backward, recommended setting
    activations_fixed: int
    sequence_length: Optional[int]
    precision: str
    effective_batch_size: int
    micro_batch_size: int          # 0: does not fit
    gradient_accumulation_steps: int
    setting: Setting               # the recommendation's (or the last tried where nothing fits)
    step_peak: int                 # predicted, at the recommendation (or at micro-batch 1 of the last setting tried)
    fits: bool
    headroom: int                  # bytes the card has left at the recommendation: card − CUDA context − step peak
    note: str
    processes: int                 # every number above is what one of them holds (``sharded.Layout``)
    zero_stage: int
    speed: Optional[Speed] = None            # the run's speed and wall time (None: no estimate)
    settings: list = field(default_factory=list)   # every setting tried (SettingPlan), in the order tried
    profiles: list = field(default_factory=list, repr=False)

    def record(self) -> dict:
        """The plan as ``--json`` prints it: every field but the profiles, the setting as flat fields."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "setting":
                out.update(gradient_checkpointing=value.checkpointing, chunked_loss=value.chunked_loss,
                           activation_offloading=value.offload, lora=value.lora, lever_optimizer=value.optimizer,
                           lever_base=value.base, lever_compute=value.compute)
            elif f.name == "settings":
                out[f.name] = [row.record() for row in value]
            elif f.name != "profiles":
                out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        return out

    def predict(self, micro_batch: int, accumulation: int, setting: Optional[Setting] = None) -> int:
        """Predicted step peak of ``micro_batch`` × ``accumulation`` under ``setting`` (default: the recommended)."""
        return self.profile(setting).step_peak(micro_batch, accumulation)

    def profile(self, setting: Optional[Setting] = None) -> Profile:
        want = setting or self.setting
        return next(p for p in self.profiles if p.setting == want)

    def table(self) -> str:
        p, b = self.profile(), max(self.micro_batch_size, 1)
        n = self.gradient_accumulation_steps or self.effective_batch_size
        layout = Layout(self.processes, self.zero_stage)
        above = self.step_peak - p.weights - p.gradients - p.optimizer_state - p.buckets - p.gathered
        saved = min(p.part(p.saved, b), max(above, 0))
        rows = fixed_rows(p, layout) + [
                (f"saved activations × {b}", saved,
                 f"kept for backward, {self.sequence_length or '-'} tokens a sample, "
                 f"{'fp32' if self.precision == 'no' else self.precision}" if p.measured else
                 "not measured: the fixed part alone exceeds the card"),
                ("loss head, temporaries", max(above - saved, 0),
                 "the rest: logits, backward, optimizer step" if p.measured else "not measured")]
        w = max([44] + [len(s.setting.label) + 2 for s in self.settings])
        lines = [f"per process: {layout.describe()}", f"{'component':<28}{'memory':>12}  note", "-" * 76]
        lines += [f"{name:<28}{size(v):>12}  {note}" for name, v, note in rows]
        lines += ["-" * 76,
                  f"{'step peak':<28}{size(self.step_peak):>12}  predicted at {b} × {n}, {p.setting.label}",
                  f"{'CUDA context + slack':<28}{size(CONTEXT):>12}  reserved before any tensor",
                  f"{'total':<28}{size(self.step_peak + CONTEXT):>12}  of {size(self.gpu_bytes)} ({self.gpu})",
                  *([self.headroom_line()] if self.fits else []),
                  "", f"{'setting':<{w}}{'largest micro-batch':>20}{'step peak there':>18}  (none: at 1)",
                  "-" * (w + 52)]
        lines += [f"{s.setting.label:<{w}}{s.micro_batch or 'none':>20}"
                  f"{size(s.step_peak) if s.measured else '> ' + size(s.step_peak):>18}"
                  f"{'' if s.measured else '  (weights, gradients, optimizer state alone: not measured)'}"
                  for s in self.settings]
        lines.append("")
        if self.fits:
            flags = " ".join(p.setting.flags())
            lines.append(f"recommendation: --batch-size {self.micro_batch_size} --grad-accum-steps "
                         f"{self.gradient_accumulation_steps} {flags} (effective batch {self.effective_batch_size})")
        lines.append(self.note)
        if self.speed is not None:
            lines += ["", *speed_lines(self.speed)]
        return "\n".join(lines)

    def headroom_line(self) -> str:
        """What the card has left at the recommendation, and whether the effective batch caps its micro-batch."""
        per_process = self.effective_batch_size // self.processes
        line = f"{'headroom':<28}{size(self.headroom):>12}  left on the card at micro-batch {self.micro_batch_size}"
        if self.micro_batch_size == per_process:
            return line + (f"; capped at the effective batch ({per_process} a process): a larger micro-batch is "
                           "never used, the room stays free")
        return line + f"; micro-batch {next_divisor(self.micro_batch_size, per_process)} would not fit"


def next_divisor(b: int, n: int) -> int:
    """The next micro-batch above ``b`` that divides the window ``n``."""
    return next(d for d in range(b + 1, n + 1) if n % d == 0)


def duration(seconds: float) -> str:
    """Seconds for people: s, min, h or days."""
    for unit, length in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * length:
            return f"{seconds / length:.1f} {unit}"
    return f"{seconds:.0f} s" if seconds >= 0.5 else "under 1 s"


def speed_lines(s: Speed) -> list[str]:
    """The speed estimate's lines: on the card (its peak, the assumed utilization, FLOPs a token and how they are
    counted), the run's tokens and wall time, and the rate measured here."""
    run = f"the run: {s.run_rows:,} rows, {s.run_tokens:,} tokens ({s.epochs} epoch{'s' * (s.epochs != 1)})"
    lines = [f"speed (an estimate): {s.flops_per_token / 1e9:.4g} GFLOP a token = {s.formula}"]
    if s.card:
        lines += [f"  on {s.card} ({s.card_note}): {s.peak_flops / 1e12:.4g} TFLOP/s peak "
                  f"{'fp32' if s.precision == 'no' else s.precision} × {s.utilization:.0%} utilization (assumed) "
                  f"= {s.tokens_per_second:.4g} tokens/s; {run} → {duration(s.seconds)}"]
    else:
        lines += [f"  no estimate on the card: {s.card_note}; {run}"]
    if s.here_flops:
        lines += [f"  measured on {s.here}: {s.here_flops / 1e9:.4g} GFLOP/s in the planner's last micro-step "
                  f"(allocator recorded) = {s.here_tokens_per_second:.4g} tokens/s → {duration(s.here_seconds)}"]
    else:
        lines += ["  not timed on this machine: the planner's micro-steps allocated their tensors without computing "
                  "them (a model larger than this machine, --model-config)"]
    return lines


def fixed_rows(p: Profile, layout: Layout) -> list:
    """The table's rows for what one process holds besides a micro-batch's own: weights, gradients, optimizer state,
    and the layout's buckets and gathered weights, each saying how ``layout`` divides it (``memory.sharded``)."""
    n, stage = layout.processes, layout.zero_stage
    rows = [("weights", p.weights, f"{p.parameters / 1e6:.2f} M parameters"
             + (f"; ÷ {n}, those of ≤ {PERSISTENCE_THRESHOLD:,} elements whole" if stage == 3 else "")),
            ("gradients", p.gradients, f"{p.trainable / 1e6:.2f} M trainable" + (f"; ÷ {n}" if stage >= 2 else "")),
            ("optimizer state", p.optimizer_state, f"÷ {n}, with the fp32 copy of this partition" if stage else "")]
    if p.buckets:
        rows.append(("DDP gradient buckets", p.buckets, "a copy of the gradients") if stage == 0 else
                    ("DeepSpeed reduce bucket", p.buckets, f"reduce_bucket_size: {REDUCE_BUCKET:,} elements"))
    if p.gathered:
        rows.append(("gathered weights", p.gathered, "whole parameters in forward and backward"))
    return rows


def rank(setting: Setting) -> int:
    """Where ``setting`` stands in ``COST`` (the head's chunking costs nothing): the exact settings 0–3, then the
    costliest lever it uses."""
    levers = [i for i, name in enumerate(LEVERS) if name in setting.parts]
    return 4 + max(levers) if levers else 2 * setting.offload + setting.checkpointing


def keeps_step(setting: Setting) -> bool:
    """Whether ``setting`` trains the baseline's step (it uses no lever)."""
    return rank(setting) < len(COST) - len(LEVERS)


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

    def measure(self, setting: Setting) -> Optional[Profile]:
        """The Profile of ``setting``, or None when the model cannot checkpoint after all."""
        try:
            switch(self.model, setting, self.enable_gradient_checkpointing)
        except ConfigError:
            return None
        whole = measure(self.model, self.batches, setting, self.t, self.loss_fn, self.pricing.per_process)
        return sharded.per_process(whole, self.pricing.layout, sharded.sizes_of(self.model))


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
    """``make_plan`` on subjects: the recipe's (its exact settings, cheapest first), then ``request.levers``', in
    order."""
    budget, per_process, every_setting = request.budget, request.per_process, request.every_setting
    can_chunk = subject.can_chunk
    fits = lambda p: p.largest_micro_batch(per_process, budget) > 0  # noqa: E731
    # with the chunked head available, the settings without it are measured only to show what it saves
    pick = lambda: min((p for p in profiles if fits(p) and p.setting.chunked_loss == can_chunk),  # noqa: E731
                       key=lambda p: rank(p.setting), default=None)
    profiles = []
    if subject.fixed is not None and subject.fixed > budget:
        profiles.append(subject.unmeasured(Setting(checkpointing=subject.can_checkpoint, chunked_loss=can_chunk)))
    else:
        order = measuring_order(can_chunk, subject.can_checkpoint)
        for i, setting in enumerate(order):
            chosen = pick()
            if chosen and not every_setting and all(rank(s) >= rank(chosen.setting) for s in order[i:]):
                break
            profile = subject.measure(setting)
            if profile is None:  # no checkpointing support after all
                break
            profiles.append(profile)
            if setting.offload:
                base = next(p for p in profiles if p.setting == dataclasses.replace(setting, offload=False))
                profiles[-1].floor = without_saved(base)
    checkpointing = any(p.setting.checkpointing for p in profiles)
    for lever, build in request.levers:
        if pick() is not None and not every_setting:
            break
        profiles.append(measure_lever(build(), dataclasses.replace(lever, checkpointing=checkpointing,
                                                                    chunked_loss=can_chunk), budget))
    return finish_plan(request, profiles, pick())


def measure_lever(subject, setting: Setting, budget: float) -> Profile:
    """A lever's Profile, with the memory settings of the recipe's most frugal one (checkpointing only where the
    model has it); priced from its fixed part alone where that already exceeds ``budget``."""
    if subject.fixed is not None and subject.fixed > budget:
        return subject.unmeasured(setting)
    profile = subject.measure(setting)
    return profile if profile is not None else subject.measure(dataclasses.replace(setting, checkpointing=False))


def finish_plan(request: PlanRequest, profiles: list, chosen: Optional[Profile]) -> Plan:
    """The Plan of ``profiles`` (every setting weighed, in order), recommending ``chosen`` (None: nothing fits)."""
    budget, per_process, gpu_bytes, layout = request.budget, request.per_process, request.gpu_bytes, request.layout

    def at_largest(p: Profile) -> tuple[int, int]:
        b = p.largest_micro_batch(per_process, budget)
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
                settings=[SettingPlan(p.setting, *at_largest(p), p.measured, keeps_step(p.setting)) for p in profiles],
                profiles=profiles)


def speed_of(chosen: Optional[Profile], request: PlanRequest) -> Optional[Speed]:
    """The recommendation's speed on the request's card (``memory.speed``); None where nothing fits or the rows have
    no tokens."""
    if chosen is None or request.work is None or not chosen.multiplying[0]:
        return None
    s = chosen.setting
    return estimate(request.gpu, s.compute or request.training.mixed_precision, chosen.multiplying, s.checkpointing,
                    request.work, chosen.here_flops)


def fixed_part(p: Profile) -> int:
    return p.weights + p.gradients + p.optimizer_state


def explain(chosen: Optional[Profile], profiles: list, request: PlanRequest) -> str:
    """Why this recommendation: what the cheaper settings would have needed (on each process of the request's
    layout)."""
    gpu_bytes, budget, per_process, layout = request.gpu_bytes, request.budget, request.per_process, request.layout
    if gpu_bytes <= CONTEXT:
        return (f"does not fit: {gpu_bytes / GiB:.1f} GiB is no more than the {CONTEXT / GiB:.1f} GiB the CUDA "
                "context takes before any tensor")
    short = [f"{p.setting.label} needs {size(p.step_peak(1, per_process))} at 1 sample" if p.measured else
             f"{p.setting.label} needs {size(fixed_part(p))} for weights, gradients and optimizer state alone"
             for p in profiles if not p.largest_micro_batch(per_process, budget)]
    room = f"{size(budget)} for tensors" + ("" if layout == Layout() else f" on each process: {layout.describe()}")
    if chosen is None:
        fixed = min(fixed_part(p) for p in profiles)
        sharding = "FSDP or DeepSpeed (accelerate_configs/; price it with --processes and --zero-stage)" \
            if layout.zero_stage < 3 else "more processes"
        hint = f"use a shorter sequence, {sharding}, or a bigger card" if fixed < budget \
            else f"weights, gradients and optimizer state alone do not fit: {sharding} or a bigger card"
        return f"does not fit ({room}): " + "; ".join(short) + f" — {hint}"
    b = chosen.largest_micro_batch(per_process, budget)
    why = f"why: {chosen.setting.label} is the cheapest setting that fits ({room})" + "".join(f"; {x}" for x in short) \
        + ". Cost: " + "; ".join(f"{x}: {COST[x]}" for x in chosen.setting.parts or ("plain",))
    if b == per_process:
        return why + ". The whole window fits in one micro-batch: no accumulation needed"
    return why + f". {per_process // b} micro-batches of {b} take the same steps as one batch of {request.effective}"


# ---------------------------------------------------------------------------------------------------------------
# the command
def plan_recipe(cfg, gpu: str, layout: Layout, build: Callable, effective: int) -> Plan:
    """``finetune plan`` for a recipe whose model this machine can build: every setting measured at full depth.
    ``build(cfg)``: the recipe's job (start-up's, given by the command); ``effective``: the batch planned for."""
    parse_gpu(gpu)  # before building the model
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
    return plan_subjects(subject(cfg, job), PlanRequest(gpu, effective, t, layout, seq, levers,
                                                        work=work_of(job, t, effective, job.model)))


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
    quant = config.installed("bitsandbytes")
    out = []
    if quant and t.optimizer == "adamw" and not lora:
        out.append(Setting(optimizer="adamw8bit"))
    if not lora and not config.installed("peft"):  # every lever below trains LoRA adapters
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
