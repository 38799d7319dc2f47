"""Ray tier: a stage actor whose process is killed (SIGKILL) is restarted by Ray and the
micro-batches it held are delivered again; the consumer sees every sample exactly once.
Real queues, shells and runner; the cores are fakes (``tests/ray_local/fakes.py``)."""

from __future__ import annotations

import collections

import pytest

from pipeline.dataflow import DataFlow
from tests.ray_local.fakes import FakeDyingStage, FakeGroupSource, FakeSampleSink

BATCHES, GROUPS, GROUP_SIZE = 24, 2, 2


# Lock-step is slow: the same kills and the same accounting as streaming, which runs in every run.
@pytest.mark.parametrize("async_execution", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["streaming", "lock-step"])
def test_killed_stages_restart_and_nothing_is_lost_or_repeated(ray_cluster, tmp_path, async_execution):
    df = DataFlow()
    df.add_node("source", FakeGroupSource, None, count=BATCHES, groups=GROUPS, group_size=GROUP_SIZE)
    # "slow" dies first, holding leases of "fast"'s outputs (requeued, copied to outlive
    # "fast"); "fast" dies later with outputs still queued for the slower "slow" (those
    # die with it, their inputs are delivered again).
    df.add_node("fast", FakeDyingStage, "source", max_restarts=2, die_at=12,
                marker=str(tmp_path / "fast"), delay_s=0.02)
    df.add_node("slow", FakeDyingStage, "fast", max_restarts=2, queue_size=3, die_at=5,
                marker=str(tmp_path / "slow"), delay_s=0.15)
    df.add_node("sink", FakeSampleSink, "slow")
    # Lock-step: the step barrier waits for the micro-batches delivered again.
    result = df.run(async_execution=async_execution, micro_batches_per_step=4)

    assert result.restarts == {"fast:0": 1, "slow:0": 1}
    arrived = collections.Counter(s for _, ids, _ in result.result("sink") for s in ids)
    expected = {f"b{b}/g{g}/{k}" for b in range(BATCHES) for g in range(GROUPS) for k in range(GROUP_SIZE)}
    assert set(arrived) == expected  # nothing lost
    assert max(arrived.values()) == 1  # nothing twice
    # Each death sent its held items back through its input queue.
    assert result.queues["source->fast"]["redelivered"] >= 1
    assert result.queues["fast->slow"]["redelivered"] >= 1
    for q in result.queues.values():
        assert q["leased"] <= 3  # released as they were read downstream: no pile-up
