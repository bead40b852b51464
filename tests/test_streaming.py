"""A streamed training set (data.streaming, finetune/streaming.py) takes the steps of the same rows tokenized ahead.

* with shuffling off, a streamed run's history is the map-style run's, step for step, and with it on, the order is
  blocks in a seeded order (another order than map-style: the control);
* (b, N) and (b·N, 1) take the same steps on a stream; 2 processes = 1 is tests/test_distributed.py's
  ``sft-smollm2:streaming`` case;
* ``finetune compare`` reads a streamed run as the tokenized one (the same windows, the same steps);
* a window is read when it is reached: set-up reads no row, and a run resumed at window k reads from k's block;
* a run SIGKILLed mid-epoch and resumed ends bit-identical to the uninterrupted one;
* dpo streams its pairs alike;
* jsonl and parquet shards and a folder of them read the same rows; what a stream cannot do is one line.
"""

from __future__ import annotations

import itertools
import json
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from finetune import streaming
from finetune.windows import WindowSpec, block_order
from tests.helpers import (
    ENV,
    ROOT,
    RUN,
    SMALL,
    TINY_CHAT,
    assert_one_error_line,
    chat_rows,
    cli,
    dpo_recipe_run,
    same_bytes,
    tiny_pairs_assets,
)
from tests.helpers import sft_recipe_run as run

STREAM = ["data.streaming=true", "data.val_fraction=0", "data.too_long=keep_start", "data.stream_block=5"]
MAP_STYLE = ["data.val_fraction=0", "data.too_long=keep_start"]


def history(result) -> list:
    return [{k: v for k, v in h.items() if k != "seconds" and not k.startswith("mem_")} for h in result["history"]]


def weights(result) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in result["model"].parameters()])


def test_a_stream_takes_the_map_style_steps_with_shuffling_off():
    # packed alike: a stream's rows are as long as training.pack_length (its longest sample is not known ahead)
    streamed, _ = run(3, 3, *STREAM, "training.shuffle=false", "training.pack_length=96")
    ahead, _ = run(3, 3, *MAP_STYLE, "training.shuffle=false", "training.pack_length=96")
    assert history(streamed) == history(ahead)  # windows, items, losses, grad norms: bit for bit
    assert torch.equal(weights(streamed), weights(ahead))
    shuffled, _ = run(3, 3, *STREAM)  # the control: the block order is another order
    assert [h["window_hash"] for h in history(shuffled)] != [h["window_hash"] for h in history(ahead)]


def test_a_stream_of_preference_pairs_takes_the_map_style_steps():
    tiny_pairs_assets()
    streamed, _, _ = dpo_recipe_run(2, 2, *STREAM, "training.shuffle=false")
    ahead, _, _ = dpo_recipe_run(2, 2, *MAP_STYLE, "training.shuffle=false")
    assert history(streamed) == history(ahead)
    assert torch.equal(weights(streamed), weights(ahead))


def test_a_stream_takes_the_same_steps_for_any_split_of_the_batch():
    small, start = run(3, 3, *STREAM)
    big, _ = run(9, 1, *STREAM)
    assert [h["window_hash"] for h in small["history"]] == [h["window_hash"] for h in big["history"]]
    assert [h["content_hash"] for h in small["history"]] == [h["content_hash"] for h in big["history"]]
    assert [h["items"] for h in small["history"]] == [h["items"] for h in big["history"]]
    assert small["loss_history"] == pytest.approx(big["loss_history"], rel=1e-5)
    delta = [(weights(r) - torch.cat([w.flatten() for w in start.values()])).double() for r in (small, big)]
    assert float((delta[0] - delta[1]).abs().max() / delta[1].abs().max()) <= 1e-5


def test_compare_reads_a_streamed_run_as_the_tokenized_one(tmp_path):
    base = [*SMALL["sft-smollm2"], *MAP_STYLE, "training.shuffle=false", "training.pack_length=96",
            "model.generate_prompts=0", "training.batch_size=4", "training.effective_batch_size=8"]
    runs = {}
    for name, extra in (("ahead", []), ("stream", ["data.streaming=true", "data.stream_block=5"])):
        runs[name] = tmp_path / name
        sets = [x for s in [*base, *extra] for x in ("--set", s)]
        proc = cli("--recipe", "sft-smollm2", *sets, "--max-steps", "3", "--output-dir", str(runs[name]))
        assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "finetune", "compare", str(runs["ahead"]), str(runs["stream"])],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert "verdict: equivalent" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "all 3 windows held the same samples" in proc.stdout


def test_block_order_is_a_permutation_read_a_block_at_a_time():
    order = block_order(23, 5, torch.Generator().manual_seed(3))
    assert sorted(order) == list(range(23))
    runs = [k for k, _ in itertools.groupby(order, key=lambda i: i // 5)]
    assert sorted(runs) == list(range(5))  # each block's rows come together, every block once
    assert order != sorted(order)


class CountingRows(streaming.StreamedRows):
    """StreamedRows that records which blocks it reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reads = []

    def read(self, first, count):
        self.reads.append(first // self.block)
        return super().read(first, count)


def stream_of(tmp_path, n=40, block=4):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"i": i, "text": "x" * (i % 7 + 1)}) + "\n" for i in range(n)))
    return CountingRows([path], lambda row, i: {**row, "length": len(row["text"])}, block)


def test_set_up_reads_nothing_and_a_resumed_run_reads_from_its_window(tmp_path):
    rows = stream_of(tmp_path)
    spec = WindowSpec(len(rows), 2, 2, 1, seed=0, sort_key=rows.length, length_of=rows.length, block=rows.block)
    windows = spec.windows(0, first=6)
    assert rows.reads == []  # nothing read before a window is reached
    first = next(windows)
    assert rows.reads and set(rows.reads) == {i // rows.block for i in first.samples}
    assert rows[first.samples[0]]["i"] == first.samples[0]  # sample i is row i
    every = [w.samples for w in spec.windows(0)]
    assert first.samples == every[6]  # the resumed window is the uninterrupted run's


def test_jsonl_parquet_and_a_folder_of_shards_read_the_same_rows(tmp_path):
    import datasets

    rows = [{"i": i, "text": f"row {i}"} for i in range(30)]
    (tmp_path / "one.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a blank line at the end
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "one.parquet"))
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:11]))
    datasets.Dataset.from_list(rows[11:]).to_parquet(str(folder / "b.parquet"))
    for source in ("one.jsonl", "one.parquet", "shards"):
        stream = streaming.StreamedRows(streaming.shards(str(tmp_path / source)), lambda r, i: r, block=7)
        assert [stream[i] for i in range(len(stream))] == rows, source


@pytest.mark.parametrize("overrides, message", [
    (["data.streaming=true", "data.val_fraction=0"], "data.too_long: a stream cannot drop rows"),
    (["data.streaming=true", "data.too_long=keep_start"], "data.val_fraction: 0.2; a stream holds nothing out"),
    (["data.streaming=true", "data.val_fraction=0", "data.too_long=keep_start", "data.source=stdlib-qa"],
     "data.source: streaming reads a .jsonl or .parquet file"),
    (["data.streaming=true", "data.val_fraction=0", "data.too_long=keep_start", "training.batch_size=auto"],
     "training.batch_size: auto measures the longest samples"),
])
def test_what_a_stream_cannot_do_is_one_line(tmp_path, overrides, message):
    args = [x for o in [*SMALL["sft-smollm2"], *overrides] for x in ("--set", o)]
    proc = cli("--recipe", "sft-smollm2", *args, "--max-steps", "1", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert_one_error_line(proc.stderr, message)


def resumable_args(out) -> list:
    sets = [*SMALL["sft-smollm2"], *STREAM, "data.source=" + str(TINY_CHAT / "chat.jsonl"), "training.batch_size=2",
            "training.effective_batch_size=4", "training.epochs=2", "model.generate_prompts=0",
            "training.eval_at_start=false"]
    return ["--recipe", "sft-smollm2", *[x for s in sets for x in ("--set", s)], "--save-every", "2",
            "--output-dir", str(out)]


def adapter_weights(out) -> dict:
    from safetensors.torch import load_file

    return {f"{p.name}:{k}": v for p in sorted((out / "model").rglob("*.safetensors")) for k, v in
            load_file(str(p)).items()}


def test_sigkill_mid_epoch_then_resume_is_bit_identical(tmp_path):
    full = tmp_path / "full"
    proc = cli(*resumable_args(full))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (full / "history.jsonl").read_text().splitlines()
    step = random.randrange(3, len(lines) // 2 - 1)  # inside epoch 0
    out = tmp_path / "killed"
    killer = subprocess.Popen([sys.executable, RUN, *resumable_args(out)], env=ENV, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and killer.poll() is None:
        if (out / "history.jsonl").exists() and len((out / "history.jsonl").read_text().splitlines()) >= step:
            killer.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    assert killer.wait() == -signal.SIGKILL, f"the run ended before step {step}"
    proc = cli(*resumable_args(out), "--resume", "latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    strip = lambda text: [{k: v for k, v in json.loads(x).items() if k != "seconds" and not k.startswith("mem_")}
                          for x in text.splitlines()]  # noqa: E731
    assert strip((out / "history.jsonl").read_text()) == strip((full / "history.jsonl").read_text())
    assert same_bytes(adapter_weights(out), adapter_weights(full)), f"killed at step {step}"


def test_rows_of_a_stream_are_the_file_rows(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = chat_rows(12)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    stream = streaming.StreamedRows([path], lambda r, i: r, block=5)
    assert [stream[i] for i in (11, 0, 6)] == [rows[11], rows[0], rows[6]]
