"""Shared fixtures: one local Ray cluster for the whole session (it takes seconds to start).

Every test is marked with its tier, from the folder it lives in (``tests/unit`` ->
``unit``, ``tests/ray_local`` -> ``ray_local``, ``tests/e2e`` -> ``e2e``, ``tests/gpu`` ->
``gpu``), so ``pytest -m unit`` or ``pytest -m "not e2e"`` selects tiers; the markers are
registered in ``pyproject.toml`` and ``--strict-markers`` refuses any other.

Tests marked ``slow`` (the rest of a family whose representative runs in every run:
the architecture matrix, the longer bench smokes, the longest e2e runs) are deselected
by a plain ``pytest`` (what CI runs); ``pytest -m slow`` runs them alone and
``pytest --slow`` runs everything.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

TIERS = ("unit", "ray_local", "e2e", "gpu")
# torch.distributed's rendezvous variables as the session found them: a trainer engine
# built in this process sets them for a world of one, and a Ray cluster started later
# would hand its workers a port this process still listens on.
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_SESSION_RENDEZVOUS = {key: os.environ.get(key) for key in RENDEZVOUS}
_TESTS = Path(__file__).resolve().parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (all of them)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = Path(str(item.path)).resolve().relative_to(_TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in one of tests/{{{','.join(TIERS)}}}/, got tests/{tier}")
        item.add_marker(getattr(pytest.mark, tier))
    if not runs_slow(config):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]


def runs_slow(config: pytest.Config) -> bool:
    """``--slow``, or a ``-m`` expression that names ``slow`` (it then decides alone)."""
    return config.getoption("--slow") or "slow" in (config.getoption("markexpr") or "")


@pytest.fixture(autouse=True)
def _restore_rendezvous_env():
    yield
    for key, value in _SESSION_RENDEZVOUS.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from pipeline.runner import init_ray

    init_ray()
    yield ray
    ray.shutdown()


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty, offline Hugging Face Hub cache under a fresh ``HF_HOME`` (``tests/hub_cache.py``
    adds repositories to it)."""
    from tests.hub_cache import use_hub_cache

    return use_hub_cache(tmp_path / "hf_home", monkeypatch)
