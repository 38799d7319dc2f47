"""Runtime profiler: span recording in the stages, pure aggregation and outputs in the driver.

Guarantees:
- ``SpanRecorder`` does no I/O and takes one uncontended lock per span: a stage records
  on its hot path (event loop or compute thread) and the driver ``drain``s the buffer.
  The buffer is bounded (``max_buffered``); when the driver falls behind, the oldest
  spans are dropped and counted in ``dropped``, so a stalled driver never grows a stage's
  memory without bound.
- Times are ``time.time()`` seconds by default: wall clock, comparable between the
  processes of one machine (not monotonic: a clock step can shorten a span, never make
  it negative, because ``span`` clamps its end to its start).
- ``aggregate_spans`` counts time per (stage, kind) as the *union* of that stage's spans
  of that kind, clipped to the window: a rollout worker with four generation requests in
  flight for the same second is busy for one second, not four. ``busy_ratio`` is busy
  union / window length and ``idle_ratio = 1 - busy_ratio``; every stage is measured
  against the same window, so a stage that started late was idle before it started.
- Every ``compute_*`` function is pure: same inputs, same dict; nothing reads a clock.
- ``write_chrome_trace`` and ``plot_timeline`` read spans only; matplotlib is imported
  lazily (Agg canvas, no pyplot global state) so importing this module in an actor is cheap.

Span kinds are those of ``pipeline.types.Span`` plus ``transfer``: time a stage spends
moving a micro-batch across a queue hop (fetching the object behind the ``ObjectRef``
after ``get`` returned, or putting it), the communication overhead that
``perf/queue_transfer_share`` reports. Waiting for an item to exist is ``wait_input``;
being blocked by a full queue is ``wait_output``; a rollout micro-batch held by the
staleness limit until the weights it needs are served is ``wait_version`` (inside that
micro-batch's ``busy`` span: ``pipeline/staleness.py`` tells the two apart); a
micro-batch whose admission waited for memory (``rollout.memory`` and the like: DEFER)
is ``wait_memory``, also inside its ``busy`` span.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.types import Span

SPAN_KINDS: tuple[str, ...] = ("busy", "wait_input", "wait_output", "sync", "oom", "transfer", "wait_version",
                               "eval", "wait_memory")
KIND_COLOURS: dict[str, str] = {  # drawing order of the timeline, rare kinds on top
    "wait_input": "#c7c7c7", "wait_output": "#ff7f0e", "transfer": "#9467bd",
    "busy": "#2ca02c", "wait_version": "#bcbd22", "wait_memory": "#8c564b", "sync": "#1f77b4", "eval": "#e377c2",
    "oom": "#d62728",
}
Interval = tuple[float, float]


# ------------------------------------------------------------------------ recording

class SpanRecorder:
    """Buffers one stage's spans until the driver drains them.

    ``with rec.span("busy", batch_id=3): ...`` times the block (also across ``await``
    and when it raises); ``rec.add(kind, start, end, batch_id)`` records a span measured
    elsewhere. Safe to call from the actor's event loop and its compute thread at once.
    """

    def __init__(
        self, stage: str, *, clock: Callable[[], float] = time.time, max_buffered: int = 100_000
    ) -> None:
        if max_buffered < 1:
            raise ValueError(f"max_buffered: expected >= 1, got {max_buffered}")
        self.stage = stage
        self.dropped = 0
        self._clock = clock
        self._buf: deque[Span] = deque(maxlen=max_buffered)
        self._lock = threading.Lock()

    def now(self) -> float:
        """The recorder's clock, for callers that measure a span themselves."""
        return self._clock()

    @contextmanager
    def span(self, kind: str, batch_id: int = -1) -> Iterator[None]:
        _check_kind(kind)
        start = self._clock()
        try:
            yield
        finally:
            # A wall-clock step backwards must not turn a span negative (or crash the stage).
            self.add(kind, start, max(start, self._clock()), batch_id)

    def add(self, kind: str, start: float, end: float, batch_id: int = -1) -> None:
        _check_kind(kind)
        if end < start:
            raise ValueError(f"span {kind!r} of {self.stage!r}: end {end} is before start {start}")
        span = Span(stage=self.stage, kind=kind, start=start, end=end, batch_id=batch_id)
        with self._lock:
            if len(self._buf) == self._buf.maxlen:
                self.dropped += 1
            self._buf.append(span)

    def drain(self) -> list[Span]:
        """Return the buffered spans, oldest first, and clear the buffer."""
        with self._lock:
            out = list(self._buf)
            self._buf.clear()
        return out


def _check_kind(kind: str) -> None:
    if kind not in SPAN_KINDS:
        raise ValueError(f"span kind: expected one of {SPAN_KINDS}, got {kind!r}")


# ---------------------------------------------------------------------- aggregation

@dataclass(frozen=True)
class StageTimes:
    """One stage's time over a window. ``seconds`` and ``intervals`` hold every kind of
    ``SPAN_KINDS`` (0.0 / empty when absent); ``intervals`` are merged and clipped."""

    stage: str
    window: Interval
    seconds: dict[str, float]
    intervals: dict[str, tuple[Interval, ...]]
    busy_ratio: float
    idle_ratio: float

    @property
    def window_s(self) -> float:
        return self.window[1] - self.window[0]


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Union of intervals as sorted, disjoint intervals; touching ones are joined."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def clip_intervals(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    """Intervals cut to ``window``; those left with no length are dropped."""
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


def sum_intervals(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def find_window(spans: Sequence[Span]) -> Interval:
    """(earliest start, latest end) over all spans; raises on an empty list."""
    if not spans:
        raise ValueError("find_window: no spans")
    return min(s.start for s in spans), max(s.end for s in spans)


def aggregate_spans(spans: Sequence[Span], window: Interval | None = None) -> dict[str, StageTimes]:
    """Per stage: seconds per kind (union of that stage's spans of the kind, clipped to
    ``window``), busy and idle ratios. ``window=None`` means ``find_window(spans)``.
    Stages come out in order of their first span."""
    if not spans:
        return {}
    window = find_window(spans) if window is None else window
    if window[1] < window[0]:
        raise ValueError(f"window: end {window[1]} is before start {window[0]}")
    raw: dict[str, dict[str, list[Interval]]] = {}
    for s in sorted(spans, key=lambda s: s.start):
        raw.setdefault(s.stage, {k: [] for k in SPAN_KINDS}).setdefault(s.kind, []).append((s.start, s.end))
    length = window[1] - window[0]
    out: dict[str, StageTimes] = {}
    for stage, by_kind in raw.items():
        intervals = {k: tuple(clip_intervals(merge_intervals(v), window)) for k, v in by_kind.items()}
        seconds = {k: sum_intervals(v) for k, v in intervals.items()}
        busy = seconds["busy"] / length if length > 0 else 0.0
        out[stage] = StageTimes(stage, window, seconds, intervals, busy, 1.0 - busy)
    return out


class SpanTotals:
    """``aggregate_spans`` over a whole run, in memory bounded by the spans of the last
    ``settle_s`` seconds rather than by the run's length (a long run's driver keeps this,
    not its spans).

    Per (stage, kind) it keeps the merged intervals that may still grow; once an interval
    ends more than ``settle_s`` before the latest span end seen, its length is folded into
    a running sum and the interval forgotten. A span that arrives later only counts its
    part after the folded time (``_folded``) of its (stage, kind), so nothing is counted
    twice; ``aggregates()`` equals ``aggregate_spans`` of every span added (stages in order
    of their first span) as long as no span arrives ``settle_s`` after its end (the driver
    drains the stages every tick, about a second). Window: earliest start, latest end;
    ``intervals`` hold the unfolded part only.
    """

    def __init__(self, settle_s: float = 120.0) -> None:
        if settle_s < 0:
            raise ValueError(f"settle_s: expected >= 0, got {settle_s}")
        self.settle_s = settle_s
        self._open: dict[str, dict[str, list[Interval]]] = {}
        self._sums: dict[str, dict[str, float]] = {}
        self._folded: dict[tuple[str, str], float] = {}
        self._first: dict[str, float] = {}  # each stage's first start: the order of the stages
        self._window: Interval | None = None

    def add(self, spans: Iterable[Span]) -> None:
        touched: set[tuple[str, str]] = set()
        for s in spans:
            lo, hi = self._window or (s.start, s.end)
            self._window = (min(lo, s.start), max(hi, s.end))
            self._sums.setdefault(s.stage, {k: 0.0 for k in SPAN_KINDS})
            self._first[s.stage] = min(s.start, self._first.get(s.stage, s.start))
            start = max(s.start, self._folded.get((s.stage, s.kind), s.start))
            if s.end >= start:
                self._open.setdefault(s.stage, {}).setdefault(s.kind, []).append((start, s.end))
                touched.add((s.stage, s.kind))
        if self._window is None:
            return
        horizon = self._window[1] - self.settle_s
        for stage, kind in touched:
            merged = merge_intervals(self._open[stage][kind])
            # Merged intervals are disjoint and sorted, so the settled ones are a prefix.
            done = [iv for iv in merged if iv[1] <= horizon]
            keep = merged[len(done):]
            if done:
                self._sums[stage][kind] += sum_intervals(done)
                self._folded[(stage, kind)] = max(e for _, e in done)
            self._open[stage][kind] = keep

    def aggregates(self) -> dict[str, StageTimes]:
        """Per stage, as ``aggregate_spans(all spans added)``; {} before the first span."""
        if self._window is None:
            return {}
        length = self._window[1] - self._window[0]
        out: dict[str, StageTimes] = {}
        for stage in sorted(self._sums, key=self._first.__getitem__):
            sums = self._sums[stage]
            open_ = self._open.get(stage, {})
            intervals = {k: tuple(merge_intervals(open_.get(k, []))) for k in SPAN_KINDS}
            seconds = {k: sums[k] + sum_intervals(intervals[k]) for k in SPAN_KINDS}
            busy = seconds["busy"] / length if length > 0 else 0.0
            out[stage] = StageTimes(stage, self._window, seconds, intervals, busy, 1.0 - busy)
        return out


# ---------------------------------------------------------------- throughput bound

def compute_seconds_per_item(aggregates: Mapping[str, StageTimes], items: Mapping[str, int]) -> dict[str, float]:
    """Busy seconds per item of each stage in ``items``. Busy time is a union, so a stage
    that overlaps requests gets credit for its concurrency; a stage with several worker
    actors should be given as one entry per worker, or its per-item time divided by them."""
    return {stage: aggregates[stage].seconds["busy"] / n for stage, n in items.items() if n > 0}


def compute_ideal_throughput(stage_seconds_per_item: Mapping[str, float]) -> tuple[str, float]:
    """(bottleneck stage, items/s) of a perfectly overlapped pipeline: 1 / the slowest
    stage's per-item time, since in steady state every stage moves at the bottleneck's pace."""
    if not stage_seconds_per_item:
        raise ValueError("compute_ideal_throughput: no stages")
    if any(t < 0 for t in stage_seconds_per_item.values()):
        raise ValueError(f"per-item seconds must be >= 0, got {dict(stage_seconds_per_item)}")
    stage = max(stage_seconds_per_item, key=lambda k: stage_seconds_per_item[k])
    slowest = stage_seconds_per_item[stage]
    if slowest == 0:
        raise ValueError("compute_ideal_throughput: every stage takes 0 s per item")
    return stage, 1.0 / slowest


def compute_efficiency(achieved: float, ideal: float) -> float:
    """achieved / ideal throughput (1.0 = the pipeline runs at its bottleneck's pace)."""
    if ideal <= 0:
        raise ValueError(f"ideal throughput must be > 0, got {ideal}")
    return achieved / ideal


# ------------------------------------------------------------------------ metrics

def compute_stage_metrics(aggregates: Mapping[str, StageTimes]) -> dict[str, float]:
    """``timing_s/<stage>`` (busy seconds), ``<stage>/busy_ratio``, ``<stage>/idle_ratio``."""
    out: dict[str, float] = {}
    for stage, t in aggregates.items():
        out[f"timing_s/{stage}"] = t.seconds["busy"]
        out[f"{stage}/busy_ratio"] = t.busy_ratio
        out[f"{stage}/idle_ratio"] = t.idle_ratio
    return out


def compute_union_seconds(aggregates: Mapping[str, StageTimes], kind: str) -> float:
    """Wall-clock seconds during which at least one stage was in ``kind``."""
    return sum_intervals(merge_intervals(iv for t in aggregates.values() for iv in t.intervals.get(kind, ())))


def compute_overhead_metrics(aggregates: Mapping[str, StageTimes]) -> dict[str, float]:
    """Weight sync and queue transfer costs.

    - ``timing_s/weight_sync``: wall-clock union of all stages' ``sync`` spans (the trainer
      publishing and the workers loading one version overlap: counted once), and
      ``perf/weight_sync_share`` = that / window length.
    - ``timing_s/queue_transfer``: stage-seconds in ``transfer`` spans, summed over stages
      (hops are paid by every stage in parallel, so their cost adds up), and
      ``perf/queue_transfer_share`` = that / the sum of the stages' window lengths, i.e.
      the mean fraction of a stage's time spent moving data.
    """
    if not aggregates:
        return {}
    window_s = next(iter(aggregates.values())).window_s
    sync = compute_union_seconds(aggregates, "sync")
    transfer = sum(t.seconds["transfer"] for t in aggregates.values())
    stage_time = window_s * len(aggregates)
    return {
        "timing_s/weight_sync": sync,
        "perf/weight_sync_share": sync / window_s if window_s > 0 else 0.0,
        "timing_s/queue_transfer": transfer,
        "perf/queue_transfer_share": transfer / stage_time if stage_time > 0 else 0.0,
    }


# ------------------------------------------------------------------------ outputs

def _assign_lanes(spans: Sequence[Span]) -> dict[str, list[list[Span]]]:
    """Per stage, spans packed into lanes of non-overlapping spans (first fit by start).
    Chrome's "X" events on one thread must nest; concurrent requests do not."""
    lanes: dict[str, list[list[Span]]] = {}
    for s in sorted(spans, key=lambda s: (s.start, s.end)):
        stage_lanes = lanes.setdefault(s.stage, [])
        lane = next((ln for ln in stage_lanes if ln[-1].end <= s.start), None)
        if lane is None:
            stage_lanes.append([s])
        else:
            lane.append(s)
    return lanes


def build_chrome_trace(spans: Sequence[Span], markers: Sequence[tuple[float, str]] = ()) -> dict[str, Any]:
    """Chrome trace event dict: pid 1, one tid per stage (extra tids ``<stage> #2`` ...
    only for concurrent spans), "X" events in microseconds since the first span,
    global instant events for markers."""
    times = [s.start for s in spans] or [t for t, _ in markers] or [0.0]
    t0 = min(times)

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "conveyor"}}]
    tid = 0
    for stage, lanes in _assign_lanes(spans).items():
        for j, lane in enumerate(lanes):
            tid += 1
            name = stage if j == 0 else f"{stage} #{j + 1}"
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": name}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
            events += [{"name": s.kind, "cat": s.kind, "ph": "X", "ts": us(s.start), "dur": us(s.end) - us(s.start),
                        "pid": 1, "tid": tid, "args": {"batch_id": s.batch_id}} for s in lane]
    events += [{"name": n, "cat": "marker", "ph": "i", "s": "g", "ts": us(t), "pid": 1, "tid": 0} for t, n in markers]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(spans: Sequence[Span], path: str | Path, markers: Sequence[tuple[float, str]] = ()) -> Path:
    """Write ``build_chrome_trace`` as JSON; open it in Perfetto or chrome://tracing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(build_chrome_trace(spans, markers)))
    return path


def plot_timeline(
    spans: Sequence[Span],
    path: str | Path,
    markers: Sequence[tuple[float, str]] = (),
    stages: Sequence[str] | None = None,
) -> Path:
    """PNG timeline: one row per stage (``stages`` order, default order of first span, top
    to bottom), each kind's merged spans in its colour, markers as dashed vertical lines,
    seconds since the first span on the x axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    aggregates = aggregate_spans(spans) if spans else {}
    rows = list(stages) if stages is not None else list(aggregates)
    t0 = min([s.start for s in spans] or [t for t, _ in markers] or [0.0])
    fig = Figure(figsize=(12, 1.2 + 0.5 * max(len(rows), 1)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    drawn: list[str] = []
    for i, stage in enumerate(rows):
        y = len(rows) - 1 - i
        for kind, colour in KIND_COLOURS.items():
            ivs = aggregates[stage].intervals.get(kind, ()) if stage in aggregates else ()
            if ivs:
                ax.broken_barh([(s - t0, e - s) for s, e in ivs], (y - 0.4, 0.8), facecolors=colour)
                drawn.append(kind)
    for t, name in markers:
        ax.axvline(t - t0, color="black", linestyle="--", linewidth=0.8 if len(markers) <= 20 else 0.3)
        if len(markers) <= 20:  # more labels than that only hide the spans
            ax.annotate(name, (t - t0, len(rows) - 0.5), fontsize=7, rotation=90, va="top", ha="right")
    ax.set_yticks(range(len(rows)), list(reversed(rows)))
    ax.set_ylim(-0.6, max(len(rows), 1) - 0.4)
    ax.set_xlabel("seconds since start")
    kinds = [k for k in KIND_COLOURS if k in drawn]
    if kinds:
        ax.legend(handles=[Patch(color=KIND_COLOURS[k], label=k) for k in kinds], loc="upper left",
                  bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def format_summary_table(aggregates: Mapping[str, StageTimes]) -> str:
    """Fixed-width text table (fits a log line as well as a terminal): one row per stage,
    busy and idle ratios and seconds per kind."""
    kinds = [k for k in SPAN_KINDS if any(t.seconds.get(k, 0.0) > 0 for t in aggregates.values()) or k == "busy"]
    header = ["stage", "busy %", "idle %", *(f"{k} s" for k in kinds)]
    rows = [
        [stage, f"{100 * t.busy_ratio:.1f}", f"{100 * t.idle_ratio:.1f}", *(f"{t.seconds.get(k, 0.0):.2f}" for k in kinds)]
        for stage, t in aggregates.items()
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------------------- GPU

class GpuSampler:
    """GPU utilisation in percent (0-100) of one device, or None where it cannot be read.

    Tries NVML (``pynvml``) first, then ``torch.cuda.utilization`` when torch is already
    imported (importing torch just to learn there is no GPU costs seconds in the driver).
    The first failure disables sampling for good: no retry storm, no log spam.
    """

    def __init__(self, device_index: int = 0, query: Callable[[], float | None] | None = None) -> None:
        self.device_index = device_index
        self._query = query
        self._disabled = False

    def sample(self) -> float | None:
        if self._disabled:
            return None
        try:
            self._query = self._query or self._find_backend()
            value = self._query()
        except Exception:
            value = None
        self._disabled = value is None
        return None if value is None else float(value)

    def _find_backend(self) -> Callable[[], float | None]:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.device_index)
            return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:
            torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            return lambda: float(torch.cuda.utilization(self.device_index))
        return lambda: None
