"""The CLI as a user runs it: `accelerate launch finetune/run.py --recipe …`, its outputs and its errors."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from finetune.cli import main, run_main
from finetune.errors import ConfigError
from finetune.loading import load_recipe
from finetune.registry import list_recipes
from tests.helpers import ACCELERATE, ENV, ROOT, TINY, assert_one_error_line, cli


def test_minilm_sentiment_through_accelerate_launch(tmp_path):
    out = tmp_path / "run"
    proc = cli("--recipe", "minilm-sentiment", "--max-steps", "3", "--batch-size", "4", "--grad-accum-steps", "2",
               "--set", "data.limit=40", "--output-dir", str(out),
               launcher=(ACCELERATE, "launch", "--num_processes", "1", "--num_machines", "1",
                         "--mixed_precision", "no", "--dynamo_backend", "no"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Effective batch size: 8 (4 × 2)" in proc.stdout
    history = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3]
    assert all(h["samples"] == 8 for h in history)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 3 and 0 <= metrics["final_metrics"]["accuracy"] <= 1
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["training"]["batch_size"] == 4 and cfg["training"]["gradient_accumulation_steps"] == 2
    for png in ("loss.png", "lr.png", "grad_norm.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert (out / "model" / "model.safetensors").exists() and (out / "model" / "tokenizer.json").exists()


def test_list_recipes():
    proc = cli("--list-recipes")
    assert proc.returncode == 0
    names = [line.split()[0] for line in proc.stdout.splitlines()]
    assert names == [n for n, _ in list_recipes()] and "minilm-sentiment" in names
    assert all(len(line.split(None, 1)) == 2 for line in proc.stdout.splitlines())  # name, then a description


@pytest.mark.parametrize("name", [n for n, _ in list_recipes()])
def test_every_recipe_loads_and_validates(name):
    cfg = load_recipe(name)
    assert cfg.name == name and cfg.description
    # the baseline's batch is stated, so that --batch-size (or another process count) changes N, never the step
    assert cfg.training.effective_batch_size is not None, f"{name} states N, not its effective batch"
    text = (ROOT / "recipes" / f"{name}.yaml").read_text()
    assert text.startswith("# accelerate launch -q finetune/run.py --recipe " + name)  # -q: an error is one line


def test_effective_batch_size_derives_n():
    cfg = load_recipe("minilm-sentiment", ["training.batch_size=4", "training.effective_batch_size=32"])
    from finetune.startup import resolve_accumulation

    assert resolve_accumulation(cfg.training, processes=1) == 8
    assert resolve_accumulation(cfg.training, processes=2) == 4
    with pytest.raises(ConfigError, match="training.effective_batch_size: 32 is not a multiple"):
        resolve_accumulation(load_recipe("minilm-sentiment", ["training.batch_size=5"]).training, 1)


def test_mixed_precision_no_survives_yaml(tmp_path):
    # YAML 1.1 reads a bare `no` as false; `mixed_precision: no` must still mean "no", in a recipe or via --set
    assert load_recipe("clm-lion-long", ["training.mixed_precision=no"]).training.mixed_precision == "no"
    recipe = tmp_path / "r.yaml"
    raw = yaml.safe_load(open(TINY).read())
    raw["training"]["mixed_precision"] = "no"
    recipe.write_text(yaml.safe_dump(raw).replace("mixed_precision: 'no'", "mixed_precision: no"))
    assert "mixed_precision: no\n" in recipe.read_text()
    assert load_recipe(str(recipe)).training.mixed_precision == "no"
    with pytest.raises(ConfigError, match="training.mixed_precision: got True"):
        load_recipe("clm-lion-long", ["training.mixed_precision=yes"])


# files the bad-input cases name as {tmp}/<name>
FILES = {
    "empty.csv": "",
    "bad.jsonl": '{"text": "good", "label": 1}\n{"text": "bad", "label": \n',
    "labels.csv": "text,label\ngood,1\nbad,7\n",
    "nolabel.csv": "text,polarity\ngood,1\nbad,0\n",
    "badyaml.yaml": "task: sentiment\ntraining: [unclosed\n",
    "badtask.yaml": "task: nope\n",
    "one.csv": "text,label\ngood,1\n",
    "nan.csv": "text,label\ngood,1\nbad,\nfine,0\n",
    "strings.csv": "text,label\ngood,pos\nbad,neg\n",
    "notext.csv": "text,label\ngood,1\n,0\nfine,0\n",
    "header.csv": "text,label\n",
    "latin1.csv": b"text,label\ncaf\xe9,1\nbad,0\n",
    "garbage.csv": bytes(range(256)) * 8,
    "binary.yaml": bytes(range(256)) * 8,
    "empty.yaml": "",
    "list.yaml": "- task: sentiment\n- task: clm\n",
    "twice.yaml": "task: sentiment\ntraining:\n  batch_size: 4\n  batch_size: 8\n",
    "dir/": None,
    "emptyrun/history.jsonl": "",
    "badrun/history.jsonl": '{"step": 1, "loss": 0.5, "lr": 0.1, "grad_norm": 1.0}\n{"step": 2, "loss": \n',
}

# (arguments, expected message); "{tmp}" is replaced by the test's temporary directory. Arguments starting with a
# command (plan, plot, search) go to `finetune`, the others to `finetune run`.
BAD = [
    (["--recipe", "nope"], "recipe: unknown recipe 'nope'"),
    (["--recipe", "{tmp}/missing.yaml"], "recipe: file"),
    (["--recipe", "minilm-sentiment", "--set", "training.bogus=1"], "training.bogus: unknown key"),
    (["--recipe", "minilm-sentiment", "--batch-size", "eight"], "training.batch_size: got 'eight'"),
    (["--recipe", "minilm-sentiment", "--grad-accum-steps", "0"], "training.gradient_accumulation_steps: got 0"),
    (["--recipe", "minilm-sentiment", "--lr", "-0.1"], "training.learning_rate: got -0.1"),
    (["--recipe", "minilm-sentiment", "--batch-size", "-4"], "training.batch_size: got -4"),
    (["--recipe", "minilm-sentiment", "--epochs", "0"], "training.epochs: got 0"),
    (["--recipe", "minilm-sentiment", "--mixed-precision", "fp8"], "training.mixed_precision: got 'fp8'"),
    (["--recipe", "minilm-sentiment", "--set", "training.max_grad_norm=0"], "training.max_grad_norm: got 0"),
    (["--recipe", "minilm-sentiment", "--set", "training.warmup_steps=-1"], "training.warmup_steps: got -1"),
    (["--recipe", "minilm-sentiment", "--effective-batch-size", "30", "--batch-size", "4"],
     "training.effective_batch_size: 30 is not a multiple"),
    (["--recipe", "minilm-sentiment", "--effective-batch-size", "32", "--grad-accum-steps", "2"],
     "--effective-batch-size: give it or --grad-accum-steps, not both"),
    (["--recipe", "minilm-sentiment", "--set", "model.dropout=1.5"], "model.dropout: got 1.5"),
    (["--recipe", "minilm-sentiment", "--set", "data.val_fraction=1.5"], "data.val_fraction: got 1.5"),
    (["--recipe", "minilm-sentiment", "--save-every", "0"], "output.save_every: got 0"),
    (["--recipe", "minilm-sentiment", "--set", "data.source=/no/such/file.csv"], "data.source: file"),
    (["--recipe", "minilm-sentiment", "--set", "optimizer=adam"], "--set optimizer"),
    (["--recipe", "minilm-sentiment", "--set", "training.lr"], "--set training.lr: expected section.key=value"),
    (["--recipe", "minilm-sentiment", "--epochs", "1", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--recipe", TINY, "--batch-size", "500"], "training.batch_size: 500 is larger than the 120 training samples"),
    (["--recipe", TINY, "--set", "data.source={tmp}/empty.csv"], "data.source: file {tmp}/empty.csv is empty"),
    (["--recipe", TINY, "--set", "data.source={tmp}/bad.jsonl"], "data.source: {tmp}/bad.jsonl line 2 is not JSON ("),
    (["--recipe", TINY, "--set", "data.source={tmp}/labels.csv"],
     "data.label_field: line 3 has label 7; labels must be integers in [0, 1]"),
    (["--recipe", TINY, "--set", "data.source={tmp}/nolabel.csv"], "data.label_field: no column 'label'"),
    (["--recipe", TINY, "--mixed-precision", "fp16", "--set", "training.initial_loss_scale=0"],
     "training.initial_loss_scale: got 0"),
    (["--recipe", TINY, "--resume", "latest"], "resume: no checkpoint in"),
    (["--recipe", TINY, "--resume", "{tmp}/nowhere/checkpoints/step-000004"], "resume: checkpoint"),
    (["--recipe", "{tmp}/badyaml.yaml"], "recipe: {tmp}/badyaml.yaml is not valid YAML"),
    (["--recipe", "{tmp}/badtask.yaml"], "task: got 'nope'; allowed:"),
    # inputs that crashed with a traceback
    (["--recipe", TINY, "--set", "data.source={tmp}/one.csv"], "data.val_fraction: 0.1 of 1 sample leaves none"),
    (["--recipe", TINY, "--set", "data.source={tmp}/nan.csv"], "data.label_field: line 3 has label None"),
    (["--recipe", TINY, "--set", "data.source={tmp}/strings.csv"], "data.label_field: line 2 has label 'pos'"),
    (["--recipe", TINY, "--set", "data.source={tmp}/notext.csv"], "data.text_field: line 3 has no text"),
    (["--recipe", TINY, "--seed", "-1"], "training.seed: got -1; must be an integer in [0, 2**32 - 1]"),
    (["--recipe", TINY, "--seed", str(2**32)], f"training.seed: got {2**32}"),
    (["--recipe", TINY, "--set", "model.name_or_path={tmp}/nomodel"],
     "model.name_or_path: cannot load {tmp}/nomodel: no such directory"),
    (["--recipe", TINY, "--output-dir", "/proc/finetune-test/run"], "output.dir: cannot write /proc/finetune-test"),
    (["--recipe", TINY, "--output-dir", "{tmp}/one.csv/run"], "output.dir: cannot write {tmp}/one.csv/run"),
    (["--recipe", "{tmp}/binary.yaml"], "recipe: {tmp}/binary.yaml is not a text file"),
    (["plot", "{tmp}/emptyrun"], "plot: {tmp}/emptyrun/history.jsonl holds no optimizer steps"),
    (["plot", "{tmp}/badrun"], "plot: {tmp}/badrun/history.jsonl line 2 is not a step record"),
    # silent misconfiguration
    (["--recipe", TINY, "--grad-accum-steps", "3", "--set", "training.effective_batch_size=8"],
     "training.gradient_accumulation_steps: 3 contradicts training.effective_batch_size 8, which makes N = 2"),
    (["--recipe", "{tmp}/twice.yaml"], "key 'batch_size' is given twice (lines 3 and 4)"),
    (["plan", "--recipe", TINY, "--gpu", "t4", "--set", "training.effective_batch_size=100000000", "--set",
      "training.gradient_accumulation_steps=null"],
     "training.effective_batch_size: 100000000 is larger than the 120 training samples"),
    (["plan", "--recipe", TINY, "--gpu", "0GiB"], "--gpu: got '0GiB'"),
    # plan takes run's --effective-batch-size and --data, checked the same way
    (["plan", "--recipe", TINY, "--gpu", "t4", "--effective-batch-size", "0"], "training.effective_batch_size: got 0"),
    (["plan", "--recipe", TINY, "--gpu", "t4", "--effective-batch-size", "500"],
     "training.effective_batch_size: 500 is larger than the 120 training samples"),
    (["plan", "--recipe", TINY, "--gpu", "t4", "--data", "{tmp}/empty.csv"],
     "data.source: file {tmp}/empty.csv is empty"),
    (["--recipe", TINY, "--data", "{tmp}/empty.csv"], "data.source: file {tmp}/empty.csv is empty"),
    (["search", "--recipe", TINY, "--trials", "1", "--param", "lr=loguniform:1e-4:1e-3", "--metric", "f1score",
      "--output-dir", "{tmp}/out"], "--metric: the recipe reports no validation 'f1score'; it reports loss, accuracy"),
    # messages that misled
    (["--recipe", "{tmp}/empty.yaml"], "recipe: {tmp}/empty.yaml is empty"),
    (["--recipe", "{tmp}/list.yaml"], "recipe: {tmp}/list.yaml holds a YAML list"),
    (["--recipe", TINY, "--set", "data.source={tmp}/garbage.csv"],
     "data.source: cannot read {tmp}/garbage.csv: Error tokenizing"),
    (["--recipe", TINY, "--set", "data.source={tmp}/latin1.csv"],
     "data.source: cannot read {tmp}/latin1.csv: not UTF-8 text (byte 0xe9"),
    (["--recipe", TINY, "--set", "data.source={tmp}/header.csv"], "data.source: {tmp}/header.csv holds no data rows"),
    (["--recipe", TINY, "--set", "data.source={tmp}/dir"], "data.source: {tmp}/dir is a directory"),
    (["--recipe", "{tmp}/dir/"], "recipe: {tmp}/dir/ is a directory"),
]

# These run as their own process: config, argparse, data and resume errors through the plain script, and one
# through the README's `accelerate launch -q` (its exit code is 1: the launcher's, whatever the script's); the rest
# call main() in this process.
IN_A_PROCESS = {0: "accelerate", 17: "python", 20: "python", 22: "python", 24: "python", 26: "python"}
ACCELERATE_Q = (ACCELERATE, "launch", "-q", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no")


def _files(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("index,args,message", [(i, *case) for i, case in enumerate(BAD)],
                         ids=[f"{i:02d}-" + m.split(":")[0] for i, (_, m) in enumerate(BAD)])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, index, args, message):
    for name, content in FILES.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.mkdir(exist_ok=True)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    command = args[0] if not args[0].startswith("-") else "run"
    if command == "run" and ("data.source={tmp}" in " ".join(args)):
        args = [*args, "--set", "data.limit=1000"]
    if command == "run" and "--output-dir" not in args:
        args = [*args, "--output-dir", "{tmp}/out"]
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    message = message.replace("{tmp}", str(tmp_path))
    out = tmp_path / "out"
    if "latest" in args:  # an existing run without checkpoints: its files must survive
        out.mkdir()
        (out / "history.jsonl").write_text("keep me\n")
    before = _files(tmp_path)
    if index in IN_A_PROCESS:  # as a user runs it: the exit code and stderr of a real process
        proc = cli(*args, launcher=ACCELERATE_Q if IN_A_PROCESS[index] == "accelerate" else (sys.executable,))
        code, stderr = proc.returncode, proc.stderr
        assert len(stderr.strip().splitlines()) == 1, stderr[-2000:]  # nothing else: no log, no progress bar
    else:  # the same entry point in this process (an exception escaping main() fails the test)
        capsys.readouterr()
        try:
            code = run_main(args) if command == "run" else main(args)
        except SystemExit as e:  # argparse
            code = e.code
        stderr = capsys.readouterr().err
    assert code == (1 if IN_A_PROCESS.get(index) == "accelerate" else 2), stderr[-2000:]
    assert_one_error_line(stderr, message)
    assert len(stderr.strip().splitlines()) <= 3, stderr[-2000:]
    assert _files(tmp_path) == before  # nothing written, nothing changed
    output_dir = args[args.index("--output-dir") + 1] if "--output-dir" in args else None
    assert "latest" in args or output_dir is None or not Path(output_dir).exists()
    assert not (tmp_path / "out").exists() or "latest" in args


def test_existing_run_is_not_overwritten(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "history.jsonl").write_text("keep me\n")
    proc = cli("--recipe", "minilm-sentiment", "--output-dir", str(out))
    assert proc.returncode == 2 and "output.dir:" in proc.stderr and "already holds files" in proc.stderr
    assert (out / "history.jsonl").read_text() == "keep me\n"
    f = tmp_path / "file"
    f.write_text("x")
    proc = cli("--recipe", "minilm-sentiment", "--output-dir", str(f))
    assert proc.returncode == 2 and f"output.dir: {f} is a file" in proc.stderr


def test_divergence_stops_with_one_line_naming_the_step(tmp_path):
    out = tmp_path / "run"
    proc = cli("--recipe", TINY, "--lr", "1e30", "--set", "training.max_grad_norm=null", "--set",
               "training.optimizer=sgd", "--output-dir", str(out))
    assert proc.returncode == 1
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and "non-finite gradient" in errors[0] and "optimizer step" in errors[0]
    assert "Traceback" not in proc.stderr
    proc = cli("--recipe", TINY, "--lr", "1e30", "--set", "training.max_grad_norm=null", "--set",
               "training.optimizer=sgd", "--set", "training.on_nonfinite=skip", "--output-dir", str(tmp_path / "b"))
    assert proc.returncode == 0
    history = [json.loads(x) for x in (tmp_path / "b" / "history.jsonl").read_text().splitlines()]
    assert any(h["skipped"] for h in history)


def test_the_plotted_moving_average_is_the_runs_own(tmp_path, monkeypatch):
    """`finetune plot` draws the loss's moving average at the run's training.ema_beta (config.yaml), the average the
    progress bar shows; a NaN window (skipped) leaves it alone."""
    import matplotlib.axes

    from finetune.state import TrainState

    losses = [2.0, 1.0, float("nan"), 0.5, 0.25]
    (tmp_path / "history.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "loss": v, "lr": 0.1, "grad_norm": 1.0}) + "\n" for i, v in enumerate(losses)))
    (tmp_path / "config.yaml").write_text("training:\n  ema_beta: 0.5\n")
    drawn = {}
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda self, *a, **k: drawn.setdefault(k.get("label"), a[1]) and real(self, *a, **k))
    assert main(["plot", str(tmp_path)]) == 0
    state = TrainState()
    expected = [state.update_ema(v, 0.5) for v in losses]
    assert drawn["EMA (0.5)"] == expected
    default = TrainState()
    assert expected != [default.update_ema(v, 0.9) for v in losses]  # the default would draw another curve


def test_clm_concatenate_was_data_packing(tmp_path):
    """clm's data.packing (concatenate the corpus, cut blocks) is data.concatenate now: it meant something else than
    training.packing. The old key is carried with a note for a release; both keys with different values are one
    problem naming both; the new key alone says nothing."""
    recipe = tmp_path / "c.yaml"
    model = "model: {config: {model_type: gpt2, n_layer: 1, n_embd: 32, n_head: 2, n_positions: 64}}\n"
    recipe.write_text(f"task: clm\n{model}data: {{packing: true}}\n")
    old = load_recipe(str(recipe))
    assert old.data.concatenate is True and old.notes == [
        "note: data.packing moved to data.concatenate; the old key still works in this release and will be removed "
        "in a later one"]
    recipe.write_text(f"task: clm\n{model}data: {{concatenate: true}}\n")
    new = load_recipe(str(recipe))
    assert new.data.concatenate is True and new.notes == [] and new.to_dict() == old.to_dict()
    recipe.write_text(f"task: clm\n{model}data: {{packing: true, concatenate: false}}\n")
    with pytest.raises(ConfigError, match="data.concatenate: False here and True in data.packing, its old place"):
        load_recipe(str(recipe))


def test_a_checkpoint_saved_before_a_key_moved_resumes_without_a_false_warning(tmp_path):
    """A checkpoint's settings name a moved key in its old place (data.packing); resuming with the new name and the
    same value warns of nothing, and another value is still named (the control)."""
    from types import SimpleNamespace

    from finetune.checkpoint import check_resume
    from finetune.config import flatten
    from finetune.shape import Shape

    recipe = tmp_path / "c.yaml"
    recipe.write_text("task: clm\nmodel: {config: {model_type: gpt2, n_layer: 1, n_embd: 32, n_head: 2, "
                      "n_positions: 64}}\ndata: {concatenate: true}\n")
    cfg = load_recipe(str(recipe))
    before = {("data.packing" if k == "data.concatenate" else k): v for k, v in flatten(cfg.to_dict()).items()}
    saved = SimpleNamespace(settings=before, effective_batch_size=8, processes=1, engine="ddp", path=tmp_path,
                            state=SimpleNamespace(next_window=0))
    shape = Shape(micro_batch=8, accumulation=1, processes=1)
    assert check_resume(saved, cfg.to_dict(), shape) == []
    other = load_recipe(str(recipe), ["data.concatenate=false"])
    notes = check_resume(saved, other.to_dict(), shape)
    assert len(notes) == 1 and "data.concatenate (True → False)" in notes[0], notes


def test_the_command_line_imports_reproduce_only_for_its_commands():
    """``finetune run``'s start does not pay for the reproduce package: importing the command line and building the
    parser for ``run`` loads none of it; building it for ``compare`` does (the negative control: the probe sees the
    package when it is there)."""
    import subprocess

    probe = ("import sys; from finetune.cli import build_parser\n"
             "loaded = lambda: sorted(m for m in sys.modules if m.startswith('finetune.reproduce'))\n"
             "print(loaded()); build_parser('finetune', 'run'); print(loaded())\n"
             "build_parser('finetune', 'compare'); print(len(loaded()))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported, run, compare = proc.stdout.splitlines()
    assert imported == run == "[]", proc.stdout
    assert int(compare) > 0, proc.stdout
