"""axolotl's rows as finetune reads them: the one data set an axolotl config names (``datasets``), its rows in the
format its ``type`` names, written as the rows the task the run trains reads — ``messages`` for a chat task, TRL's
conversational ``prompt`` / ``chosen`` / ``rejected`` for a preference task, ``text`` for a text task (the task's own
row reader says which: its module's ``to_pair``, ``to_messages``, or a ``text_field`` setting).

What is said here of axolotl was read in its source at commit 067b021c8b87a9e5e380b9173c704cf7340e30f5
(``src/axolotl/prompt_strategies/chat_template.py``, ``utils/schemas/utils.py`` ``handle_legacy_message_fields_logic``,
``prompt_tokenizers.py`` and ``prompters.py`` (alpaca, gpteacher, oasst), ``completion.py``, ``dpo/chat_template.py``,
``dpo/chatml.py``, ``dpo/llama3.py``) and of its older ``sharegpt`` type (deprecated there: ``utils/schemas/
validation.py``), conversations of from/value turns. The types converted are :data:`CHAT`, :data:`INSTRUCT`,
:data:`TEXT` and :data:`PAIRS`; any other keeps the import's one "not carried: datasets.type" line.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from finetune.errors import ConfigError
from finetune.registry import section_class, task_module
from finetune.reproduce.objective import task_of

# the data set keys the written rows carry (the import's "not carried" lines for them go)
CARRIED = ("type", "field_messages", "message_property_mappings", "message_field_role", "message_field_content",
           "roles", "drop_system_message")
CHAT = ("chat_template", "sharegpt")  # conversations: the chat_template strategy, and its older sharegpt type
# instruct types: type (before ":", its prompt style) → (instruction, input, answer) columns, as their
# PromptTokenizingStrategy's parse_instruction_fields read them (prompt_tokenizers.py)
INSTRUCT = {"alpaca": ("instruction", "input", "output"), "gpteacher": ("instruction", "input", "response"),
            "oasst": ("INSTRUCTION", None, "RESPONSE")}
# AlpacaPrompter's system texts (prompters.py), which these types' prompters share: with an input, and without
SYSTEM = ("Below is an instruction that describes a task, paired with an input that provides further context. Write "
          "a response that appropriately completes the request.",
          "Below is an instruction that describes a task. Write a response that appropriately completes the request.")
TEXT = ("completion",)  # its field (default text), trained whole
# chatml.* / llama3.* preference types: function → (prompt columns tried in order, chosen, rejected, whether the
# answers are conversations whose second turn is the answer); dpo/chatml.py and dpo/llama3.py
BUILT_PAIRS = {"default": (("prompt", "input", "question", "instruction"), ("chosen", "chosen_response"),
                           ("rejected", "rejected_response"), False),
               "intel": (("question",), ("chosen",), ("rejected",), False),
               "icr": (("input",), ("chosen",), ("rejected",), False),
               "prompt_pairs": (("prompt",), ("chosen",), ("rejected",), False),
               "ultra": (("prompt",), ("chosen",), ("rejected",), True)}
PAIRS = ("chat_template", "chat_template.default", "chatml.argilla_chat", "llama3.argilla_chat",
         *(f"{t}.{f}" for t in ("chatml", "llama3") for f in BUILT_PAIRS), "chatml", "llama3")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def row_kind(b) -> str | None:
    """How the task the run trains reads rows: ``pairs``, ``messages`` or ``text`` (its module's row reader); None
    when no task is said, or none of these."""
    try:
        task = task_of(b)
    except ConfigError:
        return None  # the import refuses it in its own words
    if task is None:
        return None
    module = task_module(task)
    data_fields = {f.name for f in dataclasses.fields(section_class(module, "DataConfig"))}
    return "pairs" if hasattr(module, "to_pair") else "messages" if hasattr(module, "to_messages") else \
        "text" if "text_field" in data_fields else None


def read_rows(path: Path) -> list:
    """A data file's rows as axolotl's json loader reads them: a JSON list, one JSON object (one row), or JSON
    lines."""
    text = path.read_text(encoding="utf-8")
    try:
        rows = json.loads(text)
    except ValueError:
        try:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        except ValueError as e:
            raise ConfigError(f"data: {path} is not JSON nor JSON lines ({e})") from None
    rows = [rows] if isinstance(rows, dict) else rows
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"data: {path} holds no rows (axolotl reads a JSON list, an object or JSON lines)")
    return rows


def field(row: dict, key: str, at: tuple):
    """``row[key]``; one line naming the file, the row and the field when it is missing. ``at``: (path, row number,
    type)."""
    if not isinstance(row, dict) or row.get(key) is None:
        raise ConfigError(f"data: {at[0]} row {at[1]} has no {key} (axolotl's {at[2]} rows)")
    return row[key]


def mappings(d: dict) -> dict:
    """The message keys of role and content: ``message_property_mappings``, or the legacy ``message_field_role`` /
    ``message_field_content``, else role and content (``handle_legacy_message_fields_logic``)."""
    found = dict(d.get("message_property_mappings") or {})
    return {"role": d.get("message_field_role") or found.get("role") or "role",
            "content": d.get("message_field_content") or found.get("content") or "content"}


def chat_turns(row: dict, d: dict, at: tuple) -> list:
    """A chat_template (or sharegpt) row's conversation as role/content turns, in its order, as axolotl's
    ``ChatTemplateStrategy.get_conversation_thread`` reads it: the turns of ``field_messages``, each through the
    message mappings and the ``roles`` map (unmapped roles kept as they are; by default human → user, gpt →
    assistant), the system turn dropped with ``drop_system_message``."""
    sharegpt = at[2].startswith("sharegpt")
    keys = {"role": "from", "content": "value"} if sharegpt else mappings(d)
    roles = {s: t for t, sources in d["roles"].items() for s in sources} if d.get("roles") else SHAREGPT_ROLES
    name = "conversations" if sharegpt else d.get("field_messages") or "messages"
    turns = field(row, name, at)
    if not isinstance(turns, list):
        raise ConfigError(f"data: {at[0]} row {at[1]}: {name} is not a list of turns (axolotl's {at[2]} rows)")
    out = []
    for k, turn in enumerate(turns):
        role = field(turn, keys["role"], (at[0], f"{at[1]} turn {k}", at[2]))
        out.append({"role": roles.get(role, role) if not sharegpt else SHAREGPT_ROLES.get(role, role),
                    "content": field(turn, keys["content"], (at[0], f"{at[1]} turn {k}", at[2]))})
    if d.get("drop_system_message") and out and out[0]["role"] == "system":
        out = out[1:]
    return out


def instruct_turns(row: dict, columns: tuple, at: tuple) -> list:
    """An instruct row (alpaca, gpteacher, oasst) as turns: AlpacaPrompter's system text (with or without an input),
    the instruction (its input after a newline, as its chat styles join them) and the answer."""
    instruction, extra = field(row, columns[0], at), row.get(columns[1]) if columns[1] else None
    answer = field(row, columns[2], at)
    return [{"role": "system", "content": SYSTEM[0] if extra else SYSTEM[1]},
            {"role": "user", "content": f"{instruction}\n{extra}" if extra else instruction},
            {"role": "assistant", "content": answer}]


def first_of(row: dict, keys: tuple, at: tuple):
    """The first of ``keys`` the row has (dpo/chatml.py's ``default`` tries them in order)."""
    return field(row, next((k for k in keys if k in row), keys[-1]), at)


def template_pair(row: dict, d: dict, at: tuple) -> dict:
    """A ``chat_template.default`` preference row (dpo/chat_template.py): the prompt turns of ``field_messages``
    (text: one user turn), the answer of ``field_chosen`` / ``field_rejected`` (text, one message, or a list whose last
    message is the answer), each through the message mappings and the ``roles`` map."""
    keys = mappings(d)
    roles = {s: t for t, sources in (d.get("roles") or {}).items() for s in sources} or \
        {r: r for r in ("user", "assistant", "system", "tool")}

    def turn(message, k: str, default_role: str) -> dict:
        if isinstance(message, str):
            return {"role": default_role, "content": message}
        role = field(message, keys["role"], at)
        if role not in roles:
            raise ConfigError(f"data: {at[0]} row {at[1]}: a {role} turn in {k}; the data set's roles map "
                              f"{', '.join(sorted(roles))}")
        return {"role": roles[role], "content": field(message, keys["content"], at)}

    name = d.get("field_messages") or "messages"
    messages = field(row, name, at)
    prompt = [turn(m, name, "user") for m in ([messages] if isinstance(messages, str) else messages)]
    answers = []
    for key in (d.get("field_chosen") or "chosen", d.get("field_rejected") or "rejected"):
        value = field(row, key, at)
        answers.append([turn(value[-1] if isinstance(value, list) else value, key, "assistant")])
    return {"prompt": prompt, "chosen": answers[0], "rejected": answers[1]}


def built_pair(row: dict, kind: str, at: tuple) -> dict:
    """A chatml.* / llama3.* preference row as turns: its system (when given) and prompt column, then each answer
    (the second turn's content for ``ultra`` and ``argilla_chat``, whose answers are conversations)."""
    function = kind.split(".", 1)[1] if "." in kind else "default"
    if function == "argilla_chat":
        chosen, rejected = field(row, "chosen", at), field(row, "rejected", at)
        prompt, answers = [{"role": "user", "content": chosen[0]["content"]}], (chosen[1]["content"],
                                                                                rejected[1]["content"])
    else:
        prompts, chosen_keys, rejected_keys, nested = BUILT_PAIRS[function]
        system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
        prompt = system + [{"role": "user", "content": first_of(row, prompts, at)}]
        answers = tuple(first_of(row, keys, at) for keys in (chosen_keys, rejected_keys))
        answers = tuple(a[1]["content"] for a in answers) if nested else answers
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": answers[0]}],
            "rejected": [{"role": "assistant", "content": answers[1]}]}


def converter(kind: str, shape: str, d: dict):
    """The function turning one row (row, at) into finetune's, for a data set of type ``kind`` read as ``shape``;
    None: a type finetune does not convert for this task."""
    base = kind.split(":")[0]
    if shape == "messages" and (base in CHAT or base.startswith("sharegpt")):
        return lambda row, at: {"messages": chat_turns(row, d, at)}
    if shape == "messages" and base in INSTRUCT:
        return lambda row, at: {"messages": instruct_turns(row, INSTRUCT[base], at)}
    if shape == "text" and base in TEXT:
        return lambda row, at: {"text": field(row, d.get("field") or "text", at)}
    if shape == "pairs" and kind in PAIRS:
        return (lambda row, at: template_pair(row, d, at)) if kind.startswith("chat_template") else \
            (lambda row, at: built_pair(row, kind, at))
    return None


def said(kind: str, shape: str) -> str | None:
    """The one line on what the written rows carry of a type axolotl lays out in its own text; None: the rows are
    rendered as axolotl renders them (its chat_template types, with the template carried)."""
    base = kind.split(":")[0]
    if base in INSTRUCT:
        style = kind.split(":")[1] if ":" in kind else "instruct"
        return (f"carried: the turns (system: AlpacaPrompter's text, user: the instruction and input, assistant: the "
                f"answer); not carried: its {style} prompt text ('### Instruction:' … for instruct), which finetune "
                "renders as those turns with the recipe's chat template")
    if base in TEXT:
        return ("carried: each row's text; not carried: axolotl tokenizes each row alone (its eos added, cut into "
                "sequence_len pieces), finetune's text task lays the texts out as its data settings say")
    if shape == "pairs" and not kind.startswith("chat_template"):
        return (f"carried: the turns; not carried: {kind} writes {kind.split('.')[0]}'s text itself whatever the "
                "model's template, finetune renders the turns with the recipe's chat template (the same text only "
                "where that template is the same)")
    return None


def converted(rows: list, convert, path: Path, kind: str) -> list:
    """Every row converted; a row of another shape than the type's (a turn that is no mapping, an answer that is no
    conversation) is one line naming it."""
    out = []
    for n, row in enumerate(rows, 1):
        try:
            out.append(convert(row, (path, n, kind)))
        except (TypeError, KeyError, IndexError, AttributeError):
            raise ConfigError(f"data: {path} row {n} is not of axolotl's {kind} shape (see docs/reproduce/axolotl.md)"
                              ) from None
    return out


def training_rows(b, data, recipe: Path):
    """``finetune import``'s ``--data`` for an axolotl config (the file given, else the one local file its one data
    set names): rows of a type finetune converts (:func:`converter`) are written, in their order, beside the recipe
    (``RECIPE-rows.jsonl``) as the rows the run's task reads, and the data set's keys they carry leave the "not
    carried" lines (with one line on what they do not carry, :func:`said`). Other rows are read as they are."""
    sets, _ = b.own.get("datasets", ([], None))
    path = Path(data) if data is not None else b.data_file[0] if b.data_file else None
    shape = row_kind(b)
    if path is None or len(sets) != 1 or shape is None or path.suffix.lower() not in (".json", ".jsonl") \
            or not path.is_file():
        return data
    d, kind = sets[0], str(sets[0].get("type"))
    convert = converter(kind, shape, d)
    if convert is None:
        return data  # read as they are: the import says what it does not carry of the type
    rows = read_rows(path)
    out_rows = converted(rows, convert, path, kind)
    if shape == "messages" and [r["messages"] for r in out_rows] == [r.get("messages") for r in rows]:
        return data  # the rows are finetune's as they are
    out = recipe.with_name(f"{recipe.stem}-rows.jsonl")
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out_rows), encoding="utf-8")
    carried = {f"datasets.{key}" for key in CARRIED}
    b.uncarried[:] = [u for u in b.uncarried if u[0] not in carried]
    if said(kind, shape):
        b.uncarried.append(("datasets.type", kind, said(kind, shape)))
    print(f"{path}: axolotl's {kind} rows written as {shape} to {out} (the same turns, in their order)")
    return str(out)
