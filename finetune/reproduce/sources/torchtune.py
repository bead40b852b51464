"""A torchtune run (0.6.1's single-device and distributed SFT recipes): its YAML config (``_component_`` paths;
also the ``torchtune_config.yaml`` it saves into its output folder) and its metric log (``DiskLogger``'s
``log_<unix time>.txt``: one ``Step k | loss:… lr:… tokens_per_second_per_gpu:… [grad_norm:…]`` line per logged step).

torchtune's step, read from its recipes: the data loader drops each epoch's incomplete last micro-batch
(``drop_last=True``) and an epoch takes ``micro-batches ÷ gradient_accumulation_steps`` steps (rounded down), so each
epoch's incomplete last window is dropped — ``training.drop_last`` at the effective batch, which ``import`` sets; the
loss is the window's token mean (``running_loss / num_tokens``), finetune's; the order is the distributed sampler's,
seeded with 0 whatever ``seed`` says (``torch.randperm(n)`` from ``0 + epoch``: ``sample_order: trainer`` at seed
0); ``dtype: bf16`` loads and trains every weight in bf16 (no fp32 master weights), which finetune does not do.
The micro-batches left at an epoch's end are still backpropagated and their gradients join the next epoch's first
step (the recipe zeroes gradients only after a step): from epoch 2 on that step is not the big batch's, said by
``import``. The lr it logs at step k is read after the scheduler stepped: step k + 1's (the reader shifts it back).
``train_on_input: False`` trains each assistant message whole (its header, and the newline after a non-final turn's
end token): ``data.train_on: assistant_turns``. Checked against runs torchtune trained (tests/test_torchtune_runs.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import finetune.reproduce.sources.files as files
from finetune.errors import ConfigError
from finetune.loading import read_yaml
from finetune.reproduce.objective import instruction_task, named_task
from finetune.reproduce.record import Baseline, Objective, Where, local_file, pure_precision
from finetune.reproduce.sources.contract import Reader, yaml_mapping

OPTIMIZERS = {"torch.optim.AdamW": "adamw_torch", "torch.optim.SGD": "sgd", "bitsandbytes.optim.PagedAdamW8bit":
              "paged_adamw_8bit", "bitsandbytes.optim.AdamW8bit": "adamw_8bit", "torchao.optim.AdamW8bit":
              "adamw_8bit", "torch.optim.Adam": "adam"}
SCHEDULERS = {"torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup": "cosine",
              "torchtune.modules.get_cosine_schedule_with_warmup": "cosine"}
# torchtune's names of the adapted projections → Hugging Face's (the checkpointer converts between them)
LORA_MODULES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
MLP = ["gate_proj", "up_proj", "down_proj"]
CHAT_DATASET = "torchtune.datasets.chat_dataset"  # the builder whose rows are finetune's: messages
# torchtune's losses (the last part of loss._component_; the tasks' objective_names hold those finetune trains): the
# preference losses' loss_type, and those of objectives finetune does not train
LOSS_TYPES = {"DPOLoss": "sigmoid", "RSOLoss": "hinge", "IPOLoss": "ipo"}
OTHER_LOSSES = {"SimPOLoss": "simpo", "PPOLoss": "ppo"}
# torchtune's data set builders (torchtune/datasets, the last part of _component_) whose rows train on the whole text;
# those of preference pairs are the preference task's objective_names; its other builders format instructions or
# chats: the instruction task, the prompt masked (train_on_input false, their default)
TEXT_DATASETS = {"text_completion_dataset", "cnn_dailymail_articles_dataset", "wikitext_dataset"}
# a config with no optimizer trains nothing: the key that says what its recipe does instead, first found
NOT_TRAINING = (("max_new_tokens", "generation"), ("prompt", "generation"), ("tasks", "evaluation"),
                ("quantizer", "export"))


class Torchtune(Reader):
    name = "torchtune"
    reads = "a config YAML (_component_ paths) or an output folder (torchtune_config.yaml, its log_*.txt, epoch_*/)"

    def recognises(self, path: Path) -> bool:
        return is_run(path) if path.is_dir() else is_torchtune(yaml_mapping(path))

    def read(self, path: Path, what: str) -> Baseline:
        return read_run(path, what) if path.is_dir() else read_torchtune(path, read_yaml(path, what), what)

    def adapters_start(self, b: Baseline) -> tuple:
        return False, ("torchtune draws them from its seed while it builds its own model and saves none: give "
                       "--initial-adapter DIR, the adapters drawn by replaying that build (seed, then the model: "
                       "examples/torchtune/make_baselines.py, initial_adapters)")

    def carry_own(self, b: Baseline, out, model_fields: dict, data_fields: set, baseline_step: bool) -> None:
        """torchtune's own settings onto the recipe: its ``dtype: bf16`` (every weight
        trained in it), taken with ``baseline_step``."""
        dtype = b.own["dtype"][0]
        if dtype in ("bf16", "fp16"):
            pure_precision(out, b.own["dtype"], dtype, "torchtune", baseline_step, model_fields, autocast="no")


SOURCE = Torchtune()


def is_torchtune(raw) -> bool:
    """Whether a YAML mapping is a torchtune config: its sections name ``_component_`` paths."""
    return isinstance(raw, dict) and any(isinstance(v, dict) and "_component_" in v for v in raw.values())


def read_torchtune(path: Path, raw: dict, what: str) -> Baseline:
    """The settings of torchtune config ``raw`` (read from ``path``), as TrainingArguments names with their sources;
    ConfigError (one line) for a value of the wrong kind."""
    raw = interpolated(raw, raw)
    b = Baseline("torchtune config", path)
    src = lambda key: Where(path.name, key)  # noqa: E731
    for key, name in (("batch_size", "per_device_train_batch_size"), ("gradient_accumulation_steps", None),
                      ("epochs", "num_train_epochs"), ("log_every_n_steps", "logging_steps")):
        if raw.get(key) is not None:
            b.args[name or key] = (_int(raw[key], key, path, what), src(key))
    b.args.setdefault("gradient_accumulation_steps", (1, f"{path.name}: torchtune's default accumulation"))
    b.logged_loss_is_mean = False  # every log_every_n_steps-th step logs its own loss
    b.args["seed"] = (0, f"{path.name}: torchtune's sampler is seeded with 0 whatever seed says")
    if raw.get("seed") not in (None, 0):
        b.uncarried.append(("seed", raw["seed"], "it seeds torchtune's model and adapters; its sampler draws the "
                            "order from 0, which the recipe's one seed takes"))
    if raw.get("shuffle") is False:
        b.args["train_sampling_strategy"] = ("sequential", src("shuffle"))
    if raw.get("max_steps_per_epoch") is not None:
        steps, epochs = _int(raw["max_steps_per_epoch"], "max_steps_per_epoch", path, what), raw.get("epochs", 1)
        if epochs == 1:
            b.args["max_steps"] = (steps, src("max_steps_per_epoch"))
        else:
            b.uncarried.append(("max_steps_per_epoch", steps, "finetune caps the run's steps, not each epoch's"))
    size = int(b.get("per_device_train_batch_size") or 1) * int(b.get("gradient_accumulation_steps"))
    b.args["drop_last"] = (size, f"{path.name}: torchtune drops each epoch's incomplete last window (drop_last "
                                 "micro-batches, steps = micro-batches ÷ gradient_accumulation_steps)")
    if int(b.get("gradient_accumulation_steps")) > 1 and int(b.get("num_train_epochs") or 1) > 1:
        b.uncarried.append(("the micro-batches left at an epoch's end", "backpropagated", "torchtune adds their "
                            "gradients to the next epoch's first step (it zeroes gradients only after a step); "
                            "finetune drops them: the steps from epoch 2 on differ unless rows ÷ batch_size, rounded "
                            "down, is a multiple of gradient_accumulation_steps"))
    _optimizer(raw, b, path)
    if raw.get("optimizer_in_bwd"):  # its step is the same where it clips nothing (torchtune refuses clipping then)
        b.args["optimizer_in_bwd"] = (True, src("optimizer_in_bwd"))
    _schedule(raw, b, path)
    if "clip_grad_norm" in raw:
        norm = raw.get("clip_grad_norm")
        b.args["max_grad_norm"] = (None if norm in (None, "inf") else float(norm), src("clip_grad_norm"))
    b.args["bf16"] = (False, src("dtype"))  # no autocast: its dtype is the weights' own (carry_own)
    b.own["dtype"] = (str(raw.get("dtype") or "fp32"), src("dtype"))
    if raw.get("enable_activation_checkpointing"):
        b.args["gradient_checkpointing"] = (True, src("enable_activation_checkpointing"))
    _model(raw, b, path)
    _data(raw, b, path)
    b.objective = _objective(raw, b, path)
    checkpointer = raw.get("checkpointer") or {}
    b.base_model = checkpointer.get("checkpoint_dir") if isinstance(checkpointer, dict) else None
    return b


INTERPOLATION = re.compile(r"\$\{([\w.]+)\}")


def interpolated(value, root: dict):
    """``value`` with OmegaConf's ``${key}`` / ``${section.key}`` replaced by that scalar of the config ``root``, as
    torchtune's config loader does (``checkpoint_dir: ${base_model_path}``); one it cannot find (an env resolver)
    stays as written."""
    if isinstance(value, dict):
        return {k: interpolated(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolated(v, root) for v in value]
    if not isinstance(value, str) or "${" not in value:
        return value

    def lookup(m):
        found = root
        for part in m.group(1).split("."):
            found = found.get(part) if isinstance(found, dict) else None
        return None if isinstance(found, (dict, list)) else found

    whole = INTERPOLATION.fullmatch(value)
    if whole:  # the value itself, of its own type (``lr: ${base_lr}`` is a number)
        return value if lookup(whole) is None else lookup(whole)
    return INTERPOLATION.sub(lambda m: m.group(0) if lookup(m) is None else str(lookup(m)), value)


def _objective(raw: dict, b: Baseline, path: Path) -> Objective | None:
    """What the config trains, as its recipe does: a teacher model (knowledge distillation), a value model (PPO), its
    loss's component, else its data set's builder; nothing when it has no optimizer (generation, evaluation and
    quantization configs). The dpo task's loss type and beta from a DPO loss's own arguments."""
    if not isinstance(raw.get("optimizer"), dict):
        key, name = next(((k, n) for k, n in NOT_TRAINING if k in raw), ("optimizer", "generation"))
        return Objective(name, f"{path.name}: {key}, and no optimizer")
    for key, name in (("teacher_model", "distillation"), ("kd_loss", "distillation"),
                      ("reward_and_value_model", "ppo")):
        if key in raw:
            return Objective(name, f"{path.name}: {key}")
    loss = raw.get("loss") if isinstance(raw.get("loss"), dict) else {}
    stem = str(loss.get("_component_", "")).rsplit(".", 1)[-1]
    name = named_task(stem) or OTHER_LOSSES.get(stem)
    if name is not None:
        if stem in LOSS_TYPES:
            b.args["loss_type"] = (LOSS_TYPES[stem], f"{path.name}: loss._component_ {loss['_component_']}")
        if loss.get("beta") is not None:
            b.args["beta"] = (float(loss["beta"]), f"{path.name}: loss.beta")
        return Objective(name, f"{path.name}: loss._component_ {loss['_component_']}")
    datasets = raw.get("dataset")
    builders = {str(d.get("_component_", "")).rsplit(".", 1)[-1] for d in
                (datasets if isinstance(datasets, list) else [datasets]) if isinstance(d, dict)}
    if not builders or "" in builders:
        return None
    where = f"{path.name}: dataset._component_ {', '.join(sorted(builders))}"
    named = {named_task(builder) for builder in builders}
    if len(named) == 1 and None not in named:
        return Objective(named.pop(), where)
    if builders <= TEXT_DATASETS:
        return Objective("clm", where + " (text, every token trained)")
    if named == {None} and not builders & TEXT_DATASETS:
        return Objective(instruction_task(), where + " (instructions or chats: the prompt masked unless "
                                                     "train_on_input)")
    return None


def _int(value, key: str, path: Path, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: {path}: {key} is {value!r}, not a whole number") from None


def _optimizer(raw: dict, b: Baseline, path: Path) -> None:
    opt = raw.get("optimizer") or {}
    if not isinstance(opt, dict):
        return
    where = f"{path.name}: optimizer"
    name = OPTIMIZERS.get(opt.get("_component_"), opt.get("_component_"))
    b.args["optim"] = (name, f"{where}._component_")
    if opt.get("lr") is not None:
        b.args["learning_rate"] = (float(opt["lr"]), f"{where}.lr")
    if name == "adamw_torch":  # torch's AdamW default weight decay is 0.01
        b.args["weight_decay"] = (float(opt.get("weight_decay", 0.01)), f"{where}.weight_decay" if "weight_decay"
                                  in opt else f"{where}: torch.optim.AdamW's default 0.01")
    elif opt.get("weight_decay") is not None:
        b.args["weight_decay"] = (float(opt["weight_decay"]), f"{where}.weight_decay")
    if opt.get("betas") is not None:
        b.args["adam_beta1"], b.args["adam_beta2"] = ((float(opt["betas"][0]), f"{where}.betas"),
                                                      (float(opt["betas"][1]), f"{where}.betas"))
    if opt.get("eps") is not None:
        b.args["adam_epsilon"] = (float(opt["eps"]), f"{where}.eps")


def _schedule(raw: dict, b: Baseline, path: Path) -> None:
    sched = raw.get("lr_scheduler")
    if not isinstance(sched, dict):  # none: the optimizer's lr throughout
        b.args["lr_scheduler_type"] = ("constant", f"{path.name}: no lr_scheduler")
        b.args["warmup_steps"] = (0, f"{path.name}: no lr_scheduler")
        return
    kind = SCHEDULERS.get(sched.get("_component_"), sched.get("_component_"))
    b.args["lr_scheduler_type"] = (kind, f"{path.name}: lr_scheduler._component_")
    b.args["warmup_steps"] = (int(sched.get("num_warmup_steps", 0)), f"{path.name}: lr_scheduler.num_warmup_steps")
    if kind == "cosine" and float(sched.get("num_cycles", 0.5)) != 0.5:
        b.uncarried.append(("lr_scheduler.num_cycles", sched["num_cycles"], "finetune's cosine falls over half a wave"))


def _model(raw: dict, b: Baseline, path: Path) -> None:
    model = raw.get("model") or {}
    where = f"{path.name}: model"
    # a lora_* / qlora_* builder, or LoRA's own keys: its builder's defaults where they are left out (lora_rank 8,
    # lora_alpha 16: torchtune/models/*/_model_builders.py)
    lora = isinstance(model, dict) and ("lora_rank" in model or str(model.get("_component_")).rsplit(".", 1)[-1]
                                        .startswith(("lora_", "qlora_")))
    if isinstance(model, dict) and model.get("_component_") and not lora:
        b.args["adapter"] = (None, f"{where}._component_ {model['_component_']} (no lora_rank: every weight trained)")
    if not lora:
        return
    modules = [LORA_MODULES.get(m, m) for m in model.get("lora_attn_modules") or []]
    modules += MLP if model.get("apply_lora_to_mlp") else []
    modules += ["lm_head"] if model.get("apply_lora_to_output") else []
    b.args.update({"adapter": ("lora", f"{where}._component_"),
                   "lora_r": (model.get("lora_rank", 8), f"{where}.lora_rank"),
                   "lora_alpha": (model.get("lora_alpha", 16), f"{where}.lora_alpha"),
                   "lora_dropout": (model.get("lora_dropout", 0.0), f"{where}.lora_dropout"),
                   "lora_target_modules": (modules, f"{where}.lora_attn_modules, apply_lora_to_mlp/output")})
    checkpointer = raw.get("checkpointer") or {}
    qk = sorted({"q_proj", "k_proj"} & set(model.get("lora_attn_modules") or []))
    if qk and isinstance(checkpointer, dict) and checkpointer.get("model_type") == "QWEN2":
        b.uncarried.append(("lora_attn_modules", qk, "torchtune 0.6.1 saves a Qwen2's q/k adapters permuted as a "
                            "Llama's (convert_weights.tune_to_peft_adapter_weights), so its adapter_model.safetensors "
                            "is not what it trained: the weights layer differs"))
    if model.get("use_dora"):
        b.uncarried.append(("use_dora", True, "DoRA adapters: finetune trains LoRA"))
    # a qlora_* builder is its lora_* builder with quantize_base=True
    qlora = ".qlora_" in str(model.get("_component_"))
    if model.get("quantize_base") or qlora:
        b.args["load_in_4bit"] = (True, f"{where}._component_ (qlora_)" if qlora and not model.get("quantize_base")
                                  else f"{where}.quantize_base")
        b.uncarried.append(("quantize_base", True, "torchtune quantizes the base to NF4 with torchao, finetune with "
                            "bitsandbytes: other rounding"))


def _data(raw: dict, b: Baseline, path: Path) -> None:
    tokenizer, dataset = raw.get("tokenizer") or {}, raw.get("dataset") or {}
    if isinstance(tokenizer, dict) and tokenizer.get("max_seq_len"):
        b.args["max_length"] = (int(tokenizer["max_seq_len"]), f"{path.name}: tokenizer.max_seq_len")
        b.uncarried.append(("tokenizer.max_seq_len", tokenizer["max_seq_len"], "with it torchtune 0.6.1 never trains "
                            "a conversation's last token, its end token (truncate() sets the mask's last element); "
                            "finetune trains it"))
    for ds in dataset if isinstance(dataset, list) else [dataset]:
        if not isinstance(ds, dict):
            continue
        builder = str(ds.get("_component_") or "")
        if builder != CHAT_DATASET:
            b.uncarried.append(("dataset", builder.rsplit(".", 1)[-1], "torchtune formats its rows with its own prompt "
                                "template; finetune's sft renders rows of messages with the chat template (give "
                                "--data rows as messages, torchtune's chat_dataset reads them as finetune does)"))
        elif ds.get("conversation_style", "openai") != "openai":
            b.uncarried.append(("dataset.conversation_style", ds["conversation_style"], "finetune reads rows of "
                                "messages ({role, content}, torchtune's openai style)"))
        elif not isinstance(dataset, list) and ds.get("source") in ("json", "csv", "parquet") and \
                (found := local_file(ds.get("data_files"), path)) is not None:
            b.data_file = (found, f"{path.name}: dataset.data_files {ds['data_files']}")
        if ds.get("packed"):
            b.uncarried.append(("dataset.packed", True, "torchtune packs the rows in order into rows of max_seq_len "
                                "tokens before sampling; finetune packs as TRL's bfd or wrapped"))
        if "train_on_input" in ds:  # False: each assistant message whole, header and glue after its end included
            b.args["train_on"] = ("all" if ds["train_on_input"] else "assistant_turns",
                                  f"{path.name}: dataset.train_on_input={ds['train_on_input']}")
        elif builder.rsplit(".", 1)[-1] not in TEXT_DATASETS and named_task(builder.rsplit(".", 1)[-1]) is None:
            # an instruction or chat builder masks the prompt unless told: its train_on_input defaults to False
            b.args["train_on"] = ("assistant_turns", f"{path.name}: dataset.train_on_input, its builder's default "
                                                     "False")
    if isinstance(dataset, list) and len(dataset) > 1:
        b.uncarried.append(("dataset", f"{len(dataset)} data sets", "torchtune concatenates them: give --data the "
                            "rows in that order"))


# ---------------------------------------------------------------------------------------------------------------
# a torchtune output folder and its metric log


LINE = re.compile(r"^Step (\d+) \| (.*)$")
PAIR = re.compile(r"(\w+):(?:tensor\()?([-+0-9.eE]+|nan|inf)")


def is_run(folder: Path) -> bool:
    return (folder / "torchtune_config.yaml").is_file()


def read_run(folder: Path, what: str) -> Baseline:
    """A torchtune output folder: its ``torchtune_config.yaml``, the newest ``log_*.txt`` of its metric logger, and
    the last epoch's checkpoint (its ``config.json``, weights or adapters)."""
    config = folder / "torchtune_config.yaml"
    raw = read_yaml(config, what)
    if not is_torchtune(raw):
        raise ConfigError(f"{what}: {config} is not a torchtune config (no _component_ sections)")
    b = read_torchtune(config, raw, what)
    b.kind, b.path = "torchtune run", folder
    logs = sorted(folder.rglob("log_*.txt"), key=lambda p: p.stat().st_mtime)
    if logs:
        b.logs = read_log(logs[-1], b, what)
        b.max_steps = b.logs[-1]["step"] if b.logs and int(b.get("logging_steps") or 1) == 1 else None
    epochs = files.numbered(folder, "epoch_")
    if epochs:
        last = epochs[-1]
        for name, attr in (("config.json", "model_config"), ("adapter_config.json", "adapter_config")):
            if (last / name).is_file():
                setattr(b, attr, json.loads((last / name).read_text()))
        found = [last / "adapter_model.safetensors"] if b.get("adapter") else sorted(last.glob("model*.safetensors"))
        b.weights = found[0] if len(found) == 1 and found[0].is_file() else None
    return b


def read_log(path: Path, b: Baseline, what: str) -> list[dict]:
    """The steps of a DiskLogger file, as Trainer log entries (``step``, ``loss``, ``learning_rate``,
    ``grad_norm``). torchtune reads the lr after the scheduler stepped, so line k holds step k + 1's: each step's
    lr is the previous line's (step 1's is the schedule's start: 0 under a warm-up, else the optimizer's lr)."""
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        m = LINE.match(line.strip())
        if not m:
            continue
        values = {k: float(v) for k, v in PAIR.findall(m.group(2))}
        if "loss" not in values:
            raise ConfigError(f"{what}: {path} line {number} logs no loss (torchtune writes 'Step k | loss:…')")
        entries.append({"step": int(m.group(1)), **values})
    logged = {e["step"]: e.get("lr") for e in entries}
    start = 0.0 if int(b.get("warmup_steps") or 0) > 0 else b.get("learning_rate")
    out = []
    for e in entries:
        lr = logged.get(e["step"] - 1) if e["step"] > 1 else start
        entry = {"step": e["step"], "loss": e["loss"], **({"learning_rate": lr} if lr is not None else {})}
        if "grad_norm" in e:
            entry["grad_norm"] = e["grad_norm"]
        out.append(entry)
    return out
