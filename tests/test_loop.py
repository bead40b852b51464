"""Step counts, the LR schedule, N = 1, precision and the optimizer-step ordering of the shared loop."""

import json
import math

import pytest
import torch

from finetune import ConfigError, TrainingConfig, test_fine_tuning
from finetune.distributed import make_accelerator
from finetune.optim import Optim
from finetune.steps import optimizer_step
from finetune.windows import Window, WindowSpec
from tests.helpers import MLP, copy_model, regression_data, rel_diff


def test_100_micro_batches_with_n4_take_25_steps():
    result = test_fine_tuning(MLP(), train_data=regression_data(800), batch_size=8, gradient_accumulation_steps=4)
    assert result["micro_batches"] == 100
    assert result["optimizer_steps"] == 25
    assert len(result["grad_norm_history"]) == 25
    assert all(math.isfinite(g) and g > 0 for g in result["grad_norm_history"])
    assert result["effective_batch_size"] == 32


@pytest.mark.parametrize("n_samples,b,n,epochs", [(50, 4, 3, 3), (17, 5, 2, 2), (64, 8, 8, 1), (9, 2, 16, 2)])
def test_steps_and_linear_schedule(n_samples, b, n, epochs):
    """Optimizer steps = Σ over epochs of ceil(micro_batches / N); the scheduler is stepped once per step."""
    result = test_fine_tuning(MLP(), train_data=regression_data(n_samples), batch_size=b,
                              gradient_accumulation_steps=n, n_epochs=epochs, learning_rate=1e-2)
    micro = math.ceil(n_samples / b)
    steps = epochs * math.ceil(micro / n)
    assert result["optimizer_steps"] == steps
    assert result["micro_batches"] == epochs * micro
    assert result["lr_history"] == pytest.approx([1e-2 * (1 - k / steps) for k in range(steps)], abs=1e-12)


def test_warmup_and_max_steps():
    result = test_fine_tuning(MLP(), train_data=regression_data(100), batch_size=5, gradient_accumulation_steps=2,
                              n_epochs=5, max_steps=7, warmup_steps=2, learning_rate=1.0)
    assert result["optimizer_steps"] == 7
    assert result["lr_history"][:3] == pytest.approx([0.0, 0.5, 1.0])
    assert result["lr_history"][-1] == pytest.approx(1.0 * (7 - 6) / (7 - 2))


def test_n1_is_a_plain_loop():
    """N = 1 takes exactly the steps of a hand-written torch loop over the same seeded order."""
    torch.manual_seed(0)
    model, data = MLP(), regression_data(30)
    ours = test_fine_tuning(copy_model(model), train_data=data, batch_size=4, optimizer="sgd", learning_rate=0.1,
                            max_grad_norm=None, lr_scheduler="constant", n_epochs=2, seed=5)
    ref = copy_model(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for epoch in range(2):
        order = WindowSpec(30, 4, 1, 1, 5).epoch(epoch, 0)
        for w in order:
            idx = list(w.micro_batches[0])
            batch = {"x": torch.stack([data[i]["x"] for i in idx]), "y": torch.stack([data[i]["y"] for i in idx])}
            ref(**batch)["loss"].backward()
            opt.step()
            opt.zero_grad()
    assert rel_diff(ours["model"], ref) <= 1e-6


def test_sample_order_depends_on_seed_only():
    def members(b, n, w):
        return [sorted(x.samples) for r in range(w) for x in WindowSpec(103, b, n, w, 7).epoch(1, r)][:5]

    base = [sorted(x.samples) for x in WindowSpec(103, 24, 1, 1, 7).epoch(1, 0)]
    for b, n, w in [(3, 8, 1), (6, 2, 2), (1, 12, 2), (24, 1, 1)]:
        windows = WindowSpec(103, b, n, w, 7).epoch(1, 0)
        assert [sorted(x.samples) for x in windows] == base
    assert base != [sorted(x.samples) for x in WindowSpec(103, 24, 1, 1, 8).epoch(1, 0)]
    assert base != [sorted(x.samples) for x in WindowSpec(103, 24, 1, 1, 7).epoch(2, 0)]


def test_bf16_autocast_runs_on_cpu():
    seen = []

    class Probe(MLP):
        def forward(self, x, y):
            seen.append(self.net[0](x).dtype)
            return super().forward(x, y)

    result = test_fine_tuning(Probe(), train_data=regression_data(20), batch_size=5, mixed_precision="bf16")
    assert torch.bfloat16 in seen
    assert all(math.isfinite(v) for v in result["loss_history"])


def test_two_precisions_in_one_process():
    """Accelerate refuses a second Accelerator with another precision in one process; runs through the API (a
    search, a notebook) must still get the precision they ask for, and sync gradients every window."""
    seen = []

    class Probe(MLP):
        def forward(self, x, y):
            seen.append(self.net[0](x).dtype)
            return super().forward(x, y)

    data = regression_data(16)
    for precision, dtype in (("bf16", torch.bfloat16), ("no", torch.float32), ("bf16", torch.bfloat16)):
        seen.clear()
        result = test_fine_tuning(Probe(), train_data=data, batch_size=4, gradient_accumulation_steps=2,
                                  mixed_precision=precision)
        assert set(seen) == {dtype}, precision
        assert result["accelerator"].mixed_precision == precision
        assert result["optimizer_steps"] == 2


def test_fp16_runs_on_the_cpu_with_a_loss_scale():
    """fp16 autocast and a dynamic loss scale on the CPU (Accelerate alone would train fp32 there): the products run
    in fp16, each step records the scale it was backpropagated at, and the run trains."""
    seen = []

    class Probe(MLP):
        def forward(self, x, y):
            seen.append(self.net[0](x).dtype)
            return super().forward(x, y)

    torch.manual_seed(0)
    model = Probe()
    start = copy_model(model)
    result = test_fine_tuning(model, train_data=regression_data(16), batch_size=4, gradient_accumulation_steps=2,
                              mixed_precision="fp16", learning_rate=1e-2)
    assert set(seen) == {torch.float16}
    assert [h["loss_scale"] for h in result["history"]] == [2.0 ** 16] * 2
    assert not any(h["skipped"] for h in result["history"])
    assert rel_diff(result["model"], start) > 1e-3  # both updates were taken
    plain = test_fine_tuning(copy_model(start), train_data=regression_data(16), batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=1e-2)
    assert "loss_scale" not in plain["history"][0]  # the control: fp32 has no scale
    assert result["loss_history"] == pytest.approx(plain["loss_history"], rel=1e-2)  # fp16 rounding, not another loss


def _fp16_accelerator(init_scale):
    """A CPU Accelerator wired like an fp16 one: a real GradScaler scales the loss in backward and the prepared
    optimizer steps through it — the ordering under test is the loop's, with Accelerate's real plumbing (the forward
    stays fp32 so the numbers can be compared exactly)."""
    acc = make_accelerator()
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    acc.state._mixed_precision = "fp16"
    return acc


def _one_step(acc, model, max_norm, poison=False):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))
    params = list(model.parameters())
    model, opt = acc.prepare(model, opt)
    acc.native_amp = True  # after prepare: fp32 forward (exact numbers), fp16 loss scaling and unscaling
    batch = {"x": torch.ones(4, 6), "y": torch.zeros(4)}
    acc.backward(model(**batch)["loss"])
    if poison:
        next(model.parameters()).grad[0, 0] = float("inf")
    update = optimizer_step(acc, [Optim("model", opt, sched, params, max_norm)], "stop", 1,
                            Window(0, 0, (0,), ((0,),), (True,), 1))
    return model, opt, sched, update.norms[0], update.skipped, update.lrs[0]


def test_fp16_unscales_before_norm_and_clip():
    torch.manual_seed(0)
    model = MLP()
    ref = copy_model(model)
    ref(**{"x": torch.ones(4, 6), "y": torch.zeros(4)})["loss"].backward()
    true_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01))
    torch.optim.SGD(ref.parameters(), lr=1.0).step()

    acc = _fp16_accelerator(init_scale=2.0 ** 12)
    model, _, sched, norm, skipped, lr = _one_step(acc, model, max_norm=0.01)
    assert not skipped
    assert norm == pytest.approx(true_norm, rel=1e-5)  # measured after unscaling, before clipping
    assert rel_diff(model, ref) <= 1e-6  # clipped in true units, then stepped
    assert sched.last_epoch == 1


def test_fp16_overflow_skips_step_and_scheduler():
    torch.manual_seed(0)
    model = MLP()
    before = [p.detach().clone() for p in model.parameters()]
    acc = _fp16_accelerator(init_scale=2.0 ** 12)
    model, opt, sched, norm, skipped, lr = _one_step(acc, model, max_norm=1.0, poison=True)
    assert skipped and not math.isfinite(norm)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert sched.last_epoch == 0  # a skipped update is not a step of the schedule
    assert acc.scaler.get_scale() < 2.0 ** 12


def test_nonfinite_stop_and_skip():
    class Bad(MLP):
        calls = 0

        def forward(self, x, y):
            Bad.calls += 1
            out = super().forward(x, y)
            return {"loss": out["loss"] * (float("nan") if Bad.calls == 3 else 1.0)}

    with pytest.raises(RuntimeError, match="optimizer step 3 \\(epoch 0, window 2\\)"):
        test_fine_tuning(Bad(), train_data=regression_data(20), batch_size=4, shuffle=False)
    Bad.calls = 0
    result = test_fine_tuning(Bad(), train_data=regression_data(20), batch_size=4, on_nonfinite="skip")
    assert [h["skipped"] for h in result["history"]] == [False, False, True, False, False]
    assert [h["step"] for h in result["history"]] == [1, 2, 3, 4, 5]  # a skipped window still counts as a step
    assert all(torch.isfinite(p).all() for p in result["model"].parameters())


def test_an_unknown_grad_norm_is_not_non_finite():
    """DeepSpeed's engine reports no norm (None) when it does not clip: the step is taken and the norm logged as NaN;
    a real NaN norm still stops the run (the control)."""
    from types import SimpleNamespace

    model = MLP()
    model(**{"x": torch.ones(4, 6), "y": torch.zeros(4)})["loss"].backward()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    window = Window(0, 0, (0,), ((0,),), (True,), 1)
    optim = Optim("model", opt, sched, list(model.parameters()), None)
    before = [p.detach().clone() for p in model.parameters()]
    unknown = SimpleNamespace(clip_grad_norm_=lambda params, max_norm: None, scaler=None)
    update = optimizer_step(unknown, [optim], "stop", 1, window)
    assert math.isnan(update.norms[0]) and not update.skipped
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the update was taken
    model(**{"x": torch.ones(4, 6), "y": torch.zeros(4)})["loss"].backward()
    nan = SimpleNamespace(clip_grad_norm_=lambda params, max_norm: torch.tensor(float("nan")), scaler=None)
    with pytest.raises(RuntimeError, match="non-finite gradient"):
        optimizer_step(nan, [optim], "stop", 2, window)


def test_history_file_and_metrics(tmp_path):
    result = test_fine_tuning(MLP(), train_data=regression_data(30), val_data=regression_data(10, seed=1),
                              batch_size=4, gradient_accumulation_steps=2, n_epochs=2, output_dir=str(tmp_path))
    lines = [json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert len(lines) == result["optimizer_steps"] == 8
    assert {"step", "epoch", "items", "micro_batches", "loss", "lr", "grad_norm", "skipped", "seconds"} <= set(lines[0])
    assert [x["step"] for x in lines] == list(range(1, 9))
    assert sum(x["items"] for x in lines) == 60
    assert len(result["val_history"]) == 2 and result["final_loss"] == result["val_history"][-1]["loss"]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 8


def test_config_dict_and_keyword_precedence():
    result = test_fine_tuning(MLP(), {"batch_size": 3, "n_epochs": 2, "learning_rate": 0.5},
                              train_data=regression_data(12), learning_rate=0.25, lr_scheduler="constant")
    assert result["optimizer_steps"] == 8
    assert result["lr_history"][0] == 0.25


@pytest.mark.parametrize("kw,field", [
    ({"gradient_accumulation_steps": 0}, "training.gradient_accumulation_steps"),
    ({"batch_size": -1}, "training.batch_size"),
    ({"learning_rate": -1e-3}, "training.learning_rate"),
    ({"optimizer": "adam"}, "training.optimizer"),
    ({"nonsense": 1}, "training.nonsense"),
])
def test_api_bad_arguments_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        test_fine_tuning(MLP(), train_data=regression_data(8), **kw)


@pytest.mark.parametrize("kw,closest", [
    ({"learnig_rate": 1e-3}, "learning_rate"),
    ({"num_epochs": 2}, "n_epochs"),
    ({"grad_accum_steps": 2}, "gradient_accumulation_steps"),
    ({"train_dataset": []}, "train_data"),
    ({"nonsense": 1}, None),
    ({"very_" * 60 + "long": 1}, None),
])
def test_an_unknown_keyword_is_one_short_line_naming_the_closest(kw, closest):
    """Not the schema's 36 field names in one 531-character line: the keyword, and the valid name it is closest to."""
    with pytest.raises(ConfigError) as refused:
        test_fine_tuning(MLP(), train_data=regression_data(8), **kw)
    message = str(refused.value)
    assert "\n" not in message and len(message) <= 200, message
    assert message.startswith(f"training.{next(iter(kw))[:30]}"), message
    assert message.endswith(f"did you mean {closest}?") if closest else "did you mean" not in message, message


def test_an_unknown_key_in_the_config_dict_is_refused_alike():
    with pytest.raises(ConfigError, match=r"^training\.n_epoch: .*did you mean n_epochs\?$"):
        test_fine_tuning(MLP(), {"training": {"n_epoch": 2}}, train_data=regression_data(8))
    # negative control: the aliases and the call's own keywords are accepted, in the dict as well as as keywords
    result = test_fine_tuning(MLP(), {"n_epochs": 1, "lr": 0.5, "use_amp": False, "output_dir": None},
                              train_data=regression_data(8), lr=0.25, lr_scheduler="constant", batch_size=4)
    assert result["optimizer_steps"] == 2 and result["lr_history"][0] == 0.25


def test_keyword_defaults_and_their_docs_come_from_the_schema():
    import dataclasses
    import inspect

    from finetune.api import _training_config

    params, doc = inspect.signature(test_fine_tuning).parameters, test_fine_tuning.__doc__
    schema = TrainingConfig()
    for f in dataclasses.fields(TrainingConfig):
        assert params[f.name].default == getattr(schema, f.name), f.name
        assert f"\n        {f.name} " in doc, f.name
    assert "learning_rate (or lr) = 5e-05: peak learning rate" in doc and "epochs (or n_epochs) = 1" in doc
    own = {"model", "config", "train_data", "val_data", "collate_fn", "loss_fn", "use_amp", "use_wandb", "output_dir",
           "save_every", "resume"}
    assert set(params) == own | {f.name for f in dataclasses.fields(TrainingConfig)} | {"hooks_and_aliases"}
    assert _training_config(None, {}) == schema  # a keyword not given takes the schema's default


def test_use_amp_is_decided_in_one_place(monkeypatch):
    """``test_fine_tuning(use_amp=True)`` and ``finetune run --use-amp`` both ask ``distributed.amp_precision``."""
    from finetune import distributed
    from finetune.api import _training_config
    from finetune.cli import build_parser, overrides_from_args

    monkeypatch.setattr(distributed, "amp_precision", lambda: "fp16")  # what a CUDA machine answers
    assert _training_config(None, {}, use_amp=True).mixed_precision == "fp16"
    args = build_parser().parse_args(["run", "--recipe", "minilm-sentiment", "--use-amp"])
    assert "training.mixed_precision=fp16" in overrides_from_args(args)
    monkeypatch.undo()
    assert distributed.amp_precision() == ("fp16" if torch.cuda.is_available() else "bf16")


def test_not_collected_by_pytest():
    assert test_fine_tuning.__test__ is False


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_optimizers_train(name):
    torch.manual_seed(0)
    data = regression_data(64)
    result = test_fine_tuning(MLP(), train_data=data, batch_size=8, optimizer=name, n_epochs=8,
                              learning_rate={"adamw": 1e-2, "sgd": 0.1, "lion": 1e-2}[name], weight_decay=0.01)
    first, last = result["loss_history"][:8], result["loss_history"][-8:]
    assert sum(last) < 0.8 * sum(first)


def test_adamw_no_weight_decay_on_biases_and_norms():
    from finetune.optim import make_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = make_optimizer(model, TrainingConfig(weight_decay=0.1))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model[0].weight)}


def test_compile_matches_eager():
    torch.manual_seed(0)
    model, data = MLP(), regression_data(24)
    eager = test_fine_tuning(copy_model(model), train_data=data, batch_size=4, gradient_accumulation_steps=2,
                             optimizer="sgd", learning_rate=0.1)
    compiled = test_fine_tuning(copy_model(model), train_data=data, batch_size=4, gradient_accumulation_steps=2,
                                optimizer="sgd", learning_rate=0.1, compile=True)
    assert rel_diff(compiled["model"], eager["model"]) <= 1e-5


def test_tracker_logs_effective_batch(tmp_path):
    pytest.importorskip("tensorboard")
    test_fine_tuning(MLP(), train_data=regression_data(16), batch_size=2, gradient_accumulation_steps=4,
                     use_wandb="tensorboard", output_dir=str(tmp_path))
    events = list(tmp_path.rglob("events.out.tfevents.*"))
    assert events
    hparams = "".join(p.read_text() for p in tmp_path.rglob("hparams.yml"))
    assert "config/effective_batch_size: 8" in hparams and "config/physical_batch_size: 2" in hparams


def test_model_in_eval_mode_is_trained_in_train_mode():
    """from_pretrained hands over a model in eval mode; dropout must still be active while training."""
    modes = []

    class Probe(MLP):
        def forward(self, x, y):
            modes.append(self.training)
            return super().forward(x, y)

    model = Probe().eval()
    test_fine_tuning(model, train_data=regression_data(8), batch_size=4)
    assert modes and all(modes)


@pytest.mark.parametrize("n, tail", [(37, "the last window of each epoch holds 1 sample)"),
                                     (35, "the last window of each epoch holds 11 samples)"),
                                     (24, "every window is full)")])
def test_banner_names_the_short_last_window(capsys, n, tail):
    test_fine_tuning(MLP(), train_data=regression_data(n), batch_size=4, gradient_accumulation_steps=3,
                     max_steps=1)
    out = capsys.readouterr().out
    assert "Effective batch size: 12 (4 × 3)" in out
    assert f"per epoch; {tail}" in out


def test_eval_at_start_and_after_step_hook():
    """eval_at_start evaluates the untuned model at step 0; after_step sees every optimizer step once, in order."""
    data, seen = regression_data(24), []
    kw = dict(train_data=data[:16], val_data=data[16:], batch_size=4, gradient_accumulation_steps=2,
              learning_rate=0.05, n_epochs=2, after_step=lambda state, model: seen.append(state.optimizer_step))
    result = test_fine_tuning(MLP(), eval_at_start=True, **kw)
    assert [v["step"] for v in result["val_history"]] == [0, 2, 4]
    assert result["val_history"][0]["loss"] != result["val_history"][-1]["loss"]
    assert seen == [1, 2, 3, 4]
    assert [v["step"] for v in test_fine_tuning(MLP(), **kw)["val_history"]] == [2, 4]  # off by default


def test_the_gradient_checkpointing_hooks_old_name_still_works_and_says_its_new_one():
    """``enable_checkpointing`` (the hook's name before "checkpointing" meant a checkpoint to resume from) is carried
    for a release: it warns and lands on ``enable_gradient_checkpointing``; the new name does not warn (control)."""
    import warnings

    from finetune.job import Job

    called = []
    hook = lambda model: called.append(model)  # noqa: E731
    with pytest.warns(FutureWarning, match="enable_gradient_checkpointing"):
        job = Job(model=torch.nn.Linear(1, 1), train_data=[], enable_checkpointing=hook)
    assert job.enable_gradient_checkpointing is hook
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Job(model=torch.nn.Linear(1, 1), train_data=[], enable_gradient_checkpointing=hook) \
            .enable_gradient_checkpointing is hook


def test_accelerates_per_step_package_question_is_asked_once_in_a_run_and_restored_after():
    """Accelerate's optimizer wrapper asks importlib whether lomo_optim is installed twice every step; inside a run
    the answer is cached (asked once), and Accelerate's own function is back when the run ends."""
    import accelerate.optimizer as wrapper

    from finetune.api import test_fine_tuning
    from tests.helpers import MLP, regression_data

    own, seen = wrapper.is_lomo_available, []

    class Spying(MLP):
        def forward(self, x, y):
            seen.append(wrapper.is_lomo_available)
            return super().forward(x, y)

    test_fine_tuning(Spying(), train_data=regression_data(16), batch_size=4, gradient_accumulation_steps=2,
                     learning_rate=0.01)
    assert seen and all(f is not own and hasattr(f, "cache_info") for f in seen)
    assert seen[0].cache_info().misses <= 1 and seen[0]() == own()  # asked once, the same answer
    assert wrapper.is_lomo_available is own
