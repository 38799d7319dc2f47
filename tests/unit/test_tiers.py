"""Tier markers come from the folder (``tests/conftest.py``), so ``pytest -m unit`` works."""

from __future__ import annotations

import pytest


def test_a_unit_test_carries_the_unit_marker_only(request: pytest.FixtureRequest) -> None:
    tiers = {m.name for m in request.node.iter_markers() if m.name in ("unit", "ray_local", "e2e", "gpu")}
    assert tiers == {"unit"}


def _collected(*args: str) -> list[str]:
    """The test names ``pytest --collect-only`` selects from the bench smokes with ``args``."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/ray_local/test_bench_smoke.py", *args], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return [line.split("::")[1] for line in out.stdout.splitlines() if "::" in line]


def test_a_plain_run_leaves_the_slow_tests_out_and_m_slow_or_slow_runs_them() -> None:
    fast = ["test_overlap_quick_writes_result"]
    slow = ["test_queue_hop_quick_writes_result", "test_staleness_quick_writes_result", "test_soak_quick_writes_result",
            "test_soak_quick_recovers_from_each_new_fault", "test_soak_quick_recovers_from_an_engine_kill",
            "test_soak_memory_quick_writes_result"]
    assert _collected() == fast
    assert _collected("-m", "slow") == slow
    assert _collected("--slow") == [*fast, *slow]
    assert _collected("--slow", "-k", "soak") == slow[2:]
