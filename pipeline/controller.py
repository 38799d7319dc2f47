"""The controller: one small async actor that owns the run's shared state.

It owns no compute and no tensors. It holds the prompt ledger, the policy version board,
the trainer's per-step metrics, the lock-step barrier, colocated GPU turns, the
curriculum level, the staleness bound η (``max_staleness: auto``: the driver raises it)
and the evaluations' results (docs/architecture.md, "Controller"). Stages reach it only through
``ControllerClient`` (typed, one remote call per method), and only where the data needs it.

Guarantees:
- the ledger always reconciles: every prompt admitted is trained or dropped with a reason;
- versions on the board only grow; a worker confirms only weights it has loaded, and a
  fingerprint mismatch never reaches the board (it fails the worker);
- lock-step: prompts of step k are admitted only once the trainer finished step k - 1;
- η only grows; every weight update a rollout worker is handed carries η as it stands;
- colocated: the trainer trains only once every rollout worker confirmed its GPU free;
- evaluation (``eval``): the weights of every version the ``EvalSchedule`` calls due stay
  here until its result is reported (at most ``MAX_HELD_EVAL_VERSIONS``; older ones are
  given up and named in ``evals_skipped``), and the worker that evaluates is handed the
  oldest of them first, so it evaluates exactly those versions, in order;
- call budget: at most one call per micro-batch, one per optimizer step, one per weight
  update per rollout worker (plus drops, colocated turns and, per evaluation, the
  evaluating worker's confirmation and its result); telemetry never comes
  here; ``calls`` counts calls by method so tests and ``summary.json`` check the budget.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import ray

from pipeline.evaluation import EvalSchedule
from pipeline.types import EvalResult, WeightConfirmation, WeightUpdate
from pipeline.versions import Ledger

# The step metric carrying the curriculum's level (stages/data/curriculum.py sets it).
CURRICULUM_LEVEL = "curriculum/level"

# Publish times of the newest versions, for the publish-to-serve lag: a worker confirms
# the newest update it found, so one older than these has long been superseded.
PUBLISH_TIMES_KEPT = 64
# Versions due an evaluation whose weights wait for the evaluating worker; beyond this
# the oldest is given up (each held version keeps its weights in the object store).
MAX_HELD_EVAL_VERSIONS = 4


@ray.remote(num_cpus=0, max_concurrency=1000, enable_task_events=False)  # as QueueActor's
class ControllerActor:
    def __init__(self, target_prompts: int, prompts_per_step: int,
                 resumed: dict[str, Any] | None = None, barrier: bool = False,
                 max_staleness: int | None = None, auto_staleness: bool = False,
                 evals: EvalSchedule | None = None) -> None:
        """``resumed``: ``{"version", "trained_prompts", "dropped"}`` of the checkpoint a
        resumed run starts from; its prompts count as trained or dropped, none in flight.
        ``barrier``: lock-step, the admission of step k waits for trainer version k.
        ``max_staleness``: η at the start (None: the stages keep their config's);
        ``auto_staleness``: the driver may raise it (``set_max_staleness``).
        ``evals``: the versions due an evaluation (None: ``eval`` is off)."""
        self.ledger = Ledger(target=target_prompts, prompts_per_step=prompts_per_step)
        self.barrier = barrier
        self._max_staleness = self._start_staleness = max_staleness
        self._auto_staleness = auto_staleness
        self._staleness_changes: list[dict[str, Any]] = []
        self._cond = asyncio.Condition()
        self._update: WeightUpdate | None = None
        self._payload: list[Any] = []
        self._published_at: dict[int, float] = {}
        self._served: dict[str, dict[str, Any]] = {}
        self._sync_log: list[dict[str, Any]] = []
        self._trainer_version = 0
        self._steps: list[dict[str, Any]] = []
        self._stop_reason: str | None = None
        self._curriculum_level: int | None = None  # none reported yet: the source keeps its own
        self._sleep_version = -1  # colocate: the newest version whose training asked for the GPU
        self._asleep: set[str] = set()  # rollout workers that confirmed sleeping for it
        self.calls: collections.Counter[str] = collections.Counter()
        self._evals = evals
        self._held: dict[int, tuple[WeightUpdate, list[Any]]] = {}  # version due an evaluation -> its weights
        self._eval_results: list[EvalResult] = []  # reported since the last drain
        self._evals_reported = 0
        self._evals_skipped: list[int] = []
        if resumed:
            self.ledger.trained = int(resumed["trained_prompts"])
            self.ledger.dropped.update({k: int(v) for k, v in resumed["dropped"].items()})
            self.ledger.admitted = self.ledger.trained + self.ledger.dropped_total
            self._trainer_version = int(resumed["version"])

    # ---------------------------------------------------------------- prompt ledger
    async def admit_prompts(self, want: int, with_level: bool = False) -> tuple[int, ...]:
        """Wait until there is room (and, in lock-step, until the step the prompts are
        destined for is the trainer's next); (granted, step). (0, -1): no more needed.
        ``with_level``: (granted, step, curriculum level or None)."""
        self.calls["admit_prompts"] += 1
        async with self._cond:
            await self._cond.wait_for(lambda: (self.ledger.room > 0 and self._step_open()) or self._done())
            granted, step = (0, -1) if self._done() else self.ledger.admit(want)
            return (granted, step, self._curriculum_level) if with_level else (granted, step)

    def _step_open(self) -> bool:
        # Lock-step's barrier: step k = live // prompts_per_step opens at trainer version k.
        # A drop lowers ``live``, so its replacement joins the step it left.
        return not self.barrier or self.ledger.live // self.ledger.prompts_per_step <= self._trainer_version

    def _done(self) -> bool:
        return self.ledger.finished or self._stop_reason is not None

    async def finish_step(self, prompts: int, version: int, metrics: dict[str, Any],
                          update: WeightUpdate | None = None, payload: list[Any] | None = None) -> None:
        """The trainer took an optimizer step on ``prompts`` prompts, reaching ``version``:
        its metrics and, on a sync step, its weights (``payload`` is ``[ObjectRef]``, a list
        so Ray passes the reference unresolved, or ``[bytes]``), all in one call."""
        self.calls["finish_step"] += 1
        async with self._cond:
            if update is not None:
                self._publish(update, payload or [])
            self.ledger.record_trained(prompts)
            self._trainer_version = version
            self._steps.append(metrics)
            if CURRICULUM_LEVEL in metrics:
                self._curriculum_level = int(metrics[CURRICULUM_LEVEL])
            self._cond.notify_all()

    async def record_dropped(self, prompts: int, reason: str) -> None:
        self.calls["record_dropped"] += 1
        async with self._cond:
            self.ledger.record_dropped(prompts, reason)
            self._cond.notify_all()

    def set_max_staleness(self, eta: int, reason: str) -> None:
        """``max_staleness: auto``'s new η (the driver's decision, ``pipeline/staleness.py``);
        rollout workers take it with their next weight update. Refused without ``auto`` and
        below the current η (samples generated under it may still be in flight)."""
        self.calls["set_max_staleness"] += 1
        if self._max_staleness is None or not self._auto_staleness:
            raise ValueError("set_max_staleness: this run's dataflow.max_staleness is not 'auto'")
        if eta < self._max_staleness:
            raise ValueError(f"set_max_staleness: {eta} is below the current {self._max_staleness}; η only grows")
        self._staleness_changes.append({"version": self._trainer_version, "before": self._max_staleness,
                                        "after": eta, "reason": reason, "time": time.time()})
        self._max_staleness = eta

    def trainer_version(self) -> int:
        self.calls["trainer_version"] += 1
        return self._trainer_version

    async def stop(self, reason: str) -> None:
        async with self._cond:
            self._stop_reason = reason
            self._cond.notify_all()

    # ---------------------------------------------------------------- weights
    async def publish(self, update: WeightUpdate, payload: list[Any]) -> None:
        """Weights outside a step: a resumed trainer's checkpoint, at setup."""
        self.calls["publish"] += 1
        async with self._cond:
            self._publish(update, payload)
            self._cond.notify_all()

    def _publish(self, update: WeightUpdate, payload: list[Any]) -> None:
        if self._update is not None and update.version <= self._update.version:
            raise ValueError(f"publish: version {update.version} is not newer than {self._update.version}")
        self._update, self._payload = update, payload
        if self._evals is not None and self._evals.kind(update.version) is not None:
            self._held[update.version] = (update, payload)
            if len(self._held) > MAX_HELD_EVAL_VERSIONS:
                self._evals_skipped.append(min(self._held))
                del self._held[min(self._held)]
        self._published_at[update.version] = time.time()
        if len(self._published_at) > PUBLISH_TIMES_KEPT:  # versions go in ascending: drop the oldest
            del self._published_at[next(iter(self._published_at))]

    async def wait_for_update(self, newer_than: int, timeout_s: float | None,
                              confirmed: WeightConfirmation | None = None,
                              evaluating: bool = False) -> tuple[WeightUpdate | None, list[Any], int | None]:
        """Wait for a published version newer than ``newer_than`` (None on timeout); with
        it its payload and η as it stands. ``confirmed``: the update the worker applied
        since its last call. ``evaluating``: the worker evaluates: the oldest held version
        newer than ``newer_than`` comes before the newest one.

        A stop does not end the wait: after an interrupt, what is in flight drains, and
        micro-batches of later steps still need the versions the trainer publishes.
        """
        self.calls["wait_for_update"] += 1
        if confirmed is not None:
            self._confirm(confirmed)
        async with self._cond:
            try:
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: self._update is not None and self._update.version > newer_than),
                    timeout_s,
                )
            except TimeoutError:
                return None, [], self._max_staleness
            if self._update is None or self._update.version <= newer_than:
                return None, [], self._max_staleness
            due = sorted(v for v in self._held if v > newer_than) if evaluating else []
            return (*(self._held[due[0]] if due else (self._update, self._payload)), self._max_staleness)

    def latest_update(self, newer_than: int = -1, evaluating: bool = False) -> tuple[WeightUpdate | None, list[Any]]:
        """The newest published update (None before any), at once; ``evaluating``: the
        oldest held version newer than ``newer_than`` comes first, as in ``wait_for_update``."""
        self.calls["latest_update"] += 1
        due = sorted(v for v in self._held if v > newer_than) if evaluating else []
        return self._held[due[0]] if due else (self._update, self._payload)

    def confirm(self, confirmed: WeightConfirmation) -> None:
        """A rollout worker now serves ``confirmed.version`` (outside the watch loop:
        the final update at shutdown)."""
        self.calls["confirm"] += 1
        self._confirm(confirmed)

    def _confirm(self, c: WeightConfirmation) -> None:
        lag = time.time() - self._published_at.get(c.version, time.time())
        self._served[c.worker] = {"version": c.version, "fingerprint": list(c.fingerprint), "verified": c.verified}
        self._sync_log.append({"worker": c.worker, "version": c.version, "verified": c.verified,
                               "apply_s": c.apply_s, "publish_to_serve_s": lag, "time": time.time()})

    # ---------------------------------------------------------------- evaluation
    def report_eval(self, result: EvalResult) -> None:
        """An evaluation's result; the weights held for it (and any older) are let go."""
        self.calls["report_eval"] += 1
        self._eval_results.append(result)
        self._evals_reported += 1
        for version in [v for v in self._held if v <= result.version]:
            del self._held[version]

    # ---------------------------------------------------------------- colocate: GPU turns
    async def hand_gpus_to_trainer(self, version: int, workers: int, timeout_s: float) -> list[str]:
        """Ask every rollout worker to sleep before the trainer trains the step that
        starts at ``version``; the workers asleep once ``workers`` of them confirmed, or
        those that had when ``timeout_s`` ran out."""
        self.calls["hand_gpus_to_trainer"] += 1
        async with self._cond:
            if version > self._sleep_version:
                self._sleep_version, self._asleep = version, set()
                self._cond.notify_all()
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: len(self._asleep) >= workers), timeout_s)
            except TimeoutError:
                pass
            return sorted(self._asleep)

    async def wait_for_sleep_request(self, newer_than: int) -> int:
        """A rollout worker's wait for its turn to sleep: the version asking for the GPU."""
        self.calls["wait_for_sleep_request"] += 1
        async with self._cond:
            await self._cond.wait_for(lambda: self._sleep_version > newer_than)
            return self._sleep_version

    async def confirm_asleep(self, worker: str, version: int) -> None:
        self.calls["confirm_asleep"] += 1
        async with self._cond:
            if version == self._sleep_version:
                self._asleep.add(worker)
                self._cond.notify_all()

    # ---------------------------------------------------------------- metrics, status
    def drain(self) -> dict[str, Any]:
        """Everything new since the last drain, plus the current counters."""
        steps, self._steps = self._steps, []
        syncs, self._sync_log = self._sync_log, []
        evals, self._eval_results = self._eval_results, []
        return {"steps": steps, "syncs": syncs, "eval_results": evals, **self.summary()}

    def summary(self) -> dict[str, Any]:
        staleness = None if self._max_staleness is None else {
            "current": self._max_staleness, "start": self._start_staleness, "auto": self._auto_staleness,
            "changes": list(self._staleness_changes)}
        return {
            "ledger": self.ledger.summary(),
            "max_staleness": staleness,
            "trainer_version": self._trainer_version,
            "served": dict(self._served),
            "stop_reason": self._stop_reason,
            "calls": dict(self.calls),
            **({"evals": {"reported": self._evals_reported, "skipped": list(self._evals_skipped),
                          "held": sorted(self._held)}} if self._evals is not None else {}),
        }


async def resolve_payload(payload: Any) -> bytes:
    """A published payload's bytes: inline ones as they are, a reference fetched."""
    return payload if isinstance(payload, bytes) else await payload


class ControllerClient:
    """How a stage (and the driver) talks to the controller: one typed method per
    remote call. Picklable (it holds the actor handle only), so stages receive it.

    ``finish_step`` and ``record_dropped`` are posted: they return once sent, so the
    trainer's next micro-batch does not wait for the controller's round trip (at 10 ms
    per stage that wait made the trainer the bottleneck). Posted calls reach the
    controller in the order they were made, one at a time: each waits for the reply of
    the one before (where an error of that one surfaces). ``settle`` waits for the last;
    the stage shell calls it before its ``run`` returns, so a finished stage's calls
    have all taken effect.
    """

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self._posted: ray.ObjectRef | None = None  # the last posted call's reply, not awaited yet

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_posted": None}  # a reply is awaited by the process that sent the call

    async def _post(self, method: Any, *args: Any) -> None:
        await self.settle()
        self._posted = method.remote(*args)

    async def settle(self) -> None:
        """Until the last posted call is done; raises its error."""
        posted, self._posted = self._posted, None
        if posted is not None:
            await posted

    async def admit_prompts(self, want: int) -> tuple[int, int]:
        return await self.actor.admit_prompts.remote(want)

    async def admit_prompts_at_level(self, want: int) -> tuple[int, int, int | None]:
        """``admit_prompts`` plus the curriculum level the trainer last reported (None: none yet)."""
        return await self.actor.admit_prompts.remote(want, True)

    async def trainer_version(self) -> int:
        return await self.actor.trainer_version.remote()

    async def finish_step(self, prompts: int, version: int, metrics: dict[str, Any],
                          update: WeightUpdate | None = None, payload: ray.ObjectRef | bytes | None = None) -> None:
        await self._post(self.actor.finish_step, prompts, version, metrics, update,
                         [payload] if payload is not None else [])

    async def record_dropped(self, prompts: int, reason: str) -> None:
        await self._post(self.actor.record_dropped, prompts, reason)

    async def publish(self, update: WeightUpdate, payload: ray.ObjectRef | bytes) -> None:
        await self.actor.publish.remote(update, [payload])

    async def wait_for_update(self, newer_than: int, timeout_s: float | None = None,
                              confirmed: WeightConfirmation | None = None,
                              evaluating: bool = False) -> tuple[WeightUpdate | None, Any, int | None]:
        """(update, its payload: an ``ObjectRef`` or inline bytes, see ``resolve_payload``,
        η as it stands: None where the controller was given none), or (None, None, η) on
        timeout. ``evaluating``: see ``ControllerActor.wait_for_update``."""
        update, payload, eta = await self.actor.wait_for_update.remote(newer_than, timeout_s, confirmed, evaluating)
        return update, payload[0] if payload else None, eta

    async def set_max_staleness(self, eta: int, reason: str) -> None:
        """The driver's η for ``max_staleness: auto`` (see the actor's method)."""
        await self.actor.set_max_staleness.remote(eta, reason)

    async def latest_update(self, newer_than: int = -1, evaluating: bool = False) -> tuple[WeightUpdate | None, Any]:
        update, payload = await self.actor.latest_update.remote(newer_than, evaluating)
        return update, payload[0] if payload else None

    async def confirm(self, confirmed: WeightConfirmation) -> None:
        await self.actor.confirm.remote(confirmed)

    async def report_eval(self, result: EvalResult) -> None:
        await self.actor.report_eval.remote(result)

    async def hand_gpus_to_trainer(self, version: int, workers: int, timeout_s: float) -> list[str]:
        return await self.actor.hand_gpus_to_trainer.remote(version, workers, timeout_s)

    async def wait_for_sleep_request(self, newer_than: int) -> int:
        return await self.actor.wait_for_sleep_request.remote(newer_than)

    async def confirm_asleep(self, worker: str, version: int) -> None:
        await self.actor.confirm_asleep.remote(worker, version)

    async def stop(self, reason: str) -> None:
        await self.actor.stop.remote(reason)

    async def drain(self) -> dict[str, Any]:
        return await self.actor.drain.remote()

    async def summary(self) -> dict[str, Any]:
        return await self.actor.summary.remote()
