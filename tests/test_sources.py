"""The sources' contract (``finetune/reproduce/sources/``): every entry of ``SOURCES`` has a real run of its tool as
a fixture, which it recognises and no other tool's entry does, which ``finetune reproduce`` imports, trains and
compares reading it once; every list of the tools is made from the table (the docs' too); and the shape the
contract keeps the package in (no task named in a reader, short modules, short parameter lists, one name per
meaning)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import yaml

from finetune.reproduce.sources import SOURCES, docs_table, read_baseline, recognised_by
from tests.helpers import (
    ROOT,
    one_torch_thread,  # noqa: F401  (the module's fixture, by name)
    tiny_chat_assets,
)
from tests.helpers import cli_in_process as cli

ASSETS = ROOT / "tests" / "assets"
REPRODUCE = ROOT / "finetune" / "reproduce"
LF = ASSETS / "llamafactory"


def _llamafactory(request, tmp):
    return LF / "sft-lora", ["--recipe", "sft-smollm2", "--model", LF / "model"]


def _torchtune(request, tmp):
    tiny = ASSETS / "torchtune-tiny"
    return ASSETS / "torchtune-full", ["--recipe", "sft-smollm2", "--data", tiny / "chat.jsonl", "--model",
                                       tiny / "model"]


def _axolotl(request, tmp):
    inputs = ASSETS / "axolotl-inputs"
    return ASSETS / "axolotl-full", ["--model", inputs / "model", "--data", inputs / "chat.jsonl"]


def _trl_config(request, tmp):
    """A config of TRL's command line (``trl sft --config sft.yaml``) for the Hub run's settings, the run it makes."""
    _, folder, data = request.getfixturevalue("trl_hub_run")
    config = {"model_name_or_path": tiny_chat_assets()["model"], "dataset_name": str(data),
              "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "num_train_epochs": 1,
              "learning_rate": 1e-3, "lr_scheduler_type": "cosine", "max_grad_norm": 0.15, "seed": 42,
              "use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
              "lora_target_modules": ["q_proj", "v_proj"]}
    (tmp / "sft.yaml").write_text(yaml.safe_dump(config))
    return tmp / "sft.yaml", ["--recipe", "sft-smollm2", "--data", data]


def _tensorboard(request, tmp):
    _, folder, data = request.getfixturevalue("trl_events_run")
    return folder, ["--recipe", "sft-smollm2", "--data", data, "--model", tiny_chat_assets()["model"]]


def _hub(request, tmp):
    _, folder, data = request.getfixturevalue("trl_hub_run")
    return folder, ["--recipe", "sft-smollm2", "--data", data, "--model", tiny_chat_assets()["model"]]


def _trainer(request, tmp):
    root = request.getfixturevalue("trainer_example_run")
    return root / "baseline", ["--recipe", root / "recipe.yaml"]


def _finetune(request, tmp):
    """A finetune run of the tiny chat model at micro-batch 4."""
    assets = tiny_chat_assets()
    run = tmp / "finetune-run"
    code, out = cli(request.getfixturevalue("capsys"), "run", "--recipe", "sft-smollm2", "--batch-size", 4,
                    "--output-dir", run, "--set", f"model.name_or_path={assets['model']}", "--set",
                    f"data.source={assets['data']}", "--set", "training.effective_batch_size=8", "--set",
                    "training.max_steps=3", "--set", "output.tracker=none", "--set", "model.generate_prompts=0")
    assert code == 0, out
    return run, []


def _msswift(request, tmp):
    """ms-swift's run on the LLaMA-Factory runs' inputs (examples/msswift/make_baselines.sh)."""
    return ASSETS / "msswift" / "sft-lora", ["--model", LF / "model", "--data", LF / "data" / "chat.jsonl"]


# each source's real run and what reproduce needs beside it; an entry of SOURCES without one fails the test below
FIXTURES = {"finetune": _finetune, "LLaMA-Factory": _llamafactory, "torchtune": _torchtune, "axolotl": _axolotl,
            "TRL config": _trl_config, "TensorBoard logs": _tensorboard, "Hub folder": _hub, "Trainer / TRL": _trainer,
            "ms-swift": _msswift}


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("source", SOURCES, ids=[s.name for s in SOURCES])
def test_every_source_reads_a_real_run_of_its_tool(source, request, tmp_path, capsys, monkeypatch):
    assert source.name in FIXTURES, f"{source.name}: no fixture — a source lands with a real run of its tool"
    path, extra = FIXTURES[source.name](request, tmp_path)
    found = recognised_by(path)
    assert found and found[0] is source, [s.name for s in found]
    tools = [s for s in found if not s.general]
    assert tools == ([] if source.general else [source]), [s.name for s in found]  # no other tool claims it
    reads = []
    for s in SOURCES:
        monkeypatch.setattr(type(s), "read", _counted(type(s).read, reads))
    chat = [] if source.name == "Trainer / TRL" else ["--set", "model.generate_prompts=0"]  # its recipe is clm
    code, out = cli(capsys, "reproduce", path, *extra, "--batch-size", 1, "-o", tmp_path / "reproduced", *chat)
    verdict = next((line for line in out.splitlines() if line.startswith("verdict:")), out[-3000:])
    assert code == 0 and verdict.startswith("verdict: equivalent"), verdict
    assert reads == [source.name], reads  # read once, by its own entry
    assert (tmp_path / "reproduced" / "report.md").is_file()


def _counted(read, reads: list):
    def counted(self, path, what):
        reads.append(self.name)
        return read(self, path, what)

    return counted


def test_a_path_no_source_recognises_is_refused_in_one_line_naming_them(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    code, out = cli(capsys, "import", tmp_path / "notes.txt")
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and all(s.name in lines[0] for s in SOURCES), out
    with pytest.raises(Exception, match="does not exist"):
        read_baseline(tmp_path / "missing")


# ---------------------------------------------------------------------------------------------------------------
# one source per fact: every list of the tools comes from the table


def test_the_docs_table_is_the_table():
    page = (ROOT / "docs" / "reproduce" / "sources.md").read_text()
    assert docs_table() in page, "docs/reproduce/sources.md: paste finetune.reproduce.sources.docs_table()"


def test_help_names_every_source(capsys):
    for command in ("import", "reproduce"):
        with pytest.raises(SystemExit):
            cli(capsys, command, "--help")
        text = " ".join(capsys.readouterr().out.split())
        assert all(s.name in text for s in SOURCES), (command, text)


def _tools() -> list:
    """The names of the tools (not the Trainer's general forms, not finetune itself)."""
    return [s.name for s in SOURCES if not s.general and "finetune" not in s.name]


def _literals(path: Path):
    """(line, text) of every string literal in a module that is not a docstring."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


def test_no_hand_written_list_of_sources_outside_the_table():
    tools = _tools()
    assert len(tools) >= 3
    found = []
    for path in (ROOT / "finetune").rglob("*.py"):
        if (REPRODUCE / "sources") in path.parents:
            continue
        for line, text in _literals(path):
            named = [t for t in tools if t.lower() in text.lower()]
            if len(named) >= 2:
                found.append(f"{path.relative_to(ROOT)}:{line}: {named}")
    assert not found, found


def test_the_guard_sees_a_hand_written_list(tmp_path):
    """Negative control: a help text listing two tools is what the guard above looks for."""
    tools = _tools()
    module = tmp_path / "m.py"
    module.write_text(f'HELP = "a folder ({tools[0]}, {tools[1]})"\n')
    assert [t for t in tools if t.lower() in _literals(module)[0][1].lower()] == tools[:2]


# ---------------------------------------------------------------------------------------------------------------
# the shape of finetune/reproduce/


def _modules():
    return sorted(REPRODUCE.rglob("*.py"))


def test_no_reader_names_a_task():
    """A task's name is asked of its hints (CompareHints), never written in finetune/reproduce/."""
    tasks = {"dpo", "sft", "grpo"}
    found = [f"{p.relative_to(ROOT)}:{line}" for p in _modules() for line, text in _literals(p) if text in tasks]
    assert not found, found


def test_modules_are_short_and_functions_take_at_most_seven_parameters():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in _modules() if (n := len(p.read_text().splitlines())) > 500]
    assert not long, long
    wide = []
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                if n > 7:
                    wide.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({n})")
    assert not wide, wide


OLD_NAMES = re.compile(r"\b(own_step|loss_floor|warmup_of|read_other_folder|read_yaml_source)\b")


def test_names_with_one_meaning():
    """``own_step`` is the flag's ``baseline_step``; a twin run is ``twin``, an absolute floor ``atol``; a
    ``Baseline`` is ``baseline`` or ``b``, a recipe path ``base_recipe``; ``carry_own`` and ``warmup`` are the
    source's."""
    found = [f"{p.relative_to(ROOT)}:{n}" for p in [*_modules(), *(ROOT / "finetune").glob("*.py"),
                                                    *(ROOT / "finetune" / "tasks").glob("*.py")]
             for n, line in enumerate(p.read_text().splitlines(), 1) if OLD_NAMES.search(line)]
    assert not found, found
    params = []
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params += [f"{p.relative_to(ROOT)}:{node.lineno} {x.arg}" for x in node.args.args + node.args.kwonlyargs
                           if x.arg in ("floor", "base")]
    assert not params, params


def test_an_old_name_is_seen(tmp_path):
    """Negative control of the guard above."""
    assert OLD_NAMES.search("def carry(b, own_step=False):") and not OLD_NAMES.search("baseline_step")


def test_every_fixture_is_real_and_in_the_repo():
    """The committed runs the table's fixtures read (the others are trained by the suite's own fixtures)."""
    for path in (LF / "sft-lora" / "trainer_state.json", ASSETS / "torchtune-full" / "torchtune_config.yaml",
                 ASSETS / "axolotl-full" / "README.md", ASSETS / "msswift" / "sft-lora"):
        assert path.exists(), path
    assert json.loads((LF / "sft-lora" / "trainer_state.json").read_text())["log_history"]
