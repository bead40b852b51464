"""What one process holds when several train together: DDP, or DeepSpeed ZeRO stage 1, 2 or 3.

``finetune plan --processes N --zero-stage S`` measures one process holding everything
(``finetune.memory.step.Profile``) and turns it into what the busiest of the N holds (``per_process``).
Measured on DeepSpeed 0.19.8 in fp32 training (``tests/test_zero_memory.py``), with the DeepSpeed defaults that
finetune's accelerate configs keep (they set no bucket or threshold):

* DDP (stage 0): everything, plus DDP's gradient buckets (a copy of the gradients);
* ZeRO-1: the optimizer's state over N, plus an fp32 copy of this process's share of the trainable weights
  (``single_partition_of_fp32_groups``: a clone even when the model is fp32); whole weights and — until the window's
  last backward reduces them — whole gradients;
* ZeRO-2: the gradients over N as well, but the whole gradient of each parameter its share touches
  (``gradient_bytes``);
* ZeRO-3: the parameters over N as well, except those of at most ``PERSISTENCE_THRESHOLD`` elements, which every
  process also keeps whole; forward and backward gather whole parameters (``gathered_bytes``);
* ZeRO 1-3: DeepSpeed's reduce bucket, ``REDUCE_BUCKET`` gradient elements whatever the model's size (ZeRO-1/2
  allocate it in backward, ZeRO-3 holds it from the start).

Left out, each small against the rest (their measured sizes: docs/memory.md): alignment padding (shares are padded
to a multiple of 2N elements per parameter group), one step counter per group instead of per tensor, buffers
(ZeRO-3 keeps them whole).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from finetune.errors import ConfigError
from finetune.memory.step import Profile

# what each stage partitions over the processes, by ``--zero-stage``
ZERO_STAGES = {0: "DDP: every process holds everything",
               1: "DeepSpeed ZeRO-1: optimizer state partitioned",
               2: "DeepSpeed ZeRO-2: optimizer state and gradients partitioned",
               3: "DeepSpeed ZeRO-3: optimizer state, gradients and parameters partitioned"}

# DeepSpeed 0.19's defaults (zero_optimization), which finetune's accelerate configs do not change
REDUCE_BUCKET = 500_000_000           # reduce_bucket_size, gradient elements: allocated whole, 2 GB in fp32
PERSISTENCE_THRESHOLD = 100_000       # stage3_param_persistence_threshold: parameters this small are kept whole
MAX_LIVE_PARAMETERS = 1_000_000_000   # stage3_max_live_parameters: the most elements gathered at once


@dataclass(frozen=True)
class Layout:
    """How a run spreads over processes: ``processes`` (N) and the ZeRO stage (0: DDP, or one process)."""

    processes: int = 1
    zero_stage: int = 0

    def describe(self) -> str:
        """One line for the plan: which layout its per-process numbers are for."""
        if self.processes == 1 and self.zero_stage == 0:
            return "1 process"
        return f"{self.processes} process{'es' if self.processes > 1 else ''}, {ZERO_STAGES[self.zero_stage]}"


def parse_zero_stage(value) -> int:
    """``--zero-stage``: one of ``ZERO_STAGES``, else ConfigError naming them."""
    allowed = ", ".join(f"{stage} ({text.split(':')[0]})" for stage, text in ZERO_STAGES.items())
    try:
        stage = int(str(value).strip())
    except ValueError:
        stage = None
    if stage not in ZERO_STAGES:
        raise ConfigError(f"--zero-stage: got {value!r}; one of {allowed}")
    return stage


@dataclass(frozen=True)
class Sizes:
    """What ``per_process`` needs to know of a model's tensors beyond its totals (``sizes_of``)."""

    kept_whole: int = 0         # bytes of the parameters ZeRO-3 keeps whole: ≤ PERSISTENCE_THRESHOLD elements each
    largest_trainable: int = 0  # elements of the largest trainable parameter


def sizes_of(model) -> Sizes:
    """``Sizes`` of ``model`` (a meta-device build works); a parameter shared by two modules counts once."""
    params = list({id(p): p for p in model.parameters()}.values())
    return Sizes(kept_whole=sum(p.numel() * p.element_size() for p in params if p.numel() <= PERSISTENCE_THRESHOLD),
                 largest_trainable=max((p.numel() for p in params if p.requires_grad), default=0))


def per_process(profile: Profile, layout: Layout, sizes: Sizes = Sizes()) -> Profile:
    """``profile`` (measured with one process holding everything) as the busiest of ``layout.processes`` holds
    it. See the module's docstring for what each stage holds."""
    n, stage = layout.processes, layout.zero_stage
    if stage == 0:
        return dataclasses.replace(profile, buckets=profile.gradients if n > 1 else 0, gathered=0)
    grad_bytes = profile.gradients // max(profile.trainable, 1)  # per element: the planner trains in fp32
    master = profile.gradients // n  # the fp32 copy of this process's partition of the trainable weights
    return dataclasses.replace(
        profile, weights=profile.weights // n + sizes.kept_whole if stage == 3 else profile.weights,
        gradients=gradient_bytes(profile.gradients, stage, n, sizes.largest_trainable * grad_bytes),
        optimizer_state=profile.optimizer_state // n + master,
        optimizer_step=profile.optimizer_step // n + master,  # AdamW steps on the partition only
        buckets=REDUCE_BUCKET * grad_bytes, gathered=gathered_bytes(profile, stage, sizes))


def gradient_bytes(gradients: int, stage: int, n: int, largest: int) -> int:
    """Gradient bytes the busiest process holds (``largest``: bytes of the largest trainable parameter's gradient).
    ZeRO-1 holds them whole until the window's last backward. ZeRO-2
    splits them at fixed offsets of all trainable weights laid end to end, but keeps the whole gradient of every
    parameter its share touches: one that crosses the share's edge is held whole by both neighbours (at most two
    edges a process, one with two processes). ZeRO-3 splits every parameter itself."""
    if stage == 1:
        return gradients
    if stage == 2:
        return min(gradients, gradients // n + min(2, n - 1) * largest)
    return gradients // n


def gathered_bytes(profile: Profile, stage: int, sizes: Sizes) -> int:
    """ZeRO-3's whole parameters in forward and backward: every one it partitions (DeepSpeed keeps them gathered
    from forward to backward while fewer than its limits), at most ``MAX_LIVE_PARAMETERS`` elements."""
    if stage < 3:
        return 0
    per_element = profile.weights / max(profile.parameters, 1)
    return max(int(min(profile.weights - sizes.kept_whole, MAX_LIVE_PARAMETERS * per_element)), 0)
