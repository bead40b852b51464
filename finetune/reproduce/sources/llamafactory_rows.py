"""LLaMA-Factory's data sets as finetune reads them: the one its YAML names (``dataset`` in ``dataset_info.json``)
and its rows in LLaMA-Factory's own formats, alpaca and sharegpt, by the columns, tags and ``ranking`` of their
``dataset_info.json`` entry (as its data converters read them), written as finetune's rows: ``messages`` for sft, TRL's
conversational pairs for dpo."""

from __future__ import annotations

import json
from pathlib import Path

import finetune.reproduce.sources.files as files
from finetune.errors import ConfigError


def dataset_entry(b) -> tuple | None:
    """(the training file, its ``dataset_info.json`` entry) the YAML names (``dataset`` in ``dataset_dir``), when it
    is one local file; None otherwise."""
    if "dataset" not in b.own:
        return None
    names = [n.strip() for n in str(b.own["dataset"][0]).split(",")]
    root = Path(str(b.own.get("dataset_dir", ("data", ""))[0]))
    for base in (Path.cwd(), b.path.parent):
        info = base / root / "dataset_info.json"
        if len(names) == 1 and info.is_file():
            entry = dataset_info(info).get(names[0]) or {}
            if entry.get("file_name") and (base / root / entry["file_name"]).is_file():
                return base / root / entry["file_name"], entry
    return None


def dataset_info(info: Path) -> dict:
    """``dataset_info.json``: data set name → its entry (file, formatting, columns, tags, ranking); ConfigError (one
    line) when it is not a JSON object."""
    return files.json_object(info, "data")


def dataset_file(b) -> Path | None:
    """The training file the YAML names, when it is one local file; None otherwise."""
    found = dataset_entry(b)
    return found[0] if found else None


def entry_of(b, path: Path) -> dict | None:
    """The ``dataset_info.json`` entry of a file given as ``--data``: the YAML's data set when it names this file,
    else the entry of that name in a ``dataset_info.json`` beside the file; None when no entry names it."""
    found = dataset_entry(b)
    if found and found[0].resolve() == path.resolve():
        return found[1]
    info = path.parent / "dataset_info.json"
    if info.is_file():
        return next((e for e in dataset_info(info).values() if isinstance(e, dict) and
                     e.get("file_name") == path.name), None)
    return None


# LLaMA-Factory's defaults (its DatasetAttr): the columns of an alpaca row, the columns and tags of a sharegpt one
ALPACA = {"prompt": "instruction", "query": "input", "response": "output", "history": None, "system": None,
          "chosen": "chosen", "rejected": "rejected"}
SHAREGPT = {"messages": "conversations", "system": None, "tools": None, "chosen": "chosen", "rejected": "rejected"}
TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
        "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}


def row_format(entry: dict | None, rows: list) -> str | None:
    """``alpaca`` or ``sharegpt``: the entry's ``formatting`` (alpaca when it names none), else what the rows hold
    (sharegpt's ``conversations``, alpaca's ``instruction`` and ``output``); None: rows finetune reads as they are."""
    if entry is not None:
        return str(entry.get("formatting", "alpaca"))
    first = rows[0] if rows and isinstance(rows[0], dict) else {}
    if isinstance(first.get("conversations"), list):
        return "sharegpt"
    if "instruction" in first and "output" in first:
        return "alpaca"
    if isinstance(first.get("chosen"), dict) and "messages" in first:  # sharegpt pairs with role/content tags
        return "sharegpt"
    return None


def read_rows(path: Path) -> list:
    """A data file's rows: a JSON list (LLaMA-Factory's .json) or JSON lines."""
    text = path.read_text(encoding="utf-8")
    try:
        rows = json.loads(text) if path.suffix.lower() == ".json" else \
            [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError as e:
        raise ConfigError(f"data: {path} is not JSON ({e})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"data: {path} holds no list of rows (LLaMA-Factory reads a JSON list or JSON lines)")
    return rows


def sharegpt_turns(row: dict, n: int, path: Path, entry: dict) -> list:
    """A sharegpt row's messages as role/content turns (its system turn or column first), as LLaMA-Factory's
    converter reads them: by its tags, user (or observation) and assistant (or function call) alternating."""
    columns, tags = {**SHAREGPT, **(entry.get("columns") or {})}, {**TAGS, **(entry.get("tags") or {})}
    if "messages" not in (entry.get("columns") or {}) and "conversations" not in row and "messages" in row:
        columns["messages"] = "messages"
        tags = {**tags, "role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    turns = row.get(columns["messages"])
    if not isinstance(turns, list):
        raise ConfigError(f"data: {path} row {n} has no {columns['messages']} list (sharegpt rows)")
    roles = {tags["user_tag"]: "user", tags["assistant_tag"]: "assistant", tags["system_tag"]: "system"}
    out = [{"role": "system", "content": row[columns["system"]]}] if columns["system"] and \
        row.get(columns["system"]) else []
    for turn in turns:
        role = turn.get(tags["role_tag"]) if isinstance(turn, dict) else None
        if role not in roles:
            raise ConfigError(f"data: {path} row {n}: a {role} turn; finetune trains {tags['user_tag']}, "
                              f"{tags['assistant_tag']} and {tags['system_tag']} turns (no tool calls)")
        out.append({"role": roles[role], "content": turn.get(tags["content_tag"])})
    if columns["tools"] and row.get(columns["tools"]) not in (None, "", "[]", []):
        raise ConfigError(f"data: {path} row {n} names tools ({columns['tools']}); LLaMA-Factory renders them into "
                          "the system turn, finetune does not")
    return out


def alpaca_turns(row: dict, n: int, path: Path, entry: dict) -> list:
    """An alpaca row as role/content turns: its system, its history's pairs, then the instruction (its input after a
    newline) and, for sft, the output — as LLaMA-Factory's converter joins them."""
    columns = {**ALPACA, **(entry.get("columns") or {})}
    if columns["prompt"] not in row:
        raise ConfigError(f"data: {path} row {n} has no {columns['prompt']} (alpaca rows)")
    out = [{"role": "system", "content": row[columns["system"]]}] if columns["system"] and \
        row.get(columns["system"]) else []
    for query, answer in (row.get(columns["history"]) or []) if columns["history"] else []:
        out += [{"role": "user", "content": query}, {"role": "assistant", "content": answer}]
    prompt = "\n".join(x for x in (row[columns["prompt"]], row.get(columns["query"]) or "") if x)
    return out + [{"role": "user", "content": prompt}]


def converted(rows: list, fmt: str, entry: dict, path: Path, pairs: bool) -> list:
    """LLaMA-Factory's rows as finetune's: ``messages`` (sft), or TRL's conversational ``prompt`` / ``chosen`` /
    ``rejected`` (a ranking data set: dpo)."""
    columns = {**(ALPACA if fmt == "alpaca" else SHAREGPT), **(entry.get("columns") or {})}
    out = []
    for n, row in enumerate(rows, 1):
        if fmt == "alpaca":
            turns = alpaca_turns(row, n, path, entry)
            answer = lambda key: [{"role": "assistant", "content": row.get(key)}]  # noqa: E731
        else:
            turns = sharegpt_turns(row, n, path, entry)
            answer = lambda key: sharegpt_turns({columns["messages"]: [row.get(key)]}, n, path,  # noqa: E731
                                                {**entry, "columns": {**(entry.get("columns") or {}),
                                                                      "system": None, "tools": None}})
        if pairs:
            if row.get(columns["chosen"]) is None or row.get(columns["rejected"]) is None:
                raise ConfigError(f"data: {path} row {n} has no {columns['chosen']} / {columns['rejected']} (a "
                                  "ranking data set: the dpo stage trains pairs)")
            out.append({"prompt": turns, "chosen": answer(columns["chosen"]), "rejected": answer(columns["rejected"])})
        elif fmt == "alpaca":
            out.append({"messages": turns + [{"role": "assistant", "content": row.get(columns["response"])}]})
        else:
            out.append({"messages": turns})
    return out


def training_rows(b, data, recipe: Path, chat: bool, pairs: bool):
    """``finetune import``'s ``--data`` for a LLaMA-Factory run: the file given (else the one its YAML names in
    ``dataset_info.json``), as rows finetune reads. Rows in LLaMA-Factory's own formats — alpaca (instruction, input,
    output, history, system) and sharegpt (conversations of from/value turns), by the columns and tags of their
    ``dataset_info.json`` entry — are written, in their order, beside the recipe (``RECIPE-rows.jsonl``): as
    ``messages`` for a chat stage (``chat``), as TRL's conversational pairs for a preference one (``pairs``). Other
    rows, and a stage that reads text (pt), are read as they are."""
    if data is None:
        found = dataset_entry(b)
        if found is None:
            return None
        path, entry = found
    else:
        path = Path(data)
        entry = entry_of(b, path) if path.is_file() else None
    if path.suffix.lower() not in (".json", ".jsonl") or not path.is_file():
        return str(path)
    rows = read_rows(path)
    fmt = row_format(entry, rows)
    if fmt not in ("alpaca", "sharegpt") or not chat or not rows:
        return str(path)
    out = recipe.with_name(f"{recipe.stem}-rows.jsonl")
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n"
                           for r in converted(rows, fmt, entry or {}, path, pairs)), encoding="utf-8")
    shape = "TRL's conversational pairs" if pairs else "messages"
    print(f"{path}: LLaMA-Factory's {fmt} rows written as {shape} to {out} (the same turns, in their order)")
    return str(out)
