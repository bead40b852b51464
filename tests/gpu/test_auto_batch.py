"""``batch_size: auto`` against a real out-of-memory error: the device capped with
``torch.cuda.set_per_process_memory_fraction``, the loop must settle on the largest micro-batch that fits and still
take exactly the steps of the effective batch."""

from __future__ import annotations

import copy
import re

import torch
from accelerate.utils import set_seed

from finetune.config import TrainingConfig
from finetune.job import Job
from tests.gpu.common import GPU, causal_lm_collate, causal_lm_data, flat, gpt2, rel_diff, release, train_and_measure
from tests.helpers import train_quietly

pytestmark = GPU

EFFECTIVE = 32
LENGTH, VOCAB = 512, 8192
SGD = dict(optimizer="sgd", learning_rate=0.1, max_grad_norm=None)


def run(model, data, batch_size):
    """One epoch of 64 samples in windows of 32 (two optimizer steps); ``batch_size`` a number or "auto"."""
    t = TrainingConfig(batch_size=batch_size, effective_batch_size=EFFECTIVE, seed=5, **SGD)
    set_seed(t.seed)
    return train_quietly(Job(model=model, train_data=data, collate_fn=causal_lm_collate), t)


def fits(model, data, batch_size) -> bool:
    """Whether an explicit micro-batch trains under the cap (an out-of-memory error is the answer no)."""
    try:
        run(model, data, batch_size)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        release()


def test_auto_micro_batch_under_a_real_memory_cap(figures, clean_cuda, capsys):
    """Cap the process at the midpoint between the measured needs of micro-batches 4 and 8 (a GPT-2 at 512 tokens,
    ~100 MiB of activations a sample). ``auto`` starts from the planner's prediction under the cap and shrinks
    through the window's divisors on each real out-of-memory error; the micro-batch it keeps must be the largest
    that fits — the next divisor up, given explicitly, runs out of memory under the same cap — and its run must
    equal the run with that micro-batch given explicitly: the same windows (hashes) and the same weights (≤ 1e-5,
    fp32)."""
    model = gpt2(n_layer=4, vocab=VOCAB, positions=LENGTH)
    data = causal_lm_data(2 * EFFECTIVE, LENGTH, VOCAB)
    need = {b: train_and_measure(copy.deepcopy(model), data, causal_lm_collate, b, EFFECTIVE // b,
                                 **SGD)[0] for b in (4, 8)}
    release()
    total = torch.cuda.get_device_properties(0).total_memory
    cap = torch.cuda.memory_reserved() + (need[4] + need[8]) // 2
    capsys.readouterr()
    torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0))
    try:
        auto = run(copy.deepcopy(model), data, "auto")
        kept = auto.history[-1]["micro_batch_size"]
        printed = capsys.readouterr().out
        tries = re.findall(r"out of memory at micro-batch (\d+):", printed)
        planned = re.search(r"batch_size auto: micro-batch (\d+) ×", printed)
        release()
        explicit = run(copy.deepcopy(model), data, kept)
        release()
        bigger = min(d for d in range(kept + 1, EFFECTIVE + 1) if EFFECTIVE % d == 0) if kept < EFFECTIVE else None
        bigger_fits = fits(copy.deepcopy(model), data, bigger) if bigger else None
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    figures("need 4 / 8", f"{need[4] / 2 ** 20:.0f} / {need[8] / 2 ** 20:.0f} MiB")
    figures("cap", f"{cap / 2 ** 20:.0f} MiB")
    figures("planned, tried", " → ".join([planned.group(1) if planned else "?", *tries, str(kept)]))
    figures("next divisor up", f"{bigger} {'fits' if bigger_fits else 'runs out of memory'}")
    weights = rel_diff(flat(auto.model), flat(explicit.model))
    figures("weights vs explicit", weights, "≤ 1e-05")

    assert 1 < kept < EFFECTIVE, f"the cap did not bite (kept {kept}): the calibration above is off"
    assert planned, "batch_size auto printed no planned micro-batch"
    assert int(planned.group(1)) >= kept and (tries or int(planned.group(1)) == kept)  # shrunk only on a real OOM
    assert bigger_fits is False, f"micro-batch {bigger} fits under the cap: auto stopped too small at {kept}"
    assert all(h["micro_batch_size"] == kept for h in auto.history)
    assert auto.effective_batch_size == explicit.effective_batch_size == EFFECTIVE
    assert auto.optimizer_steps == explicit.optimizer_steps == 2
    assert [h["samples"] for h in auto.history] == [EFFECTIVE, EFFECTIVE]
    assert [h["window_hash"] for h in auto.history] == [h["window_hash"] for h in explicit.history]
    assert weights <= 1e-5, weights
