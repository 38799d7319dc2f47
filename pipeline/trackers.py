"""Experiment trackers (``run.trackers``): the run's config, every metric row, the summary
and the timeline picture, sent to MLflow, Weights & Biases, SwanLab or Trackio as well
as ``metrics.jsonl`` (TensorBoard is ``pipeline/metrics.py``'s own writer).

Guarantees:
- Each tracker is an optional package (``TRACKERS``: module and pip extra); a run naming
  one that is not installed is refused by pre-flight (``check_trackers``: a
  ``ConfigError`` naming ``run.trackers`` and the extra, exit 2) before Ray starts.
- ``MetricsWriter`` (``pipeline/metrics.py``) drives them through one small interface,
  ``log_config`` once, ``log_metrics(step, row)`` per metric row, ``log_eval(version,
  row)`` per evaluation, ``log_summary(summary, files)`` once at the end
  (``summary.json`` and the run's pictures), then ``close``.
- An evaluation may arrive after rows of later steps: W&B, which drops a row whose step
  went back, plots ``eval/*`` against ``eval/step`` (its ``define_metric``); the others
  take a step per metric or in any order, so they get the version as the step.
- Each tracker's own settings come from its environment: ``MLFLOW_TRACKING_URI`` (unset:
  MLflow's local file store in ``<run dir>/mlruns``, no server; MLflow 3 refuses that
  store unless ``MLFLOW_ALLOW_FILE_STORE`` is true, so it is set for this process when
  unset; a ``sqlite:///`` URI selects MLflow's database store instead) and
  ``MLFLOW_EXPERIMENT_NAME``; ``WANDB_PROJECT``, ``WANDB_MODE=offline``; SwanLab's and
  Trackio's likewise. The project is ``conveyor`` unless the environment names one; the
  run is named ``run.name``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pipeline.config import ConfigError

# Tracker name -> (module imported, pip extra of conveyor that installs it).
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
    "swanlab": ("swanlab", "swanlab"),
    "trackio": ("trackio", "trackio"),
}
PROJECT = "conveyor"


class Tracker(Protocol):
    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_eval(self, version: int, metrics: Mapping[str, float]) -> None: ...

    def log_summary(self, summary: Mapping[str, Any], files: Sequence[Path]) -> None: ...

    def close(self) -> None: ...


def check_trackers(names: Sequence[str]) -> None:
    """Every tracker of ``run.trackers`` importable; else a ``ConfigError`` naming the extra."""
    for name in names:
        module, extra = TRACKERS[name]
        if not _installed(module):
            raise ConfigError(f"run.trackers: {name} is not installed; pip install 'conveyor[{extra}]' "
                              f"(or {module}), or remove it from run.trackers")


def open_trackers(names: Sequence[str], run_dir: Path, run_name: str) -> list[Tracker]:
    """The adapters of the external trackers among ``names`` (not TensorBoard)."""
    adapters = {"mlflow": MlflowTracker, "wandb": WandbTracker, "swanlab": SwanlabTracker, "trackio": TrackioTracker}
    return [adapters[n](importlib.import_module(TRACKERS[n][0]), run_dir, run_name) for n in names if n in adapters]


def flatten(value: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1e-6}}`` -> ``{"train.lr": 1e-6}``; lists stay whole."""
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, Mapping) and item:
            out.update(flatten(item, f"{name}."))
        else:
            out[name] = item
    return out


def summary_numbers(summary: Mapping[str, Any]) -> dict[str, float]:
    """The summary's finite numbers, flattened (``samples.trained``...)."""
    return {k: float(v) for k, v in flatten(summary).items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


class MlflowTracker:
    """MLflow through its public API: a file store under the run dir unless
    ``MLFLOW_TRACKING_URI`` names a server; parameters from the config, metrics by step,
    ``summary.json`` and ``timeline.png`` as artifacts."""

    INVALID = re.compile(r"[^\w\-. /]")  # MLflow's metric and parameter names

    def __init__(self, mlflow: Any, run_dir: Path, run_name: str) -> None:
        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store is opt-in
            mlflow.set_tracking_uri((run_dir / "mlruns").absolute().as_uri())
        if not os.environ.get("MLFLOW_EXPERIMENT_NAME"):
            mlflow.set_experiment(PROJECT)
        self.run = mlflow.start_run(run_name=run_name)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.mlflow.log_params({self._name(k): json.dumps(v)[:500] if not isinstance(v, str) else v[:500]
                                for k, v in flatten(config).items()})

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.mlflow.log_metrics({self._name(k): v for k, v in metrics.items() if math.isfinite(v)}, step=step)

    def log_eval(self, version: int, metrics: Mapping[str, float]) -> None:
        self.log_metrics(version, metrics)

    def log_summary(self, summary: Mapping[str, Any], files: Sequence[Path]) -> None:
        for file in files:
            self.mlflow.log_artifact(str(file))

    def close(self) -> None:
        self.mlflow.end_run()

    def _name(self, key: str) -> str:
        return self.INVALID.sub("_", key)


class WandbTracker:
    """Weights & Biases: the config at ``init``, rows by step, the summary's numbers in
    the run summary and the timeline as an image (``WANDB_MODE=offline`` works offline)."""

    def __init__(self, wandb: Any, run_dir: Path, run_name: str) -> None:
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name, dir=str(run_dir))
        self._eval_axis = False

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config))

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_eval(self, version: int, metrics: Mapping[str, float]) -> None:
        """Against ``eval/step``, added to the pending row (no step of its own to go back)."""
        if not self._eval_axis:
            self.run.define_metric("eval/step")
            self.run.define_metric("eval/*", step_metric="eval/step")
            self._eval_axis = True
        self.run.log({**metrics, "eval/step": version}, commit=False)

    def log_summary(self, summary: Mapping[str, Any], files: Sequence[Path]) -> None:
        self.run.summary.update(summary_numbers(summary))
        for file in files:
            if file.suffix == ".png":
                self.run.log({file.stem: self.wandb.Image(str(file))})

    def close(self) -> None:
        self.run.finish()


class SwanlabTracker:
    """SwanLab: the config at ``init``, rows by step, the summary's numbers under
    ``summary/`` and the timeline as an image."""

    def __init__(self, swanlab: Any, run_dir: Path, run_name: str) -> None:
        self.swanlab = swanlab
        self.run_dir, self.run_name = run_dir, run_name
        self.started = False

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.swanlab.init(project=os.environ.get("SWANLAB_PROJECT", PROJECT), experiment_name=self.run_name,
                          config=dict(config), logdir=str(self.run_dir / "swanlog"))
        self.started = True

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.swanlab.log(dict(metrics), step=step)

    def log_eval(self, version: int, metrics: Mapping[str, float]) -> None:
        self.log_metrics(version, metrics)  # steps are kept per metric

    def log_summary(self, summary: Mapping[str, Any], files: Sequence[Path]) -> None:
        self.swanlab.log({f"summary/{k}": v for k, v in summary_numbers(summary).items()})
        for file in files:
            if file.suffix == ".png":
                self.swanlab.log({file.stem: self.swanlab.Image(str(file))})

    def close(self) -> None:
        if self.started:
            self.swanlab.finish()


class TrackioTracker:
    """Trackio: the config at ``init``, rows by step, the summary's numbers under
    ``summary/`` and the timeline as an image where the installed Trackio has ``Image``."""

    def __init__(self, trackio: Any, run_dir: Path, run_name: str) -> None:
        self.trackio = trackio
        self.run_name = run_name
        self.started = False

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=self.run_name, config=dict(config))
        self.started = True

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.trackio.log(dict(metrics), step=step)

    def log_eval(self, version: int, metrics: Mapping[str, float]) -> None:
        self.log_metrics(version, metrics)

    def log_summary(self, summary: Mapping[str, Any], files: Sequence[Path]) -> None:
        self.trackio.log({f"summary/{k}": v for k, v in summary_numbers(summary).items()})
        image = getattr(self.trackio, "Image", None)
        for file in files:
            if file.suffix == ".png" and image is not None:
                self.trackio.log({file.stem: image(str(file))})

    def close(self) -> None:
        if self.started:
            self.trackio.finish()


def _installed(module: str) -> bool:
    if module in sys.modules:  # imported already (or blocked: None)
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
