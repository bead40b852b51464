"""ms-swift's default data order (``dataset_shuffle: true``) replayed by ``finetune import``: the rows it writes are in
the order ms-swift's own ``load_dataset`` gave them (tests/assets/msswift/row-orders.json, computed by ms-swift 4.6.0
itself: examples/msswift/row_orders.py), for several files, data seeds and data set counts; an order it cannot
replay is named as not carried."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.reproduce.record import Baseline
from finetune.reproduce.rows import row_change
from finetune.reproduce.sources.msswift import rows_shuffled
from tests.helpers import ROOT

ORDERS = json.loads((ROOT / "tests" / "assets" / "msswift" / "row-orders.json").read_text())
CASES = ORDERS["cases"]


def swift_args(case: dict, **changes) -> dict:
    """args.json as ms-swift writes it for the case: its data sets, data seed and shuffle."""
    return {"swift_version": ORDERS["ms-swift"], "dataset": [f"set{n}.jsonl" for n in range(case["sets"])],
            "data_seed": case["data_seed"], "dataset_shuffle": case.get("dataset_shuffle", True),
            "split_dataset_ratio": 0.0, "streaming": False, "interleave_prob": None, "cached_dataset": [], **changes}


def imported_order(args: dict, rows: int) -> list:
    """The order of the rows ``finetune import`` writes for a run with ``args`` over a file of ``rows`` rows."""
    b = Baseline("ms-swift run", Path("run"))
    rows_shuffled(args, b)
    change = row_change(b)
    return list(range(rows)) if change is None else list(change[3](rows))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['files']}-seed{c['data_seed']}"
                         + ("-unshuffled" if c.get("dataset_shuffle") is False else ""))
def test_the_rows_are_written_in_the_order_swift_trained_them(case):
    assert len(case["order"]) == case["rows"] and sorted(case["order"]) == list(range(case["rows"]))
    assert imported_order(swift_args(case), case["rows"]) == case["order"]


def test_the_draws_before_the_shuffle_matter():
    """Negative control: 4.5 drew the shuffle's seed first (no init_decision_augment before it); read as 4.5, the
    same run's rows come in another order than 4.6 trained them."""
    shuffled = [c for c in CASES if c.get("dataset_shuffle", True)]
    for case in shuffled:
        assert imported_order(swift_args(case, swift_version="4.5.0"), case["rows"]) != case["order"], case["files"]
    assert len({tuple(c["order"]) for c in shuffled if c["files"] == "chat.jsonl"}) == 3  # the seed changes it


@pytest.mark.parametrize("change, why", [
    ({"split_dataset_ratio": 0.1}, "holds rows out first"), ({"streaming": True}, "streams them"),
    ({"interleave_prob": [0.5, 0.5]}, "interleaves its data sets"), ({"cached_dataset": ["c"]}, "cached data sets"),
    ({"dataset": ["data.jsonl#20"]}, "samples its data sets"), ({"swift_version": "3.12.0"}, "not of 3.12.0"),
    ({"swift_version": "4.7.0"}, "not of 4.7.0"), ({"data_seed": None}, "seeded by the OS")])
def test_an_order_it_cannot_replay_is_named(change, why):
    b = Baseline("ms-swift run", Path("run"))
    rows_shuffled(swift_args(CASES[0], **change), b)
    assert b.shuffled is None and row_change(b) is None
    [(key, value, said)] = b.uncarried
    assert key == "dataset_shuffle" and value is True and why in said, said
