"""Metrics outputs: JSONL round trip and crash tolerance, TensorBoard, summary.json."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from structlog.testing import capture_logs

from pipeline.metrics import MetricsWriter, accumulate_totals, launch_totals, read_metrics, read_summary, write_summary


def test_metrics_jsonl_round_trip(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.log(1, {"loss": 0.5, "timing_s/rollout": 2.0})
        writer.log(2, {"loss": float("nan"), "perf/throughput_tokens_per_s": np.float32(12.5)})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] == 0.5
    assert rows[0]["timing_s/rollout"] == 2.0
    # NaN has no JSON spelling: written as null. 12.5 is exact in float32.
    assert rows[1]["loss"] is None
    assert rows[1]["perf/throughput_tokens_per_s"] == 12.5
    assert all(isinstance(r["time"], float) for r in rows)


def test_a_row_can_carry_the_time_its_step_ended(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.log(0, {"loss": 1.0}, at=1234.5)
        writer.log(1, {"loss": 1.0})
    rows = read_metrics(tmp_path)
    assert rows[0]["time"] == 1234.5
    assert rows[1]["time"] > 1234.5  # now


def test_each_line_is_readable_before_close(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.log(0, {"loss": 1.0})
    # Flushed per line: a crash now would leave this row on disk.
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in rows] == [(0, 1.0)]
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.log(1, {"loss": 1.0})


def test_reopened_writer_appends(tmp_path):
    for step in range(2):
        with MetricsWriter(tmp_path, tensorboard=False) as writer:
            writer.log(step, {"x": float(step)})
    assert [r["x"] for r in read_metrics(tmp_path)] == [0.0, 1.0]


def test_read_metrics_skips_torn_last_line_but_not_a_bad_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n{"step": 3, "x"')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(path)


def test_reserved_metric_names_are_rejected(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer, pytest.raises(ValueError, match="reserved"):
        writer.log(0, {"step": 1.0})


def _read_scalars(logdir: Path) -> list[tuple[int, str, float]]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = []
    for f in sorted(logdir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(f)).Load():
            for v in event.summary.value:
                value = v.simple_value if v.HasField("simple_value") else float(v.tensor.float_val[0])
                out.append((event.step, v.tag, value))
    return out


def test_tensorboard_scalars_are_written(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=True) as writer:
        writer.log(1, {"loss": 0.5})
        writer.log(2, {"loss": 0.25, "timing_s/trainer": 3.0})
    assert sorted(_read_scalars(tmp_path / "tensorboard")) == [
        (1, "loss", 0.5), (2, "loss", 0.25), (2, "timing_s/trainer", 3.0)]


def test_missing_tensorboard_warns_once_and_jsonl_goes_on(tmp_path, monkeypatch):
    # None in sys.modules makes an import raise ImportError.
    for name in ("tensorboard.compat.proto.event_pb2", "tensorboard.compat.proto.summary_pb2",
                 "tensorboard.summary.writer.event_file_writer"):
        monkeypatch.setitem(sys.modules, name, None)
    with capture_logs() as logs, MetricsWriter(tmp_path, tensorboard=True) as writer:
        for step in range(3):
            writer.log(step, {"loss": 1.0})
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["tensorboard_unavailable"]
    assert len(read_metrics(tmp_path)) == 3
    assert not (tmp_path / "tensorboard").exists()


def test_write_summary_is_atomic_and_converts_values(tmp_path):
    write_summary(tmp_path, {"old": 1})
    path = write_summary(tmp_path, {
        "tokens_per_s": np.float32(2.5), "ratios": np.array([0.5, 0.25]), "bad": math.inf,
        "trace": tmp_path / "trace.json", "stages": {"rollout": {"busy_ratio": 0.75}},
    })
    # The second write replaced the first whole; no temp file is left next to it.
    assert json.loads(path.read_text()) == {
        "tokens_per_s": 2.5, "ratios": [0.5, 0.25], "bad": None,
        "trace": str(tmp_path / "trace.json"), "stages": {"rollout": {"busy_ratio": 0.75}},
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_totals_add_each_launch_to_the_previous_summary():
    first = {"steps": 40, "wall_s": 100.0, "launch_wall_s": 130.0, "trainer": {"samples_trained": 2560}}
    one = accumulate_totals(None, launch_totals(first))
    # a first launch: its own figures, wall time from the launch's start (130 s, not the graph's 100 s)
    assert one == {"launches": 1, "steps": 40, "samples_trained": 2560, "wall_s": 130.0}
    # resumed from step 30: 80 more steps (10 of them redone) and 5120 samples in 200 s
    second = {"steps": 80, "launch_wall_s": 200.0, "samples_trained": 5120}
    two = accumulate_totals({**first, "totals": one}, launch_totals(second))
    assert two == {"launches": 2, "steps": 120, "samples_trained": 7680, "wall_s": 330.0}


def test_a_summary_without_totals_counts_as_one_launch():
    old = {"steps": 10, "wall_s": 50.0, "trainer": {"samples_trained": 640}}
    # 10 + 5 steps, 640 + 320 samples, 50 + 20 s over 2 launches
    assert accumulate_totals(old, launch_totals({"steps": 5, "wall_s": 20.0, "samples_trained": 320})) == {
        "launches": 2, "steps": 15, "samples_trained": 960, "wall_s": 70.0}


def test_read_summary_is_none_without_a_readable_file(tmp_path):
    assert read_summary(tmp_path) is None
    (tmp_path / "summary.json").write_text("{torn")
    assert read_summary(tmp_path) is None
    write_summary(tmp_path, {"steps": 3})
    assert read_summary(tmp_path) == {"steps": 3}
