"""Reproducing a baseline trained by HF Trainer: its sample order replayed (``training.sample_order: trainer``)."""

import pytest
import torch

from finetune.windows import plan_epoch, trainer_epoch_order
from tests.helpers import ROOT


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


# ---------------------------------------------------------------------------------------------------------------
# the worked example at test size: a Trainer baseline, imported, replayed at micro-batch 2, compared

EXAMPLE = ROOT / "examples" / "trainer-baseline"
AXOLOTL = ROOT / "tests" / "assets" / "axolotl-tiny-llama-lora.yaml"


def finetune_cli(capsys, *args) -> tuple[int, str, str]:
    """``finetune ARGS`` in this process: (exit code, stdout, stderr)."""
    from finetune.cli import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The example's Trainer baseline (examples/trainer-baseline/train_with_trainer.py) and its base recipe, pointing
    at the tiny model the script wrote."""
    import runpy
    import sys

    import yaml

    root = tmp_path_factory.mktemp("trainer")
    argv = sys.argv
    sys.argv = ["train_with_trainer.py", "--out", str(root / "baseline"), "--model", str(root / "tiny-llama")]
    try:
        runpy.run_path(str(EXAMPLE / "train_with_trainer.py"), run_name="__main__")
    finally:
        sys.argv = argv
    recipe = yaml.safe_load((EXAMPLE / "recipe.yaml").read_text())
    recipe["model"]["name_or_path"] = str(root / "tiny-llama")
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root


@pytest.fixture(scope="module")
def replayed(baseline):
    """``finetune import`` of the baseline folder, trained at micro-batch 2 (N = 8) in the Trainer's order."""
    from finetune.cli import main, run_main

    recipe = baseline / "imported.yaml"
    assert main(["import", str(baseline / "baseline"), "--recipe", str(baseline / "recipe.yaml"),
                 "-o", str(recipe)]) == 0
    assert run_main(["--recipe", str(recipe), "--batch-size", "2", "--output-dir", str(baseline / "mine")]) == 0
    return baseline / "mine"


def test_the_trainer_round_trip_is_equivalent(baseline, replayed, capsys):
    code, out, _ = finetune_cli(capsys, "compare", baseline / "baseline", replayed, "--plot", baseline / "c.png")
    assert code == 0, out
    lines = {line[6:22].strip(): line for line in out.splitlines()}
    assert out.splitlines()[-2] == "verdict: equivalent" and out.splitlines()[-1].startswith("curves:")
    for check in ("effective batch", "optimizer steps", "window samples", "lr schedule", "loss curve", "eval loss",
                  "weights"):
        assert lines[check].startswith("ok"), out
    assert "identical at all 26 logged steps" in lines["lr schedule"]
    from finetune.compare import compare_with_baseline

    c = compare_with_baseline(baseline / "baseline", replayed)
    details = {name: detail for name, _, detail in c.checks}
    weights = float(details["weights"].split("difference ")[1].split()[0])
    loss = float(details["loss curve"].split("difference ")[1].split()[0])
    assert weights <= 1e-5 and loss <= 1e-4


def test_the_default_order_is_flagged_different_samples(baseline, replayed, capsys):
    """Negative control: the same recipe in finetune's own order takes other windows than the Trainer."""
    from finetune.cli import run_main

    other = baseline / "default-order"
    assert run_main(["--recipe", str(baseline / "imported.yaml"), "--batch-size", "4", "--output-dir", str(other),
                     "--set", "training.sample_order=finetune"]) == 0
    code, out, _ = finetune_cli(capsys, "compare", baseline / "baseline", other)
    assert code == 1
    assert "verdict: differs — window samples: step 1 (epoch 0, window 0) held different samples" in out


def test_the_model_card_alone(baseline, replayed, capsys):
    """From the card: batch, steps, windows (from its seed) and eval loss are checked; lr, loss curve, weights are
    said to be not checkable."""
    code, out, _ = finetune_cli(capsys, "compare", baseline / "baseline" / "README.md", replayed)
    assert code == 0, out
    assert "verdict: equivalent — not checkable from the model card: lr schedule, training loss, weights" in out
    code, out, _ = finetune_cli(capsys, "import", baseline / "baseline" / "README.md", "--recipe",
                                baseline / "recipe.yaml", "-o", baseline / "from-card.yaml")
    assert code == 0
    assert "training.warmup_steps                 3" in out  # ratio 0.1 × 26 steps (the results table's last row)
    assert "not in the model card, the recipe's values kept: weight_decay (Trainer default 0.0)" in out

