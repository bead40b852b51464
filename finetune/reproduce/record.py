"""What a reader of another tool's run hands ``finetune import`` and ``finetune compare``: the run's settings as
TrainingArguments names, each with where it came from, its per-step log, and its files (``Baseline``). Each entry of
``sources.SOURCES`` fills one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Optional, Protocol

# arguments that TRL's configs (SFTConfig, DPOConfig, GRPOConfig, …) add to the TrainingArguments
TRL_ARGS = ("completion_only_loss", "assistant_only_loss", "dataset_text_field", "padding_free",
            "max_prompt_length", "num_generations")


class Where(str):
    """Where a value was read: ``file: key`` as every message shows it (a ``str``), with the file and the key kept
    apart (``file``, ``key``), so that nothing parses them back."""

    def __new__(cls, file, key: Optional[str] = None):
        where = super().__new__(cls, f"{file}: {key}" if key else str(file))
        where.file, where.key = str(file), key
        return where

    def said(self, more: str) -> "Where":
        """The same place with ``more`` said of it (``sft.yaml: lora_alpha`` + ``, its default``)."""
        return Where(self.file, f"{self.key or ''}{more}")


def file_of(source) -> str:
    """The file a value was read from: a ``Where``'s, else the source as said (a file's name, a command-line flag)."""
    return source.file if isinstance(source, Where) else str(source)


def key_of(source) -> str:
    """The key a value was read from: a ``Where``'s, else the source as said."""
    return source.key if isinstance(source, Where) and source.key else str(source)


class Objective(NamedTuple):
    """What a run trained, as its files say it (``objective.py`` holds the names): a finetune task (``sft``, ``clm``,
    ``dpo``, ``grpo``), an objective finetune does not train (``kto``, ``ppo``, ``reward model``, …) or what a file
    that trains nothing does (``generation``, ``evaluation``, …); ``where``: the file and key that say it."""

    name: str
    where: str


class WholeRecipe(NamedTuple):
    """The recipe a run carries whole (finetune's own runs and cards), imported as it is: the recipe, one line on
    what it was read from, and the sha256 of the data its card records (None: not a local file, or no card)."""

    recipe: dict
    said: str
    data_sha: Optional[str]


class Skip(NamedTuple):
    """A setting of the baseline that ``finetune import`` does not carry: its value and why."""

    setting: str
    value: object
    why: str

    def __str__(self) -> str:
        return f"not carried: {self.setting}={self.value} — {self.why}"


class EngineStep(NamedTuple):
    """A step the baseline's engine took that is not the big batch's, as its files show it: ``where`` the files and
    fields that show it, ``what`` what the engine did (``engine.py`` finds them)."""

    where: str
    what: str

    def __str__(self) -> str:
        return f"engine: {self.where} — {self.what}: the baseline's steps are not the big-batch step, expect differs"


class TokenCounts(NamedTuple):
    """The tokens a baseline logged as seen — summed over its processes and over its run so far — at each logged
    step: ``key`` its log's name for them, ``counts`` (step, count) in order, ``padding`` whether its padding is
    counted (the Trainer's ``include_num_input_tokens_seen: all``; None: not known), ``defined`` how its tool
    counts them, as the report says it."""

    key: str
    counts: tuple
    padding: Optional[bool]
    defined: str


# TRL's SFT, DPO and reward trainers (1.16, ``compute_loss``): each micro-batch's attention_mask summed (under
# padding-free packing, its position_ids' length), gathered over processes, added up over the run
TRL_TOKENS = "TRL's num_tokens: each micro-batch's attention_mask summed over every process, cumulative"


def logged_tokens(logs: list, mode) -> Optional[TokenCounts]:
    """The token counts a Trainer-based run's log holds (its entries ``logs``): TRL's ``num_tokens``, else the
    Trainer's ``num_input_tokens_seen``, whose ``mode`` (``include_num_input_tokens_seen``) says what it counts:
    ``non_padding`` the attention mask, ``all`` (or True) every input id, padding included (transformers 5.24,
    ``Trainer._track_num_input_tokens``). None when the log holds neither."""
    for key in ("num_tokens", "num_input_tokens_seen"):
        counts = tuple((e["step"], int(e[key])) for e in logs if isinstance(e.get(key), (int, float)) and
                       not isinstance(e.get(key), bool) and float(e[key]).is_integer())
        if not counts:
            continue
        if key == "num_tokens":
            return TokenCounts(key, counts, False, TRL_TOKENS)
        padding = {"all": True, True: True, "non_padding": False}.get(mode)
        what = {True: "every input id of each micro-batch, padding included", False: "each micro-batch's "
                "attention_mask summed", None: f"include_num_input_tokens_seen={mode!r}: what it counts is unknown"}
        return TokenCounts(key, counts, padding, f"the Trainer's num_input_tokens_seen: {what[padding]}, over "
                                                 "every process, cumulative")
    return None


@dataclass
class Baseline:
    kind: str                                     # what was read, in messages: "Trainer folder", "model card", …
    path: Path
    source: Optional["Source"] = None             # the SOURCES entry that read it (sources.read_baseline sets it)
    args: dict = field(default_factory=dict)      # TrainingArguments name → (value, source)
    logs: list = field(default_factory=list)      # trainer_state's training log entries (with "loss"), in order
    evals: list = field(default_factory=list)     # (step, eval_loss), from the log or the card's results table
    card_losses: list = field(default_factory=list)  # (step, training loss) of the card's results table
    max_steps: Optional[int] = None               # optimizer steps the baseline took (trainer_state's global_step)
    model_config: Optional[dict] = None           # config.json
    adapter_config: Optional[dict] = None         # adapter_config.json
    weights: Optional[Path] = None                # model.safetensors / adapter_model.safetensors
    base_model: Optional[str] = None              # the model it fine-tuned, as the source names it
    base_model_where: Optional[str] = None        # where base_model is said (None: the source's own file)
    unknown: list = field(default_factory=list)   # keys of the source that finetune does not know (axolotl)
    uncarried: list = field(default_factory=list)  # (setting, value, why) the source's reader knows finetune lacks
    lr_rounding: float = 1e-9                      # relative rounding of its logged lr (TensorBoard keeps fp32)
    objective: Optional[Objective] = None         # what it trained, as its tool's own reader read it (its rl,
    #                                               loss component, stage, data sets' type); None: read from the
    #                                               arguments, the log, the card and the model (objective.py)
    tags: tuple = ()                              # the model card's front-matter tags (TRL's: trl, sft, dpo, …)
    args_class: Optional[tuple] = None            # (the training arguments' class, its file): a .bin names it
    own: dict = field(default_factory=dict)       # the tool's own settings, name → (value, source), for its
    #                                               source's carry_own
    card_only: bool = False                       # read from a model card alone: it lists only some arguments
    processes: Optional[tuple] = None             # (processes it trained on, where that is said): its source's
    #                                               processes(), or import's --processes
    data_file: Optional[tuple] = None             # (path, source): the one local training file the source names,
    #                                               taken as --data when none is given (axolotl's datasets[0].path)
    logged_loss_is_mean: bool = True              # a logged loss is the mean since the previous log (the Trainer's);
    #                                               False: the logged step's own (torchtune's log_every_n_steps)
    held_out: Optional[tuple] = None              # (first rows, test size, seed, source): the tool kept the first
    #                                               rows (or all: None), split them before training (datasets'
    #                                               train_test_split; no split: None) and trained the train part in
    #                                               that order (LLaMA-Factory's max_samples, val_size)
    assumed: dict = field(default_factory=dict)   # setting → why it is assumed: the source's files do not say
    #                                               it (LLaMA-Factory's folder without its YAML: the accumulation)
    shuffled: Optional[tuple] = None              # (seed, source): the tool shuffled its training rows once before
    #                                               training, as datasets' Dataset.shuffle(seed=seed) does (axolotl;
    #                                               ms-swift, its seed drawn as its load_dataset draws it)
    run: Optional[Path] = None                    # finetune's own run folder: compared run against run
    recipe: Optional[WholeRecipe] = None          # the recipe it carries whole, imported as it is (finetune's)

    def get(self, name, default=None):
        return self.args[name][0] if name in self.args else default

    @property
    def token_counts(self) -> Optional[TokenCounts]:
        """The tokens its log says it saw at each logged step, and what they count (None: it logs none)."""
        return logged_tokens(self.logs, self.get("include_num_input_tokens_seen"))

    @property
    def trl(self) -> bool:
        """Whether TRL trained it (its configs add these to the TrainingArguments)."""
        return getattr(self.source, "trl", False) or any(k in self.args for k in TRL_ARGS)

    def effective_batch(self) -> Optional[int]:
        """Samples per optimizer step: ``total_train_batch_size`` when the source says it, else the speed metrics'
        (``speed_batch``) where no file says the accumulation, else per-device × accumulation × processes (1 when the
        source does not say)."""
        if self.get("total_train_batch_size"):
            return int(self.get("total_train_batch_size"))
        if self.get("speed_batch") and "gradient_accumulation_steps" not in self.args:
            return int(self.get("speed_batch"))  # the Trainer's speed metrics, where no file says the accumulation
        if self.get("per_device_train_batch_size") is None:
            return None
        return int(self.get("per_device_train_batch_size")) * int(self.get("gradient_accumulation_steps") or 1) * \
            self.process_count()

    def process_count(self) -> int:
        """The processes the run trained on: as its source knows them (``processes``), else 1."""
        return self.processes[0] if self.processes else 1


class Source(Protocol):
    """One tool whose runs finetune reads.

    Attributes:
        name: what the tool is called in messages and in ``--help`` (``LLaMA-Factory``).
        reads: one line on what of it is read (``--help``, the refusals that list what is accepted, the docs' table).
        general: whether it is a form every tool built on the HF Trainer leaves (its output folder, a Hub folder,
            TensorBoard logs), which a more specific source before it in ``SOURCES`` may claim first.
    """

    name: str
    reads: str
    general: bool

    def recognises(self, path: Path) -> bool:
        """Whether ``path`` is a run of this tool (looked at, not read whole)."""

    def read(self, path: Path, what: str) -> Baseline:
        """The run at ``path`` as a ``Baseline``; ConfigError (one line naming the file) when unreadable."""

    def carry_own(self, b: Baseline, out, model_fields: dict, data_fields: set, baseline_step: bool) -> None:
        """The tool's own settings onto the recipe being imported (``out``: ``carry.Imported``; the recipe's model
        fields, name → type, and data fields), last, after the TrainingArguments'. ``baseline_step``: take the tool's
        own step where it is not the big batch's."""

    def warmup(self, b: Baseline, ratio: float, total: Optional[int]) -> Optional[tuple]:
        """(warm-up steps or None, how) for a warm-up ``ratio`` of ``total`` steps, as the tool rounds it; None: as
        the Trainer does."""

    def task(self, b: Baseline) -> Optional[str]:
        """The built-in task the run trained, by the tool's own names for tasks (the tasks' hints say them)."""

    def processes(self, b: Baseline) -> Optional[tuple]:
        """(the number of processes the run trained on, where that is said) where the tool's files say it."""

    def adapters_start(self, b: Baseline) -> tuple:
        """(whether finetune's draw from the seed replays the LoRA adapters' start the tool drew, how the tool draws
        them): a start not replayed is said as unknown, with how to give it (``--initial-adapter``)."""

    def training_rows(self, b: Baseline, data, recipe: Path):
        """The file ``import`` trains on for ``--data`` ``data`` (None: not given): the rows as the tool trained them,
        written beside ``recipe`` when they had to be rewritten."""


class Imported:
    """The recipe being written: ``set`` records each value with its source, ``skip`` each setting not carried
    (a ``Skip``; ``not_carried`` holds them and the other lines import says, in order)."""

    def __init__(self):
        self.rows, self.not_carried, self.values, self.missing = [], [], {}, []
        self.assumed = []  # (field, why): values no file of the baseline says, shown as assumed
        # why the baseline's batches held other samples than the recipe's (a packing not taken): compare cannot
        # check its windows against them
        self.other_samples: str | None = None

    def set(self, name: str, value, source: str) -> None:
        """``name`` = ``value`` from ``source``; a later source of the same field (the data's rows over the
        arguments) replaces the earlier row."""
        self.values[name] = value
        self.rows = [r for r in self.rows if r[0] != name] + [(name, value, source)]

    def skip(self, setting: str, value, why: str) -> None:
        """``setting`` = ``value`` is not carried, for ``why``; a later reason for the same setting (a tool's own
        reader knows better) replaces the earlier one where it stood."""
        new = Skip(setting, value, why)
        at = next((i for i, s in enumerate(self.not_carried) if isinstance(s, Skip) and s.setting == setting), None)
        if at is None:
            self.not_carried.append(new)
        else:
            self.not_carried[at] = new

    def skipped(self, setting: str) -> bool:
        return any(isinstance(s, Skip) and s.setting == setting for s in self.not_carried)

    def drop(self, setting: str) -> None:
        """Take back the skip of ``setting`` (a tool whose own reader carries it)."""
        self.not_carried = [s for s in self.not_carried if not (isinstance(s, Skip) and s.setting == setting)]

    def skips(self) -> list:
        return [s for s in self.not_carried if isinstance(s, Skip)]

    def engine_steps(self) -> list:
        """The baseline's engine's own steps that are not the big batch's (``EngineStep``)."""
        return [s for s in self.not_carried if isinstance(s, EngineStep)]

    def lines(self) -> list:
        """What import says of what it did not carry, one line each."""
        return [str(s) for s in self.not_carried]



def pure_precision(out, setting: tuple, dtype: str, tool: str, baseline_step: bool, model_fields,
                   autocast: Optional[str] = None) -> None:
    """A baseline that trained every weight in ``dtype`` with no fp32 master weights (torchtune's ``dtype: bf16``,
    LLaMA-Factory's ``pure_bf16``): its step rounds each update to ``dtype``, not the fp32 step. Taken on request
    (``baseline_step``: ``model.dtype`` and ``model.master_weights: false``), else named as not carried. ``setting``:
    (its value, where it is said: ``file: key``); ``autocast``: the mixed precision it trained with on top, when the
    carried one is not it (None: leave it)."""
    value, where = setting
    if not baseline_step or "master_weights" not in model_fields:
        out.skip(key_of(where), value, f"{tool} loads and trains every weight in {dtype}, with no fp32 master "
                 "weights; finetune's trainable weights stay fp32" + (" (--baseline-step trains as it did)" if
                                                                       "master_weights" in model_fields else ""))
        return
    out.set("model.dtype", dtype, f"{where} — the baseline's own step (--baseline-step)")
    out.set("model.master_weights", False, f"{where}: {tool} trains every weight in {dtype}, its gradients and "
                                           "the optimizer's state too, with no fp32 master weights")
    if autocast is not None:
        out.set("training.mixed_precision", autocast, f"{where}: the model computes in {dtype} itself"
                + (", no autocast" if autocast == "no" else f", under {autocast} autocast"))


def local_file(path, config: Path) -> Path | None:
    """A data set's ``path`` when it is a file here: as given (axolotl reads it from where it runs), else beside the
    config (or inside the output folder whose card holds it). None for a hub id or a folder."""
    if not path:
        return None
    folder = config if config.is_dir() else config.parent
    return next((p for p in (Path(str(path)), folder / str(path)) if p.is_file()), None)
