"""Ray tier: the real queues, actors and runner with fake cores."""

from __future__ import annotations

import pytest

from pipeline import runner
from pipeline.dataflow import DataFlow
from pipeline.stage import StageError
from tests.ray_local.fakes import (
    FakeBlockingSetupSink,
    FakeEnvStage,
    FakeGatheringSink,
    FakeGroupSource,
    FakeOomStage,
    FakeScoredSink,
    FakeSink,
    FakeSource,
    FakeStage,
    FakeTimedSetupSink,
    FakeTimedSetupStage,
    FakeWatchedStage,
)


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


def test_a_nodes_env_reaches_its_process_beside_the_runs_own(ray_cluster):
    """``Node.env`` (how GPU stages get the MPS daemon's variables) is merged into the
    run's environment for that node's process only."""
    df = DataFlow()
    df.add_node("source", FakeSource, None, count=3)
    df.add_node("other", FakeEnvStage, "source", names=("CONVEYOR_NODE_ENV",))
    df.add_node("sink", FakeEnvStage, "other", names=("CONVEYOR_NODE_ENV", "PYTHONPATH"), terminal=True)
    df.nodes["sink"].env["CONVEYOR_NODE_ENV"] = "mps-pipe"
    result = df.run(async_execution=True)
    got = result.result("sink")
    assert got["CONVEYOR_NODE_ENV"] == "mps-pipe"
    # The run's runtime_env (pipeline/runner.py) still applies: its set-up hook unblocked
    # SIGTERM, which the local cluster's processes were started with blocked.
    assert got["sigterm_blocked"] is False and got["PYTHONPATH"]
    assert result.result("other") == {"CONVEYOR_NODE_ENV": None, "sigterm_blocked": False}


def test_a_node_sets_up_after_the_nodes_it_names(ray_cluster, capfd):
    """``Node.setup_after`` (the trainer beside a vLLM that sizes its cache from the GPU's
    free memory): its set-up begins once theirs have ended; the others set up together."""
    df = DataFlow()
    df.add_node("source", FakeSource, None, count=3)
    df.add_node("engine", FakeTimedSetupStage, "source", setup_s=2.0)
    df.add_node("beside", FakeTimedSetupStage, "engine", setup_s=0.2)
    df.add_node("sink", FakeTimedSetupSink, "beside", setup_s=0.2)
    df.nodes["beside"].setup_after = ("engine",)
    result = df.run(async_execution=True)
    engine, beside, sink = (result.result(n) for n in ("engine", "beside", "sink"))
    assert beside["began"] >= engine["ended"] > sink["began"]  # the sink did not wait for it
    assert "setting_up_first" in capfd.readouterr().out


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


def test_a_gathering_core_takes_what_is_queued_in_order_and_each_item_once(ray_cluster):
    df = DataFlow()
    df.add_node("source", FakeSource, None, count=30)
    df.add_node("sink", FakeGatheringSink, "source", queue_size=8, max_gather=4, delay_s=0.05)
    result = df.run(async_execution=True).result("sink")
    assert [seq for _, seq, _ in result["arrived"]] == list(range(30))  # once each, in order
    sizes = [len(c) for c in result["calls"]]
    assert max(sizes) == 4  # a slow core catches up on what waited, at most max_gather at once
    assert len(sizes) < 30


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
    # Where it was raised: the core's line, from the project's root.
    assert info.value.where.startswith("tests/ray_local/fakes.py:90 in "), info.value.where


def test_a_core_that_reports_a_failure_stops_the_run_while_its_input_waits(ray_cluster):
    """A core's background task fails (``ctx.fail``, as the rollout's weight watcher does
    when an update is refused) while no item has reached the core: the run stops with that
    error, naming the stage, instead of waiting for an item that may never come."""
    df = DataFlow()
    df.add_node("source", FakeSource, None, count=1, delay_s=300)  # its one item comes late
    df.add_node("watched", FakeWatchedStage, "source")
    df.add_node("sink", FakeSink, "watched")
    with pytest.raises(StageError) as info:
        df.run(async_execution=True)
    assert info.value.stage == "watched"
    assert "RuntimeError: fake watcher failure" in str(info.value)


def test_stages_still_setting_up_are_logged_by_name_and_the_run_goes_on(ray_cluster, monkeypatch, capsys):
    monkeypatch.setattr(runner, "SETUP_REPORT_S", 0.25)
    df = DataFlow()
    df.add_node("source", FakeSource, None, count=4)
    df.add_node("slow_start", FakeSink, "source", setup_s=5.0)
    result = df.run(async_execution=True)
    assert len(result.result("slow_start")) == 4
    reports = [line for line in "".join(capsys.readouterr()).splitlines() if "setting_up" in line]
    assert len(reports) >= 2, reports  # one every 0.25 s over the 5 s set-up
    # The source set up in a moment: the last reports name the slow stage alone, with
    # what its set-up says it is doing.
    assert "'slow_start'" in reports[-1] and "'source'" not in reports[-1], reports[-1]
    assert "'slow_start:0': 'fake engine start of 5 s'" in reports[-1], reports[-1]


def test_a_set_up_that_holds_its_loop_is_still_named_without_saying_what_it_does(ray_cluster, monkeypatch, capsys):
    monkeypatch.setattr(runner, "SETUP_REPORT_S", 0.25)
    monkeypatch.setattr(runner, "SETUP_PROBE_S", 0.1)
    df = DataFlow()
    df.add_node("source", FakeSource, None, count=2)
    df.add_node("importing", FakeBlockingSetupSink, "source", setup_s=3.0)
    assert len(df.run(async_execution=True).result("importing")) == 2
    reports = [line for line in "".join(capsys.readouterr()).splitlines() if "setting_up" in line]
    assert reports and all("'importing'" in line and "doing" not in line for line in reports), reports


def test_a_failed_set_up_stops_the_run_while_another_stage_still_sets_up(ray_cluster):
    # "stuck" comes first and never finishes its set-up; "broken"'s failure ends the run.
    df = DataFlow()
    df.add_node("source", FakeSource, None, count=4)
    df.add_node("stuck", FakeStage, "source", setup_s=3600.0)
    df.add_node("broken", FakeSink, "stuck", setup_error="no checkpoint at /nowhere")
    with pytest.raises(StageError) as info:
        df.run(async_execution=True)
    assert info.value.stage == "broken"
    assert "no checkpoint at /nowhere" in str(info.value)


def test_a_stage_whose_constructor_raises_is_named_with_its_error(ray_cluster):
    df = DataFlow()
    df.add_node("source", FakeSource, None, count=4)
    df.add_node("bad", FakeSink, "source", no_such_option=1)
    with pytest.raises(StageError) as info:
        df.run(async_execution=True)
    assert info.value.stage == "bad" and not info.value.died
    assert "could not be constructed: TypeError:" in str(info.value)
    assert "unexpected keyword argument 'no_such_option'" in str(info.value)


def test_stage_that_raises_in_lockstep_mode_is_named(ray_cluster):
    df = DataFlow()
    df.add_node("source", FakeSource, None, count=8)
    df.add_node("bad", FakeStage, "source", fail_at=5)
    df.add_node("sink", FakeSink, "bad")
    with pytest.raises(StageError) as info:
        df.run(async_execution=False, micro_batches_per_step=2)
    assert info.value.stage == "bad"


def test_debug_run_checks_the_first_micro_batch_against_the_consumers_declaration(ray_cluster):
    # The source is undeclared, so the graph passes validation; what it sends lacks the
    # ref_logprobs the sink declares it needs. Without debug nothing looks; with it, the
    # first micro-batch on the edge stops the run, the edge and the field named.
    def graph() -> DataFlow:
        df = DataFlow()
        df.add_node("source", FakeGroupSource, None, count=3, groups=2)
        df.add_node("sink", FakeScoredSink, "source")
        return df

    assert len(graph().run(async_execution=True).result("sink")) == 3
    with pytest.raises(StageError) as info:
        graph().run(async_execution=True, debug=True)
    assert info.value.stage == "sink"
    assert "edge 'source->sink': sink needs ref_logprobs set, got None" in str(info.value)
    assert "WireMismatch" in str(info.value)


def test_debug_run_passes_micro_batches_that_fit(ray_cluster):
    df = DataFlow()
    df.add_node("source", FakeGroupSource, None, count=3, groups=2)
    df.add_node("score", FakeOomStage, "source", max_groups=8)  # sets ref_logprobs
    df.add_node("sink", FakeScoredSink, "score")
    arrived = df.run(async_execution=True, debug=True).result("sink")
    assert [(bid, scored) for bid, _, scored in arrived] == [(0, True), (1, True), (2, True)]
