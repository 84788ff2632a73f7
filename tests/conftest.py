"""Shared fixtures: ``device`` runs a test on the CPU and, where a GPU is present, on CUDA
(the CUDA cases skip without one)."""

from __future__ import annotations

import pytest
import torch

#: CPU, and CUDA where a GPU is present (skipped otherwise)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    """The device a test runs on: "cpu", then "cuda" where available."""
    return request.param
