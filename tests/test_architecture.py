"""The shape the code keeps: no import cycles inside the package, tasks below the loop, core code that imports no
task, no writes into Accelerate's objects nor use of their private members, one writer of the run's state
(``loop.advance``), one way to ask for the main process. The checkers are shown failing on planted violations."""

import ast
import shutil
from pathlib import Path

import pytest

from tests.helpers import ROOT

PACKAGE = ROOT / "finetune"


def _modules() -> dict:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        out[name] = ast.parse(path.read_text())
    return out


def _imports(tree, modules) -> set:
    """finetune modules imported anywhere in the file (inside functions too: a lazy import is still a dependency)."""
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n for n in names if n in modules}
    return found


def _graph() -> dict:
    modules = _modules()
    return {m: _imports(tree, modules) - {m, "finetune"} for m, tree in modules.items()}


def find_cycles(graph: dict) -> list:
    seen, stack, cycles = set(), [], []

    def visit(node):
        if node in stack:
            cycles.append(stack[stack.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        stack.pop()

    for m in sorted(graph):
        visit(m)
    return cycles


def test_no_import_cycles():
    cycles = find_cycles(_graph())
    assert not cycles, " ; ".join(" → ".join(c) for c in cycles)
    # negative control: the cycle the package once had (memory importing the loop inside a function) is found
    graph = _graph()
    graph["finetune.memory.measure"] = graph["finetune.memory.measure"] | {"finetune.loop"}
    assert find_cycles(graph)


# what runs a task: its loop and the command line
ABOVE_TASKS = {"finetune.loop", "finetune.steps", "finetune.cli", "finetune.run", "finetune.startup", "finetune.api"}
# what a task is told through its TaskContext (finetune.job: the run's shape, main process, device, process count,
# a collective refusal) instead of asking the loop, the shape or the process group itself
TOLD_TO_TASKS = {"finetune.loop", "finetune.shape", "finetune.windows", "finetune.distributed"}
def task_imports(graph: dict, of: set) -> dict:
    """Task module → the modules of ``of`` it imports (anywhere in its file), for the tasks that import any."""
    return {m: sorted(deps & of) for m, deps in graph.items() if m.startswith("finetune.tasks") and deps & of}


def test_tasks_never_import_the_loop_the_command_line_nor_what_they_are_told():
    graph = _graph()
    assert task_imports(graph, ABOVE_TASKS) == {}
    assert task_imports(graph, TOLD_TO_TASKS) == {}
    # negative control: sft asking for the main process again, through a lazy import inside a function, is found
    source = (PACKAGE / "tasks" / "sft.py").read_text()
    planted = source + "\ndef main():\n    from finetune import distributed\n    return distributed.is_main_process()\n"
    graph["finetune.tasks.sft"] = _imports(ast.parse(planted), _modules()) - {"finetune.tasks.sft", "finetune"}
    assert task_imports(graph, TOLD_TO_TASKS).get("finetune.tasks.sft") == ["finetune.distributed"]


def core_imports_of_tasks(graph: dict) -> list:
    """(core module, task module) for every import of finetune.tasks outside it: what every task shares lives in
    core modules (finetune.data, finetune.models.hf, …), and tasks are found by name (finetune.registry)."""
    return sorted((m, d) for m, deps in graph.items() if not m.startswith("finetune.tasks")
                  for d in deps if d.startswith("finetune.tasks"))


def test_core_never_imports_a_task():
    graph = _graph()
    assert not core_imports_of_tasks(graph), core_imports_of_tasks(graph)
    # negative control: a lazy import of a task helper in core code (as checkpoint.py once took step_seed) is found
    graph["finetune.checkpoint"] = graph["finetune.checkpoint"] | {"finetune.tasks.sft"}
    assert core_imports_of_tasks(graph) == [("finetune.checkpoint", "finetune.tasks.sft")]


def test_no_writes_to_accelerate_objects():
    """Accelerate is steered through its documented API: nothing in the package assigns to an attribute of an
    Accelerator or of Accelerate's state."""
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute):
                    owner = ast.unparse(target.value)
                    assert "accelerator" not in owner.lower() and "State" not in owner, \
                        f"{path.name}:{node.lineno}: {ast.unparse(target)}"


# ---------------------------------------------------------------------------------------------------------------
# who writes what: the run's state has one writer (loop.advance); Accelerate's objects have none

# methods that change the object they are called on (TrainState.update_ema included)
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "remove", "clear", "sort",
            "reverse", "add", "discard", "update_ema"}
# the run's state and what holds its records: TrainState (``state``, ``run.state``, ``result.state``), its lists
# (also reachable as TrainResult.history), and a step or evaluation record handed to a function
STATE_NAMES = {"state", "history", "val_history"}
RECORD_PARAMETERS = {"record", "val"}
ACCELERATE_NAMES = {"AcceleratorState", "GradientState", "PartialState", "process_group", "deepspeed_plugin"}
STATE_OWNER = ("loop.py", "advance")
# the documented exceptions, each (file, function, the exact expression written or called)
ACCELERATE_EXCEPTIONS = {
    # Accelerate's own reset of its process-wide singletons ("restart your runtime" otherwise); see its docstring
    ("distributed.py", "restart_accelerate_state", "AcceleratorState._reset_state"),
    ("distributed.py", "restart_accelerate_state", "GradientState._reset_state"),
    # without a prepared DataLoader, Accelerate's error message asks for exactly this assignment
    ("distributed.py", "configure_deepspeed", "plugin.deepspeed_config['train_micro_batch_size_per_gpu']"),
    # the recipe's clipping, where Accelerate would fill in 1.0 for a falsy or missing value (the plugin's config
    # dict is what a user's DeepSpeed config file becomes; Accelerate fills only its "auto" entries)
    ("distributed.py", "configure_deepspeed", "plugin.deepspeed_config['gradient_clipping']"),
    # an offloaded optimizer is the recipe's own on the host; forced (DeepSpeed's default), Accelerate replaces it
    # with DeepSpeed's CPU Adam made from the lr and decay alone (map_pytorch_optim_to_deepspeed)
    ("distributed.py", "configure_deepspeed", "plugin.deepspeed_config['zero_force_ds_cpu_optimizer']"),
}


def _chain(node) -> list:
    """The names along an access path, outermost first: ``run.state.history[-1]`` → [run, state, history];
    ``AcceleratorState()._reset_state`` → [AcceleratorState, _reset_state]."""
    names = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, (ast.Subscript, ast.Starred)):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        else:
            if isinstance(node, ast.Name):
                names.append(node.id)
            return names[::-1]


def _is_state(names: list, aliases: set) -> bool:
    return bool(set(names) & (STATE_NAMES | aliases))


def _is_accelerate(names: list, aliases: set) -> bool:
    return any("accelerator" in n.lower() or n in ACCELERATE_NAMES or n in aliases for n in names)


def _aliases(fn, is_kind) -> set:
    """Local names bound to such an object in ``fn`` (``plugin = accelerator.deepspeed_plugin``)."""
    pairs = []  # (name, the expression bound to it), tuples unpacked: ``a, b = x, y``
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) and \
                        len(t.elts) == len(node.value.elts):
                    pairs += zip(t.elts, node.value.elts)
                else:
                    pairs.append((t, node.value))
    found = set()
    while True:
        more = {t.id for t, value in pairs if isinstance(t, ast.Name) and is_kind(_chain(value), found)} - found
        if not more:
            return found
        found |= more


def _writes(fn):
    """(node, the object written into, what is written) for every write in ``fn``: assignment, augmented assignment
    or deletion of an attribute or item, a mutating method call, setattr / delattr."""
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                if isinstance(t, (ast.Attribute, ast.Subscript)):
                    yield node, t.value, t
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                yield node, node.func.value, node.func
            elif isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") and node.args:
                yield node, node.args[0], node


def _functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def violations(package) -> list:
    """Every write into the run's state outside ``loop.advance``, and every write into an Accelerate object or use
    of one of its private members outside the documented exceptions, as ``file:line: function: expression``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for fn in _functions(ast.parse(path.read_text())):
            where = f"{path.name}:{{}}: {fn.name}: {{}}"
            states = _aliases(fn, _is_state) | ({a.arg for a in fn.args.args} & RECORD_PARAMETERS)
            accelerates = _aliases(fn, _is_accelerate)
            for node, obj, written in _writes(fn):
                names = _chain(obj)
                if _is_state(names, states) and (path.name, fn.name) != STATE_OWNER:
                    found.append(where.format(node.lineno, "writes the run's state: " + ast.unparse(written)))
                if _is_accelerate(names, accelerates) and \
                        (path.name, fn.name, ast.unparse(written)) not in ACCELERATE_EXCEPTIONS:
                    found.append(where.format(node.lineno, "writes into Accelerate: " + ast.unparse(written)))
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                        and _is_accelerate(_chain(node.value), accelerates) \
                        and (path.name, fn.name, ast.unparse(node)) not in ACCELERATE_EXCEPTIONS:
                    found.append(where.format(node.lineno, "uses Accelerate's private " + ast.unparse(node)))
    return sorted(set(found))


def test_one_writer_of_the_state_and_none_of_accelerate():
    """The run's state moves in loop.advance only (records are stored whole: nothing adds val_* or seconds to one
    afterwards); Accelerate is steered through its documented API, except where a comment says why not."""
    assert violations(PACKAGE) == []


# loop.after_step's checkpoint, where the plants go
SAVE_LINE = "    run.checkpointer.save_if_due(run.accelerator, state, run.schedulers, run.shape.total_steps)\n"
# Writes the checker must find: the bugs it exists for, planted into a copy of the real source (a line of it
# replaced), and the ways around a name check (an alias, setattr, a private member).
PLANTS = {
    "evaluate appends to the state": ("loop.py", "    if run.reporting.on_eval is not None:\n",
                                      "    run.state.val_history.append(record)\n"
                                      "    if run.reporting.on_eval is not None:\n"),
    "a hook adds val_* to the stored record": (
        "loop.py", "    if run.job.after_step is not None:\n",
        "    state.history[-1].update({'val_loss': 0.0})\n    if run.job.after_step is not None:\n"),
    "the log adds seconds to the record": ("runlog.py", "        if self.log_with is not None:\n",
                                           "        record['seconds'] = 0.0\n        if self.log_with is not None:\n"),
    "a counter moved outside advance": ("loop.py", SAVE_LINE, "    state.optimizer_step += 1\n" + SAVE_LINE),
    "an alias of the state": ("loop.py", SAVE_LINE, "    saved = state.history\n    saved.extend([])\n" + SAVE_LINE),
    "setattr on the state": ("loop.py", SAVE_LINE, "    setattr(state, 'epoch', 0)\n" + SAVE_LINE),
    "a private counter of the Accelerator": ("loop.py", SAVE_LINE, "    run.accelerator.step = 0\n" + SAVE_LINE),
    "Accelerate's private method": ("steps.py", "    norms = []\n",
                                    "    norms = []\n    accelerator.gradient_state._set_sync_gradients(True)\n"),
    "a write through an alias of a plugin": (
        "distributed.py", "    if plugin.is_auto(",
        "    plugin.deepspeed_config['gradient_accumulation_steps'] = 1\n    if plugin.is_auto("),
    "the reset outside its one place": ("distributed.py", "        group.wait_for_everyone()\n",
                                        "        group.wait_for_everyone()\n    GradientState._reset_state()\n"),
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_the_checker_finds_a_planted_write(tmp_path, plant):
    name, line, planted = PLANTS[plant]
    copy = tmp_path / "finetune"
    shutil.copytree(PACKAGE, copy)
    source = (copy / name).read_text()
    assert source.count(line) == 1, f"the line to plant at is no longer in {name}: {line!r}"
    (copy / name).write_text(source.replace(line, planted))
    found = violations(copy)
    assert len(found) == 1 and found[0].startswith(f"{name}:"), found


def test_the_owner_may_write_the_state():
    """The control on the other side: the same writes inside loop.advance are allowed, outside they are not."""
    snippet = "def advance(state, record):\n    state.history.append(record)\n    state.optimizer_step += 1\n"
    assert _found_in(snippet, "loop.py") == []
    assert len(_found_in(snippet.replace("def advance", "def after_step"), "loop.py")) == 2
    assert len(_found_in(snippet, "runlog.py")) == 2


def _found_in(snippet: str, name: str) -> list:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / name).write_text(snippet)
        return violations(Path(d))


def test_one_place_advances_the_state():
    """Only loop.advance (and TrainState itself, and checkpoint loading) move the run's counters."""
    counters = {"optimizer_step", "micro_step", "epoch", "next_window", "items", "samples"}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]:
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, ast.AugAssign) else []
                flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                for t in flat:
                    if isinstance(t, ast.Attribute) and t.attr in counters and ast.unparse(t.value) == "state":
                        assert (path.name, fn.name) == ("loop.py", "advance"), f"{path.name}:{fn.name} sets {t.attr}"


def main_process_questions(tree) -> list:
    """Where code asks "am I the main process?" other than through ``distributed.is_main_process()``: an
    ``is_main_process`` attribute of Accelerate's objects, or the launcher's ``RANK`` read directly."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("is_main_process", "is_local_main_process") \
                and ast.unparse(node.value) != "distributed":
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and node.value == "RANK":
            found.append(f"{node.lineno}: RANK")
    return found


def test_one_way_to_ask_for_the_main_process():
    for path in PACKAGE.rglob("*.py"):
        if path.name != "distributed.py":  # where is_main_process() reads RANK
            assert not main_process_questions(ast.parse(path.read_text())), path.name
    # negative control: the other ways the package once asked are found; the one way is not
    assert main_process_questions(ast.parse('main = os.environ.get("RANK", "0") == "0"'))
    assert main_process_questions(ast.parse("if run.accelerator.is_main_process: pass"))
    assert main_process_questions(ast.parse("if state.is_main_process: pass"))
    assert not main_process_questions(ast.parse("if distributed.is_main_process(): pass"))


# ---------------------------------------------------------------------------------------------------------------
# the package's folders: the core never reaches into reproduce/, tasks never into each other


def reproduce_importers(graph: dict) -> list:
    """Modules outside finetune/reproduce that import it: only the command line may (``finetune compare``,
    ``finetune import``); the loop, its set-up and the tasks never depend on how a baseline is read or compared."""
    return sorted(m for m, deps in graph.items() if not m.startswith("finetune.reproduce") and m != "finetune.cli"
                  and any(d.startswith("finetune.reproduce") for d in deps))


def test_only_the_command_line_imports_reproduce():
    graph = _graph()
    assert reproduce_importers(graph) == []
    graph["finetune.loop"] = graph["finetune.loop"] | {"finetune.reproduce.compare"}  # negative control
    assert reproduce_importers(graph) == ["finetune.loop"]


def task_to_task_imports(graph: dict) -> list:
    """(task, task) for every task module importing another: what chat tasks share lives in finetune.tasks.chat,
    which is not a task."""
    from finetune.registry import available_tasks

    tasks = {f"finetune.tasks.{t}" for t in available_tasks()}
    return sorted((m, d) for m in tasks for d in graph.get(m, ()) if d in tasks)


def modules_with_build(folder) -> set:
    """The modules of a folder that define ``build`` — imported, not searched as text."""
    import importlib
    import importlib.util

    found = set()
    for path in sorted(Path(folder).glob("*.py")):
        if path.stem.startswith("_"):
            continue
        if (Path(folder) / "__init__.py").exists() and Path(folder).parent.name == "finetune":
            module = importlib.import_module(f"finetune.tasks.{path.stem}")
        else:
            spec = importlib.util.spec_from_file_location(f"probe_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        if callable(getattr(module, "build", None)):
            found.add(path.stem)
    return found


def test_the_built_in_task_list_is_every_task_module(tmp_path):
    from finetune import registry

    folder = Path(registry.__file__).parent / "tasks"
    assert modules_with_build(folder) == set(registry.BUILT_IN_TASKS)
    (tmp_path / "extra.py").write_text("def build(cfg):\n    return None\n")  # planted: a task left off the list
    (tmp_path / "shared.py").write_text("def helper():\n    return None\n")
    assert modules_with_build(tmp_path) - set(registry.BUILT_IN_TASKS) == {"extra"}


def test_tasks_never_import_each_other():
    graph = _graph()
    assert "finetune.tasks.chat" in graph["finetune.tasks.grpo"] and task_to_task_imports(graph) == []
    graph["finetune.tasks.grpo"] = graph["finetune.tasks.grpo"] | {"finetune.tasks.dpo"}  # negative control
    assert task_to_task_imports(graph) == [("finetune.tasks.grpo", "finetune.tasks.dpo")]


# ---------------------------------------------------------------------------------------------------------------
# one way through the code: a run's configuration, followed from the command line

TRACED_TASK = '''
import torch
from finetune.job import Job


def build(cfg):
    rows = [{"x": a, "y": 2 * a} for a in torch.linspace(0, 3, 30).unsqueeze(-1)]
    return Job(model=torch.nn.Linear(1, 1), train_data=rows[:24], val_data=rows[24:],
               loss_fn=lambda m, b: (m(b["x"]) - b["y"]).pow(2).mean())
'''
# computed once per run: called more often, a fact would have two sources
SET_UP_ONCE = ("finetune.startup.split_batch", "finetune.startup.count_steps", "finetune.checkpoint.find_checkpoint",
               "finetune.checkpoint.read", "finetune.windows.WindowSpec.of", "finetune.distributed.make_accelerator",
               "finetune.startup.check_environment", "finetune.startup.assemble", "build")


def traced_run(argv: list) -> tuple[list, dict]:
    """Run ``finetune run argv`` in this process under a profiler. Returns (the configuration's path: each finetune
    function that receives the recipe or one of its sections as an argument, not as ``self``, in the order of its
    first call, as (module, function); calls per finetune function, by ``module.qualname``)."""
    import dataclasses
    import sys
    from collections import Counter

    from finetune.cli import run_main
    from finetune.config import RecipeConfig

    sections, path, calls = set(), [], Counter()

    def profile(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if event != "call" or not module.startswith("finetune"):
            return
        code = frame.f_code
        if "__create_fn__" in code.co_qualname:  # a dataclass's generated __init__: storing, not following
            return
        name = code.co_qualname if module.startswith("finetune.") else code.co_name  # a task file: its module
        calls[f"{module}.{name}" if module.startswith("finetune.") else name] += 1
        args = [frame.f_locals.get(n) for n in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
                if n != "self"]
        for value in args:
            if isinstance(value, RecipeConfig):
                sections.update(id(section) for f in dataclasses.fields(value)
                                if dataclasses.is_dataclass(section := getattr(value, f.name, None)))
        if any(isinstance(v, RecipeConfig) or id(v) in sections for v in args) and (module, name) not in path:
            path.append((module, name))

    sys.setprofile(profile)
    try:
        assert run_main(argv) == 0
    finally:
        sys.setprofile(None)
    return path, calls


# the recipe's own modules (its schema, the machinery, loading, validation): one place the configuration stays in
RECIPE_MODULES = {"finetune.config", "finetune.schema", "finetune.loading", "finetune.validation"}


def stays(path: list) -> list:
    """The modules the configuration stays in, in order: consecutive functions of one module are one stay (of the
    recipe's own modules, ``RECIPE_MODULES``, shown as finetune.config)."""
    out = []
    for module, _ in path:
        module = "finetune.config" if module in RECIPE_MODULES else module
        if not out or out[-1] != module:
            out.append(module)
    return out


def returns(modules: list) -> list:
    """The stays in a module the configuration had already left."""
    return [m for i, m in enumerate(modules) if m in modules[:i]]


def test_a_run_follows_its_configuration_in_8_stays_and_1_return_and_sets_up_once(tmp_path):
    (tmp_path / "traced.py").write_text(TRACED_TASK)
    recipe = tmp_path / "traced.yaml"
    recipe.write_text("task: ./traced.py\ntraining: {batch_size: 2, effective_batch_size: 8, learning_rate: 0.05, "
                      "eval_at_start: true}\noutput: {plots: false, save_model: false, save_every: 2}\n")
    out = str(tmp_path / "run")
    fresh = traced_run(["--recipe", str(recipe), "--output-dir", out, "--max-steps", "2"])
    resumed = traced_run(["--recipe", str(recipe), "--output-dir", out, "--resume", "latest"])
    for (path, calls), what in ((fresh, "fresh"), (resumed, "resumed")):
        modules = stays(path)
        shown = " → ".join(modules)
        assert len(modules) <= 8 and len(returns(modules)) <= 1, f"{what}: {len(modules)} stays, returns " \
            f"{returns(modules)}: {shown}"
        # the loop trains the assembled run once, and is handed no section of the configuration
        assert modules[0] == "finetune.config" and "finetune.loop" not in modules, shown
        assert calls["finetune.loop.train"] == 1, what
        twice = {f: n for f, n in calls.items() if any(f.endswith(s) for s in SET_UP_ONCE) and n != 1}
        assert not twice, f"{what}: set-up called more than once: {twice}"
    assert resumed[1]["finetune.checkpoint.read"] == 1 and "finetune.checkpoint.read" not in fresh[1]
    # negative controls: a shape computed again after the loop began is a return, and a second call is counted
    planted = [*fresh[0], ("finetune.startup", "split_batch")]
    assert returns(stays(planted))[-1] == "finetune.startup"
    assert stays([("a", "f"), ("a", "g"), ("b", "h"), ("a", "k")]) == ["a", "b", "a"]
    assert stays([("finetune.validation", "f"), ("finetune.schema", "g"), ("b", "h")]) == ["finetune.config", "b"]


# the stage functions a resumed run passes through, whoever starts it
RESUME_STAGES = ("finetune.startup.check_training", "finetune.checkpoint.find_checkpoint", "finetune.checkpoint.read",
                 "finetune.checkpoint.check_resume", "finetune.startup.counted", "finetune.checkpoint.check_holds",
                 "finetune.startup.assemble", "finetune.loop.train")


def stage_calls(run) -> dict:
    """Calls per finetune function (``module.qualname``) while ``run()`` runs."""
    import sys
    from collections import Counter

    calls = Counter()

    def profile(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith("finetune."):
            calls[f"{module}.{frame.f_code.co_qualname}"] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def stages_missed(calls: dict) -> list:
    """The resume stages not called exactly once."""
    return [s for s in RESUME_STAGES if calls.get(s) != 1]


def test_the_command_line_and_the_python_api_resume_through_the_same_stages(tmp_path):
    import torch

    from finetune.api import test_fine_tuning
    from tests.helpers import MLP, regression_data

    (tmp_path / "traced.py").write_text(TRACED_TASK)
    recipe = tmp_path / "traced.yaml"
    recipe.write_text("task: ./traced.py\ntraining: {batch_size: 2, effective_batch_size: 8, learning_rate: 0.05}\n"
                      "output: {plots: false, save_model: false, save_every: 2, tracker: none}\n")
    out = str(tmp_path / "run")
    traced_run(["--recipe", str(recipe), "--output-dir", out, "--max-steps", "2"])
    cli = traced_run(["--recipe", str(recipe), "--output-dir", out, "--resume", "latest"])[1]

    kw = dict(train_data=regression_data(24), batch_size=2, gradient_accumulation_steps=4, save_every=2,
              output_dir=str(tmp_path / "api"))
    torch.manual_seed(0)
    test_fine_tuning(MLP(), max_steps=2, **kw)
    api = stage_calls(lambda: test_fine_tuning(MLP(), resume="latest", **kw))
    assert stages_missed(cli) == [] and stages_missed(api) == []
    # the control: the Python API's old way (the checkpoint read and handed to the loop, unchecked) is caught
    old = {**api, "finetune.checkpoint.find_checkpoint": 0, "finetune.checkpoint.check_resume": 0,
           "finetune.startup.counted": 0}
    assert stages_missed(old) == ["finetune.checkpoint.find_checkpoint", "finetune.checkpoint.check_resume",
                                  "finetune.startup.counted"]


def train_parameters(source: str) -> int:
    """How many parameters the module-level ``train`` of ``source`` takes (``*args`` and ``**kwargs`` count)."""
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "train")
    a = fn.args
    return len(a.posonlyargs + a.args + a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)


def test_the_loop_takes_the_assembled_run_and_the_checkpoint_only():
    """``loop.train`` is handed what start-up assembled and the checkpoint to continue, and only trains: the
    settings, the shape and the outputs are in the run, not parameters of their own."""
    assert train_parameters((PACKAGE / "loop.py").read_text()) <= 2
    planted = "def train(job, t, shape, output=None, saved=None, **kw):\n    pass\n"  # the old signature, and more
    assert train_parameters(planted) == 6


def memory_reaching_up(graph: dict) -> list:
    """(memory module, upper module) for every import of the loop, start-up or a command from finetune/memory: the
    loop uses the memory model, so the memory model must not use the loop (``finetune plan``'s command hands it
    what it needs)."""
    upper = {"finetune.loop", "finetune.startup", "finetune.plan_command", "finetune.cli", "finetune.api"}
    return sorted((m, d) for m, deps in graph.items() if m.startswith("finetune.memory") for d in deps & upper)


def test_memory_imports_neither_the_loop_nor_start_up():
    graph = _graph()
    assert memory_reaching_up(graph) == []
    graph["finetune.memory.plan"] = graph["finetune.memory.plan"] | {"finetune.loop"}  # planted: training_peak's
    assert memory_reaching_up(graph) == [("finetune.memory.plan", "finetune.loop")]     # old import
