"""GRPO under accumulation: how far each tool's (b, N) lands from its own (b·N, 1), TRL's GRPOTrainer beside finetune.

Both tools train on the same fixed rollouts, so that only the loss's normalisation differs: arithmetic prompts of the
``sums`` source (those of one token length: no prompt is padded), ``num_generations`` completions each, sampled once
from the initial model at temperature 1 and cut to uneven lengths (some end with the end token, some run to
``max_completion_length``), scored by a fixed hash of their tokens. TRL gets them from a ``rollout_func`` that returns
the recorded completions in place of generating, and scores them itself; finetune replays them from a
``rollouts.jsonl`` (``model.rollouts``) holding the same completions, their rewards, group-normalised advantages
and the initial model's log-probs. Full fine-tuning of the same weights, SGD at a constant learning rate, no clipping,
no dropout, β = 0, one iteration, temperature 1, ε = 0.2, the prompts in the same order on both sides, and TRL's
in-batch shuffle of a generation batch off (the micro-batches then hold the same completions in both tools).

Two cases, each a single generation batch:

* ``steps_per_generation = N``: one optimizer step of b·N completions;
* ``steps_per_generation ≠ N``: a generation batch of 2·b·N completions for two optimizer steps (the second starts
  from the first's weights, its ratios against the generation-time log-probs). TRL counts ``steps_per_generation``
  in micro-batches (its ``generation_batch_size`` fixes the batch: 2N at (b, N), 2 at (b·N, 1)); both tools are given
  the batch as ``generation_batch_size`` = 2·b·N completions.

Reported per loss type (grpo, bnpo, dr_grpo, dapo) and tool: max |Δ(b, N) − Δ(b·N, 1)| / max |Δ(b·N, 1)| over all
weights (Δ: the change from the initial weights); beside them, how far TRL's big-batch step is from finetune's
(the same measure, TRL's Δ(b·N, 1) against finetune's): whether the two tools take the same step at N = 1. Then
tokens/s (prompt + completion tokens trained, over the wall time of the training call, the median over the runs of
the second case) and the peak of tensor memory during training (one profiled run each,
``finetune.memory.measure.PeakMeter``), as ratios finetune ÷ TRL.

    pip install --no-deps trl==1.16.0      # TRL is not a dependency of finetune
    HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/grpo_trl.py [--b 2 --n 4 --group 4 --max-len 10] [--tiny]

``--tiny``: a 2-layer Llama (hidden 72) with SmolLM2's vocabulary and tokenizer instead of SmolLM2 itself.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.16

import torch  # noqa: E402

from benchmarks.common import emit_json, machine, median, quiet, smollm2_path, table, update_diff  # noqa: E402

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
CASES = {"spg = N": 1, "spg ≠ N": 2}  # case → optimizer steps in its one generation batch
SEED = 42  # finetune's training.seed: it fixes the order of the prompts (the task shuffles them per epoch)
MB = 2 ** 20


def reward(completion_ids, **_) -> list:
    """A fixed hash of each completion's tokens in [0, 1): deterministic, so both tools score alike, and varied
    within every group (a reward a tiny random model could earn would be 0 everywhere, and so every advantage)."""
    return [(sum(ids) * 2654435761 % 1000) / 1000 for ids in completion_ids]


def weights(model) -> dict:
    return {k: p.detach().double().clone() for k, p in model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------------------------------------------------------
# the fixed rollouts


def prompt_rows(tokenizer, count: int) -> list:
    """``count`` rows of the sums source whose chat-formatted prompts have one token length (the most common): TRL
    left-pads prompts without shifting positions, finetune right-pads, so only equal lengths give both the same
    forward."""
    from finetune.tasks import grpo

    rows = grpo.sums(200)
    length = [len(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"]) for r in rows]
    common = collections.Counter(length).most_common(1)[0][0]
    return [r for r, n in zip(rows, length) if n == common][:count]


@torch.no_grad()
def record(model, tokenizer, prompt_ids: list, group: int, max_len: int) -> dict:
    """The generation batch as finetune's ``rollouts.jsonl`` holds it, for prompts ``prompt_ids`` (in order):
    ``group`` completions each, sampled at temperature 1, each cut to a length drawn from 2..max_len (ending with the
    end token when shorter), their rewards, advantages and old log-probs under ``model``."""
    from finetune.tasks import grpo

    eos = tokenizer.eos_token_id
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    completions = []
    for ids in prompt_ids:
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_len,
                             min_new_tokens=max_len, num_return_sequences=group, pad_token_id=eos)
        for row in out[:, len(ids):].tolist():
            cut = int(torch.randint(2, max_len + 1, (1,), generator=g))
            completions.append(row[:cut] if cut == max_len else row[:cut - 1] + [eos])
    rewards = reward(completions)
    adv = grpo.advantages(torch.tensor(rewards, dtype=torch.float64), group, "group")
    full = [ids for ids in prompt_ids for _ in range(group)]
    old = grpo.token_log_probs(model, [torch.tensor(p + c) for p, c in zip(full, completions)],
                               [len(p) for p in full], 1.0, torch.device("cpu"))
    return {"completions": completions, "rewards": rewards, "advantages": adv.tolist(),
            "old_log_probs": [o.tolist() for o in old]}


# ---------------------------------------------------------------------------------------------------------------
# TRL


def run_trl(path: str, rows: list, prompt_ids: list, completions: list, loss_type: str, b: int, n: int,
            steps: int, group: int, max_len: int, lr: float, out: Path, meter=None) -> tuple:
    """TRL's GRPOTrainer on the fixed completions; (start weights, trained weights, seconds)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import grpo_trainer

    ids_of, queue = {}, {}  # prompt → its token ids; → its completions, in recorded order
    for i, (row, ids) in enumerate(zip(rows, prompt_ids)):
        ids_of[json.dumps(row["prompt"])] = ids
        queue[json.dumps(row["prompt"])] = collections.deque(completions[i * group:(i + 1) * group])

    def fixed_rollouts(prompts, trainer):  # TRL's hook for a custom generator: the recorded completions instead
        keys = [json.dumps(p) for p in prompts]
        return {"prompt_ids": [ids_of[k] for k in keys], "completion_ids": [queue[k].popleft() for k in keys],
                "logprobs": None}

    torch.manual_seed(0)
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=b, gradient_accumulation_steps=n,
                      generation_batch_size=steps * b * n, num_generations=group, max_completion_length=max_len,
                      learning_rate=lr, optim="sgd", lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
                      num_train_epochs=1, beta=0.0, num_iterations=1, temperature=1.0, epsilon=0.2,
                      loss_type=loss_type, scale_rewards="group", shuffle_dataset=False, report_to=[],
                      save_strategy="no", logging_steps=1, seed=0, use_cpu=True, disable_tqdm=True, bf16=False,
                      fp16=False)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                          reward_funcs=[reward], args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=AutoTokenizer.from_pretrained(path), rollout_func=fixed_rollouts)
    start = weights(trainer.model)
    # TRL shuffles a generation batch's completions before cutting it into micro-batches; kept in order, both
    # tools' micro-batches hold the same completions
    with mock.patch.object(grpo_trainer, "shuffle_sequence_dict", lambda batch: batch):
        began = time.perf_counter()
        with meter or contextlib.nullcontext():
            trainer.train()
        seconds = time.perf_counter() - began
    assert trainer.state.global_step == steps, f"TRL took {trainer.state.global_step} steps, not {steps}"
    assert not any(queue.values()), "TRL left recorded completions unused"
    shutil.rmtree(out, ignore_errors=True)
    return start, weights(trainer.model), seconds


# ---------------------------------------------------------------------------------------------------------------
# finetune


def run_finetune(path: str, data_file: Path, rollouts: Path, loss_type: str, b: int, n: int, steps: int,
                 group: int, max_len: int, lr: float, meter=None) -> tuple:
    """The grpo task through finetune's loop, replaying ``rollouts``; (start weights, trained weights, seconds)."""
    from finetune import loop, startup

    cfg = finetune_config(path, data_file, rollouts, loss_type, b, n, steps, group, max_len, lr)
    job = startup.build_job(cfg)  # seeded, as a run builds it
    start = weights(job.model)
    began = time.perf_counter()
    with meter or contextlib.nullcontext():
        result = startup.train_job(job, cfg.training, loop.Reporting(banner=False))
    seconds = time.perf_counter() - began
    assert result.optimizer_steps == steps, f"finetune took {result.optimizer_steps} steps, not {steps}"
    return start, weights(result.model), seconds


def finetune_config(path: str, data_file: Path, rollouts, loss_type: str, b: int, n: int, steps: int,
                    group: int, max_len: int, lr: float):
    from finetune.loading import load_recipe

    return load_recipe("grpo-smollm2", [
        f"model.name_or_path={path}", f"data.source={data_file}", "data.val_fraction=0", "data.limit=null",
        "data.system_prompt=null", "model.dropout=0", "peft.enabled=false", f"model.num_generations={group}",
        f"model.generation_batch_size={steps * b * n}", "model.num_iterations=1",
        "model.temperature=1.0", f"model.max_completion_length={max_len}", "model.epsilon=0.2", "model.beta=0",
        f"model.loss_type={loss_type}", "model.scale_rewards=group", f"training.batch_size={b}",
        f"training.gradient_accumulation_steps={n}", "training.effective_batch_size=null", "training.optimizer=sgd",
        f"training.learning_rate={lr}", "training.lr_scheduler=constant", "training.warmup_steps=0",
        "training.max_grad_norm=null", "training.eval_at_start=false", "training.shuffle=false",
        f"training.seed={SEED}", *([f"model.rollouts={rollouts}"] if rollouts else [])])


# ---------------------------------------------------------------------------------------------------------------
# the measurement


def prepare(path: str, folder: Path, b: int, n: int, group: int, max_len: int) -> dict:
    """Per case: the prompt rows in the order both tools train them, their token ids, the data file and the
    rollouts file finetune replays, and the tokens a run trains on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.tasks import grpo

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    per_step = b * n // group
    cases = {}
    for case, steps in CASES.items():
        rows = prompt_rows(tokenizer, per_step * steps)
        data_file = folder / f"prompts-{steps}.jsonl"
        data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = finetune_config(path, data_file, None, "dapo", b, n, steps, group, max_len, 0.0)
        order = grpo_order(len(rows), SEED)  # the order finetune's task trains the prompts in
        prompt_ids = [grpo.prompt_ids(tokenizer, rows[i]["prompt"], cfg.data.system_prompt) for i in order]
        rec = record(model, tokenizer, prompt_ids, group, max_len)
        rollouts = folder / f"rollouts-{steps}.jsonl"
        rollouts.write_text(json.dumps({"epoch": 0, "batch": 0, "prompts": order, **rec}) + "\n")
        tokens = sum(len(p) * group for p in prompt_ids) + sum(len(c) for c in rec["completions"])
        cases[case] = {"steps": steps, "rows": [rows[i] for i in order], "prompt_ids": prompt_ids,
                       "completions": rec["completions"], "data_file": data_file, "rollouts": rollouts,
                       "tokens": tokens, "lengths": [len(c) for c in rec["completions"]]}
    return cases


def grpo_order(n: int, seed: int) -> list:
    """The order finetune's grpo task trains ``n`` prompts in, in epoch 0."""
    from finetune.seeding import permutation

    return permutation(n, seed, 0)


def measure(path: str, folder: Path, b: int, n: int, group: int, max_len: int, lr: float,
            loss_types=LOSS_TYPES, case_names=tuple(CASES), memory: bool = True, log=print) -> dict:
    """Train every (tool, case, loss type) at (b, N) and (b·N, 1); returns the errors, tokens/s and peaks."""
    cases = prepare(path, folder, b, n, group, max_len)
    tools = {
        "TRL GRPOTrainer": lambda c, loss, b, n, meter=None: run_trl(
            path, c["rows"], c["prompt_ids"], c["completions"], loss, b, n, c["steps"], group, max_len, lr,
            folder / "trl", meter),
        "finetune": lambda c, loss, b, n, meter=None: run_finetune(
            path, c["data_file"], c["rollouts"], loss, b, n, c["steps"], group, max_len, lr, meter),
    }
    errors, speed, big_steps = {}, collections.defaultdict(list), {}
    for case in case_names:
        c = cases[case]
        for loss in loss_types:
            for name, run in tools.items():
                with quiet():
                    start, small, s_small = run(c, loss, b, n)
                    start_big, one, s_big = run(c, loss, b * n, 1)
                assert all(torch.equal(start[k], start_big[k]) for k in start), f"{name}: other initial weights"
                errors[(case, loss, name)] = update_diff(small, one, start)
                big_steps[name] = (start, one)
                if case == case_names[-1]:
                    speed[name] += [c["tokens"] / s_small, c["tokens"] / s_big]
                log(f"{case}, {loss}, {name}: {errors[(case, loss, name)]:.1e} "
                    f"(max |Δ| {float(max((one[k] - start[k]).abs().max() for k in start)):.1e}; "
                    f"{s_small:.1f} s / {s_big:.1f} s)")
            (start, trl_one), (_, ours_one) = big_steps["TRL GRPOTrainer"], big_steps["finetune"]
            errors[(case, loss, "TRL vs finetune at (b·N, 1)")] = update_diff(trl_one, ours_one, start)
    peaks = {}
    if memory:
        from finetune.memory.measure import PeakMeter

        c = cases[case_names[-1]]
        for name, run in tools.items():
            meter = PeakMeter("cpu")
            with quiet():
                run(c, loss_types[-1], b, n, meter)
            peaks[name] = meter.peak
    return {"errors": errors, "tokens_per_s": {k: median(v) for k, v in speed.items()}, "peak_bytes": peaks,
            "lengths": {case: cases[case]["lengths"] for case in case_names}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--b", type=int, default=2, help="completions per micro-batch")
    parser.add_argument("--n", type=int, default=2, help="accumulation steps")
    parser.add_argument("--group", type=int, default=2, help="num_generations")
    parser.add_argument("--max-len", type=int, default=8, help="max_completion_length")
    parser.add_argument("--lr", type=float, default=None, help="SGD learning rate (default: 0.01, --tiny 0.1)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer Llama with SmolLM2's vocabulary")
    a = parser.parse_args(argv)
    try:
        import trl
    except ImportError:
        sys.exit("error: trl: not installed; pip install --no-deps trl==1.16.0")
    if (a.b * a.n) % a.group:
        sys.exit(f"error: --group {a.group} must divide b·N = {a.b * a.n}")
    lr = a.lr or (0.1 if a.tiny else 0.01)
    print(f"machine: {machine()}; trl {trl.__version__}")
    print(f"model: {'tiny 2-layer Llama' if a.tiny else 'SmolLM2-135M-Instruct'}, full fine-tuning; (b, N) = "
          f"({a.b}, {a.n}) against ({a.b * a.n}, 1); {a.group} completions per prompt, up to {a.max_len} tokens; "
          f"SGD lr {lr}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        res = measure(smollm2_path(a.tiny, Path(tmp)), Path(tmp), a.b, a.n, a.group, a.max_len, lr)
    e = res["errors"]
    print()
    for case, lengths in res["lengths"].items():
        print(f"{case}: completion lengths {lengths}")
    print()
    print(table(["loss type", *(f"{tool}, {case}" for case in CASES for tool in ("TRL", "finetune")),
                 *(f"TRL vs finetune at (b·N, 1), {case}" for case in CASES)],
                [[loss, *(f"{e[(case, loss, tool)]:.1e}" for case in CASES for tool in ("TRL GRPOTrainer", "finetune")),
                  *(f"{e[(case, loss, 'TRL vs finetune at (b·N, 1)')]:.1e}" for case in CASES)]
                 for loss in LOSS_TYPES]))
    tps, peak = res["tokens_per_s"], res["peak_bytes"]
    print()
    print(table(["tool", "tokens/s (wall)", "peak tensor MB in training"],
                [["TRL GRPOTrainer", f"{tps['TRL GRPOTrainer']:.0f}", f"{peak['TRL GRPOTrainer'] / MB:.0f}"],
                 ["finetune", f"{tps['finetune']:.0f}", f"{peak['finetune'] / MB:.0f}"],
                 ["finetune ÷ TRL", f"{tps['finetune'] / tps['TRL GRPOTrainer']:.2f}",
                  f"{peak['finetune'] / peak['TRL GRPOTrainer']:.2f}"]]))
    out = {"benchmark": "grpo_trl", "tiny": a.tiny, "b": a.b, "n": a.n, "group": a.group, "max_len": a.max_len,
           "lr": lr, "errors": {" | ".join(k): v for k, v in e.items()}, "tokens_per_s": tps,
           "peak_mb": {k: v / MB for k, v in peak.items()}}
    emit_json(out)
    return out


if __name__ == "__main__":
    main()
