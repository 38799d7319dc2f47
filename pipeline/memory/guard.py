"""The admission controller as a stage actor drives it: admit, defer, split, measure.

``pipeline/memory/admission.py`` decides; this module enforces the decisions on a stage's event
loop. Invariants, while ``oom_protection`` is on:
- work starts only once admitted. A SPLIT decision runs the pieces (runs of whole GRPO
  groups, each estimated and admitted on its own, split again if need be) and merges their
  results in the micro-batch's order: the stage still emits one whole micro-batch, and every
  sample is processed exactly once. DEFER waits and asks again, until ``AdmissionTimeout``
  names the stage and the numbers: it waits ``retry_after_s`` (memory freed elsewhere) or
  less, as soon as work of this stage releases its bytes;
- admitted bytes are released when the work ends, whether it returns or raises;
- with a fixed ``budget_bytes`` the budget is the stage's *work* budget: readings are
  shifted by what the process holds at rest (measured whenever nothing is in flight), so
  weights, optimizer state, runtime and allocator caches never eat into it; without one,
  ``max_memory_ratio`` of the device's total caps the whole process (``MemoryConfig``);
- a peak is measured around one piece of work at a time (the peak window is per process):
  stages that measure run one piece at a time.
With protection off the work runs as it comes: no estimate, no split, no measurement.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, TypeVar

from pipeline.config import MemoryConfig
from pipeline.memory.admission import AdmissionController, Decision, DecisionKind
from pipeline.memory.oom import OomEvent
from pipeline.memory.readings import MemoryReading, read_memory, read_peak_memory, reset_peak_memory

T = TypeVar("T")
R = TypeVar("R")

_SUMMED = ("memory/", "admission/", "oom/")


def shift_reading(reading: MemoryReading, rest_bytes: int) -> MemoryReading:
    """``reading`` with ``used_bytes`` counted above ``rest_bytes`` (what the process
    holds with nothing in flight): the frame a work budget is compared in."""
    return MemoryReading(
        used_bytes=max(0, reading.used_bytes - rest_bytes),
        free_bytes=reading.free_bytes,
        total_bytes=reading.total_bytes,
        source=reading.source,
    )


def build_pool_reading(pool_bytes: int, source: str = "kv_cache") -> MemoryReading:
    """A preallocated pool (vLLM's KV cache) seen from its owner: nothing of it is held
    at rest and all of it is free; what admitted micro-batches will take is the controller's
    in-flight sum, so admission against it is admission against the in-flight total."""
    return MemoryReading(used_bytes=0, free_bytes=pool_bytes, total_bytes=pool_bytes, source=source)


def merge_guard_metrics(statuses: dict[str, dict[str, Any]]) -> dict[str, float]:
    """One set of ``memory/``, ``admission/`` and ``oom/`` metrics from the statuses of
    several replicas (or stages): bytes and counters add up; a calibration factor is
    averaged."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for status in statuses.values():
        for key, value in status.items():
            if not key.startswith(_SUMMED) or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            sums[key] = sums.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return {k: v / counts[k] if k.endswith("/calibration") else v for k, v in sums.items()}


class MemoryGuard:
    """One stage's admission, on its event loop (see the module invariants).

    ``read`` gives the stage's reading (default: this process, ``read_memory``; the rollout
    passes its KV pool). ``spans`` (a ``SpanRecorder``) gets an ``oom`` span per recovery
    and a ``wait_memory`` span per admission that waited (DEFER) before its answer.
    """

    def __init__(
        self,
        stage: str,
        config: MemoryConfig,
        *,
        read: Callable[[], MemoryReading] = read_memory,
        spans: Any = None,
        now: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.stage = stage
        self.config = config
        self.controller = AdmissionController(stage, config, now=now)
        self._read = read
        self._spans = spans
        self._sleep = sleep
        self._rest: int | None = None
        self._attempt_started = time.time()
        self._released: asyncio.Event | None = None  # set (and replaced) at each release

    @property
    def protected(self) -> bool:
        return self.config.oom_protection

    def read(self) -> MemoryReading:
        """A reading in the frame the controller compares against the budget."""
        raw = self._read()
        if self.config.budget_bytes is None:
            return raw
        if self.controller.in_flight_bytes == 0 or self._rest is None:
            self._rest = raw.used_bytes  # re-measured at rest, as the controller does
        return shift_reading(raw, self._rest)

    async def admit(self, raw_estimate: int, *, key: Hashable, max_pieces: int | None) -> Decision:
        """ADMIT (bytes reserved: ``release`` them) or SPLIT; waits out DEFER."""
        waited_from = None
        try:
            while True:
                decision = self.controller.decide(raw_estimate, self.read(), key=key, max_pieces=max_pieces)
                if decision.kind is not DecisionKind.DEFER:
                    return decision
                if waited_from is None:
                    waited_from = time.time()
                await self._wait(decision.retry_after_s)
        except asyncio.CancelledError:
            self.controller.forget(key)
            raise
        finally:
            if waited_from is not None and self._spans is not None:  # inside the stage's busy span
                self._spans.add("wait_memory", waited_from, time.time(), key if isinstance(key, int) else -1)

    async def _wait(self, seconds: float) -> None:
        """Until ``seconds`` pass or this stage releases admitted bytes, whichever is first."""
        if self._released is None:
            self._released = asyncio.Event()
        released = asyncio.ensure_future(self._released.wait())
        timer = asyncio.ensure_future(self._sleep(seconds))
        try:
            await asyncio.wait({released, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            released.cancel()
            timer.cancel()

    def _release(self, nbytes: int) -> None:
        self.controller.release(nbytes)
        if self._released is not None:
            event, self._released = self._released, None
            event.set()  # every micro-batch waiting now asks again

    async def run(
        self,
        batch: T,
        work: Callable[[T], Awaitable[R]],
        *,
        estimate: Callable[[T], int],
        split: Callable[[T, int], Sequence[T]],
        merge: Callable[[list[R]], R],
        size: Callable[[T], int],
        key: Hashable,
        concurrent: bool = False,
    ) -> R:
        """``work(batch)`` once admitted; after SPLIT, ``merge`` of the pieces' results in
        order. ``concurrent`` pieces run at once, each when admitted (the rollout: many
        generate calls share the engine); otherwise one after another."""
        if not self.protected:
            return await work(batch)
        decision = await self.admit(estimate(batch), key=key, max_pieces=size(batch))
        if decision.kind is DecisionKind.SPLIT:
            pieces = split(batch, decision.pieces)

            def run_piece(i: int, piece: T) -> Awaitable[R]:
                return self.run(piece, work, estimate=estimate, split=split, merge=merge, size=size,
                                key=(key, i), concurrent=concurrent)

            if concurrent:
                async with asyncio.TaskGroup() as group:  # one failure cancels its siblings
                    tasks = [group.create_task(run_piece(i, p)) for i, p in enumerate(pieces)]
                return merge([t.result() for t in tasks])
            return merge([await run_piece(i, p) for i, p in enumerate(pieces)])
        try:
            return await work(batch)
        finally:
            self._release(decision.bytes)

    async def measure(self, raw_estimate: int, compute: Callable[[], Awaitable[R]]) -> R:
        """Await ``compute()`` inside a peak window and teach the calibration the peak
        above the window's baseline (nothing is learnt from a call that raises)."""
        self._attempt_started = time.time()
        if not self.protected:
            return await compute()
        baseline = reset_peak_memory()
        result = await compute()
        peak = read_peak_memory()
        if peak is not None:
            self.controller.observe_peak(raw_estimate, max(0, peak - baseline))
        return result

    def mark_attempt(self) -> None:
        """A piece of work starts now (the start of an ``oom`` span if it fails)."""
        self._attempt_started = time.time()

    def on_oom(self, batch_id: int = -1) -> Callable[[OomEvent], None]:
        """``on_event`` for ``run_with_oom_recovery``: counts the event and, per OOM, an
        ``oom`` span from the failed attempt's start to now (work lost plus recovery)."""

        def record(event: OomEvent) -> None:
            self.controller.record_oom_event(event)
            if event.kind == "oom" and self._spans is not None:
                now = time.time()
                self._spans.add("oom", min(self._attempt_started, now), now, batch_id)

        return record

    def metrics(self) -> dict[str, float]:
        """The controller's metrics, with ``used_bytes`` and ``budget_bytes`` in absolute
        terms: the process's use (or the pool's in-flight bytes) and its whole budget."""
        out = self.controller.metrics()
        raw = self._read()
        rest = self._rest if self.config.budget_bytes is not None and self._rest is not None else 0
        budget = self.controller.budget_for(raw) + rest
        out[f"memory/{self.stage}/used_bytes"] = float(max(raw.used_bytes, rest + self.controller.in_flight_bytes))
        out[f"memory/{self.stage}/budget_bytes"] = float(budget)
        return out

    def status(self) -> dict[str, Any]:
        """Fields for a stage's ``status()`` (``conveyor status`` reads the two
        ``memory_*`` ones) plus every metric."""
        metrics = self.metrics()
        return {
            "memory_used_bytes": metrics[f"memory/{self.stage}/used_bytes"],
            "memory_budget_bytes": metrics[f"memory/{self.stage}/budget_bytes"],
            "oom_protection": self.protected,
            **metrics,
        }
