"""``finetune plan --recipe R --gpu 8GiB``: will the baseline fit on my card, and with what?

The planner predicts the **peak of one optimizer step** — the most bytes allocated at any moment — for each
combination of the memory settings (``step_memory.Profile``: weights, gradients, the optimizer's state and step,
and the micro-batch's measured peak: saved activations, the loss head, backward's temporaries), and recommends the
cheapest that fits the card: the settings are tried in the order of what they cost (``COST``), each with the largest
micro-batch that divides the window and fits. It builds the recipe's model on this machine and measures its
micro-batches of the longest training samples rather than guessing.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch

from finetune.errors import ConfigError
from finetune.memory import GiB, PeakMeter
from finetune.step_memory import HEADROOM, Profile, Setting, longest_batches, measure, without_saved

# memory of common cards (bytes); "8GiB" / "12GB" / "24" also work
GPUS = {
    "t4": 16, "v100": 16, "v100-32gb": 32, "p100": 16, "rtx2080ti": 11, "rtx3060": 12, "rtx3070": 8, "rtx3080": 10,
    "rtx3090": 24, "rtx4060": 8, "rtx4070": 12, "rtx4070-laptop": 8, "rtx4080": 16, "rtx4090": 24, "a10": 24,
    "a10g": 24, "l4": 24, "l40s": 48, "a100-40gb": 40, "a100-80gb": 80, "a100": 80, "h100": 80, "h100-80gb": 80,
}
CONTEXT = 0.6 * GiB   # CUDA context, cuBLAS workspaces and the allocator's slack, reserved before any tensor


def parse_gpu(spec: str) -> int:
    """``t4`` / ``a100-40gb`` / ``8GiB`` / ``12GB`` / ``24`` (GiB) → bytes."""
    key = spec.strip().lower()
    if key in GPUS:
        return GPUS[key] * GiB
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(gib|gb|g)?", key)
    if not m:
        raise ConfigError(f"--gpu: got {spec!r}; give a size like 8GiB or one of: {', '.join(sorted(GPUS))}")
    size = int(float(m.group(1)) * GiB)
    if size <= 0:
        raise ConfigError(f"--gpu: got {spec!r}; give the card's memory, more than 0")
    return size


def size(nbytes: float) -> str:
    """Bytes for people: GiB from 1 GiB up, MiB below."""
    return f"{nbytes / GiB:.2f} GiB" if abs(nbytes) >= GiB else f"{nbytes / 2**20:.1f} MiB"


def budget_for(gpu_bytes: float) -> float:
    """Bytes of tensors a card of ``gpu_bytes`` can hold: what the context leaves, less the headroom."""
    return (gpu_bytes - CONTEXT) * HEADROOM


# ---------------------------------------------------------------------------------------------------------------
# what each setting costs


# What each setting costs, in the order the planner tries them (cheapest first). LoRA comes last: it trains other
# weights, so it is no longer the baseline's step.
COST = {
    "plain": "no extra compute",
    "chunked loss": "the same FLOPs (the loss head runs in chunks; exact)",
    "checkpointing": "recomputes each block's forward in backward (about 1/3 more compute)",
    "offloading": "copies saved activations to host memory and back (PCIe traffic, partly overlapped)",
    "LoRA": "trains adapters only: a different run from a full fine-tune baseline",
}


# ---------------------------------------------------------------------------------------------------------------
# the plan


@dataclass
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
    gradient_checkpointing: bool
    chunked_loss: bool
    activation_offloading: bool
    lora: bool
    step_peak: int                 # predicted, at the recommendation (or at micro-batch 1 of the last setting tried)
    fits: bool
    note: str
    settings: list = field(default_factory=list)   # every setting tried: label, largest micro-batch, its peak
    profiles: list = field(default_factory=list, repr=False)

    def predict(self, micro_batch: int, accumulation: int, setting: Optional[Setting] = None) -> int:
        """Predicted step peak of ``micro_batch`` × ``accumulation`` under ``setting`` (default: the recommended)."""
        return self.profile(setting).step_peak(micro_batch, accumulation)

    def profile(self, setting: Optional[Setting] = None) -> Profile:
        want = setting or Setting(self.gradient_checkpointing, self.chunked_loss, self.activation_offloading,
                                  self.lora)
        return next(p for p in self.profiles if p.setting == want)

    def table(self) -> str:
        p, b = self.profile(), max(self.micro_batch_size, 1)
        n = self.gradient_accumulation_steps or self.effective_batch_size
        above = self.step_peak - p.weights - p.gradients - p.optimizer_state - p.buckets
        saved = min(p.part(p.saved, b), max(above, 0))
        rows = [("weights", p.weights, f"{p.parameters / 1e6:.2f} M parameters"),
                ("gradients", p.gradients, f"{p.trainable / 1e6:.2f} M trainable"),
                ("optimizer state", p.optimizer_state, ""),
                (f"saved activations × {b}", saved,
                 f"kept for backward, {self.sequence_length or '-'} tokens a sample, "
                 f"{'fp32' if self.precision == 'no' else self.precision}"),
                ("loss head, temporaries", max(above - saved, 0), "the rest: logits, backward, optimizer step")]
        if p.buckets:
            rows.insert(3, ("DDP gradient buckets", p.buckets, "a copy of the gradients per process"))
        lines = [f"{'component':<28}{'memory':>12}  note", "-" * 76]
        lines += [f"{name:<28}{size(v):>12}  {note}" for name, v, note in rows]
        lines += ["-" * 76,
                  f"{'step peak':<28}{size(self.step_peak):>12}  predicted at {b} × {n}, {p.setting.label}",
                  f"{'CUDA context + slack':<28}{size(CONTEXT):>12}  reserved before any tensor",
                  f"{'total':<28}{size(self.step_peak + CONTEXT):>12}  of {size(self.gpu_bytes)} ({self.gpu})",
                  "", f"{'setting':<44}{'largest micro-batch':>20}{'step peak there':>18}  (none: at 1)", "-" * 96]
        lines += [f"{s['setting']:<44}{s['micro_batch'] or 'none':>20}{size(s['step_peak']):>18}"
                  for s in self.settings]
        lines.append("")
        if self.fits:
            flags = " ".join(p.setting.flags())
            lines.append(f"recommendation: --batch-size {self.micro_batch_size} --grad-accum-steps "
                         f"{self.gradient_accumulation_steps} {flags} (effective batch {self.effective_batch_size})")
        lines.append(self.note)
        return "\n".join(lines)


def rank(setting: Setting) -> int:
    """Where ``setting`` stands in ``COST`` (the head's chunking costs nothing)."""
    return 4 if setting.lora else 2 * setting.offload + setting.checkpointing


def measuring_order(can_chunk: bool, can_checkpoint: bool) -> list[Setting]:
    """Every setting to weigh, in the order they can be measured on one model: checkpointing is only ever switched
    on, so the settings without it come first. Offloading keeps the chunked head when there is one."""
    heads = [False, True] if can_chunk else [False]
    out = [Setting(chunked_loss=h) for h in heads] + [Setting(chunked_loss=can_chunk, offload=True)]
    if can_checkpoint:
        out += [Setting(checkpointing=True, chunked_loss=h) for h in heads]
        out.append(Setting(checkpointing=True, chunked_loss=can_chunk, offload=True))
    return out


def switch(model, setting: Setting, enable_checkpointing: Optional[Callable]) -> None:
    """Put ``model`` in ``setting`` (checkpointing is only ever switched on: see ``measuring_order``)."""
    from finetune.loss_head import chunked_loss_enabled, disable_chunked_loss, enable_chunked_loss

    if setting.chunked_loss and not chunked_loss_enabled(model):
        enable_chunked_loss(model)
    elif not setting.chunked_loss and chunked_loss_enabled(model):
        disable_chunked_loss(model)
    if setting.checkpointing and not getattr(model, "_planned_checkpointing", False):
        enable_checkpointing(model)
        model._planned_checkpointing = True


def make_plan(model, batches: list, gpu: str, effective: int, training=None, loss_fn=None,
              enable_checkpointing: Optional[Callable] = None, sequence_length: Optional[int] = None,
              processes: int = 1, lora_model: Optional[Callable] = None, every_setting: bool = False) -> Plan:
    """Measure the settings until the cheapest that fits ``gpu`` is known; recommend it with its micro-batch.

    ``batches``: two micro-batches of different sizes (samples), same sequence length, on the model's device.
    ``training``: the recipe's TrainingConfig (optimizer, precision, whether the chunked head may be used).
    ``enable_checkpointing(model)``: switches checkpointing on (None: not available). ``lora_model()``: a fresh
    LoRA model of the recipe, tried only when nothing that trains every weight fits (None: not offered).
    ``every_setting``: measure them all (``Plan.predict`` then answers for any), not only until the pick is known.
    """
    from finetune.config import TrainingConfig
    from finetune.items import is_causal_lm
    from finetune.loss_head import unsupported_reason

    t = training or TrainingConfig()
    gpu_bytes = parse_gpu(gpu)
    budget = budget_for(gpu_bytes)
    per_process = effective // processes
    can_chunk = bool(is_causal_lm(model) and unsupported_reason(model) is None and (loss_fn is None or t.chunked_loss))
    fits = lambda p: p.largest_micro_batch(per_process, budget) > 0  # noqa: E731
    # with the chunked head available, the settings without it are measured only to show what it saves
    pick = lambda: min((p for p in profiles if fits(p) and p.setting.chunked_loss == can_chunk),  # noqa: E731
                       key=lambda p: rank(p.setting), default=None)
    order = measuring_order(can_chunk, enable_checkpointing is not None)
    profiles = []
    for i, setting in enumerate(order):
        chosen = pick()
        if chosen and not every_setting and all(rank(s) >= rank(chosen.setting) for s in order[i:]):
            break
        try:
            switch(model, setting, enable_checkpointing)
        except ConfigError:  # no checkpointing support after all
            break
        profiles.append(measure(model, batches, setting, t, loss_fn, processes, per_process))
        if setting.offload:
            base = next(p for p in profiles if p.setting == dataclasses.replace(setting, offload=False))
            profiles[-1].floor = without_saved(base)
    can_lora = lora_model is not None and not any("lora_" in name for name, _ in model.named_parameters())
    if pick() is None and can_lora:
        lora = lora_model().to(next(model.parameters()).device)
        setting = Setting(checkpointing=any(p.setting.checkpointing for p in profiles), chunked_loss=can_chunk,
                          lora=True)
        switch(lora, setting, enable_checkpointing)
        profiles.append(measure(lora, batches, setting, t, loss_fn, processes, per_process))
    return finish_plan(gpu, gpu_bytes, budget, effective, per_process, t, sequence_length, profiles, pick())


def finish_plan(gpu, gpu_bytes, budget, effective, per_process, t, sequence_length, profiles,
                chosen: Optional[Profile]) -> Plan:
    def at_largest(p: Profile) -> tuple[int, int]:
        b = p.largest_micro_batch(per_process, budget)
        return b, p.step_peak(b or 1, per_process // (b or 1))

    last = chosen or profiles[-1]
    b, peak = at_largest(last)
    s = last.setting
    return Plan(gpu=gpu, gpu_bytes=gpu_bytes, parameters=last.parameters, trainable_parameters=last.trainable,
                weights=last.weights, gradients=last.gradients, optimizer=last.optimizer_state,
                activations_per_sample=last.per_sample(last.saved)[1],
                activations_fixed=last.per_sample(last.saved)[0],
                sequence_length=sequence_length, precision=t.mixed_precision, effective_batch_size=effective,
                micro_batch_size=b, gradient_accumulation_steps=per_process // b if b else 0,
                gradient_checkpointing=s.checkpointing, chunked_loss=s.chunked_loss, activation_offloading=s.offload,
                lora=s.lora, step_peak=peak, fits=chosen is not None,
                note=explain(chosen, profiles, gpu_bytes, budget, per_process, effective),
                settings=[{"setting": p.setting.label, "micro_batch": at_largest(p)[0], "step_peak": at_largest(p)[1]}
                          for p in profiles], profiles=profiles)


def explain(chosen: Optional[Profile], profiles: list, gpu_bytes: int, budget: float, per_process: int,
            effective: int) -> str:
    """Why this recommendation: what the cheaper settings would have needed."""
    if gpu_bytes <= CONTEXT:
        return (f"does not fit: {gpu_bytes / GiB:.1f} GiB is no more than the {CONTEXT / GiB:.1f} GiB the CUDA "
                "context takes before any tensor")
    short = [f"{p.setting.label} needs {size(p.step_peak(1, per_process))} at 1 sample" for p in profiles
             if not p.largest_micro_batch(per_process, budget)]
    room = f"{size(budget)} for tensors"
    if chosen is None:
        fixed = min(p.weights + p.gradients + p.optimizer_state for p in profiles)
        hint = "use a shorter sequence, FSDP or DeepSpeed (accelerate_configs/), or a bigger card" if fixed < budget \
            else "weights, gradients and optimizer state alone do not fit: FSDP or DeepSpeed (accelerate_configs/)" \
            " or a bigger card"
        return f"does not fit ({room}): " + "; ".join(short) + f" — {hint}"
    b = chosen.largest_micro_batch(per_process, budget)
    label = chosen.setting.label
    why = f"why: {label} is the cheapest setting that fits ({room})" + "".join(f"; {x}" for x in short) \
        + ". Cost: " + "; ".join(f"{x}: {COST[x]}" for x in label.split(" + "))
    if b == per_process:
        return why + ". The whole window fits in one micro-batch: no accumulation needed"
    return why + f". {per_process // b} micro-batches of {b} take the same steps as one batch of {effective}"


# ---------------------------------------------------------------------------------------------------------------
# the command
def training_peak(job, t) -> tuple[int, object]:
    """(the most bytes allocated at any moment of ``loop.train(job, t)``, weights included; its TrainResult). With
    ``t.max_steps`` ≥ 2 that is the peak of a steady optimizer step (the optimizer's state exists from the first on),
    which is what ``finetune plan`` predicts. A model on the CPU that trains on a GPU comes to it inside the run."""
    from finetune import loop

    device = next(job.model.parameters()).device
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    held = 0 if device.type == "cuda" and next(job.model.parameters()).device.type != "cuda" else \
        sum(x.numel() * x.element_size() for x in list(job.model.parameters()) + list(job.model.buffers()))
    with PeakMeter(device) as meter:
        result = loop.train(job, t, print_banner=False)
    return held + meter.peak, result




def plan_recipe(cfg, gpu: str, processes: int = 1) -> Plan:
    import dataclasses

    from finetune.execute import build_job
    from finetune.modeling import enable_checkpointing
    from finetune.windows import resolve_accumulation

    parse_gpu(gpu)  # before building the model
    job = build_job(cfg)
    t = cfg.training
    effective = t.effective_batch_size or (t.batch_size * resolve_accumulation(t, processes) * processes)
    n_train = len(job.train_data)
    if effective > n_train:  # every window would be the whole set: a micro-batch above it is never used
        raise ConfigError(f"training.effective_batch_size: {effective} is larger than the {n_train} training "
                          f"samples; plan for at most {n_train} (one optimizer step per epoch)")
    batches, seq = longest_batches(job, sizes=(1, 2))
    lora = None
    if hasattr(cfg, "peft") and not cfg.peft.enabled:
        lora = lambda: build_job(dataclasses.replace(cfg, peft=dataclasses.replace(cfg.peft, enabled=True))).model  # noqa: E731
    return make_plan(job.model, batches, gpu, effective, t, job.loss_fn,
                     lambda m: enable_checkpointing(m, job.enable_checkpointing), seq, processes, lora)


def add_arguments(p) -> None:
    p.add_argument("--recipe", required=True, help="recipe name or YAML path")
    p.add_argument("--gpu", required=True, help="card memory: 8GiB, 24GB, or a name (t4, rtx4070, a100-40gb, …)")
    p.add_argument("--processes", type=int, default=1, help="processes (GPUs) sharing the effective batch")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def main(args) -> int:
    from finetune.config import load_recipe

    cfg = load_recipe(args.recipe, args.set)
    if args.processes < 1:
        raise ConfigError(f"--processes: got {args.processes}; must be >= 1")
    plan = plan_recipe(cfg, args.gpu, args.processes)
    if args.json:
        record = asdict(plan)
        record.pop("profiles")
        print(json.dumps(record))
    else:
        print(plan.table())
    return 0 if plan.fits else 1
