"""The planner's request and answer as records: a ``PlanRequest`` (the card, the effective batch and how processes
share it, the training settings, the levers to try) is answered by a ``Plan`` (the recommendation, and one
``SettingPlan`` per setting weighed), which prints ``finetune plan``'s table (``finetune.memory.plan`` fills them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from finetune.config import TrainingConfig
from finetune.memory.cards import parse_gpu
from finetune.memory.host import LEVELS
from finetune.memory.measure import GiB
from finetune.memory.sharded import PERSISTENCE_THRESHOLD, REDUCE_BUCKET, Layout
from finetune.memory.speed import Speed, Work
from finetune.memory.step import HEADROOM, Profile, Setting

CONTEXT = 0.6 * GiB   # CUDA context, cuBLAS workspaces and the allocator's slack, reserved before any tensor


def size(nbytes: float) -> str:
    """Bytes for people: GiB from 1 GiB up, MiB below."""
    return f"{nbytes / GiB:.2f} GiB" if abs(nbytes) >= GiB else f"{nbytes / 2**20:.1f} MiB"


def this_machine_memory() -> int:
    """Bytes of RAM this machine has (``--host-memory``'s default)."""
    import psutil  # lazy: only a plan asks

    return psutil.virtual_memory().total


def budget_for(gpu_bytes: float) -> float:
    """Bytes of tensors a card of ``gpu_bytes`` can hold: what the context leaves, less the headroom."""
    return (gpu_bytes - CONTEXT) * HEADROOM


@dataclass(frozen=True)
class Machine:
    """What a plan is for besides the recipe: the card (``cards.parse_gpu``), the host's memory (bytes, every
    process together; 0: this machine's RAM) and the host level forced (``--offload``: "" none, or a level of
    ``host.LEVELS``; None: the planner weighs each)."""

    gpu: str
    host_memory: int = 0
    offload: Optional[str] = None


def as_machine(gpu) -> Machine:
    """``gpu`` (a Machine, or the card alone) as a Machine."""
    return gpu if isinstance(gpu, Machine) else Machine(gpu)


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
    host_memory: int = 0           # bytes of host memory, every process together (0: this machine's RAM)
    offload: Optional[str] = None  # the host level forced (training.offload: "" none, or a level); None: any

    @property
    def host_bytes(self) -> int:
        return self.host_memory or this_machine_memory()

    @property
    def host_budget(self) -> float:
        """Host bytes one process's training state may take: its share of the host, less the headroom."""
        return self.host_bytes * HEADROOM / self.layout.processes

    def micro_batch_of(self, p: Profile) -> int:
        """The largest micro-batch of ``p`` that fits the card; 0 where none does, or where its host part exceeds the
        host."""
        return p.largest_micro_batch(self.per_process, self.budget) if p.host <= self.host_budget else 0

    @property
    def host_levels(self) -> tuple:
        """The host levels weighed, in order: none, then ``host.LEVELS``; only the forced one where one is."""
        return ("", *LEVELS) if self.offload is None else (self.offload,)

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
    host: int = 0   # bytes of host memory a process keeps for the training state (``memory.host``)

    def record(self) -> dict:
        return {"setting": self.setting.label, "micro_batch": self.micro_batch, "step_peak": self.step_peak,
                "measured": self.measured, "exact": self.exact, "host": self.host}


@dataclass(frozen=True)
class Plan:
    """The answer: the recommendation (its setting, micro-batch and accumulation, the parts of its step peak, why),
    the speed estimate, and every setting weighed (``settings``) with the profiles they were measured as."""

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
    host: int = 0                  # bytes of host memory a process keeps for the training state, recommended setting
    host_memory: int = 0           # bytes of host memory planned for, every process together
    settings: list = field(default_factory=list)   # every setting tried (SettingPlan), in the order tried
    profiles: list = field(default_factory=list, repr=False)

    def record(self) -> dict:
        """The plan as ``--json`` prints it: every field but the profiles, the setting as flat fields."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "setting":
                out.update(gradient_checkpointing=value.checkpointing, chunked_loss=value.chunked_loss,
                           activation_offloading=value.offload, offload=value.host or "none", lora=value.lora,
                           lever_optimizer=value.optimizer,
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
                  self.host_line(),
                  "", f"{'setting':<{w}}{'largest micro-batch':>20}{'step peak there':>18}{'host':>12}  (none: at 1)",
                  "-" * (w + 64)]
        lines += [f"{s.setting.label:<{w}}{s.micro_batch or 'none':>20}"
                  f"{size(s.step_peak) if s.measured else '> ' + size(s.step_peak):>18}{size(s.host):>12}"
                  f"{'' if s.measured else '  (' + unmeasured_why(s) + ': not measured)'}"
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

    def host_line(self) -> str:
        """What the recommendation keeps in host memory per process, of the host planned for."""
        where = f"of {size(self.host_memory)} host memory" + (f" for {self.processes} processes"
                                                               if self.processes > 1 else "")
        if not self.setting.host:
            return f"{'host memory':<28}{size(self.host):>12}  {where}: the training state stays on the card"
        return (f"{'host memory':<28}{size(self.host):>12}  {where}: {self.setting.host} offload (fp32 master, "
                "AdamW's moments, gradient buffers" + (", the weights" if self.setting.host == "parameters" else "")
                + "; memory.host)")

    def headroom_line(self) -> str:
        """What the card has left at the recommendation, and whether the effective batch caps its micro-batch."""
        per_process = self.effective_batch_size // self.processes
        line = f"{'headroom':<28}{size(self.headroom):>12}  left on the card at micro-batch {self.micro_batch_size}"
        if self.micro_batch_size == per_process:
            return line + (f"; capped at the effective batch ({per_process} a process): a larger micro-batch is "
                           "never used, the room stays free")
        return line + f"; micro-batch {next_divisor(self.micro_batch_size, per_process)} would not fit"


def unmeasured_why(s: SettingPlan) -> str:
    """Why a setting was priced from its fixed part alone."""
    return "its fixed part alone exceeds the card or the host" if s.setting.host else \
        "weights, gradients, optimizer state alone"


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
    if s.offload is not None:
        lines += offload_lines(s)
    if s.here_flops:
        lines += [f"  measured on {s.here}: {s.here_flops / 1e9:.4g} GFLOP/s in the planner's last micro-step "
                  f"(allocator recorded) = {s.here_tokens_per_second:.4g} tokens/s → {duration(s.here_seconds)}"]
    else:
        lines += ["  not timed on this machine: the planner's micro-steps allocated their tensors without computing "
                  "them (a model larger than this machine, --model-config)"]
    return lines


def offload_lines(s: Speed) -> list[str]:
    """The host level's price per optimizer step (``host.OffloadTime``), included in the run's times, and the step
    on the card with it."""
    o = s.offload
    link = (f"{o.link_bytes / 1e9:.3g} GB over {o.link} ({o.link_rate / 1e9:.3g} GB/s each way) = "
            f"{o.link_seconds:.3g} s" if o.link_rate else
            f"{o.link_bytes / 1e9:.3g} GB over the host link (no link at hand for this card: not timed)")
    return [f"  {o.level} offload, each optimizer step: {link}; the host's AdamW step {o.host_seconds:.3g} s "
            f"({o.timed}) → +{o.seconds:.3g} s a step, {o.steps:,} steps → +{duration(o.steps * o.seconds)} "
            "(not overlapped with the card's work: an upper bound)"] + ([
        f"  time per optimizer step on {s.card}: {compute:.3g} s computing + {o.seconds:.3g} s offload = "
        f"{compute + o.seconds:.3g} s"] if (compute := step_compute(s)) else [])


def step_compute(s: Speed) -> float:
    """Seconds one optimizer step computes on the card (0: no estimate there)."""
    steps = s.offload.steps if s.offload else 0
    return s.run_tokens / steps / s.tokens_per_second if steps and s.tokens_per_second else 0.0


def fixed_rows(p: Profile, layout: Layout) -> list:
    """The table's rows for what one process holds besides a micro-batch's own: weights, gradients, optimizer state,
    and the layout's buckets and gathered weights, each saying how ``layout`` divides it (``memory.sharded``)."""
    if p.setting.host:
        return offloaded_rows(p, layout.processes)
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


def offloaded_rows(p: Profile, n: int) -> list:
    """``fixed_rows`` under a host level (``memory.host``): what stays on the card."""
    on_host = f"on the host ({p.setting.host} offload)"
    weights = f"{p.parameters / 1e6:.2f} M parameters" if p.setting.host == "optimizer" else \
        f"those of ≤ {PERSISTENCE_THRESHOLD:,} elements; the rest on the host"
    rows = [("weights", p.weights, weights),
            ("gradients", p.gradients, f"{p.trainable / 1e6:.2f} M trainable, {on_host}"),
            ("optimizer state", p.optimizer_state, f"{on_host}, AdamW steps there"),
            ("DeepSpeed buffers", p.buckets, f"reduce bucket ({REDUCE_BUCKET:,} elements)"
             + (" + a gradient buffer of the largest parameter" if p.setting.host == "optimizer" else ""))]
    if p.gathered:
        rows.append(("gathered weights", p.gathered, "whole layers streamed in for forward and backward"))
    return rows
