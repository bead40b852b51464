"""``test_fine_tuning()``: fine-tune a model from Python objects through the shared loop.

    >>> result = test_fine_tuning(model, train_data=train, val_data=val, batch_size=4,
    ...                           gradient_accumulation_steps=8, learning_rate=5e-5, n_epochs=3)
    >>> len(result["grad_norm_history"]) == result["optimizer_steps"]
    True
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable, Optional

from finetune.config import RecipeConfig, TrainingConfig, build_section, fields_with, validate_training
from finetune.errors import ConfigError
from finetune.job import Job

# Job hooks accepted as keywords; every other keyword is a TrainingConfig field (or its alias, e.g. n_epochs).
_HOOKS = ("count_items", "eval_step", "compute_metrics", "param_groups", "before_window", "after_step",
          "enable_checkpointing", "length_of")


def _explicit_kwargs(fn):
    """Let ``fn`` know which keyword arguments the caller passed (config values fill only the others)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, _passed=frozenset(kwargs), **kwargs)

    return wrapper


@_explicit_kwargs
def test_fine_tuning(
    model,
    config=None,
    train_data=None,
    val_data=None,
    *,
    n_epochs: int = 1,
    batch_size: int = 8,
    gradient_accumulation_steps: int = 1,
    learning_rate: float = 5e-5,
    optimizer: str = "adamw",
    weight_decay: float = 0.0,
    lr_scheduler: str = "linear",
    warmup_steps: int = 0,
    max_grad_norm: Optional[float] = 1.0,
    use_amp: bool = False,
    mixed_precision: Optional[str] = None,
    gradient_checkpointing: bool = False,
    compile: bool = False,
    shuffle: bool = True,
    seed: int = 42,
    collate_fn: Optional[Callable] = None,
    loss_fn: Optional[Callable] = None,
    max_steps: Optional[int] = None,
    use_wandb: Any = False,
    output_dir: Optional[str] = None,
    _passed: frozenset = frozenset(),
    **more,
) -> dict:
    """Fine-tune ``model`` with exact gradient accumulation and return what happened.

    Every optimizer step equals the step of one batch of ``batch_size × gradient_accumulation_steps × processes``
    samples — including each epoch's short last window and short last micro-batch.

    Args:
        model: an ``nn.Module`` called as ``model(**batch)`` returning ``.loss`` / ``["loss"]``, unless ``loss_fn``.
        config: optional dict (``test_fine_tuning`` keywords or ``TrainingConfig`` fields, flat or under
            ``"training"``), a ``TrainingConfig`` or a ``RecipeConfig``; explicit keyword arguments override it.
        train_data, val_data: a torch Dataset of dict samples, a 🤗 ``datasets.Dataset`` or a list of dicts.
        n_epochs, batch_size, gradient_accumulation_steps, learning_rate, optimizer (adamw|sgd|lion),
        weight_decay, lr_scheduler (a ``transformers.get_scheduler`` name), warmup_steps (optimizer steps),
        max_grad_norm (None: no clipping), max_steps (optimizer steps), seed, shuffle: as in ``TrainingConfig``.
        use_amp: mixed precision — fp16 on CUDA, bf16 elsewhere; ``mixed_precision`` ("no"/"fp16"/"bf16") wins.
        gradient_checkpointing, compile: memory / speed switches.
        collate_fn: list of samples → batch. loss_fn: ``loss_fn(model, batch)`` → mean loss over the batch.
        use_wandb: True (wandb) or a tracker name ("tensorboard", "mlflow") logged through Accelerate.
        output_dir: where ``history.jsonl`` and ``metrics.json`` go (nothing is written when None).
        **more: other ``TrainingConfig`` fields (``items``, ``on_nonfinite``, ``eval_every``, …) and the
            ``Job`` hooks ``count_items``, ``eval_step``, ``compute_metrics``, ``param_groups``,
            ``before_window``, ``enable_checkpointing``, ``length_of`` (see ``finetune.job.Job``).

    Returns:
        ``finetune.loop.TrainResult``, read as a dict or by attribute: ``grad_norm_history``, ``loss_history``,
        ``lr_history`` (one per optimizer step),
        ``optimizer_steps``, ``micro_batches``, ``effective_batch_size``, ``final_loss`` (validation loss at the
        end when ``val_data`` is given, else the last window's loss), ``val_history``, ``history`` (the
        ``history.jsonl`` records) and ``model`` (trained in place, unwrapped).

    Raises:
        ConfigError: a bad argument, naming it and what is allowed.
    """
    from accelerate.utils import set_seed

    from finetune import loop, outputs

    if train_data is None:
        raise ConfigError("train_data: required (a torch Dataset, a datasets.Dataset or a list of dicts)")
    check_arguments(model, train_data, val_data, loss_fn, collate_fn)
    given = {k: v for k, v in locals().items() if k in _passed}
    given.update(more)
    t = _training_config(config, given)
    hooks = {k: more.pop(k) for k in _HOOKS if k in more}
    set_seed(t.seed)
    job = Job(model=model, train_data=_as_dataset(train_data), val_data=_as_dataset(val_data),
              collate_fn=collate_fn, loss_fn=loss_fn, **hooks)
    log_with = None
    if use_wandb:
        log_with = "wandb" if use_wandb is True else use_wandb
    result = loop.train(job, t, loop.Outputs(dir=output_dir, tracker=log_with, settings=dataclasses.asdict(t)))
    if output_dir is not None and result["accelerator"].is_main_process:
        outputs.write_metrics(result, output_dir)
    return result


test_fine_tuning.__test__ = False  # not a pytest test, whatever module imports it
# the keywords that are not training fields (the model, data, hooks and switches of the call itself)
_API_ARGUMENTS = {*inspect.signature(test_fine_tuning).parameters, *_HOOKS} - {"more", "_passed"}


def check_arguments(model, train_data, val_data, loss_fn=None, collate_fn=None) -> None:
    """Refuse, naming the argument, what the loop cannot use — rather than a TypeError from collate or backward."""
    import torch

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


def _training_config(config, given: dict) -> TrainingConfig:
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
    renamed = {alias: name.split(".", 1)[1] for name, alias in fields_with("alias").items()
               if name.startswith("training.")}
    fields = {f.name for f in dataclasses.fields(TrainingConfig)}
    raw = {}
    for key, value in {**base, **given}.items():
        key = renamed.get(key, key)
        if key in fields or key not in _API_ARGUMENTS:  # an unknown keyword is reported by build_section
            raw[key] = value
    if given.get("mixed_precision") is None and "mixed_precision" in raw and raw["mixed_precision"] is None:
        del raw["mixed_precision"]
    if given.get("use_amp") or (base.get("use_amp") and "mixed_precision" not in given):
        if raw.get("mixed_precision") in (None, "no"):
            import torch

            raw["mixed_precision"] = "fp16" if torch.cuda.is_available() else "bf16"
    problems = []
    t = build_section(TrainingConfig, raw, "training", problems)
    if problems:
        raise ConfigError(problems)
    validate_training(t, problems)
    if problems:
        raise ConfigError(problems)
    return t


def _as_dataset(data):
    """🤗 datasets come back as python lists; ask for tensors so the default collate works."""
    if data is None:
        return None
    try:
        import datasets
    except ImportError:
        return data
    if isinstance(data, datasets.Dataset) and data.format["type"] is None:
        return data.with_format("torch")
    return data
