"""Less padding, same steps: length-sorted micro-batches and token budgets inside each window (packing off: these are
the unpacked layouts; tests/test_packing.py covers packed rows)."""

import pytest

from finetune import test_fine_tuning
from tests.helpers import copy_model, pad_collate, rel_diff, tiny_gpt2, token_data

SGD = dict(optimizer="sgd", learning_rate=0.3, max_grad_norm=None, n_epochs=2, seed=3, collate_fn=pad_collate,
           packing=False)


@pytest.fixture(scope="module")
def setup():
    model, data = tiny_gpt2(), token_data(37, lo=2, hi=24, seed=7)
    lengths = [len(s["input_ids"]) for s in data]
    big = test_fine_tuning(copy_model(model), train_data=data, batch_size=12, **SGD)
    return model, data, lengths, big


@pytest.mark.parametrize("split", [
    dict(batch_size=3, gradient_accumulation_steps=4, sort_within_window=False),
    dict(batch_size=3, gradient_accumulation_steps=4, sort_within_window=True),
    dict(batch_size=3, gradient_accumulation_steps=4, sort_within_window=True, max_tokens_per_micro_batch=40),
    dict(batch_size=3, gradient_accumulation_steps=4, sort_within_window=False, max_tokens_per_micro_batch=25),
], ids=["unsorted", "sorted", "sorted-budget-40", "unsorted-budget-25"])
def test_same_weights_as_one_big_batch(setup, split):
    model, data, lengths, big = setup
    small = test_fine_tuning(copy_model(model), train_data=data, length_of=lambda i: lengths[i], **split, **SGD)
    assert rel_diff(small["model"], big["model"]) <= 1e-5
    assert [h["window_hash"] for h in small["history"]] == [h["window_hash"] for h in big["history"]]
    assert [h["content_hash"] for h in small["history"]] == [h["content_hash"] for h in big["history"]]
    assert small["tokens"] == big["tokens"] == 2 * sum(lengths)
    if "max_tokens_per_micro_batch" in split:  # each micro-batch within the budget, unless one sample exceeds it
        budget = split["max_tokens_per_micro_batch"]
        assert all(h["padded_tokens"] <= budget * h["micro_batches"] for h in small["history"])


def test_sorting_cuts_padding(setup):
    model, data, lengths, _ = setup
    runs = {s: test_fine_tuning(copy_model(model), train_data=data, batch_size=3, gradient_accumulation_steps=4,
                                length_of=lambda i: lengths[i], sort_within_window=s, **SGD) for s in (False, True)}
    assert runs[True]["padded_tokens"] < runs[False]["padded_tokens"]
    assert runs[True]["tokens"] == runs[False]["tokens"]
    h = runs[True]["history"][0]
    assert h["tokens"] <= h["padded_tokens"]


def test_token_budget_varies_micro_batch_count():
    from finetune.windows import WindowSpec

    lengths = [2, 30, 3, 4, 28, 5, 6, 2]
    windows = WindowSpec(8, 2, 4, 1, 0, sort_key=lambda i: lengths[i], length_of=lambda i: lengths[i],
                         max_tokens=16).epoch(0, 0)
    (w,) = windows
    sizes = [len(mb) for mb in w.micro_batches]
    assert sizes == [4, 2, 1, 1]  # lengths 2 2 3 4 | 5 6 | 28 | 30 — not b = 2 per micro-batch any more
    assert all(len(mb) * max(lengths[i] for i in mb) <= 16 or len(mb) == 1 for mb in w.micro_batches)
