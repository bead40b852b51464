"""The baseline's kernels replayed: a TRL SFTTrainer run on 2 CPU processes, bf16 autocast + gradient checkpointing,
LoRA, 4 per device × 2 accumulation × 2 = 16, 48 chats of varied length (tests/assets/trl-2proc/varied.jsonl), on a
random Llama as wide as SmolLM2 (hidden 576, 2 layers: examples/trl-multiprocess/wider_model.py, seeded), trained
here by the test as a user trains it — ``accelerate launch`` at its defaults, which give each CPU process
physical cores // 2 threads — so that the baseline's kernels are this CPU's (a fixture made on another CPU kind would
replay another's). ``finetune reproduce`` with no ``--batch-size`` runs its micro-batches of 4, padded as TRL padded
them, with its threads: step 1's loss, before any update, is TRL's logged one bit for bit, and the verdict says so.
Negative controls: one word of an answer in the first window changed, the same token count → differs at step 1 (a
change 1e-4 of the loss, which the fp32 band alone would barely see); the same baseline at micro-batch 2 → not
replayed, said, and equivalent within its band, whose power the verdict states; the replay's own check names the
threads, the micro-batch and a micro-batch that does not fit."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from finetune.reproduce import replay
from finetune.reproduce.runs import read_run
from finetune.reproduce.sources import read_baseline
from tests.helpers import ACCELERATE, ENV, ROOT, cpu_kernels
from tests.helpers import cli_in_process as cli

VARIED = ROOT / "tests" / "assets" / "trl-2proc" / "varied.jsonl"
EXAMPLES = ROOT / "examples" / "trl-multiprocess"


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """(the wide model's folder, the 2-process TRL baseline trained on it)."""
    root = tmp_path_factory.mktemp("wide")
    model, baseline = root / "model", root / "trl-bf16-wide"
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}  # accelerate launch's own default
    subprocess.run([sys.executable, EXAMPLES / "wider_model.py", "--hidden", "576", "--layers", "2", "--out", model],
                   check=True, cwd=ROOT, env=env, capture_output=True)
    done = subprocess.run([ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", EXAMPLES / "train_sft.py",
                           "--bf16", "--data", VARIED, "--per-device", "4", "--accumulation", "2", "--model", model,
                           "--out", baseline], cwd=ROOT, env={**env, "ACCELERATE_USE_CPU": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return model, baseline


def logged(baseline) -> list:
    return [e for e in json.loads((baseline / "trainer_state.json").read_text())["log_history"] if "loss" in e]


def reproduce(capsys, wide, out, *more, data=VARIED):
    model, baseline = wide
    return cli(capsys, "reproduce", baseline, "--model", model, "--data", data, "-o", out, "--set",
               "model.generate_prompts=0", "--set", "output.plots=false", *more)


def verdict(said: str) -> str:
    return next(line for line in said.splitlines() if line.startswith("verdict:"))


def one_word(tmp_path, baseline) -> tuple:
    """The data with " plus " → " minus " in the answer of a sample of the first window (both one token), and the
    sample's index."""
    from transformers import AutoTokenizer

    from finetune.windows import trainer_epoch_order

    rows = [json.loads(line) for line in VARIED.read_text().splitlines()]
    first = trainer_epoch_order(len(rows), 42, 0)[:16]  # train_sft.py's seed; the first window's samples
    i = next(i for i in first if " plus " in rows[i]["messages"][1]["content"])
    before = rows[i]["messages"][1]["content"]
    rows[i]["messages"][1]["content"] = before.replace(" plus ", " minus ", 1)
    tokenizer = AutoTokenizer.from_pretrained(baseline)
    assert len(tokenizer(before)["input_ids"]) == len(tokenizer(rows[i]["messages"][1]["content"])["input_ids"])
    path = tmp_path / "word.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, i


def test_the_baselines_micro_batches_and_threads_replay_step_one_bit_for_bit(wide, tmp_path, capsys):
    code, said = reproduce(capsys, wide, tmp_path / "same")
    assert code == 0 and verdict(said).startswith("verdict: equivalent"), (cpu_kernels(), said)
    assert "forward replayed bit for bit at step 1" in verdict(said), (cpu_kernels(), said)
    assert "nothing above — step-1 loss 0 (bit for bit), loss " in verdict(said), said  # its power
    threads = replay.baseline_threads(read_baseline(wide[1], "compare"))[0]
    assert f"micro-batch 4, padded as the baseline's, {threads} thread" in said, said
    ours = json.loads((tmp_path / "same" / "run" / "history.jsonl").read_text().splitlines()[0])
    assert ours["loss"] == logged(wide[1])[0]["loss"]  # TRL's logged float32, to the last bit
    # the twin is the layout that differs
    assert "floor measured on twin at micro-batch 2, padded as the baseline's micro-batches of 4" in said, said

    word, i = one_word(tmp_path, wide[1])
    code, said = reproduce(capsys, wide, tmp_path / "word", data=word)
    assert code == 1 and verdict(said).startswith("verdict: differs — step 1: the baseline's kernels replayed"), said
    assert re.search(r"^ok\s+token count\s+equal", said, re.M), said  # the same token count: only the numbers tell

    rows = [json.loads(line) for line in VARIED.read_text().splitlines()]
    rows[i]["messages"][1]["content"] += " Indeed."  # a word added: the row's token count changes
    added = tmp_path / "added.jsonl"
    added.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, said = reproduce(capsys, wide, tmp_path / "added", data=added)
    assert code == 1 and re.search(r"^DIFF\s+token count\s+step 1: ", said, re.M), said


def test_another_micro_batch_is_not_a_replay_and_is_held_to_its_band(wide, tmp_path, capsys):
    code, said = reproduce(capsys, wide, tmp_path / "two", "--batch-size", "2")
    line = verdict(said)
    assert code == 0 and line.startswith("verdict: equivalent"), said
    assert "step 1 not replayed — the micro-batch: 2 here, the baseline's 4" in line, said
    assert "forward replayed bit for bit" not in line, said
    power = re.search(r"nothing above — loss (\S+), grad norm (\S+), weights L2 (\S+) \(the smallest", line)
    assert power and all(float(x.rstrip(",")) > 0 for x in power.groups()), line  # its power, printed


def test_the_replay_check_names_what_differs(wide, tmp_path, capsys):
    """The replay's own judgement on a run that replayed, with one thing of it changed at a time: the threads, the
    micro-batch, a micro-batch that ``batch_size: auto`` could not fit."""
    code, _ = reproduce(capsys, wide, tmp_path / "r")
    b, run = read_baseline(wide[1], "compare"), read_run(tmp_path / "r" / "run")
    assert code == 0 and replay.kernels(b, run).replayed, replay.kernels(b, run)
    threads = run.metrics["arithmetic"]["threads"]
    other = dataclasses.replace(run, metrics={**run.metrics, "arithmetic": {**run.metrics["arithmetic"],
                                                                             "threads": threads + 1}})
    assert any(d.startswith(f"the threads: {threads + 1} here") for d in replay.kernels(b, other).differs)
    halved = [{**h, "micro_batches": 2 * h["micro_batches"]} for h in run.history]
    smaller = dataclasses.replace(run, history=halved)
    k = replay.kernels(b, smaller)
    assert k.differs == ("the micro-batch: 2 here, the baseline's 4",) and "does not fit" in (k.impossible or ""), k
    told = dataclasses.replace(smaller, config={**run.config, "training": {**run.config["training"], "batch_size": 2}})
    assert replay.kernels(b, told).impossible is None


@pytest.mark.parametrize("value, digits", [(1.8459535837173462, 16), (5.7704, 4), (2.0, 1), (0.00012345, 8)])
def test_logged_digits(value, digits):
    assert replay.logged_digits(value) == digits
    assert replay.same_to_logged_digits(value, value) and not replay.same_to_logged_digits(value, value * (1 + 1e-3))


def test_baseline_threads_follow_accelerates_default(monkeypatch):
    """accelerate launch on a CPU: physical cores // local processes, at least 1 (its commands/launch.py)."""
    from finetune.reproduce.record import Baseline

    monkeypatch.setattr(replay.psutil, "cpu_count", lambda logical=True: 16)
    assert replay.baseline_threads(Baseline("x", ROOT, processes=(2, "test")))[0] == 8
    assert replay.baseline_threads(Baseline("x", ROOT, processes=(32, "test")))[0] == 1
    assert replay.baseline_threads(Baseline("x", ROOT))[0] == 16
    assert os.cpu_count()  # the machine's own is what the reproduction takes
