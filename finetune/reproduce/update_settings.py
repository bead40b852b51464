"""The settings that shape each optimizer step beyond what the per-step layers see (the optimizer, its betas and
decay, the precision, the adapters, and each task's own: ``CompareHints.step_settings``), read from a run's resolved
config so that two runs, or a run and a baseline, can be held to each other's."""

from __future__ import annotations

from finetune.job import CompareHints
from finetune.registry import task_hints

# the settings of every task that shape each update beyond what the per-step layers see; the rest either does not
# change the steps or shows in them (lr, clipping, batch). A task adds its own (CompareHints.step_settings).
STEP_SETTINGS = ("training.optimizer", "training.weight_decay", "training.momentum", "training.betas",
                 "training.mixed_precision", "model.dtype", "model.quantization", "model.dropout", "peft.enabled",
                 "peft.r", "peft.alpha", "peft.dropout", "peft.target_modules", "peft.modules_to_save",
                 "training.drop_last", "training.loss_divisor", "model.master_weights")



# settings added after runs were written with their step: a run's config.yaml without one had its default then
ADDED_LATER = {"training.loss_divisor": "items", "model.master_weights": True}



def setting(config: dict | None, dotted: str):
    """``training.optimizer`` of a resolved config (None when absent)."""
    section, key = dotted.split(".")
    part = (config or {}).get(section)
    return part.get(key) if isinstance(part, dict) else None



def hints(config: dict | None) -> CompareHints:
    """What the task of a run's resolved config declares for compare (the defaults without a config)."""
    return task_hints(config["task"]) if config and config.get("task") else CompareHints()



def settings_of(config: dict | None) -> tuple:
    """The dotted settings that shape a run's update: every task's, then its task's own."""
    return STEP_SETTINGS + tuple(hints(config).step_settings)



def step_settings(values: dict, names: tuple) -> dict:
    """The settings ``names`` among dotted ``values`` (a run's, or what a baseline says), comparable: the adapted
    modules are a set, so their list is sorted."""
    return {k: sorted(v) if isinstance(v, list) and k.startswith("peft.") else v
            for k, v in values.items() if k in names}



def run_settings(config: dict | None, names: tuple | None = None) -> dict | None:
    """A run's update settings (``names``, else its own ``settings_of``) from its resolved config (None without
    one)."""
    names = names or settings_of(config)
    present = lambda k: k.split(".")[1] in ((config or {}).get(k.split(".")[0]) or {})  # noqa: E731
    return step_settings({k: setting(config, k) if present(k) or k not in ADDED_LATER else ADDED_LATER[k]
                          for k in names}, names) if config else None

