"""The order in which ms-swift hands its training rows to the Trainer, computed by ms-swift's own code (run in its
environment, SWIFT_VENV of make_baselines.sh) for a few files, data seeds and data set counts:

    $SWIFT_VENV/bin/python examples/msswift/row_orders.py tests/assets/msswift/row-orders.json

For each case it calls ``swift.dataset.load_dataset`` as ``BaseArguments.load_dataset`` calls it
(``swift/arguments/base_args/base_args.py``: ``split_dataset_ratio``, ``shuffle=dataset_shuffle``, and
``get_dataset_kwargs()``'s ``seed=data_seed``, ``num_proc=1``, ``streaming=False``; ms-swift 4.6.0) and writes
which row of the concatenated files each training row is (the rows are told apart by their messages). finetune's
import must write its rows in these orders (tests/test_msswift_order.py).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import swift
from swift.dataset import load_dataset

CHAT = Path("tests/assets/llamafactory/data/chat.jsonl")


def numbered(n: int, folder: Path, name: str) -> Path:
    """A file of n one-turn chats, each its own (the row's number in its text)."""
    path = folder / name
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{name} row {i}"},
                                                     {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
                            for i in range(n)))
    return path


def order(files: list, data_seed: int, shuffle: bool = True) -> list:
    """Which row of ``files`` (one after another) each of swift's training rows is."""
    rows = [json.loads(line)["messages"] for f in files for line in f.read_text().splitlines() if line.strip()]
    index = {json.dumps(m, sort_keys=True): n for n, m in enumerate(rows)}
    assert len(index) == len(rows), "rows must be told apart"
    train, _ = load_dataset([str(f) for f in files], split_dataset_ratio=0.0, shuffle=shuffle, seed=data_seed,
                            num_proc=1, load_from_cache_file=False, streaming=False, interleave_prob=None,
                            strict=False)
    # swift's rows carry its own keys beside a message's role and content (None where the file has none)
    kept = [[{k: v for k, v in turn.items() if v is not None} for turn in m] for m in train["messages"]]
    return [index[json.dumps(m, sort_keys=True)] for m in kept]


def main(out: str) -> None:
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inputs = {"chat.jsonl": [CHAT], "7 rows": [numbered(7, tmp, "a.jsonl")],
                  "100 rows": [numbered(100, tmp, "b.jsonl")],
                  "3 files": [numbered(5, tmp, "c.jsonl"), numbered(11, tmp, "d.jsonl"), CHAT]}
        for name, files in inputs.items():
            for data_seed in (42, 0, 1234):
                cases.append({"files": name, "data_seed": data_seed, "sets": len(files),
                              "rows": sum(len(f.read_text().splitlines()) for f in files),
                              "order": order(files, data_seed)})
        cases.append({"files": "chat.jsonl", "data_seed": 42, "sets": 1, "rows": 40, "dataset_shuffle": False,
                      "order": order([CHAT], 42, shuffle=False)})
    Path(out).write_text(json.dumps({"ms-swift": swift.__version__, "cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
