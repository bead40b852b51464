"""``finetune plan --recipe R --gpu 8GiB``: will the baseline fit on my card, and with what micro-batch?

It builds the recipe's model on this machine, counts parameters, gradients and optimizer state, and runs real
micro-batches forward and backward to measure the activations saved for backward per sample (unique storages,
parameters excluded) with and without checkpointing, under the recipe's precision. Then it picks the largest
micro-batch that fits and divides the effective batch, and N for that effective batch.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from finetune.errors import ConfigError
from finetune.memory import GiB, activation_bytes

# memory of common cards (bytes); "8GiB" / "12GB" / "24" also work
GPUS = {
    "t4": 16, "v100": 16, "v100-32gb": 32, "p100": 16, "rtx2080ti": 11, "rtx3060": 12, "rtx3070": 8, "rtx3080": 10,
    "rtx3090": 24, "rtx4060": 8, "rtx4070": 12, "rtx4070-laptop": 8, "rtx4080": 16, "rtx4090": 24, "a10": 24,
    "a10g": 24, "l4": 24, "l40s": 48, "a100-40gb": 40, "a100-80gb": 80, "a100": 80, "h100": 80, "h100-80gb": 80,
}
CONTEXT = 0.6 * GiB   # CUDA context, cuBLAS workspaces and the allocator's slack, reserved before any tensor
HEADROOM = 0.9        # plan to use at most 90 % of what is left (fragmentation)


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


# ---------------------------------------------------------------------------------------------------------------
# the plan


@dataclass
class Plan:
    gpu: str
    gpu_bytes: int
    parameters: int
    trainable_parameters: int
    weights: int                   # bytes
    gradients: int
    optimizer: int
    activations_per_sample: int
    activations_per_sample_checkpointed: int
    activations_fixed: int
    sequence_length: Optional[int]
    precision: str
    effective_batch_size: int
    micro_batch_size: int          # 0: does not fit
    gradient_accumulation_steps: int
    gradient_checkpointing: bool
    fits: bool
    note: str

    def table(self) -> str:
        gib = lambda b: f"{b / GiB:8.2f} GiB"  # noqa: E731
        b = max(self.micro_batch_size, 1)
        act = self.activations_per_sample_checkpointed if self.gradient_checkpointing else self.activations_per_sample
        rows = [
            ("weights", self.weights, f"{self.parameters / 1e6:.1f} M parameters"),
            ("gradients", self.gradients, f"{self.trainable_parameters / 1e6:.1f} M trainable, fp32"),
            ("optimizer state", self.optimizer, ""),
            ("activations / sample", self.activations_per_sample,
             f"saved for backward at {self.sequence_length or '-'} tokens, {self.precision}"),
            ("  with checkpointing", self.activations_per_sample_checkpointed, ""),
            (f"activations × {b}", self.activations_fixed + act * b, "micro-batch"),
            ("CUDA context + slack", int(CONTEXT), "reserved before any tensor"),
        ]
        total = self.weights + self.gradients + self.optimizer + self.activations_fixed + act * b + int(CONTEXT)
        lines = [f"{'component':<24}{'memory':>12}  note", "-" * 72]
        lines += [f"{name:<24}{gib(v):>12}  {note}" for name, v, note in rows]
        lines += ["-" * 72, f"{'total':<24}{gib(total):>12}  of {gib(self.gpu_bytes).strip()} ({self.gpu})", ""]
        if self.fits:
            ck = ", gradient checkpointing on" if self.gradient_checkpointing else ""
            lines.append(f"recommendation: --batch-size {self.micro_batch_size} --grad-accum-steps "
                         f"{self.gradient_accumulation_steps} (effective batch {self.effective_batch_size}){ck}")
        lines.append(self.note)
        return "\n".join(lines)


def optimizer_bytes(trainable: int, optimizer: str, momentum: float = 0.0) -> int:
    """fp32 state: AdamW keeps two moments, Lion one, SGD one buffer only with momentum."""
    slots = {"adamw": 2, "lion": 1, "sgd": 1 if momentum else 0}[optimizer]
    return slots * trainable * 4


def make_plan(model, batches: list, gpu: str, effective: int, optimizer: str = "adamw", momentum: float = 0.0,
              precision: str = "no", loss_fn=None, enable_checkpointing=None, sequence_length=None,
              processes: int = 1) -> Plan:
    """Measure and recommend. ``batches``: two micro-batches of different sizes (samples), same sequence length."""
    gpu_bytes = parse_gpu(gpu)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    weights = sum(p.numel() * p.element_size() for p in params) + sum(b.numel() * b.element_size()
                                                                       for b in model.buffers())
    gradients = trainable * 4
    opt = optimizer_bytes(trainable, optimizer, momentum)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.bfloat16 if not torch.cuda.is_available() else torch.float16}.get(
        precision)  # fp16 and bf16 save the same 2-byte activations; on CPU bf16 stands in for fp16

    from finetune.items import batch_len

    (b1, x1), (b2, x2) = [(batch_len(b), b) for b in batches]
    a1, a2 = activation_bytes(model, x1, loss_fn, dtype), activation_bytes(model, x2, loss_fn, dtype)
    per_sample = max((a2 - a1) // max(b2 - b1, 1), 1)
    fixed = max(a1 - per_sample * b1, 0)
    per_sample_ck = per_sample
    if enable_checkpointing is not None:
        try:
            enable_checkpointing(model)
            c1, c2 = activation_bytes(model, x1, loss_fn, dtype), activation_bytes(model, x2, loss_fn, dtype)
            per_sample_ck = max((c2 - c1) // max(b2 - b1, 1), 1)
        except ConfigError:
            pass

    budget = (gpu_bytes - CONTEXT) * HEADROOM - weights - gradients - opt - fixed
    per_process = effective // processes
    divisors = [d for d in range(per_process, 0, -1) if per_process % d == 0]
    pick = lambda per: next((d for d in divisors if d * per <= budget), 0)  # noqa: E731
    b, ck = pick(per_sample), False
    if b == 0 and per_sample_ck < per_sample:
        b, ck = pick(per_sample_ck), True
    fits = b > 0
    if not fits and gpu_bytes <= CONTEXT:
        note = (f"does not fit: {gpu_bytes / GiB:.1f} GiB is no more than the {CONTEXT / GiB:.1f} GiB the CUDA context "
                "takes before any tensor")
    elif not fits and budget > 0:
        note = (f"does not fit: one sample's activations ({min(per_sample, per_sample_ck) / GiB:.2f} GiB, with "
                f"checkpointing if it helps) exceed the {budget / GiB:.2f} GiB left after weights, gradients and "
                "optimizer state — use a shorter sequence, LoRA (peft.enabled), or a bigger card")
    elif not fits:
        note = ("does not fit: weights + gradients + optimizer state alone take "
                f"{(weights + gradients + opt) / GiB:.1f} GiB — use LoRA (peft.enabled), FSDP or DeepSpeed "
                "(accelerate_configs/), or a bigger card")
    elif b == per_process:
        note = "the whole effective batch fits in one micro-batch: no accumulation needed"
    else:
        note = f"accumulating {per_process // b} micro-batches of {b} takes the same steps as one batch of {effective}"
    return Plan(gpu=gpu, gpu_bytes=gpu_bytes, parameters=n_params, trainable_parameters=trainable, weights=weights,
                gradients=gradients, optimizer=opt, activations_per_sample=per_sample,
                activations_per_sample_checkpointed=per_sample_ck, activations_fixed=fixed,
                sequence_length=sequence_length, precision=precision, effective_batch_size=effective,
                micro_batch_size=b, gradient_accumulation_steps=per_process // b if b else 0,
                gradient_checkpointing=ck, fits=fits, note=note)


def longest_batches(job, sizes=(1, 2)) -> tuple[list, Optional[int]]:
    """Two micro-batches made of the longest training samples (the worst case), and their sequence length."""
    n = len(job.train_data)
    order = sorted(range(n), key=job.length_of, reverse=True) if job.length_of else list(range(n))
    collate = job.collate_fn or torch.utils.data.default_collate
    batches = []
    for size in sizes:
        idx = order[:1] * size if job.length_of else order[:size]  # same length: repeat the longest sample
        batches.append(collate([job.train_data[i] for i in idx]))
    seq = job.length_of(order[0]) if job.length_of else None
    return batches, seq


def plan_recipe(cfg, gpu: str, processes: int = 1) -> Plan:
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
    batches, seq = longest_batches(job, sizes=(2, 4))
    return make_plan(job.model, batches, gpu, effective, t.optimizer, t.momentum, t.mixed_precision, job.loss_fn,
                     lambda m: enable_checkpointing(m, job.enable_checkpointing), seq, processes)


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
    print(json.dumps(asdict(plan)) if args.json else plan.table())
    return 0 if plan.fits else 1
