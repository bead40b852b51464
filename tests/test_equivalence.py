"""(b, N) and (b·N, 1) take the same optimizer steps: same weights, same grad norms, over epochs with tails."""

import math

import pytest
import torch

from finetune import test_fine_tuning
from tests.helpers import MLP, copy_model, pad_collate, regression_data, rel_diff, tiny_gpt2, token_data

SGD = dict(optimizer="sgd", learning_rate=0.2, max_grad_norm=None, n_epochs=2, seed=3)


def run(model, data, b, n, **kw):
    return test_fine_tuning(copy_model(model), train_data=data, batch_size=b, gradient_accumulation_steps=n,
                            **{**SGD, **kw})


# 41 samples: windows of 12 leave a 5-sample tail window = a full micro-batch of 3 + a short one of 2.
@pytest.mark.parametrize("b,n", [(3, 4), (2, 6), (5, 2), (1, 12)])
def test_sample_loss_tail_window_and_short_micro_batch(b, n):
    torch.manual_seed(0)
    model, data = MLP(), regression_data(41)
    small = run(model, data, b, n)
    big = run(model, data, b * n, 1)
    assert small["optimizer_steps"] == big["optimizer_steps"] == 2 * math.ceil(41 / (b * n))
    assert rel_diff(small["model"], big["model"]) <= 1e-5
    assert small["grad_norm_history"] == pytest.approx(big["grad_norm_history"], rel=1e-5)
    assert small["loss_history"] == pytest.approx(big["loss_history"], rel=1e-5)
    assert small["lr_history"] == big["lr_history"]


def test_equal_micro_batch_weights_would_not_match():
    """The check above can fail: weighting every micro-batch equally (Trainer's ÷ micro-batches) drifts."""
    torch.manual_seed(0)
    model, data = MLP(), regression_data(41)
    naive = run(model, data, 3, 4, count_items=lambda batch: 1)
    big = run(model, data, 12, 1)
    assert rel_diff(naive["model"], big["model"]) > 1e-3


def test_causal_lm_padded_tokens():
    """Token-level loss with padded labels: the window's gradient is the mean over its real, shifted tokens."""
    model, data = tiny_gpt2(), token_data(29)
    small = run(model, data, 2, 3, collate_fn=pad_collate, learning_rate=0.5)
    big = run(model, data, 6, 1, collate_fn=pad_collate, learning_rate=0.5)
    assert rel_diff(small["model"], big["model"]) <= 1e-5
    assert small["grad_norm_history"] == pytest.approx(big["grad_norm_history"], rel=1e-5)
    # the window's item count is the shifted count of real tokens
    n_items = sum(len(s["input_ids"]) - 1 for s in data)
    assert sum(h["items"] for h in small["history"]) == 2 * n_items

    per_sample = run(model, data, 2, 3, collate_fn=pad_collate, learning_rate=0.5, items="samples")
    assert rel_diff(per_sample["model"], big["model"]) > 1e-4  # sample weighting is measurably wrong here


def test_token_classification_unshifted_tokens():
    """A non-causal token-level loss (BERT token classification) counts unshifted label tokens."""
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, num_labels=3)
    model = BertForTokenClassification(cfg)

    def collate(samples):
        batch = pad_collate(samples)
        batch["labels"] = torch.where(batch["labels"] == -100, -100, batch["input_ids"] % 3)
        return batch

    data = token_data(23, seed=2)
    small = run(model, data, 2, 2, collate_fn=collate)
    big = run(model, data, 4, 1, collate_fn=collate)
    assert rel_diff(small["model"], big["model"]) <= 1e-5
    assert sum(h["items"] for h in small["history"]) == 2 * sum(len(s["input_ids"]) for s in data)


def test_micro_batch_without_items_adds_nothing():
    """A micro-batch whose labels are all ignored (one-token rows: nothing to predict) adds exact zeros."""
    model = tiny_gpt2()
    data = [{"input_ids": torch.tensor([5])}] * 2 + token_data(6, lo=4, hi=8, seed=4)
    small = run(model, data, 2, 4, collate_fn=pad_collate, shuffle=False, n_epochs=1)
    big = run(model, data, 8, 1, collate_fn=pad_collate, shuffle=False, n_epochs=1)
    assert math.isfinite(small["grad_norm_history"][0])
    assert rel_diff(small["model"], big["model"]) <= 1e-5


def test_gradient_checkpointing_gives_the_same_steps():
    model, data = tiny_gpt2(), token_data(20)
    plain = run(model, data, 4, 2, collate_fn=pad_collate, n_epochs=1)
    ckpt = run(model, data, 4, 2, collate_fn=pad_collate, n_epochs=1, gradient_checkpointing=True)
    assert ckpt["model"].transformer.gradient_checkpointing
    assert rel_diff(ckpt["model"], plain["model"]) <= 1e-6


class TwoPart(torch.nn.Module):
    """Two parameter sets with their own optimizers; the second's loss reads the first's output detached."""

    def __init__(self):
        super().__init__()
        self.first = MLP()
        self.second = torch.nn.Linear(6, 1)
        self.weight = 1.0  # set by before_window from the optimizer step

    def forward(self, x, y):
        a = self.first(x, y)["loss"]
        b = torch.nn.functional.mse_loss(self.second(x).squeeze(-1), y - self.first.net(x).squeeze(-1).detach())
        return {"loss": a + self.weight * b, "second": b}


def test_two_optimizers_and_a_step_keyed_schedule():
    torch.manual_seed(0)
    model, data = TwoPart(), regression_data(41)
    weights = {}

    def run_two(b, n):
        m = copy_model(model)

        def before(state):  # a warm-up keyed on optimizer steps, as a KL or R1 schedule would be
            m.weight = min(1.0, (state.optimizer_step + 1) / 4)
            weights.setdefault((b, n), []).append(m.weight)

        groups = {"first": {"params": m.first.parameters()},
                  "second": {"params": m.second.parameters(), "learning_rate": 0.05, "max_grad_norm": 0.5}}
        return run(m, data, b, n, param_groups=groups, before_window=before, learning_rate=0.2)

    small, big = run_two(3, 4), run_two(12, 1)
    assert rel_diff(small["model"], big["model"]) <= 1e-5
    assert weights[(3, 4)] == weights[(12, 1)]  # the same schedule whatever N
    h = small["history"][0]
    assert {"grad_norm_second", "lr_second", "second"} <= set(h) and h["lr_second"] == 0.05
    assert [x["grad_norm_second"] for x in small["history"]] == pytest.approx(
        [x["grad_norm_second"] for x in big["history"]], rel=1e-5)
