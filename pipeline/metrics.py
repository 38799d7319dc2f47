"""Metrics outputs of a run: ``metrics.jsonl``, TensorBoard scalars and ``summary.json``.

Guarantees:
- ``MetricsWriter.log`` appends exactly one JSON object per call to
  ``<run_dir>/metrics.jsonl`` and flushes it before returning, so a run that crashes
  leaves every logged step readable. Each line is ``{"step": int, "time": float,
  <metric>: float | null, ...}``; a non-finite value (NaN, inf) is written as ``null``
  because JSON has no NaN. The file is opened for append: a resumed run continues it.
- TensorBoard is optional: tensorboard's event writer is imported lazily; when it does
  not import, one warning is logged and the JSONL file is still written. It receives
  every row's scalars, the config and the summary as text and ``timeline.png`` as an
  image; so do the trackers of ``run.trackers`` (``pipeline/trackers.py``).
- ``log_eval`` writes an evaluation's ``eval/*`` values as a row of its own whose
  ``step`` is the policy version evaluated (``is_eval_row`` tells them apart); it may
  come after rows of later steps, so trackers that need steps in order get it on an
  axis of its own (``eval/step``).
- ``read_metrics`` returns the logged rows in order; a torn last line (the process died
  mid-write) is skipped, a malformed line elsewhere raises ``ValueError`` with its number.
- ``write_summary`` replaces ``summary.json`` atomically: readers see the old file or
  the new one, never a partial one.
- ``accumulate_totals``: a run's ``totals`` across its launches (a resume is a new
  launch) are the previous ``summary.json``'s totals plus this launch's figures; a
  summary written before totals existed counts as one launch of its own figures.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self, TextIO

import structlog

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TENSORBOARD_DIR = "tensorboard"
_RESERVED = ("step", "time")
EVAL_PREFIX = "eval/"

log = structlog.get_logger(__name__)


class MetricsWriter:
    """Per-step scalars to ``<run_dir>/metrics.jsonl`` and, optionally, TensorBoard
    (event files under ``<run_dir>/tensorboard``) and the trackers of ``run.trackers``
    (``pipeline/trackers.py``). ``log_config`` once, ``log`` per row, ``close()`` the
    JSONL file; ``finish(summary, files)`` sends the summary and pictures to TensorBoard
    and the trackers and closes them (the context manager does both)."""

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, trackers: Sequence[str] = (),
                 run_name: str = "conveyor") -> None:
        from pipeline.trackers import open_trackers

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        self._tb: _Scalars | None = _open_tensorboard(self.run_dir / TENSORBOARD_DIR) if tensorboard else None
        self.trackers: list[Any] = ([self._tb] if self._tb else []) + open_trackers(trackers, self.run_dir, run_name)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The run's resolved config, to every tracker."""
        for tracker in self.trackers:
            tracker.log_config(config)

    def log(self, step: int, metrics: Mapping[str, float], *, at: float | None = None) -> None:
        """One row; ``at``: its ``time`` (default now), e.g. when the step ended rather
        than when the driver heard of it."""
        values = self._write_row(step, metrics, at)
        for tracker in self.trackers:
            if tracker is not self._tb:
                tracker.log_metrics(int(step), values)

    def log_eval(self, version: int, metrics: Mapping[str, float], *, at: float | None = None) -> None:
        """One evaluation's ``eval/*`` values as a row of its own at ``step`` = the policy
        version evaluated (see the module guarantees)."""
        wrong = [k for k in metrics if not k.startswith(EVAL_PREFIX)]
        if wrong:
            raise ValueError(f"eval rows hold {EVAL_PREFIX}* metrics only, got {wrong}")
        values = self._write_row(version, metrics, at)  # the file and TensorBoard take any step order
        for tracker in self.trackers:
            if tracker is not self._tb:
                tracker.log_eval(int(version), values)

    def _write_row(self, step: int, metrics: Mapping[str, float], at: float | None) -> dict[str, float]:
        """The row to ``metrics.jsonl`` (flushed) and TensorBoard; its values as floats."""
        if self._file is None:
            raise RuntimeError(f"MetricsWriter for {self.path} is closed")
        clash = [k for k in _RESERVED if k in metrics]
        if clash:
            raise ValueError(f"metric names {clash} are reserved for the row's own fields")
        values = {k: float(v) for k, v in metrics.items()}
        row: dict[str, Any] = {"step": int(step), "time": time.time() if at is None else float(at)}
        row.update({k: v if math.isfinite(v) else None for k, v in values.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb.write(int(step), values, row["time"])
        return values

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self, summary: Mapping[str, Any] | None = None, files: Sequence[Path] = ()) -> None:
        """The summary and ``files`` (those that exist) to every tracker, then close them;
        once (later calls do nothing)."""
        trackers, self.trackers, self._tb = self.trackers, [], None
        for tracker in trackers:
            if summary is not None:
                tracker.log_summary(summary, [f for f in files if f.is_file()])
            tracker.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.finish()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` (a file or a run directory), in logged order."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            # Only the very last line can be torn by a crash; it was never flushed whole.
            if i == len(lines) and not line.endswith("\n"):
                break
            raise ValueError(f"{path}:{i}: not a JSON object ({exc})") from None
    return rows


def is_eval_row(row: Mapping[str, Any]) -> bool:
    """A row ``MetricsWriter.log_eval`` wrote (its metrics are ``eval/*``), not a step's."""
    return any(k.startswith(EVAL_PREFIX) for k in row)


def write_summary(run_dir: str | Path, summary: Mapping[str, Any]) -> Path:
    """Write ``<run_dir>/summary.json`` atomically (temp file in the same dir, fsync,
    rename). numpy scalars and arrays become numbers and lists, paths strings,
    non-finite floats ``null``."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / SUMMARY_FILE
    text = json.dumps(_to_json(dict(summary)), indent=2, sort_keys=True, allow_nan=False)
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{SUMMARY_FILE}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _to_json(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if hasattr(value, "tolist"):  # numpy scalars and arrays, without importing numpy here
        return _to_json(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


# -------------------------------------------------------------------- TensorBoard

class _Scalars:
    """Scalars to a TensorBoard event file with tensorboard's own writer (no torch
    import; ``torch.utils.tensorboard`` needs these same modules anyway)."""

    def __init__(self, logdir: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(logdir))

    def write(self, step: int, values: dict[str, float], at: float | None = None) -> None:
        value = [self._summary.Value(tag=k, simple_value=v) for k, v in values.items()]
        self._add(self._summary(value=value), step, at)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._add(self._text("config", json.dumps(_to_json(dict(config)), indent=2)), 0)

    def log_summary(self, summary: Mapping[str, Any], files: Sequence[Path]) -> None:
        """``summary.json`` as text, each PNG of ``files`` as an image."""
        values = [self._text("summary", json.dumps(_to_json(dict(summary)), indent=2, allow_nan=False)).value[0]]
        for file in files:
            if file.suffix == ".png":
                data = file.read_bytes()
                width, height = struct.unpack(">II", data[16:24])  # the PNG header's IHDR chunk
                image = self._summary.Image(height=height, width=width, colorspace=4, encoded_image_string=data)
                values.append(self._summary.Value(tag=file.stem, image=image))
        self._add(self._summary(value=values), 0)

    def _text(self, tag: str, text: str) -> Any:
        """A TensorBoard text-plugin summary of one string."""
        from tensorboard.compat.proto.summary_pb2 import SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.compat.proto.types_pb2 import DT_STRING

        tensor = TensorProto(dtype=DT_STRING, string_val=[text.encode()],
                             tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]))
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        return self._summary(value=[self._summary.Value(tag=tag, metadata=meta, tensor=tensor)])

    def _add(self, summary: Any, step: int, at: float | None = None) -> None:
        self._writer.add_event(self._event(wall_time=time.time() if at is None else at, step=step, summary=summary))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _open_tensorboard(logdir: Path) -> _Scalars | None:
    """A TensorBoard writer, or None after one warning when tensorboard is not installed."""
    try:
        return _Scalars(logdir)
    except ImportError as exc:
        log.warning("tensorboard_unavailable", reason=str(exc), logdir=str(logdir),
                    note="metrics go to metrics.jsonl only")
        return None


TOTAL_KEYS = ("launches", "steps", "samples_trained", "wall_s")


def launch_totals(summary: Mapping[str, Any]) -> dict[str, float]:
    """One launch's figures for ``totals``: its steps, the samples its trainer trained
    and its wall time (``launch_wall_s``, else ``wall_s``)."""
    trained = (summary.get("trainer") or {}).get("samples_trained", summary.get("samples_trained", 0))
    return {"launches": 1, "steps": int(summary.get("steps") or 0), "samples_trained": int(trained or 0),
            "wall_s": float(summary.get("launch_wall_s", summary.get("wall_s")) or 0.0)}


def accumulate_totals(previous: Mapping[str, Any] | None, launch: Mapping[str, Any]) -> dict[str, Any]:
    """The run's ``totals`` after ``launch`` (``launch_totals``), given the summary the
    run's previous launch left (None for a first launch). ``steps`` counts steps each
    launch took, so a step redone after a resume from an older checkpoint counts again;
    ``policy_version`` says how many the run's weights hold."""
    before = {k: 0 for k in TOTAL_KEYS}
    if previous:
        before = dict(previous.get("totals") or launch_totals(previous))
    return {k: before.get(k, 0) + launch[k] for k in TOTAL_KEYS}


def read_summary(run_dir: str | Path) -> dict[str, Any] | None:
    """``<run_dir>/summary.json`` as written, or None when there is none (or it does not parse)."""
    try:
        data = json.loads((Path(run_dir) / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
