"""Data for tasks: a seeded train/validation split (the held-out set raised to a minimum on the user's own data),
local data files read as tables, where a row sits in its file, and padding collation."""

from __future__ import annotations

import csv
import functools
import json
import math
from pathlib import Path
from typing import Callable, Optional

import torch

from finetune.errors import ConfigError

# The least a recipe's val_fraction may hold out of the user's own data: a fraction sized for the recipe's data set
# (0.012 of 4,170 rows) leaves one row of a 62-row file, and evaluation numbers resting on one row mean nothing. Never
# more than a quarter of the rows is taken for it.
LEAST_HELD_OUT_ROWS = 16
LEAST_HELD_OUT_SHARE = 0.05
MOST_HELD_OUT_SHARE = 0.25


def held_out(n: int, val_fraction: float, minimum: bool, rounding: Callable = math.ceil) -> tuple:
    """The held-out part of ``n`` rows as :func:`split` / :func:`split_samples` take it, and the line to say before
    training when it was raised or could not be (None when ``val_fraction`` stands unremarked).

    ``val_fraction`` as it is, unless ``minimum`` (``data.val_minimum`` on the user's own data) and it holds out
    (``rounding`` of val_fraction × n: ceil for :func:`split`, round for :func:`split_samples`) fewer than
    ``LEAST_HELD_OUT_ROWS`` or ``LEAST_HELD_OUT_SHARE`` of the rows, whichever is more: then a row count, that
    minimum, at most ``MOST_HELD_OUT_SHARE`` of the rows (rows too few for the minimum are said too).

        >>> held_out(400, 0.012, True)[0], held_out(62, 0.012, True)[0], held_out(62, 0.012, False)[0]
        (20, 16, 0.012)
    """
    asked = rounding(val_fraction * n)
    least = max(LEAST_HELD_OUT_ROWS, math.ceil(LEAST_HELD_OUT_SHARE * n))
    if not minimum or val_fraction <= 0 or asked >= least:
        return val_fraction, None
    most = math.ceil(MOST_HELD_OUT_SHARE * n)  # 62 rows: 16, the minimum itself
    why = f"val_fraction {val_fraction:g} of {n} rows is below the minimum of {least} rows"
    if least <= most:
        return least, f"data: held-out set raised from {asked} to {least} rows ({why})"
    too_few = f"{why}, more than a quarter of them"
    if most > asked:
        return most, f"data: held-out set raised from {asked} to {most} rows, a quarter of the {n} rows ({too_few})"
    return val_fraction, f"data: held-out set kept at {asked} row{'s' if asked != 1 else ''} ({too_few})"


def split(dataset, val_fraction, seed: int, limit=None):
    """Seeded train/validation split of a 🤗 Dataset; ``limit`` keeps the first N of each part. ``val_fraction``: the
    share held out, or a row count (an int, as datasets' ``test_size`` takes either; :func:`held_out`)."""
    if val_fraction > 0:
        n = len(dataset)
        # a fractional test_size rounded up, as datasets rounds it
        n_val = val_fraction if isinstance(val_fraction, int) else math.ceil(val_fraction * n)
        if n - n_val < 1:
            raise ConfigError(f"data.val_fraction: {val_fraction} of {n} sample{'s' if n > 1 else ''} leaves none "
                              "to train on; give more data or set data.val_fraction=0")
        parts = dataset.train_test_split(test_size=val_fraction, seed=seed, shuffle=True)
        train, val = parts["train"], parts["test"]
    else:
        train, val = dataset, None
    if limit is not None:
        train = train.select(range(min(limit, len(train))))
        val = val.select(range(min(limit, len(val)))) if val is not None else None
    return train, val


def split_samples(samples: list, val_fraction, seed: int, limit=None):
    """Seeded train/validation split of a list of samples (for data a task generates itself); ``limit`` keeps the
    first N of each part. Returns (train, val or None). Without a validation part the samples keep their order, as
    :func:`split` keeps a table's (a baseline trained on a file in the Trainer's order draws from the file's).
    ``val_fraction``: the share held out (rounded), or a row count (an int; :func:`held_out`)."""
    n_val = val_fraction if isinstance(val_fraction, int) else round(len(samples) * val_fraction)
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist() if n_val else \
        list(range(len(samples)))
    val = [samples[i] for i in order[:n_val]] or None
    train = [samples[i] for i in order[n_val:]]
    if limit is not None:
        train = train[:limit]
        val = val[:limit] if val is not None else None
    return train, val


def parse_rows(rows: list, parse, source: str) -> list:
    """``parse(row)`` of every row; one ConfigError line (``data.source: …``) naming where the first row ``parse``
    refuses (its ValueError) sits in ``source`` (:func:`row_place`) and how many more it refuses, or saying that there
    are no rows."""
    out, bad = [], []
    for i, row in enumerate(rows):
        try:
            out.append(parse(row))
        except ValueError as e:
            bad.append(f"{row_place(source, i)} {e}")
    if bad:
        more = f" ({len(bad) - 1} more bad rows)" if len(bad) > 1 else ""
        raise ConfigError(f"data.source: {bad[0]}{more}")
    if not out:
        raise ConfigError(f"data.source: {source} holds no rows")
    return out


def row_place(source, i: int) -> str:
    """Where row ``i`` (0-based, in the table's order) of ``source`` sits, as its user finds it: ``line N`` of a JSON
    Lines or CSV / TSV file (1-based: the header and blank lines counted, as an editor counts them), else ``row N``
    (1-based)."""
    lines = row_lines(str(source))
    return f"line {lines[i]}" if i < len(lines) else f"row {i + 1}"


@functools.lru_cache(maxsize=8)
def row_lines(source: str) -> tuple:
    """The 1-based line each row of the line-oriented file ``source`` starts on (datasets skips blank lines, and a
    CSV cell may span lines); () for anything else. Read only to place a refused row."""
    path = Path(source).expanduser()
    kind = path.suffix.lower().lstrip(".")
    if not path.is_file() or kind not in ("jsonl", "json", "csv", "tsv"):
        return ()
    with open(path, newline="", encoding="utf-8", errors="replace") as f:
        if kind in ("csv", "tsv"):
            reader, starts, line = csv.reader(f, delimiter="\t" if kind == "tsv" else ","), [], 0
            for row in reader:
                if row and line:  # after the header
                    starts.append(line + 1)
                line = reader.line_num
            return tuple(starts)
        text = f.read()
    if kind == "json" and text.lstrip()[:1] == "[":  # one JSON list: its rows are not lines
        return ()
    return tuple(n for n, line in enumerate(text.splitlines(), 1) if line.strip())


def first_bad_json_line(path: Path) -> Optional[str]:
    """``line N is not JSON (why)`` for the first line of a JSON Lines file that is not JSON; None when every line
    is (or the file is one JSON document)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix.lower() == ".json":
        try:
            json.loads(text)
            return None
        except ValueError:
            pass
    for n, line in enumerate(text.splitlines(), 1):
        try:
            if line.strip():
                json.loads(line)
        except ValueError as e:
            return f"line {n} is not JSON ({e})"
    return None


def require_columns(table, source: str, task: str, needs: tuple) -> None:
    """One ``data.source`` line when ``table`` holds none of the column sets ``needs`` (alternatives, each a tuple of
    names), naming the columns it has: said before any row is read, and by ``finetune import`` for its ``--data``.

        >>> require_columns(table, "chat.csv", "sft", (("messages",), ("prompt", "completion")))
        ConfigError: data.source: chat.csv has columns question, answer; the sft task needs messages, or prompt and
        completion
    """
    have = set(table.column_names)
    if any(set(columns) <= have for columns in needs):
        return
    wanted = ", or ".join(" and ".join(columns) for columns in needs)
    raise ConfigError(f"data.source: {source} has columns {', '.join(table.column_names)}; the {task} task needs "
                      f"{wanted}")


def load_local_table(path, builders: dict, kwargs=None):
    """A local data file through ``datasets.load_dataset`` (``builders``: file extension → builder name). A bad file
    is one ``data.source`` line: datasets' own error log and progress bar are silenced while it reads."""
    import datasets  # lazy: 0.6 s on every command (this module is on each one's path)

    path = Path(path)
    ext = path.suffix.lower().lstrip(".")
    if ext not in builders:
        raise ConfigError(f"data.source: unsupported file type .{ext}; use {', '.join(builders)}")
    if path.stat().st_size == 0:
        raise ConfigError(f"data.source: file {path} is empty")
    verbosity, bars = datasets.utils.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(builders[ext], data_files=str(path), split="train",
                                      **(kwargs or {}).get(ext, {}))
    except Exception as e:  # datasets raises many types for a malformed file
        if "corresponds to no data" in str(e):  # its words for a file with a header and no rows
            raise ConfigError(f"data.source: {path} holds no data rows") from None
        why = _unreadable(e)
        # pyarrow names a bad JSON line by its row in a block, from 0: the file's own line number is found instead
        bad = first_bad_json_line(path) if builders[ext] == "json" and not why.startswith("not UTF-8") else None
        raise ConfigError(f"data.source: {path} {bad}" if bad else f"data.source: cannot read {path}: {why}") from None
    finally:
        datasets.utils.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
    if len(table) == 0:
        raise ConfigError(f"data.source: {path} holds no data rows")
    return table


def _unreadable(error: Exception) -> str:
    """Why datasets could not read a file, in words: the cause under its "An error occurred while generating the
    dataset", or a file that is not UTF-8 text."""
    chain, e = [], error
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, UnicodeDecodeError):
            return f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at byte {e.start}); save it as UTF-8"
    words = next((str(e) for e in chain if str(e) and type(e).__name__ != "DatasetGenerationError"), str(error))
    return (words.strip().splitlines() or [type(error).__name__])[0][:200]


def check_data_source(source: str, builtin: str, problems: list) -> None:
    """One ``data.source`` line when ``source`` is neither the task's built-in data set nor a file."""
    if source == builtin:
        return
    if Path(source).is_dir():
        problems.append(f"data.source: {source} is a directory; give a data file, or '{builtin}'")
    elif not Path(source).is_file():
        problems.append(f"data.source: file {source} not found; use '{builtin}' or a data file")


def right_pad(rows: list, fill: int) -> torch.Tensor:
    """Token rows (lists of ints) as one ``[rows, longest]`` long tensor, each right-padded with ``fill``."""
    out = torch.full((len(rows), max(map(len, rows))), fill, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, :len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out


def attention_mask(rows: list) -> torch.Tensor:
    """1 on each row's tokens, 0 on the padding ``right_pad`` adds."""
    return right_pad([[1] * len(row) for row in rows], 0)


def pad_collate(pad_id: int = 0):
    """A collate_fn that right-pads each micro-batch to its own longest sample. Without a per-sample ``labels`` (a
    causal LM) the labels are the input ids with -100 on padding; a per-sample class label is stacked."""

    def collate(samples):
        rows = [s["input_ids"] for s in samples]
        ids, mask = right_pad(rows, pad_id), attention_mask(rows)
        labels = torch.tensor([s["labels"] for s in samples]) if "labels" in samples[0] else \
            ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate
