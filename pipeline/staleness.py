"""``dataflow.max_staleness: auto``: choose η from the run's measured steps (pure, no Ray).

A run with ``auto`` starts at ``max(1, train.sync_interval - 1)``. The driver measures
each step's window (``measure_step``): from the stages' spans the trainer's busy time,
the rollout's generating time and the time the staleness limit alone held the rollout
back (its ``wait_version`` spans while nothing of it generated); from the trainer's
metrics the samples it trained and dropped as stale. ``AutoStaleness`` sums
``WINDOW_STEPS`` steps after ``WARMUP_STEPS`` and asks ``decide_max_staleness``:
- the trainer idle less than ``MIN_SHARE`` of the window: trainer-bound, η stays;
- the trainer waits, and the limit held the rollout back ``MIN_SHARE`` of the window or
  more, or ``MIN_SHARE`` of the samples were dropped as stale (generation thrown away,
  long samples outliving η): η + 1, at most ``dataflow.max_staleness_cap``, measured
  again under the new η;
- the trainer waits for neither: generation (or scoring) is the bottleneck, η stays.
So η rises one step at a time from below and stops at the smallest η under which the
trainer no longer waits because of the limit. Guarantees: η never falls (samples
generated under a higher bound stay trainable), never exceeds the cap, and every
decision carries its reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.log import get_logger
from pipeline.profiler import Interval, clip_intervals, merge_intervals, sum_intervals
from pipeline.types import Span

WARMUP_STEPS = 2  # engine start, compilation and the first weight loads: not measured
WINDOW_STEPS = 4  # steps summed per decision
MIN_SHARE = 0.1  # trainer idle, rollout held back: below this share of the window, nothing to gain


@dataclass(frozen=True)
class StepTimes:
    """One window (or a sum of windows): its length, the trainer's busy time, the
    rollout's generating time and the time the staleness limit alone held it back (both
    averaged over rollout replicas), in seconds; the samples trained and dropped as stale."""

    window_s: float = 0.0
    trainer_busy_s: float = 0.0
    rollout_generating_s: float = 0.0
    rollout_gated_s: float = 0.0
    samples_trained: int = 0
    samples_stale: int = 0

    def __add__(self, other: StepTimes) -> StepTimes:
        return StepTimes(self.window_s + other.window_s, self.trainer_busy_s + other.trainer_busy_s,
                         self.rollout_generating_s + other.rollout_generating_s,
                         self.rollout_gated_s + other.rollout_gated_s,
                         self.samples_trained + other.samples_trained, self.samples_stale + other.samples_stale)

    @property
    def stale_share(self) -> float:
        made = self.samples_trained + self.samples_stale
        return self.samples_stale / made if made else 0.0

    def share(self, seconds: float) -> float:
        return seconds / self.window_s if self.window_s > 0 else 0.0


@dataclass(frozen=True)
class StalenessDecision:
    """η after a decision (``before`` when it stays) and why, as the log line says it."""

    before: int
    after: int
    reason: str

    @property
    def changed(self) -> bool:
        return self.after != self.before

    def describe(self) -> str:
        move = f"{self.before} -> {self.after}" if self.changed else f"stays {self.before}"
        return f"max_staleness auto: {move} ({self.reason})"


def _subtract(intervals: Sequence[Interval], holes: Sequence[Interval]) -> list[Interval]:
    """``intervals`` minus ``holes`` (both merged, sorted)."""
    out: list[Interval] = []
    for start, end in intervals:
        cursor = start
        for h0, h1 in holes:
            if h1 <= cursor or h0 >= end:
                continue
            if h0 > cursor:
                out.append((cursor, h0))
            cursor = max(cursor, h1)
        if cursor < end:
            out.append((cursor, end))
    return out


def _is_rollout(stage: str) -> bool:
    return stage == "rollout" or stage.startswith("rollout:")


def measure_step(spans: Iterable[Span], window: Interval, trained: int = 0, stale: int = 0) -> StepTimes:
    """``StepTimes`` of ``window`` from the stages' spans (``trained``, ``stale``: the
    step's samples, from the trainer's metrics). A rollout micro-batch's
    ``wait_version`` span sits inside its ``busy`` span: it generates for the rest of it.
    The rollout is held back by the limit when one of its micro-batches waits so and
    none generates."""
    busy: dict[str, dict[int, list[Interval]]] = {}
    gated: dict[str, dict[int, list[Interval]]] = {}
    trainer: list[Interval] = []
    for s in spans:
        if s.stage == "trainer" and s.kind == "busy":
            trainer.append((s.start, s.end))
        elif _is_rollout(s.stage) and s.kind in ("busy", "wait_version"):
            into = busy if s.kind == "busy" else gated
            into.setdefault(s.stage, {}).setdefault(s.batch_id, []).append((s.start, s.end))
    generating, held = [], []
    for replica in set(busy) | set(gated):
        waits = gated.get(replica, {})
        gen = merge_intervals(iv for batch, ivs in busy.get(replica, {}).items()
                              for iv in _subtract(merge_intervals(ivs), merge_intervals(waits.get(batch, []))))
        gen = clip_intervals(gen, window)
        generating.append(sum_intervals(gen))
        wait_all = clip_intervals(merge_intervals(iv for ivs in waits.values() for iv in ivs), window)
        held.append(sum_intervals(_subtract(wait_all, gen)))
    mean = (lambda xs: sum(xs) / len(xs) if xs else 0.0)
    return StepTimes(window_s=max(0.0, window[1] - window[0]),
                     trainer_busy_s=sum_intervals(clip_intervals(merge_intervals(trainer), window)),
                     rollout_generating_s=mean(generating), rollout_gated_s=mean(held),
                     samples_trained=trained, samples_stale=stale)


def decide_max_staleness(current: int, cap: int, times: StepTimes) -> StalenessDecision:
    """η after ``times`` were measured at η = ``current`` (the rule in the module doc)."""
    # Whole percent, as the reason shows them: a share shown as 10% counts as 10%.
    trainer_busy, waited, held, generating, stale = (round(x, 2) for x in (
        times.share(times.trainer_busy_s), times.share(times.window_s - times.trainer_busy_s),
        times.share(times.rollout_gated_s), times.share(times.rollout_generating_s), times.stale_share))
    measured = (f"trainer waited {waited:.0%} of step time for data; rollout blocked by staleness {held:.0%}, "
                f"generating {generating:.0%}" + (f"; {stale:.0%} of samples dropped as stale" if stale else ""))
    if waited < MIN_SHARE:
        return StalenessDecision(current, current, f"trainer busy {trainer_busy:.0%} of step time: the trainer "
                                                   f"is the bottleneck, a larger η would not make it faster")
    if held < MIN_SHARE and stale < MIN_SHARE:
        return StalenessDecision(current, current, f"{measured}: generation or scoring is the bottleneck, "
                                                   f"a larger η would not make it faster")
    if current >= cap:
        return StalenessDecision(current, current, f"{measured}; at dataflow.max_staleness_cap {cap}")
    return StalenessDecision(current, current + 1, measured)


class AutoStaleness:
    """When to decide: after ``warmup`` steps, every ``window`` steps; after a raise,
    measured again only from the steps generated under the new η (``applied``); no more
    once η is at ``cap``. ``observe`` returns a decision or None; ``after_step`` (the
    driver's) also hands a raise to the controller and logs it."""

    def __init__(self, cap: int, warmup: int = WARMUP_STEPS, window: int = WINDOW_STEPS) -> None:
        self.cap, self.window = cap, window
        self.measure_from = warmup  # the first step a window may count
        self.verdicts = 0
        # For status and summary, bounded in a long run: the first verdict and every raise
        # (at most cap of them), and the latest verdict.
        self.log: list[dict[str, object]] = []
        self.latest: dict[str, object] | None = None
        self.current: int | None = None  # η now; the controller's until this raises it
        self._sum = StepTimes()
        self._steps = 0
        self._counts: tuple[int, int] | None = None  # the trainer's samples trained and stale so far

    def measure(self, metrics: dict[str, Any], spans: Iterable[Span], window: Interval) -> StepTimes:
        """A trained step's ``StepTimes``: the spans of its window, and from its metrics
        (the trainer's running ``samples/trained`` and ``samples/dropped_stale``) the
        samples since the step before (none for the first step seen)."""
        counts = (int(metrics.get("samples/trained", 0)), int(metrics.get("samples/dropped_stale", 0)))
        before, self._counts = self._counts or counts, counts
        return measure_step(spans, window, max(0, counts[0] - before[0]), max(0, counts[1] - before[1]))

    async def after_step(self, controller: Any, step: int, times: StepTimes, known: int) -> StalenessDecision | None:
        """One trained step's times; ``known``: η as the controller last reported it.
        A raise goes to the controller (``set_max_staleness``); the rollout takes it with
        its next weight update."""
        self.current = known if self.current is None else max(self.current, known)
        decision = self.observe(step, times, self.current)
        if decision is None:
            return None
        entry: dict[str, object] = {"step": step, "before": decision.before, "after": decision.after,
                                    "reason": decision.reason}
        log = get_logger(stage="driver")  # here, not at import: the run's log level applies
        if decision.changed:
            await controller.set_max_staleness(decision.after, decision.reason)
            self.applied(step, decision.after)
            self.current = decision.after
        shown = decision.changed or self.verdicts == 1  # verdicts that keep η after the first: debug level
        (log.info if shown else log.debug)(decision.describe(), step=step)
        if shown:
            self.log.append(entry)
        self.latest = entry
        return decision

    def observe(self, step: int, times: StepTimes, current: int) -> StalenessDecision | None:
        if step < self.measure_from or (current >= self.cap and self.verdicts):
            return None
        self._sum, self._steps = self._sum + times, self._steps + 1
        if self._steps < self.window:
            return None
        decision = decide_max_staleness(current, self.cap, self._sum)
        self._sum, self._steps = StepTimes(), 0
        self.verdicts += 1
        return decision

    def applied(self, step: int, eta: int) -> None:
        """η was raised to ``eta`` after ``step``. The rollout takes it with the next weight
        update (published after step + 1); what it generated before, up to the old η
        steps ahead, trains first: measure from step + 2 + ``eta`` on."""
        self.measure_from = max(self.measure_from, step + 2 + eta)
