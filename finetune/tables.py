"""Tables of samples kept in Arrow: a task's rows are encoded once, by ``datasets.Dataset.map`` in several processes,
into a folder of the on-disk cache (``finetune.cache``), and every run reads that folder memory-mapped. The windows
read each sample's length from a column, so no sample becomes a Python object until its micro-batch is collated.

The cache key holds everything that shapes a sample: the data's bytes (or datasets' fingerprint of a saved folder or
a hub dataset), the tokenizer with its chat template, the task's settings and ``ENCODING``. A second run with the
same key reads the folder and tokenizes nothing; a changed template or setting makes another folder.

    >>> how = Encoding("sft", lambda row, i: encode_row(tokenizer, row, i, d), features, (d.train_on, d.max_length))
    >>> samples = encoded(table, d.source, tokenizer, how)
    >>> lengths = column(samples.select(train_indices), "length")
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from finetune import cache
from finetune.errors import ConfigError

# datasets (0.6 s) and pyarrow.compute (50 ms) are imported in the functions that use them: `finetune validate`
# imports this module (through the recipe's task) and reads no data.

# Bumped whenever an encoder's output changes for the same data, tokenizer and settings: older folders are not read.
ENCODING = "1"
PARALLEL_ROWS = 10_000  # from this many rows a table is encoded by one process per CPU core (fewer: start-up costs)


def digest(*parts) -> str:
    """A short key from the given parts (text, numbers, None)."""
    return hashlib.sha256("\x00".join(map(str, parts)).encode()).hexdigest()[:20]


def data_digest(source: str, table) -> str:
    """What identifies the rows: a file's bytes, else datasets' fingerprint of the table (a saved folder's, a hub
    dataset's, or one built from Python rows: a hash of their content)."""
    path = Path(source).expanduser()
    if path.is_file():
        return cache.file_digest(path).hexdigest()
    return table._fingerprint


def tokenizer_digest(tokenizer) -> str:
    """What identifies a tokenizer's output: its vocabulary and rules, special tokens and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    rules = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return digest(type(tokenizer).__name__, rules, getattr(tokenizer, "chat_template", None),
                  json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str))


def rows_of(batch: dict) -> list:
    """A batch of ``Dataset.map`` (column → values) as its rows (dicts), as ``Dataset.to_list`` gives them."""
    names = list(batch)
    return [dict(zip(names, values)) for values in zip(*(batch[n] for n in names))]


def workers(num_proc: Optional[int], rows: int) -> Optional[int]:
    """``Dataset.map``'s ``num_proc``: the setting, else one per CPU core for a large table."""
    if num_proc is not None:
        return num_proc if num_proc > 1 else None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, 16) if rows >= PARALLEL_ROWS and cores > 1 else None


@dataclass(frozen=True)
class Encoding:
    """How a task turns a table's rows into samples: ``encode(row, i)`` turns row ``i`` (a dict) into a sample, a
    value for each column of ``features``, one of them ``error`` (the row's one-line refusal, or ""); ``settings``:
    the task's settings that shape a sample (in the cache key); ``num_proc``: ``Dataset.map``'s processes
    (``workers``)."""

    task: str
    encode: Callable[[dict, int], dict]
    features: Any
    settings: tuple = ()
    num_proc: Optional[int] = None


def encoded(table, source: str, tokenizer, how: Encoding):
    """Every row of ``table`` (read from ``source``) through ``how.encode``, as a memory-mapped ``datasets.Dataset``
    in the table's order. A table with a refused row is never cached: its first refusal (and how many rows were
    refused) is the ConfigError.

    Built once under ``<cache root>/datasets/<task>-<key>`` (one process builds, the others of a process group
    wait); later calls with the same key read it. The key: the task, ``ENCODING``, the data, ``tokenizer`` and the
    task's ``settings`` that shape a sample.
    """
    import datasets

    task, encode, features, settings, num_proc = how.task, how.encode, how.features, how.settings, how.num_proc
    key = f"{task}-" + digest(task, ENCODING, data_digest(source, table), tokenizer_digest(tokenizer), *settings)
    columns = list(features)

    def encode_rows(batch: dict, indices: list) -> dict:  # Dataset.map's batched form
        samples = [encode(row, i) for i, row in zip(indices, rows_of(batch))]
        return {name: [s[name] for s in samples] for name in columns}

    def build(out: Path) -> None:
        rows = table.map(encode_rows, batched=True, with_indices=True, remove_columns=table.column_names,
                         features=features, num_proc=workers(num_proc, len(table)), desc=f"{task}: tokenize",
                         cache_file_name=str(out / "samples.arrow"), new_fingerprint=key)
        refuse_bad_rows(rows)

    folder = cache.folder(cache.root() / "datasets" / key, build, "tokenized data set")
    parts = [datasets.Dataset.from_file(str(p)) for p in sorted(folder.glob("*.arrow"))]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def refuse_bad_rows(rows) -> None:
    """One ConfigError line for a table whose ``error`` column names refused rows: the first data row refused
    (``data.source: row i …``) with how many more were, else the first other refusal (a template that cannot
    render a row)."""
    import pyarrow.compute as pc

    errors = rows.data.column("error")
    bad = pc.not_equal(errors, "")
    if not pc.any(bad).as_py():
        return
    messages = pc.filter(errors, bad)
    in_data = pc.filter(messages, pc.starts_with(messages, "data.source:"))
    if len(in_data):
        more = f" ({len(in_data) - 1} more bad rows)" if len(in_data) > 1 else ""
        raise ConfigError(f"{in_data[0].as_py()}{more}")
    raise ConfigError(messages[0].as_py())


def column(samples, name: str) -> np.ndarray:
    """One column of a table (through its selection) as a numpy array: lengths, flags. Taken by Arrow at once
    (datasets' numpy format converts row by row: seconds at a million rows)."""
    return samples.with_format("arrow", columns=[name])[:][name].to_numpy(zero_copy_only=False)


def token_lengths(samples, name: str = "input_ids") -> np.ndarray:
    """The length of every sample's token list in column ``name``, counted by Arrow a block at a time (the lists
    themselves never become Python objects)."""
    import pyarrow.compute as pc

    blocks = samples.with_format("arrow", columns=[name]).iter(batch_size=65_536)
    return np.concatenate([pc.list_value_length(b[name]).to_numpy(zero_copy_only=False) for b in blocks] or
                          [np.zeros(0, dtype=np.int64)])


def kept(indices: list, dropped: np.ndarray) -> list:
    """The row numbers of ``indices`` whose ``dropped`` flag is off, in order."""
    ids = np.asarray(indices, dtype=np.int64)
    return ids[~dropped[ids]].tolist() if len(ids) else []


class Tagged(torch.utils.data.Dataset):
    """A table whose every sample also carries ``tag(i)`` (its place in the split, whether to answer it), without
    copying the table."""

    def __init__(self, data, tag: Callable[[int], dict]):
        self.data, self.tag = data, tag

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {**self.data[i], **self.tag(i)}

    def __getitems__(self, indices: list) -> list:
        return [{**row, **self.tag(i)} for i, row in zip(indices, self.data.__getitems__(list(indices)))]

