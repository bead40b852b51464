"""One optimizer table (``finetune.optimizers``): the recipe schema's choices, the optimizer made, the memory model's
state (``batch_size: auto``, ``finetune plan``), ``finetune compare`` and ``finetune import`` all read it, so every
entry works with each of them, and an entry added to the table alone is usable everywhere."""

import json

import pytest
import torch

from finetune import optimizers
from finetune.errors import ConfigError
from finetune.loading import load_recipe
from finetune.optimizers import OPTIMIZERS, Optimizer
from tests.helpers import MLP, TINY, assert_one_error_line, regression_data

pytestmark = pytest.mark.usefixtures("frozen_heap")  # the planner's gc passes walk only this module's objects


def needs_installed(name: str) -> None:
    """Skip where the entry's package is missing (the 8-bit ones without bitsandbytes)."""
    needs = OPTIMIZERS[name].needs
    if needs:
        pytest.importorskip(needs[0])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_batch_size_auto_trains_with_every_optimizer_of_the_table(name):
    """``batch_size: auto`` sizes the optimizer's state from the table before it exists: the count is what the
    optimizer holds once it has stepped, and the run trains."""
    from finetune.api import test_fine_tuning
    from finetune.config import TrainingConfig
    from finetune.memory.fixed import state_bytes
    from finetune.memory.step import auto_profile
    from finetune.optim import make_optimizer

    needs_installed(name)
    data = regression_data(24)
    torch.manual_seed(0)
    model = MLP()
    t = TrainingConfig(optimizer=name, momentum=0.9 if name == "sgd" else 0.0)
    batch = lambda n: torch.utils.data.default_collate(data[:n])  # noqa: E731
    predicted = auto_profile(model, [batch(1), batch(2)], t, up_to=2).optimizer_state
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = make_optimizer(params, t)
    optimizer.step()
    assert predicted == state_bytes(optimizer) and predicted > 0  # sgd with momentum holds a buffer too

    start = [p.detach().clone() for p in model.parameters()]
    result = test_fine_tuning(model, train_data=data, batch_size="auto", effective_batch_size=8, optimizer=name,
                              learning_rate=1e-2, max_steps=2)
    assert result["optimizer_steps"] == 2 and result["effective_batch_size"] == 8
    assert any(not torch.equal(a, b) for a, b in zip(start, result["model"].parameters()))  # it stepped


def test_batch_size_auto_with_adamw8bit_is_a_run_not_a_traceback(tmp_path, capsys):
    """The small-GPU combination of #53: the run's own command, the same flags; it once ended in a KeyError from
    the memory model's own table of state sizes."""
    from finetune.cli import run_main

    pytest.importorskip("bitsandbytes")
    out = tmp_path / "run"
    code = run_main(["--recipe", TINY, "--set", "training.optimizer=adamw8bit", "--batch-size", "auto",
                     "--effective-batch-size", "8", "--max-steps", "2", "--set", "output.save_model=false",
                     "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err[-2000:]
    history = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert [h["samples"] for h in history] == [8, 8]


def test_batch_size_auto_with_adamw8bit_without_bitsandbytes_is_one_line(tmp_path, capsys, monkeypatch):
    from finetune.cli import run_main

    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes", None)  # as on a machine without it
    out = tmp_path / "run"
    code = run_main(["--recipe", TINY, "--set", "training.optimizer=adamw8bit", "--batch-size", "auto",
                     "--effective-batch-size", "8", "--output-dir", str(out)])
    assert code == 2
    assert_one_error_line(capsys.readouterr().err, "training.optimizer: adamw8bit needs bitsandbytes, which is not "
                                                   "installed (pip install 'finetune[quant]')")
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# a made-up optimizer, added to the table alone

ADAGRAD = Optimizer(
    make=lambda groups, t: torch.optim.Adagrad(groups, lr=t.learning_rate),
    state_bytes=lambda numels, momentum=0.0: sum(4 * n + 4 for n in numels),  # a running sum and a step count
    about="made up for the test", trainer_names=("adagrad_made_up",))


def tiny_run(out, *flags) -> None:
    from finetune.cli import run_main

    assert run_main(["--recipe", TINY, "--set", "training.optimizer=adagrad", "--set", "model.dropout=0",
                     "--max-steps", "2", "--set", "output.save_model=true", "--output-dir", str(out), *flags]) == 0


def test_a_made_up_optimizer_added_to_the_table_alone_is_planned_trained_compared_and_imported(
        tmp_path, monkeypatch, capsys):
    from finetune.cli import main
    from finetune.reproduce.compare import compare_runs
    from finetune.reproduce.importer import Request, import_recipe
    from finetune.startup import build_job

    args = tmp_path / "args.json"  # a Trainer baseline's arguments, naming its optimizer
    args.write_text(json.dumps({"optim": "adagrad_made_up", "learning_rate": 1e-3}))
    # the control: before the entry exists, the recipe refuses the name and the import does not carry it
    with pytest.raises(ConfigError, match="training.optimizer: got 'adagrad'; expected 'adamw' | 'sgd'"):
        load_recipe(TINY, ["training.optimizer=adagrad"])
    _, imported, _ = import_recipe(str(args), Request(TINY))
    assert "training.optimizer" not in imported.values
    assert any(line.startswith("not carried: optim=adagrad_made_up") for line in imported.lines())

    monkeypatch.setitem(OPTIMIZERS, "adagrad", ADAGRAD)
    # the schema
    assert load_recipe(TINY, ["training.optimizer=adagrad"]).training.optimizer == "adagrad"
    # imported
    raw, imported, _ = import_recipe(str(args), Request(TINY))
    assert raw["training"]["optimizer"] == "adagrad" and imported.values["training.optimizer"] == "adagrad"
    # planned: the plan's optimizer state is the table's count of the recipe's trainable tensors
    capsys.readouterr()
    assert main(["plan", "--recipe", TINY, "--gpu", "t4", "--json", "--set", "training.optimizer=adagrad"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    job = build_job(load_recipe(TINY, ["training.optimizer=adagrad"]))
    numels = [p.numel() for p in job.model.parameters() if p.requires_grad]
    assert plan["optimizer"] == ADAGRAD.state_bytes(numels) and plan["fits"]
    # trained: a fixed micro-batch, and batch_size: auto (which sizes its state from the table)
    fixed, auto = tmp_path / "fixed", tmp_path / "auto"
    tiny_run(fixed)
    tiny_run(auto, "--batch-size", "auto", "--effective-batch-size", "8", "--set",
             "training.gradient_accumulation_steps=null")
    # compared: the same steps, its weights judged as an adaptive optimizer's (relative L2) as the table says
    verdict = compare_runs(fixed, auto)
    _, ok, detail, _ = weights_check(verdict)
    assert verdict.equivalent and ok and detail.startswith("relative L2"), verdict.report()
    # the control: the same entry, not adaptive, is judged by its largest element — compare read the table
    monkeypatch.setitem(OPTIMIZERS, "adagrad", Optimizer(**{**vars(ADAGRAD), "adaptive": False}))
    assert "adagrad" not in optimizers.ADAPTIVE
    assert weights_check(compare_runs(fixed, auto))[2].startswith("largest element")


def weights_check(verdict) -> tuple:
    """(name, ok, detail, step) of a comparison's weights layer."""
    return next(c for c in verdict.checks if c[0] == "weights")
