"""The controller: one small async actor that owns the run's shared state.

It owns no compute and no tensors. It holds
- the prompt ledger (``pipeline.versions.Ledger``): sources ask it for room, the trainer
  reports trained and dropped prompts, so the counters always reconcile;
- the policy version board: the trainer publishes a ``WeightUpdate`` plus an
  ``ObjectRef`` to its payload every ``sync_interval`` steps; rollout workers wait on it,
  apply, and confirm the version and fingerprint they now serve;
- per-step metrics the trainer reports, and status lines from every stage, which the
  driver drains for metrics.jsonl, TensorBoard and ``conveyor status``.

Invariant: versions on the board only grow. A worker confirms only weights it has
loaded; ``verified`` says whether it read them back from its engine and found the
payload there (a mismatch never reaches the board: it fails the worker).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray

from pipeline.types import WeightUpdate
from pipeline.versions import Ledger

# Publish times of the newest versions, for the publish-to-serve lag: a worker confirms
# the newest update it found, so one older than these has long been superseded.
PUBLISH_TIMES_KEPT = 64


@ray.remote(num_cpus=0, max_concurrency=1000)
class ControllerActor:
    def __init__(self, target_prompts: int, prompts_per_step: int, target_steps: int,
                 resumed: dict[str, Any] | None = None) -> None:
        """``resumed``: ``{"version", "trained_prompts", "dropped"}`` of the checkpoint a
        resumed run starts from; its prompts count as trained or dropped, none in flight."""
        self.ledger = Ledger(target=target_prompts, prompts_per_step=prompts_per_step)
        self.target_steps = target_steps
        self._cond = asyncio.Condition()
        self._update: WeightUpdate | None = None
        self._payload: list[Any] = []
        self._published_at: dict[int, float] = {}
        self._served: dict[str, dict[str, Any]] = {}
        self._sync_log: list[dict[str, Any]] = []
        self._trainer_version = 0
        self._steps: list[dict[str, Any]] = []
        self._status: dict[str, dict[str, Any]] = {}
        self._stop_reason: str | None = None
        self._samples = {"generated": 0}
        if resumed:
            self.ledger.trained = int(resumed["trained_prompts"])
            self.ledger.dropped.update({k: int(v) for k, v in resumed["dropped"].items()})
            self.ledger.admitted = self.ledger.trained + self.ledger.dropped_total
            self._trainer_version = int(resumed["version"])

    # ---------------------------------------------------------------- prompt ledger
    async def admit_prompts(self, want: int) -> tuple[int, int]:
        """Wait until there is room; (granted, step). (0, -1) means the run needs no more."""
        async with self._cond:
            await self._cond.wait_for(lambda: self.ledger.room > 0 or self._done())
            if self._done():
                return 0, -1
            return self.ledger.admit(want)

    def _done(self) -> bool:
        return self.ledger.finished or self._stop_reason is not None

    async def record_trained(self, prompts: int) -> None:
        async with self._cond:
            self.ledger.record_trained(prompts)
            self._cond.notify_all()

    async def finish_step(self, prompts: int, version: int) -> None:
        """The trainer took an optimizer step on ``prompts`` prompts: one call, not two."""
        async with self._cond:
            self.ledger.record_trained(prompts)
            self._trainer_version = version
            self._cond.notify_all()

    async def record_dropped(self, prompts: int, reason: str) -> None:
        async with self._cond:
            self.ledger.record_dropped(prompts, reason)
            self._cond.notify_all()

    def record_generated(self, samples: int) -> None:
        self._samples["generated"] += samples

    async def stop(self, reason: str) -> None:
        async with self._cond:
            self._stop_reason = reason
            self._cond.notify_all()

    # ---------------------------------------------------------------- weights
    async def publish(self, update: WeightUpdate, payload: list[Any]) -> None:
        """``payload`` is ``[ObjectRef]`` (a list, so Ray passes the reference unresolved)."""
        async with self._cond:
            if self._update is not None and update.version <= self._update.version:
                raise ValueError(
                    f"publish: version {update.version} is not newer than {self._update.version}"
                )
            self._update, self._payload = update, payload
            self._published_at[update.version] = time.time()
            if len(self._published_at) > PUBLISH_TIMES_KEPT:  # versions go in ascending: drop the oldest
                del self._published_at[next(iter(self._published_at))]
            self._cond.notify_all()

    async def set_trainer_version(self, version: int) -> None:
        async with self._cond:
            self._trainer_version = version
            self._cond.notify_all()

    def trainer_version(self) -> int:
        return self._trainer_version

    async def wait_for_update(self, newer_than: int, timeout_s: float | None) -> tuple[WeightUpdate | None, list[Any]]:
        """Wait for a published version newer than ``newer_than`` (None on timeout).

        A stop does not end the wait: after an interrupt, what is in flight drains, and
        micro-batches of later steps still need the versions the trainer publishes.
        """
        async with self._cond:
            try:
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: self._update is not None and self._update.version > newer_than),
                    timeout_s,
                )
            except TimeoutError:
                return None, []
            if self._update is None or self._update.version <= newer_than:
                return None, []
            return self._update, self._payload

    def latest_update(self) -> tuple[WeightUpdate | None, list[Any]]:
        return self._update, self._payload

    def confirm(self, worker: str, version: int, fingerprint: tuple[float, float], verified: bool,
                seconds: float) -> None:
        """A rollout worker now serves ``version`` (read back from its engine if ``verified``)."""
        lag = time.time() - self._published_at.get(version, time.time())
        self._served[worker] = {"version": version, "fingerprint": list(fingerprint), "verified": verified}
        self._sync_log.append(
            {"worker": worker, "version": version, "verified": verified, "apply_s": seconds, "publish_to_serve_s": lag,
             "time": time.time()}
        )

    def served_versions(self) -> dict[str, dict[str, Any]]:
        return dict(self._served)

    # ---------------------------------------------------------------- metrics, status
    def report_step(self, metrics: dict[str, Any]) -> None:
        self._steps.append(metrics)

    def drain(self) -> dict[str, Any]:
        """Everything new since the last drain, plus the current counters."""
        steps, self._steps = self._steps, []
        syncs, self._sync_log = self._sync_log, []
        return {
            "steps": steps,
            "syncs": syncs,
            "ledger": self.ledger.summary(),
            "samples": dict(self._samples),
            "trainer_version": self._trainer_version,
            "served": dict(self._served),
            "status": dict(self._status),
            "stop_reason": self._stop_reason,
        }

    def set_status(self, stage: str, status: dict[str, Any]) -> None:
        self._status[stage] = status

    def summary(self) -> dict[str, Any]:
        return {
            "ledger": self.ledger.summary(),
            "samples": dict(self._samples),
            "trainer_version": self._trainer_version,
            "served": dict(self._served),
            "stop_reason": self._stop_reason,
        }
