"""A baseline's settings as finetune's recipe values: what ``finetune import`` writes into a recipe and what
``finetune compare`` checks a run against. ``carry`` turns a :class:`baselines.Baseline` into recipe fields, each
with where it came from, and says which settings have no counterpart; ``model_difference`` tells two models'
architectures apart."""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path

from finetune.models.hf import resolve_model_path
from finetune.optimizers import OPTIMIZERS
from finetune.reproduce.record import Baseline

SCHEDULERS = {"linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay"}
# settings that change the step and that finetune has no counterpart for: TrainingArguments name → why
NO_COUNTERPART = {
    "neftune_noise_alpha": "finetune has no NEFTune",
    "label_smoothing_factor": "finetune's losses have no label smoothing",
    "lr_scheduler_kwargs": "finetune passes no scheduler arguments",
    "cosine_min_lr_ratio": "finetune passes no scheduler arguments",
    "group_by_length": "finetune draws no length-grouped order; its windows sort by length inside (same samples)",
    "tf32": "finetune leaves torch's matmul precision as it is",
}
# TrainingArguments defaults: a setting at its default needs no line
DEFAULTS = {"neftune_noise_alpha": None, "label_smoothing_factor": 0.0, "lr_scheduler_kwargs": None,
            "cosine_min_lr_ratio": None, "group_by_length": False, "tf32": None}


# A TRL trainer's own settings that change its steps (GRPOConfig, DPOConfig), each carried onto the recipe's model field
# of the same name and meaning where the recipe's task has that field.
TASK_SETTINGS = ("beta", "loss_type", "label_smoothing", "num_generations", "num_iterations", "epsilon",
                 "epsilon_high", "temperature", "top_p", "max_completion_length", "scale_rewards", "reward_weights",
                 "use_bias_correction_kl")
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

# what a model card never lists, with the Trainer's defaults
CARD_OMITS = {"weight_decay": 0.0, "max_grad_norm": 1.0, "data_seed": None, "bf16": False}


class Imported:
    """The recipe being written: ``set`` records each value with its source, ``skip`` each setting not carried."""

    def __init__(self):
        self.rows, self.not_carried, self.values, self.missing = [], [], {}, []
        # why the baseline's batches held other samples than the recipe's (a packing not taken): compare cannot
        # check its windows against them
        self.other_samples: str | None = None

    def set(self, name: str, value, source: str) -> None:
        """``name`` = ``value`` from ``source``; a later source of the same field (the data's rows over the
        arguments) replaces the earlier row."""
        self.values[name] = value
        self.rows = [r for r in self.rows if r[0] != name] + [(name, value, source)]

    def skip(self, setting: str, value, why: str) -> None:
        self.not_carried.append(f"not carried: {setting}={value} — {why}")


def carry(base: Baseline, model_fields: dict, data_fields: set, steps: int | None = None,
          initial_adapter=None, own_step: bool = False) -> Imported:
    """Map the baseline's settings onto recipe fields (``section.name``); ``model_fields``: the recipe's model
    section, field name → type; ``steps``: the optimizer steps the run took, when the source does not say them (for
    a warm-up ratio); ``own_step``: take the baseline tool's own step where it is not the big batch's (its
    ``carry_own`` says which it can)."""
    out = Imported()
    src = lambda name: base.args[name][1]  # noqa: E731
    get = base.get

    total = base.effective_batch()
    if total:
        if get("total_train_batch_size"):
            where = f"{src('total_train_batch_size')}: total_train_batch_size"
        else:
            devices = get("num_devices")
            where = f"{src('per_device_train_batch_size')} × accumulation × " + (
                f"{devices} devices" if devices else "1 process (the source names no process count)")
        out.set("training.effective_batch_size", total, where)
        out.set("training.gradient_accumulation_steps", None, "derived from the effective batch and your micro-batch")
    for name, field in (("learning_rate", "training.learning_rate"), ("weight_decay", "training.weight_decay")):
        if get(name) is not None:
            out.set(field, float(get(name)), src(name))
    _scheduler(base, out, steps)
    _length(base, out)
    _optimizer(base, out)
    if "max_grad_norm" in base.args:
        norm = get("max_grad_norm")
        out.set("training.max_grad_norm", float(norm) if norm else None, src("max_grad_norm"))
    if get("bf16") or get("fp16"):
        which = "bf16" if get("bf16") else "fp16"
        out.set("training.mixed_precision", which, src(which))
    elif "bf16" in base.args or "fp16" in base.args:
        out.set("training.mixed_precision", "no", src("bf16" if "bf16" in base.args else "fp16"))
    if get("gradient_checkpointing"):
        out.set("training.gradient_checkpointing", True, src("gradient_checkpointing"))
    _eval(base, out)
    if _lora(base, out):
        _lora_start(base, out, initial_adapter)
    _quantization(base, out, model_fields)
    if base.get("model_dtype") and "dtype" in model_fields:  # the frozen base's dtype, as the source's reader says
        out.set("model.dtype", base.get("model_dtype"), base.args["model_dtype"][1])
    _data(base, out, data_fields)
    _seed_and_order(base, out)  # after _data: a packing it carried makes the packed rows the samples
    _task_settings(base, out, model_fields)
    if base.get("num_generations") is not None:
        _grpo(base, out, model_fields)
    if base.kind == "model card":  # the card lists only some arguments: the others are the recipe's own
        missing = [f"{k} (Trainer default {v})" for k, v in CARD_OMITS.items() if k not in base.args]
        if missing:
            out.not_carried.append("not in the model card, the recipe's values kept: " + ", ".join(missing))
    for name, why in NO_COUNTERPART.items():
        if get(name, DEFAULTS[name]) not in (DEFAULTS[name], {}, 0, 0.0, False):
            out.skip(name, get(name), why)
    _drop_last(base, out)
    if "beta" not in model_fields:  # a preference or policy task sums its own loss: no Trainer count divides it
        _loss_divisor(base, out)
    for setting, value, why in base.uncarried:  # what the source's own reader knows finetune lacks
        out.skip(setting, value, why)
    if base.source is not None:  # a tool's own settings (LLaMA-Factory's template, stage), last
        base.source.carry_own(base, out, model_fields, data_fields, own_step)
    return out


# HF Trainer divided a window's summed loss by its labels counted before a causal LM's shift (num_items_in_batch)
# from transformers 4.46, which introduced that count, until 5.10 counted after it
UNSHIFTED_COUNT = ((4, 46), (5, 10))


def _loss_divisor(base: Baseline, out: Imported) -> None:
    """The divisor of the Trainer version that trained the baseline (its card's Framework versions): before 5.10,
    one label more per row whose first label trains (``training.loss_divisor: labels``)."""
    version = base.get("transformers_version")
    if version is None:
        return
    parts = tuple(int(x) for x in str(version).split(".")[:2])
    if UNSHIFTED_COUNT[0] <= parts < UNSHIFTED_COUNT[1]:
        out.set("training.loss_divisor", "labels", f"{base.args['transformers_version'][1]}: Transformers "
                f"{version}, whose Trainer divides each window's loss by its labels before the shift")


def _drop_last(base: Baseline, out: Imported) -> None:
    """An epoch's dropped tail: the source's own (torchtune's incomplete last window) or the Trainer's
    ``dataloader_drop_last`` (its incomplete last micro-batch: per-device batch × processes)."""
    if base.get("drop_last"):
        out.set("training.drop_last", int(base.get("drop_last")), base.args["drop_last"][1])
    elif base.get("dataloader_drop_last") and base.get("per_device_train_batch_size"):
        size = int(base.get("per_device_train_batch_size")) * int(base.get("num_devices") or 1)
        out.set("training.drop_last", size, f"{base.args['dataloader_drop_last'][1]}: dataloader_drop_last, the "
                                            "incomplete last micro-batch of each epoch dropped")


def _scheduler(base: Baseline, out: Imported, steps_given: int | None) -> None:
    get = base.get
    kind = get("lr_scheduler_type")
    if kind is not None:
        if str(kind) in SCHEDULERS:
            out.set("training.lr_scheduler", str(kind), base.args["lr_scheduler_type"][1])
        else:
            out.skip("lr_scheduler_type", kind, f"finetune's schedulers are {', '.join(sorted(SCHEDULERS))}")
    # transformers 5: warmup_steps below 1 is a ratio (TrainingArguments has no warmup_ratio); older arguments and
    # axolotl have warmup_ratio. The Trainer's warmup_steps are what it took, 0 too: a ratio from another file (the
    # axolotl config beside its arguments) never overrides them; a ratio in the same file is used when they are 0
    # (transformers 4's rule). A ratio becomes steps as the source's tool rounds it (its source's warmup), else as
    # TrainingArguments.get_warmup_steps does: ceil(steps × ratio).
    steps, ratio, ratio_src = get("warmup_steps"), get("warmup_ratio"), None
    if steps is not None and 0 < float(steps) < 1:
        ratio, ratio_src = float(steps), base.args["warmup_steps"][1]
    elif steps is not None and (float(steps) >= 1 or not ratio or _origin(base, "warmup_ratio") !=
                                _origin(base, "warmup_steps")):
        out.set("training.warmup_steps", int(steps), base.args["warmup_steps"][1])
        return
    elif ratio:
        ratio, ratio_src = float(ratio), base.args["warmup_ratio"][1]
    if not ratio:
        return
    total = get("schedule_steps") or (get("max_steps") if (get("max_steps") or -1) > 0 else None)
    where = base.args["schedule_steps" if get("schedule_steps") else "max_steps"][1] if total else "--steps"
    n = int(total or steps_given) if total or steps_given else None
    warmup, how = (base.source and base.source.warmup(base, ratio, n)) or trainer_warmup(ratio, n)
    if warmup is not None:
        out.set("training.warmup_steps", warmup, f"{ratio_src}: ratio {ratio:g} × {total or steps_given} steps "
                                                 f"({where}), {how}")
    else:
        out.skip("warmup ratio", ratio, "this source does not say how many optimizer steps the run took; give "
                 f"--steps N, or set training.warmup_steps={how}")


def trainer_warmup(ratio: float, total: int | None) -> tuple:
    """(warm-up steps, how they were rounded) for a warm-up ratio over ``total`` optimizer steps, as transformers
    rounds it (up); (None, the formula) when the steps are unknown."""
    if total is None:
        return None, f"ceil({ratio:g} × N) (transformers rounds up)"
    return math.ceil(total * ratio), "rounded up as transformers does"


def _origin(base: Baseline, name: str) -> str | None:
    """The file a setting was read from (its source less the key it names)."""
    return base.args[name][1].split(": ")[0] if name in base.args else None


def _length(base: Baseline, out: Imported) -> None:
    get = base.get
    epochs, max_steps = get("num_train_epochs"), get("max_steps")
    if max_steps is not None and int(max_steps) > 0:
        out.set("training.max_steps", int(max_steps), base.args["max_steps"][1])
        out.set("training.epochs", max(1, math.ceil(int(max_steps) / max(1, int(get("schedule_steps") or
                                                                                max_steps)))), "derived")
    elif epochs is not None:
        if float(epochs) != int(float(epochs)):
            out.set("training.epochs", math.ceil(float(epochs)), base.args["num_train_epochs"][1])
            out.skip("num_train_epochs", epochs, "finetune trains whole epochs; set training.max_steps to the "
                     "baseline's step count to stop where it stopped")
        else:
            out.set("training.epochs", int(float(epochs)), base.args["num_train_epochs"][1])


def trainer_optimizers() -> dict:
    """TrainingArguments.optim → training.optimizer, from the optimizer table's ``trainer_names`` (read at each
    call: an entry added to the table is imported at once)."""
    return {trainer: ours for ours, entry in OPTIMIZERS.items() for trainer in entry.trainer_names}


def _optimizer(base: Baseline, out: Imported) -> None:
    get = base.get
    optim = get("optim")
    if optim is not None:
        ours = trainer_optimizers().get(str(optim).lower())
        if ours:
            out.set("training.optimizer", ours, base.args["optim"][1])
        else:
            out.skip("optim", optim, f"finetune's optimizers are {', '.join(OPTIMIZERS)}")
    if get("adam_beta1") is not None or get("adam_beta2") is not None:
        betas = [float(get("adam_beta1", 0.9)), float(get("adam_beta2", 0.999))]
        out.set("training.betas", betas, base.args["adam_beta1" if "adam_beta1" in base.args else "adam_beta2"][1])
    eps = get("adam_epsilon")
    if eps is not None and float(eps) != 1e-8:
        out.skip("adam_epsilon", eps, "finetune's AdamW uses torch's eps 1e-8")


def _seed_and_order(base: Baseline, out: Imported) -> None:
    get = base.get
    seed, data_seed = get("seed"), get("data_seed")
    if data_seed is not None and data_seed != seed:
        out.set("training.seed", int(data_seed), f"{base.args['data_seed'][1]}: data_seed, the seed of the order")
        if seed is not None:
            out.skip("seed", seed, f"finetune has one seed; data_seed={data_seed} is taken, for the sample order "
                     "(dropout and new weights draw from it too)")
    elif seed is not None:
        out.set("training.seed", int(seed), base.args["seed"][1])
    strategy = str(get("train_sampling_strategy") or "random")
    # TRL's packed rows are its samples, drawn in a seeded order too, where data.pack carries the packing
    if (get("packing") and "data.pack" not in out.values) or get("group_by_length") or \
            strategy not in ("random", "sequential"):
        return  # their order is not a seeded permutation of the samples (said by their own not-carried lines)
    if strategy == "sequential":
        out.set("training.shuffle", False, base.args["train_sampling_strategy"][1])
    else:
        out.set("training.sample_order", "trainer",
                "HF Trainer's random sampler (axolotl and TRL train with it too)")


def _eval(base: Baseline, out: Imported) -> None:
    strategy = str(base.get("eval_strategy") or base.get("evaluation_strategy") or "")
    if strategy == "steps" and base.get("eval_steps"):
        out.set("training.eval_every", int(base.get("eval_steps")), base.args["eval_steps"][1])


def _lora(base: Baseline, out: Imported) -> bool:
    """LoRA's settings, or that there is none; True when the baseline trained adapters."""
    a, get = base.adapter_config, base.get
    if a and a.get("peft_type", "LORA") == "LORA":
        where = "adapter_config.json"
        values = {"r": a.get("r"), "alpha": a.get("lora_alpha"), "dropout": a.get("lora_dropout"),
                  "target_modules": a.get("target_modules"), "modules_to_save": a.get("modules_to_save")}
    elif get("adapter") in ("lora", "qlora"):
        where = base.args["adapter"][1].split(":")[0]
        values = {"r": get("lora_r"), "alpha": get("lora_alpha"), "dropout": get("lora_dropout"),
                  "target_modules": get("lora_target_modules"), "modules_to_save": None}
        if get("lora_target_linear"):
            out.skip("lora_target_linear", True, "finetune names the adapted modules; list the model's linear "
                     "layers in peft.target_modules")
    elif base.kind == "Trainer folder" and base.weights is not None and base.weights.name == "model.safetensors":
        out.set("peft.enabled", False, f"{base.weights.name} and no adapter_config.json: every weight trained")
        return False
    elif "adapter" in base.args and get("adapter") is None:  # the baseline says so (torchtune's model component)
        out.set("peft.enabled", False, base.args["adapter"][1])
        return False
    else:
        out.skip("LoRA or not", "unknown", f"the {base.kind} does not say; the recipe's peft section is kept")
        return False
    out.set("peft.enabled", True, where)
    for key, value in values.items():
        if value is not None:
            if key == "target_modules" and isinstance(value, str):
                value = [value]  # peft's "all-linear" too: finetune's peft.target_modules takes [all-linear]
            out.set(f"peft.{key}", sorted(value) if isinstance(value, (list, set)) else value, where)
    return True


def _lora_start(base: Baseline, out: Imported, initial_adapter) -> None:
    """Where the adapters start: the baseline's saved initial adapters, TRL's draw replayed from the seed, or
    unknown (said)."""
    if initial_adapter is not None:
        out.set("peft.init_from", str(initial_adapter), "--initial-adapter: the adapters before the first step")
    elif base.trl:
        out.not_carried.append("adapters' start: replayed — TRL draws them right after set_seed(seed) and finetune "
                               "seeds the same way before building the model (checked with TRL 1.16, peft 0.21)")
    elif base.kind.startswith("torchtune"):
        out.skip("the adapters' start", "unknown", "torchtune draws them from its seed while it builds its own model "
                 "and saves none: give --initial-adapter DIR, the adapters drawn by replaying that build (seed, then "
                 "the model: examples/torchtune/make_baselines.py, initial_adapters)")
    else:
        out.skip("the adapters' start", "unknown", "a Trainer baseline drew them in its own script: the same only if "
                 "it called set_seed(seed) right before get_peft_model; else give --initial-adapter DIR (its adapters "
                 "saved before the first step)")


def _quantization(base: Baseline, out: Imported, model_fields: set) -> None:
    get, q = base.get, (base.model_config or {}).get("quantization_config") or {}
    kind = None
    if get("load_in_4bit") or q.get("load_in_4bit"):
        kind = str(get("bnb_4bit_quant_type") or q.get("bnb_4bit_quant_type") or "nf4")
    elif get("load_in_8bit") or q.get("load_in_8bit"):
        kind = "int8"
    if kind is None:
        return
    where = base.args["load_in_4bit" if get("load_in_4bit") else "load_in_8bit"][1].split(":")[0] \
        if get("load_in_4bit") or get("load_in_8bit") else "config.json: quantization_config"
    if "quantization" in model_fields and kind in ("nf4", "fp4", "int8"):
        out.set("model.quantization", kind, where)
        if kind == "int8" and out.values.get("training.gradient_checkpointing"):
            # it saves memory and changes no step; finetune's int8 layers keep their inputs where it cannot free them
            del out.values["training.gradient_checkpointing"]
            out.rows = [r for r in out.rows if r[0] != "training.gradient_checkpointing"]
            out.not_carried.append("note: gradient_checkpointing=True left off — int8 layers keep their inputs "
                                   "outside autograd, where checkpointing cannot free them; it changes memory, not "
                                   "the step")
    else:
        out.skip("quantization", kind, "this recipe's task has no model.quantization")


def _data(base: Baseline, out: Imported, data_fields: set) -> None:
    get = base.get
    length = get("max_length") or get("max_seq_length")
    if length:
        name = "max_length" if "max_length" in base.args else "max_seq_length"
        field = next((f for f in ("max_length", "seq_len") if f in data_fields), None)
        if field:
            out.set(f"data.{field}", int(length), base.args[name][1])
        else:
            out.skip(name, length, "this recipe's task has no data.max_length / data.seq_len")
        if base.trl and "too_long" in data_fields and not get("packing"):  # TRL cuts longer rows, never drops them
            mode = str(get("truncation_mode") or "keep_start")
            out.set("data.too_long", mode, f"{base.args[name][1]}: TRL truncates rows longer than {name}={length} "
                                           f"(truncation_mode={mode})")
    if get("packing"):
        _packing(base, out, data_fields)
    train_on, key = _train_on(base)
    if train_on is not None:
        if "train_on" in data_fields:
            out.set("data.train_on", train_on, f"{base.args[key][1]}: {key}={get(key)}" + (
                " (TRL's default: the loss after the prompt, on prompt/completion rows; rows of messages train on "
                "every token there: set data.train_on=all for those)" if train_on == "completion" else ""))
        elif train_on != "all":
            out.skip(key, get(key), "this recipe's task trains on every token (no data.train_on)")
    if "system_prompt" in data_fields:
        out.set("data.system_prompt", None, "the baseline's rows as they are: a Trainer / TRL / axolotl run adds no "
                                            "system message (the template's own default stays)")


def row_format(path) -> str | None:
    """``messages``, ``prompt-completion``, ``text``, ``preference-text`` or ``preference-messages``: the format of a
    data file's first row (None: unreadable or none of them)."""
    path = Path(path)
    try:
        if path.suffix.lower() in (".jsonl", ".json") and path.stat().st_size:
            with open(path, encoding="utf-8") as f:
                first = f.readline() if path.suffix.lower() == ".jsonl" else f.read()
            row = json.loads(first)
            row = row[0] if isinstance(row, list) and row else row
        else:
            import datasets  # lazy: 0.6 s on every command (this module is on each one's path)

            row = datasets.load_dataset(path.suffix.lstrip(".").replace("jsonl", "json"), data_files=str(path),
                                        split="train[:1]")[0]
    except Exception:  # the run reads the file again and says what is wrong with it
        return None
    if not isinstance(row, dict):
        return None
    if "chosen" in row:  # preference pairs: TRL renders conversations, and takes text as it is
        return "preference-text" if isinstance(row["chosen"], str) else "preference-messages"
    if "messages" in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt-completion"
    return "text" if "text" in row else None


def trl_train_on(base: Baseline, kind: str) -> tuple[str, str]:
    """(data.train_on, why) as TRL 1.16's SFTTrainer trains on rows of format ``kind``: the assistant's tokens with
    ``assistant_only_loss``; else, on prompt/completion rows, the completion (``completion_only_loss`` None or True);
    else every token (rows of messages or text)."""
    get = base.get
    if get("assistant_only_loss"):
        return "assistant", f"{base.args['assistant_only_loss'][1]}: assistant_only_loss=True"
    if kind == "prompt-completion" and get("completion_only_loss") is not False:
        return "completion", f"--data: prompt/completion rows, completion_only_loss={get('completion_only_loss')}"
    return "all", f"--data: {kind} rows, trained on every token by TRL (no assistant_only_loss)"


def _packing(base: Baseline, out: Imported, data_fields: set) -> None:
    """TRL's packing (the whole data set packed before sampling) onto ``data.pack`` where the task has it."""
    strategy = str(base.get("packing_strategy") or "bfd")
    where = base.args["packing"][1]
    if "pack" not in data_fields or strategy not in ("bfd", "wrapped"):
        out.skip("packing", True, "it packs the whole data set before sampling, so its batches are of packed rows; "
                 + ("this recipe's task cannot pack as TRL does" if "pack" not in data_fields else
                    f"finetune packs as TRL's bfd and wrapped, not {strategy}"))
        out.other_samples = "the baseline's batches were of TRL's packed rows"
        return
    out.set("data.pack", strategy, f"{where}: packing=True, packing_strategy={strategy}")
    out.set("training.packing", False, "TRL packed the data set itself: its rows are the samples")
    if base.get("shuffle_dataset"):
        out.skip("shuffle_dataset", True, "TRL shuffled the rows before packing them; finetune packs them in order")


def _train_on(base: Baseline) -> tuple:
    """(data.train_on, the argument it comes from) — (None, None) when the source says nothing."""
    get = base.get
    if "train_on" in base.args:  # torchtune: finetune's own name
        return get("train_on"), "train_on"
    if "train_on_inputs" in base.args:  # axolotl
        return ("all" if get("train_on_inputs") else "assistant"), "train_on_inputs"
    if get("assistant_only_loss"):
        return "assistant", "assistant_only_loss"
    if "completion_only_loss" in base.args and get("completion_only_loss") is not False:
        return "completion", "completion_only_loss"  # TRL: None means on for prompt/completion rows
    if "assistant_only_loss" in base.args or "completion_only_loss" in base.args:
        return "all", next(k for k in ("completion_only_loss", "assistant_only_loss") if k in base.args)
    return None, None


def _task_settings(base: Baseline, out: Imported, model_fields: dict) -> None:
    """The TRL trainer's own settings (``TASK_SETTINGS``) onto the recipe's model fields of the same name; a value
    the task does not have (a loss type it lacks) is said as not carried."""
    for name in TASK_SETTINGS:
        if name not in base.args or name not in model_fields:
            continue
        value = base.get(name)
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
        out.set(f"model.{name}", value, base.args[name][1])


def _grpo(base: Baseline, out: Imported, model_fields: dict) -> None:
    """A TRL GRPOTrainer's generation batch (completions: per-device batch × processes × its steps_per_generation,
    which counts micro-batches), what the grpo task cannot carry, and that its samples are drawn anew."""
    get = base.get
    size, where = get("generation_batch_size"), None
    if size:
        where = base.args["generation_batch_size"][1]
    elif get("steps_per_generation") and get("per_device_train_batch_size"):
        devices = get("num_devices")
        size = int(get("per_device_train_batch_size")) * int(devices or 1) * int(get("steps_per_generation"))
        where = (f"{base.args['steps_per_generation'][1]}: per-device batch × {devices or 1} process"
                 f"{'es' if (devices or 1) > 1 else ''} × steps_per_generation (micro-batches)")
    elif get("per_device_train_batch_size"):
        size, where = base.effective_batch(), "TRL's default: one generation batch per optimizer step"
    if size and "generation_batch_size" in model_fields:
        out.set("model.generation_batch_size", int(size), where)
    for name, (default, why) in GRPO_NO_COUNTERPART.items():
        if get(name, default) not in (default, {}):
            out.skip(name, get(name), why)
    if "disable_dropout" in base.args and "dropout" in model_fields and get("disable_dropout"):
        out.set("model.dropout", 0.0, f"{base.args['disable_dropout'][1]}: disable_dropout")
    out.not_carried.append("not carried: the reward functions — a TRL folder does not name them: set "
                           "model.reward_funcs to the baseline's")
    out.not_carried.append("not carried: the sampler's draws — TRL shuffles its prompts and samples completions with "
                           "its own random state, finetune draws its own: to take the baseline's steps, replay its "
                           "completions with model.rollouts (a rollouts.jsonl)")


def training_file(out: Imported, data: str | None, data_fields: set, base: Baseline | None = None,
                  recipe: Path | None = None, said: str = "--data") -> None:
    """``--data FILE``: the baseline's training file, whole and in its order (the Trainer's order draws from it); for
    a TRL SFT baseline, the tokens it trained on, from the rows' format (``trl_train_on``). A baseline whose tool
    shuffled its rows once before training (``Baseline.shuffled``: axolotl) or held some out
    (``Baseline.held_out``: LLaMA-Factory's ``val_size``) trains on the rows it kept, in their order, written beside
    ``recipe`` (:func:`rows_in_order`); without ``--data`` or ``recipe`` that is said as not carried. ``said``: where
    the file comes from (``--data``, or the source's own naming of it)."""
    change = row_change(base)
    if data is None:
        if change is not None:
            out.skip(*change[:2], f"{change[2]}; give --data FILE, the rows it loaded, and import writes the rows "
                     "it trained on, in that order")
        return
    out.set("data.source", str(data), said)
    if change is not None:
        written = rows_in_order(data, change[3], recipe) if recipe is not None else None
        if written is None:
            out.skip(*change[:2], f"{change[2]}; import writes the rows it trained on from a local jsonl, json, "
                     "parquet or csv --data only")
        else:
            out.set("data.source", str(written), f"the rows of {data} ({said}) as it trained on them: {change[2]}")
    kind = row_format(data) if base is not None and base.trl else None
    if kind is not None and "train_on" in data_fields and not kind.startswith("preference"):
        train_on, why = trl_train_on(base, kind)
        out.set("data.train_on", train_on, why)
    if kind is not None and "text_rows" in data_fields:
        out.set("data.text_rows", "plain" if kind == "preference-text" else "chat",
                f"--data: {kind} rows" + (", tokenized as they are with an end token, as TRL's DPOTrainer"
                                          if kind == "preference-text" else ", rendered with the chat template"))
    for name, value in (("val_fraction", 0.0), ("limit", None)):
        if name in data_fields:
            out.set(f"data.{name}", value, "--data: the baseline trained on the whole file, in its order")


def row_change(base: Baseline | None) -> tuple | None:
    """How the baseline's tool changed its rows before the Trainer saw them: (the setting, its value, what it did,
    the rows it kept in their order as a function of the row count), or None. The orders are the ``datasets``
    library's own (they depend only on the row count and the seed)."""
    import datasets  # lazy: 0.6 s on every command (this module is on each one's path)

    rows = lambda n: datasets.Dataset.from_dict({"row": range(n)})  # noqa: E731
    if base is not None and base.shuffled is not None:
        seed, where = base.shuffled
        return ("the rows' order", f"shuffled with seed {seed}", f"{where}: the rows are shuffled once before "
                f"training, as datasets' Dataset.shuffle(seed={seed}) does",
                lambda n: rows(n).shuffle(seed=seed)["row"])
    if base is not None and base.held_out is not None:
        first, size, seed, where = base.held_out
        kept = lambda n: min(first, n) if first else n  # noqa: E731
        return ("the rows it trained on", f"first {first}" if not size else f"{size} held out (seed {seed})",
                f"{where}: " + (f"the first {first} rows kept" if first else "") + (", then " if first and size else "")
                + (f"the rows split before training, as datasets' train_test_split(test_size={size}, seed={seed}) "
                   "does, and the train part trained, in its order" if size else ""),
                lambda n: rows(kept(n)).train_test_split(test_size=size, seed=seed)["train"]["row"] if size else
                list(range(kept(n))))
    return None


def rows_in_order(data, order_of, recipe: Path) -> Path | None:
    """The rows of the local file ``data`` that ``order_of(row count)`` lists, in that order, written beside
    ``recipe`` (``RECIPE-rows.jsonl``; a jsonl's lines kept as they are, a parquet or csv file's format kept). None
    when ``data`` is not a local jsonl, json, parquet or csv file."""
    import datasets  # lazy: 0.6 s on every command (this module is on each one's path)

    path = Path(data)
    kind = path.suffix.lower().lstrip(".")
    if not path.is_file() or kind not in ("jsonl", "json", "parquet", "csv"):
        return None
    if kind == "jsonl":
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        out = recipe.with_name(f"{recipe.stem}-rows.jsonl")
        out.write_text("".join(lines[i] + "\n" for i in order_of(len(lines))), encoding="utf-8")
        return out
    table = datasets.load_dataset(kind, data_files=str(path), split="train")
    table = table.select(order_of(len(table)))
    out = recipe.with_name(f"{recipe.stem}-rows.{'jsonl' if kind == 'json' else kind}")
    {"json": table.to_json, "parquet": table.to_parquet, "csv": table.to_csv}[kind](str(out))
    return out


# ---------------------------------------------------------------------------------------------------------------
# the model check and the command


ARCHITECTURE = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "n_embd", "n_layer", "n_head")


def model_config_of(model_section) -> dict | None:
    """The architecture a recipe's model section names: its checkpoint's config.json, or ``model.config``."""
    name = getattr(model_section, "name_or_path", None)
    if name:
        folder = Path(resolve_model_path(name)) if not name.startswith("gguf:") else None
        if folder is not None and (folder / "config.json").is_file():
            return {**json.loads((folder / "config.json").read_text()), **(getattr(model_section, "config", None)
                                                                          or {})}
        return None
    return getattr(model_section, "config", None)


def model_difference(baseline: dict | None, mine: dict | None) -> str | None:
    """``hidden_size 64 vs 128`` for the first architecture field both name and disagree on; None when none."""
    if not baseline or not mine:
        return None
    for key in ARCHITECTURE:
        if key in baseline and key in mine and baseline[key] != mine[key]:
            return f"{key} {baseline[key]} vs {mine[key]}"
    return None
