"""What a baseline trained — its objective — read with where it is said, like every other setting, never assumed:
the tool's own word first (axolotl's ``rl``, torchtune's ``loss._component_``, LLaMA-Factory's ``stage``: each
source's reader sets ``Baseline.objective``), else the keys only one TRL trainer's config holds
(any one of them), the columns only one trainer logs, the model card's tags, and the model's own architecture.

An objective finetune trains gets its task (``sft`` with its loss mask, ``clm``, ``dpo``, ``grpo``: the built-in tasks
a baseline is imported as); one it does not (KTO, ORPO, PPO, a reward model, distillation, an encoder-decoder …) is
refused in one line naming it and what finetune trains, and so is a file that trains nothing (generation, evaluation,
merge, export). Where no file says it, :func:`said_objective` is None and ``import`` says so in its table.
"""

from __future__ import annotations

import re
from typing import Optional

from finetune.errors import ConfigError
from finetune.registry import built_in_hints
from finetune.reproduce.record import Baseline, Objective, Where, file_of

# what other tools train that finetune does not: objective → what it is, in a refusal
NOT_TRAINED = {
    "kto": "KTO (unpaired preference: desirable / undesirable rows)",
    "orpo": "ORPO (odds-ratio preference, no reference model)",
    "simpo": "SimPO (reference-free preference)",
    "cpo": "CPO (contrastive preference)",
    "bco": "BCO (binary classifier preference)",
    "ppo": "PPO (a policy trained against a value and a reward model)",
    "rloo": "RLOO (REINFORCE leave-one-out)",
    "online dpo": "online DPO (pairs sampled and judged while training)",
    "reward model": "a reward model (a scalar head trained on pairs)",
    "process reward model": "a process reward model (a score per reasoning step)",
    "distillation": "knowledge distillation (a student trained on a teacher's outputs)",
    "seq2seq": "an encoder-decoder (seq2seq) model",
    "masked lm": "a masked language model (a BERT-style encoder's fill-in-the-blank loss)",
    "task head": "a model with a task head (classification, tagging, extractive QA, CTC) and its own loss",
    "ebft": "axolotl's EBFT (energy-based fine-tuning)",
    "gdpo": "axolotl's GDPO (group DPO)",
}
# what a file that trains nothing does (its tool's inference, evaluation and conversion commands)
TRAINS_NOTHING = {
    "generation": "a generation config (it samples from a model)",
    "evaluation": "an evaluation config (it scores a model)",
    "prediction": "a prediction config (it runs a model over a data set)",
    "merge": "a merge config (it folds adapters into a model)",
    "export": "an export config (it converts or quantizes a model)",
}

# TRL's configs (trl/trainer/*_config.py, trl/experimental/*): keys that only the config of a trainer finetune does
# not have holds (GKDConfig derives from SFTConfig, RLOOConfig holds GRPOConfig's num_generations): looked at before
# the tasks' own (``CompareHints.arg_marks``) — a saved config (training_args.json / .bin) holds every field
MARKS = (
    ("seq2seq", ("predict_with_generate", "generation_num_beams", "sortish_sampler")),  # Seq2SeqTrainingArguments
    ("distillation", ("teacher_model_name_or_path", "teacher_model_init_kwargs", "lmbda", "seq_kd")),
    ("ppo", ("num_ppo_epochs", "vf_coef", "cliprange_value", "whiten_rewards", "sft_model_path")),
    ("reward model", ("center_rewards_coefficient",)),
    ("kto", ("desirable_weight", "undesirable_weight")),
    ("cpo", ("cpo_alpha", "simpo_gamma")),
    ("rloo", ("rloo_k", "normalize_advantages", "reward_clip_range")),
)
# the class of a saved trainer config (training_args.bin), Unsloth's (``Unsloth…``) alike, of a trainer finetune does
# not have → its objective (a task's own config classes are its hints' objective_names: SFTConfig, DPOConfig, …);
# the Trainer's own TrainingArguments (and a tool's subclass of it: axolotl's) says nothing of it
CLASSES = {"KTOConfig": "kto", "ORPOConfig": "orpo", "CPOConfig": "cpo", "BCOConfig": "bco", "PPOConfig": "ppo",
           "RLOOConfig": "rloo",
           "RewardConfig": "reward model", "PRMConfig": "process reward model", "GKDConfig": "distillation",
           "OnlineDPOConfig": "online dpo", "Seq2SeqTrainingArguments": "seq2seq"}
# keys every TRL preference trainer takes (DPO, ORPO, KTO, CPO): with no key of one trainer's own, the run's own
# names (output_dir, hub_model_id, run_name) may say which; else DPOConfig's (the preference task's)
PREFERENCE = ("beta", "max_prompt_length")
NAMED = ("orpo", "kto", "simpo", "cpo", "bco")
NAMES = ("output_dir", "hub_model_id", "run_name")
# columns that a trainer finetune does not have logs beside its loss (ORPO's odds ratio)
LOGGED = (("orpo", ("log_odds_ratio", "log_odds_chosen")),)
# the tags TRL writes into its cards' front matter (its trainers' _tag_names) for trainers finetune does not have;
# the tasks' own are their objective_names
TAGS = {"orpo": "orpo", "kto": "kto", "cpo": "cpo", "bco": "bco", "reward-trainer": "reward model", "ppo": "ppo",
        "gkd": "distillation", "rloo": "rloo", "online-dpo": "online dpo", "prm": "process reward model"}


def trained_tasks() -> tuple:
    """The built-in tasks a baseline is imported as: those with a base recipe (sft, dpo, grpo), and clm."""
    return tuple(sorted({name for name, h in built_in_hints().items() if h.base_recipe} | {"clm"}))


def named_task(word) -> Optional[str]:
    """The built-in task another tool calls ``word`` (its hints' ``objective_names``), None for none."""
    return next((name for name, h in built_in_hints().items() if str(word) in h.objective_names), None)


def marked_tasks() -> list:
    """(task, its hints) of the tasks a TRL trainer trains, the one with the most TRL marks first: a GRPOConfig
    holds DPOConfig's beta and loss_type, and every TRL config SFTConfig's fields of the Trainer."""
    found = [(name, h) for name, h in built_in_hints().items() if h.base_recipe and h.trl_marks is not None]
    return sorted(found, key=lambda pair: -len(pair[1].trl_marks))


def instruction_task() -> str:
    """The task of TRL's SFTTrainer (no TRL marks of its own): the loss on the response, the prompt masked — what
    another tool's instruction and chat data sets train."""
    return next(name for name, h in marked_tasks() if h.trl_marks == ())


def preference_task() -> str:
    """The task of a preference trainer (TRL's marks: the fewest that hold beta)."""
    return next(name for name, h in reversed(marked_tasks()) if "beta" in h.trl_marks)


def said_objective(b: Baseline) -> Optional[Objective]:
    """The objective the baseline's files say, with where; None when none of them says it."""
    if b.objective is not None:
        return b.objective
    return (_argument_class(b) or _architecture(b) or _marks(b) or _logged(b) or _tagged(b) or _trl(b) or
            _causal(b))


def _argument_class(b: Baseline) -> Optional[Objective]:
    """The trainer's config class a ``training_args.bin`` holds (``DPOConfig``, ``UnslothGRPOConfig``, …)."""
    if b.args_class is None:
        return None
    name, where = b.args_class
    stem = name.removeprefix("Unsloth")
    objective = named_task(stem) or CLASSES.get(stem)
    if objective == "seq2seq" and _decoder(b):
        return None
    return Objective(objective, f"{where}: {name}") if objective else None


def _decoder(b: Baseline) -> bool:
    """Whether the model's own files say it is a decoder: its config.json without ``is_encoder_decoder``, or its
    adapters' ``task_type: CAUSAL_LM``. Seq2SeqTrainingArguments (its class, its predict_with_generate …) says
    nothing then: LLaMA-Factory and ms-swift save it for every causal LM they fine-tune."""
    config, adapter = b.model_config or {}, b.adapter_config or {}
    return bool(config.get("architectures")) and not config.get("is_encoder_decoder") or \
        adapter.get("task_type") == "CAUSAL_LM"


def task_of(b: Baseline, what: str = "import") -> Optional[str]:
    """The built-in task the baseline's objective is (None: no file says it); ConfigError (one line) for an
    objective finetune does not train, or a file that trains nothing."""
    objective = said_objective(b)
    if objective is None:
        return None
    check(objective, b, what)
    return objective.name


def check(objective: Objective, b: Baseline, what: str) -> None:
    """ConfigError (one line) unless ``objective`` is one finetune trains."""
    if objective.name in TRAINS_NOTHING:
        raise ConfigError(f"{what}: {b.path} trains nothing: {TRAINS_NOTHING[objective.name]} ({objective.where}); "
                          "give the config or output folder of a training run")
    if objective.name not in trained_tasks():
        what_it_is = NOT_TRAINED.get(objective.name, objective.name)
        raise ConfigError(f"{what}: {b.path} trains {what_it_is} ({objective.where}), which finetune does not; "
                          f"finetune trains {', '.join(trained_tasks())} ({instruction_task()} with its loss mask)")


def _where(b: Baseline, key: str) -> str:
    """Where the argument ``key`` is said: ``file: key``."""
    source = b.args[key][1]
    return str(source) if isinstance(source, Where) and source.key else f"{file_of(source)}: {key}"


def _marks(b: Baseline) -> Optional[Objective]:
    """Any one key only one trainer's config holds, else a preference trainer's keys (beta …)."""
    own = [(name, h.arg_marks) for name, h in marked_tasks()]
    for name, keys in MARKS + tuple(own):
        key = next((k for k in keys if k in b.args), None)
        if key is not None and not (name == "seq2seq" and _decoder(b)):
            return Objective(name, f"{_where(b, key)} (only {name}'s trainer takes it)")
    key = next((k for k in PREFERENCE if k in b.args), None)
    if key is None:
        return None
    named = _named(b)
    if named is not None:
        return Objective(named[0], f"{_where(b, key)}, a preference trainer's; {named[1]} names {named[0]}")
    return Objective(preference_task(), f"{_where(b, key)}, a preference trainer's (DPOConfig: no key of ORPO's, "
                                        "KTO's or CPO's)")


def _named(b: Baseline) -> Optional[tuple]:
    """(the preference objective the run's own names say, the key that says it)."""
    for key in NAMES:
        words = set(re.split(r"[^a-z0-9]+", str(b.get(key) or "").lower()))
        found = next((n for n in NAMED if n in words), None)
        if found is not None:
            return found, _where(b, key)
    return None


def _logged(b: Baseline) -> Optional[Objective]:
    """The columns one trainer logs beside its loss (``CompareHints.log_marks``, DPO's ``rewards/chosen``)."""
    logged = {key for entry in b.logs for key in entry}
    own = [(name, h.log_marks) for name, h in marked_tasks() if h.log_marks]
    for name, columns in LOGGED + tuple(own):
        if set(columns) <= logged:
            return Objective(name, f"its log's {', '.join(columns)} (only {name}'s trainer logs it)")
    return None


def _tagged(b: Baseline) -> Optional[Objective]:
    """The tag TRL writes into the card of each trainer's run."""
    for tag in b.tags:
        name = named_task(tag) or TAGS.get(tag)
        if name is not None:
            return Objective(name, f"README.md: tags {tag}")
    return None


def _trl(b: Baseline) -> Optional[Objective]:
    """A TRL run holding none of another trainer's keys: its SFTTrainer's (``trl sft``)."""
    if not b.trl:
        return None
    return Objective(instruction_task(), f"{b.path.name}: TRL's, with no key of another TRL trainer's (DPO's beta, "
                                         "GRPO's num_generations, …): its SFTTrainer")


def _architecture(b: Baseline) -> Optional[Objective]:
    """An encoder-decoder model (T5, BART: ``is_encoder_decoder`` in its config.json), which no objective of
    finetune's trains."""
    config = b.model_config or {}
    if config.get("is_encoder_decoder"):
        kind = ", ".join(config.get("architectures") or []) or config.get("model_type") or "it"
        return Objective("seq2seq", f"config.json: is_encoder_decoder ({kind})")
    for arch in config.get("architectures") or []:
        head = next((name for name, ends in HEADS if str(arch).endswith(ends)), None)
        if head is not None:
            return Objective(head, f"config.json: architectures {arch}")
    return None


# the heads transformers names its model classes by (``BertForMaskedLM``, ``…ForSequenceClassification``) that no
# objective of finetune's trains: a config.json saved with one says what the run trained
HEADS = (("masked lm", ("ForMaskedLM",)),
         ("task head", ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                        "ForMultipleChoice", "ForCTC", "ForAudioClassification", "ForImageClassification")))


def _causal(b: Baseline) -> Optional[Objective]:
    """A causal LM trained by the Trainer's own arguments (no TRL trainer's key): its next-token loss on every
    token."""
    config = b.model_config or {}
    arch = next((a for a in config.get("architectures") or [] if str(a).endswith("ForCausalLM")), None)
    if arch is None or not b.args:
        return None
    return Objective("clm", f"config.json: architectures {arch}, trained with the Trainer's own arguments (no "
                            "TRL trainer's key)")
