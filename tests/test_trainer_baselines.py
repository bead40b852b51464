"""Reproducing a baseline trained by HF Trainer: its sample order replayed (``training.sample_order: trainer``)."""

import pytest
import torch

from finetune.windows import WindowSpec, trainer_epoch_order
from tests.helpers import ROOT


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: a second thread buys nothing, and on a busy machine its spin-waits cost seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    trainer = WindowSpec(37, 1, 8, 1, order_seed, sample_order="trainer")
    ours = [list(w.samples) for e in range(3) for w in trainer.epoch(e, 0)]
    assert got == ours and [len(s) for s in got[:5]] == [8, 8, 8, 8, 5]
    # negative control: finetune's own order puts other samples in the windows
    default = [sorted(w.samples) for e in range(3) for w in WindowSpec(37, 1, 8, 1, order_seed).epoch(e, 0)]
    assert [sorted(s) for s in got] != default


def test_trainer_order_depends_on_seed_and_epoch_only():
    base = [sorted(w.samples) for w in WindowSpec(103, 24, 1, 1, 7, sample_order="trainer").epoch(1, 0)]
    for b, n, w in [(3, 8, 1), (6, 2, 2), (1, 12, 2)]:
        assert [sorted(x.samples) for x in WindowSpec(103, b, n, w, 7, sample_order="trainer").epoch(1, 0)] == base
    assert trainer_epoch_order(103, 7, 1) == trainer_epoch_order(103, 8, 0)  # the Trainer seeds with seed + epoch
    assert trainer_epoch_order(103, 7, 1) != trainer_epoch_order(103, 7, 0)


def test_elastic_resume_keeps_the_trainers_windows(tmp_path):
    """A run in the Trainer's order, resumed mid-epoch at another micro-batch, takes the uninterrupted run's steps;
    its window hashes are the Trainer order's."""
    import json

    from finetune.cli import run_main
    from finetune.reproduce.compare import compare_runs
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
                for w in WindowSpec(n_train, 8, 1, 1, 7, sample_order="trainer").epoch(e, 0)]
    assert hashes == expected
    assert hashes != [membership_hash(w.samples) for e in range(2) for w in WindowSpec(n_train, 8, 1, 1, 7).epoch(e, 0)]


# ---------------------------------------------------------------------------------------------------------------
# the worked example at test size: a Trainer baseline, imported, replayed at micro-batch 2, compared

EXAMPLE = ROOT / "examples" / "trainer-baseline"
AXOLOTL = ROOT / "tests" / "assets" / "axolotl-tiny-llama-lora.yaml"


def verdict_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("verdict: "))


def finetune_cli(capsys, *args) -> tuple[int, str, str]:
    """``finetune ARGS`` in this process: (exit code, stdout, stderr)."""
    from finetune.cli import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def baseline(trainer_example_run):
    return trainer_example_run


def train_example(root, *extra):
    """The example's Trainer baseline (examples/trainer-baseline/train_with_trainer.py, given ``extra`` arguments) in
    ``root/baseline`` and its base recipe, pointing at the tiny model the script wrote."""
    import runpy
    import sys

    import yaml

    argv = sys.argv
    sys.argv = ["train_with_trainer.py", "--out", str(root / "baseline"), "--model", str(root / "tiny-llama"),
                *extra]
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
    said = [line for line in out.splitlines() if not line.startswith("verdict recorded in ")]  # compare's own
    assert said[-2].startswith("verdict: equivalent — rests on ") and said[-1].startswith("curves:")
    for check in ("effective batch", "optimizer steps", "window samples", "lr schedule", "loss curve", "grad norm",
                  "clipping", "eval loss", "weights"):
        assert lines[check].startswith("ok"), out
    assert "identical at all 26 logged steps" in lines["lr schedule"]
    from finetune.reproduce.baseline_check import compare_with_baseline

    c = compare_with_baseline(baseline / "baseline", replayed)
    details = {name: detail for name, _, detail, _ in c.checks}
    weights = float(details["weights"].split("relative L2 ")[1].split()[0])
    loss = float(details["loss curve"].split("difference ")[1].split()[0])
    norm = float(details["grad norm"].split("difference ")[1].split()[0])
    assert weights <= 1e-5 and loss <= 1e-4 and norm <= 1e-4


def test_an_eval_loss_of_one_batch_is_still_judged(baseline, replayed, tmp_path, capsys):
    """The twin of the Trainer's several-batch eval loss, which is said and not judged: one eval batch, whose mean is
    the token mean, moved by 1e-3 reads "differs"."""
    import json
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(baseline / "baseline", moved)
    state = json.loads((moved / "trainer_state.json").read_text())
    for entry in state["log_history"]:
        if "eval_loss" in entry:
            entry["eval_loss"] *= 1.001
    (moved / "trainer_state.json").write_text(json.dumps(state))
    code, out, _ = finetune_cli(capsys, "compare", moved, replayed)
    assert code == 1 and "verdict: differs — eval loss" in out, out


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
    verdict = verdict_line(out)
    assert verdict.startswith("verdict: equivalent — rests on ") and \
        verdict.endswith("not checkable from the model card: lr schedule, training loss, weights"), out
    code, out, _ = finetune_cli(capsys, "import", baseline / "baseline" / "README.md", "--recipe",
                                baseline / "recipe.yaml", "-o", baseline / "from-card.yaml")
    assert code == 0
    assert "training.warmup_steps                 3" in out  # ratio 0.1 × 26 steps (the results table's last row)
    assert "not in the model card, the recipe's values kept: weight_decay (Trainer default 0.0)" in out



# ---------------------------------------------------------------------------------------------------------------
# finetune import: each source kind


def _folder_variant(baseline, tmp_path, kind):
    """The baseline as each source kind a user may hold."""
    import shutil

    folder = baseline / "baseline"
    if kind == "folder":
        return folder
    if kind == "checkpoint folder (training_args.bin only)":
        out = tmp_path / "out"
        shutil.copytree(folder, out / "checkpoint-26")
        (out / "checkpoint-26" / "training_args.json").unlink()
        (out / "checkpoint-26" / "README.md").unlink()
        (out / "checkpoint-26" / "model.safetensors").unlink()
        return out
    if kind == "model card":
        return folder / "README.md"
    if kind == "args JSON":
        return folder / "training_args.json"
    return AXOLOTL


@pytest.mark.parametrize("kind", ["folder", "checkpoint folder (training_args.bin only)", "model card", "args JSON",
                                  "axolotl YAML"])
def test_import_each_source_kind(baseline, tmp_path, capsys, kind):
    import yaml

    out = tmp_path / "recipe.yaml"
    code, stdout, err = finetune_cli(capsys, "import", _folder_variant(baseline, tmp_path, kind), "--recipe",
                                     baseline / "recipe.yaml", "-o", out)
    assert code == 0, err
    t = yaml.safe_load(out.read_text())["training"]
    assert (t["effective_batch_size"], t["learning_rate"], t["seed"], t["sample_order"], t["epochs"]) == \
        (16, 0.002, 42, "trainer", 2)
    if kind in ("args JSON", "axolotl YAML"):  # no step count in the source: the ratio is not carried ...
        assert "warmup_steps" not in t and "not carried: warmup ratio=0.1" in stdout
        code, stdout, _ = finetune_cli(capsys, "import", _folder_variant(baseline, tmp_path, kind), "--recipe",
                                       baseline / "recipe.yaml", "-o", out, "--steps", "26", "--force")
        t = yaml.safe_load(out.read_text())["training"]  # ... until the steps are given
    # ceil(26 × 0.1), as transformers rounds; axolotl rounds down: int(26 × 0.1)
    assert t["warmup_steps"] == (2 if kind == "axolotl YAML" else 3)
    if kind == "axolotl YAML":
        peft = yaml.safe_load(out.read_text())["peft"]
        assert (peft["enabled"], peft["r"], peft["alpha"], peft["target_modules"]) == \
            (True, 8, 16, ["q_proj", "v_proj"])
    if kind != "model card":
        assert t["weight_decay"] == 0.01
    assert stdout.splitlines()[1].split() == ["field", "value", "from"]


def test_training_args_bin_is_read_by_the_restricted_unpickler(baseline):
    from finetune.reproduce.sources.pickled_args import read_training_args_bin

    args = read_training_args_bin(baseline / "baseline" / "training_args.bin")
    assert (args["per_device_train_batch_size"], args["warmup_steps"], args["optim"], args["lr_scheduler_type"]) == \
        (8, 0.1, "adamw_torch", "linear")


class _Payload:
    def __reduce__(self):
        import os

        return os.system, (f"touch {_Payload.marker}",)


def test_a_pickle_with_a_foreign_class_is_refused(baseline, tmp_path, capsys):
    """A training_args.bin that would run a command: one line naming the class, exit 2, nothing run or written."""
    import shutil

    from tests.helpers import assert_one_error_line

    _Payload.marker = tmp_path / "ran"
    folder = tmp_path / "evil"
    shutil.copytree(baseline / "baseline", folder)
    (folder / "training_args.json").unlink()
    torch.save(_Payload(), folder / "training_args.bin")
    code, _, err = finetune_cli(capsys, "import", folder, "--recipe", baseline / "recipe.yaml",
                                "-o", tmp_path / "r.yaml")
    assert code == 2 and not (tmp_path / "r.yaml").exists() and not _Payload.marker.exists()
    assert_one_error_line(err, "system (a name of Python's standard library): not training arguments")
    # negative control: the file really runs the command when unpickled as is
    torch.load(folder / "training_args.bin", weights_only=False)
    assert _Payload.marker.exists()


# ---------------------------------------------------------------------------------------------------------------
# bad input: one line, exit 2, nothing written


def _bad_state(folder, text):
    folder.mkdir()
    (folder / "trainer_state.json").write_text(text)
    return folder


@pytest.mark.parametrize("case, message", [
    ("state not JSON", "trainer_state.json is not JSON"),
    ("no log_history", "has no log_history"),
    ("card without hyperparameters", "has no 'Training hyperparameters' list"),
    ("model differs", "differs from the recipe's model.name_or_path: hidden_size 64 vs 32"),
])
def test_bad_baselines_are_refused_with_one_line(baseline, tmp_path, capsys, case, message):
    import json

    import yaml

    from tests.helpers import assert_one_error_line

    source, recipe = baseline / "baseline", baseline / "recipe.yaml"
    if case == "state not JSON":
        source = _bad_state(tmp_path / "f", '{"log_history": [')
    elif case == "no log_history":
        source = _bad_state(tmp_path / "f", '{"global_step": 3}')
    elif case == "card without hyperparameters":
        source = tmp_path / "README.md"
        source.write_text("# a model\n\n## Training procedure\n\nMore information needed\n")
    else:  # the recipe fine-tunes a narrower model than the baseline did
        other = tmp_path / "other-model"
        other.mkdir()
        config = json.loads((baseline / "tiny-llama" / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, "hidden_size": 32}))
        raw = yaml.safe_load(recipe.read_text())
        raw["model"]["name_or_path"] = str(other)
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(yaml.safe_dump(raw))
    code, _, err = finetune_cli(capsys, "import", source, "--recipe", recipe, "-o", tmp_path / "r.yaml")
    assert code == 2 and not (tmp_path / "r.yaml").exists()
    assert_one_error_line(err, message)
    if case != "model differs":  # compare refuses the same baseline alike
        code, out, err = finetune_cli(capsys, "compare", source, baseline / "mine")
        assert code == 2 and out == ""
        assert_one_error_line(err, message)


def test_compare_refuses_a_baseline_of_another_model(baseline, replayed, tmp_path, capsys):
    import json
    import shutil

    from tests.helpers import assert_one_error_line

    mine = tmp_path / "mine"
    shutil.copytree(replayed, mine)
    config = json.loads((mine / "model" / "config.json").read_text())
    (mine / "model" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    code, out, err = finetune_cli(capsys, "compare", baseline / "baseline", mine)
    assert code == 2 and out == ""
    assert_one_error_line(err, "the baseline's model differs from")


def test_unknown_axolotl_keys_are_listed_not_fatal(baseline, tmp_path, capsys):
    import yaml

    raw = yaml.safe_load(AXOLOTL.read_text())
    source = tmp_path / "axolotl.yaml"
    source.write_text(yaml.safe_dump({**raw, "rope_theta_schedule": 3, "my_plugin_flag": True}))
    code, out, err = finetune_cli(capsys, "import", source, "--recipe", baseline / "recipe.yaml",
                                  "-o", tmp_path / "r.yaml")
    assert code == 0 and (tmp_path / "r.yaml").is_file()
    assert "warning: axolotl.yaml: keys finetune does not know, not read: my_plugin_flag, rope_theta_schedule" in err
    # the shipped asset holds none: every key of axolotl's documented example is known
    assert "warning" not in finetune_cli(capsys, "import", AXOLOTL, "--recipe", baseline / "recipe.yaml",
                                         "-o", tmp_path / "r2.yaml")[2]


# ---------------------------------------------------------------------------------------------------------------
# compare: logging every K steps, the stated band, and a TRL arguments JSON


def _edited_folder(baseline, tmp_path, state=None, args=None):
    import json
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(baseline / "baseline", folder)
    if state is not None:
        path = folder / "trainer_state.json"
        path.write_text(json.dumps(state(json.loads(path.read_text()))))
    if args is not None:
        path = folder / "training_args.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **args}))
    return folder


def _log_every(k):
    """The baseline's log as the Trainer writes it with logging_steps k: each entry the mean of the k steps'
    losses, at every k-th step (and the last)."""
    def edit(state):
        steps = [e for e in state["log_history"] if "loss" in e]
        logged = []
        for end in [s for s in range(k, len(steps) + 1, k)] + ([len(steps)] if len(steps) % k else []):
            start = logged[-1]["step"] if logged else 0
            losses = [e["loss"] for e in steps[start:end]]
            logged.append({**steps[end - 1], "loss": sum(losses) / len(losses)})
        rest = [e for e in state["log_history"] if "loss" not in e]
        return {**state, "logging_steps": k, "log_history": logged + rest}
    return edit


def test_a_log_every_k_steps_is_held_against_our_mean(baseline, replayed, tmp_path, capsys):
    folder = _edited_folder(baseline, tmp_path, state=_log_every(4), args={"logging_steps": 4})
    code, out, _ = finetune_cli(capsys, "compare", folder, replayed)
    assert code == 0, out
    assert "at 7 logged steps (each a mean over the 4 steps since the previous log), tolerance 0.0001" in out
    # negative control: a log holding the single step's loss instead of the mean is caught
    single = _edited_folder(baseline, tmp_path / "single", args={"logging_steps": 4}, state=lambda s: {
        **_log_every(4)(s), "log_history": [e for e in s["log_history"] if "loss" not in e or e["step"] % 4 == 0
                                            or e["step"] == 26]})
    code, out, _ = finetune_cli(capsys, "compare", single, replayed)
    assert code == 1 and "verdict: differs — loss curve" in out


def test_a_mixed_precision_baseline_is_held_to_a_stated_band(baseline, replayed, tmp_path, capsys):
    """A bf16 baseline: its loss and grad norm are held to the stated band, and an fp32 replay of it is another run
    (the settings layer says so)."""
    folder = _edited_folder(baseline, tmp_path, args={"bf16": True})
    code, out, _ = finetune_cli(capsys, "compare", folder, replayed)
    assert code == 1, out
    assert ("tolerance 0.01 (band: mixed precision (bf16 baseline, no here) rounds each side differently; an assumed "
            "band: measure the floor on this hardware with --floor TWIN (this reproduction at another --batch-size))"
            in out)
    assert verdict_line(out).startswith("verdict: differs — settings: training.mixed_precision bf16 in the "
                                           "baseline vs no; loss held to 0.01, not 0.0001: mixed precision"), out


def test_a_trl_args_json(baseline, tmp_path, capsys):
    import json

    import yaml

    source = tmp_path / "sft_config.json"
    source.write_text(json.dumps({
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "learning_rate": 1e-4,
        "lr_scheduler_type": "cosine", "warmup_steps": 10, "num_train_epochs": 1, "max_steps": -1,
        "optim": "adamw_torch_fused", "adam_beta2": 0.95, "seed": 3, "bf16": True, "max_length": 48,
        "packing": True, "neftune_noise_alpha": 5, "label_smoothing_factor": 0.0}))
    code, out, err = finetune_cli(capsys, "import", source, "--recipe", baseline / "recipe.yaml",
                                  "-o", tmp_path / "r.yaml")
    assert code == 0, err
    raw = yaml.safe_load((tmp_path / "r.yaml").read_text())
    t = raw["training"]
    assert (t["effective_batch_size"], t["lr_scheduler"], t["warmup_steps"], t["optimizer"], t["betas"],
            t["mixed_precision"], raw["data"]["seq_len"]) == (16, "cosine", 10, "adamw", [0.9, 0.95], "bf16", 48)
    assert "sample_order" not in t  # packed rows: not the Trainer's permutation of the samples
    assert "not carried: neftune_noise_alpha=5 — finetune has no NEFTune" in out
    assert "not carried: packing=True — it packs the whole data set before sampling" in out
    assert "label_smoothing" not in out  # at the Trainer's default: nothing to say


def test_import_without_a_base_recipe(baseline, tmp_path, capsys):
    """The base model the source names, in a clm recipe, and a line saying the data set is not carried; a source
    that names no base model still gives the recipe of its training settings, with one line saying what is
    missing."""
    import yaml

    code, out, err = finetune_cli(capsys, "import", AXOLOTL, "-o", tmp_path / "r.yaml")
    assert code == 0, err
    raw = yaml.safe_load((tmp_path / "r.yaml").read_text())
    assert (raw["task"], raw["model"]["name_or_path"]) == ("clm", "runs/tiny-llama")
    assert "not carried: the data set=unknown — not in the axolotl YAML" in out
    card = tmp_path / "README.md"
    card.write_text("\n".join(line for line in (baseline / "baseline" / "README.md").read_text().splitlines()
                               if not line.startswith("base_model")))
    code, out, err = finetune_cli(capsys, "import", card, "-o", tmp_path / "c.yaml")
    assert code == 0, err
    raw = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert raw["training"]["learning_rate"] == 0.002 and "name_or_path" not in raw["model"]
    assert err.strip().splitlines() == [
        "missing: model.name_or_path: the baseline does not name the model it fine-tuned; add it (--set "
        "model.name_or_path=MODEL when you run) or give --recipe BASE",
        "assumed: peft — the model card does not say whether it trained LoRA adapters (no adapter_config.json, no "
        "card's library_name): the recipe's peft section"]


def test_compare_names_the_baselines_dropped_gradients_and_only_where_the_files_show_them(baseline, replayed,
                                                                                            tmp_path, capsys):
    """The baseline under ms-swift's zero2_offload.json (as a dict, as the Trainer's arguments keep it) and, in
    wandb's pip freeze, DeepSpeed 0.16.4: compare names the dropped gradients beside its verdict; the same folder
    with DeepSpeed 0.19.0 (the fix) says nothing of them, and the offload itself changes no verdict."""
    import json

    config = json.loads((ROOT / "tests" / "assets" / "corpus" / "deepspeed" /
                         "ms-swift__swift__config__zero2_offload.json").read_text())
    said = {}
    for version in ("0.16.4", "0.19.0"):
        folder = _edited_folder(baseline, tmp_path / version, args={"deepspeed": config})
        freeze = folder / "wandb" / "run-20250101_000000-abcd1234" / "files"
        freeze.mkdir(parents=True)
        (freeze / "requirements.txt").write_text(f"accelerate==1.2.1\ndeepspeed=={version}\n")
        said[version] = finetune_cli(capsys, "compare", folder, replayed)
    code, out, _ = said["0.16.4"]
    assert "deepspeed 0.16.4" in out and "DeepSpeed PRs #7967, #7981" in out and "expect differs" in out, out
    code, out, _ = said["0.19.0"]
    assert code == 0 and "#7967" not in out and verdict_line(out).startswith("verdict: equivalent"), out
