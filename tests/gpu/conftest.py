"""Fixtures of the CUDA tests, and the summary printed at the end of their run (``tests/gpu/summary.py``)."""

import pytest
import torch

from tests.gpu.common import release
from tests.gpu.summary import figures, pytest_runtest_logreport, pytest_terminal_summary  # noqa: F401


@pytest.fixture
def ieee_fp32():
    """fp32 matrix products in full fp32: TF32 keeps 10 mantissa bits (~1e-3 relative), which no ≤ 1e-5 check
    survives. torch leaves it off by default; this makes sure, and restores the setting after the test."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.fixture
def clean_cuda():
    """Each memory test starts with nothing of earlier tests cached on the device, and leaves nothing behind."""
    release()
    yield
    release()

