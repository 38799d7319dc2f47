"""Held-out evaluation, the plumbing side: which versions are evaluated, and what the
driver makes of the results (``eval`` config; docs/evaluation.md).

Rollout worker 0 evaluates (``stages/evaluation/``); the controller holds the weights
of every version due an evaluation until it is reported, so that worker evaluates each
one even when newer weights were published meanwhile; the driver logs each result as an
``eval/*`` row and sums them up in ``summary.json`` and ``eval.png``.

Guarantees:
- ``EvalSchedule.kind`` is a pure function of the version: ``before_train`` for the
  version a launch starts from (0, or a resumed run's checkpoint) when asked,
  ``periodic`` for every ``eval.every``-th version after it, None otherwise; the
  controller and the rollout read the same schedule, so they agree on what is due.
- ``EvalLog`` keeps the first, last and best result (by ``HEADLINE``) and a count, never
  a history (the rows are in ``metrics.jsonl``); a resumed run's log continues the one
  its previous launch left in ``summary.json``.
- ``plot_evals`` reads ``metrics.jsonl`` rows only and draws nothing without eval rows.
- ``check_eval_node`` refuses (``ConfigError`` naming ``eval.path``) a graph whose rollout
  does not evaluate: results that never come would not be noticed otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from pipeline.config import ConfigError
from pipeline.metrics import is_eval_row
from pipeline.plugins import import_object, stage_class
from pipeline.types import EvalResult

HEADLINE = "eval/reward_mean"  # what "best" means in summary.json
EVAL_PICTURE = "eval.png"


class EvalSchedule(msgspec.Struct, frozen=True, kw_only=True):
    """The versions due an evaluation between steps (the final one is asked at the end)."""

    every: int = 0
    before_train: bool = False
    start_version: int = 0

    def kind(self, version: int) -> str | None:
        if self.before_train and version == self.start_version:
            return "before_train"
        if self.every and version > self.start_version and version % self.every == 0:
            return "periodic"
        return None


def build_eval_schedule(config: Any, start_version: int) -> EvalSchedule | None:
    """The run's schedule (None when ``eval`` is off or there is no config)."""
    ev = getattr(config, "eval", None)
    if ev is None or not ev.enabled:
        return None
    return EvalSchedule(every=ev.every, before_train=ev.before_train, start_version=start_version)


def check_eval_node(cfg: Any, df: Any) -> None:
    """With ``eval``, one node of the graph must be a rollout that evaluates."""
    if not cfg.eval.enabled:
        return
    evaluating = stage_class("rollout_eval")
    for node in df.nodes.values():
        cls = import_object(node.node_class, f"node {node.name!r} node_class") if isinstance(node.node_class, str) \
            else node.node_class
        if isinstance(cls, type) and issubclass(cls, evaluating):
            return
    raise ConfigError("eval.path: the run's graph has no rollout node that evaluates; a DataFlow script or "
                      "dataflow.nodes names stages.evaluation.stage:EvalRolloutStage (stages.flow.EvaluatingRollout) "
                      "as its rollout")


def eval_record(result: EvalResult) -> dict[str, Any]:
    """One result as ``summary.json`` shows it: version, kind, seconds and the metrics."""
    return {"version": result.version, "kind": result.kind, "wall_s": result.wall_s, **result.metrics}


class EvalLog:
    """The driver's account of the evaluations (see the module guarantees)."""

    def __init__(self, previous: Mapping[str, Any] | None = None) -> None:
        before = dict((previous or {}).get("eval") or {})
        self.count = int(before.get("evals", 0))
        self.first: dict[str, Any] | None = before.get("first")
        self.last: dict[str, Any] | None = before.get("last")
        self.best: dict[str, Any] | None = before.get("best")

    def add(self, result: EvalResult) -> dict[str, Any]:
        record = eval_record(result)
        self.count += 1
        self.first = self.first or record
        self.last = record
        if self.best is None or _headline(record) > _headline(self.best):
            self.best = record
        return record

    def summary(self) -> dict[str, Any]:
        return {"evals": self.count, "first": self.first, "last": self.last, "best": self.best}


def _headline(record: Mapping[str, Any]) -> float:
    value = record.get(HEADLINE)
    return float("-inf") if value is None else float(value)


def plot_evals(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """``eval.png``: the eval metrics against the policy version they were measured on,
    beside the training reward (``reward/mean``) of each step; None without eval rows."""
    evals = sorted((r for r in rows if is_eval_row(r)), key=lambda r: r["step"])
    if not evals:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    train = [(r["step"] + 1, r["reward/mean"]) for r in rows
             if not is_eval_row(r) and r.get("reward/mean") is not None]
    if train:
        # The row of step k trained the weights of version k + 1.
        ax.plot(*zip(*train, strict=True), color="lightgrey", linewidth=1, label="train reward/mean (after step)")
    keys = [k for k in (HEADLINE, "eval/greedy_reward", "eval/pass@1")
            if any(r.get(k) is not None for r in evals)]
    keys += sorted({k for r in evals for k in r if k.startswith("eval/pass@") and k not in keys},
                   key=lambda k: int(k.rsplit("@", 1)[1]))
    for key in keys:
        points = [(r["step"], r[key]) for r in evals if r.get(key) is not None]
        # Dashed: with rewards of 0 or 1 the mean reward and pass@1 are the same line.
        ax.plot(*zip(*points, strict=True), marker="o", markersize=3, label=key,
                linestyle="--" if key == HEADLINE else "-", zorder=3 if key == HEADLINE else 2)
    ax.set_xlabel("policy version (optimizer steps taken)")
    ax.set_ylabel("reward / pass rate")
    ax.set_title("held-out evaluation")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png", dpi=100)
    return path
