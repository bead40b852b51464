"""What the loop trains: a model, its data and the few functions that differ between tasks.

Task modules (``finetune/tasks/*``) build a :class:`Job`; the loop (``finetune/loop.py``) runs it. Tasks never import
the loop.
"""

from __future__ import annotations

import warnings
from dataclasses import InitVar, dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass
class Job:
    """Args:
        model: any ``nn.Module``; called as ``model(**batch)`` unless ``loss_fn`` is given.
        train_data / val_data: indexable datasets (torch Dataset, 🤗 ``datasets.Dataset``, list of dicts).
        collate_fn: list of samples → batch (default: torch's ``default_collate``).
        loss_fn: ``loss_fn(model, batch)`` → mean loss over the batch's items, or a dict with ``"loss"`` and other
            scalars to log (each averaged over the batch's items).
        count_items: batch → how many items its mean loss averages over (default: ``training.items``).
        eval_step: ``eval_step(model, batch, outputs)`` → (predictions, references) lists for ``compute_metrics``.
        compute_metrics: (predictions, references) → dict of metric values.
        enable_gradient_checkpointing: hook that turns on activation checkpointing for a custom model.
        save: hook ``save(model, directory)`` for the final model (default: save_pretrained or safetensors).
        length_of: sample index → length (tokens), for length-sorted micro-batches inside a window.
        param_groups: name → {"params": iterable, and TrainingConfig fields to override (learning_rate, betas,
            weight_decay, optimizer, max_grad_norm, …)}: one optimizer (and scheduler) each, all stepped at the end
            of every window — e.g. a generator and a discriminator. One loss drives them all: keep each
            parameter set's gradient out of the others' terms (detach / frozen copies).
        val_loss_metrics: validation loss → dict of metrics derived from it (perplexity = exp(loss)).
        summarize: ``summarize(model, run_dir)`` → dict added to metrics.json at the end (e.g. a generated sample);
            ``run_dir`` is the run's output directory (None through the Python API without ``output_dir``).
        before_window: called with the TrainState before each window (keys schedules such as a KL warm-up or an
            R1 interval on optimizer steps, so they are the same for any N).
        after_step: ``after_step(state, model)`` after every optimizer step and its evaluation, before its
            checkpoint (an EMA of the weights, a sample image every K steps); ``model`` is the unwrapped model.
        tokenizer: saved beside the model when it has ``save_pretrained``.
        checkpointed: objects with ``state_dict()`` (name → tensor) and ``load_state_dict`` whose state is saved
            in every checkpoint and restored on resume (e.g. reference log-probs computed once at set-up); a
            checkpoint without it is refused at start-up (``checkpoint.contents``, the registry it joins).
        stream_block: ``train_data`` is read a block of this many consecutive samples at a time (a stream,
            ``finetune.streaming``): it is shuffled in blocks (``windows.block_order``), and set-up reads no sample
            ahead of its window.
        windows_in_order: the task's samples must come in their own order, a window after the other (GRPO's slots
            of a generation batch): start-up refuses ``training.shuffle`` and sorting for it, in one line.
        model_for: ``model_for(variant)`` → the model the task builds for ``variant``, the job's recipe with other
            model, peft or training settings, trained by this job's ``loss_fn`` and hooks: ``finetune plan`` prices
            its levers and depth-reduced copies with it, without building the data again (None: it builds the whole
            job of each variant).
        unplannable: why ``finetune plan`` cannot measure this task's micro-steps before a run (GRPO's are made of
            the rollouts the run generates); the plan refuses in one line. Empty: it can.
    """

    model: torch.nn.Module
    train_data: Any
    val_data: Any = None
    collate_fn: Optional[Callable] = None
    loss_fn: Optional[Callable] = None
    count_items: Optional[Callable] = None
    eval_step: Optional[Callable] = None
    compute_metrics: Optional[Callable] = None
    enable_gradient_checkpointing: Optional[Callable] = None
    save: Optional[Callable] = None
    length_of: Optional[Callable] = None
    tokenizer: Any = None
    param_groups: Optional[dict] = None
    before_window: Optional[Callable] = None
    after_step: Optional[Callable] = None
    val_loss_metrics: Optional[Callable] = None
    summarize: Optional[Callable] = None
    checkpointed: list = field(default_factory=list)
    stream_block: Optional[int] = None
    windows_in_order: bool = False
    model_for: Optional[Callable] = None
    unplannable: str = ""
    # the hook's old name, carried for a release: "checkpointing" alone now means a checkpoint to resume from
    enable_checkpointing: InitVar[Optional[Callable]] = None

    def __post_init__(self, enable_checkpointing):
        if enable_checkpointing is not None:
            warnings.warn(RENAMED_HOOK, FutureWarning, stacklevel=3)
            self.enable_gradient_checkpointing = self.enable_gradient_checkpointing or enable_checkpointing


RENAMED_HOOK = ("Job(enable_checkpointing=...) is now enable_gradient_checkpointing; the old name goes in a later "
                "release")


@dataclass(frozen=True)
class TaskContext:
    """What a task's ``build(cfg, ctx)`` is told about the run it builds for, so that it never asks the loop, the
    shape or the process group itself. A task whose ``build`` takes one argument is called as ``build(cfg)``.

    Args:
        shape: the split of the effective batch (``micro_batch``, ``accumulation``, ``processes``, ``effective``),
            before the data is counted (its ``total_steps`` is 0).
        processes / rank: the launch's process count and this process's rank.
        device: where this process trains.
        main: whether this process speaks for the run (prints, writes shared files).
        seed: ``training.seed`` (already applied before ``build`` is called).
        agree: ``agree(fn)`` runs ``fn`` on every process; a refusal on one stops every process alike.
    """

    shape: Any
    processes: int
    rank: int
    device: torch.device
    main: bool
    seed: int
    agree: Callable = field(default=lambda fn: fn(), repr=False)


@dataclass(frozen=True)
class CompareHints:
    """What ``finetune compare``, ``import`` and ``reproduce`` know of a task, declared by its module as
    ``COMPARE_HINTS`` (a task that declares none gets these defaults): they never switch on a task's name.

    Args:
        step_settings: the task's own dotted settings that shape each update beyond what the per-step layers see
            (``model.beta``, ``data.pack``): two runs that differ in one take different steps.
        loss_atol: for a loss that sums to about 0 (GRPO's centred advantages), the absolute floor a relative
            difference is taken against, and no one-sided-shift check (a shift of nothing); None: relative as is.
        mean_of_micro_batches: the trainer of a baseline of this task that averages each micro-batch's mean loss
            over the window (so an epoch's short last micro-batch weighs like a full one), as said in a report.
        base_recipe: the recipe ``finetune reproduce`` imports a baseline of this task over.
        trl_marks: TRL arguments that a folder of this task's TRL trainer holds; a TRL folder is taken to be of the
            task whose marks it holds all of, the most marks first (``()``: any TRL folder; None: no TRL trainer).
        peer_names: what another tool calls this task (``{"llamafactory": "dpo"}``: its ``stage``; axolotl: the
            ``type`` of its data sets).
        peer_default: the tools that train this task when their config names none.
        log_marks: what the Trainer's log of this task's trainer holds and no other task's does (TRL's DPOTrainer
            logs ``rewards/chosen``): how a run whose config is missing is known by its log.
        arg_marks: keys that only this task's TRL trainer's config holds, any one of which says a run trained it (a
            saved config holds every field, its defaults too: GRPOConfig's ``num_generations``, SFTConfig's
            ``packing``).
        objective_names: what other tools call this task's objective (axolotl's ``rl``, the tag TRL writes into a
            card, torchtune's loss class and its data sets' builders): how ``import`` knows it by their word.
        counted_as_peers: its batches' attention masks are the rows its peers' trainers feed theirs (DPO's: prompt +
            chosen, prompt + rejected, as TRL concatenates them), so the tokens they log as seen (TRL's
            ``num_tokens``, the Trainer's ``num_input_tokens_seen``) are its history's ``tokens_seen``; False: its
            trainer counts batches of its own (GRPO's generated ones).
    """

    step_settings: tuple = ()
    loss_atol: Optional[float] = None
    mean_of_micro_batches: Optional[str] = None
    base_recipe: Optional[str] = None
    trl_marks: Optional[tuple] = None
    peer_names: dict = field(default_factory=dict)
    peer_default: tuple = ()
    log_marks: tuple = ()
    arg_marks: tuple = ()
    objective_names: tuple = ()
    counted_as_peers: bool = False
