"""An ms-swift run (4.x: ``swift sft``, ``swift rlhf``): its output folder — ``args.json`` (every argument, swift's
own beside the TrainingArguments), ``logging.jsonl`` (one line per logged step) and ``checkpoint-*/`` with the
Trainer's files (``trainer_state.json``, ``training_args.bin`` pickling swift's ``Seq2SeqTrainingArguments``, the
adapters or weights) — or one of its checkpoint folders.

ms-swift trains with the HF Trainer's step, read from its source (4.6.0): the loss is the window's token mean
(``Seq2SeqTrainer.compute_loss`` divides by ``num_items_in_batch``); its sampler (``dataloader/shard.py``,
``BatchSamplerShard``) draws ``torch.randperm(n)`` from ``data_seed + epoch`` as the Trainer's does
(``training.sample_order: trainer``), in file order with ``train_dataloader_shuffle: false``. Its ``chatml`` template
renders a conversation as ChatML, no system message added unless ``system`` says one, and with ``loss_scale:
default`` trains each assistant turn with the ``<|im_end|>\\n`` after it (``data.train_on: assistant``,
``data.turn_end: trained``); ``truncation_strategy: delete`` drops a longer conversation. Before any of that it
shuffles the rows once (``dataset_shuffle: true``, its default): ``load_dataset`` (``swift/dataset/loader.py``) makes
``np.random.RandomState(data_seed)``, draws from it (``get_seed``: ``randint(0, 2**31 - 1)``) once per data set
(4.6: ``init_decision_augment``'s seed, drawn whether or not it is used) and then the seed of
``Dataset.shuffle(seed=…)`` (datasets') over the concatenated rows; the too-long rows are dropped after it, the
sampler draws over what is left. That order is ``Baseline.shuffled``: ``finetune import --data`` writes the rows in
it. What it does that finetune does not (packing; a split of the data; streaming) is named as not carried.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import finetune.reproduce.sources.files as files
from finetune.registry import built_in_hints
from finetune.reproduce.objective import named_task, task_of
from finetune.reproduce.record import Baseline, Objective, Where, local_file, pure_precision
from finetune.reproduce.sources.contract import Reader

ARGS = "args.json"
LOG = "logging.jsonl"
KIND = "ms-swift run"
# swift's templates that render ChatML, with the system message they add to a conversation that has none
CHATML_TEMPLATES = {"chatml": None}
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
TRUNCATION = {"delete": "drop", "right": "keep_start", "left": "keep_end"}  # truncation_strategy → data.too_long
# swift's own arguments that change the steps and that finetune cannot take: name → (its default, why)
NOT_CARRIED = {
    "packing": (False, "ms-swift packs rows before sampling; finetune's reproduction trains them unpacked"),
    "padding_free": (False, "ms-swift concatenates each micro-batch's rows; the steps are the same only while no "
                            "attention crosses rows"),
    "split_dataset_ratio": (0.0, "ms-swift holds rows out with its own random state; give --data the rows it trained "
                                 "on"),
    "streaming": (False, "ms-swift streams the rows in the file's order (shuffled in a buffer of "
                         "shuffle_buffer_size with dataset_shuffle), no sampler on top"),
    "loss_type": (None, "finetune's sft trains the token-mean cross-entropy"),
    "use_rslora": (False, "finetune scales LoRA by alpha / r"), "use_dora": (False, "finetune's LoRA is plain LoRA"),
    "lorap_lr_ratio": (None, "finetune gives every LoRA weight one learning rate"),
    "neftune_noise_alpha": (None, "finetune has no NEFTune"),
}


# the TrainingArguments that args.json holds beside swift's own (the same values training_args.bin pickles) and
# that import carries: read from it where the folder has no training_args.bin
TRAINER_KEYS = ("learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs",
                "max_steps", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "weight_decay", "max_grad_norm",
                "optim", "adam_beta1", "adam_beta2", "adam_epsilon", "seed", "data_seed", "bf16", "fp16",
                "gradient_checkpointing", "eval_strategy", "eval_steps", "dataloader_drop_last", "logging_steps",
                "deepspeed")


def swift_args(path: Path) -> Optional[dict]:
    """The folder's ``args.json`` when ms-swift wrote it (its ``tuner_type`` and ``template`` beside the model's),
    else None."""
    found = path / ARGS
    if not found.is_file():
        return None
    try:
        args = files.json_object(found, "baseline")
    except Exception:  # not JSON: another tool's file, or none the reader below would take
        return None
    return args if {"tuner_type", "template", "model_type"} <= set(args) else None


class MsSwift(Reader):
    name = "ms-swift"
    reads = ("its output folder (args.json, logging.jsonl, checkpoint-*/ with the Trainer's files) or one of its "
             "checkpoint folders")

    def recognises(self, path: Path) -> bool:
        return path.is_dir() and swift_args(path) is not None

    def read(self, path: Path, what: str) -> Baseline:
        b = files.read_folder(path, what) if files.state_file(path) else Baseline(KIND, path)
        b.kind = KIND
        args = files.json_object(path / ARGS, what)
        for key in TRAINER_KEYS:  # args.json says them too: where no training_args.bin beside it does
            if key in args and key not in b.args:
                b.args[key] = (args[key], Where(ARGS, key))
        read_args(args, b)
        return b

    def task(self, b: Baseline) -> Optional[str]:
        """``swift rlhf``: the task whose TRL trainer it runs (its marks: DPO's beta and loss type); ``swift sft``:
        the task TRL's SFTTrainer trains (no marks of its own)."""
        if b.objective is not None:  # swift rlhf: its rlhf_type (read_args)
            return task_of(b)
        return next((name for name, h in built_in_hints().items() if h.base_recipe and h.trl_marks == ()), None)

    def adapters_start(self, b: Baseline) -> tuple:
        return True, ("ms-swift seeds (seed_everything(seed)) before it loads the model and adds the adapters, as "
                      "finetune seeds before building the model (checked with ms-swift 4.6.0, peft 0.20)")

    def carry_own(self, b: Baseline, out, model_fields: dict, data_fields: set, baseline_step: bool) -> None:
        carry_own(b, out, model_fields, data_fields, baseline_step)


SOURCE = MsSwift()


def read_args(args: dict, b: Baseline) -> None:
    """swift's own arguments onto ``b``: its base model, length, template, what it trains on, the order of its rows,
    its LoRA or full fine-tuning, its dtype, and what finetune cannot take."""
    where = lambda key: Where(ARGS, key)  # noqa: E731
    if args.get("model"):
        b.base_model, b.base_model_where = args["model"], f"{ARGS}: model"
    for key in ("template", "system", "loss_scale", "truncation_strategy", "rlhf_type", "tuner_type"):
        if key in args:
            b.own[key] = (args[key], where(key))
    if args.get("rlhf_type"):  # the trainer swift rlhf ran: the task another tool calls so, else refused naming it
        b.objective = Objective(named_task(args["rlhf_type"]) or str(args["rlhf_type"]),
                                where("rlhf_type").said(f" {args['rlhf_type']}"))
    if args.get("max_length"):
        b.args["max_length"] = (int(args["max_length"]), where("max_length"))
    if args.get("train_dataloader_shuffle") is False:
        b.args["train_sampling_strategy"] = ("sequential", where("train_dataloader_shuffle"))
    if args.get("tuner_type") == "full" and b.adapter_config is None:
        b.args["adapter"] = (None, where("tuner_type").said(": full, every weight trained"))
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(str(args.get("torch_dtype")))
    if dtype and args.get("tuner_type") == "lora":
        b.args["model_dtype"] = (dtype, where("torch_dtype").said(" (the frozen base; the adapters train in fp32)"))
    elif dtype:
        b.own["pure"] = (dtype, where("torch_dtype"))
    for key, (default, why) in NOT_CARRIED.items():
        if args.get(key) not in (default, None, [], {}):
            b.uncarried.append((key, args[key], why))
    rows_shuffled(args, b)
    datasets = args.get("dataset") or []
    if len(datasets) == 1 and (found := local_file(datasets[0], b.path)) is not None:
        b.data_file = (found, where("dataset"))
    if not b.logs and (b.path / LOG).is_file():
        b.logs = read_log(b.path / LOG)
        b.max_steps = b.logs[-1]["step"] if b.logs else None
    b.logs = lr_of_each_step(b.logs, b)


# the versions whose load_dataset (swift/dataset/loader.py) was read, and how many draws it makes from its random
# state per data set before the shuffle's seed: 4.0–4.5 none (a split's train_test_split aside), 4.6 one (the seed
# of init_decision_augment, an argument evaluated for every data set)
DRAWS_PER_SET = {(4, minor): 0 for minor in range(6)} | {(4, 6): 1}


def rows_shuffled(args: dict, b: Baseline) -> None:
    """swift's one shuffle of the training rows (``dataset_shuffle``, its default true) onto ``b.shuffled``: the seed
    it hands datasets' ``Dataset.shuffle``, drawn as its ``load_dataset`` draws it; named as not carried where the
    order is not the shuffled file's (a split, streaming, interleaving, cached or sampled data sets, a version not
    read)."""
    said = "dataset_shuffle " + ("true" if "dataset_shuffle" in args else "(ms-swift's default true)")
    if args.get("dataset_shuffle", True) is False:
        return
    sets, version = args.get("dataset") or [], str(args.get("swift_version") or "")
    why = unreplayed(args, sets, version)
    if why is not None:
        b.uncarried.append(("dataset_shuffle", True, f"ms-swift shuffles the rows once before training, and {why}: "
                            "give --data the rows in the order it trained them"))
        return
    draws = DRAWS_PER_SET[release(version)] * len(sets)
    data_seed = int(args.get("data_seed", 42))
    seed = shuffle_seed(data_seed, draws)
    b.shuffled = (seed, f"{ARGS}: {said}, data_seed {data_seed} (ms-swift {version}: the seed is draw {draws + 1} "
                        f"of np.random.RandomState({data_seed}), as its load_dataset draws it)"
                  + (f", its {len(sets)} data sets one after another" if len(sets) > 1 else ""))


def unreplayed(args: dict, sets: list, version: str) -> Optional[str]:
    """Why swift's training rows are not the file's rows shuffled with the seed :func:`shuffle_seed` draws (None:
    they are)."""
    if release(version) not in DRAWS_PER_SET:
        return (f"finetune replays the order of ms-swift {min(DRAWS_PER_SET)[0]}.0–{max(DRAWS_PER_SET)[0]}."
                f"{max(DRAWS_PER_SET)[1]} (read in their swift/dataset/loader.py), not of {version or 'a version'}"
                " its args.json does not say")
    reasons = [(float(args.get("split_dataset_ratio") or 0) > 0, "holds rows out first (split_dataset_ratio)"),
               (bool(args.get("streaming")), "streams them (shuffled in a buffer)"),
               (args.get("interleave_prob") is not None, "interleaves its data sets (interleave_prob)"),
               (bool(args.get("cached_dataset")), "puts its cached data sets first (cached_dataset)"),
               (any(re.search(r"#\d+$", str(d)) for d in sets), "samples its data sets (DATASET#N) with the same "
                                                               "random state"),
               (not sets, "its args.json names no data set"),
               (args.get("data_seed", 42) is None, "draws its seed from a random state seeded by the OS (data_seed "
                                                   "null)")]
    return next((why for holds, why in reasons if holds), None)


def release(version: str) -> Optional[tuple]:
    """(major, minor) of a version such as ``4.6.0`` (None: not one)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else None


def shuffle_seed(data_seed: int, draws_before: int) -> int:
    """The seed ms-swift's ``load_dataset`` hands ``Dataset.shuffle`` for its training rows: its random state
    ``np.random.RandomState(data_seed)`` (``swift/dataset/loader.py``), ``draws_before`` draws made, then one more,
    each as its ``get_seed`` draws (``swift/utils/np_utils.py``: ``randint(0, np.iinfo(np.int32).max)``)."""
    import numpy as np

    state = np.random.RandomState(data_seed)
    draws = [state.randint(0, np.iinfo(np.int32).max) for _ in range(draws_before + 1)]
    return int(draws[-1])


def lr_of_each_step(logs: list, b: Baseline) -> list:
    """swift's trainer reads the lr it logs after the scheduler stepped (``trainers/mixin.py``,
    ``_maybe_log_save_evaluate``): the entry of step k holds step k + 1's. Each step's is the previous entry's (step
    1's the schedule's start: 0 under a warm-up, else the optimizer's lr) where every step is logged; where some are
    not, the lr is left out (not checkable)."""
    every = [e["step"] for e in logs] == list(range(1, len(logs) + 1))
    warm = int(b.get("warmup_steps") or 0) > 0 or float(b.get("warmup_ratio") or 0) > 0
    start = 0.0 if warm else b.get("learning_rate")
    out = []
    for n, e in enumerate(logs):
        e = {k: v for k, v in e.items() if k != "learning_rate"}
        lr = (logs[n - 1].get("learning_rate") if n else start) if every else None
        out.append({**e, "learning_rate": lr} if lr is not None else e)
    return out


def read_log(path: Path) -> list:
    """``logging.jsonl``: one line per logged step (``global_step/max_steps``, loss, lr, grad norm), as the
    Trainer's log entries."""
    entries = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        e = json.loads(line) if line.strip() else {}
        step = str(e.get("global_step/max_steps", "")).split("/")[0]
        if "loss" in e and step.isdigit():
            entries.append({"step": int(step), "loss": float(e["loss"]), "learning_rate": e.get("learning_rate"),
                            **({"grad_norm": float(e["grad_norm"])} if "grad_norm" in e else {})})
    return entries


def carry_own(b: Baseline, out, model_fields: dict, data_fields: set, baseline_step: bool) -> None:
    """swift's own settings onto the recipe (its source's ``carry_own``, last): the
    template it rendered with and its system message, the tokens it trained, how it treated a longer conversation, a
    pure low-precision run."""
    own = b.own
    template, where = own.get("template", (None, None))
    if str(template) in CHATML_TEMPLATES and "chat_template" in model_fields:
        out.set("model.chat_template", CHATML, f"{where}: {template} renders ChatML, as ms-swift's template does")
        if "system_prompt" in data_fields:
            system = own.get("system", (None, None))[0] or CHATML_TEMPLATES[str(template)]
            out.set("data.system_prompt", system, own["system"][1] if "system" in own else
                    f"{where}: {template} adds no system message")
    elif template is not None:
        out.skip("template", template, "finetune maps ms-swift's " + ", ".join(CHATML_TEMPLATES) + " template; "
                 "another may render other text: set model.chat_template to its jinja")
    scale, said = own.get("loss_scale", ("default", "ms-swift's default loss_scale"))
    if scale == "default" and {"train_on", "turn_end"} <= data_fields:
        out.set("data.train_on", "assistant", f"{said}: the loss on the assistant's turns")
        out.set("data.turn_end", "trained", f"{said}: each assistant turn trained with the template's text after "
                                            "its end token")
    elif scale != "default":
        out.skip("loss_scale", scale, "finetune trains the assistant's turns, every token weighed alike")
    cut, said = own.get("truncation_strategy", ("delete", "ms-swift's default truncation_strategy"))
    if cut in TRUNCATION and "too_long" in data_fields:
        out.set("data.too_long", TRUNCATION[cut], f"{said}: {cut}")
    elif cut not in TRUNCATION:
        out.skip("truncation_strategy", cut, f"finetune drops or cuts a longer conversation ({', '.join(TRUNCATION)})")
    if "pure" in own:
        pure_precision(out, own["pure"], own["pure"][0], "ms-swift", baseline_step, model_fields)
