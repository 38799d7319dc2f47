"""Profiler core: span recording, union-based aggregation, bounds, metrics and outputs."""

from __future__ import annotations

import json
import threading

import pytest

from pipeline.profiler import (
    GpuSampler,
    SpanRecorder,
    SpanTotals,
    aggregate_spans,
    build_chrome_trace,
    compute_efficiency,
    compute_ideal_throughput,
    compute_overhead_metrics,
    compute_seconds_per_item,
    compute_stage_metrics,
    format_summary_table,
    merge_intervals,
    plot_timeline,
    write_chrome_trace,
)
from pipeline.types import Span


def span(stage: str, kind: str, start: float, end: float, batch_id: int = -1) -> Span:
    return Span(stage=stage, kind=kind, start=start, end=end, batch_id=batch_id)


class FakeClock:
    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


# ------------------------------------------------------------------------ recorder

def test_recorder_span_times_block_with_injected_clock_and_drain_clears():
    rec = SpanRecorder("rollout", clock=FakeClock(10.0, 12.5))
    with rec.span("busy", batch_id=3):
        pass
    assert rec.drain() == [span("rollout", "busy", 10.0, 12.5, 3)]
    assert rec.drain() == []


def test_recorder_records_span_when_block_raises():
    rec = SpanRecorder("reward", clock=FakeClock(1.0, 2.0))
    with pytest.raises(KeyError), rec.span("busy", batch_id=7):
        raise KeyError("boom")
    assert rec.drain() == [span("reward", "busy", 1.0, 2.0, 7)]


def test_recorder_clamps_backward_clock_step_to_zero_length():
    # The wall clock stepped back from 5.0 to 4.0 inside the block: the span is (5, 5).
    rec = SpanRecorder("trainer", clock=FakeClock(5.0, 4.0))
    with rec.span("sync"):
        pass
    assert rec.drain() == [span("trainer", "sync", 5.0, 5.0)]


def test_recorder_rejects_unknown_kind_and_negative_span():
    rec = SpanRecorder("trainer")
    with pytest.raises(ValueError, match="span kind"):
        rec.add("bussy", 0.0, 1.0)
    with pytest.raises(ValueError, match="before start"):
        rec.add("busy", 2.0, 1.0)
    assert rec.drain() == []


def test_recorder_bounded_buffer_drops_oldest_and_counts():
    rec = SpanRecorder("source", max_buffered=2)
    for i in range(3):
        rec.add("busy", float(i), float(i) + 0.5, batch_id=i)
    # Capacity 2, three spans: batch 0 is dropped, 1 and 2 stay.
    assert [s.batch_id for s in rec.drain()] == [1, 2]
    assert rec.dropped == 1


def test_recorder_loses_nothing_with_concurrent_adds_and_drains():
    rec = SpanRecorder("rollout")
    drained: list[Span] = []

    def produce() -> None:
        for i in range(2000):
            rec.add("busy", 0.0, 1.0, batch_id=i)

    threads = [threading.Thread(target=produce) for _ in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        drained.extend(rec.drain())
    for t in threads:
        t.join()
    drained.extend(rec.drain())
    # 4 threads x 2000 spans, each drained exactly once.
    assert len(drained) == 8000
    assert rec.dropped == 0


# --------------------------------------------------------------------- aggregation

def test_merge_intervals_joins_overlapping_and_touching():
    # (0,2)+(1,3) overlap -> (0,3); (3,4) touches -> (0,4); (6,7) stays apart.
    assert merge_intervals([(6, 7), (1, 3), (0, 2), (3, 4)]) == [(0, 4), (6, 7)]


def test_overlapping_busy_spans_count_as_union_not_sum():
    spans = [
        span("rollout", "busy", 0.0, 2.0, 1),
        span("rollout", "busy", 1.0, 3.0, 2),  # concurrent request: overlaps [1, 2]
        span("rollout", "busy", 5.0, 6.0, 3),
        span("rollout", "wait_input", 3.0, 5.0),
    ]
    agg = aggregate_spans(spans, window=(0.0, 10.0))
    t = agg["rollout"]
    # busy = |[0,3] u [5,6]| = 3 + 1 = 4 s (the sum would be 5); ratio 4/10.
    assert t.seconds["busy"] == pytest.approx(4.0)
    assert t.busy_ratio == pytest.approx(0.4)
    assert t.idle_ratio == pytest.approx(0.6)
    assert t.seconds["wait_input"] == pytest.approx(2.0)
    assert t.seconds["sync"] == 0.0
    assert t.intervals["busy"] == ((0.0, 3.0), (5.0, 6.0))


def test_window_clips_spans():
    spans = [
        span("rollout", "busy", 0.0, 2.0),
        span("rollout", "busy", 1.0, 3.0),
        span("rollout", "busy", 5.0, 6.0),
        span("rollout", "wait_input", 3.0, 5.0),
        span("rollout", "busy", 8.0, 9.0),  # wholly outside the window
    ]
    t = aggregate_spans(spans, window=(2.0, 6.0))["rollout"]
    # busy inside [2,6]: [2,3] u [5,6] = 2 s of 4 s -> 0.5; wait_input [3,5] = 2 s.
    assert t.seconds["busy"] == pytest.approx(2.0)
    assert t.busy_ratio == pytest.approx(0.5)
    assert t.idle_ratio == pytest.approx(0.5)
    assert t.seconds["wait_input"] == pytest.approx(2.0)
    assert t.window_s == pytest.approx(4.0)


def test_default_window_spans_all_stages():
    spans = [span("rollout", "busy", 0.0, 2.0), span("trainer", "busy", 4.0, 8.0)]
    agg = aggregate_spans(spans, window=None)
    # Window (0, 8) for both: rollout 2/8 = 0.25, trainer 4/8 = 0.5 (idle before it started).
    assert list(agg) == ["rollout", "trainer"]
    assert agg["rollout"].busy_ratio == pytest.approx(0.25)
    assert agg["trainer"].busy_ratio == pytest.approx(0.5)
    assert agg["trainer"].idle_ratio == pytest.approx(0.5)


def test_stage_with_no_span_in_window_is_fully_idle():
    agg = aggregate_spans([span("reward", "busy", 20.0, 21.0)], window=(0.0, 10.0))
    assert agg["reward"].busy_ratio == 0.0
    assert agg["reward"].idle_ratio == 1.0


def test_aggregate_rejects_inverted_window_and_accepts_empty():
    assert aggregate_spans([], window=None) == {}
    with pytest.raises(ValueError, match="window"):
        aggregate_spans([span("a", "busy", 0.0, 1.0)], window=(5.0, 1.0))


# ------------------------------------------------------------------ ideal bound

def test_ideal_throughput_is_set_by_the_slowest_stage():
    # max(0.1, 0.2, 0.05) = 0.2 s/item -> 1 / 0.2 = 5 items/s, bottleneck reward.
    stage, rate = compute_ideal_throughput({"rollout": 0.1, "reward": 0.2, "trainer": 0.05})
    assert stage == "reward"
    assert rate == pytest.approx(5.0)
    # 4 achieved of 5 ideal -> 0.8.
    assert compute_efficiency(4.0, rate) == pytest.approx(0.8)


def test_ideal_throughput_rejects_degenerate_inputs():
    with pytest.raises(ValueError):
        compute_ideal_throughput({})
    with pytest.raises(ValueError):
        compute_ideal_throughput({"a": 0.0})
    with pytest.raises(ValueError):
        compute_efficiency(1.0, 0.0)


def test_seconds_per_item_divides_busy_union_by_items():
    agg = aggregate_spans([span("rollout", "busy", 0.0, 3.0), span("rollout", "busy", 2.0, 4.0)])
    # busy = |[0,4]| = 4 s over 20 items -> 0.2 s/item; a stage with 0 items is left out.
    assert compute_seconds_per_item(agg, {"rollout": 20}) == {"rollout": pytest.approx(0.2)}
    assert compute_seconds_per_item(agg, {"rollout": 0}) == {}


# ------------------------------------------------------------------------ metrics

def test_stage_and_overhead_metrics_from_hand_built_spans():
    spans = [
        span("rollout", "busy", 0.0, 6.0),
        span("rollout", "sync", 6.5, 7.5),
        span("rollout", "transfer", 8.0, 9.0),
        span("trainer", "transfer", 2.0, 3.0),
        span("trainer", "busy", 4.0, 10.0),
        span("trainer", "sync", 6.0, 7.0),
    ]
    agg = aggregate_spans(spans)
    metrics = {**compute_stage_metrics(agg), **compute_overhead_metrics(agg)}
    # Window (0, 10). Busy 6 s each -> ratio 0.6, idle 0.4. Sync union [6,7] u [6.5,7.5]
    # = [6,7.5] = 1.5 s -> 0.15 of 10 s. Transfer 1 s + 1 s = 2 stage-seconds of 2 x 10 -> 0.1.
    assert metrics == pytest.approx({
        "timing_s/rollout": 6.0, "rollout/busy_ratio": 0.6, "rollout/idle_ratio": 0.4,
        "timing_s/trainer": 6.0, "trainer/busy_ratio": 0.6, "trainer/idle_ratio": 0.4,
        "timing_s/weight_sync": 1.5, "perf/weight_sync_share": 0.15,
        "timing_s/queue_transfer": 2.0, "perf/queue_transfer_share": 0.1,
    })


def test_chrome_trace_format(tmp_path):
    spans = [
        span("rollout", "busy", 100.0, 100.5, 1),
        span("rollout", "busy", 100.25, 101.0, 2),  # concurrent with batch 1
        span("trainer", "busy", 101.0, 102.0, 1),
        span("trainer", "wait_input", 102.0, 102.5),
    ]
    path = write_chrome_trace(spans, tmp_path / "trace.json", markers=[(101.5, "weight_sync v1")])
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    # Overlapping rollout spans need a second lane; the trainer's sequential spans share one.
    assert names == {1: "rollout", 2: "rollout #2", 3: "trainer"}
    complete = [e for e in events if e["ph"] == "X"]
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= e.keys()
        assert e["pid"] == 1
    # Microseconds since the first span (t0 = 100.0): 0.25 s -> 250000 us, etc.
    got = [(e["tid"], e["name"], e["ts"], e["dur"], e["args"]["batch_id"]) for e in complete]
    assert got == [
        (1, "busy", 0.0, 500000.0, 1),
        (2, "busy", 250000.0, 750000.0, 2),
        (3, "busy", 1000000.0, 1000000.0, 1),
        (3, "wait_input", 2000000.0, 500000.0, -1),
    ]
    instants = [e for e in events if e["ph"] == "i"]
    assert [(e["name"], e["ts"], e["s"]) for e in instants] == [("weight_sync v1", 1500000.0, "g")]
    assert {"pid", "tid"} <= instants[0].keys()


def test_chrome_trace_of_no_spans_is_valid():
    assert build_chrome_trace([])["traceEvents"][0]["name"] == "process_name"


def test_timeline_png_is_written(tmp_path):
    spans = [
        span("rollout", "busy", 0.0, 2.0),
        span("rollout", "wait_output", 2.0, 3.0),
        span("trainer", "wait_input", 0.0, 1.0),
        span("trainer", "busy", 1.0, 3.0),
        span("trainer", "sync", 3.0, 3.2),
    ]
    path = plot_timeline(spans, tmp_path / "out" / "timeline.png", markers=[(3.0, "v1")])
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1000


def test_timeline_of_no_spans_still_writes_png(tmp_path):
    path = plot_timeline([], tmp_path / "empty.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_summary_table_shows_ratios_and_seconds():
    agg = aggregate_spans([span("rollout", "busy", 0.0, 6.0), span("trainer", "sync", 9.0, 10.0)])
    table = format_summary_table(agg)
    lines = table.splitlines()
    # Window (0, 10): rollout busy 6 s -> 60.0 % busy, 40.0 % idle; trainer 0 busy, 1 s sync.
    assert lines[0].split() == ["stage", "busy", "%", "idle", "%", "busy", "s", "sync", "s"]
    assert lines[2].split() == ["rollout", "60.0", "40.0", "6.00", "0.00"]
    assert lines[3].split() == ["trainer", "0.0", "100.0", "0.00", "1.00"]


# ---------------------------------------------------------------------------- GPU

def test_gpu_sampler_uses_query_and_disables_after_failure():
    assert GpuSampler(query=lambda: 42).sample() == 42.0
    calls = []

    def broken() -> float:
        calls.append(1)
        raise RuntimeError("no NVML")

    sampler = GpuSampler(query=broken)
    # First call fails -> None; the second returns None without asking the backend again.
    assert sampler.sample() is None
    assert sampler.sample() is None
    assert len(calls) == 1


def test_gpu_sampler_default_backend_never_raises():
    value = GpuSampler().sample()
    assert value is None or 0.0 <= value <= 100.0


# ------------------------------------------------------------------- running totals

def test_span_totals_fold_settled_time_and_count_a_late_span_once() -> None:
    totals = SpanTotals(settle_s=5.0)
    totals.add([span("rollout", "busy", 0.0, 2.0), span("rollout", "busy", 1.0, 3.0)])
    totals.add([span("rollout", "busy", 10.0, 12.0), span("reward", "wait_input", 11.0, 11.5)])
    # Horizon 12 - 5 = 7: [0, 3] is folded (3 s) and forgotten, [10, 12] stays open.
    assert totals.aggregates()["rollout"].intervals["busy"] == ((10.0, 12.0),)
    # A late span over folded time counts only its part after 3: [3, 4] adds 1 s.
    totals.add([span("rollout", "busy", 2.5, 4.0)])
    t = totals.aggregates()["rollout"]
    # Union of [0,2], [1,3], [2.5,4], [10,12] = [0,4] + [10,12] = 6 s over the window [0, 12].
    assert t.seconds["busy"] == pytest.approx(6.0)
    assert t.window == (0.0, 12.0)
    assert t.busy_ratio == pytest.approx(0.5)
    assert totals.aggregates()["reward"].seconds["wait_input"] == pytest.approx(0.5)


def test_span_totals_match_aggregate_spans_and_stay_bounded() -> None:
    import random

    rng = random.Random(0)
    spans, open_sizes = [], []
    totals = SpanTotals(settle_s=10.0)
    t = 0.0
    for _ in range(200):  # 200 driver ticks of overlapping spans of three stages
        chunk = []
        for stage in ("rollout", "reward", "trainer"):
            for kind in ("busy", "wait_input"):
                start = t + rng.uniform(0.0, 1.0)
                chunk.append(span(stage, kind, start, start + rng.uniform(0.0, 2.0)))
        spans += chunk
        totals.add(chunk)
        open_sizes.append(sum(len(v) for s in totals.aggregates().values() for v in s.intervals.values()))
        t += 1.0
    want, got = aggregate_spans(spans), totals.aggregates()
    assert list(got) == list(want)
    for stage in want:
        assert got[stage].window == want[stage].window
        for kind, seconds in want[stage].seconds.items():
            assert got[stage].seconds[kind] == pytest.approx(seconds, abs=1e-9)
    # Only the last ~settle_s seconds stay as intervals: at most ~13 per (stage, kind).
    assert max(open_sizes) <= 6 * 13
