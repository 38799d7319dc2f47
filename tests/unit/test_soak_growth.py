"""The soak's growth fit (``bench.soak.compute_growth``): slopes in MiB/hour over the
samples after the warm-up, and over the two halves of those apart."""

from __future__ import annotations

import pytest

from bench.soak import compute_growth


def _samples(rss_at_minute, minutes: int = 20) -> list[dict]:
    return [{"t_s": 60.0 * m, "object_store_mib": 1.0,
             "memory_mib": {"p": {"rss": rss_at_minute(m), "uss": rss_at_minute(m) / 2}}}
            for m in range(minutes + 1)]


def test_steady_growth_has_the_same_slope_over_both_halves():
    # 1 MiB per minute = 60 MiB/hour; USS half of it, 30.
    growth = compute_growth(_samples(lambda m: 500.0 + m), warmup_s=0.0)
    assert growth["rss_mib_per_hour"]["p"] == pytest.approx(60.0)
    assert growth["uss_mib_per_hour"]["p"] == pytest.approx(30.0)
    assert growth["rss_halves_mib_per_hour"]["p"] == pytest.approx([60.0, 60.0])
    assert growth["object_store_mib_per_hour"] == pytest.approx(0.0)


def test_growth_that_levels_off_has_a_flat_second_half():
    # 2 MiB per minute up to minute 10, then flat. Fitted from minute 4 (warm-up 240 s):
    # minutes 4..20 are 17 samples, halves of 8 (4..11) and 9 (12..20). The first half
    # holds 6 rising points (4..10) and 10 = 11: its slope lies between 0 and 120 MiB/h;
    # the second half is flat: 0.
    growth = compute_growth(_samples(lambda m: 500.0 + 2 * min(m, 10)), warmup_s=240.0)
    assert growth["samples_fitted"] == 17
    first, second = growth["rss_halves_mib_per_hour"]["p"]
    assert 60.0 < first < 120.0
    assert second == pytest.approx(0.0, abs=1e-9)
    assert 0.0 < growth["rss_mib_per_hour"]["p"] < first


def test_halves_need_three_samples_each():
    growth = compute_growth(_samples(lambda m: 500.0 + m, minutes=4), warmup_s=0.0)
    assert "p" in growth["rss_mib_per_hour"]  # 5 samples fit one line
    assert growth["rss_halves_mib_per_hour"] == {}  # but not two halves of 2 and 3
