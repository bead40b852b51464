"""Dropout keyed by sample (finetune/models/dropout.py; docs/exact-steps.md#dropout): each sample's mask drawn from
the run's seed, its epoch, the sample and the layer, so the layouts of a run with dropout on take the same steps.

The mask itself: the same for a sample in micro-batches of any size and padded length, in a layer recomputed by
gradient checkpointing, and another for another sample, layer or epoch. The run: the LoRA recipe with dropout 0.1 at
(8, 1) and (2, 4) reads equivalent at fp32's band; one word changed differs; and torch's own draw (the negative
control: masks from the global generator in the order the micro-batches run) stands the layouts apart."""

from __future__ import annotations

import pytest
import torch

from finetune.models import dropout
from finetune.reproduce.compare import compare_runs
from tests.helpers import SMALL, one_word_changed, recipe_runs, tiny_chat_assets

LORA = [*SMALL["sft-smollm2"], "data.limit=22", "training.effective_batch_size=8", "model.generate_prompts=0",
        "training.eval_at_start=false", "output.plots=false", "peft.enabled=true", "peft.dropout=0.1",
        "training.learning_rate=2e-3", "training.packing=false", "training.epochs=2"]


class Rows(torch.nn.Module):
    """Two keyed dropouts around a linear layer, over [rows, tokens, width]."""

    def __init__(self):
        super().__init__()
        self.first, self.linear, self.second = torch.nn.Dropout(0.3), torch.nn.Linear(6, 6), torch.nn.Dropout(0.3)

    def forward(self, x):
        return self.second(self.linear(self.first(x)))


def keyed_rows(seed=0):
    torch.manual_seed(seed)
    model = Rows()
    keys = dropout.key_by_sample(model, seed=7, length_of=lambda i: 5 + i)
    return model, keys


def test_a_samples_mask_is_the_same_in_every_micro_batch_and_padded_length():
    model, keys = keyed_rows()
    assert keys.layers == 2 and isinstance(model.first, dropout.KeyedDropout)
    samples = list(range(8))
    keys.window(epoch=0, samples=samples)
    x = torch.ones(8, 12, 6)
    keys.see(samples)
    whole = model.first(x)
    for b, padded in ((4, 10), (2, 8), (1, 7)):  # shorter padding, as a smaller micro-batch's longest sample
        parts = []
        for start in range(0, 8, b):
            keys.see(samples[start:start + b])
            parts.append(model.first(torch.ones(b, padded, 6)))
        assert torch.equal(torch.cat(parts), whole[:, :padded]), b
    dropped = float((whole == 0).float().mean())
    assert 0.2 < dropped < 0.4  # p = 0.3
    assert not torch.equal(whole[0], whole[1])  # another sample, another mask
    assert not torch.equal(model.second(x), whole)  # another layer
    keys.window(epoch=1, samples=samples)
    keys.see(samples)
    assert not torch.equal(model.first(x), whole)  # another epoch
    keys.clear()
    torch.manual_seed(0)
    a = model.first(x)
    torch.manual_seed(0)
    assert torch.equal(model.first(x), a) and not torch.equal(a, whole)  # outside the loop: torch's own draw


def test_a_layer_recomputed_by_checkpointing_draws_its_forwards_mask():
    """The gradients with checkpointing (the forward recomputed in backward, another draw from torch's generator
    in between) equal those without; with torch's own dropout the recomputed masks would be restored by
    checkpointing's RNG stash only for the global generator, which keyed layers do not use."""
    from torch.utils.checkpoint import checkpoint

    def grads(checkpointed: bool):
        model, keys = keyed_rows()
        keys.window(0, range(4))
        keys.see(range(4))
        x = torch.randn(4, 9, 6, generator=torch.Generator().manual_seed(1))
        out = checkpoint(model, x, use_reentrant=False) if checkpointed else model(x)
        torch.rand(100)  # the global generator moves on before backward
        out.square().sum().backward()
        return model.linear.weight.grad

    assert torch.equal(grads(True), grads(False))


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    tiny_chat_assets()
    return recipe_runs(tmp_path_factory.mktemp("dropout"), "sft-smollm2", LORA)


def test_lora_with_dropout_at_two_layouts_is_equivalent_and_one_word_differs(lora, tmp_path, capsys):
    big, small = lora("b8", 8), lora("b2", 2)
    said = capsys.readouterr().out
    assert "Dropout: keyed by sample in" in said, said
    c = compare_runs(big, small)
    assert c.equivalent, c.report()
    # held to fp32's band (no dropout allowance), and well inside it: the masks are the same
    assert "loss ≤ 1e-04" in c.report() and c.measured["weights L2"] < 1e-6, c.report()
    word = compare_runs(big, lora("word", 2, f"data.source={one_word_changed(tmp_path)}"))
    assert word.verdict.kind == "differs", word.report()


def test_torchs_own_draw_stands_the_layouts_apart(lora, monkeypatch):
    """The negative control: with the keys never set, every layer draws from torch's generator in the order the
    micro-batches run, and (2, 4) differs from (8, 1)."""
    monkeypatch.setattr(dropout.SampleKeys, "see", lambda self, rows: None)
    c = compare_runs(lora("b8", 8), lora("torch-b2", 2))
    assert c.verdict.kind == "differs", c.report()


def test_another_dropout_seed_draws_other_masks_over_the_same_samples(lora):
    """``training.dropout_seed``: the same samples, order and init (its windows and content equal), other masks —
    the steps part (what a twin at another dropout seed measures)."""
    c = compare_runs(lora("b8", 8), lora("seed-b8", 8, "training.dropout_seed=7"))
    by_name = {name: ok for name, ok, _, _ in c.checks}
    assert by_name["window samples"] and by_name["window content"], c.report()
    assert c.verdict.kind == "differs" and not by_name["grad norm"], c.report()
