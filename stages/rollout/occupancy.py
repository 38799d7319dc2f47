"""How full the rollout engine was: seconds spent at each number of samples in flight,
the share of generation time spent waiting for the tail, and the lengths generated.

A sample is in flight from the moment its request is handed to the engine until its
completion comes back. ``OccupancyMeter`` integrates that count over time (a pure state
machine: the caller passes the clock), so a whole run is summarised by one small map
``{samples in flight: seconds}``; ``compute_tail_wait`` reads the tail off it.

Guarantees:
- the seconds of the map add up to the time from the first event to the last (or to
  ``now`` in ``seconds_at``), split exactly by the count in flight; the count never goes
  negative (``ValueError`` names the call that would make it so);
- the tail is defined once, for every system: generation time (some sample in flight)
  during which fewer than ``threshold`` × the peak count were in flight. In lock-step,
  where a step's samples start together, that is each step's time from the moment its
  median sample finished to its longest's (``threshold`` 0.5).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

TAIL_THRESHOLD = 0.5  # below half the peak count in flight: waiting for the tail


class OccupancyMeter:
    """Seconds at each count of samples in flight; times are the caller's clock."""

    def __init__(self) -> None:
        self.level = 0
        self.peak = 0
        self._since: float | None = None  # time of the last event (None: no event yet)
        self._seconds: dict[int, float] = {}

    def _advance(self, now: float) -> None:
        if self._since is not None and now > self._since:
            self._seconds[self.level] = self._seconds.get(self.level, 0.0) + now - self._since
        if self._since is None or now > self._since:
            self._since = now

    def add(self, count: int, now: float) -> None:
        """``count`` samples handed to the engine at ``now``."""
        self._advance(now)
        self.level += count
        self.peak = max(self.peak, self.level)

    def remove(self, count: int, now: float) -> None:
        """``count`` samples came back at ``now``."""
        if count > self.level:
            raise ValueError(f"OccupancyMeter.remove({count}): only {self.level} samples in flight")
        self._advance(now)
        self.level -= count

    def seconds_at(self, now: float | None = None) -> dict[int, float]:
        """``{count in flight: seconds}`` up to the last event, or up to ``now``."""
        out = dict(self._seconds)
        if now is not None and self._since is not None and now > self._since:
            out[self.level] = out.get(self.level, 0.0) + now - self._since
        return out


def integrate_events(events: Iterable[tuple[float, int]]) -> dict[int, float]:
    """``{count in flight: seconds}`` of a timeline of (time, +k handed over / -k back)
    events, in time order."""
    meter = OccupancyMeter()
    for t, delta in events:
        if delta >= 0:
            meter.add(delta, t)
        else:
            meter.remove(-delta, t)
    return meter.seconds_at()


def compute_tail_wait(seconds_at: Mapping[int | str, float], threshold: float = TAIL_THRESHOLD,
                      slots: int | None = None) -> dict[str, Any]:
    """The tail figures of a ``{count in flight: seconds}`` map (keys may be strings,
    as read back from JSON). ``slots``: the count that is full (default: the peak seen).

    ``generating_s``: seconds with a sample in flight; ``tail_s``: of those, seconds with
    fewer than ``threshold * slots`` in flight; ``tail_share`` = tail_s / generating_s;
    ``idle_s``: seconds with none in flight (between the first and last event);
    ``mean_occupancy``: the mean count in flight while generating over ``slots``."""
    levels = {int(k): float(v) for k, v in seconds_at.items() if float(v) > 0}
    peak = max((k for k in levels if k > 0), default=0)
    full = slots or peak
    generating = sum(s for k, s in levels.items() if k > 0)
    tail = sum(s for k, s in levels.items() if 0 < k < threshold * full)
    weighted = sum(k * s for k, s in levels.items() if k > 0)
    return {
        "threshold": threshold, "slots": full, "peak_in_flight": peak,
        "generating_s": generating, "tail_s": tail, "idle_s": levels.get(0, 0.0),
        "tail_share": tail / generating if generating > 0 else None,
        "mean_occupancy": weighted / (generating * full) if generating > 0 and full else None,
    }


def summarize_length_counts(counts: Mapping[int | str, int]) -> dict[str, Any]:
    """``{length: samples}`` -> samples, mean, median, p90, p99 and max length (exact:
    the smallest length with at least that share of samples at or below it)."""
    items = sorted((int(k), int(v)) for k, v in counts.items() if int(v) > 0)
    total = sum(v for _, v in items)
    if total == 0:
        return {"samples": 0}

    def quantile(q: float) -> int:
        need, seen = q * total, 0
        for length, count in items:
            seen += count
            if seen >= need:
                return length
        return items[-1][0]

    return {"samples": total, "mean": sum(k * v for k, v in items) / total, "median": quantile(0.5),
            "p90": quantile(0.9), "p99": quantile(0.99), "max": items[-1][0]}
