"""Makes the ``training_args.bin`` files of this folder (PROVENANCE.md says what each is and from which source):
``python tests/assets/corpus/pickles/make_pickles.py``. Each is ``torch.save(args, path)`` as the HF Trainer saves its
arguments (``Trainer._save``: pickle protocol 2), of a stand-in class that carries the foreign class's module and
qualname (registered in ``sys.modules`` while it is saved, as pickle requires) and its fields, on top of the
installed transformers / TRL classes it derives from."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import enum
import sys
import types
from pathlib import Path
from typing import Any, Optional

import torch

HERE = Path(__file__).parent


@contextlib.contextmanager
def registered(module: str, cls: type):
    """``module`` (and its parents) in ``sys.modules`` holding ``cls``, so pickle names it by that path."""
    parts = module.split(".")
    added = []
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
            added.append(name)
    setattr(sys.modules[module], cls.__qualname__, cls)
    try:
        yield
    finally:
        for name in added:
            del sys.modules[name]


def stand_in(module: str, qualname: str, base: type, fields: list) -> type:
    """A dataclass ``module.qualname`` deriving from ``base`` with ``fields`` ((name, type, default) triples)."""
    cls = dataclasses.make_dataclass(qualname, [(n, t, dataclasses.field(default=d)) for n, t, d in fields],
                                     bases=(base,))
    cls.__module__, cls.__qualname__ = module, qualname
    return cls


@contextlib.contextmanager
def saved_on(device: str):
    """accelerate's shared state as a one-process run on ``device`` leaves it while the arguments are pickled."""
    from accelerate.state import PartialState

    shared = PartialState._shared_state
    before = dict(shared)
    shared.update(device=torch.device(device), num_processes=1, process_index=0, distributed_type="NO")
    try:
        yield
    finally:
        shared.clear()
        shared.update(before)


def save(args, path: Path, module: str | None = None, protocol: int = 2) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _ = args.device  # the accelerate state the arguments pickle (as after training)
    with saved_on("cuda"), (registered(module, type(args)) if module else contextlib.nullcontext()):
        torch.save(args, path, pickle_protocol=protocol)


def axolotl_mixin_fields(source: Path) -> list:
    """``AxolotlTrainingMixins``' fields (name, default) as axolotl's ``core/training_args_base.py`` declares them
    (a copy of it at the commit PROVENANCE.md names): literal defaults kept, others None."""
    tree = ast.parse(source.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "AxolotlTrainingMixins")
    out = []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            default = None
            call = node.value
            if isinstance(call, ast.Call):
                for kw in call.keywords:
                    if kw.arg == "default":
                        with contextlib.suppress(ValueError):
                            default = ast.literal_eval(kw.value)
            out.append((node.target.id, Any, default))
    return out


def unsloth_sft(path: Path) -> None:
    """Unsloth's ``UnslothSFTConfig``: made by unsloth/models/rl.py as ``class UnslothSFTConfig(SFTConfig)`` in the
    generated module ``UnslothSFTTrainer`` (unsloth_zoo's compiler imports it by that top-level name), with the
    fields it adds; the values of a published Unsloth notebook run (PROVENANCE.md)."""
    from trl import SFTConfig

    cls = stand_in("UnslothSFTTrainer", "UnslothSFTConfig", SFTConfig, [
        ("vllm_sampling_params", Optional[Any], None), ("unsloth_num_chunks", Optional[int], -1),
        ("unsloth_logit_chunk_multiplier", Optional[int], None), ("unsloth_grpo_mini_batch", Optional[int], None),
        ("max_seq_length", Optional[int], None)])
    args = cls(output_dir="outputs", per_device_train_batch_size=2, gradient_accumulation_steps=4, warmup_steps=10,
               max_steps=60, learning_rate=5e-5, logging_steps=1, optim="adamw_8bit", weight_decay=0.01,
               lr_scheduler_type="linear", seed=3407, report_to="none", max_length=512, dataset_text_field="text",
               use_cpu=True)
    args.bf16, args.max_seq_length = True, 512  # as on the run's GPU (a CPU refuses bf16 at construction)
    save(args, path, "UnslothSFTTrainer")


class RequestOutputKind(enum.IntEnum):  # vllm.sampling_params.RequestOutputKind, as vLLM declares it
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams:
    """vLLM's ``SamplingParams``: a msgspec struct, which pickles as its class called with its fields' values in
    order (``__reduce__``); the values below are the first ones of the published GRPO run's (PROVENANCE.md)."""

    def __init__(self, *values):
        self.values = values

    def __reduce__(self):
        return type(self), self.values


def unsloth_grpo(path: Path) -> None:
    """Unsloth's ``UnslothGRPOConfig`` (module ``UnslothGRPOTrainer``) holding vLLM's sampling parameters."""
    from trl import GRPOConfig

    cls = stand_in("UnslothGRPOTrainer", "UnslothGRPOConfig", GRPOConfig, [
        ("vllm_sampling_params", Optional[Any], None), ("unsloth_num_chunks", Optional[int], -1),
        ("unsloth_logit_chunk_multiplier", Optional[int], None), ("unsloth_grpo_mini_batch", Optional[int], None),
        ("max_seq_length", Optional[int], None)])
    args = cls(output_dir="outputs", per_device_train_batch_size=8, gradient_accumulation_steps=1,
               num_generations=8, learning_rate=5e-6, lr_scheduler_type="cosine", optim="adamw_8bit",
               warmup_steps=0.1, seed=3407, report_to="none", use_cpu=True, num_train_epochs=1)
    with registered("vllm.sampling_params", RequestOutputKind), registered("vllm.sampling_params", SamplingParams):
        RequestOutputKind.__module__ = SamplingParams.__module__ = "vllm.sampling_params"
        args.vllm_sampling_params = SamplingParams(1, None, None, 0.0, 0.0, 1.0, 0.9, 0.95, -1, 0.1, 3407,
                                                   ["<|im_end|>"], set(), False, 16, RequestOutputKind.CUMULATIVE)
        save(args, path, "UnslothGRPOTrainer")


def axolotl_lora(path: Path, module: str = "axolotl.core.training_args") -> None:
    """axolotl's ``AxolotlTrainingArguments(AxolotlTrainingMixins, TrainingArguments)`` with the mixin's fields,
    as axolotl 0.21.0 built them for tests/assets/axolotl-lora (4 × 2, lr 0.001, cosine, 2 warm-up steps)."""
    from PIL.Image import Resampling
    from transformers import TrainingArguments

    fields = axolotl_mixin_fields(HERE / "axolotl_training_args_base.py.txt")
    cls = stand_in(module, "AxolotlTrainingArguments", TrainingArguments, fields)
    args = cls(output_dir="tests/assets/axolotl-lora", per_device_train_batch_size=4, gradient_accumulation_steps=2,
               num_train_epochs=1, learning_rate=0.001, lr_scheduler_type="cosine", warmup_steps=2,
               optim="adamw_torch", max_grad_norm=0.5, weight_decay=0.0, seed=42, logging_steps=1,
               report_to=[], use_cpu=True, save_strategy="no", sample_packing=False, max_seq_length=512,
               image_resize_algorithm=Resampling.BILINEAR)  # a PIL enum (IntEnum) among the fields, as axolotl's
    save(args, path, module)


def by_name(path: Path, reduce_ex, protocol: int) -> None:
    """The Trainer's own TrainingArguments with transformers' and accelerate's enums pickled by name: as an enum
    class that sets ``__reduce_ex__`` to ``enum.pickle_by_enum_name`` writes them (``getattr(Class, 'NAME')``), or
    one whose reduce names the member by its qualified name ``Class.NAME`` (:func:`by_qualified_name`; protocol 2
    writes that as ``getattr(Class, 'NAME')`` too, protocol 4 as the dotted global)."""
    from accelerate.utils.dataclasses import DistributedType
    from transformers import TrainingArguments
    from transformers.trainer_utils import HubStrategy, IntervalStrategy, SaveStrategy, SchedulerType
    from transformers.training_args import OptimizerNames

    args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             learning_rate=3e-4, num_train_epochs=2, lr_scheduler_type="cosine_with_restarts",
                             optim="paged_adamw_32bit", eval_strategy="steps", eval_steps=10, save_strategy="epoch",
                             seed=7, report_to=[], use_cpu=True)
    enums = (IntervalStrategy, SaveStrategy, HubStrategy, SchedulerType, OptimizerNames, DistributedType)
    saved = {e: e.__dict__.get("__reduce_ex__") for e in enums}
    try:
        for e in enums:
            e.__reduce_ex__ = reduce_ex
        save(args, path, protocol=protocol)
    finally:
        for e, before in saved.items():
            if before is None:
                del e.__reduce_ex__
            else:
                e.__reduce_ex__ = before


def by_qualified_name(member, proto):
    """An enum member reduced to its qualified name, as pickle saves a class attribute reached through its class."""
    return f"{type(member).__qualname__}.{member._name_}"


def make_all() -> None:
    unsloth_sft(HERE / "unsloth-sft" / "training_args.bin")
    unsloth_grpo(HERE / "unsloth-grpo" / "training_args.bin")
    axolotl_lora(HERE / "axolotl-lora" / "training_args.bin")
    axolotl_lora(HERE / "axolotl-trainer-builder" / "training_args.bin", "axolotl.core.trainer_builder")
    by_name(HERE / "enums-by-getattr" / "training_args.bin", enum.pickle_by_enum_name, 2)
    by_name(HERE / "enums-by-dotted-global" / "training_args.bin", by_qualified_name, 4)


if __name__ == "__main__":
    make_all()
