"""The shape the code keeps: no import cycles inside the package, tasks below the loop, core code that imports no
task, no writes into Accelerate's objects, one place that advances the run's state."""

import ast

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
    graph["finetune.memory"] = graph["finetune.memory"] | {"finetune.loop"}
    assert find_cycles(graph)


def test_tasks_never_import_the_loop_or_the_command_line():
    graph = _graph()
    upper = {"finetune.loop", "finetune.steps", "finetune.cli", "finetune.run", "finetune.execute", "finetune.api"}
    for m, deps in graph.items():
        if m.startswith("finetune.tasks"):
            assert not deps & upper, (m, deps & upper)


def core_imports_of_tasks(graph: dict) -> list:
    """(core module, task module) for every import of finetune.tasks outside it: what every task shares lives in
    core modules (finetune.data, finetune.hf_models, …), and tasks are found by name (finetune.registry)."""
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
