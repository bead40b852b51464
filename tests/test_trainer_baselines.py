"""Reproducing a baseline trained by HF Trainer: its sample order replayed (``training.sample_order: trainer``)."""

import pytest
import torch

from finetune.windows import plan_epoch, trainer_epoch_order


def trainer_batches(out, n, per_device, accum, epochs, seed, data_seed=None):
    """The samples HF Trainer (the installed transformers + accelerate) puts in each optimizer step, recorded by a
    model that sees sample indices."""
    from transformers import Trainer, TrainingArguments

    steps, current = [], []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(1, 1)

        def forward(self, idx):
            current.extend(idx.tolist())
            return {"loss": self.w(idx.float()[:, None]).pow(2).mean()}

    class Close(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            steps.append(list(current))
            current.clear()

    args = TrainingArguments(str(out), per_device_train_batch_size=per_device, gradient_accumulation_steps=accum,
                             num_train_epochs=epochs, seed=seed, data_seed=data_seed, report_to=[],
                             save_strategy="no", remove_unused_columns=False, use_cpu=True, disable_tqdm=True,
                             logging_strategy="no")
    trainer = Trainer(model=Probe(), args=args, train_dataset=[{"idx": i} for i in range(n)],
                      data_collator=lambda rows: {"idx": torch.tensor([r["idx"] for r in rows])},
                      callbacks=[Close()])
    trainer.train()
    return steps


@pytest.mark.parametrize("seed, data_seed", [(7, None), (3, 11)])
def test_window_k_holds_the_trainers_batch_k(tmp_path, seed, data_seed):
    """37 samples, batch 4 × accumulation 2: 4 full windows of 8 and a short one of 5 (a short micro-batch of 1)
    each epoch, over 3 epochs. finetune at micro-batch 1 × N = 8 holds the Trainer's samples in every window."""
    got = trainer_batches(tmp_path, 37, 4, 2, 3, seed, data_seed)
    order_seed = seed if data_seed is None else data_seed
    ours = [list(w.samples) for e in range(3) for w in plan_epoch(37, 1, 8, 1, 0, order_seed, e,
                                                                   sample_order="trainer")]
    assert got == ours and [len(s) for s in got[:5]] == [8, 8, 8, 8, 5]
    # negative control: finetune's own order puts other samples in the windows
    default = [sorted(w.samples) for e in range(3) for w in plan_epoch(37, 1, 8, 1, 0, order_seed, e)]
    assert [sorted(s) for s in got] != default


def test_trainer_order_depends_on_seed_and_epoch_only():
    base = [sorted(w.samples) for w in plan_epoch(103, 24, 1, 1, 0, 7, 1, sample_order="trainer")]
    for b, n, w in [(3, 8, 1), (6, 2, 2), (1, 12, 2)]:
        assert [sorted(x.samples) for x in plan_epoch(103, b, n, w, 0, 7, 1, sample_order="trainer")] == base
    assert trainer_epoch_order(103, 7, 1) == trainer_epoch_order(103, 8, 0)  # the Trainer seeds with seed + epoch
    assert trainer_epoch_order(103, 7, 1) != trainer_epoch_order(103, 7, 0)


def test_elastic_resume_keeps_the_trainers_windows(tmp_path):
    """A run in the Trainer's order, resumed mid-epoch at another micro-batch, takes the uninterrupted run's steps;
    its window hashes are the Trainer order's."""
    import json

    from finetune.cli import run_main
    from finetune.compare import compare_runs
    from finetune.windows import membership_hash
    from tests.helpers import TINY, checkpoint_copy

    common = ["--recipe", TINY, "--set", "data.limit=28", "--set", "model.dropout=0", "--effective-batch-size", "8",
              "--set", "training.sample_order=trainer", "--set", "output.tracker=none"]
    whole = tmp_path / "whole"
    assert run_main([*common, "--batch-size", "4", "--save-every", "1", "--keep-last", "100",
                     "--output-dir", str(whole)]) == 0
    resumed = checkpoint_copy(whole, tmp_path / "resumed", 3)
    (resumed / "metrics.json").unlink()
    assert run_main([*common, "--batch-size", "2", "--output-dir", str(resumed), "--resume", "latest"]) == 0
    assert compare_runs(resumed, whole).equivalent
    history = [json.loads(x) for x in (resumed / "history.jsonl").read_text().splitlines()]
    hashes, n_train = [h["window_hash"] for h in history], sum(h["samples"] for h in history if h["epoch"] == 0)
    expected = [membership_hash(w.samples) for e in range(2)
                for w in plan_epoch(n_train, 8, 1, 1, 0, 7, e, sample_order="trainer")]
    assert hashes == expected
    assert hashes != [membership_hash(w.samples) for e in range(2) for w in plan_epoch(n_train, 8, 1, 1, 0, 7, e)]
