"""The one-screen summary that ends a GPU run (``make test-gpu``): one line per ``gpu`` test — pass / fail / skip,
seconds, and the figures the test recorded (tolerances reached, peaks measured against predicted, …). When every
GPU test skipped for one reason (no CUDA device), that one line instead.

A test records a figure with the ``figures`` fixture, before it asserts on it, so that a failing line still shows
what was measured::

    def test_x(figures):
        figures("weights", 3.1e-8, "≤ 1e-05")   # → "weights 3.1e-08 (≤ 1e-05)"

Loaded by ``tests/gpu/conftest.py``; ``python -m pytest -p tests.gpu.summary …`` loads it for other test files.
"""

from __future__ import annotations

import shutil

import pytest

WIDTH = 140  # characters a line of the summary may take before its figures wrap
_results: list = []  # (nodeid, outcome, seconds, figures or reason), in the order the tests ran


@pytest.fixture
def figures(record_property):
    """``figures(name, value, bound="")``: one figure of this test for the summary (a float as ``number`` writes
    it; a string as given)."""

    def record(name: str, value, bound: str = "") -> None:
        text = number(value) if isinstance(value, float) else str(value)
        record_property(name, f"{text} ({bound})" if bound else text)

    return record


def number(x: float) -> str:
    """2.2e-07, 3.1e-04, 0.13, 41.5: small and large values in exponent form, the others in 3 digits."""
    return f"{x:.1e}" if x and (abs(x) < 1e-2 or abs(x) >= 1e4) else f"{x:.3g}"


def pytest_runtest_logreport(report) -> None:
    if "gpu" not in report.keywords:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = "xfail" if hasattr(report, "wasxfail") else report.outcome
        _results.append((report.nodeid, outcome, report.duration, _details(report)))
    elif report.when == "teardown" and report.failed:
        _results.append((report.nodeid, "error", report.duration, _details(report)))


def _details(report) -> str:
    """The recorded figures; for a skip its reason; for a failure the figures, then the first line of the error."""
    shown = [f"{name} {value}" for name, value in report.user_properties]
    if report.skipped and isinstance(report.longrepr, tuple):
        shown.append(str(report.longrepr[2]).removeprefix("Skipped: "))
    elif report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)
        shown.append("✗ " + message.strip().splitlines()[0] if message.strip() else "✗ failed")
    return " · ".join(shown)


def short_name(nodeid: str) -> str:
    """tests/gpu/test_precision.py::test_fp16_overflow[mlp] → precision: fp16_overflow[mlp]"""
    path, _, test = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1].removesuffix(".py").removeprefix("test_")
    return f"{module}: {test.removeprefix('test_')}"


def device_line() -> str:
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}): every GPU test skips"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    memory = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    cards = f"{names[0]} × {len(names)}" if len(set(names)) == 1 else ", ".join(names)
    return f"{cards} ({memory:.0f} GiB) · torch {torch.__version__} · CUDA {torch.version.cuda}"


def format_summary(results: list, header: str, width: int = WIDTH) -> list[str]:
    """The summary's lines: a header, one line per test (its figures wrapped under it when long), a total."""
    label = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP", "error": "ERROR", "xfail": "XFAIL"}
    names = [short_name(nodeid) for nodeid, *_ in results]
    name_width = min(max(map(len, names), default=0), 60)
    lines = [" GPU summary ".center(width, "="), header]
    for name, (_, outcome, seconds, details) in zip(names, results):
        head = f"{label.get(outcome, outcome.upper()):<5} {seconds:6.1f}s  {name:<{name_width}}  "
        lines += _wrap(head, details, width)
    counts = {}
    for _, outcome, _, _ in results:
        counts[outcome] = counts.get(outcome, 0) + 1
    total = sum(seconds for _, _, seconds, _ in results)
    tally = ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
    lines.append("-" * width)
    lines.append(f"{tally or 'no GPU test ran'}; {total:.0f} s in the tests (the budget is 600 s on one GPU)")
    return lines


def _wrap(head: str, details: str, width: int) -> list[str]:
    """``head`` then the " · "-separated figures, continued on indented lines where the line is full."""
    indent = " " * 15
    lines, line = [], head
    for part in details.split(" · ") if details else []:
        fresh = line in (head, indent)
        piece = part if fresh else " · " + part
        if len(line) + len(piece) > width and line != indent:
            lines.append(line.rstrip())
            line, piece = indent, part
        line += piece
    lines.append(line.rstrip())
    return lines


def pytest_terminal_summary(terminalreporter) -> None:
    if not _results:  # no gpu test was selected (the default run deselects them)
        return
    reasons = {details for _, outcome, _, details in _results if outcome == "skipped"}
    if len(reasons) == 1 and all(outcome == "skipped" for _, outcome, _, _ in _results):  # e.g. no CUDA: one line
        terminalreporter.write_line(f"GPU summary: {len(_results)} skipped, {reasons.pop()}")
        return
    width = min(WIDTH, max(shutil.get_terminal_size((WIDTH, 24)).columns, 80))
    for line in format_summary(_results, device_line(), width):
        terminalreporter.write_line(line)
