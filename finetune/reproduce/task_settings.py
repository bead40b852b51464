"""The settings a baseline's task trains with beyond the TrainingArguments: its data (length, truncation, packing, the
tokens trained on) and its TRL trainer's own (``DPOConfig``'s beta and loss, ``GRPOConfig``'s generation), each
carried onto the recipe's field of the same meaning where the recipe's task has it."""

from __future__ import annotations

import typing

from finetune.registry import built_in_hints
from finetune.reproduce.objective import instruction_task, said_objective
from finetune.reproduce.record import Baseline, Imported


def task_settings() -> tuple:
    """A TRL trainer's own settings that change its steps, each carried onto the recipe's model field of the same
    name and meaning: the model settings the tasks that a TRL trainer trains declare as shaping their step
    (``CompareHints.step_settings``)."""
    return tuple(dict.fromkeys(s.split(".", 1)[1] for h in built_in_hints().values() if h.trl_marks is not None
                               for s in h.step_settings if s.startswith("model.")))


# GRPOConfig settings that change the steps and that the grpo task has no counterpart for: name → (TRL 1.16's
# default, why)
GRPO_NO_COUNTERPART = {
    "delta": (None, "finetune's grpo clips the ratio on one side per advantage sign, as TRL without delta"),
    "importance_sampling_level": ("token", "finetune's grpo weighs each token by its own ratio"),
    "mask_truncated_completions": (False, "finetune's grpo trains on truncated completions too"),
    "top_k": (0, "finetune's grpo samples with top_k 0"),
    "min_p": (None, "finetune's grpo samples without min_p"),
    "repetition_penalty": (1.0, "finetune's grpo samples without a repetition penalty"),
    "generation_kwargs": (None, "finetune's grpo passes no other generation arguments"),
    "use_vllm": (False, "finetune's grpo samples with transformers' generate"),
    "sync_ref_model": (False, "finetune's reference model stays the initial model"),
    "top_entropy_quantile": (1.0, "finetune's grpo trains on every completion token"),
    "entropy_coef": (0.0, "finetune's grpo has no entropy bonus"),
    "off_policy_mask_threshold": (None, "finetune's grpo masks no off-policy sequences"),
    "multi_objective_aggregation": ("sum_then_normalize", "finetune's grpo sums the weighted rewards, then "
                                    "normalises"),
    "cast_lm_head_to_fp32": (False, "finetune leaves the output layer's dtype as loaded"),
}


def data_settings(b: Baseline, out: Imported, data_fields: set) -> None:
    get = b.get
    length = get("max_length") or get("max_seq_length")
    if length:
        name = "max_length" if "max_length" in b.args else "max_seq_length"
        field = next((f for f in ("max_length", "seq_len") if f in data_fields), None)
        if field:
            out.set(f"data.{field}", int(length), b.args[name][1])
        else:
            out.skip(name, length, "this recipe's task has no data.max_length / data.seq_len")
        if b.trl and "too_long" in data_fields and not get("packing"):  # TRL cuts longer rows, never drops them
            mode = str(get("truncation_mode") or "keep_start")
            out.set("data.too_long", mode, f"{b.args[name][1]}: TRL truncates rows longer than {name}={length} "
                                           f"(truncation_mode={mode})")
    if get("packing"):
        _packing(b, out, data_fields)
    train_on, key = _train_on(b)
    if train_on is not None:
        if "train_on" in data_fields:
            out.set("data.train_on", train_on, (str(b.args[key][1]) if key == "train_on" else
                                                f"{b.args[key][1]}: {key}={get(key)}") + (
                " (TRL's default: the loss after the prompt, on prompt/completion rows; rows of messages train on "
                "every token there: set data.train_on=all for those)" if train_on == "completion" else ""))
        elif train_on != "all":
            out.skip(key, get(key), ("" if key != "train_on" else f"{b.args[key][1]}; ") +
                     "this recipe's task trains on every token (no data.train_on)")
    if "system_prompt" in data_fields:
        out.set("data.system_prompt", None, "the baseline's rows as they are: a Trainer / TRL / axolotl run adds no "
                                            "system message (the template's own default stays)")


def trl_shuffled(b: Baseline) -> tuple | None:
    """(seed, where) of TRL's one shuffle of an SFT run's rows before its sampler (``shuffle_dataset``: TRL 1.16's
    ``SFTTrainer._prepare_dataset`` ends with ``dataset.shuffle(seed=args.seed)``, trl/trainer/sft_trainer.py:1482,
    after tokenizing), for ``Baseline.shuffled``; None where it did not, where it packed the shuffled rows (named by
    :func:`_packing`), or where the run is not an SFT run (GRPOConfig's ``shuffle_dataset`` is its sampler's)."""
    if not (b.trl and b.get("shuffle_dataset")) or b.get("packing"):
        return None
    objective = said_objective(b)
    if objective is not None and objective.name != instruction_task():
        return None
    seed = int(b.get("seed") if b.get("seed") is not None else 42)
    return seed, f"{b.args['shuffle_dataset'][1]}: shuffle_dataset=True, TRL's SFTTrainer shuffling its tokenized " \
                 f"rows with the seed ({seed})"


def trl_train_on(b: Baseline, kind: str) -> tuple[str, str]:
    """(data.train_on, why) as TRL 1.16's SFTTrainer trains on rows of format ``kind``: the assistant's tokens with
    ``assistant_only_loss``; else, on prompt/completion rows, the completion (``completion_only_loss`` None or True);
    else every token (rows of messages or text)."""
    get = b.get
    if get("assistant_only_loss"):
        return "assistant", f"{b.args['assistant_only_loss'][1]}: assistant_only_loss=True"
    if kind == "prompt-completion" and get("completion_only_loss") is not False:
        return "completion", f"--data: prompt/completion rows, completion_only_loss={get('completion_only_loss')}"
    return "all", f"--data: {kind} rows, trained on every token by TRL (no assistant_only_loss)"


def _packing(b: Baseline, out: Imported, data_fields: set) -> None:
    """TRL's packing (the whole data set packed before sampling) onto ``data.pack`` where the task has it."""
    strategy = str(b.get("packing_strategy") or "bfd")
    where = b.args["packing"][1]
    if "pack" not in data_fields or strategy not in ("bfd", "wrapped"):
        out.skip("packing", True, "it packs the whole data set before sampling, so its batches are of packed rows; "
                 + ("this recipe's task cannot pack as TRL does" if "pack" not in data_fields else
                    f"finetune packs as TRL's bfd and wrapped, not {strategy}"))
        out.other_samples = "the baseline's batches were of TRL's packed rows"
        return
    out.set("data.pack", strategy, f"{where}: packing=True, packing_strategy={strategy}")
    out.set("training.packing", False, "TRL packed the data set itself: its rows are the samples")
    if b.get("shuffle_dataset"):
        out.skip("shuffle_dataset", True, "TRL shuffled the rows before packing them; finetune packs them in order")


def _train_on(b: Baseline) -> tuple:
    """(data.train_on, the argument it comes from) — (None, None) when the source says nothing."""
    get = b.get
    if "train_on" in b.args:  # finetune's own name, read by a source from its tool's key (torchtune's, axolotl's)
        return get("train_on"), "train_on"
    if get("assistant_only_loss"):
        return "assistant", "assistant_only_loss"
    if "completion_only_loss" in b.args and get("completion_only_loss") is not False:
        return "completion", "completion_only_loss"  # TRL: None means on for prompt/completion rows
    if "assistant_only_loss" in b.args or "completion_only_loss" in b.args:
        return "all", next(k for k in ("completion_only_loss", "assistant_only_loss") if k in b.args)
    return None, None


def task_model_settings(b: Baseline, out: Imported, model_fields: dict) -> None:
    """The TRL trainer's own settings (``task_settings()``) onto the recipe's model fields of the same name; a value
    the task does not have (a loss type it lacks) is said as not carried."""
    for name in task_settings():
        if name not in b.args or name not in model_fields:
            continue
        value = b.get(name)
        if name == "loss_type" and isinstance(value, list):  # DPOConfig: a list of losses, weighted
            if len(value) != 1:
                out.skip(name, value, "finetune's dpo trains one loss type")
                continue
            value = value[0]
        if name == "scale_rewards" and isinstance(value, bool):  # GRPOConfig reads True / False so
            value = "group" if value else "none"
        allowed = typing.get_args(model_fields[name]) if typing.get_origin(model_fields[name]) is typing.Literal \
            else None
        if allowed and value not in allowed:
            out.skip(name, value, f"this recipe's task has {name} {', '.join(allowed)}")
            continue
        out.set(f"model.{name}", value, b.args[name][1])


def grpo_settings(b: Baseline, out: Imported, model_fields: dict) -> None:
    """A TRL GRPOTrainer's generation batch (completions: per-device batch × processes × its steps_per_generation,
    which counts micro-batches), what the grpo task cannot carry, and that its samples are drawn anew."""
    get = b.get
    size, where = get("generation_batch_size"), None
    if size:
        where = b.args["generation_batch_size"][1]
    elif get("steps_per_generation") and get("per_device_train_batch_size"):
        devices = b.process_count()
        size = int(get("per_device_train_batch_size")) * devices * int(get("steps_per_generation"))
        where = (f"{b.args['steps_per_generation'][1]}: per-device batch × {devices} process"
                 f"{'es' if devices > 1 else ''} × steps_per_generation (micro-batches)")
    elif get("per_device_train_batch_size"):
        size, where = b.effective_batch(), "TRL's default: one generation batch per optimizer step"
    if size and "generation_batch_size" in model_fields:
        out.set("model.generation_batch_size", int(size), where)
    for name, (default, why) in GRPO_NO_COUNTERPART.items():
        # None where the default is off (top_k 0, use_vllm false): off too (older TRL's top_k=None filters nothing)
        off = (default, {}) + ((None,) if default in (0, False, None) else ())
        if get(name, default) not in off:
            out.skip(name, get(name), why)
    if "disable_dropout" in b.args and "dropout" in model_fields and get("disable_dropout"):
        out.set("model.dropout", 0.0, f"{b.args['disable_dropout'][1]}: disable_dropout")
    _reward_funcs(b, out)
    out.not_carried.append("not carried: the sampler's draws — TRL shuffles its prompts and samples completions with "
                           "its own random state, finetune draws its own: to take the baseline's steps, replay its "
                           "completions with model.rollouts (a rollouts.jsonl)")


def _reward_funcs(b: Baseline, out: Imported) -> None:
    """The baseline's reward functions are its script's (open-r1's ``reward_funcs: [accuracy, format]`` names its
    own), never carried; their weights go with them: a recipe's functions with another count of weights would not
    validate."""
    weights = out.values.get("model.reward_weights")
    if weights is not None:
        del out.values["model.reward_weights"]
        out.rows = [r for r in out.rows if r[0] != "model.reward_weights"]
        out.skip("reward_weights", weights, "the weights of the baseline's reward functions, which are not carried: "
                 "set them with model.reward_funcs")
    if b.get("reward_funcs") is not None:
        out.skip("reward_funcs", b.get("reward_funcs"), "the names of its script's reward functions, not "
                 "finetune's: set model.reward_funcs to their counterparts (module:function)")
    else:
        out.not_carried.append("not carried: the reward functions — a TRL folder does not name them: set "
                               "model.reward_funcs to the baseline's")
