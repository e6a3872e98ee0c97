"""Kernel tests run the Triton kernels compiled on CUDA, or under Triton's interpreter on CPU.

Triton picks interpreter or compiler when it is first imported, so without CUDA this sets
``TRITON_INTERPRET=1`` before anything here imports it (prefixd.kernels imports triton only
when a kernel first runs).
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    """CUDA when present (kernels compiled), else CPU (kernels interpreted)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def triton_ready(device):
    """Fail loudly (not skip) if triton was imported compiled on a machine without CUDA."""
    if device.type == "cpu" and "triton" in sys.modules:
        from prefixd.kernels.launch import interpreter_active

        if not interpreter_active():
            pytest.fail(
                "triton was imported before tests/kernels/conftest.py could set "
                "TRITON_INTERPRET=1; run the kernel tests on their own or import triton lazily"
            )
    return device
