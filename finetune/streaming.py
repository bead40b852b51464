"""A training set streamed from jsonl / parquet shards (``data.streaming``): rows are read, encoded and held a block
at a time while training, never all at once.

Set-up reads only where each row starts: a parquet shard's metadata, or the line offsets of a jsonl shard (one scan
of its bytes, 8 bytes a row kept). A row is then found by its number, so a window's rows are read when the window is
reached and a resumed run starts reading at its window, not at the start of the stream.

The order is ``windows.block_order``: blocks of consecutive rows in a seeded order, the rows of each block in a
seeded order. It depends on the seed and the epoch alone, so any number of processes, any micro-batch and a resumed
run see the same windows. A window is read whole before its first backward (the loop cuts and counts it first); two
blocks are kept, as a window may span two.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from finetune.data import row_place
from finetune.errors import ConfigError

# pyarrow.parquet (30 ms) is imported where a parquet shard is read: `finetune validate` imports this module
# (through the recipe's task), and jsonl shards never need it.

SHARD_TYPES = (".jsonl", ".parquet")
BLOCKS_KEPT = 2
SCAN_BYTES = 1 << 24


def shards(source: str) -> list[Path]:
    """The shards of ``source``: the file itself, or a folder's jsonl / parquet files by name; one ConfigError line
    when it is neither."""
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() in SHARD_TYPES:
        return [path]
    found = sorted(p for p in path.iterdir() if p.suffix.lower() in SHARD_TYPES) if path.is_dir() else []
    if not found:
        raise ConfigError(f"data.source: streaming reads a {' or '.join(SHARD_TYPES)} file or a folder of them; "
                          f"{source} is neither")
    return found


class Shard:
    """Where each row of one shard starts: a jsonl file's line offsets, or a parquet file's row groups."""

    def __init__(self, path: Path):
        self.path = path
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            self.groups = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
            self.rows = int(self.groups[-1])
        else:
            self.starts, self.ends = line_spans(path)
            self.rows = len(self.starts)

    def read(self, first: int, count: int) -> list:
        """Rows ``first`` … ``first + count - 1`` of this shard, as dicts."""
        if self.path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            g0 = int(np.searchsorted(self.groups, first, side="right") - 1)
            g1 = int(np.searchsorted(self.groups, first + count, side="left"))
            table = pq.ParquetFile(self.path).read_row_groups(list(range(g0, g1)))
            return table.slice(first - int(self.groups[g0]), count).to_pylist()
        with open(self.path, "rb") as f:
            f.seek(int(self.starts[first]))
            text = f.read(int(self.ends[first + count - 1] - self.starts[first]))
        lines = [text[s - self.starts[first]:e - self.starts[first]]
                 for s, e in zip(self.starts[first:first + count], self.ends[first:first + count])]
        return [parse_line(line, self.path, first + k) for k, line in enumerate(lines)]


def line_spans(path: Path) -> tuple:
    """(start, end) byte offsets of every non-blank line of a file, found a few MB at a time."""
    starts, ends, offset, begin = [], [], 0, 0
    with open(path, "rb") as f:
        while block := f.read(SCAN_BYTES):
            newlines = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10).astype(np.int64) + offset
            if len(newlines):
                starts.append(np.concatenate([[begin], newlines[:-1] + 1]))
                ends.append(newlines)
                begin = int(newlines[-1]) + 1
            offset += len(block)
    if begin < offset:  # a last line without a newline
        starts.append(np.array([begin], dtype=np.int64))
        ends.append(np.array([offset], dtype=np.int64))
    starts = np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)
    ends = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
    blank = ends - starts <= 1  # an empty line, or one holding "\r" only
    return starts[~blank], ends[~blank]


def parse_line(line: bytes, path: Path, row: int):
    try:
        return json.loads(line)
    except ValueError as e:
        raise ConfigError(f"data.source: line {row + 1} of {path} is not JSON ({e})") from None


class StreamedRows(torch.utils.data.Dataset):
    """The training set of a stream: sample ``i`` is row ``i`` of the shards taken in order, encoded by
    ``encode(row, i)`` (a task's sample dict with its ``length``, or one with an ``error`` line), read with its block
    when first asked for. ``limit`` keeps the first rows."""

    def __init__(self, paths: list, encode: Callable[[dict, int], dict], block: int, limit: Optional[int] = None):
        self.shards = [Shard(p) for p in paths]
        self.offsets = np.cumsum([0] + [s.rows for s in self.shards])
        self.rows = int(self.offsets[-1]) if limit is None else min(limit, int(self.offsets[-1]))
        if self.rows == 0:
            raise ConfigError(f"data.source: {', '.join(map(str, paths[:3]))} holds no rows")
        self.encode, self.block = encode, block
        self.kept: OrderedDict = OrderedDict()  # block number → its encoded samples, least recently used first

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict:
        return self.samples_of(i // self.block)[i % self.block]

    def __getitems__(self, indices: list) -> list:
        return [self[i] for i in indices]

    def length(self, i: int) -> int:
        return self[i]["length"]

    def samples_of(self, b: int) -> list:
        if b in self.kept:
            self.kept.move_to_end(b)
            return self.kept[b]
        first = b * self.block
        samples = [self.encode(row, first + k) for k, row in enumerate(self.read(first, min(self.block,
                                                                                          self.rows - first)))]
        for k, sample in enumerate(samples):
            if sample.get("error"):
                raise ConfigError(sample["error"])
            if sample.get("dropped"):
                raise ConfigError(f"data.source: {self.place(first + k)} has no trained token within "
                                  "data.max_length; a stream cannot drop rows it has not read (raise "
                                  "data.max_length, or remove it)")
        self.kept[b] = samples
        while len(self.kept) > BLOCKS_KEPT:
            self.kept.popitem(last=False)
        return samples

    def place(self, i: int) -> str:
        """Where row ``i`` of the stream sits: a line of its one file, else its place in the stream (1-based)."""
        return row_place(self.shards[0].path, i) if len(self.shards) == 1 else f"row {i + 1}"

    def read(self, first: int, count: int) -> list:
        """Rows ``first`` … ``first + count - 1`` of the stream, across shards."""
        rows = []
        while count:
            s = int(np.searchsorted(self.offsets, first, side="right") - 1)
            local = first - int(self.offsets[s])
            n = min(count, self.shards[s].rows - local)
            rows += self.shards[s].read(local, n)
            first, count = first + n, count - n
        return rows
