"""Short parameter lists: no function in finetune/ takes more than 7 parameters, none in finetune/memory/ more than 6
(positional and keyword, ``self`` / ``cls`` and ``*args`` / ``**kwargs`` not counted). What belongs together is
handed over as one record (``schema.Said``, ``steps.Backward``, ``tables.Encoding``, ``loss_head.Head``). Two kinds
are exempt: the public ``test_fine_tuning`` (its keywords are the recipe's fields) and the ``forward`` of an
autograd ``Function`` (torch hands ``backward`` one gradient per input of it)."""

from __future__ import annotations

import ast

from tests.helpers import ROOT

PACKAGE = ROOT / "finetune"
LIMIT, MEMORY_LIMIT = 7, 6
EXEMPT = {("finetune/api.py", "test_fine_tuning")}


def parameters(node: ast.FunctionDef) -> int:
    a = node.args
    return len([x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")])


def autograd_forwards(tree: ast.Module) -> set:
    """The ``forward`` methods (their nodes' ids) of the classes of ``tree`` that derive from
    ``torch.autograd.Function`` (written so or as ``Function``)."""
    return {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
            and any(ast.unparse(b).endswith("Function") for b in c.bases)
            for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "forward"}


def wide(path: str, source: str) -> list:
    """``path:line name (n)`` for each function of ``source`` over its limit, the exempt ones aside."""
    tree = ast.parse(source)
    limit = MEMORY_LIMIT if path.startswith("finetune/memory/") else LIMIT
    exempt = autograd_forwards(tree)
    return [f"{path}:{node.lineno} {node.name} ({parameters(node)})" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and parameters(node) > limit
            and id(node) not in exempt and (path, node.name) not in EXEMPT]


def package_sources() -> dict:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_no_function_takes_more_than_seven_parameters_nor_in_memory_more_than_six():
    found = [w for path, source in package_sources().items() for w in wide(path, source)]
    assert not found, found


def test_the_guard_finds_a_wide_function_and_keeps_its_exemptions():
    eight = "def f(a, b, c, d, e, g, h, i):\n    pass\n"
    assert wide("finetune/x.py", eight) == ["finetune/x.py:1 f (8)"]
    # self, *args and **kwargs are not counted; the memory planner's limit is one lower
    assert wide("finetune/x.py", "class A:\n    def f(self, a, b, c, d, e, g, h, *r, **k):\n        pass\n") == []
    seven = "def f(a, b, c, d, e, g, *, h):\n    pass\n"
    assert wide("finetune/x.py", seven) == []
    assert wide("finetune/memory/x.py", seven) == ["finetune/memory/x.py:1 f (7)"]
    # the forward of an autograd Function is exempt; another class's forward is not
    forward = "    @staticmethod\n    def forward(ctx, a, b, c, d, e, g, h, i):\n        pass\n"
    assert wide("finetune/x.py", "class F(torch.autograd.Function):\n" + forward) == []
    assert wide("finetune/x.py", "class M(torch.nn.Module):\n" + forward) == ["finetune/x.py:3 forward (9)"]
    # the public entry point is exempt by name and file
    assert wide("finetune/api.py", eight.replace("def f", "def test_fine_tuning")) == []
    assert wide("finetune/other.py", eight.replace("def f", "def test_fine_tuning")) != []
    assert "finetune/memory/plan.py" in package_sources()  # the whole package is read
