"""Tier markers come from the folder (``tests/conftest.py``), so ``pytest -m unit`` works."""

from __future__ import annotations

import pytest


def test_a_unit_test_carries_the_unit_marker_only(request: pytest.FixtureRequest) -> None:
    tiers = {m.name for m in request.node.iter_markers() if m.name in ("unit", "ray_local", "e2e", "gpu")}
    assert tiers == {"unit"}
