"""Fake stage cores: the real control plane, no models (``bench/overlap.py`` and the
Ray tier's control-plane test run them).

Fakes, named so: each core sleeps where a real one computes (``FakeSourceCore``,
``FakeRolloutCore``, ``FakeScorerCore``, ``FakeTrainerCore``); durations follow
``GenerationLengths``. Details: docs/architecture.md, "Fake cores".

Guarantees:
- everything but compute is real: ``StageActor`` shells, bounded queues, the controller
  through ``ControllerClient`` with the same calls at the same points as the real
  stages, and the pure rules of ``pipeline.versions``;
- compute runs off the event loop (``asyncio.to_thread(time.sleep, d)``);
- each stage's mean micro-batch time is ``mean_s``;
- each core measures its own compute seconds: the ideal bound a perfect control plane
  would need;
- ``exclusive=True`` computes one item at a time even with ``concurrency > 1``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import numpy as np
import ray

from pipeline.controller import resolve_payload
from pipeline.queue import fits_inline
from pipeline.types import WeightConfirmation, WeightUpdate
from pipeline.versions import compute_staleness, is_too_stale, required_serving_version


class GenerationLengths(msgspec.Struct, frozen=True, kw_only=True):
    """Completion lengths of one micro-batch: ``samples`` lognormal draws (median
    ``median_tokens``, log-sd ``sigma``) rounded and clipped to [1, ``max_tokens``]."""

    samples: int = 32
    median_tokens: float = 200.0
    sigma: float = 0.8
    max_tokens: int = 1024

    def sample(self, rng: np.random.Generator) -> np.ndarray:
        if self.sigma == 0:
            return np.full(self.samples, min(self.max_tokens, max(1, round(self.median_tokens))), dtype=np.int32)
        raw = rng.lognormal(np.log(self.median_tokens), self.sigma, size=self.samples)
        return np.clip(np.rint(raw), 1, self.max_tokens).astype(np.int32)

    def expected(self, draws: int = 4000) -> tuple[float, float]:
        """(mean longest sample, mean total tokens) of a micro-batch, by a fixed-seed
        Monte Carlo estimate (deterministic: every actor scales by the same numbers)."""
        rng = np.random.default_rng(12345)
        batches = [self.sample(rng) for _ in range(draws)]
        return float(np.mean([b.max() for b in batches])), float(np.mean([b.sum() for b in batches]))


class FakeBatch(msgspec.Struct, frozen=True, kw_only=True):
    """A fake micro-batch: ``prompts`` prompts destined for optimizer ``step``;
    after the rollout, the per-sample ``lengths``, the ``policy_version`` it was generated
    with and a ``payload`` standing for its token arrays."""

    batch_id: int
    step: int
    prompts: int
    policy_version: int = -1
    lengths: np.ndarray | None = None
    payload: np.ndarray | None = None


class _Timed:
    """Compute-time bookkeeping shared by the fake cores."""

    def __init__(self, mean_s: float, exclusive: bool) -> None:
        if mean_s < 0:
            raise ValueError(f"mean_s: expected >= 0, got {mean_s}")
        self.mean_s = mean_s
        self.compute_s = 0.0
        self.items = 0
        self.done_at: list[float] = []  # time.time() at the end of each item's compute
        self._lock = asyncio.Lock() if exclusive else None

    def section(self) -> Any:
        """The critical section of one item: a FIFO lock when exclusive, else nothing.
        Everything that must see the previous item's effects (the trainer's version, the
        rollout's served version) happens inside it."""
        return self._lock if self._lock is not None else contextlib.nullcontext()

    async def compute(self, seconds: float) -> None:
        t0 = time.perf_counter()
        if seconds > 0:
            await asyncio.to_thread(time.sleep, seconds)
        self.compute_s += time.perf_counter() - t0
        self.items += 1
        self.done_at.append(time.time())

    def timing(self) -> dict[str, Any]:
        return {"mean_s": self.mean_s, "compute_s": self.compute_s, "items": self.items,
                "compute_s_per_item": self.compute_s / self.items if self.items else 0.0,
                "done_at": list(self.done_at)}


class FakeSourceCore:
    """Emits ``prompts_per_micro_batch`` prompts per micro-batch while the ledger grants room."""

    def __init__(self, prompts_per_micro_batch: int = 4) -> None:
        self.per_batch = prompts_per_micro_batch
        self.emitted = 0

    async def setup(self, ctx: Any) -> None:
        self.ctx = ctx

    async def generate(self) -> AsyncIterator[FakeBatch]:
        batch_id = 0
        while True:
            granted, step = await self.ctx.controller.admit_prompts(self.per_batch)
            if granted == 0:
                return
            self.emitted += 1
            yield FakeBatch(batch_id=batch_id, step=step, prompts=granted)
            batch_id += 1

    def result(self) -> dict[str, Any]:
        return {"micro_batches": self.emitted}


class FakeRolloutCore:
    """Generates for ``mean_s`` on average (longest sample of lognormal lengths)."""

    def __init__(
        self, mean_s: float, lengths: GenerationLengths, max_staleness: int, sync_interval: int = 1,
        apply_s: float = 0.0, payload_bytes: int = 0, exclusive: bool = False, seed: int = 0,
    ) -> None:
        self.timed = _Timed(mean_s, exclusive)
        self.lengths = lengths
        self.max_staleness = max_staleness
        self.sync_interval = sync_interval
        self.apply_s = apply_s
        self.payload_bytes = payload_bytes
        self.seed = seed
        self.version = 0
        self.version_wait_s = 0.0
        self.applied: list[float] = []
        self._watch_error: BaseException | None = None

    async def setup(self, ctx: Any) -> None:
        self.ctx = ctx
        self.rng = np.random.default_rng(self.seed + 1000 * ctx.replica)
        self.mean_max, _ = self.lengths.expected()
        self._changed = asyncio.Condition()
        self._watcher = asyncio.create_task(self._watch_weights())

    async def _watch_weights(self) -> None:
        try:
            confirmed = None
            while True:
                update, payload, _ = await self.ctx.controller.wait_for_update(self.version, None, confirmed)
                if update is None:
                    return  # the run is stopping
                t0 = time.time()
                with self.ctx.spans.span("sync"):
                    data = await resolve_payload(payload)  # fetch it, as a real worker must
                    if hashlib.sha256(data).hexdigest() != update.sha256:
                        raise RuntimeError(f"weights v{update.version}: sha256 mismatch")
                    if self.apply_s > 0:
                        await asyncio.to_thread(time.sleep, self.apply_s)
                seconds = time.time() - t0
                confirmed = WeightConfirmation(worker=self.ctx.worker_id, version=update.version,
                                               fingerprint=update.fingerprint, verified=False, apply_s=seconds)
                self.applied.append(seconds)
                async with self._changed:
                    self.version = update.version
                    self._changed.notify_all()
        except BaseException as exc:
            self._watch_error = exc
            async with self._changed:
                self._changed.notify_all()
            raise

    async def process(self, b: FakeBatch) -> FakeBatch:
        async with self.timed.section():
            need = required_serving_version(b.step, self.max_staleness, self.sync_interval)
            if self.version < need:
                t0 = time.perf_counter()
                async with self._changed:
                    await self._changed.wait_for(lambda: self.version >= need or self._watch_error is not None)
                self.version_wait_s += time.perf_counter() - t0
            if self._watch_error is not None:
                raise self._watch_error
            version = self.version  # the oldest version any of its tokens can carry
            lengths = self.lengths.sample(self.rng)
            await self.timed.compute(self.timed.mean_s * float(lengths.max()) / self.mean_max)
        payload = np.zeros(self.payload_bytes, dtype=np.uint8) if self.payload_bytes else None
        return msgspec.structs.replace(b, policy_version=version, lengths=lengths, payload=payload)

    def result(self) -> dict[str, Any]:
        return {**self.timed.timing(), "version_wait_s": self.version_wait_s,
                "weight_updates": len(self.applied), "apply_s_total": float(sum(self.applied))}

    async def shutdown(self) -> None:
        self._watcher.cancel()


class FakeScorerCore:
    """Reward or reference: takes ``mean_s`` on average, in proportion to the batch's tokens."""

    def __init__(self, mean_s: float, lengths: GenerationLengths, exclusive: bool = False) -> None:
        self.timed = _Timed(mean_s, exclusive)
        self.mean_total = lengths.expected()[1]

    async def process(self, b: FakeBatch) -> FakeBatch:
        tokens = float(b.lengths.sum()) if b.lengths is not None else self.mean_total
        async with self.timed.section():
            await self.timed.compute(self.timed.mean_s * tokens / self.mean_total)
        return b

    def result(self) -> dict[str, Any]:
        return self.timed.timing()


class FakeTrainerCore:
    """Trains for ``mean_s`` on average per micro-batch; one optimizer step (one policy
    version) per ``prompts_per_step`` prompts; publishes ``weight_bytes`` of weights."""

    def __init__(
        self, mean_s: float, lengths: GenerationLengths, max_staleness: int, prompts_per_step: int,
        sync_interval: int = 1, weight_bytes: int = 4096, exclusive: bool = False,
    ) -> None:
        self.timed = _Timed(mean_s, exclusive)
        self.mean_total = lengths.expected()[1]
        self.max_staleness = max_staleness
        self.prompts_per_step = prompts_per_step
        self.sync_interval = sync_interval
        self.version = 0
        self.step_prompts = 0
        self.dropped_batches = 0
        self.staleness: dict[int, int] = {}
        self.publish_s = 0.0
        self._weights = np.random.default_rng(0).integers(0, 255, weight_bytes, dtype=np.uint8).tobytes()
        self._sha = hashlib.sha256(self._weights).hexdigest()

    async def setup(self, ctx: Any) -> None:
        self.ctx = ctx

    async def process(self, b: FakeBatch) -> None:
        async with self.timed.section():
            await self._train(b)

    async def _train(self, b: FakeBatch) -> None:
        controller = self.ctx.controller
        if is_too_stale(self.version, b.policy_version, self.max_staleness):
            self.dropped_batches += 1
            await controller.record_dropped(b.prompts, "stale")
            return None
        k = compute_staleness(self.version, b.policy_version)
        self.staleness[k] = self.staleness.get(k, 0) + 1
        tokens = float(b.lengths.sum()) if b.lengths is not None else self.mean_total
        await self.timed.compute(self.timed.mean_s * tokens / self.mean_total)
        self.step_prompts += b.prompts
        if self.step_prompts >= self.prompts_per_step:
            trained, self.step_prompts = self.step_prompts, 0
            self.version += 1
            update, payload = None, None
            if self.version % self.sync_interval == 0:
                t0 = time.time()
                with self.ctx.spans.span("sync"):
                    update = WeightUpdate(version=self.version, sha256=self._sha,
                                          fingerprint=(float(self.version), 0.0), num_bytes=len(self._weights))
                    # As the trainer publishes: by value when it fits inline.
                    payload = self._weights if fits_inline(self._weights) else ray.put(self._weights)
                self.publish_s += time.time() - t0
            await controller.finish_step(trained, self.version, {"step": self.version - 1}, update, payload)
        return None

    def result(self) -> dict[str, Any]:
        return {**self.timed.timing(), "steps": self.version, "dropped_batches": self.dropped_batches,
                "staleness_hist": dict(sorted(self.staleness.items())), "publish_s_total": self.publish_s}
