"""Ray tier: admission and OOM recovery through real queues, actors and the runner.

The scoring stage is ``FakeOomStage``: the real ``MemoryGuard`` and recovery driver
around a compute that raises a CUDA out-of-memory error above a number of GRPO groups.
"""

from __future__ import annotations

import pytest

from pipeline.dataflow import DataFlow
from pipeline.stage import StageError
from tests.ray_local.fakes import FakeGroupSource, FakeOomStage, FakeSampleSink, make_fake_rollout_batch

BATCHES, GROUPS, GROUP_SIZE = 5, 4, 2


def build(**stage_kwargs) -> DataFlow:
    df = DataFlow()
    df.add_node("source", FakeGroupSource, None, count=BATCHES, groups=GROUPS, group_size=GROUP_SIZE)
    df.add_node("score", FakeOomStage, "source", **stage_kwargs)
    df.add_node("sink", FakeSampleSink, "score")
    return df


def assert_every_sample_once_in_whole_batches(arrived) -> None:
    assert sorted(bid for bid, _, _ in arrived) == list(range(BATCHES))  # one item per micro-batch
    for bid, ids, scored in arrived:
        assert ids == make_fake_rollout_batch(bid, GROUPS, GROUP_SIZE).sample_ids  # all, once, in order
        assert scored  # every sample went through the stage's compute
    assert len({s for _, ids, _ in arrived for s in ids}) == BATCHES * GROUPS * GROUP_SIZE


def test_oom_above_one_group_recovers_by_halving(ray_cluster):
    result = build(max_groups=1).run(async_execution=True)
    assert_every_sample_once_in_whole_batches(result.result("sink"))
    score = result.result("score")
    # Per batch: 4 groups OOM -> halves of 2; the first half OOMs -> 1 + 1; the second
    # half is as large as one that failed, so it is split before it runs: 1 + 1.
    assert score["attempts"] == [4, 2, 1, 1, 1, 1] * BATCHES
    assert score["oom/score/events"] == 2 * BATCHES
    assert score["oom/score/recovered"] == 2 * BATCHES
    # The stage's status (what the driver merges into each step) carries the counters.
    assert result.reports["score"][0]["core"]["oom/score/recovered"] == 2 * BATCHES


def test_admission_splits_before_any_oom(ray_cluster):
    # 64 MiB per group, a 150 MiB work budget: 4 groups (256 MiB) split in 2 halves of 2
    # (128 MiB each fit), and compute never sees more than it can take.
    result = build(max_groups=2, bytes_per_group=64 << 20, memory={"budget_bytes": 150 << 20}).run(
        async_execution=True)
    assert_every_sample_once_in_whole_batches(result.result("sink"))
    score = result.result("score")
    assert score["attempts"] == [2, 2] * BATCHES
    assert score["admission/score/splits"] == BATCHES and score["oom/score/events"] == 0
    assert score["memory/score/budget_bytes"] > 150 << 20  # rest + work budget, in absolute terms


def test_oom_on_a_single_group_stops_the_run_naming_the_stage(ray_cluster):
    with pytest.raises(StageError) as info:
        build(max_groups=0).run(async_execution=True)
    assert info.value.stage == "score"
    assert "OomUnrecoverable" in str(info.value) and "cannot be split further" in str(info.value)
