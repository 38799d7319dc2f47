"""The admission driver (``pipeline/memory/guard.py``) with injected readings, clock and
sleep; the driver's summary of it; pieces cut at recorded group counts."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.config import MemoryConfig
from pipeline.launch import summarise_admission
from pipeline.memory.admission import AdmissionTimeout
from pipeline.memory.guard import MemoryGuard, build_pool_reading, merge_guard_metrics, shift_reading
from pipeline.memory.oom import OomEvent
from pipeline.memory.readings import MemoryReading
from pipeline.memory.splitting import merge_rollout_batches, split_rollout_batch, split_rollout_batch_at
from pipeline.profiler import SpanRecorder
from tests.unit.test_admission import FakeClock, assert_batches_equal, make_batch

MiB = 1 << 20
GROUP = 100  # bytes per GRPO group in the estimates below


def reading(used: int, free: int = 10**9, total: int = 10**10) -> MemoryReading:
    return MemoryReading(used_bytes=used, free_bytes=free, total_bytes=total, source="cpu")


class Readings:
    """``read`` for the guard: returns ``self.now``, counts the calls."""

    def __init__(self, used: int) -> None:
        self.now = reading(used)
        self.calls = 0

    def __call__(self) -> MemoryReading:
        self.calls += 1
        return self.now


def make_guard(read, clock: FakeClock | None = None, **cfg: object) -> tuple[MemoryGuard, list[float]]:
    slept: list[float] = []
    clock = clock or FakeClock()

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.t += seconds

    config = MemoryConfig(defer_timeout_s=1.0, **cfg)  # type: ignore[arg-type]
    return MemoryGuard("reference", config, read=read, now=clock, sleep=sleep), slept


def run_groups(guard: MemoryGuard, batch, work) -> object:
    return asyncio.run(guard.run(
        batch, work, estimate=lambda b: GROUP * len(b.prompts), split=split_rollout_batch,
        merge=merge_rollout_batches, size=lambda b: len(b.prompts), key=batch.batch_id,
    ))


def test_shift_and_pool_readings() -> None:
    shifted = shift_reading(reading(700, free=50, total=900), rest_bytes=500)
    assert (shifted.used_bytes, shifted.free_bytes, shifted.total_bytes) == (200, 50, 900)
    assert shift_reading(reading(100), rest_bytes=500).used_bytes == 0  # never negative
    pool = build_pool_reading(4096)
    assert (pool.used_bytes, pool.free_bytes, pool.total_bytes, pool.source) == (0, 4096, 4096, "kv_cache")


def test_work_budget_is_counted_above_the_resting_process() -> None:
    # The process holds 5000 at rest; a 250-byte work budget. 4 groups x 100 = 400 > 250:
    # split in 2 (400 <= 2 x 250); each half of 200 fits. Were the budget absolute, 5000
    # already used would leave nothing.
    read = Readings(used=5000)
    guard, _ = make_guard(read, budget_bytes=250)
    seen: list[list[str]] = []

    async def work(piece):
        seen.append(list(piece.sample_ids))
        return piece

    batch = make_batch(num_groups=4)
    out = run_groups(guard, batch, work)
    assert [len(s) for s in seen] == [4, 4]  # two pieces of 2 groups x 2 samples
    assert_batches_equal(out, merge_rollout_batches(split_rollout_batch(batch, 2)))
    m = guard.metrics()
    assert (m["admission/reference/splits"], m["admission/reference/admitted"]) == (1.0, 2.0)
    # Reported in absolute terms: the process's use and rest + work budget.
    assert (m["memory/reference/used_bytes"], m["memory/reference/budget_bytes"]) == (5000.0, 5250.0)
    assert guard.controller.in_flight_bytes == 0  # released


def test_ratio_budget_caps_the_whole_process() -> None:
    # No budget_bytes: 0.5 x total 10_000 = 5000 for the process; 4800 used at rest
    # leaves 200: the 400-byte batch splits into two of 200.
    read = Readings(used=4800)
    read.now = reading(4800, total=10_000)
    guard, _ = make_guard(read, max_memory_ratio=0.5)

    async def work(piece):
        return piece

    run_groups(guard, make_batch(num_groups=4), work)
    assert guard.controller.splits == 1 and guard.controller.admitted == 2
    assert guard.metrics()["memory/reference/budget_bytes"] == 5000.0


def test_defer_waits_for_free_memory_then_times_out_with_the_numbers() -> None:
    read = Readings(used=0)
    read.now = reading(0, free=50)  # 200 bytes fit the budget but not the free memory
    guard, slept = make_guard(read, budget_bytes=10_000)

    async def work(piece):
        raise AssertionError("never admitted")

    spans = guard._spans = SpanRecorder("reference")
    with pytest.raises(AdmissionTimeout, match="stage 'reference'.*estimate .* free"):
        run_groups(guard, make_batch(num_groups=2), work)
    assert sum(slept) >= 1.0 and guard.controller.deferred == 1  # one item, many polls
    assert [s.kind for s in spans.drain()] == ["wait_memory"]  # a wait that failed is one too


def test_deferred_item_runs_once_memory_frees() -> None:
    read = Readings(used=0)
    read.now = reading(0, free=50)
    clock = FakeClock()
    guard, slept = make_guard(read, clock, budget_bytes=10_000)

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        read.now = reading(0, free=10**6)  # another process let go

    guard._sleep = sleep
    done: list[int] = []

    async def work(piece):
        done.append(piece.batch_id)
        return piece

    spans = guard._spans = SpanRecorder("reference")
    run_groups(guard, make_batch(num_groups=2), work)
    assert done == [7] and len(slept) == 1 and guard.controller.deferred == 1
    # The wait is a span of its own (inside the stage's busy span): the stage table and the
    # timeline tell time waiting for memory from time computing.
    (waited,) = spans.drain()
    assert (waited.kind, waited.batch_id, waited.stage) == ("wait_memory", 7, "reference") and waited.end >= waited.start


def test_release_on_failure_and_protection_off_bypasses_everything() -> None:
    guard, _ = make_guard(Readings(used=0), budget_bytes=10_000)

    async def boom(piece):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        run_groups(guard, make_batch(num_groups=2), boom)
    assert guard.controller.in_flight_bytes == 0 and guard.controller.admitted == 1

    read = Readings(used=0)
    off, _ = make_guard(read, oom_protection=False, budget_bytes=1)
    calls: list[int] = []

    async def work(piece):
        calls.append(len(piece.prompts))
        return piece

    run_groups(off, make_batch(num_groups=4), work)
    # Whole, unestimated, unread: 400 bytes against a 1-byte budget still ran as one.
    assert calls == [4] and read.calls == 0 and off.controller.admitted == 0


def test_concurrent_parts_share_the_budget_and_keep_their_order() -> None:
    # A pool of 250 (rollout-style reading): 4 groups split in 2 halves of 200; the second
    # waits for the first to release, yet results come back in prompt order.
    pool = build_pool_reading(250)
    guard, _ = make_guard(lambda: pool)
    order: list[str] = []
    timers: list[float] = []

    async def sleep(seconds: float) -> None:  # a poll timer that never fires: only a release wakes
        timers.append(seconds)
        await asyncio.Event().wait()

    guard._sleep = sleep

    async def work(piece):
        order.append(f"start {piece.prompts[0].prompt_id}")
        await asyncio.sleep(0.01)
        order.append(f"end {piece.prompts[0].prompt_id}")
        return piece

    batch = make_batch(num_groups=4)
    out = asyncio.run(asyncio.wait_for(guard.run(  # wait_for: a missed wake-up fails instead of hanging
        batch, work, estimate=lambda b: GROUP * len(b.prompts), split=split_rollout_batch,
        merge=merge_rollout_batches, size=lambda b: len(b.prompts), key=batch.batch_id, concurrent=True,
    ), timeout=30))
    assert out.sample_ids == batch.sample_ids
    assert order == ["start g0", "end g0", "start g2", "end g2"]  # never both at once
    assert guard.controller.deferred == 1 and timers == [0.1]  # woken by g0's release, not the timer


def test_oom_events_count_and_leave_spans() -> None:
    class Spans:
        def __init__(self) -> None:
            self.added: list[tuple[str, int]] = []

        def add(self, kind: str, start: float, end: float, batch_id: int = -1) -> None:
            assert end >= start
            self.added.append((kind, batch_id))

    spans = Spans()
    guard = MemoryGuard("trainer", MemoryConfig(), read=lambda: reading(0), spans=spans)
    record = guard.on_oom(batch_id=3)
    record(OomEvent(stage="trainer", kind="oom", size=4, pieces=2))
    record(OomEvent(stage="trainer", kind="recovered", count=1))
    m = guard.metrics()
    assert (m["oom/trainer/events"], m["oom/trainer/recovered"]) == (1.0, 1.0)
    assert spans.added == [("oom", 3)]


def test_merge_guard_metrics_adds_replicas_and_averages_calibration() -> None:
    statuses = {
        "rollout": {"state": "generating", "admission/rollout/splits": 2, "memory/rollout/used_bytes": 10.0,
                    "admission/rollout/calibration": 1.0, "oom_protection": True},
        "rollout:1": {"admission/rollout/splits": 1, "memory/rollout/used_bytes": 5.0,
                      "admission/rollout/calibration": 3.0},
        "trainer": {"oom/trainer/recovered": 1.0, "samples": 7},
    }
    assert merge_guard_metrics(statuses) == {
        "admission/rollout/splits": 3.0, "memory/rollout/used_bytes": 15.0,
        "admission/rollout/calibration": 2.0, "oom/trainer/recovered": 1.0,
    }


def test_summarise_admission_names_metrics_per_stage() -> None:
    reports = {
        "source": [{"core": {"state": "x"}}],
        "rollout": [{"core": {"admission/rollout/splits": 1.0}}, {"core": {"admission/rollout/splits": 2.0}}],
        "trainer": [{"core": {"oom/trainer/recovered": 1.0, "memory/trainer/budget_bytes": 9.0}}],
        "reward": [{}],
    }
    assert summarise_admission(reports) == {
        "rollout": {"admission/splits": 3.0},
        "trainer": {"memory/budget_bytes": 9.0, "oom/recovered": 1.0},
    }


def test_split_at_counts_equals_splitting_in_rounds() -> None:
    batch = make_batch(num_groups=5)
    # Split in 2 (3 + 2 groups), then the first half again (2 + 1): counts [2, 1, 2].
    first, second = split_rollout_batch(batch, 2)
    rounds = [*split_rollout_batch(first, 2), second]
    at_once = split_rollout_batch_at(batch, [2, 1, 2])
    assert [len(p.prompts) for p in at_once] == [2, 1, 2]
    for a, b in zip(rounds, at_once, strict=True):
        assert_batches_equal(a, b)
    assert split_rollout_batch_at(batch, [5])[0] is batch
    for bad in ([2, 2], [5, 0], []):
        with pytest.raises(ValueError, match="do not cover"):
            split_rollout_batch_at(batch, bad)
