"""The rows a baseline trained on: its training file as ``finetune import`` hands it to the recipe — whole and in
its order, or as its tool changed it before training (shuffled once, split, the first rows kept), written beside the
recipe — and the format of its rows."""

from __future__ import annotations

import json
from pathlib import Path

from finetune.reproduce.record import Baseline, Imported
from finetune.reproduce.task_settings import trl_train_on


def training_file(out: Imported, data: str | None, data_fields: set, b: Baseline | None = None,
                  recipe: Path | None = None, said: str = "--data") -> None:
    """``--data FILE``: the baseline's training file, whole and in its order (the Trainer's order draws from it); for
    a TRL SFT baseline, the tokens it trained on, from the rows' format (``trl_train_on``). A baseline whose tool
    shuffled its rows once before training (``Baseline.shuffled``: axolotl, ms-swift) or held some out
    (``Baseline.held_out``: LLaMA-Factory's ``val_size``) trains on the rows it kept, in their order, written beside
    ``recipe`` (:func:`rows_in_order`); without ``--data`` or ``recipe`` that is said as not carried. ``said``: where
    the file comes from (``--data``, or the source's own naming of it)."""
    change = row_change(b)
    if data is None:
        if change is not None:
            out.skip(*change[:2], f"{change[2]}; give --data FILE, the rows it loaded, and import writes the rows "
                     "it trained on, in that order")
        return
    out.set("data.source", str(data), said)
    written = None
    if change is not None:
        written = rows_in_order(data, change[3], recipe) if recipe is not None else None
        if written is None:
            out.skip(*change[:2], f"{change[2]}; import writes the rows it trained on from a local jsonl, json, "
                     "parquet or csv --data only")
        else:
            out.set("data.source", str(written), f"the rows of {data} ({said}) as it trained on them: {change[2]}")
    kind = row_format(data) if b is not None and b.trl else None
    if kind is not None and "train_on" in data_fields and kind not in PAIRS:
        train_on, why = trl_train_on(b, kind)
        out.set("data.train_on", train_on, why)
    if kind is not None and "text_rows" in data_fields:
        out.set("data.text_rows", "plain" if kind == "preference-text" else "chat",
                f"--data: {kind} rows" + (", tokenized as they are with an end token, as TRL's DPOTrainer"
                                          if kind == "preference-text" else ", rendered with the chat template"))
    for name, value in (("val_fraction", 0.0), ("limit", None)):
        if name in data_fields:
            out.set(f"data.{name}", value, "--data: the baseline trained on the whole file, in its order" if written
                    is None else "data.source: the rows the baseline trained on, in its tool's order")


def row_change(b: Baseline | None) -> tuple | None:
    """How the baseline's tool changed its rows before the Trainer saw them: (the setting, its value, what it did,
    the rows it kept in their order as a function of the row count), or None. The orders are the ``datasets``
    library's own (they depend only on the row count and the seed)."""
    import datasets  # lazy: 0.6 s on every command (this module is on each one's path)

    rows = lambda n: datasets.Dataset.from_dict({"row": range(n)})  # noqa: E731
    if b is not None and b.shuffled is not None:
        seed, where = b.shuffled
        return ("the rows' order", f"shuffled with seed {seed}", f"{where}: the rows are shuffled once before "
                f"training, as datasets' Dataset.shuffle(seed={seed}) does",
                lambda n: rows(n).shuffle(seed=seed)["row"])
    if b is not None and b.held_out is not None:
        first, size, seed, where = b.held_out
        kept = lambda n: min(first, n) if first else n  # noqa: E731
        return ("the rows it trained on", f"first {first}" if not size else f"{size} held out (seed {seed})",
                f"{where}: " + (f"the first {first} rows kept" if first else "") + (", then " if first and size else "")
                + (f"the rows split before training, as datasets' train_test_split(test_size={size}, seed={seed}) "
                   "does, and the train part trained, in its order" if size else ""),
                lambda n: rows(kept(n)).train_test_split(test_size=size, seed=seed)["train"]["row"] if size else
                list(range(kept(n))))
    return None


def local_rows(data):
    """The rows of the local file ``data``: a jsonl's non-blank lines as they are, a json, parquet or csv file's
    table (``datasets``); None when ``data`` is not such a file."""
    path = Path(str(data))
    kind = path.suffix.lower().lstrip(".")
    if not path.is_file() or kind not in ("jsonl", "json", "parquet", "csv"):
        return None
    if kind == "jsonl":
        return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    import datasets  # lazy: 0.6 s on every command (this module is on each one's path)

    return datasets.load_dataset(kind, data_files=str(path), split="train")


def row_count(data) -> int | None:
    """How many rows the local file ``data`` holds (:func:`local_rows`); None for anything else, or a file that
    does not read (the run reads it again and says what is wrong with it)."""
    try:
        rows = local_rows(data)
    except Exception:
        return None
    return None if rows is None else len(rows)


def rows_in_order(data, order_of, recipe: Path) -> Path | None:
    """The rows of the local file ``data`` that ``order_of(row count)`` lists, in that order, written beside
    ``recipe`` (``RECIPE-rows.jsonl``; a jsonl's lines kept as they are, a parquet or csv file's format kept). None
    when ``data`` is not a local jsonl, json, parquet or csv file."""
    rows = local_rows(data)
    if rows is None:
        return None
    if isinstance(rows, list):  # jsonl lines
        out = recipe.with_name(f"{recipe.stem}-rows.jsonl")
        out.write_text("".join(rows[i] + "\n" for i in order_of(len(rows))), encoding="utf-8")
        return out
    kind = Path(str(data)).suffix.lower().lstrip(".")
    table = rows.select(order_of(len(rows)))
    out = recipe.with_name(f"{recipe.stem}-rows.{'jsonl' if kind == 'json' else kind}")
    {"json": table.to_json, "parquet": table.to_parquet, "csv": table.to_csv}[kind](str(out))
    return out


PAIRS = ("preference-text", "preference-messages")  # the formats of preference pairs (row_format)


def row_format(path) -> str | None:
    """``messages``, ``prompt-completion``, ``text``, ``preference-text`` or ``preference-messages``: the format of a
    data file's first row (None: unreadable or none of them)."""
    path = Path(path)
    try:
        if path.suffix.lower() in (".jsonl", ".json") and path.stat().st_size:
            with open(path, encoding="utf-8") as f:
                first = f.readline() if path.suffix.lower() == ".jsonl" else f.read()
            row = json.loads(first)
            row = row[0] if isinstance(row, list) and row else row
        else:
            import datasets  # lazy: 0.6 s on every command (this module is on each one's path)

            row = datasets.load_dataset(path.suffix.lstrip(".").replace("jsonl", "json"), data_files=str(path),
                                        split="train[:1]")[0]
    except Exception:  # the run reads the file again and says what is wrong with it
        return None
    if not isinstance(row, dict):
        return None
    if "chosen" in row:  # preference pairs: TRL renders conversations, and takes text as it is
        return "preference-text" if isinstance(row["chosen"], str) else "preference-messages"
    if "messages" in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt-completion"
    return "text" if "text" in row else None
