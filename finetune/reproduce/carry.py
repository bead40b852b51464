"""A baseline's settings as finetune's recipe values: what ``finetune import`` writes into a recipe and what
``finetune compare`` checks a run against. ``carry`` turns a ``record.Baseline`` into recipe fields (``Imported``),
each with where it came from, and says which settings have no counterpart (``record.Skip``); the task's own settings
are :mod:`task_settings`', the rows :mod:`rows`'."""

from __future__ import annotations

import math
import typing

from finetune.config import TrainingConfig
from finetune.optimizers import OPTIMIZERS
from finetune.reproduce.engine import engine_lines
from finetune.reproduce.record import Baseline, Imported, Where, file_of
from finetune.reproduce.task_settings import data_settings, grpo_settings, task_model_settings

# the schedules finetune takes: the recipe schema's (training.lr_scheduler), by transformers.get_scheduler's names
SCHEDULERS = frozenset(typing.get_args(typing.get_type_hints(TrainingConfig)["lr_scheduler"]))

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


# what a model card never lists, with the Trainer's defaults
CARD_OMITS = {"weight_decay": 0.0, "max_grad_norm": 1.0, "data_seed": None, "bf16": False}


def carry(b: Baseline, model_fields: dict, data_fields: set, steps: int | None = None,
          initial_adapter=None, baseline_step: bool = False) -> Imported:
    """Map the baseline's settings onto recipe fields (``section.name``); ``model_fields``: the recipe's model
    section, field name → type; ``steps``: the optimizer steps the run took, when the source does not say them (for
    a warm-up ratio); ``baseline_step``: take the baseline tool's own step where it is not the big batch's (its
    ``carry_own`` says which it can)."""
    out = Imported()
    src = lambda name: b.args[name][1]  # noqa: E731
    get = b.get

    total = b.effective_batch()
    if total:
        if get("total_train_batch_size"):
            where = f"{src('total_train_batch_size')}: total_train_batch_size" + (
                f", {b.processes[0]} processes ({b.processes[1]})" if b.processes else "")
        elif get("speed_batch") and "gradient_accumulation_steps" not in b.args:
            where = f"{src('speed_batch')}: the Trainer's speed metrics"
        elif "gradient_accumulation_steps" in b.assumed:
            where = f"{src('per_device_train_batch_size')} × accumulation 1 ASSUMED"
            out.assumed.append(("training.effective_batch_size", b.assumed["gradient_accumulation_steps"]))
        else:
            where = f"{src('per_device_train_batch_size')} × accumulation × " + (
                f"{b.processes[0]} processes ({b.processes[1]})" if b.processes else
                "1 process (the source names no process count: --processes P)")
        out.set("training.effective_batch_size", total, where + _engine(b))
        out.set("training.gradient_accumulation_steps", None, "derived from the effective batch and your micro-batch")
    for name, field in (("learning_rate", "training.learning_rate"), ("weight_decay", "training.weight_decay")):
        if get(name) is not None:
            out.set(field, float(get(name)), src(name))
    _scheduler(b, out, steps)
    _length(b, out)
    _optimizer(b, out)
    if "max_grad_norm" in b.args:
        norm = get("max_grad_norm")
        out.set("training.max_grad_norm", float(norm) if norm else None, src("max_grad_norm"))
    precision = trained_precision(b)
    if precision is not None:
        out.set("training.mixed_precision", *precision)
    if get("gradient_checkpointing"):
        out.set("training.gradient_checkpointing", True, src("gradient_checkpointing"))
    _eval(b, out)
    if _lora(b, out):
        _lora_start(b, out, initial_adapter)
    _quantization(b, out, model_fields)
    if b.get("model_dtype") and "dtype" in model_fields:  # the frozen base's dtype, as the source's reader says
        out.set("model.dtype", b.get("model_dtype"), b.args["model_dtype"][1])
    data_settings(b, out, data_fields)
    _seed_and_order(b, out)  # after _data: a packing it carried makes the packed rows the samples
    task_model_settings(b, out, model_fields)
    if b.get("num_generations") is not None:
        grpo_settings(b, out, model_fields)
    if b.card_only:  # the card lists only some arguments: the others are the recipe's own
        missing = [f"{k} (Trainer default {v})" for k, v in CARD_OMITS.items() if k not in b.args]
        if missing:
            out.not_carried.append("not in the model card, the recipe's values kept: " + ", ".join(missing))
    for name, why in NO_COUNTERPART.items():  # None is unset for each (axolotl's arguments save group_by_length so)
        if get(name, DEFAULTS[name]) not in (DEFAULTS[name], None, {}, 0, 0.0, False):
            out.skip(name, get(name), why)
    _drop_last(b, out)
    _data_parallel(b, out, baseline_step)
    engine_lines(b, out)  # its offload, a local choice; its engine's own steps, named
    if "beta" not in model_fields and b.get("num_generations") is None:  # rows padded alone, not as pairs or rollouts
        _replay_padding(b, out)
    if "beta" not in model_fields:  # a preference or policy task sums its own loss: no Trainer count divides it
        _loss_divisor(b, out)
    for setting, value, why in b.uncarried:  # what the source's own reader knows finetune lacks
        out.skip(setting, value, why)
    if b.source is not None:  # a tool's own settings (LLaMA-Factory's template, stage), last
        b.source.carry_own(b, out, model_fields, data_fields, baseline_step)
    _unsaid(b, out)
    return out


# the step's settings a recipe always has: where no file of the baseline says one, the recipe's own is kept, said;
# each with the words of a line that already names it (a value read but not carried)
STEP_FIELDS = (("training.learning_rate", ("learning",)), ("training.lr_scheduler", ("scheduler",)),
               ("training.effective_batch_size", ("batch", "accumulation")),
               ("training.warmup_steps", ("warmup", "warm-up")))


def _unsaid(b: Baseline, out: Imported) -> None:
    """One not-carried line for each step setting (learning rate, schedule, batch, warm-up, length) that no file of
    the baseline says and no earlier line names: the recipe's own value is not the baseline's."""
    named = " ".join(str(s.setting).lower() for s in out.skips())
    for field, words in STEP_FIELDS:
        if field not in out.values and not any(w in named for w in words):
            out.skip(field, "unknown", f"the {b.kind} does not say it; the recipe's own is kept")
    if "training.epochs" not in out.values and "training.max_steps" not in out.values and \
            not any(w in named for w in ("epoch", "max_steps")):
        out.skip("training.epochs / max_steps", "unknown", f"the {b.kind} does not say how long it trained; the "
                 "recipe's own length is kept")


# where accelerate leaves the casting to the engine (Accelerator.__init__ sets up no autocast under them)
OWN_CASTING = {"DEEPSPEED", "MEGATRON_LM"}


def trained_precision(b: Baseline) -> tuple | None:
    """(``training.mixed_precision`` as the baseline trained: bf16 / fp16 / no, where that is said), None where its
    arguments name neither bf16 nor fp16. accelerate (1.15, ``Accelerator.__init__``) turns fp16 autocast and its
    GradScaler on only off the CPU (``native_amp`` false there): the arguments' fp16 on a CPU trained in fp32. bf16
    autocast it runs on a CPU too: bf16 stays bf16. Where the files do not say the device, the arguments' word."""
    which = "bf16" if b.get("bf16") else "fp16" if b.get("fp16") else None
    if which is None:
        named = next((name for name in ("bf16", "fp16") if name in b.args), None)
        return ("no", b.args[named][1]) if named else None
    device = trained_device(b)
    engine = str(_record(b, "distributed_state").get("distributed_type"))
    if which == "fp16" and device is not None and device[0] == "cpu" and engine not in OWN_CASTING and \
            not b.get("deepspeed"):
        return "no", f"{_true(b, 'fp16')}, on a CPU ({device[1]}): accelerate trains fp16 as fp32 there (no " \
                     "autocast, no GradScaler)"
    return which, b.args[which][1]


def trained_device(b: Baseline) -> tuple | None:
    """(the type of the device the baseline trained on — cpu, cuda, mps, … —, where its files say it), None where
    they do not: accelerate's state pickled in ``training_args.bin`` (``distributed_state.device``), the Trainer's
    device there (``_setup_devices``), else ``use_cpu`` / ``no_cuda`` true. Their false says nothing: ms-swift's
    runs on a CPU record ``use_cpu`` false."""
    state = _record(b, "distributed_state")
    for value, name, key in ((state.get("device"), "distributed_state", "distributed_state.device"),
                             (b.get("_setup_devices"), "_setup_devices", "_setup_devices")):
        if value:
            kind = str(value).split(":")[0]
            return kind, f"{Where(file_of(b.args[name][1]), key)} {value}"
    name = next((name for name in ("use_cpu", "no_cuda") if b.get(name) is True), None)
    return ("cpu", _true(b, name)) if name else None


def _true(b: Baseline, name: str) -> str:
    """``file: key true``: where the argument ``name`` is said true (by its own key in that file, else by name)."""
    where = b.args[name][1]
    return f"{Where(file_of(where), where.key if isinstance(where, Where) and where.key else name)} true"


# HF Trainer divided a window's summed loss by its labels counted before a causal LM's shift (num_items_in_batch)
# from transformers 4.46, which introduced that count, until 5.10 counted after it
UNSHIFTED_COUNT = ((4, 46), (5, 10))


def _loss_divisor(b: Baseline, out: Imported) -> None:
    """The divisor of the Trainer version that trained the baseline (its card's Framework versions): before 5.10,
    one label more per row whose first label trains (``training.loss_divisor: labels``)."""
    version = b.get("transformers_version")
    if version is None:
        return
    parts = tuple(int(x) for x in str(version).split(".")[:2])
    if UNSHIFTED_COUNT[0] <= parts < UNSHIFTED_COUNT[1]:
        out.set("training.loss_divisor", "labels", f"{b.args['transformers_version'][1]}: Transformers "
                f"{version}, whose Trainer divides each window's loss by its labels before the shift")


# DeepSpeed's names of a reduction or accumulation dtype below fp32
LOW = {"bf16", "bfloat16", "fp16", "float16", "torch.bfloat16", "torch.float16"}


def _data_parallel(b: Baseline, out: Imported, baseline_step: bool) -> None:
    """What a run on several processes did that is not the big batch's step: the samples accelerate's
    ``even_batches`` repeats in an epoch's short last window (replayed with ``baseline_step``, else named by
    compare, which knows the training set's size), and, named, each process's own token mean
    (``average_tokens_across_devices: false``) and gradients reduced or accumulated below fp32 by DeepSpeed
    (``communication_data_type``, ``data_types.grad_accum_dtype``) or FSDP (its mixed precision's reduce dtype)."""
    if baseline_step and b.process_count() > 1:
        _even_batches(b, out)
    if b.process_count() > 1 and b.get("average_tokens_across_devices") is False:
        if "training.even_batches" in out.values:  # the processes' samples known: their means are taken
            out.set("training.process_mean", True, f"{b.args['average_tokens_across_devices'][1]}: "
                    "average_tokens_across_devices false — each process's own token mean, averaged over the "
                    "processes: the baseline's own step (--baseline-step)")
        else:
            out.skip("average_tokens_across_devices", False, "each process divided its loss by its own tokens and "
                     "the processes' gradients were averaged: the mean of their means, not the big batch's token "
                     "mean" + ("" if baseline_step else " (--baseline-step takes it)"))
    ds = _record(b, "deepspeed")
    for key, value in (("communication_data_type", ds.get("communication_data_type")),
                       ("data_types.grad_accum_dtype", (ds.get("data_types") or {}).get("grad_accum_dtype"))):
        if str(value) in LOW:
            out.skip(f"deepspeed {key}", value, "DeepSpeed reduced or accumulated the gradients in it; finetune "
                     "sums them in fp32")
    fsdp = _record(b, "fsdp_config")
    reduce = (fsdp.get("mixed_precision_policy") or {}).get("reduce_dtype") if isinstance(
        fsdp.get("mixed_precision_policy"), dict) else None
    if str(reduce) in LOW:
        out.skip("fsdp reduce_dtype", reduce, "FSDP reduced the gradients in it; finetune sums them in fp32")


def _record(b: Baseline, name: str) -> dict:
    """The argument ``name`` where it is a record (DeepSpeed's config, accelerate's state, …), else {}."""
    value = b.get(name)
    return value if isinstance(value, dict) else {}


def _engine(b: Baseline) -> str:
    """The sharding engine a run on several processes trained under, said beside its batch: its step is the
    data-parallel one (what it reduced below fp32 is named by ``_data_parallel``)."""
    zero = _record(b, "deepspeed").get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    state = _record(b, "distributed_state")
    launched = {"DEEPSPEED": "DeepSpeed (accelerate's launch config, not in the arguments)",
                "FSDP": "FSDP (accelerate's launch config)"}.get(str(state.get("distributed_type")))
    engine = f"DeepSpeed ZeRO-{stage}" if stage is not None else f"DeepSpeed ({b.get('deepspeed')})" if \
        isinstance(b.get("deepspeed"), str) else "FSDP" if b.get("fsdp") else launched
    return f"; under {engine}: the data-parallel step" if engine and b.process_count() > 1 else ""


def _even_batches(b: Baseline, out: Imported) -> None:
    """``training.even_batches``: the baseline's processes and per-device batch, where accelerate completed each
    process's short last batch with the epoch's first samples (its ``even_batches``, true unless the arguments'
    ``accelerator_config`` says otherwise; nothing is short when the last micro-batch is dropped)."""
    config = _record(b, "accelerator_config")
    per_device = b.get("per_device_train_batch_size")
    if config.get("even_batches", True) is False or b.get("dataloader_drop_last") or b.get("drop_last") or \
            not per_device:
        return
    out.set("training.even_batches", [b.process_count(), int(per_device)],
            f"{b.processes[1]}: accelerate's even_batches on "
            f"{b.process_count()} processes of {per_device} — the baseline's own step (--baseline-step)")


def _replay_padding(b: Baseline, out: Imported) -> None:
    """``training.replay_padding``: a mixed-precision baseline's micro-batches — its per-device batch, and the
    multiple its collator padded them to (TRL's ``pad_to_multiple_of``; 1: each to its longest row) — so that the
    run pads every sample to the length the baseline ran it at: a sample's bf16 numbers depend on that length, not
    on the micro-batch around it. Not for packed or padding-free rows, which have no padding to replay."""
    per_device = b.get("per_device_train_batch_size")
    # what the baseline trained in (fp16 asked on a CPU trained fp32: nothing rounds by length there)
    if out.values.get("training.mixed_precision") not in ("bf16", "fp16") or not per_device:
        return
    if "data.pack" in out.values or b.get("packing") or b.get("padding_free"):
        out.not_carried.append("note: micro-batch padding not replayed — the baseline packed its rows or trained "
                               "padding-free, and has no padding")
        return
    multiple = b.get("pad_to_multiple_of")
    multiple = int(multiple) if isinstance(multiple, (int, float)) and not isinstance(multiple, bool) else 1
    collator = "TRL's collator, right-padded" if b.trl else \
        "the Trainer's padding collator assumed (right, to its longest row; the script's own collator is not read)"
    out.set("training.replay_padding", [int(per_device), multiple],
            f"{b.args['per_device_train_batch_size'][1]}: per_device_train_batch_size {per_device}, each micro-batch "
            f"padded to its longest row" + (f" rounded up to a multiple of {multiple} (pad_to_multiple_of)"
                                            if multiple > 1 else "") + f" — {collator}")


def _drop_last(b: Baseline, out: Imported) -> None:
    """An epoch's dropped tail: the source's own (torchtune's incomplete last window) or the Trainer's
    ``dataloader_drop_last`` (its incomplete last micro-batch: per-device batch × processes)."""
    if b.get("drop_last"):
        out.set("training.drop_last", int(b.get("drop_last")), b.args["drop_last"][1])
    elif b.get("dataloader_drop_last") and b.get("per_device_train_batch_size"):
        size = int(b.get("per_device_train_batch_size")) * b.process_count()
        out.set("training.drop_last", size, f"{b.args['dataloader_drop_last'][1]}: dataloader_drop_last, the "
                                            "incomplete last micro-batch of each epoch dropped")


def _scheduler(b: Baseline, out: Imported, steps_given: int | None) -> None:
    get = b.get
    kind = get("lr_scheduler_type")
    if kind is not None:
        if str(kind) in SCHEDULERS:
            out.set("training.lr_scheduler", str(kind), b.args["lr_scheduler_type"][1])
        else:
            out.skip("lr_scheduler_type", kind, f"finetune's schedulers are {', '.join(sorted(SCHEDULERS))}")
    # transformers 5: warmup_steps below 1 is a ratio (TrainingArguments has no warmup_ratio); older arguments and
    # axolotl have warmup_ratio. The Trainer's warmup_steps are what it took, 0 too: a ratio from another file (the
    # axolotl config beside its arguments) never overrides them; a ratio in the same file is used when they are 0
    # (transformers 4's rule). A ratio becomes steps as the source's tool rounds it (its source's warmup), else as
    # TrainingArguments.get_warmup_steps does: ceil(steps × ratio).
    steps, ratio, ratio_src = get("warmup_steps"), get("warmup_ratio"), None
    if steps is not None and 0 < float(steps) < 1:
        ratio, ratio_src = float(steps), b.args["warmup_steps"][1]
    elif steps is not None and (float(steps) >= 1 or not ratio or _origin(b, "warmup_ratio") !=
                                _origin(b, "warmup_steps")):
        out.set("training.warmup_steps", int(steps), b.args["warmup_steps"][1])
        return
    elif ratio:
        ratio, ratio_src = float(ratio), b.args["warmup_ratio"][1]
    if not ratio:
        return
    total = get("schedule_steps") or (get("max_steps") if (get("max_steps") or -1) > 0 else None)
    where = b.args["schedule_steps" if get("schedule_steps") else "max_steps"][1] if total else "--steps"
    n = int(total or steps_given) if total or steps_given else None
    warmup, how = (b.source and b.source.warmup(b, ratio, n)) or trainer_warmup(ratio, n)
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


def _origin(b: Baseline, name: str) -> str | None:
    """The file a setting was read from."""
    return file_of(b.args[name][1]) if name in b.args else None


def _length(b: Baseline, out: Imported) -> None:
    get = b.get
    epochs, max_steps = get("num_train_epochs"), get("max_steps")
    if max_steps is not None and int(max_steps) > 0:
        out.set("training.max_steps", int(max_steps), b.args["max_steps"][1])
        out.set("training.epochs", max(1, math.ceil(int(max_steps) / max(1, int(get("schedule_steps") or
                                                                                max_steps)))), "derived")
    elif epochs is not None:
        if float(epochs) != int(float(epochs)):
            out.set("training.epochs", math.ceil(float(epochs)), b.args["num_train_epochs"][1])
            out.skip("num_train_epochs", epochs, "finetune trains whole epochs; set training.max_steps to the "
                     "baseline's step count to stop where it stopped")
        else:
            out.set("training.epochs", int(float(epochs)), b.args["num_train_epochs"][1])


def trainer_optimizers() -> dict:
    """TrainingArguments.optim → training.optimizer, from the optimizer table's ``trainer_names`` (read at each
    call: an entry added to the table is imported at once)."""
    return {trainer: ours for ours, entry in OPTIMIZERS.items() for trainer in entry.trainer_names}


def _optimizer(b: Baseline, out: Imported) -> None:
    get = b.get
    optim = get("optim")
    if optim is not None:
        ours = trainer_optimizers().get(str(optim).lower())
        if ours:
            out.set("training.optimizer", ours, b.args["optim"][1])
        else:
            out.skip("optim", optim, f"finetune's optimizers are {', '.join(OPTIMIZERS)}")
    if get("adam_beta1") is not None or get("adam_beta2") is not None:
        betas = [float(get("adam_beta1", 0.9)), float(get("adam_beta2", 0.999))]
        out.set("training.betas", betas, b.args["adam_beta1" if "adam_beta1" in b.args else "adam_beta2"][1])
    eps = get("adam_epsilon")
    if eps is not None and float(eps) != 1e-8:
        out.skip("adam_epsilon", eps, "finetune's AdamW uses torch's eps 1e-8")


def _seed_and_order(b: Baseline, out: Imported) -> None:
    get = b.get
    seed, data_seed = get("seed"), get("data_seed")
    if data_seed is not None and data_seed != seed:
        out.set("training.seed", int(data_seed), f"{b.args['data_seed'][1]}: data_seed, the seed of the order")
        if seed is not None:
            out.skip("seed", seed, f"finetune has one seed; data_seed={data_seed} is taken, for the sample order "
                     "(dropout and new weights draw from it too)")
    elif seed is not None:
        out.set("training.seed", int(seed), b.args["seed"][1])
    strategy = str(get("train_sampling_strategy") or "random")
    # TRL's packed rows are its samples, drawn in a seeded order too, where data.pack carries the packing
    if (get("packing") and "data.pack" not in out.values) or get("group_by_length") or \
            strategy not in ("random", "sequential"):
        return  # their order is not a seeded permutation of the samples (said by their own not-carried lines)
    if strategy == "sequential":
        out.set("training.shuffle", False, b.args["train_sampling_strategy"][1])
    else:
        out.set("training.sample_order", "trainer",
                "HF Trainer's random sampler (axolotl and TRL train with it too)")


def _eval(b: Baseline, out: Imported) -> None:
    strategy = str(b.get("eval_strategy") or b.get("evaluation_strategy") or "")
    if strategy == "steps" and b.get("eval_steps"):
        out.set("training.eval_every", int(b.get("eval_steps")), b.args["eval_steps"][1])


def _lora(b: Baseline, out: Imported) -> bool:
    """LoRA's settings, or that there is none; True when the baseline trained adapters."""
    a, get = b.adapter_config, b.get
    if a and a.get("peft_type", "LORA") == "LORA":
        where = "adapter_config.json"
        values = {"r": a.get("r"), "alpha": a.get("lora_alpha"), "dropout": a.get("lora_dropout"),
                  "target_modules": a.get("target_modules"), "modules_to_save": a.get("modules_to_save")}
    elif get("adapter") in ("lora", "qlora"):
        where = file_of(b.args["adapter"][1])
        values = {"r": get("lora_r"), "alpha": get("lora_alpha"), "dropout": get("lora_dropout"),
                  "target_modules": get("lora_target_modules"), "modules_to_save": None}
        if get("lora_target_linear"):
            out.skip("lora_target_linear", True, "finetune names the adapted modules; list the model's linear "
                     "layers in peft.target_modules")
    elif get("library_name") == "peft":  # the card says adapters were trained, not their settings
        out.set("peft.enabled", True, f"{b.args['library_name'][1]}: peft (the card of an adapters' run)")
        out.skip("LoRA r and alpha", "unknown", "the card does not list them; the recipe's are kept (give the "
                 "folder with its adapter_config.json)")
        return True
    elif "adapter" in b.args and get("adapter") is None:  # the source says so (torchtune's model component)
        out.set("peft.enabled", False, b.args["adapter"][1])
        return False
    elif b.weights is not None and b.weights.name == "model.safetensors" and b.model_config is not None:
        out.set("peft.enabled", False, f"{b.weights.name} and no adapter_config.json: every weight trained")
        return False
    else:
        out.skip("LoRA or not", "unknown", f"the {b.kind} does not say; the recipe's peft section is kept")
        out.assumed.append(("peft", f"the {b.kind} does not say whether it trained LoRA adapters (no "
                                    "adapter_config.json, no card's library_name): the recipe's peft section"))
        return False
    out.set("peft.enabled", True, where)
    modules = values["target_modules"]
    if modules is not None and not (isinstance(modules, str) or isinstance(modules, list) and
                                    all(isinstance(m, str) for m in modules)):
        values["target_modules"] = None  # a script's own object serialised in their place (an OmegaConf list)
        out.skip("target_modules", f"a {type(modules).__name__}", f"{where} holds no list of module names; the "
                 "recipe's peft.target_modules are kept")
    for key, value in values.items():
        if value is not None:
            if isinstance(value, float) and key in ("r", "alpha") and value.is_integer():
                value = int(value)  # a tool that saves them as floats (ms-swift's lora_alpha 32.0)
            if key == "target_modules" and isinstance(value, str):
                value = [value]  # peft's "all-linear" too: finetune's peft.target_modules takes [all-linear]
            out.set(f"peft.{key}", sorted(value) if isinstance(value, (list, set)) else value, where)
    return True


def _lora_start(b: Baseline, out: Imported, initial_adapter) -> None:
    """Where the adapters start: the baseline's saved initial adapters, else its tool's draw replayed from the seed,
    or unknown (its source's ``adapters_start`` says which, and how)."""
    if initial_adapter is not None:
        out.set("peft.init_from", str(initial_adapter), "--initial-adapter: the adapters before the first step")
        return
    replayed, how = b.source.adapters_start(b)  # each tool draws them its own way
    if replayed:
        out.not_carried.append(f"adapters' start: replayed — {how}")
    else:
        out.skip("the adapters' start", "unknown", how)


def _quantization(b: Baseline, out: Imported, model_fields: set) -> None:
    get, q = b.get, (b.model_config or {}).get("quantization_config") or {}
    kind = None
    if get("load_in_4bit") or q.get("load_in_4bit"):
        kind = str(get("bnb_4bit_quant_type") or q.get("bnb_4bit_quant_type") or "nf4")
    elif get("load_in_8bit") or q.get("load_in_8bit"):
        kind = "int8"
    if kind is None:
        return
    where = file_of(b.args["load_in_4bit" if get("load_in_4bit") else "load_in_8bit"][1]) \
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
