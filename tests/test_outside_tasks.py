"""A task outside the package: a task file beside the recipe in the user's own folder (``task: ./my_task.py``) or an
importable module (``task: mypkg.wave``), trained through ``accelerate launch finetune/run.py`` on 1 and 2
processes, and refused, like a built-in task, with one line naming ``task`` (or the task's own field)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune.cli import run_main
from finetune.errors import ConfigError
from finetune.loading import load_recipe
from finetune.registry import available_tasks
from tests.helpers import ACCELERATE, ENV, ROOT, RUN, assert_same_history, cli

TASK = '''
"""An MLP learns sin(x), built from the recipe's model and data sections."""
from dataclasses import dataclass

import torch
from torch import nn

from finetune.config import BaseDataConfig, BaseModelConfig, doc
from finetune.job import Job


@dataclass
class ModelConfig(BaseModelConfig):
    hidden: int = doc("hidden units", 8)


@dataclass
class DataConfig(BaseDataConfig):
    n: int = doc("samples generated", 40)


def validate(cfg, problems):
    if cfg.model.hidden < 1:
        problems.append(f"model.hidden: got {cfg.model.hidden}; must be an integer >= 1")


class Net(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x, y):
        pred = self.body(x).squeeze(-1)
        return {"loss": (pred - y).pow(2).mean(), "pred": pred}


def build(cfg):
    x = torch.rand(cfg.data.n, 1, generator=torch.Generator().manual_seed(0)) * 6
    samples = [{"x": a, "y": torch.sin(a[0])} for a in x]
    k = int(len(samples) * cfg.data.val_fraction)
    return Job(model=Net(cfg.model.hidden), train_data=samples[k:], val_data=samples[:k],
               eval_step=lambda m, batch, out: (out["pred"].tolist(), batch["y"].tolist()),
               compute_metrics=lambda p, r: {"mae": sum(abs(a - b) for a, b in zip(p, r)) / len(p)})
'''

# 32 training samples, windows of 8: 3 optimizer steps (N = 4 on one process, 2 on two)
RECIPE = {"model": {"hidden": 8}, "data": {"n": 40, "val_fraction": 0.2},
          "training": {"batch_size": 2, "effective_batch_size": 8, "learning_rate": 0.01, "max_steps": 3},
          "output": {"plots": False, "tracker": "none", "save_model": False}}
ONE = (ACCELERATE, "launch", "-q", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
       "--dynamo_backend", "no")
TWO = (ACCELERATE, "launch", "-q", "--config_file", str(ROOT / "accelerate_configs" / "multi_cpu_2.yaml"))
QUIET = {"OMP_NUM_THREADS": "1"}  # what the launcher would set (else Accelerate warns about it on each process)


def user_folder(root: Path, task: str = "./my_task.py", **sections) -> Path:
    """The user's folder: ``my_task.py`` and ``my_recipe.yaml`` (naming ``task``, with ``sections`` merged into the
    recipe's); returns the recipe's path."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "my_task.py").write_text(TASK)
    raw = {"task": task, **{k: {**RECIPE.get(k, {}), **v} for k, v in {**RECIPE, **sections}.items()}}
    (root / "my_recipe.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return root / "my_recipe.yaml"


def history(run: Path) -> list:
    return [json.loads(x) for x in (run / "history.jsonl").read_text().splitlines()]


def test_a_task_file_beside_the_recipe_trains_on_one_and_two_processes(tmp_path):
    recipe = user_folder(tmp_path / "mine")
    # as the README runs it: from the user's folder, the recipe by a relative path
    one = subprocess.run([*ONE, RUN, "--recipe", "./my_recipe.yaml", "--output-dir", str(tmp_path / "one")],
                         capture_output=True, text=True, env={**ENV, **QUIET}, cwd=recipe.parent, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "Effective batch size: 8 (2 × 4)" in one.stdout and "mae=" in one.stdout
    # from the checkout, the recipe by its absolute path: the task file is found from the recipe, not the cwd
    two = cli("--recipe", str(recipe), "--output-dir", str(tmp_path / "two"),
              launcher=(*TWO, "--main_process_port", "29551"), env=QUIET)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "Processes: 2" in two.stdout and "Effective batch size: 8 (2 × 2 × 2 processes)" in two.stdout
    h1, h2 = history(tmp_path / "one"), history(tmp_path / "two")
    assert [h["step"] for h in h1] == [1, 2, 3]
    assert_same_history(h2, h1)  # the same optimizer steps on 2 processes as on 1
    for run in ("one", "two"):
        metrics = json.loads((tmp_path / run / "metrics.json").read_text())
        assert metrics["optimizer_steps"] == 3 and 0 <= metrics["final_metrics"]["mae"] < 2
        saved = yaml.safe_load((tmp_path / run / "config.yaml").read_text())
        assert saved["task"] == str(recipe.parent / "my_task.py")  # the run's config names the file from anywhere
        assert saved["model"] == {"name_or_path": None, "dropout": None, "trust_remote_code": False, "hidden": 8}


def test_a_task_module_on_the_python_path_trains(tmp_path):
    package = tmp_path / "src" / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "wave.py").write_text(TASK)
    recipe = user_folder(tmp_path / "recipes", task="mypkg.wave")
    (recipe.parent / "my_task.py").unlink()  # the module, not a file beside the recipe
    out = tmp_path / "run"
    proc = cli("--recipe", str(recipe), "--output-dir", str(out), launcher=ONE,
               env={**QUIET, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path / 'src'}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [h["step"] for h in history(out)] == [1, 2, 3]
    assert yaml.safe_load((out / "config.yaml").read_text())["task"] == "mypkg.wave"
    # without its folder on the path (as in this process) the module is not found: one line naming task
    with pytest.raises(ConfigError) as refused:
        load_recipe(str(recipe))
    assert refused.value.problems == [
        f"task: got 'mypkg.wave'; allowed: one of {', '.join(available_tasks())}, an importable module "
        "(mypackage.my_task) or a .py file (./my_task.py, relative to the recipe's folder); no module mypkg.wave is "
        "importable here (is its folder on PYTHONPATH?)"]


BUILD_ONLY = '''
"""Builds its model and data in build() alone: no model or data settings."""
import torch

from finetune.job import Job


def build(cfg):
    x = torch.linspace(0, 3, 24).unsqueeze(-1)
    model = torch.nn.Linear(1, 1)
    return Job(model=model, train_data=[{"x": a, "y": 2 * a} for a in x],
               loss_fn=lambda m, b: (m(b["x"]) - b["y"]).pow(2).mean())
'''


def test_a_task_with_build_alone_trains_and_its_sections_are_empty(tmp_path):
    (tmp_path / "only.py").write_text(BUILD_ONLY)
    recipe = tmp_path / "only.yaml"
    recipe.write_text(yaml.safe_dump({"task": "./only.py", "training": {"batch_size": 2, "effective_batch_size": 8,
                                                                        "learning_rate": 0.05},
                                      "output": {"plots": False, "save_model": False}}))
    cfg = load_recipe(str(recipe))
    assert cfg.to_dict()["model"] == {} and cfg.to_dict()["data"] == {}
    assert run_main(["--recipe", str(recipe), "--output-dir", str(tmp_path / "run")]) == 0
    assert [h["step"] for h in history(tmp_path / "run")] == [1, 2, 3]
    # its sections hold no keys: a setting given there is refused, one line naming it
    with pytest.raises(ConfigError) as refused:
        load_recipe(str(recipe), ["model.hidden=8"])
    assert refused.value.problems[0].startswith("model.hidden: unknown key")


IN_ORDER = '''
"""Its samples must come in their own order, a window after the other (as GRPO's slots): Job.windows_in_order."""
from dataclasses import dataclass

import torch

from finetune.config import BaseModelConfig, doc
from finetune.job import Job


@dataclass
class ModelConfig(BaseModelConfig):
    in_order: bool = doc("sets Job.windows_in_order", True)


def build(cfg):
    x = torch.linspace(0, 3, 24).unsqueeze(-1)
    return Job(model=torch.nn.Linear(1, 1), train_data=[{"x": a, "y": 2 * a} for a in x],
               loss_fn=lambda m, b: (m(b["x"]) - b["y"]).pow(2).mean(), windows_in_order=cfg.model.in_order)
'''


@pytest.mark.parametrize("in_order, order, refused", [
    (True, "shuffle", "training.shuffle: this task's samples must come in order (Job.windows_in_order); set "
                      "training.shuffle=false"),
    (True, "sort_within_window", "training.sort_within_window: this task's samples must come in order "
                                 "(Job.windows_in_order); set training.sort_within_window=false"),
    (True, None, None),       # in order: trains
    (False, "shuffle", None),  # the negative control: without the flag, shuffled windows train
])
def test_a_task_whose_windows_come_in_order_refuses_shuffling_and_sorting(tmp_path, capsys, in_order, order,
                                                                         refused):
    (tmp_path / "ordered.py").write_text(IN_ORDER)
    recipe = tmp_path / "ordered.yaml"
    training = {"batch_size": 2, "effective_batch_size": 8, "learning_rate": 0.05, "shuffle": order == "shuffle",
                **({"sort_within_window": True} if order == "sort_within_window" else {})}
    recipe.write_text(yaml.safe_dump({"task": "./ordered.py", "model": {"in_order": in_order},
                                      "training": training, "output": {"plots": False, "save_model": False}}))
    out = tmp_path / "run"
    capsys.readouterr()
    code = run_main(["--recipe", str(recipe), "--output-dir", str(out)])
    stderr = capsys.readouterr().err
    if refused:
        assert code == 2 and stderr.strip().splitlines() == [f"error: {refused}"], stderr[-2000:]
        assert not out.exists()  # refused after the task is built, before anything is written
    else:
        assert code == 0, stderr[-2000:]
        assert [h["step"] for h in history(out)] == [1, 2, 3]


def test_a_relative_task_path_is_taken_from_the_recipes_folder(tmp_path, monkeypatch):
    recipe = user_folder(tmp_path / "a" / "b", task="../tasks/my_task.py")
    (tmp_path / "a" / "tasks").mkdir()
    (recipe.parent / "my_task.py").rename(tmp_path / "a" / "tasks" / "my_task.py")
    monkeypatch.chdir(tmp_path)
    cfg = load_recipe(str(recipe.relative_to(tmp_path)))
    assert cfg.task == str(tmp_path / "a" / "tasks" / "my_task.py")
    assert cfg.model.hidden == 8
    # --set task=… is taken from the recipe's folder too; a decoy of the same name in the working directory is not
    (tmp_path / "my_task.py").write_text("raise RuntimeError('the decoy was imported')\n")
    assert load_recipe(str(recipe), ["task=../tasks/my_task.py"]).task == cfg.task
    with pytest.raises(ConfigError, match="task: file .*/a/b/my_task.py not found"):
        load_recipe(str(recipe), ["task=./my_task.py"])


def test_built_in_tasks_are_found_by_name_as_before():
    cfg = load_recipe("minilm-sentiment")
    assert cfg.task == "sentiment" and type(cfg.model).__module__ == "finetune.tasks.sentiment"


# ---------------------------------------------------------------------------------------------------------------
# bad input: one line naming the field, exit 2, nothing written

# (task as the recipe gives it, files written beside the recipe, recipe sections, the start of the expected error
# line after "error: ", or of each line); {dir} is the recipe's folder
BAD = [
    ("./nope.py", {}, {}, "task: file {dir}/nope.py not found; allowed: one of clm, "),
    ("./my_task.txt", {}, {}, "task: got './my_task.txt'; a task file is a Python file ending in .py; allowed: "),
    ("nopkg.wave", {}, {}, "task: got 'nopkg.wave'; allowed: one of clm, "),
    ("./empty.py", {"empty.py": "x = 1\n"}, {},
     "task: {dir}/empty.py has no build; a task module defines build(cfg) -> Job, and ModelConfig / DataConfig "
     "dataclasses for the recipe's model / data sections if it has settings there"),
    ("./plain.py", {"plain.py": "class ModelConfig:\n    pass\nDataConfig = ModelConfig\ndef build(cfg):\n    pass\n"},
     {}, "task: {dir}/plain.py: ModelConfig and DataConfig must be a dataclass; a task module defines build(cfg)"),
    ("./syntax.py", {"syntax.py": "import torch\n\ndef build(cfg:\n    pass\n"}, {},
     "task: {dir}/syntax.py does not import: SyntaxError: '(' was never closed (syntax.py, line 3)"),
    ("./needs.py", {"needs.py": "import os\nimport no_such_dependency_x\n"}, {},
     "task: {dir}/needs.py does not import: ModuleNotFoundError: No module named 'no_such_dependency_x' "
     "(needs.py, line 2)"),
    ("./raises.py", {"raises.py": "import json\n\njson.loads('{')\n"}, {},
     "task: {dir}/raises.py does not import: JSONDecodeError: Expecting property name enclosed in double quotes: "
     "line 1 column 2 (char 1) (raises.py, line 3)"),
    (["my_task.py"], {}, {}, "task: got ['my_task.py']; allowed: one of clm, "),
    # the task's own sections: validated like a built-in task's
    ("./my_task.py", {}, {"model": {"hidden": "many", "bogus": 1}},  # every problem, one line each
     "model.hidden: got 'many'; expected an integer\n"
     "model.bogus: unknown key; allowed: name_or_path, dropout, trust_remote_code, hidden"),
    ("./my_task.py", {}, {"model": {"hidden": 0}}, "model.hidden: got 0; must be an integer >= 1"),  # its validate()
    ("./my_task.py", {}, {"data": {"val_fraction": 1.5}}, "data.val_fraction: got 1.5; must be in [0, 1)"),
]
IN_A_PROCESS = (0, 5, 10)  # as a user runs it, through the plain script; the rest call run_main in this process


@pytest.mark.parametrize("index", range(len(BAD)), ids=[f"{i:02d}-{m.split(':')[0]}" for i, (*_, m) in enumerate(BAD)])
def test_bad_task_input_is_one_line_per_problem_exit_2(tmp_path, capsys, index):
    task, files, sections, message = BAD[index]
    recipe = user_folder(tmp_path / "mine", task=task, **sections)
    for name, text in files.items():
        (recipe.parent / name).write_text(text)
    message = message.replace("{dir}", str(recipe.parent))
    args = ["--recipe", str(recipe), "--output-dir", str(tmp_path / "out")]
    if index in IN_A_PROCESS:
        proc = cli(*args, env=QUIET)
        code, stderr = proc.returncode, proc.stderr
    else:
        capsys.readouterr()
        code = run_main(args)
        stderr = capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    lines, expected = stderr.strip().splitlines(), message.splitlines()
    assert len(lines) == len(expected), stderr[-2000:]
    assert all(line.startswith("error: " + e) for line, e in zip(lines, expected)), stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_bad_task_stops_every_process_with_exit_2(tmp_path):
    """Two processes as a launcher starts them (torchrun's environment), each watched for its own exit code (a
    launcher would stop the slower one once the first has failed): both exit 2, and one line is printed, by rank 0."""
    recipe = user_folder(tmp_path / "mine", task="./syntax.py")
    (recipe.parent / "syntax.py").write_text("def build(cfg:\n    pass\n")
    env = {**ENV, **QUIET, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29552"}
    ranks = [subprocess.Popen([sys.executable, RUN, "--recipe", str(recipe), "--output-dir", str(tmp_path / "out")],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    outputs = [p.communicate(timeout=300) for p in ranks]
    assert [p.returncode for p in ranks] == [2, 2], outputs
    error = f"error: task: {recipe.parent}/syntax.py does not import: SyntaxError: '(' was never closed (syntax.py, " \
        "line 1)"
    assert outputs[0][1].strip().splitlines() == [error] and outputs[1][1].strip() == ""
    assert outputs[0][0] == outputs[1][0] == ""
    assert not (tmp_path / "out").exists()
    # and through accelerate launch: the same line once (the launcher's own failure report follows it)
    proc = cli("--recipe", str(recipe), "--output-dir", str(tmp_path / "out"),
               launcher=(*TWO, "--main_process_port", "29553"), env=QUIET)
    assert proc.returncode != 0
    assert [x for x in proc.stderr.splitlines() if x.startswith("error:")] == [error], proc.stderr[-3000:]
    assert not re.search(r'File ".*finetune/', proc.stderr)  # no traceback through finetune's code
    assert not (tmp_path / "out").exists()


def readme_example() -> dict:
    """The task file and the recipe of the README's "Add your own model" (wherever the docs keep it): name → text."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    blocks = [b for page in pages if page.is_file() for b in re.findall(r"```(?:python|yaml)\n(# (my_\w+\.\w+).*?)```",
                                                                              page.read_text(), re.S)]
    return {name: text for text, name in blocks}


def test_the_readme_example_trains_from_its_folder(tmp_path, capsys):
    example = readme_example()
    assert set(example) == {"my_task.py", "my_recipe.yaml"}
    folder = tmp_path / "my_project"
    folder.mkdir()
    for name, text in example.items():
        (folder / name).write_text(text)
    assert yaml.safe_load(example["my_recipe.yaml"])["task"] == "./my_task.py"
    out = tmp_path / "run"
    code = run_main(["--recipe", str(folder / "my_recipe.yaml"), "--max-steps", "2", "--set", "data.n=200",
                     "--set", "output.tracker=none", "--set", "output.plots=false", "--output-dir", str(out)])
    assert code == 0, capsys.readouterr().err[-3000:]
    assert "Effective batch size: 64 (32 × 2)" in capsys.readouterr().out
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["optimizer_steps"] == 2 and metrics["final_metrics"]["mae"] > 0
    assert run_main(["--recipe", str(folder / "my_recipe.yaml"), "--set", "model.hidden=0", "--output-dir",
                     str(tmp_path / "no")]) == 2  # its validate() is called
    assert capsys.readouterr().err.strip() == "error: model.hidden: got 0; must be an integer >= 1"


# A setting the steps never read, which the task declares as one that shapes them (CompareHints.step_settings): compare
# must then tell two runs apart by it, though every step is equal — the task's hints, not a list in compare.
NOTED = TASK.replace('    hidden: int = doc("hidden units", 8)\n',
                     '    hidden: int = doc("hidden units", 8)\n    note: str = doc("read by no step", "a")\n')
HINTED = NOTED + '''
from finetune.job import CompareHints

COMPARE_HINTS = CompareHints(step_settings=("model.note",))
'''


@pytest.mark.parametrize("source, told_apart", [(HINTED, True), (NOTED, False)], ids=["hinted", "control"])
def test_an_outside_task_is_compared_with_its_own_hints(tmp_path, capsys, source, told_apart):
    from finetune.cli import main

    runs = []
    for note in ("a", "b"):
        recipe = user_folder(tmp_path / note, model={"note": note}, output={"save_model": True})
        (recipe.parent / "my_task.py").write_text(source)
        runs.append(str(tmp_path / f"run-{note}"))
        assert run_main(["--recipe", str(recipe), "--output-dir", runs[-1]]) == 0
    losses = [[h["loss"] for h in history(Path(run))] for run in runs]
    assert losses[0] == losses[1]  # the steps never read the note
    capsys.readouterr()
    code = main(["compare", *runs])
    report = capsys.readouterr().out
    assert code == (1 if told_apart else 0), report
    assert ("model.note a vs b" in report or "model.note b vs a" in report) == told_apart, report
