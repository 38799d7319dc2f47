"""The GPU tier: collected only with ``CONVEYOR_GPU_TESTS=1`` (``bash tests/gpu/run.sh``
sets it on a GPU machine). A plain ``pytest`` does not collect these files at all, so a
CPU run neither runs nor lists them as skipped."""

from __future__ import annotations

import os

import pytest

if os.environ.get("CONVEYOR_GPU_TESTS") != "1":
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def cuda():
    import torch

    assert torch.cuda.is_available(), "the GPU tier needs a CUDA device (CONVEYOR_GPU_TESTS=1 was set)"
    return torch.device("cuda", 0)
