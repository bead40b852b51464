"""Tables of samples in Arrow (finetune/tables.py): the chat tasks encode their rows once, through ``Dataset.map``,
into the on-disk cache, and every later run reads the cached table.

* the cached samples are the ones each row encodes to on its own, in the file's order, and the same for any number
  of encoding processes;
* a second run tokenizes nothing (the encoder is not called), and a changed chat template or setting misses the
  cache, as a changed data file does;
* a table with a bad row is refused with one line and never cached;
* lengths come from a column and equal the samples' token counts.
"""

from __future__ import annotations

import json
import shutil

import pytest

from finetune import cache, tables
from finetune.errors import ConfigError
from finetune.tasks import chat, dpo, grpo, sft
from tests.helpers import CHATML, chat_rows, tiny_chat_assets


@pytest.fixture()
def tokenizer():
    return chat.load_tokenizer(chat.ChatModelConfig(name_or_path=tiny_chat_assets()["model"]))


@pytest.fixture()
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "datasets"


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def sft_config(source, **fields):
    return sft.DataConfig(source=source, max_length=64, **fields)


def folders(root) -> list:
    return [p for p in root.iterdir() if p.is_dir()]


def encoder_calls(monkeypatch, module):
    """Count the calls of ``module.encode_row`` (one per row encoded)."""
    calls = []
    real = module.encode_row
    monkeypatch.setattr(module, "encode_row", lambda *a: calls.append(1) or real(*a))
    return calls


def test_the_cached_samples_are_each_rows_own_encoding(tmp_path, fresh_cache, tokenizer):
    rows = chat_rows(30)
    d = sft_config(write_rows(tmp_path / "c.jsonl", rows))
    samples = sft.tokenized(tokenizer, sft.load_rows(d), d)
    assert len(samples) == len(rows)
    for i, row in enumerate(rows):
        expected = sft.encode(tokenizer, sft.to_messages(row), "assistant")
        got = samples[i]
        too_long = len(expected["input_ids"]) > d.max_length
        assert got["dropped"] == too_long
        if not too_long:
            assert (got["input_ids"], got["labels"], got["prompt_ids"]) == \
                (expected["input_ids"], expected["labels"], expected["prompt_ids"])
            assert got["length"] == len(expected["input_ids"])
    assert 0 < sum(samples["dropped"]) < len(rows)  # the check saw both kinds


def test_any_number_of_encoding_processes_gives_the_same_table(tmp_path, fresh_cache, tokenizer):
    d = sft_config(write_rows(tmp_path / "c.jsonl", chat_rows(40)))
    one = sft.tokenized(tokenizer, sft.load_rows(d), d).to_list()
    shutil.rmtree(fresh_cache)
    d.num_proc = 2
    two = sft.tokenized(tokenizer, sft.load_rows(d), d)
    assert len(list(fresh_cache.glob("*/*.arrow"))) == 2  # really written by two processes
    assert two.to_list() == one


def test_a_second_run_tokenizes_nothing_and_a_changed_template_misses(tmp_path, fresh_cache, tokenizer, monkeypatch):
    d = sft_config(write_rows(tmp_path / "c.jsonl", chat_rows(12)))
    calls = encoder_calls(monkeypatch, sft)
    first = sft.tokenized(tokenizer, sft.load_rows(d), d).to_list()
    assert len(calls) == 12
    again = sft.tokenized(tokenizer, sft.load_rows(d), d).to_list()
    assert len(calls) == 12 and again == first  # read from the cache: no row encoded
    tokenizer.chat_template = CHATML.replace("'\\n'", "'\\n\\n'")  # another template: other tokens
    changed = sft.tokenized(tokenizer, sft.load_rows(d), d).to_list()
    assert len(calls) == 24 and changed != first
    d.max_length = 32  # a setting that shapes a sample
    sft.tokenized(tokenizer, sft.load_rows(d), d)
    assert len(calls) == 36
    write_rows(tmp_path / "c.jsonl", chat_rows(12, seed=1))  # the same file name, other rows
    sft.tokenized(tokenizer, sft.load_rows(d), d)
    assert len(calls) == 48
    assert len(folders(fresh_cache)) == 4


def test_dpo_and_grpo_tables_are_cached_too(tmp_path, fresh_cache, tokenizer, monkeypatch):
    pairs = [{"prompt": f"What is {i} plus 1?", "chosen": f"{i + 1}.", "rejected": f"{i + 2}."} for i in range(8)]
    d = dpo.DataConfig(source=write_rows(tmp_path / "p.jsonl", pairs))
    calls = encoder_calls(monkeypatch, dpo)
    first = dpo.tokenized(tokenizer, dpo.load_rows(d), d).to_list()
    assert dpo.tokenized(tokenizer, dpo.load_rows(d), d).to_list() == first and len(calls) == 8
    expected = dpo.encode_pair(tokenizer, *dpo.to_pair(pairs[3]))
    assert {k: first[3][k] for k in expected} == expected
    g = grpo.DataConfig(source=str(tmp_path / "p.jsonl"))
    prompts = grpo.tokenized(tokenizer, grpo.load_rows(g), g)
    assert prompts[3]["ids"] == grpo.prompt_ids(tokenizer, pairs[3]["prompt"], None)
    assert len(folders(fresh_cache)) == 2


def test_a_bad_row_is_one_line_and_nothing_is_cached(tmp_path, fresh_cache, tokenizer):
    rows = chat_rows(10)
    rows[4] = {"messages": [{"role": "user", "content": "no answer"}]}
    rows[7] = {"text": "neither"}
    d = sft_config(write_rows(tmp_path / "c.jsonl", rows))
    with pytest.raises(ConfigError) as e:
        sft.tokenized(tokenizer, sft.load_rows(d), d)
    assert e.value.problems == ["data.source: line 5 has no assistant turn (nothing to learn) (1 more bad rows)"]
    assert not any(cache.is_complete(p) for p in folders(fresh_cache))


def test_split_parts_are_views_whose_lengths_come_from_a_column(tmp_path, fresh_cache, tokenizer):
    rows = chat_rows(40)
    d = sft_config(write_rows(tmp_path / "c.jsonl", rows), val_fraction=0.25)
    samples = sft.tokenized(tokenizer, sft.load_rows(d), d)
    train, val, dropped_train, dropped_val = chat.parts(samples, d)
    assert len(train) + len(val) + dropped_train + dropped_val == len(rows)
    lengths = tables.column(train, "length")
    assert lengths.tolist() == [len(s["input_ids"]) for s in train]
    assert tables.token_lengths(train).tolist() == lengths.tolist()
