"""Reading a LLaMA-Factory run: its YAML (``llamafactory-cli train run.yaml``) and its output folder.

LLaMA-Factory (0.9.5) trains with the HF Trainer (TRL's DPOTrainer for ``stage: dpo``) from one YAML that holds its
own keys (``stage``, ``finetuning_type``, ``template``, ``cutoff_len``, ``packing``, ``pref_beta``, …) beside the
TrainingArguments'. Its output folder holds ``trainer_state.json`` and ``trainer_log.jsonl`` (its own log: step, loss,
lr, epoch), the adapters or weights, and — from its web UI, or when you copy it there — the YAML as
``training_args.yaml``. ``training_args.bin`` pickles its own TrainingArguments class (read as the Trainer's; the
YAML, when there, says the same first hand, and more).

A source is the YAML (its ``output_dir`` is read when it exists, relative to the current directory or to the
YAML's) or the output folder (its ``training_args.yaml`` when there). Every key that decides the steps is mapped onto
the TrainingArguments names (:data:`TRAINER_KEYS`), carried as a recipe field by :func:`carry_own`, or named as not
carried with why (:data:`NOT_CARRIED`); keys that only say where things go are read and not carried
(:data:`PLACES`). A key in none of these lists is reported as unknown. Every value keeps its source.
"""

from __future__ import annotations

import json
from pathlib import Path

import finetune.reproduce.sources.files as files
import finetune.reproduce.sources.llamafactory_kinds as kinds
import finetune.reproduce.sources.llamafactory_rows as rows
import finetune.reproduce.sources.llamafactory_v1 as v1
from finetune.errors import ConfigError
from finetune.loading import read_yaml
from finetune.reproduce.record import Baseline, Where, pure_precision
from finetune.reproduce.sources.contract import Reader, yaml_mapping
from finetune.reproduce.sources.llamafactory_stages import (
    logged_stage,
    pair_stage,
    stage_allows,
    stage_has,
    stage_objective,
    stage_of,
    stages,
)

KIND = "LLaMA-Factory run"
LOG = "trainer_log.jsonl"
SAVED_YAML = "training_args.yaml"  # what LLaMA-Factory's web UI writes into output_dir

# LLaMA-Factory keys that are TrainingArguments (the same name, or LLaMA-Factory's name → the Trainer's)
TRAINER_KEYS = {
    "per_device_train_batch_size": None, "gradient_accumulation_steps": None, "learning_rate": None,
    "num_train_epochs": None, "max_steps": None, "lr_scheduler_type": None, "warmup_ratio": None,
    "warmup_steps": None, "weight_decay": None, "max_grad_norm": None, "seed": None, "data_seed": None,
    "bf16": None, "fp16": None, "pure_bf16": None, "optim": None, "adam_beta1": None, "adam_beta2": None,
    "adam_epsilon": None, "logging_steps": None, "lr_scheduler_kwargs": None, "label_smoothing_factor": None,
    "group_by_length": None, "neftune_noise_alpha": None, "eval_steps": None, "eval_strategy": None,
    "cutoff_len": "max_length", "tf32": None, "use_cpu": None, "deepspeed": None,
}
# TrainingArguments' defaults (transformers 4.x, which LLaMA-Factory 0.x trains with) for what a YAML may leave out
TRAINER_DEFAULTS = {"learning_rate": 5e-05, "lr_scheduler_type": "linear", "per_device_train_batch_size": 8,
                    "gradient_accumulation_steps": 1, "seed": 42}
# LLaMA-Factory's own keys that change the steps and that finetune cannot take: key → (its default, why)
NOT_CARRIED = {
    "mask_history": (False, "finetune's sft trains on every assistant turn, not only the last"),
    "neat_packing": (False, None),  # named with packing (its packing function)
    "pref_ftx": (0.0, "finetune's dpo adds no SFT loss to the preference loss"),
    "dpo_label_smoothing": (0.0, "finetune's dpo has no label smoothing"),
    "simpo_gamma": (0.5, None), "use_dora": (False, "finetune's LoRA is plain LoRA"),
    "use_rslora": (False, "finetune scales LoRA by alpha / r"), "pissa_init": (False, "finetune starts LoRA as peft"),
    "loraplus_lr_ratio": (None, "finetune gives every LoRA weight one learning rate"),
    "lora_dropout": (0.0, None), "additional_target": (None, "finetune trains no extra modules beside LoRA"),
    "use_galore": (False, "finetune has no GaLore"), "use_apollo": (False, "finetune has no APOLLO"),
    "use_badam": (False, "finetune has no BAdam"), "use_muon": (False, "finetune has no Muon"),
    "use_adam_mini": (False, "finetune has no Adam-mini"), "use_dft_loss": (False, "finetune has no DFT loss"),
    "use_eaft_loss": (False, "finetune has no EAFT loss"), "use_asft_loss": (False, "finetune has no ASFT loss"),
    "mix_strategy": ("concat", "finetune reads one file"),
    "quantization_method": ("bnb", "finetune quantizes with bitsandbytes"),
    "double_quantization": (True, "finetune's 4-bit base is double-quantized, as bitsandbytes' QLoRA"),
    "rope_scaling": (None, "finetune loads the model's own rope"), "enable_liger_kernel": (False, None),
    "upcast_layernorm": (False, "finetune keeps layer norms in the model's dtype"),
    "resize_vocab": (False, "finetune keeps the tokenizer's vocabulary"),
    "streaming": (False, "finetune's reproduction reads the file whole"),
}
# keys read by their own functions below (quantization), not one by one
READ_HERE = {"quantization_bit", "quantization_type", "val_size", "max_samples", "disable_shuffling",
             "train_on_prompt"}
# keys that say where things go, or change no step: read, never carried
PLACES = {
    "model_name_or_path", "adapter_name_or_path", "cache_dir", "trust_remote_code", "do_train", "do_eval",
    "do_predict", "dataset", "dataset_dir", "eval_dataset", "overwrite_cache", "preprocessing_num_workers",
    "preprocessing_batch_size", "dataloader_num_workers", "output_dir", "save_steps", "save_strategy",
    "save_total_limit", "save_only_model", "plot_loss", "overwrite_output_dir", "report_to", "run_name",
    "logging_dir", "ddp_timeout", "resume_from_checkpoint", "per_device_eval_batch_size", "flash_attn",
    "disable_tqdm", "export_dir", "infer_backend", "hub_model_id", "push_to_hub",
    "disable_gradient_checkpointing", "gradient_checkpointing", "enable_thinking", "tokenized_path",
    "create_new_adapter", "print_param_status", "include_num_input_tokens_seen", "include_tokens_per_second",
    "stage", "finetuning_type", "lora_rank", "lora_alpha", "lora_target", "template", "packing", "pref_beta",
    "pref_loss", "ddp_find_unused_parameters", "trust_remote_code", "low_cpu_mem_usage", "image_max_pixels",
    "video_max_pixels", "ray_run_name", "use_ray", "torch_empty_cache_steps",
}
# LLaMA-Factory's templates that render ChatML, with their default system message (added to a conversation that has
# none): finetune renders them with the ChatML template and data.system_prompt
CHATML_TEMPLATES = {
    "smollm2": "You are a helpful AI assistant named SmolLM, trained by Hugging Face.", "smollm": "",
    "chatml": "", "qwen": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    "chatml_de": "Du bist ein freundlicher und hilfsbereiter KI-Assistent.",
}
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
# pref_loss → the preference task's loss_type (which task a stage trains, its hints say: CompareHints.peer_names)
PREF_LOSSES = {"sigmoid": "sigmoid", "hinge": "hinge", "ipo": "ipo"}


class LlamaFactory(Reader):
    name = "LLaMA-Factory"
    reads = ("its YAML (llamafactory-cli train, 0.x or v1; its eval, predict, chat and export configs refused as "
             "such) or its output folder (trainer_log.jsonl, training_args.yaml, the Trainer's files, the card, "
             "adapter_config.json, all_results.json's speed metrics)")

    def recognises(self, path: Path) -> bool:
        """A YAML with a ``stage`` and its template or fine-tuning type, or an output folder with its own log or the
        YAML its web UI saves."""
        if path.is_dir():
            return (path / LOG).is_file() or (path / SAVED_YAML).is_file()
        raw = yaml_mapping(path)
        return raw is not None and (kinds.is_v0(raw) or v1.is_v1(raw))

    def read(self, path: Path, what: str) -> Baseline:
        return read(path, what)

    def carry_own(self, b: Baseline, out, model_fields: dict, data_fields: set, baseline_step: bool) -> None:
        carry_own(b, out, model_fields, data_fields, baseline_step)

    def training_rows(self, b: Baseline, data, recipe: Path):
        return training_rows(b, data, recipe)

    def adapters_start(self, b: Baseline) -> tuple:
        if "format" in b.own:  # v1: its own trainer, whose draw was not checked
            return super().adapters_start(b)
        return True, ("LLaMA-Factory draws them after set_seed(seed), as finetune does before building the model "
                      "(checked with LLaMA-Factory 0.9.5, peft 0.18)")


SOURCE = LlamaFactory()


def read(path: Path, what: str) -> Baseline:
    """The LLaMA-Factory run at ``path`` (its YAML or its output folder); ConfigError (one line naming the file)
    when it is unreadable, or names a stage no task trains (ppo, rm, kto, pt)."""
    folder, yaml_file = (path, path / SAVED_YAML) if path.is_dir() else (None, path)
    raw = read_yaml(yaml_file, what) if yaml_file.is_file() else None
    if isinstance(raw, dict):
        kinds.refuse_non_training(raw, yaml_file, what, stages())
        if v1.is_v1(raw):
            return read_v1(raw, path)
    if folder is None:
        out = Path(str(raw.get("output_dir") or ""))
        folder = next((f for f in (out, path.parent / out) if str(out) and (f / "trainer_state.json").is_file()
                       or str(out) and (f / LOG).is_file()), None)
    if folder is not None and (folder / "trainer_state.json").is_file():
        b = files.read_folder(folder, what)
    else:
        b = Baseline(KIND, path)
        if folder is not None:  # no trainer_state.json: its card and adapters still say what they say
            read_beside(folder, b, what)
    b.kind, b.path = KIND, path
    if folder is not None and (folder / LOG).is_file():
        read_log(folder / LOG, b, what)
    if folder is not None:
        files.speed_batch(folder, b, what)
    if raw is None:  # trained from the command line: the web UI's saved YAML is not there
        if "gradient_accumulation_steps" not in b.args:
            b.assumed["gradient_accumulation_steps"] = (f"no {SAVED_YAML} nor training_args.bin in {path.name} says "
                                                        "the accumulation; give the YAML you trained with")
        b.unknown.append(f"{SAVED_YAML} (not in {path}: LLaMA-Factory's own settings — template, cutoff_len, "
                         "packing — are unknown; give the YAML you trained with)")
        if folder is not None:
            stage, said, logged = logged_stage(folder)
            b.own["stage"] = (stage, said)
            b.objective = stage_objective(b)
            if not logged:  # the default of a command line that may have named another stage
                b.assumed["objective"] = said
        return b
    read_yaml_keys(raw, yaml_file.name, b)
    named = rows.dataset_file(b)
    if named is not None:  # the one local file its dataset names in dataset_info.json
        b.data_file = (named, f"{yaml_file.name}: dataset {b.own['dataset'][0]} (its dataset_info.json entry)")
    if b.objective is None:  # refused here, naming the stage: a recipe of no task would fail on the stage's own keys
        raise ConfigError(f"{what}: stage: {raw.get('stage')} in {yaml_file} is not supported (supported: "
                          f"{', '.join(stages())})")
    return b


def read_v1(raw: dict, path: Path) -> Baseline:
    """A v1 YAML (:mod:`llamafactory_v1`), trained by the stage its data shows."""
    b = v1.read_v1(raw, path, KIND)
    stage = pair_stage() if v1.trains_pairs(raw, path) else stage_of(None)
    b.own["stage"] = (stage, Where(path.name, f"train_dataset (its converter: pair → {pair_stage()}, else "
                                              f"{stage_of(None)}; the command, llamafactory-cli v1 STAGE, decides)"))
    b.objective = stage_objective(b)
    return b


def read_beside(folder: Path, b, what: str) -> None:
    """An output folder without trainer_state.json: its card (base model, ``library_name``) and its model files
    (``adapter_config.json``: LoRA and its settings), as the Trainer's folder reader reads them."""
    if (folder / "README.md").is_file():
        files.read_card(folder / "README.md", b, what, required=False)
    files.read_model_files(b, [folder], what)


def has_yaml(b) -> bool:
    """Whether the run's YAML was read (given, or saved in its output folder)."""
    return b.path.is_file() or (b.path / SAVED_YAML).is_file()


def read_log(path: Path, b, what: str) -> None:
    """``trainer_log.jsonl``: one line per logged step (``current_steps``, ``total_steps``, ``loss``, ``lr``,
    ``epoch``). Where trainer_state.json gave no log (a run stopped early keeps only this file), its entries are the
    baseline's log; else it must agree with trainer_state's at every step it logs (the same run)."""
    entries, last = [], None
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
        except ValueError:
            raise ConfigError(f"{what}: {path} line {n} is not JSON") from None
        if not isinstance(e, dict) or "current_steps" not in e:
            raise ConfigError(f"{what}: {path} line {n} has no current_steps (LLaMA-Factory writes it on every line)")
        last = int(e["current_steps"])
        lr = e.get("lr", e.get("learning_rate"))  # "learning_rate" until 0.6, "lr" after
        if e.get("loss") is not None:  # logs of 2023 write every key on every line, null where not logged
            entries.append({"step": int(e["current_steps"]), "loss": float(e["loss"]),
                            **({"learning_rate": float(lr)} if lr is not None else {}),
                            **({"epoch": e["epoch"]} if e.get("epoch") is not None else {})})
        if e.get("eval_loss") is not None:
            b.evals.append((int(e["current_steps"]), float(e["eval_loss"])))
        if e.get("total_steps"):
            b.args.setdefault("schedule_steps", (int(e["total_steps"]), f"{path.name}: total_steps"))
        ended = e.get("total_steps") and int(e["current_steps"]) == int(e["total_steps"])
        if ended and isinstance(e.get("epoch"), (int, float)) and float(e["epoch"]).is_integer() and e["epoch"]:
            # the epoch its last planned step ends: the epochs it was given (a run cut by max_steps ends mid-epoch)
            b.args.setdefault("num_train_epochs", (int(e["epoch"]), Where(path.name, f"epoch {e['epoch']} at its "
                                                                          f"last step, {e['total_steps']}")))
    if not b.logs:
        b.logs = entries
        b.max_steps = b.max_steps or last  # its last line is the last step, with no loss logged
        return
    state = {e["step"]: e for e in b.logs}
    bad = next((e for e in entries if e["step"] in state and abs(state[e["step"]]["loss"] - e["loss"]) >
                1e-6 * max(1.0, abs(e["loss"]))), None)
    if bad is not None:
        raise ConfigError(f"{what}: {path} step {bad['step']} logs loss {bad['loss']} where trainer_state.json "
                          f"logs {state[bad['step']]['loss']}: not the same run")


def read_yaml_keys(raw: dict, name: str, b) -> None:
    """The YAML's keys onto ``b``: TrainingArguments names, LLaMA-Factory's own (``b.own``), not carried, unknown."""
    src = lambda key: Where(name, key)  # noqa: E731
    b.base_model = b.base_model or raw.get("model_name_or_path")
    for key, value in TRAINER_DEFAULTS.items():  # what the Trainer took where the YAML (and no other file) says
        if key not in raw:
            b.args.setdefault(key, (value, Where(name, f"{key} (not in it: the Trainer's default)")))
    if "num_train_epochs" not in raw and not raw.get("max_steps"):
        b.args.setdefault("num_train_epochs", (3.0, Where(name, "num_train_epochs (not in it: the Trainer's default)")))
    for key, value in raw.items():
        if key in TRAINER_KEYS:
            b.args[TRAINER_KEYS[key] or key] = (value, src(key))
        elif key in NOT_CARRIED:
            b.own[key] = (value, src(key))
        elif key not in PLACES and key not in READ_HERE:
            b.unknown.append(key)
    for key in ("stage", "finetuning_type", "lora_rank", "lora_alpha", "lora_dropout", "lora_target", "template",
                "packing", "pref_beta", "pref_loss", "train_on_prompt", "cutoff_len", "dataset", "dataset_dir",
                "preprocessing_batch_size", "preprocessing_num_workers"):
        if key in raw:
            b.own[key] = (raw[key], src(key))
    _quantization(raw, b, src)
    _rows_kept(raw, b, src)
    if raw.get("disable_shuffling"):  # its trainer's sequential sampler
        b.args["train_sampling_strategy"] = ("sequential", src("disable_shuffling"))
    if raw.get("pure_bf16"):  # bf16 compute: autocast by default, the pure step on request (carry_own)
        b.own["pure_bf16"] = (True, src("pure_bf16"))
        b.own["autocast"] = ("bf16" if raw.get("bf16") else "no", src("bf16"))
        b.args["bf16"] = (True, src("pure_bf16"))
    b.objective = stage_objective(b)
    if raw.get("finetuning_type", "lora") == "lora" and b.adapter_config is None:
        b.args["adapter"] = ("lora", src("finetuning_type"))
        b.args["lora_r"] = (raw.get("lora_rank", 8), src("lora_rank") if "lora_rank" in raw else
                            f"{name}: lora_rank (LLaMA-Factory's default)")
        b.args["lora_alpha"] = (raw.get("lora_alpha") or 2 * int(raw.get("lora_rank", 8)),
                                src("lora_alpha") if "lora_alpha" in raw else f"{name}: lora_rank × 2 "
                                                                            "(LLaMA-Factory's default lora_alpha)")
        b.args["lora_dropout"] = (raw.get("lora_dropout", 0.0), src("lora_dropout"))
        target = raw.get("lora_target", "all")
        b.args["lora_target_modules"] = ([t.strip() for t in str(target).split(",")] if target != "all" else
                                         "all-linear", src("lora_target"))
    elif raw.get("finetuning_type") == "full" and b.adapter_config is None:
        b.args["adapter"] = (None, f"{src('finetuning_type')}: full, every weight trained")
    elif raw.get("finetuning_type") not in (None, "lora", "full"):
        b.args["adapter"] = (None, f"{src('finetuning_type')}: {raw['finetuning_type']}, no adapters")
        b.uncarried.append(("finetuning_type", raw["finetuning_type"], "LLaMA-Factory trains only some layers "
                            "(freeze tuning); finetune trains every weight or LoRA adapters"))


def _rows_kept(raw: dict, b, src) -> None:
    """``max_samples`` (the first rows kept) and ``val_size`` (then split before preprocessing, the train part
    trained in its order): ``Baseline.held_out``, which import applies to ``--data``."""
    size, first = float(raw.get("val_size") or 0), raw.get("max_samples")
    if raw.get("streaming") or (size <= 1e-6 and not first):
        return
    said = [src(k) for k in ("max_samples", "val_size") if raw.get(k)]
    b.held_out = (int(first) if first else None, (int(size) if size > 1 else size) if size > 1e-6 else None,
                  int(raw.get("seed", 42)), ", ".join(said) + ("" if "seed" in raw or size <= 1e-6 else
                                                               ", seed 42 (the Trainer's default)"))


def _quantization(raw: dict, b, src) -> None:
    """``quantization_bit`` (bitsandbytes, LLaMA-Factory's default method): 4 → its ``quantization_type`` (nf4 by
    default, double-quantized), 8 → int8, as the Trainer-argument names ``settings`` reads."""
    bits = raw.get("quantization_bit")
    if bits is None or str(raw.get("quantization_method", "bnb")).lower() not in ("bnb", "bitsandbytes"):
        return
    if int(bits) == 4:
        b.args["load_in_4bit"] = (True, src("quantization_bit"))
        b.args["bnb_4bit_quant_type"] = (str(raw.get("quantization_type", "nf4")), src("quantization_type") if
                                         "quantization_type" in raw else "LLaMA-Factory's default quantization_type")
    elif int(bits) == 8:
        b.args["load_in_8bit"] = (True, src("quantization_bit"))
    else:
        b.uncarried.append(("quantization_bit", bits, "finetune quantizes to 4 or 8 bits"))


def carry_own(b, out, model_fields, data_fields: set, baseline_step: bool) -> None:
    """LLaMA-Factory's own settings onto the recipe (its source's ``carry_own``, last): its stage, template,
    preference loss and what it trains on; its packing (:func:`packing`); every other setting of
    :data:`NOT_CARRIED` that is not at its default, as not carried."""
    own = b.own
    if "format" in own:  # v1: its own trainer, none of 0.x's templates, packing or turn cutting
        return
    value = lambda key, default=None: own[key][0] if key in own else default  # noqa: E731
    replayed = out.values.get("training.replay_padding")
    if replayed and replayed[1] == 1:  # its SFT collator rounds each micro-batch's padding up, on the right
        out.set("training.replay_padding", [replayed[0], 8], "LLaMA-Factory's SFT collator pads each micro-batch "
                "to a multiple of 8 when training (pad_to_multiple_of=8 if do_train), on the right; per-device "
                f"batch {replayed[0]}")
    template = value("template")
    if template is not None:
        where = own["template"][1]
        if str(template) in CHATML_TEMPLATES:
            system = CHATML_TEMPLATES[str(template)] or None
            out.set("model.chat_template", CHATML, f"{where}: {template} renders ChatML, piece by piece as the "
                                                   "tokenizer's template does here")
            if "system_prompt" in data_fields:
                out.set("data.system_prompt", system, f"{where}: {template}'s default system message, added to a "
                                                      "conversation that has none" if system else
                        f"{where}: {template} adds no system message")
        else:
            out.skip("template", template, "finetune renders conversations with the tokenizer's own chat template; "
                     f"LLaMA-Factory's {template} template may render other text (finetune maps "
                     f"{', '.join(sorted(CHATML_TEMPLATES))})")
    if "turn_end" in data_fields and stage_has(b, "data", "turn_end"):
        out.set("data.turn_end", "trained", f"{own['template'][1] if 'template' in own else 'LLaMA-Factory'}: its "
                "templates train the whole assistant turn, the newline after its end token included")
    if stage_has(b, "data", "train_on") and "train_on" in data_fields and value("train_on_prompt"):
        out.set("data.train_on", "all", f"{own['train_on_prompt'][1]}: every token trained, the prompts and the "
                                        "system turn too")
    elif stage_has(b, "data", "train_on") and "train_on" in data_fields:
        out.set("data.train_on", "assistant", "LLaMA-Factory's default: the loss on the assistant's turns "
                                              "(train_on_prompt false)")
    if stage_has(b, "model", "beta") and not has_yaml(b):  # its beta and loss are in the YAML only
        out.skip("pref_beta", "unknown", f"not in {b.path.name} without its YAML: the recipe's model.beta and "
                 "model.loss_type are kept; give the YAML you trained with")
    elif stage_has(b, "model", "beta"):  # a preference stage
        if "beta" in model_fields:
            out.set("model.beta", float(value("pref_beta", 0.1)), own["pref_beta"][1] if "pref_beta" in own else
                    "LLaMA-Factory's default pref_beta")
        loss = str(value("pref_loss", "sigmoid"))
        if loss in PREF_LOSSES and "loss_type" in model_fields:
            out.set("model.loss_type", PREF_LOSSES[loss], own["pref_loss"][1] if "pref_loss" in own else
                    "LLaMA-Factory's default pref_loss")
        elif loss not in PREF_LOSSES:
            out.skip("pref_loss", loss, f"finetune's dpo has {', '.join(PREF_LOSSES)}")
    # neat_packing turns packing on; LLaMA-Factory packs for its sft stage only (its preference stages ignore it)
    if (value("packing") or value("neat_packing")) and stage_has(b, "data", "pack"):
        packing(b, out, data_fields, baseline_step)
    if value("pure_bf16"):
        pure_precision(out, own["pure_bf16"], "bf16", "LLaMA-Factory", baseline_step, model_fields,
                       autocast=own["autocast"][0])
    if stage_has(b, "data", "concatenate") and "concatenate" in data_fields:
        out.set("data.concatenate", True, f"{own['stage'][1] if 'stage' in own else 'LLaMA-Factory'}: its pt stage "
                "joins every text (each ending in the end-of-text token) and cuts blocks of cutoff_len")
    # its turn-by-turn cut, found by the labels: not when every token trains
    if stage_has(b, "data", "concatenate"):
        pass  # its blocks are cut, not dropped
    elif "cutoff_len" in own and "too_long" in data_fields and stage_allows(b, "data", "too_long", "turns") and \
            not value("train_on_prompt"):
        out.set("data.too_long", "turns", f"{own['cutoff_len'][1]}: LLaMA-Factory cuts a longer conversation turn by "
                                          "turn (infer_seqlen)")
    elif "cutoff_len" in own:
        out.not_carried.append(f"note: cutoff_len={value('cutoff_len')} — LLaMA-Factory cuts a longer conversation "
                               "turn by turn, finetune drops it (data.too_long=drop): the same while none is longer")
    for key, (default, why) in NOT_CARRIED.items():
        if key in own and own[key][0] not in (default, None) and why:
            out.skip(key, own[key][0], why)


def packing(b, out, data_fields: set, baseline_step: bool) -> None:
    """``packing: true``: LLaMA-Factory's step is of packed rows. Taken on request (``baseline_step``: ``data.pack:
    knapsack`` with its grouping), else named as not carried."""
    own = b.own
    neat = own.get("neat_packing", (False, ""))
    how = ("LLaMA-Factory packs the whole data set into rows of cutoff_len tokens before sampling (greedy knapsack; "
           + ("each packed conversation attends only to itself, neat_packing" if neat[0] else
              "the packed conversations attend to each other") + "): its steps are of packed rows, not the big "
           "batch's")
    if not baseline_step or "pack" not in data_fields:
        out.skip("packing", True, how + ("; finetune keeps its exact big-batch step (--baseline-step takes "
                                         "LLaMA-Factory's)" if not baseline_step else
                                         "; this recipe's task does not pack so (sft does)"))
        out.other_samples = "the baseline's batches were of LLaMA-Factory's packed rows"
        return
    where = own["packing"][1] if "packing" in own else neat[1]
    out.set("data.pack", "knapsack_neat" if neat[0] else "knapsack",
            f"{where}: packing=True — the baseline's own step (--baseline-step): {how}")
    group = own.get("preprocessing_batch_size", (1000, "LLaMA-Factory's default preprocessing_batch_size"))
    out.set("data.pack_group", int(group[0]), f"{group[1]}: preprocessing_batch_size, the rows packed together")
    workers = own.get("preprocessing_num_workers", (None, ""))
    out.set("data.pack_shards", int(workers[0] or 1), f"{workers[1]}: preprocessing_num_workers, contiguous shards "
            "packed apart" if workers[0] else "LLaMA-Factory's default: one preprocessing process")
    out.set("training.packing", False, "LLaMA-Factory packed the data set itself: its rows are the samples")
    if "cutoff_len" in own:  # packing: its DataArguments take one token off (rows of cutoff_len, padding included)
        out.set("data.max_length", int(own["cutoff_len"][0]) - 1, f"{own['cutoff_len'][1]} − 1: LLaMA-Factory "
                "packs conversations of at most cutoff_len − 1 tokens into rows of cutoff_len")


def training_rows(b: Baseline, data, recipe: Path):
    """``finetune import``'s ``--data`` for a LLaMA-Factory run (:func:`llamafactory_rows.training_rows`): a chat
    stage's rows (its task has a chat template) as messages, a preference stage's (its task has a beta) as pairs."""
    return rows.training_rows(b, data, recipe, chat=stage_has(b, "model", "chat_template"),
                              pairs=stage_has(b, "model", "beta"))
