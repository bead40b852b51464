"""Causal language modelling: fine-tune any ``AutoModelForCausalLM`` (or one built from a config) on local text.

Default corpus: the ≈2 000 paragraphs of the Python documentation that ship with Python itself
(``pydoc_data.topics``). Any text / json / jsonl / csv / parquet file works too (``data.source``). The tokenizer
comes from the model directory, or — for a model built from ``model.config`` — is trained on the training split
with ``tokenizers`` (byte-level BPE) and cached. Token weighting over each window uses the shifted count of real
label tokens (the loop's ``items: auto``), so the loss is exact for any head.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from pydoc_data import topics
from typing import Optional

import tokenizers
import torch

from finetune import cache, tables
from finetune.config import GGUF, BaseDataConfig, PretrainedModelConfig
from finetune.data import check_data_source, held_out, load_local_table, pad_collate, split
from finetune.errors import ConfigError
from finetune.job import CompareHints, Job, TaskContext
from finetune.models import precision
from finetune.models.forward import set_dropout
from finetune.models.hf import apply_peft, from_pretrained, peft_save_hook, precision_kwargs, resolve_model_path
from finetune.models.hf import from_config as new_model
from finetune.schema import doc
from finetune.validation import refuse_precision_for_new_model

# LLaMA-Factory's pt stage trains a causal LM on plain text: this task
COMPARE_HINTS = CompareHints(counted_as_peers=True, peer_names={"llamafactory": "pt"})

# datasets and transformers (0.6 s each) are imported in the functions that use them: `finetune validate`
# imports this module to check a recipe and loads no data nor model.


@dataclass
class ModelConfig(PretrainedModelConfig):
    config: Optional[dict] = doc("build a new model from this config (model_type + sizes) when name_or_path is "
                                 "null, e.g. {model_type: gpt2, n_layer: 4, n_embd: 128, n_head: 4}", None)
    tokenizer: Optional[str] = doc("tokenizer dir or hub id (null: name_or_path's, or one trained on the data)", None,
                                   needs=GGUF)
    vocab_size: int = doc("vocabulary of the tokenizer trained when there is none", 4096)
    sample_prompt: str = doc("prompt of the text sample generated at the end ('' to skip)", "The")
    sample_tokens: int = doc("length of that sample, in tokens", 40)


@dataclass
class DataConfig(BaseDataConfig):
    source: str = doc("'pydoc' (the Python docs shipped with Python) or a txt / json / jsonl / csv / parquet file",
                      "pydoc")
    text_field: str = doc("column holding the text (json / csv / parquet)", "text")
    seq_len: int = doc("tokens per sample: longer texts are truncated (or, with concatenate, cut into blocks)", 128,
                       at_least=2)
    concatenate: bool = doc("concatenate all texts and cut blocks of seq_len (no padding) instead of one text a "
                            "sample: other samples (training.packing packs whole samples into rows)", False)
    min_chars: int = doc("drop texts shorter than this", 40)

    # data.packing was this setting's name until training.packing existed beside it, meaning something else
    MOVED = {"concatenate": "data.packing"}


def validate(cfg, problems: list) -> None:
    m, d = cfg.model, cfg.data
    if m.name_or_path is None and m.config is None:
        problems.append("model.name_or_path: give a model (hub id or directory) or model.config to build one")
    if m.name_or_path is None:
        refuse_precision_for_new_model(m, problems)
    if m.config is not None and "model_type" not in m.config:
        problems.append("model.config: needs model_type (e.g. gpt2, llama)")
    check_data_source(d.source, "pydoc", problems)


def pydoc_paragraphs(min_chars: int = 40) -> list[str]:
    """Paragraphs of the Python documentation bundled with the interpreter (pydoc_data.topics)."""
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) >= min_chars]


def load_rows(d: DataConfig):
    """The texts of the data source (a ``text`` column), in its order; one line, before any is tokenized, when a file
    has no ``data.text_field`` column (``finetune import`` checks its ``--data`` with it too)."""
    import datasets

    if d.source == "pydoc":
        return datasets.Dataset.from_dict({"text": pydoc_paragraphs(d.min_chars)})
    path = Path(d.source)
    table = load_local_table(path, {"txt": "text", "text": "text", "md": "text", "json": "json", "jsonl": "json",
                                    "csv": "csv", "parquet": "parquet"},
                             {ext: {"sample_by": "paragraph"} for ext in ("txt", "text", "md")})
    if d.text_field not in table.column_names:
        raise ConfigError(f"data.text_field: no column {d.text_field!r} in {path}; "
                          f"columns: {', '.join(table.column_names)}")
    table = table.rename_column(d.text_field, "text") if d.text_field != "text" else table
    return table.filter(lambda x: x["text"] is not None and len(x["text"].strip()) >= d.min_chars)


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``texts`` (cached by content and size), as a transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    digest = hashlib.sha256(("\x00".join(texts) + f"|{vocab_size}").encode()).hexdigest()[:16]

    def build(out: Path) -> None:
        byte_level = tokenizers.pre_tokenizers.ByteLevel
        tok = tokenizers.Tokenizer(tokenizers.models.BPE())
        tok.pre_tokenizer = byte_level(add_prefix_space=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<pad>"],
                                                 initial_alphabet=byte_level.alphabet(), show_progress=False)
        tok.train_from_iterator(texts, trainer)
        tok.save(str(out / "tokenizer.json"))

    path = cache.folder(cache.root() / "tokenizers" / f"bpe-{vocab_size}-{digest}", build, "trained tokenizer")
    return PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<pad>")


# what a new model's config takes from its tokenizer, never from model.config
FROM_TOKENIZER = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")


def build_model(m: ModelConfig, tokenizer, precision: dict):
    """The pretrained model (loaded with ``precision``: ``from_pretrained``'s dtype / quantization keywords), or a
    new one from ``model.config`` (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if m.name_or_path is not None:
        model = from_pretrained(AutoModelForCausalLM, resolve_model_path(m.name_or_path),
                                trust_remote_code=m.trust_remote_code, **precision, **(m.config or {}))
    else:
        fields = dict(m.config)
        taken = sorted(set(fields) & set(FROM_TOKENIZER))
        if taken:  # for_model would get them twice: a TypeError deep in transformers
            raise ConfigError(f"model.config: {', '.join(taken)} {'comes' if len(taken) == 1 else 'come'} from the "
                              "tokenizer (model.vocab_size sizes the "
                              "one trained here, model.tokenizer names another); remove them from model.config")
        arch = AutoConfig.for_model(fields.pop("model_type"), vocab_size=len(tokenizer),
                                    bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.pad_token_id, **fields)
        model = new_model(AutoModelForCausalLM, arch, trust_remote_code=m.trust_remote_code)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "loss_type", "") is None:  # e.g. GPT2LMHeadModel: transformers falls back to this, with a warning
        model.loss_type = "ForCausalLM"
    return model


def build(cfg, ctx: Optional[TaskContext] = None) -> Job:
    m, d = cfg.model, cfg.data
    texts = load_rows(d)
    val_size, held_out_note = held_out(len(texts), d.val_fraction, d.val_minimum and d.source != "pydoc")
    if held_out_note and (ctx is None or ctx.main):
        print(held_out_note, flush=True)
    train_texts, val_texts = split(texts, val_size, d.split_seed, d.limit)
    if m.tokenizer or m.name_or_path:
        from transformers import AutoTokenizer

        tokenizer = from_pretrained(AutoTokenizer, resolve_model_path(m.tokenizer or m.name_or_path),
                                    "model.tokenizer" if m.tokenizer else "model.name_or_path",
                                    trust_remote_code=m.trust_remote_code)
    else:
        tokenizer = train_tokenizer(list(train_texts["text"]), m.vocab_size)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = build_model(m, tokenizer, precision_kwargs(cfg) if m.name_or_path is not None else {})
    set_dropout(model, m.dropout)
    model = apply_peft(model, cfg.peft, "CAUSAL_LM", cfg.training.mixed_precision,
                      precision.trained_dtype(cfg.model))

    def tokenize(batch):
        eos = tokenizer.eos_token or ""
        if d.concatenate:
            return tokenizer([t + eos for t in batch["text"]])
        return tokenizer(batch["text"], truncation=True, max_length=d.seq_len)

    def pack(batch):  # concatenate, cut into blocks of seq_len (the remainder is dropped)
        ids = [t for row in batch["input_ids"] for t in row]
        n = len(ids) // d.seq_len * d.seq_len
        return {"input_ids": [ids[i:i + d.seq_len] for i in range(0, n, d.seq_len)]}

    def prepare(table):
        if table is None:
            return None
        # Tokenized sets are cached on disk, keyed by the texts, the tokenizer and the settings.
        texts_hash = tables.digest(tables.data_digest(d.source, texts), table._fingerprint)  # the rows of this part
        key = hashlib.sha256("|".join([texts_hash, tokenizer.backend_tokenizer.to_str()
                                       if getattr(tokenizer, "is_fast", False) else tokenizer.name_or_path,
                                       str(d.seq_len), str(d.concatenate)]).encode()).hexdigest()[:16]
        import datasets

        def build(out: Path) -> None:
            tokens = table.map(tokenize, batched=True, remove_columns=table.column_names, desc="tokenize")
            tokens = tokens.remove_columns([c for c in tokens.column_names if c != "input_ids"])
            tokens = tokens.map(pack, batched=True, batch_size=1000, desc="pack") if d.concatenate else tokens
            tokens.save_to_disk(str(out))

        return datasets.load_from_disk(str(cache.folder(cache.root() / "datasets" / f"clm-{key}", build,
                                                        "tokenized data set")))

    train, val = prepare(train_texts), prepare(val_texts)
    lengths = tables.token_lengths(train)

    def summarize(trained, run_dir=None):
        if not m.sample_prompt:
            return {}
        trained.eval()
        inputs = tokenizer(m.sample_prompt, return_tensors="pt").to(next(trained.parameters()).device)
        with torch.no_grad():
            out = trained.generate(**inputs, max_new_tokens=m.sample_tokens, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id, synced_gpus=False)  # main process alone
        text = tokenizer.decode(out[0], skip_special_tokens=True)
        print(f"sample: {text!r}", flush=True)
        return {"sample": text}

    return Job(
        model=model, train_data=train, val_data=val, tokenizer=tokenizer,
        collate_fn=pad_collate(tokenizer.pad_token_id),
        length_of=lambda i: int(lengths[i]),
        val_loss_metrics=lambda loss: {"perplexity": math.exp(min(loss, 50.0))},
        summarize=summarize,
        save=peft_save_hook(cfg, tokenizer),
    )
