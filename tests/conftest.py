"""Shared fixtures: one local Ray cluster for the whole session (it takes seconds to start)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from pipeline.runner import init_ray

    init_ray()
    yield ray
    ray.shutdown()
