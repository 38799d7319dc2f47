"""Staleness rules and the prompt ledger."""

from __future__ import annotations

import pytest

from pipeline.versions import Ledger, is_too_stale, required_serving_version


def test_staleness_gate():
    # trainer at v5: a batch from v4 is 1 step stale, from v3 is 2.
    assert not is_too_stale(5, 4, max_staleness=1)
    assert is_too_stale(5, 3, max_staleness=1)
    assert not is_too_stale(5, 5, max_staleness=0)
    assert is_too_stale(5, 4, max_staleness=0)


@pytest.mark.parametrize(
    ("step", "eta", "interval", "need"),
    [
        (0, 0, 1, 0),  # the first step runs on the initial weights
        (5, 0, 1, 5),  # on-policy: wait for the previous step's weights
        (5, 2, 1, 3),
        (5, 1, 2, 4),  # versions are only published at multiples of 2: 4 is the first >= 5-1
        (3, 1, 2, 2),
        (2, 1, 2, 2),  # not 0: v0 is 2 steps old at step 2, beyond eta = 1
        (4, 2, 3, 3),  # first multiple of 3 at or after 4-2 = 2
    ],
)
def test_required_serving_version(step, eta, interval, need):
    assert required_serving_version(step, eta, interval) == need


@pytest.mark.parametrize(("eta", "interval"), [(0, 1), (1, 1), (1, 2), (2, 2), (2, 3), (3, 2), (5, 4)])
def test_every_valid_schedule_generates_only_trainable_samples(eta, interval):
    """For every config check_config accepts (eta >= interval - 1), step k generates on a
    published version that is trainable at step k and exists before step k trains."""
    assert eta >= interval - 1
    for step in range(50):
        v = required_serving_version(step, eta, interval)
        assert v % interval == 0  # a version the trainer publishes
        assert not is_too_stale(step, v, eta)  # the trainer keeps these samples
        assert v <= step  # published after step v - 1 < step: no wait on the future


def test_ledger_reconciles_and_replaces_drops():
    led = Ledger(target=8, prompts_per_step=4)
    assert led.admit(4) == (4, 0)
    assert led.admit(4) == (4, 1)
    assert led.admit(4) == (0, 2)  # target covered by what is in flight
    led.record_dropped(4, "stale")
    assert led.admit(4) == (4, 1)  # the drop reopened room; the replacement goes to step 1
    led.record_trained(4)
    assert not led.finished
    led.record_trained(4)
    assert led.finished
    s = led.summary()
    assert s == {"admitted": 12, "trained": 8, "dropped": {"stale": 4}, "dropped_total": 4,
                 "in_flight": 0, "reconciles": True}


def test_ledger_refuses_more_than_in_flight():
    led = Ledger(target=4, prompts_per_step=4)
    led.admit(2)
    with pytest.raises(ValueError, match="only 2 in flight"):
        led.record_trained(3)


@pytest.mark.parametrize(("eta", "slack", "interval", "lookahead"), [
    (2, 0, 1, 2), (2, 1, 1, 1), (2, 2, 1, 0), (3, 1, 2, 2), (2, 2, 2, 1), (1, 3, 1, 0)])
def test_tail_slack_comes_out_of_the_lead_and_leaves_a_late_sample_trainable(eta, slack, interval, lookahead):
    from pipeline.versions import compute_lookahead

    assert compute_lookahead(eta, slack, interval) == lookahead
    # A sample of step k generated on the version it waited for is trainable up to
    # step k + (η - lookahead), at least k: the slack a long sample has to arrive late.
    for step in range(20):
        v = required_serving_version(step, lookahead, interval)
        last = max(k for k in range(step, step + 10) if not is_too_stale(k, v, eta))
        assert last >= step + min(slack, eta - (interval - 1)) and v <= step
