"""Experiment trackers (``run.trackers``): each receives the config, every metric row, the
summary and the timeline picture; one that is not installed stops the launch with exit 2.
The trackers are fakes injected into ``sys.modules`` (mlflow, wandb, swanlab and trackio
are not installed here), recording the calls of each package's public API."""

from __future__ import annotations

import math
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline.cli import main
from pipeline.config import ConfigError, load_config
from pipeline.metrics import MetricsWriter
from pipeline.preflight import run_preflight
from pipeline.trackers import check_trackers, flatten, summary_numbers

CONFIG = {"train": {"lr": 1e-6}, "run": {"name": "r1", "trackers": ["mlflow"]}}
SUMMARY = {"steps": 2, "samples": {"trained": 32, "dropped": {}}, "reward_last": 0.5, "status": "completed",
           "reward_first": None}


def fake_module(name: str, calls: list, **extra) -> types.ModuleType:
    """A module named ``fake_<name>`` whose every function records (function, args, kwargs)."""
    module = types.ModuleType(f"fake_{name}")

    def recorder(fn: str):
        return lambda *args, **kwargs: calls.append((fn, args, kwargs))

    for fn in ("set_tracking_uri", "set_experiment", "start_run", "log_params", "log_metrics", "log_artifact",
               "end_run", "init", "log", "finish"):
        setattr(module, fn, recorder(fn))
    module.Image = lambda path: ("image", Path(path).name)
    for key, value in extra.items():
        setattr(module, key, value)
    return module


def run_writer(run_dir: Path, trackers: list[str]) -> Path:
    """Config, two rows, then the summary with summary.json and a 3x2 timeline.png."""
    import matplotlib.pyplot as plt

    with MetricsWriter(run_dir, tensorboard=False, trackers=trackers, run_name="r1") as writer:
        writer.log_config(CONFIG)
        writer.log(0, {"reward/mean": 0.25, "queue/rollout->reward/depth": 2.0})
        writer.log(1, {"reward/mean": 0.5, "loss": math.nan})
        plt.imsave(run_dir / "timeline.png", np.zeros((2, 3, 3)))
        (run_dir / "summary.json").write_text("{}")
        writer.finish(SUMMARY, [run_dir / "summary.json", run_dir / "timeline.png", run_dir / "missing.png"])
    return run_dir


def test_mlflow_gets_params_metrics_by_step_and_artifacts(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "mlflow", fake_module("mlflow", calls))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run_writer(tmp_path, ["mlflow"])
    # MLflow 3 refuses a file store unless this is true (seen with mlflow-skinny 3.18).
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"
    assert calls == [
        ("set_tracking_uri", ((tmp_path / "mlruns").as_uri(),), {}),  # the local file store, no server
        ("set_experiment", ("conveyor",), {}),
        ("start_run", (), {"run_name": "r1"}),
        ("log_params", ({"train.lr": "1e-06", "run.name": "r1", "run.trackers": '["mlflow"]'},), {}),
        # "->" is not allowed in an MLflow name: "-" stays, ">" becomes "_"; NaN is left out.
        ("log_metrics", ({"reward/mean": 0.25, "queue/rollout-_reward/depth": 2.0},), {"step": 0}),
        ("log_metrics", ({"reward/mean": 0.5},), {"step": 1}),
        ("log_artifact", (str(tmp_path / "summary.json"),), {}),
        ("log_artifact", (str(tmp_path / "timeline.png"),), {}),  # missing.png is skipped
        ("end_run", (), {}),
    ]


def test_wandb_gets_config_rows_summary_and_the_timeline(tmp_path, monkeypatch):
    calls: list = []
    run = types.SimpleNamespace(config=types.SimpleNamespace(update=lambda c: calls.append(("config", c))),
                                summary=types.SimpleNamespace(update=lambda s: calls.append(("summary", s))),
                                log=lambda row, step=None: calls.append(("log", row, step)),
                                finish=lambda: calls.append(("finish",)))
    wandb = fake_module("wandb", calls)
    wandb.init = lambda **kw: calls.append(("init", kw)) or run
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    run_writer(tmp_path, ["wandb"])
    assert calls == [
        ("init", {"project": "conveyor", "name": "r1", "dir": str(tmp_path)}),
        ("config", CONFIG),
        ("log", {"reward/mean": 0.25, "queue/rollout->reward/depth": 2.0}, 0),
        ("log", calls[3][1], 1),  # NaN != NaN: checked below
        # The summary's finite numbers, flattened (None and strings are left out).
        ("summary", {"steps": 2.0, "samples.trained": 32.0, "reward_last": 0.5}),
        ("log", {"timeline": ("image", "timeline.png")}, None),
        ("finish",),
    ]
    assert calls[3][1]["reward/mean"] == 0.5 and math.isnan(calls[3][1]["loss"])


@pytest.mark.parametrize("name", ["swanlab", "trackio"])
def test_swanlab_and_trackio_get_config_rows_summary_and_the_timeline(tmp_path, monkeypatch, name):
    calls: list = []
    monkeypatch.setitem(sys.modules, name, fake_module(name, calls))
    run_writer(tmp_path, [name])
    init = calls[0]
    assert init[0] == "init" and init[2]["config"] == CONFIG and init[2]["project"] == "conveyor"
    assert [c[0] for c in calls] == ["init", "log", "log", "log", "log", "finish"]
    assert calls[1] == ("log", ({"reward/mean": 0.25, "queue/rollout->reward/depth": 2.0},), {"step": 0})
    assert calls[3] == ("log", ({"summary/steps": 2.0, "summary/samples.trained": 32.0, "summary/reward_last": 0.5},),
                        {})
    assert calls[4] == ("log", ({"timeline": ("image", "timeline.png")},), {})


def test_tensorboard_gets_the_config_summary_and_timeline(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event

    with MetricsWriter(tmp_path, tensorboard=True) as writer:
        writer.log_config(CONFIG)
        writer.log(0, {"loss": 0.5})
        import matplotlib.pyplot as plt

        plt.imsave(tmp_path / "timeline.png", np.zeros((2, 3, 3)))
        writer.finish(SUMMARY, [tmp_path / "timeline.png"])
    values = {v.tag: v for f in (tmp_path / "tensorboard").glob("events.*")
              for raw in RawEventFileLoader(str(f)).Load() for v in Event.FromString(raw).summary.value}
    assert sorted(values) == ["config", "loss", "summary", "timeline"]
    assert b'"lr": 1e-06' in values["config"].tensor.string_val[0]
    assert b'"reward_last": 0.5' in values["summary"].tensor.string_val[0]
    assert (values["timeline"].image.width, values["timeline"].image.height) == (3, 2)


def test_helpers():
    assert flatten({"a": {"b": 1, "c": {}}, "d": [1]}) == {"a.b": 1, "a.c": {}, "d": [1]}
    assert summary_numbers({"x": True, "y": math.inf, "z": {"w": 3}}) == {"z.w": 3.0}


def test_a_tracker_not_installed_is_refused_naming_the_key_and_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "swanlab", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"^run.trackers: swanlab is not installed; pip install 'conveyor\[swanlab\]'"):
        check_trackers(["tensorboard", "swanlab"])
    with pytest.raises(ConfigError, match="run.trackers: swanlab"):
        run_preflight(load_config(None, ["run.trackers=[swanlab]"]))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run": {"trackers": ["swanlab"], "dir": str(tmp_path / "r")}}))
    assert main(["launch", "--config", str(config)]) == 2
    assert "conveyor: invalid config: run.trackers: swanlab is not installed" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="run.trackers"):
        load_config(None, ["run.trackers=[neptune]"])


def test_an_evaluation_reaches_each_tracker_on_an_axis_it_accepts(tmp_path, monkeypatch):
    """An eval row may come after rows of later steps: W&B (which drops a row whose step
    went back) gets it against ``eval/step``, added to the pending row; MLflow at the
    version, as a step of its own."""
    calls: list = []
    run = types.SimpleNamespace(define_metric=lambda *a, **kw: calls.append(("define", a, kw)),
                                log=lambda row, step=None, commit=None: calls.append(("log", row, step, commit)),
                                config=types.SimpleNamespace(update=lambda c: None), finish=lambda: None)
    wandb = fake_module("wandb", calls)
    wandb.init = lambda **kw: run
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", fake_module("mlflow", calls))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "false")  # a user's own choice stands
    with MetricsWriter(tmp_path, tensorboard=False, trackers=["wandb", "mlflow"]) as writer:
        writer.log(3, {"reward/mean": 0.5})
        calls.clear()
        writer.log_eval(2, {"eval/reward_mean": 0.25})
        writer.log_eval(4, {"eval/reward_mean": 0.75})
    assert calls == [
        ("define", ("eval/step",), {}), ("define", ("eval/*",), {"step_metric": "eval/step"}),
        ("log", {"eval/reward_mean": 0.25, "eval/step": 2}, None, False),
        ("log_metrics", ({"eval/reward_mean": 0.25},), {"step": 2}),
        ("log", {"eval/reward_mean": 0.75, "eval/step": 4}, None, False),  # the axis is defined once
        ("log_metrics", ({"eval/reward_mean": 0.75},), {"step": 4}),
        ("end_run", (), {}),
    ]
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "false"
