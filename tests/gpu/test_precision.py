"""fp16, bf16 and fp32 on CUDA: an overflowing fp16 window is skipped without moving the schedule, and (b, N) takes
the steps of (b·N, 1) within what each precision's rounding allows.

Tolerances, as max |w_(b,N) − w_(b·N,1)| / max |w_(b·N,1) − w_0| (the distance between the two runs as a share of
the update; a precision's rounding sets its size, whatever the size of the weights):

* fp32: ≤ 1e-5 of the weights (max |Δw| / max |w|), as on the CPU — both runs do the same sums in another grouping.
* fp16 autocast: ≤ 1e-2 of the update. The matmuls round to 11 bits (unit roundoff u = 2^-11 ≈ 4.9e-4), and each
  micro-batch's weight gradient leaves its fp16 matmul rounded before it is accumulated in fp32; the two runs group
  the samples differently, so their gradients differ by a few u. Measured with CPU fp16 autocast: 1.2–1.4 u. The
  bound is 20 u.
* bf16 autocast: ≤ 5e-2 of the update: 8 bits (u = 2^-8 ≈ 3.9e-3); measured with CPU bf16 autocast: 0.7–1.5 u;
  the bound is 13 u.

Each case also runs the mis-weighting the loop avoids (equal weights per micro-batch for the MLP, per-sample
weights of a token loss for GPT-2: 13 % and 92 % of the update on the CPU) and checks it lands outside the bound —
the bound is tight enough to catch a wrong step, not only a crash.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from finetune.config import TrainingConfig
from finetune.distributed import LossScale, make_accelerator
from finetune.job import Job
from tests.gpu.common import GPU, flat, rel_diff, update_share
from tests.helpers import MLP, pad_collate, regression_data, tiny_gpt2, token_data, train_quietly

pytestmark = GPU

INIT_SCALE = 2.0 ** 10  # fp16 loss scale: small enough that no ordinary window of these models overflows
TOLERANCE = {"no": 1e-5, "fp16": 1e-2, "bf16": 5e-2}


def accelerator_for(precision: str) -> Accelerator:
    """The Accelerator finetune makes; fp16's GradScaler starting at ``INIT_SCALE`` rather than 65 536, so that which
    windows overflow is decided by the test alone."""
    return make_accelerator(precision, loss_scale=LossScale(INIT_SCALE))


def train(model, data, b: int, n: int, precision: str, collate=None, count_items=None, before_window=None,
          after_step=None, accelerator=None, **training):
    """The loop on ``b`` × ``n`` windows: SGD at a constant lr without clipping, two epochs, unless ``training``
    says otherwise."""
    t = TrainingConfig(batch_size=b, gradient_accumulation_steps=n, mixed_precision=precision, **{
        "optimizer": "sgd", "learning_rate": 0.2, "max_grad_norm": None, "epochs": 2, "seed": 3,
        "lr_scheduler": "constant", **training})
    set_seed(t.seed)
    job = Job(model=model, train_data=data, collate_fn=collate, count_items=count_items,
              before_window=before_window, after_step=after_step)
    return train_quietly(job, t, accelerator=accelerator or accelerator_for(precision))


class Overflowing(MLP):
    """The MLP, its loss multiplied by ``factor`` (set per window): at 1e12 the loss is finite in fp32, but its
    gradient overflows fp16 (max 65 504) where it enters the fp16 layers."""

    factor = 1.0

    def forward(self, x, y):
        return {"loss": super().forward(x, y)["loss"] * self.factor}


def test_fp16_overflow_is_skipped_and_the_schedule_waits(figures):
    """The third window's gradient overflows: the GradScaler skips its update and halves its scale, the scheduler
    does not advance (the fourth step runs at the third's lr), the history says ``skipped``, and the fourth window
    trains."""
    poisoned = 2  # windows before it: the third optimizer step overflows
    torch.manual_seed(0)
    model = Overflowing()
    weights, scales = [], []
    accelerator = accelerator_for("fp16")

    def before_window(state):
        model.factor = 1e12 if state.optimizer_step == poisoned else 1.0

    def after_step(state, unwrapped):
        weights.append(flat(unwrapped))
        scales.append(accelerator.scaler.get_scale())

    result = train(model, regression_data(48), 4, 2, "fp16", before_window=before_window, after_step=after_step,
                   accelerator=accelerator, learning_rate=0.05, lr_scheduler="linear", max_grad_norm=1.0,
                   shuffle=False, epochs=1)
    history = result.history
    skipped = [h["skipped"] for h in history]
    total = result.total_steps
    expected_lr = [0.05 * (1 - k / total) for k in (0, 1, 2, 2, 3, 4)]  # the skipped step does not count
    figures("skipped", "".join("S" if s else "." for s in skipped))
    figures("lr", " ".join(f"{h['lr']:.4f}" for h in history))
    figures("scale", f"{scales[poisoned - 1]:g} → {scales[poisoned]:g}")
    figures("poisoned loss", f"{history[poisoned]['loss']:.2g} (finite: the overflow is fp16's)")

    assert total == 6 and skipped == [False, False, True, False, False, False], skipped
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6]  # a skipped window is still a step of the run
    assert result.lr_history == pytest.approx(expected_lr, rel=1e-12)
    assert math.isfinite(history[poisoned]["loss"]) and not math.isfinite(history[poisoned]["grad_norm"])
    assert scales[:poisoned] == [INIT_SCALE] * poisoned and scales[poisoned] == INIT_SCALE / 2
    assert torch.equal(weights[poisoned], weights[poisoned - 1])  # no update from the overflowing window
    assert not torch.equal(weights[poisoned + 1], weights[poisoned])  # the next window trains
    assert all(torch.isfinite(w).all() for w in weights)
    assert all(math.isfinite(h["grad_norm"]) for i, h in enumerate(history) if i != poisoned)


def _mlp_case():
    torch.manual_seed(0)
    # 41 samples in windows of 12: each epoch ends with a window of 5 = a micro-batch of 3 and a short one of 2
    return MLP(), regression_data(41), None, 3, 4, {"count_items": lambda batch: 1}


def _gpt2_case():
    # padded sequences of 2–12 tokens: micro-batches hold different numbers of label tokens
    return tiny_gpt2(), token_data(29), pad_collate, 2, 3, {"items": "samples"}


CASES = {"mlp": _mlp_case, "gpt2": _gpt2_case}


@pytest.mark.parametrize("precision", ["no", "fp16", "bf16"], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_accumulation_matches_the_big_batch(case, precision, figures, ieee_fp32):
    """(b, N) and (b·N, 1) on CUDA, two epochs with a short last window (and short micro-batches), SGD without
    clipping so that any mis-weighting shows; the mis-weighted control must miss by more than the bound."""
    if precision == "bf16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip(f"{torch.cuda.get_device_name()} has no bf16 (compute capability < 8.0)")
    model, data, collate, b, n, wrong = CASES[case]()
    start = flat(model)
    small = train(copy.deepcopy(model), data, b, n, precision, collate)
    big = train(copy.deepcopy(model), data, b * n, 1, precision, collate)
    control = train(copy.deepcopy(model), data, b, n, precision, collate,
                    count_items=wrong.get("count_items"), items=wrong.get("items", "auto"))
    w_small, w_big, w_control = flat(small.model), flat(big.model), flat(control.model)
    share, control_share = update_share(w_small, w_big, start), update_share(w_control, w_big, start)
    weights = rel_diff(w_small, w_big)
    tol = TOLERANCE[precision]
    if precision == "no":
        figures("weights", weights, f"≤ {tol:g}")
        figures("of the update", share)
    else:
        figures("of the update", share, f"≤ {tol:g}")
    figures("mis-weighted control", control_share)

    assert small.optimizer_steps == big.optimizer_steps == control.optimizer_steps
    assert small.skipped_steps == big.skipped_steps == 0  # an fp16 skip in one run only would be no comparison
    assert [h["window_hash"] for h in small.history] == [h["window_hash"] for h in big.history]
    assert small.model.training and next(small.model.parameters()).is_cuda
    if precision == "no":
        assert weights <= tol, weights
    else:
        assert share <= tol, share
    assert control_share > (1e-3 if precision == "no" else tol), control_share
