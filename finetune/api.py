"""``test_fine_tuning()``: fine-tune a model from Python objects through the shared loop.

    >>> result = test_fine_tuning(model, train_data=train, val_data=val, batch_size=4,
    ...                           gradient_accumulation_steps=8, learning_rate=5e-5, n_epochs=3)
    >>> len(result["grad_norm_history"]) == result["optimizer_steps"]
    True
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import sys
import textwrap
import typing
from collections.abc import Mapping
from typing import Callable, Optional

import torch
from accelerate.utils import set_seed

from finetune import distributed, loop, outputs, startup
from finetune.config import OutputConfig, RecipeConfig, TrainingConfig, fields_with
from finetune.errors import ConfigError
from finetune.job import Job
from finetune.schema import build_section, check_ranges
from finetune.validation import validate_training

# Job hooks accepted as keywords; every other keyword is a TrainingConfig field or its alias (n_epochs, lr).
_HOOKS = ("count_items", "eval_step", "compute_metrics", "param_groups", "before_window", "after_step",
          "enable_gradient_checkpointing", "length_of", "enable_checkpointing")  # the last: its old name (Job says)


def test_fine_tuning(model, config=None, train_data=None, val_data=None, *, collate_fn: Optional[Callable] = None,
                     loss_fn: Optional[Callable] = None, use_amp: bool = False, use_wandb=False,
                     output_dir: Optional[str] = None, save_every: Optional[int] = None,
                     resume: Optional[str] = None, **training) -> dict:
    """Fine-tune ``model`` with exact gradient accumulation and return what happened.

    Every optimizer step equals the step of one batch of ``batch_size × gradient_accumulation_steps × processes``
    samples — including each epoch's short last window and short last micro-batch.

    Args:
        model: an ``nn.Module`` called as ``model(**batch)`` returning ``.loss`` / ``["loss"]``, unless ``loss_fn``.
        config: optional dict (``test_fine_tuning`` keywords or ``TrainingConfig`` fields, flat or under
            ``"training"``), a ``TrainingConfig`` or a ``RecipeConfig``; explicit keyword arguments override it.
        train_data, val_data: a torch Dataset of dict samples, a 🤗 ``datasets.Dataset`` or a list of dicts.
        collate_fn: list of samples → batch. loss_fn: ``loss_fn(model, batch)`` → mean loss over the batch.
        use_amp: mixed precision — fp16 on CUDA, bf16 elsewhere; a ``mixed_precision`` of fp16 or bf16 wins.
        use_wandb: True (wandb) or a tracker name ("tensorboard", "mlflow") logged through Accelerate.
        output_dir: where ``history.jsonl`` and ``metrics.json`` go (nothing is written when None).
        save_every: a checkpoint every this many optimizer steps and at the end, in ``output_dir/checkpoints``
            (None: none), as ``finetune run --save-every``.
        resume: continue from a checkpoint: "latest" (the newest in ``output_dir``) or a checkpoint's folder, with
            the command line's checks (the same effective batch, unless ``scale_lr`` says otherwise at an epoch
            boundary; a run already complete is refused).
        **training: the training keywords listed below (``TrainingConfig``'s fields, with its defaults: a keyword
            not given takes ``config``'s value, else that default), and the ``Job`` hooks ``count_items``,
            ``eval_step``, ``compute_metrics``, ``param_groups``, ``before_window``, ``after_step``,
            ``enable_gradient_checkpointing``, ``length_of`` (see ``finetune.job.Job``).

    Returns:
        ``finetune.loop.TrainResult``, read as a dict or by attribute: ``grad_norm_history``, ``loss_history``,
        ``lr_history`` (one per optimizer step),
        ``optimizer_steps``, ``micro_batches``, ``effective_batch_size``, ``final_loss`` (validation loss at the
        end when ``val_data`` is given, else the last window's loss), ``val_history``, ``history`` (the
        ``history.jsonl`` records) and ``model`` (trained in place, unwrapped).

    Raises:
        ConfigError: a bad argument, naming it and what is allowed; an unknown keyword, naming the closest one; a
            checkpoint the command line would refuse, with its line.
    """
    if train_data is None:
        raise ConfigError("train_data: required (a torch Dataset, a datasets.Dataset or a list of dicts)")
    check_arguments(model, train_data, val_data, loss_fn, collate_fn)
    hooks = {k: training.pop(k) for k in _HOOKS if k in training}
    t = _training_config(config, training, use_amp)
    set_seed(t.seed)
    job = Job(model=model, train_data=_as_dataset(train_data), val_data=_as_dataset(val_data),
              collate_fn=collate_fn, loss_fn=loss_fn, **hooks)
    log_with = None
    if use_wandb:
        log_with = "wandb" if use_wandb is True else use_wandb
    # the three stages of a recipe run, from the job the caller's objects make
    reporting = loop.Reporting(dir=output_dir, save_every=_save_every(save_every, output_dir), tracker=log_with)
    result = startup.train_job(job, t, reporting, resume)
    if output_dir is not None and distributed.is_main_process():
        outputs.write_metrics(result, output_dir)
    return result


test_fine_tuning.__test__ = False  # not a pytest test, whatever module imports it
_CALL = inspect.signature(test_fine_tuning)
# the call's own keywords: the model, the data and the switches that are not training fields
_OWN = tuple(_CALL.parameters)[:-1]


def _aliases() -> dict:
    """``n_epochs`` → ``epochs``, ``lr`` → ``learning_rate``: the schema's other names for training fields."""
    return {alias: name.split(".", 1)[1] for name, alias in fields_with("alias").items()
            if name.startswith("training.")}


def _training_keywords() -> list:
    """The training keywords as ``inspect.Parameter`` s, each with the schema's type and default."""
    hints = typing.get_type_hints(TrainingConfig)
    defaults = TrainingConfig()
    return [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=getattr(defaults, f.name),
                              annotation=hints[f.name]) for f in dataclasses.fields(TrainingConfig)]


def _training_keywords_doc() -> str:
    """The docstring's list of training keywords, written from the schema: name, alias, default, help."""
    aliases = {name: alias for alias, name in _aliases().items()}
    lines = ["", "    Training keywords (``TrainingConfig``; the unit is in each description):"]
    for f, p in zip(dataclasses.fields(TrainingConfig), _training_keywords()):
        alias = f" (or {aliases[f.name]})" if f.name in aliases else ""
        lines += textwrap.wrap(f"{f.name}{alias} = {p.default!r}: {f.metadata['help']}", width=116,
                               initial_indent=" " * 8, subsequent_indent=" " * 12)
    return "\n".join(lines) + "\n"


# help(test_fine_tuning) and editors show every training keyword with the schema's default: one place says it
test_fine_tuning.__signature__ = _CALL.replace(parameters=[
    *list(_CALL.parameters.values())[:-1], *_training_keywords(),
    inspect.Parameter("hooks_and_aliases", inspect.Parameter.VAR_KEYWORD)])
if test_fine_tuning.__doc__:  # None under python -OO
    test_fine_tuning.__doc__ += _training_keywords_doc()


def check_arguments(model, train_data, val_data, loss_fn=None, collate_fn=None) -> None:
    """Refuse, naming the argument, what the loop cannot use — rather than a TypeError from collate or backward."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model: got {type(model).__name__}; expected a torch.nn.Module")
    for name, data in (("train_data", train_data), ("val_data", val_data)):
        if data is None:
            continue
        try:
            n = len(data)
        except TypeError:
            raise ConfigError(f"{name}: got {type(data).__name__}; expected a torch Dataset, a datasets.Dataset or a "
                              "list of dicts") from None
        if n == 0:
            raise ConfigError(f"{name}: empty" + ("; give samples, or None for no validation" if name == "val_data"
                                                  else ""))
        if collate_fn is not None:
            continue
        first = data[0]
        if not isinstance(first, Mapping):
            if loss_fn is None:
                raise ConfigError(f"{name}: samples are {type(first).__name__}s; model(**batch) needs dict samples "
                                  "(or give a loss_fn(model, batch))")
            continue
        if isinstance(data, (list, tuple)):
            odd = next((i for i, x in enumerate(data) if not isinstance(x, Mapping) or x.keys() != first.keys()), None)
            if odd is not None:
                got = sorted(data[odd]) if isinstance(data[odd], Mapping) else type(data[odd]).__name__
                raise ConfigError(f"{name}: sample {odd} has {got}, sample 0 has {sorted(first)}; every sample needs "
                                  "the same keys (or give a collate_fn)")


def _unknown_keyword(key: str, allowed) -> ConfigError:
    """One line naming the keyword and the closest allowed one (the full list is in ``help(test_fine_tuning)``)."""
    key = str(key)
    shown = key if len(key) <= 40 else key[:37] + "..."
    close = difflib.get_close_matches(key, list(allowed), n=1)
    hint = f"did you mean {close[0]}?" if close else "help(test_fine_tuning) lists the keywords"
    return ConfigError(f"training.{shown}: not a test_fine_tuning keyword; {hint}")


def _training_config(config, given: dict, use_amp: bool = False) -> TrainingConfig:
    """The run's ``TrainingConfig``: ``config``'s values, the keywords ``given`` over them, ``use_amp`` resolved."""
    if isinstance(config, RecipeConfig):
        base = dataclasses.asdict(config.training)
    elif isinstance(config, TrainingConfig):
        base = dataclasses.asdict(config)
    elif isinstance(config, dict):
        base = dict(config.get("training", config))
    elif config is None:
        base = {}
    else:
        raise ConfigError(f"config: got {type(config).__name__}; expected a dict, TrainingConfig or RecipeConfig")
    renamed = _aliases()
    fields = {f.name for f in dataclasses.fields(TrainingConfig)}
    raw = {}
    for key, value in {**base, **given}.items():
        name = renamed.get(key, key)
        if name in fields:
            raw[name] = value
        elif key not in (*_OWN, *_HOOKS):  # a config dict may hold the call's own keywords; they are not fields
            raise _unknown_keyword(key, [*fields, *renamed, *_OWN, *_HOOKS])
    if given.get("mixed_precision") is None and "mixed_precision" in raw and raw["mixed_precision"] is None:
        del raw["mixed_precision"]
    if use_amp or (base.get("use_amp") and "mixed_precision" not in given):
        if raw.get("mixed_precision") in (None, "no"):
            raw["mixed_precision"] = distributed.amp_precision()
    problems = []
    t = build_section(TrainingConfig, raw, "training", problems)
    if problems:
        raise ConfigError(problems)
    validate_training(t, problems)
    if problems:
        raise ConfigError(problems)
    return t


def _save_every(save_every, output_dir) -> Optional[int]:
    """``save_every`` checked by the recipe schema's ``output.save_every`` (its type and range), and against where
    the checkpoints would go."""
    problems = []
    checked = build_section(OutputConfig, {"save_every": save_every}, "output", problems)
    check_ranges(checked, "output", problems)
    if not problems and save_every is not None and output_dir is None:
        problems.append("output.save_every: checkpoints need an output_dir to be saved in")
    if problems:
        raise ConfigError(problems)
    return checked.save_every


def _as_dataset(data):
    """🤗 datasets come back as python lists; ask for tensors so the default collate works."""
    if data is None:
        return None
    # a datasets.Dataset was made by an imported `datasets`: looked up, not imported (0.6 s on every
    # `import finetune`, which imports this module)
    datasets = sys.modules.get("datasets")
    if datasets is not None and isinstance(data, datasets.Dataset) and data.format["type"] is None:
        return data.with_format("torch")
    return data
