"""Plans for models larger than the machine that plans: ``finetune plan --model-config SOURCE``.

SOURCE is a folder holding a ``config.json`` or a hub id; the full model is never built. The recipe runs with a
stand-in for its model (``finetune.models.hf.stand_in``): its own data, tokenizer, loss and settings.

* The fixed part — weights, gradients, optimizer state — comes from a meta-device build of the whole model, counted
  per dtype, quantization and optimizer (``finetune.memory.fixed``): exact, and free.
* What a micro-step adds — saved activations, the loss head, backward's temporaries — is measured as
  ``finetune.memory.step`` measures it, on a depth-reduced copy: ``DEPTHS[-1]`` blocks at the real width,
  vocabulary and sequence length, then on its first ``DEPTHS[0]`` blocks. The copy is built and run under
  ``finetune.memory.allocations.AllocationsOnly``: every tensor is allocated and freed as in a real step, and the
  matrix products, casts and quantization are not computed (an 8 B model's micro-step takes a second, and its
  untouched weights take no room here). Where every block is shown
  the same (``unlike_blocks``: the same submodules, settings and tensors, and one value in each per-block list of the
  config), what one more block adds is the difference over the blocks between them, and the full depth's micro-step
  is the deeper measurement plus that much per block left. Blocks that differ (sliding and full attention in turn,
  say) are all built and measured: nothing is carried on.

A lever whose fixed part alone exceeds the card is not built at all: it is priced from that part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Optional

import torch

from finetune.config import PretrainedModelConfig
from finetune.errors import ConfigError
from finetune.memory import host, sharded, speed
from finetune.memory.allocations import AllocationsOnly
from finetune.memory.cards import parse_gpu
from finetune.memory.fixed import fixed_part
from finetune.memory.plan import (
    PlanRequest,
    Pricing,
    Subject,
    checkpointing_of,
    plan_subjects,
    plannable,
    planned_window,
    rebuilder,
    recipe_levers,
    with_lever,
)
from finetune.memory.records import as_machine
from finetune.memory.sharded import Layout
from finetune.memory.step import Profile, Setting, at_size, longest_batches
from finetune.models.hf import from_pretrained, stand_in, unquantized_modules

DEPTHS = (1, 2)  # blocks measured: 2 of Llama-3.1-8B's width with its vocabulary hold 3 GB in bf16


def load_architecture(source: str):
    """The transformers config of ``source`` (a folder with config.json, or a hub id), with its depth."""
    from transformers import AutoConfig  # lazy: 0.7 s on every command; only --model-config reads one

    config = from_pretrained(AutoConfig, source, "--model-config")
    if not isinstance(getattr(config, "num_hidden_layers", None), int):
        raise ConfigError(f"--model-config: {source} has no num_hidden_layers; the planner extrapolates per block "
                          "of a transformer")
    return config


class Extrapolated:
    """A planning subject (``finetune.memory.plan.Subject``) for ``cfg`` whose model is ``config``'s architecture,
    priced as ``pricing`` says."""

    def __init__(self, cfg, config, batches: list, pricing: Pricing, build, meta=None):
        """``build(cfg)``: the recipe's job (start-up's, given by the command); ``meta``: ``cfg``'s model already
        built on the meta device (else built here)."""
        self.cfg, self.config, self.batches, self.build = cfg, config, batches, build
        self.pricing = pricing
        self.depth = config.num_hidden_layers
        if meta is None:
            with stand_in(config, meta=True):
                meta = build(cfg).model
        self.weights, self.gradients, self.optimizer_state = planned_fixed_part(meta, cfg)
        self.sizes = sharded.sizes_of(meta)
        self.parameters = sum(p.numel() for p in meta.parameters())
        self.trainable = sum(p.numel() for p in meta.parameters() if p.requires_grad)
        self.multiplying = speed.multiplying(meta)
        one = self.unmeasured(Setting())
        self.fixed = one.weights + one.gradients + one.optimizer_state  # what one process holds
        self.can_chunk = Subject(meta, batches, cfg.training).can_chunk
        self.can_checkpoint = True
        # blocks priced one from another only where they are shown alike; else every block is built and measured
        self.unlike = unlike_blocks(meta, config)
        self.built_depth = self.depth if self.unlike else min(DEPTHS[-1], self.depth)
        self._measured: Optional[object] = None
        self._carried: dict = {}  # each setting's extrapolated Profile, by setting without host level

    def copy(self):
        """The copy measured, built on first use: the recipe's model with ``built_depth`` blocks, allocated and never
        written."""
        if self._measured is None:
            if self.unlike:
                check_room_for_every_block(self.unlike, self.weights)
            with stand_in(self.config, layers=self.built_depth, unwritten=True), AllocationsOnly():
                job = self.build(self.cfg)
            # measured as one process holding everything: ``with_fixed`` spreads the full model over the layout
            self._measured = Subject(job.model, self.batches, self.cfg.training, job.loss_fn, checkpointing_of(job),
                                     Pricing(Layout(), self.pricing.per_process))
        return self._measured

    def measure(self, setting: Setting) -> Optional[Profile]:
        key = dataclasses.replace(setting, host="")  # a host level moves the fixed part only: measured once
        if key not in self._carried:
            self._carried[key] = self.measure_whole(key)
        carried = self._carried[key]
        return None if carried is None else self.with_fixed(dataclasses.replace(carried, setting=setting))

    def measure_whole(self, setting: Setting) -> Optional[Profile]:
        """``setting``'s micro-steps at full depth, one process holding everything (its fixed part: the copy's)."""
        subject = self.copy()
        with AllocationsOnly():
            deep = subject.measure_whole(setting)
            if deep is None or self.built_depth == self.depth:  # measured at full depth
                return deep
            with first_blocks(subject.model, DEPTHS[0]):
                shallow = subject.measure_whole(setting)
        return extrapolate(shallow, deep, DEPTHS[0], DEPTHS[-1], self.depth)

    def with_fixed(self, profile: Profile) -> Profile:
        """``profile`` (one process holding everything) with the full model's exact fixed part, as one process of
        the layout holds it (on the card, and in host memory under its setting's host level)."""
        profile.weights, profile.gradients, profile.optimizer_state = \
            self.weights, self.gradients, self.optimizer_state
        profile.parameters, profile.trainable = self.parameters, self.trainable
        profile.multiplying = self.multiplying
        profile.here_flops = 0.0  # the copy's products were not computed: nothing was timed
        return host.price(profile, self.pricing.layout, self.sizes)

    def unmeasured(self, setting: Setting) -> Profile:
        """``setting`` priced from the fixed part alone (it already exceeds the card: nothing is measured)."""
        zero = [[1, 0], [2, 0]]
        return self.with_fixed(Profile(setting=setting, parameters=0, trainable=0, weights=0, gradients=0,
                                       optimizer_state=0, optimizer_step=self.optimizer_state, buckets=0,
                                       saved=zero, first=zero, later=zero, measured=False))


def check_vocabulary(config, tokenizer, source: str) -> None:
    """ConfigError when the recipe's tokenizer makes ids that ``config``'s embedding has no row for."""
    vocabulary = getattr(config, "vocab_size", None)
    if tokenizer is not None and isinstance(vocabulary, int) and len(tokenizer) > vocabulary:
        raise ConfigError(f"--model-config: {source} has vocab_size {vocabulary}, and the recipe's tokenizer makes "
                          f"ids up to {len(tokenizer) - 1}; give a config whose vocabulary holds them")


def check_room_for_every_block(why: str, weights: int) -> None:
    """ConfigError when a model whose blocks differ (``why``) is too large to build whole on this machine."""
    import psutil  # lazy: only a plan whose blocks differ asks

    free = psutil.virtual_memory().available
    if weights > free:
        raise ConfigError(f"--model-config: {why}, so every block is measured, and its {weights / 2**30:.1f} GiB of "
                          f"weights exceed the {free / 2**30:.1f} GiB free here; plan it on a larger machine")


def planned_fixed_part(meta_model, cfg) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) of training the meta-built ``meta_model`` as ``cfg`` says."""
    m, t = cfg.model, cfg.training
    quantization = m.quantization if isinstance(m, PretrainedModelConfig) else "none"
    return fixed_part(meta_model, quantization, unquantized_modules(cfg), t.optimizer, t.momentum)


def extrapolate(shallow: Profile, deep: Profile, k1: int, k2: int, depth: int) -> Profile:
    """``deep`` (measured with ``k2`` blocks) carried on to ``depth`` blocks at what each block added over
    ``shallow`` (``k1`` blocks), at ``deep``'s micro-batch sizes."""
    per_block = (depth - k2) / (k2 - k1)

    def carry(mode: str) -> list:
        return [[b, max(int(v + per_block * (v - at_size(getattr(shallow, mode), b))), 0)]
                for b, v in getattr(deep, mode)]

    out = Profile(**{**vars(deep), "saved": carry("saved"), "first": carry("first"), "later": carry("later")})
    out.optimizer_step = int(deep.optimizer_step + per_block * (deep.optimizer_step - shallow.optimizer_step))
    return out


def block_signature(block: torch.nn.Module) -> tuple:
    """What sets a block's memory: each submodule's type and scalar settings (its position, ``layer_idx``, left
    out), each tensor's name, shape, dtype and whether it trains."""
    def settings(module):
        return tuple(sorted((k, repr(v)) for k, v in vars(module).items()
                            if not k.startswith("_") and k != "layer_idx"
                            and isinstance(v, (int, float, str, bool, type(None)))))

    return (tuple((name, type(m).__name__, settings(m)) for name, m in block.named_modules()),
            tuple((name, tuple(t.shape), t.dtype, t.requires_grad)
                  for name, t in [*block.named_parameters(), *block.named_buffers()]))


def unlike_blocks(model: torch.nn.Module, config) -> Optional[str]:
    """Why ``model``'s blocks may not be priced one from another (None: they are alike — the same submodules,
    settings and tensors, and every per-block list of ``config`` holds one value): the first difference found."""
    depth = config.num_hidden_layers
    for key, value in vars(config).items():
        if isinstance(value, list) and len(value) == depth and any(v != value[0] for v in value):
            return f"config.{key} differs between blocks ({value[0]!r}, …)"
    holder, name = block_list(model, depth)
    blocks = list(getattr(holder, name))
    first = block_signature(blocks[0])
    return next((f"block {i} differs from block 0 ({type(block).__name__})"
                 for i, block in enumerate(blocks[1:], 1) if block_signature(block) != first), None)


def block_list(model: torch.nn.Module, depth: int) -> tuple[torch.nn.Module, str]:
    """(the module holding it, its attribute name) of the ModuleList of ``model``'s ``depth`` blocks."""
    for module in model.modules():
        for name, child in module.named_children():
            if isinstance(child, torch.nn.ModuleList) and len(child) == depth:
                return module, name
    raise ConfigError(f"--model-config: found no list of {depth} blocks in {type(model).__name__}")


@contextlib.contextmanager
def first_blocks(model: torch.nn.Module, k: int):
    """``model`` running only its first ``k`` blocks inside (config.num_hidden_layers follows), whole again after."""
    config = model.config
    depth = config.num_hidden_layers
    holder, name = block_list(model, depth)
    blocks = getattr(holder, name)
    setattr(holder, name, torch.nn.ModuleList(list(blocks)[:k]))
    config.num_hidden_layers = k
    try:
        yield model
    finally:
        setattr(holder, name, blocks)
        config.num_hidden_layers = depth


def plan_from_config(cfg, source: str, gpu: str, layout: Layout, build, effective: int):
    """``finetune plan`` for ``cfg`` with its model replaced by ``source``'s architecture (never built whole), per
    process of ``layout``. ``build(cfg)``: the recipe's job (start-up's, given by the command); ``effective``: the
    batch planned for; ``gpu``: the card, or a ``records.Machine`` (the card, the host)."""
    machine = as_machine(gpu)
    parse_gpu(machine.gpu)
    config = load_architecture(source)
    with stand_in(config, meta=True):  # the recipe's data, tokenizer and collation; its model on the meta device
        job = build(cfg)
    plannable(job)
    check_vocabulary(config, job.tokenizer, source)
    planned_window(effective, job)
    batches, seq = longest_batches(job, sizes=(1, 2))
    pricing = Pricing(layout, effective // layout.processes)
    remake = rebuilder(job, build)  # every later build: the model alone, the data built once
    unlike = unlike_blocks(job.model, config)
    if unlike:
        print(f"plan: {unlike}: every block measured, none carried on from another", file=sys.stderr, flush=True)
    levers = tuple((lever, lambda lever=lever: Extrapolated(with_lever(cfg, lever), config, batches, pricing, remake))
                   for lever in recipe_levers(cfg))
    request = PlanRequest(machine.gpu, effective, cfg.training, layout, seq, levers,
                          work=speed.work_of(job, cfg.training, effective, job.model),
                          host_memory=machine.host_memory, offload=machine.offload)
    return plan_subjects(Extrapolated(cfg, config, batches, pricing, remake, job.model), request)
