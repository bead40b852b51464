"""What a reader of another tool's run hands ``finetune import`` and ``finetune compare``: the run's settings as
TrainingArguments names, each with where it came from, its per-step log, and its files (``Baseline``). Each entry of
``sources.SOURCES`` fills one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from finetune.config import read_yaml

if TYPE_CHECKING:
    from finetune.reproduce.sources.contract import Source

# arguments that TRL's configs (SFTConfig, DPOConfig, GRPOConfig, …) add to the TrainingArguments
TRL_ARGS = ("completion_only_loss", "assistant_only_loss", "dataset_text_field", "padding_free",
            "max_prompt_length", "num_generations")


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
    unknown: list = field(default_factory=list)   # keys of the source that finetune does not know (axolotl)
    uncarried: list = field(default_factory=list)  # (setting, value, why) the source's reader knows finetune lacks
    lr_rounding: float = 1e-9                      # relative rounding of its logged lr (TensorBoard keeps fp32)
    task: Optional[str] = None                    # the finetune task the source trains (LLaMA-Factory's stage)
    own: dict = field(default_factory=dict)       # the tool's own settings, name → (value, source), for its
    #                                               source's carry_own
    card_only: bool = False                       # read from a model card alone: it lists only some arguments
    data_file: Optional[tuple] = None             # (path, source): the one local training file the source names,
    #                                               taken as --data when none is given (axolotl's datasets[0].path)
    logged_loss_is_mean: bool = True              # a logged loss is the mean since the previous log (the Trainer's);
    #                                               False: the logged step's own (torchtune's log_every_n_steps)
    held_out: Optional[tuple] = None              # (first rows, test size, seed, source): the tool kept the first
    #                                               rows (or all: None), split them before training (datasets'
    #                                               train_test_split; no split: None) and trained the train part in
    #                                               that order (LLaMA-Factory's max_samples, val_size)
    shuffled: Optional[tuple] = None              # (seed, source): the tool shuffled its training rows once before
    #                                               training, as datasets' Dataset.shuffle(seed=seed) does (axolotl)

    def get(self, name, default=None):
        return self.args[name][0] if name in self.args else default

    @property
    def trl(self) -> bool:
        """Whether TRL trained it (its configs add these to the TrainingArguments)."""
        return getattr(self.source, "trl", False) or any(k in self.args for k in TRL_ARGS)

    def effective_batch(self) -> Optional[int]:
        """Samples per optimizer step: ``total_train_batch_size`` when the source says it, else per-device ×
        accumulation × processes (1 when the source does not say)."""
        if self.get("total_train_batch_size"):
            return int(self.get("total_train_batch_size"))
        if self.get("per_device_train_batch_size") is None:
            return None
        return int(self.get("per_device_train_batch_size")) * int(self.get("gradient_accumulation_steps") or 1) * \
            int(self.get("num_devices") or 1)


def load_yaml(path: Path, what: str):
    """A run's or a config's YAML file (``config.read_yaml``: the one reader); ConfigError naming the file and the
    line when it is not YAML."""
    return read_yaml(path, what)


def pure_precision(out, setting: tuple, dtype: str, tool: str, own_step: bool, model_fields,
                   autocast: Optional[str] = None) -> None:
    """A baseline that trained every weight in ``dtype`` with no fp32 master weights (torchtune's ``dtype: bf16``,
    LLaMA-Factory's ``pure_bf16``): its step rounds each update to ``dtype``, not the fp32 step. Taken on request
    (``own_step``: ``model.dtype`` and ``model.master_weights: false``), else named as not carried. ``setting``:
    (its value, where it is said: ``file: key``); ``autocast``: the mixed precision it trained with on top, when the
    carried one is not it (None: leave it)."""
    value, where = setting
    if not own_step or "master_weights" not in model_fields:
        out.skip(where.split(": ")[-1], value, f"{tool} loads and trains every weight in {dtype}, with no fp32 master "
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
