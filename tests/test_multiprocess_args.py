"""The arguments of a run trained on several processes or on an indexed device (``cuda:3``) under DeepSpeed, read
from ``training_args.bin`` as inert records (nothing from the file runs), and the number of processes with where it
was said: the arguments' accelerate state, the card, or ``--processes`` where nothing says; two sources that
disagree are refused in one line."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tests.helpers import ROOT, assert_one_error_line
from tests.helpers import cli_in_process as cli


def saved_on(path, device, processes: int, kind: str = "MULTI_GPU", **fields) -> None:
    """``torch.save`` of real TrainingArguments as a process of a ``processes``-process run on ``device`` saves them
    (accelerate's shared state set so while they are saved, then put back)."""
    from accelerate.state import PartialState
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(path.parent / "out"), use_cpu=True, report_to=[],
                             per_device_train_batch_size=8, gradient_accumulation_steps=1, learning_rate=2e-3,
                             num_train_epochs=2, seed=42, warmup_steps=0.1, weight_decay=0.01, **fields)
    _ = args.device  # the state the arguments pickle
    shared = PartialState._shared_state
    before = dict(shared)
    shared.update(device=device, num_processes=processes, process_index=1, distributed_type=kind)
    try:
        torch.save(args, path)
    finally:
        shared.clear()
        shared.update(before)


DEEPSPEED = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
             "gradient_accumulation_steps": "auto", "communication_data_type": "fp32"}


def test_a_bin_saved_on_cuda_3_under_deepspeed_is_read_and_a_foreign_one_still_refused(tmp_path):
    from finetune.errors import ConfigError
    from finetune.reproduce.sources.pickled_args import read_training_args_bin

    path = tmp_path / "training_args.bin"
    saved_on(path, torch.device("cuda", 3), 2, deepspeed=DEEPSPEED)
    args = read_training_args_bin(path)
    assert args["distributed_state"]["device"] == "cuda:3" and args["distributed_state"]["num_processes"] == 2
    assert args["deepspeed"]["zero_optimization"] == {"stage": 2}
    assert args["deepspeed_plugin"]["zero_stage"] == 2 and args["hf_deepspeed_config"]["_dtype"] == "torch.float32"
    # the stand-ins held no class of the file's: every value is plain data
    assert "Record" not in repr(args)
    torch.save({"x": torch.ones(1)}, tmp_path / "tensor.bin")  # negative control: a tensor storage is refused
    with pytest.raises(ConfigError, match="refused, nothing from it was run"):
        read_training_args_bin(tmp_path / "tensor.bin")


@pytest.fixture(scope="module")
def folder(trainer_example_run, tmp_path_factory):
    """The example's Trainer folder with its arguments as a 2-process run on cuda:3 saved them (no JSON)."""
    out = tmp_path_factory.mktemp("two") / "baseline"
    shutil.copytree(trainer_example_run / "baseline", out)
    (out / "training_args.json").unlink()
    saved_on(out / "training_args.bin", torch.device("cuda", 3), 2)
    return out


def test_the_processes_come_from_the_arguments_and_scale_the_batch(folder, trainer_example_run, tmp_path, capsys):
    import yaml

    code, said = cli(capsys, "import", folder, "--recipe", trainer_example_run / "recipe.yaml", "-o",
                     tmp_path / "r.yaml")
    assert code == 0, said
    row = next(line for line in said.splitlines() if line.startswith("training.effective_batch_size"))
    assert "2 processes (training_args.bin: distributed_state.num_processes)" in row, row  # and the card's total
    assert yaml.safe_load((tmp_path / "r.yaml").read_text())["training"]["effective_batch_size"] == 16
    code, said = cli(capsys, "import", folder, "--recipe", trainer_example_run / "recipe.yaml", "-o",
                     tmp_path / "p.yaml", "--processes", 4)
    assert code == 2 and not (tmp_path / "p.yaml").exists()
    assert_one_error_line(said, "--processes: 4, but the baseline trained on 2")


def test_sources_that_disagree_are_refused_and_processes_fill_a_gap(folder, trainer_example_run, tmp_path, capsys):
    import yaml

    odd = tmp_path / "odd"
    shutil.copytree(folder, odd)
    card = (odd / "README.md").read_text()
    (odd / "README.md").write_text(card.replace("- seed: 42", "- seed: 42\n- num_devices: 4"))
    code, said = cli(capsys, "import", odd, "--recipe", trainer_example_run / "recipe.yaml", "-o", tmp_path / "x.yaml")
    assert code == 2 and not (tmp_path / "x.yaml").exists(), said
    assert_one_error_line(said, "the number of processes is 2 (training_args.bin: distributed_state.num_processes) "
                                "but 4")
    args = tmp_path / "args.json"  # arguments JSON: it does not say the processes
    args.write_text(json.dumps({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                "learning_rate": 1e-3, "seed": 3}))
    code, said = cli(capsys, "import", args, "--recipe", trainer_example_run / "recipe.yaml", "-o", tmp_path / "a.yaml")
    assert code == 0 and "1 process (the source names no process count: --processes P)" in said, said
    code, said = cli(capsys, "import", args, "--recipe", trainer_example_run / "recipe.yaml", "-o",
                     tmp_path / "b.yaml", "--processes", 2)
    assert code == 0 and "× 2 processes (--processes)" in said, said
    assert yaml.safe_load((tmp_path / "b.yaml").read_text())["training"]["effective_batch_size"] == 16


TWO = ROOT / "tests" / "assets" / "trl-2proc" / "sft"  # examples/trl-multiprocess/train_sft.py on 2 processes
LF = ROOT / "tests" / "assets" / "llamafactory"


def one_word_changed(rows_file, out, answer_of) -> str:
    """A copy of ``rows_file`` with one word of row 7's answer (``answer_of(row)``: the message) changed."""
    rows = [json.loads(line) for line in open(rows_file)]
    answer = answer_of(rows[7])
    assert " is " in answer["content"]
    answer["content"] = answer["content"].replace(" is ", " was ", 1)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(out)


RUNS = {  # fixture → (its rows, the micro-batch reproducing it, the answer of a row, what import says of it)
    "sft": (LF / "data" / "chat.jsonl", 2, lambda r: next(m for m in r["messages"] if m["role"] == "assistant"),
            "× 2 processes (training_args.bin: distributed_state.num_processes)"),
    "sft-bf16": (LF / "data" / "chat.jsonl", 2,
                 lambda r: next(m for m in r["messages"] if m["role"] == "assistant"), "× 2 processes"),
    "sft-zero2": (LF / "data" / "chat.jsonl", 2,
                  lambda r: next(m for m in r["messages"] if m["role"] == "assistant"),
                  "× 2 processes (training_args.bin: distributed_state.num_processes); under DeepSpeed ZeRO-2: "
                  "the data-parallel step"),
    "sft-zero3": (LF / "data" / "chat.jsonl", 2,
                  lambda r: next(m for m in r["messages"] if m["role"] == "assistant"),
                  "; under DeepSpeed ZeRO-3: the data-parallel step"),
    "dpo": (TWO.parent / "pairs.jsonl", 1, lambda r: r["chosen"][0], "× 2 processes"),
}


@pytest.mark.parametrize("run", list(RUNS), ids=["fp32", "bf16-checkpointing", "deepspeed-zero2", "deepspeed-zero3",
                                                    "dpo"])
def test_a_two_process_trl_run_is_reproduced_on_one_and_its_one_word_twin_differs(tmp_path, capsys, run):
    """fp32 against fp32's tolerances; bf16 autocast (with gradient checkpointing) against the floor reproduce
    measures on its twin; DeepSpeed ZeRO-2 and ZeRO-3 (gradients reduced in fp32) and DPO (each micro-batch's mean,
    every one full) as the big batch's step."""
    rows, micro, answer_of, said_of_processes = RUNS[run]

    def reproduce(out, data):
        code, said = cli(capsys, "reproduce", TWO.parent / run, "--model", LF / "model", "--data", data,
                         "--batch-size", micro, "-o", out, "--set", "model.generate_prompts=0" if run != "dpo" else
                         "training.seed=42")
        return code, next((line for line in said.splitlines() if line.startswith("verdict:")), said[-2000:]), said

    code, verdict, said = reproduce(tmp_path / "same", rows)
    assert code == 0 and verdict.startswith("verdict: equivalent"), verdict
    assert said_of_processes in said, said
    code, verdict, _ = reproduce(tmp_path / "word", one_word_changed(rows, tmp_path / rows.name, answer_of))
    assert code == 1 and verdict.startswith("verdict: differs"), verdict
    assert run != "sft-bf16" or "floor measured on twin" in said


def test_the_processes_come_from_the_steps_per_epoch_where_no_file_says_them(tmp_path, capsys):
    """The 2-process TRL run with its arguments as JSON (no accelerate state): its 5 steps over the 40 rows of --data
    at 2 × 2 fit 2 processes only; without --data the count is unknown (1, said); 100 rows fit 5 or 6: refused."""
    import yaml

    from finetune.reproduce.sources.pickled_args import read_training_args_bin

    run = tmp_path / "run"
    shutil.copytree(TWO, run)
    args = read_training_args_bin(run / "training_args.bin")
    (run / "training_args.bin").unlink()
    kept = {k: args[k] for k in ("per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
                                 "seed", "num_train_epochs", "max_grad_norm", "lr_scheduler_type")}
    (run / "training_args.json").write_text(json.dumps(kept))
    code, said = cli(capsys, "import", run, "--recipe", "sft-smollm2", "--data", LF / "data" / "chat.jsonl", "-o",
                     tmp_path / "r.yaml")
    assert code == 0, said
    assert "× 2 processes (trainer_state.json: 5 steps per epoch over the 40 rows of" in said, said
    assert yaml.safe_load((tmp_path / "r.yaml").read_text())["training"]["effective_batch_size"] == 8
    code, said = cli(capsys, "import", run, "--recipe", "sft-smollm2", "-o", tmp_path / "n.yaml")
    assert code == 0 and "1 process (the source names no process count: --processes P)" in said, said
    more = tmp_path / "more.jsonl"
    more.write_text((LF / "data" / "chat.jsonl").read_text() * 3 + "".join(
        (LF / "data" / "chat.jsonl").read_text().splitlines(keepends=True)[:20]))
    code, said = cli(capsys, "import", run, "--recipe", "sft-smollm2", "--data", more, "-o", tmp_path / "m.yaml")
    assert code == 2 and not (tmp_path / "m.yaml").exists(), said
    assert_one_error_line(said, "import: trainer_state.json: 5 steps per epoch over the 140 rows")
    fits = [p for p in range(1, 40) if math.ceil(140 / (4 * p)) == 5]
    assert len(fits) > 1 and f"fit {', '.join(map(str, fits))} processes; give --processes P" in said, said


def test_reproduce_refuses_a_baseline_whose_data_it_does_not_know(tmp_path, capsys):
    code, said = cli(capsys, "reproduce", TWO, "--model", LF / "model", "-o", tmp_path / "r")
    assert code == 2 and not (tmp_path / "r").exists(), said
    assert_one_error_line(said, "the baseline's training data is unknown")


def test_a_short_last_batch_on_two_processes_is_named_with_the_samples_it_repeated(tmp_path, capsys):
    """38 rows, 2 per device on 2 processes: each process's last batch is short, and accelerate's even_batches
    completes it with the epoch's first samples. finetune keeps the big batch's step: steps 1–4 agree, and the verdict
    names window 4 (step 5) and the samples it held a second time, as accelerate's own sampler hands them out."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    from finetune.windows import trainer_epoch_order

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join((LF / "data" / "chat.jsonl").read_text().splitlines(keepends=True)[:38]))
    code, said = cli(capsys, "reproduce", TWO.parent / "sft-short", "--model", LF / "model", "--data", rows,
                     "--batch-size", 2, "-o", tmp_path / "r", "--set", "model.generate_prompts=0")
    verdict = next(line for line in said.splitlines() if line.startswith("verdict:"))
    assert code == 1 and verdict.startswith("verdict: differs — window samples: step 5 (epoch 0, window 4)"), verdict
    assert "first above at step 5" in said  # the four full windows are the baseline's steps
    base = BatchSampler(trainer_epoch_order(38, 42, 0), batch_size=2, drop_last=False)
    last = [list(BatchSamplerShard(base, num_processes=2, process_index=r, even_batches=True))[-1] for r in (0, 1)]
    first = set(trainer_epoch_order(38, 42, 0)[:4])
    repeated = sorted(i for batch in last for i in batch if i in first)
    assert repeated and f"held samples {repeated} a second time" in verdict, (repeated, verdict)
    assert "import --baseline-step replays them" in verdict

    code, said = cli(capsys, "reproduce", TWO.parent / "sft-short", "--model", LF / "model", "--data", rows,
                     "--batch-size", 2, "-o", tmp_path / "b", "--set", "model.generate_prompts=0", "--baseline-step")
    verdict = next(line for line in said.splitlines() if line.startswith("verdict:"))
    assert code == 0 and verdict.startswith("verdict: equivalent"), said
    assert "training.even_batches                 [2, 2]" in said
    assert f"holds 6 samples and {len(repeated)} of the epoch's first again" in said


def test_even_batches_windows_hold_what_accelerate_hands_each_process(tmp_path):
    """``training.even_batches``: each window holds the samples accelerate's sampler gave every process in it, the
    last one's repeats included, at any micro-batch of this run; without it, each sample once."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    from finetune.windows import WindowSpec, trainer_epoch_order

    n, processes, per_device, accumulation = 29, 3, 2, 2
    order = trainer_epoch_order(n, 7, 0)
    ranks = [list(BatchSamplerShard(BatchSampler(order, per_device, False), num_processes=processes,
                                    process_index=r, even_batches=True)) for r in range(processes)]
    size = processes * per_device * accumulation
    for micro in (1, 2, 3, 6):
        spec = WindowSpec(samples=n, micro_batch=micro, accumulation=size // micro, processes=1, seed=7,
                          sample_order="trainer", even_batches=(processes, per_device))
        windows = spec.epoch(0)
        assert len(windows) == spec.per_epoch == 3
        for w in windows:
            theirs = sorted(i for r in ranks for b in r[w.index * accumulation:(w.index + 1) * accumulation] for i in b)
            assert sorted(w.samples) == theirs
            assert sorted(i for m in w.micro_batches for i in m) == theirs
    held = [i for w in windows for i in w.samples]
    assert len(held) > n and set(held) == set(range(n))  # the last window repeats the epoch's first samples
    plain = WindowSpec(samples=n, micro_batch=2, accumulation=6, processes=1, seed=7, sample_order="trainer")
    assert sorted(i for w in plain.epoch(0) for i in w.samples) == list(range(n))


@pytest.mark.parametrize("extra, field", [
    (["training.even_batches=[4,2]"], "training.even_batches: 4 processes × 2 per device does not divide"),
    (["training.even_batches=[2,2]", "training.drop_last=4"], "training.even_batches: cannot be combined with "
                                                              "training.drop_last"),
    (["training.process_mean=true"], "training.process_mean: needs training.even_batches"),
    (["training.even_batches=[2,2]", "training.process_mean=true", "training.packing=true"],
     "training.process_mean: cannot be combined with training.packing")])
def test_even_batches_that_cannot_be_replayed_are_refused(trainer_example_run, tmp_path, capsys, extra, field):
    sets = [x for e in extra for x in ("--set", e)]
    code, said = cli(capsys, "run", "--recipe", trainer_example_run / "recipe.yaml", "--effective-batch-size", 12,
                     "--batch-size", 2, "--output-dir", tmp_path / "r", *sets)
    assert code == 2 and not (tmp_path / "r").exists(), said
    assert_one_error_line(said, field)


def test_a_trainer_run_with_evaluation_on_two_processes_replays_with_the_baseline_step(trainer_example_run, tmp_path,
                                                                                       capsys):
    """The HF Trainer example (its own tiny model and data, evaluation each epoch) trained on 2 processes: each epoch's
    last window repeats samples (named; replayed by --baseline-step: equivalent), and its eval loss, the mean of the
    processes' batch means, is said and not judged."""
    import subprocess

    from tests.helpers import ACCELERATE, ENV

    out = tmp_path / "baseline"
    done = subprocess.run([ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "29581",
                           str(ROOT / "examples" / "trainer-baseline" / "train_with_trainer.py"), "--out", str(out),
                           "--model", str(trainer_example_run / "tiny-llama")], capture_output=True, text=True,
                          cwd=tmp_path, env={**ENV, "ACCELERATE_USE_CPU": "1"}, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    def reproduce(name, *extra):
        code, said = cli(capsys, "reproduce", out, "--recipe", trainer_example_run / "recipe.yaml", "--batch-size", 4,
                         "-o", tmp_path / name, *extra)
        return code, said, next(line for line in said.splitlines() if line.startswith("verdict:"))

    code, said, verdict = reproduce("plain")
    assert code == 1 and "the baseline's window held samples" in verdict, verdict
    code, said, verdict = reproduce("own", "--baseline-step")
    assert code == 0 and verdict.startswith("verdict: equivalent"), said[-3000:]
    assert "info  eval loss        not judged: the Trainer's eval loss is the mean of its 2 processes' batch means" \
        in said, said


@pytest.mark.parametrize("micro", [2, 1])
def test_each_process_own_token_mean_is_replayed_with_the_baseline_step(tmp_path, capsys, micro):
    """TRL SFT on 2 processes with average_tokens_across_devices false (each process's own token mean, averaged):
    named and "differs" as the big batch's step; with --baseline-step (training.process_mean, micro-batches cut per
    baseline process) "equivalent" at any micro-batch."""
    def reproduce(name, *extra):
        code, said = cli(capsys, "reproduce", TWO.parent / "sft-process-mean", "--model", LF / "model", "--data",
                         LF / "data" / "chat.jsonl", "--batch-size", micro, "-o", tmp_path / name, "--set",
                         "model.generate_prompts=0", *extra)
        return code, said, next(line for line in said.splitlines() if line.startswith("verdict:"))

    code, said, verdict = reproduce("plain")
    assert code == 1 and verdict.startswith("verdict: differs") and "average_tokens_across_devices=False" in verdict
    code, said, verdict = reproduce("own", "--baseline-step")
    assert "training.process_mean                 True" in said, said
    assert code == 0 and verdict.startswith("verdict: equivalent"), said[-3000:]


def test_process_mean_weighs_each_share_by_its_own_items():
    """The weights training.process_mean gives: a share of 1 item beside a share of 3 weighs its item 1/2, each of
    the other's 1/6 (the mean of the two means); without it every item 1/4."""
    from types import SimpleNamespace

    from finetune.steps import count_window

    accelerator = SimpleNamespace(num_processes=1)
    window = SimpleNamespace(active=(True, True), token_counts=((1, 1), (3, 3)), groups=(0, 1), group_count=2)
    counts, shares, items, _, _ = count_window(accelerator, window, [[0], [1, 2, 3]], len)
    assert counts == [1, 3] and items == 4 and [c / s for c, s in zip(counts, shares)] == [0.5, 0.5]
    plain = SimpleNamespace(active=(True, True), token_counts=((1, 1), (3, 3)), groups=None, group_count=0)
    counts, shares, _, _, _ = count_window(accelerator, plain, [[0], [1, 2, 3]], len)
    assert [c / s for c, s in zip(counts, shares)] == [0.25, 0.75]


def test_an_engine_from_accelerate_s_launch_config_is_said(trainer_example_run, tmp_path, capsys):
    """A run launched with accelerate's DeepSpeed config leaves no deepspeed argument, only its state: the engine is
    still said beside the batch; a plain data-parallel run says none (the control)."""
    for kind, said_of in (("DEEPSPEED", "under DeepSpeed (accelerate's launch config"), ("MULTI_GPU", None)):
        saved_on(tmp_path / f"{kind}.bin", torch.device("cuda", 1), 4, kind)
        code, said = cli(capsys, "import", tmp_path / f"{kind}.bin", "--recipe", trainer_example_run / "recipe.yaml",
                         "-o", tmp_path / f"{kind}.yaml")
        row = next(line for line in said.splitlines() if line.startswith("training.effective_batch_size"))
        assert code == 0 and "× 4 processes" in row, said
        assert (said_of in row) if said_of else ("under " not in row), row


def test_what_a_data_parallel_run_reduced_otherwise_is_named(trainer_example_run, tmp_path, capsys):
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
                                "learning_rate": 1e-3, "seed": 3, "average_tokens_across_devices": False,
                                "deepspeed": {"zero_optimization": {"stage": 2}, "communication_data_type": "bf16"}}))
    code, said = cli(capsys, "import", args, "--recipe", trainer_example_run / "recipe.yaml", "-o",
                     tmp_path / "r.yaml", "--processes", 2)
    assert code == 0, said
    assert "not carried: average_tokens_across_devices=False — each process divided its loss" in said, said
    assert "not carried: deepspeed communication_data_type=bf16" in said, said
    code, said = cli(capsys, "import", args, "--recipe", trainer_example_run / "recipe.yaml", "-o",
                     tmp_path / "s.yaml")  # one process: its own mean is the batch's
    assert code == 0 and "average_tokens_across_devices" not in said, said
