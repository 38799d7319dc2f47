"""Ray tier: the real queues, actors and runner with fake cores."""

from __future__ import annotations

import pytest

from pipeline.dataflow import DataFlow
from pipeline.stage import StageError
from tests.ray_local.fakes import FakeSink, FakeSource, FakeStage


def test_every_item_arrives_once_in_per_producer_order(ray_cluster):
    df = DataFlow()
    df.add_node("source", FakeSource, None, replicas=2, count=20)
    df.add_node("double", FakeStage, "source")
    df.add_node("sink", FakeSink, "double")
    result = df.run(async_execution=True)
    arrived = result.result("sink")
    assert len(arrived) == 40
    by_producer: dict[str, list[int]] = {}
    for producer, seq, trail in arrived:
        by_producer.setdefault(producer, []).append(seq)
        assert trail == ("double", "sink")
    assert sorted(by_producer) == ["src0", "src1"]
    for seqs in by_producer.values():
        assert seqs == list(range(20))  # exactly once each, in the producer's order


def test_slow_consumer_blocks_producer_within_bound(ray_cluster):
    df = DataFlow()
    df.add_node("source", FakeSource, None, count=12)
    df.add_node("slow", FakeSink, "source", queue_size=2, delay_s=0.05)
    result = df.run(async_execution=True)
    q = result.queues["source->slow"]
    assert q["max_depth"] <= 2
    assert q["max_depth"] == 2  # the fast producer did fill the queue
    assert q["put_wait_s"] > 0  # ... and was suspended while it was full
    assert len(result.result("slow")) == 12


def test_stage_that_raises_stops_the_run_with_its_error(ray_cluster):
    df = DataFlow()
    df.add_node("source", FakeSource, None, count=50)
    df.add_node("bad", FakeStage, "source", fail_at=3)
    df.add_node("sink", FakeSink, "bad")
    with pytest.raises(StageError) as info:
        df.run(async_execution=True)
    assert info.value.stage == "bad"
    assert "fake failure at item 3" in str(info.value)
    assert "ValueError" in info.value.remote_traceback


def test_stage_that_raises_in_lockstep_mode_is_named(ray_cluster):
    df = DataFlow()
    df.add_node("source", FakeSource, None, count=8)
    df.add_node("bad", FakeStage, "source", fail_at=5)
    df.add_node("sink", FakeSink, "bad")
    with pytest.raises(StageError) as info:
        df.run(async_execution=False, micro_batches_per_step=2)
    assert info.value.stage == "bad"
