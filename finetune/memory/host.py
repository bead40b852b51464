"""What ``training.offload`` keeps in host memory and on the card, per process: DeepSpeed 0.19's ZeRO offload as
finetune runs it (``optimizer``: ZeRO-2 with ``offload_optimizer: cpu``; ``parameters``: ZeRO-3 with
``offload_param`` and ``offload_optimizer: cpu``), read from DeepSpeed's own allocations
(``deepspeed/runtime/zero/stage_1_and_2.py``, ``stage3.py``), with P_t the trainable elements, e their dtype's
bytes (4 in fp32 training), S the optimizer's state (AdamW: two fp32 moments, ``finetune.optimizers``), W the bytes
of every weight and N the processes, each partition ÷ N:

* ``optimizer`` — host: the fp32 master partition (4·P_t), its fp32 gradient (4·P_t), S, the staging copy the
  updated weights go back through (``param_buffer_of_bit16_for_cpu_offload_groups``, e·P_t), the gradients
  accumulated across micro-batches (``accumulated_grads_in_cpu``, e·P_t), all ÷ N, and one pinned buffer of the
  largest trainable parameter (``temp_grad_buffer_for_cpu_offload``, whole). Card: the weights whole, the reduce
  bucket, one gradient buffer of the largest parameter (``temp_grad_buffer_for_gpu_offload``) and the micro-batch's
  activations — no gradients (each leaves for the bucket as backward makes it), no optimizer state, no optimizer
  step.
* ``parameters`` — host: W ÷ N (``param_groups_fp16_flat_cpu_memory``), the fp32 master partition, the partition
  gradients accumulated (``grad_partitions_flat_buffer``, fp32), the optimizer's fp32 gradient buffer, S, all ÷ N.
  Card: the parameters DeepSpeed keeps whole (≤ ``stage3_param_persistence_threshold`` elements), the layers
  gathered for forward and backward (``sharded.gathered_bytes``), the reduce bucket and the activations.

Left out: the process's own memory (torch, the data, the model as loaded before DeepSpeed partitions it: freed once
it is), and nvme's swap buffers. The accumulation buffer is counted even for a window of one micro-batch (DeepSpeed
then skips it): a plan is on the safe side by e·P_t ÷ N.

DeepSpeed's estimators (``estimate_zero2_model_states_mem_needs_all_live``, ``…zero3…``) count 16 B a parameter
(ZeRO-2) and 18 B (ZeRO-3) times an ``additional_buffer_factor`` of 1.5 by default; in fp32 training the
allocations above come to 24 B a parameter and 24 B, which is the factor 1.5 (``tests/test_offload_plan.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

from finetune.config import OFFLOAD_STAGES
from finetune.errors import ConfigError
from finetune.memory import sharded
from finetune.memory.fixed import optimizer_state_bytes, planned_weight_bytes
from finetune.memory.sharded import Layout, Sizes
from finetune.memory.step import Profile

LEVELS = tuple(OFFLOAD_STAGES)                      # training.offload, beside none
STAGE = OFFLOAD_STAGES                              # the ZeRO stage each level runs as
MASTER, GRADIENT = 4, 4                             # fp32 master weights and fp32 gradient partitions, bytes each
TIMED_ELEMENTS = 2 ** 22                            # the slice the host optimizer step is timed over


@dataclass(frozen=True)
class Counts:
    """What the host formula reads of a model (the module's docstring)."""

    weights: int     # W: bytes of every weight
    trainable: int   # P_t: elements that train
    element: int     # e: bytes of one trainable element
    state: int       # S: bytes of the optimizer's state
    largest: int     # elements of the largest trainable parameter


def parse_level(value: str) -> str:
    """``--offload`` / training.offload: none or a level of ``LEVELS`` ("" for none)."""
    if value in ("", "none"):
        return ""
    if value not in LEVELS:
        raise ConfigError(f"--offload: got {value!r}; one of none, {', '.join(LEVELS)}")
    return value


def host_per_process(c: Counts, level: str, processes: int) -> int:
    """Bytes one of ``processes`` keeps in host memory under ``level`` (the module's docstring); 0 without one."""
    n = processes
    if level == "optimizer":
        return ((MASTER + GRADIENT + 2 * c.element) * c.trainable + c.state) // n + c.largest * c.element
    if level == "parameters":
        return (c.weights + (MASTER + 2 * GRADIENT) * c.trainable + c.state) // n
    return 0


def host_bytes(model, level: str, optimizer_name: str, processes: int) -> int:
    """Bytes of host memory one of ``processes`` needs for ``model``'s training state under ``level`` (optimizer /
    parameters; none: 0), with ``optimizer_name`` (training.optimizer) keeping its state there. Reads the
    parameters' shapes and dtypes only: a meta-device build works, nothing is allocated.

    Example: ``host_bytes(model, "optimizer", "adamw", 1) > psutil.virtual_memory().total`` → refuse the run.
    """
    trainable = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
    numels = [p.numel() for p in trainable]
    counts = Counts(weights=planned_weight_bytes(model), trainable=sum(numels),
                    element=trainable[0].element_size() if trainable else 4,
                    state=optimizer_state_bytes(numels, optimizer_name), largest=max(numels, default=0))
    return host_per_process(counts, parse_level(level), processes)


def counts_of(whole: Profile, sizes: Sizes) -> Counts:
    """``Counts`` of a Profile measured with one process holding everything."""
    return Counts(weights=whole.weights, trainable=whole.trainable,
                  element=whole.gradients // max(whole.trainable, 1), state=whole.optimizer_state,
                  largest=sizes.largest_trainable)


def price(whole: Profile, layout: Layout, sizes: Sizes = Sizes()) -> Profile:
    """``whole`` (one process holding everything) as the busiest of ``layout.processes`` holds it: on the card
    and, under its setting's host level, in host memory (``Profile.host``). Without a level:
    ``sharded.per_process``; with one, the level's ZeRO stage whatever ``layout`` says."""
    level = whole.setting.host
    if not level:
        return sharded.per_process(whole, layout, sizes)
    n = layout.processes
    shared = sharded.per_process(whole, Layout(n, STAGE[level]), sizes)
    c = counts_of(whole, sizes)
    # No gradient stays on the card: DeepSpeed's hooks copy each one into its bucket as backward makes it, and on
    # to the host. So a window's first micro-step peaks as a later one does with the gradients already held (what
    # ``later`` measures above them: activations, the head, one parameter's gradient at a time), not with every
    # gradient made anew on top.
    card = dict(gradients=0, optimizer_state=0, optimizer_step=0, first=whole.later,
                host=host_per_process(c, level, n), counts=c)
    if level == "optimizer":
        card.update(buckets=shared.buckets + c.largest * c.element)
    else:
        card.update(weights=sizes.kept_whole)
    return dataclasses.replace(shared, **card)


# ---------------------------------------------------------------------------------------------------------------
# time: the host link and the host's optimizer step


def link_bytes(c: Counts, level: str, processes: int, micro_batches: int) -> int:
    """Bytes one process moves over its card's host link in an optimizer step of ``micro_batches``: each
    micro-batch's gradient partition down (and, accumulating, the running sum back up for every micro-batch after
    the first: ``async_accumulate_grad_in_cpu_via_gpu``) and the updated weights up once (``optimizer``); the
    gradient partitions down and the weights' partition up in every micro-batch's forward and again in its backward
    (``parameters``: the updated weights stay on the host)."""
    n, grads = processes, c.element * c.trainable // processes
    if level == "optimizer":
        return micro_batches * grads + (micro_batches - 1) * grads + grads
    if level == "parameters":
        return micro_batches * (grads + 2 * c.weights // n)
    return 0


@functools.lru_cache(maxsize=1)
def host_step_per_element() -> tuple[float, str]:
    """(seconds an AdamW step takes per fp32 element on this machine, what was timed): torch's fused AdamW, the
    optimizer an offloaded run steps on the host (``finetune.offload``), over ``TIMED_ELEMENTS``, the best of three
    steps after one warm-up. Quick (well under a second); timed once a process."""
    import torch

    weights = torch.zeros(TIMED_ELEMENTS, requires_grad=True)
    weights.grad = torch.full_like(weights, 1e-3)
    optimizer = torch.optim.AdamW([weights], fused=True)
    optimizer.step()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        optimizer.step()
        best = min(best, time.perf_counter() - start)
    return best / TIMED_ELEMENTS, "torch's fused AdamW on this CPU"


@dataclass(frozen=True)
class OffloadTime:
    """What a host level adds to each optimizer step: the link's traffic and the host's AdamW step."""

    level: str
    link_bytes: int         # one process's, each optimizer step (``link_bytes``)
    link_rate: float        # bytes a second each way on the card's host link (0: none at hand)
    link: str               # the card's link ("PCIe 4.0 x16"; "" none at hand)
    host_seconds: float     # the host's AdamW step over every trainable element (the processes share its cores)
    timed: str              # what was timed for it, and where
    steps: int              # optimizer steps of the run

    @property
    def link_seconds(self) -> float:
        return self.link_bytes / self.link_rate if self.link_rate else 0.0

    @property
    def seconds(self) -> float:
        """Added to each optimizer step: the link's time and the host step, not overlapped (an upper bound)."""
        return self.link_seconds + self.host_seconds


def offload_time(p: Profile, processes: int, micro_batches: int, card, steps: int) -> OffloadTime:
    """The ``OffloadTime`` of ``p`` (priced at its host level by ``price``) on ``card`` (a ``cards.Card``, or None),
    in a run of ``steps`` optimizer steps of ``micro_batches`` each."""
    per_element, what = host_step_per_element()
    c = p.counts
    return OffloadTime(level=p.setting.host, link_bytes=link_bytes(c, p.setting.host, processes, micro_batches),
                       link_rate=card.link_bytes_per_second() if card else 0.0,
                       link=f"PCIe {card.link}" if card and card.link else "", host_seconds=per_element * c.trainable,
                       timed=f"{what}, {TIMED_ELEMENTS:,} fp32 elements timed here and scaled", steps=steps)
