"""The summary that ends `make test-gpu` (tests/gpu/summary.py), checked on the CPU with made-up GPU tests: one line
per gpu test with its outcome and recorded figures, skip reasons and failure messages; nothing for other tests."""

import subprocess
import sys
import textwrap

from tests.helpers import ENV

FAKE = '''
import pytest

@pytest.mark.gpu
def test_fp16_overflow(figures):
    figures("skipped", "..S...")
    figures("scale", "1024 → 512")

@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_equivalence(precision, figures):
    figures("of the update", 3.1e-4 if precision == "fp16" else 2.2e-3, "≤ 0.01")

@pytest.mark.gpu
def test_planner(figures):
    figures("predicted", "534 MiB")
    figures("measured", "662 MiB")
    figures("error", "-19.3%", "±10 %")
    assert 0.193 <= 0.10, "predicted 534 MiB, measured 662 MiB"

@pytest.mark.gpu
def test_chunked_head():
    pytest.skip("needs finetune.models.loss_head")

def test_not_on_the_gpu():
    pass
'''


def run_fake(tmp_path, *args):
    (tmp_path / "test_fake.py").write_text(textwrap.dedent(FAKE))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.gpu.summary", "-p", "no:cacheprovider",
                           "-W", "ignore::pytest.PytestUnknownMarkWarning", "-q", "-rN", "--tb=no", *args,
                           "test_fake.py"], capture_output=True, text=True, env={**ENV, "COLUMNS": "200"}, cwd=tmp_path,
                          timeout=300)


def test_summary_lists_each_gpu_test_with_its_figures(tmp_path):
    proc = run_fake(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the failing fake test
    out = proc.stdout
    summary = out[out.index(" GPU summary "):].splitlines()
    lines = {line.split()[2].rstrip(":") + line.split()[3]: line for line in summary if line[:4] in
             ("PASS", "FAIL", "SKIP")}
    assert set(lines) == {"fake" + t for t in ("fp16_overflow", "equivalence[fp16]", "equivalence[bf16]", "planner",
                                               "chunked_head")}, summary
    assert "skipped ..S... · scale 1024 → 512" in lines["fakefp16_overflow"]
    assert lines["fakeequivalence[fp16]"].startswith("PASS") and "of the update 3.1e-04 (≤ 0.01)" in \
        lines["fakeequivalence[fp16]"]
    planner = out[out.index("FAIL"):]
    assert "predicted 534 MiB · measured 662 MiB · error -19.3% (±10 %)" in planner
    assert "✗ AssertionError: predicted 534 MiB, measured 662 MiB" in planner
    head = lines["fakechunked_head"]
    assert head.startswith("SKIP") and "needs finetune.models.loss_head" in head
    assert "not_on_the_gpu" not in "\n".join(summary)
    assert next(line for line in summary if "in the tests" in line).startswith("3 passed, 1 failed, 1 skipped;")


def test_no_summary_when_no_gpu_test_ran(tmp_path):
    proc = run_fake(tmp_path, "-m", "not gpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GPU summary" not in proc.stdout


def test_one_line_when_every_gpu_test_skipped_for_one_reason(tmp_path):
    proc = run_fake(tmp_path, "-k", "chunked_head or not_on_the_gpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GPU summary: 1 skipped, needs finetune.models.loss_head" in proc.stdout
    assert " GPU summary " not in proc.stdout
