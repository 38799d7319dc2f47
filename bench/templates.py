"""The learning trend of each template that teaches something new: dpo, tool_rl, curriculum.

Each template is written with ``conveyor init`` into a fresh directory and launched from
there through the command line, as its first line says, one after the other in this
process, for its benchmark steps (``STEPS``; ``--quick``: a few). From each run's step
metrics:
- dpo: preference accuracy and reward margin (chosen minus rejected implicit reward),
  mean of the first ``EDGE_STEPS`` steps after step 0 (at step 0 the policy is the
  reference: both are 0 by definition) and of the last ``EDGE_STEPS`` steps;
- tool_rl: reward, tool-use rate (``tool/used``: samples with a call), calls answered
  without an error, right tool answers, final answers taken from the tool and right final
  answers, first and last steps;
- curriculum: the levels reached and the step of each promotion.
``trends`` says whether each rose as the issue asks (DPO accuracy rises; tool_rl reward,
the share of calls answered without an error and the share of final answers taken from
the tool rise: the prompts open every call, so the tool-use rate alone is above zero by
construction; curriculum advances at least two levels); nothing is timed against a
bound, wall times are reported for reading. Writes ``bench/results/templates/`` (JSON
and PNG); ``summarise_runs`` derives every summary from the stored series.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import new_figure, publish_result

STEPS = {"dpo": 60, "tool_rl": 300, "curriculum": 400}
EDGE_STEPS = 10
SERIES = {
    "dpo": ("actor/preference_accuracy", "actor/reward_margin", "actor/loss"),
    "tool_rl": ("reward/mean", "tool/used", "tool/calls", "tool/errors", "reward/tool_correct",
                "reward/answer_from_tool", "reward/answer_correct", "tool/calc/calls", "tool/python/calls",
                "tool/turns"),
    "curriculum": ("curriculum/level", "curriculum/promotions", "reward/mean"),
}


def launch_template(name: str, steps: int, root: Path) -> dict[str, Any]:
    """``conveyor init --template name`` + ``conveyor launch`` from its directory; the
    per-step series of ``SERIES[name]`` and the run's wall time."""
    from pipeline.cli import main
    from pipeline.metrics import read_metrics

    job = root / name
    if main(["init", "--template", name, str(job)]) != 0:
        raise RuntimeError(f"conveyor init --template {name} failed")
    run_dir = job / "runs" / name
    cwd = os.getcwd()
    os.chdir(job)
    t0 = time.time()
    try:
        status = main(["launch", "--config", "config.yaml", f"run.steps={steps}", f"run.dir={run_dir}",
                       "run.progress=false", "run.tensorboard=false"])
    finally:
        os.chdir(cwd)
    if status != 0:
        raise RuntimeError(f"conveyor launch of template {name} exited {status}")
    rows = read_metrics(run_dir / "metrics.jsonl")
    series = {key: [float(r[key]) if key in r else float("nan") for r in rows] for key in SERIES[name]}
    return {"template": name, "steps": len(rows), "wall_s": time.time() - t0, "series": series}


def _edges(values: list[float], edge: int) -> tuple[float, float]:
    arr = np.asarray(values, dtype=np.float64)
    return float(np.nanmean(arr[:edge])), float(np.nanmean(arr[-edge:]))


def summarise_dpo(run: dict[str, Any], edge: int) -> dict[str, float]:
    s = run["series"]
    acc = _edges(s["actor/preference_accuracy"][1:], edge)  # step 0: the policy is the reference
    margin = _edges(s["actor/reward_margin"][1:], edge)
    return {"accuracy_first": acc[0], "accuracy_last": acc[1], "margin_first": margin[0], "margin_last": margin[1]}


def _ok_frac(calls: np.ndarray, errors: np.ndarray) -> float:
    """The share of calls answered without an error (0 without calls)."""
    return float(1.0 - errors.sum() / calls.sum()) if calls.sum() else 0.0


def summarise_tool_rl(run: dict[str, Any], edge: int) -> dict[str, float]:
    s = run["series"]
    out: dict[str, float] = {}
    for key, label in (("reward/mean", "reward"), ("tool/used", "tool_use_rate"), ("reward/tool_correct", "tool_correct"),
                       ("reward/answer_from_tool", "answer_from_tool"), ("reward/answer_correct", "answer_correct")):
        out[f"{label}_first"], out[f"{label}_last"] = _edges(s[key], edge)
    calls, errors = np.asarray(s["tool/calls"]), np.asarray(s["tool/errors"])
    out["calls_ok_frac_first"] = _ok_frac(calls[:edge], errors[:edge])
    out["calls_ok_frac_last"] = _ok_frac(calls[-edge:], errors[-edge:])
    out["tool_use_rate_max"] = float(np.nanmax(s["tool/used"]))
    return out


def summarise_curriculum(run: dict[str, Any]) -> dict[str, Any]:
    levels = run["series"]["curriculum/level"]
    promotions = run["series"]["curriculum/promotions"]
    moves = [i for i in range(1, len(promotions)) if promotions[i] > promotions[i - 1]]
    first = [0] if promotions and promotions[0] > 0 else []
    return {"level_first": levels[0], "level_last": levels[-1], "promotions": promotions[-1],
            "promotion_steps": first + moves}


def summarise_runs(series: dict[str, dict[str, list[float]]], edge: int) -> dict[str, Any]:
    """The payload's summaries (``dpo``, ``tool_rl``, ``curriculum``, ``trends``,
    ``ratios``) from each template's per-step series alone."""
    dpo, tool, cur = (summarise_dpo({"series": series["dpo"]}, edge),
                      summarise_tool_rl({"series": series["tool_rl"]}, edge),
                      summarise_curriculum({"series": series["curriculum"]}))
    trends = {
        "dpo_accuracy_rises": dpo["accuracy_last"] > dpo["accuracy_first"],
        "tool_rl_reward_rises": tool["reward_last"] > tool["reward_first"],
        "tool_rl_calls_ok_rises": tool["calls_ok_frac_last"] > tool["calls_ok_frac_first"],
        "tool_rl_answer_from_tool_rises": tool["answer_from_tool_last"] > tool["answer_from_tool_first"],
        "curriculum_advances_two_levels": cur["promotions"] >= 2,
    }
    ratios = {
        "dpo accuracy first (after step 0) -> last": f"{dpo['accuracy_first']:.3f} -> {dpo['accuracy_last']:.3f}",
        "dpo margin first (after step 0) -> last": f"{dpo['margin_first']:.3f} -> {dpo['margin_last']:.3f}",
        "tool_rl reward first -> last": f"{tool['reward_first']:.3f} -> {tool['reward_last']:.3f}",
        "tool_rl tool use first -> last": f"{tool['tool_use_rate_first']:.3f} -> {tool['tool_use_rate_last']:.3f}",
        "tool_rl calls without error first -> last":
            f"{tool['calls_ok_frac_first']:.3f} -> {tool['calls_ok_frac_last']:.3f}",
        "tool_rl answer = tool's first -> last":
            f"{tool['answer_from_tool_first']:.3f} -> {tool['answer_from_tool_last']:.3f}",
        "tool_rl right answers first -> last": f"{tool['answer_correct_first']:.3f} -> {tool['answer_correct_last']:.3f}",
        "curriculum level first -> last": f"{cur['level_first']:.0f} -> {cur['level_last']:.0f} "
                                          f"(promotions at steps {cur['promotion_steps']})",
        **{k: str(v) for k, v in trends.items()},
    }
    return {"dpo": dpo, "tool_rl": tool, "curriculum": cur, "trends": trends, "ratios": ratios}


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    steps = {name: 4 for name in STEPS} if quick else dict(STEPS)
    edge = 2 if quick else EDGE_STEPS
    root = Path(tempfile.mkdtemp(prefix="bench-templates-"))
    try:
        runs = {name: launch_template(name, n, root) for name, n in steps.items()}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    payload = {"quick": quick, "steps": steps, "edge_steps": edge,
               **summarise_runs({name: r["series"] for name, r in runs.items()}, edge),
               "wall_s": {name: r["wall_s"] for name, r in runs.items()},
               "series": {name: r["series"] for name, r in runs.items()}}
    return publish_result(out_dir, "templates", payload, plot)


def plot(payload: dict[str, Any]) -> Any:
    fig, axes = new_figure(1, 3, size=(15.0, 4.2))
    s = payload["series"]
    ax = axes[0][0]
    ax.plot(s["dpo"]["actor/preference_accuracy"], label="preference accuracy")
    ax.plot(s["dpo"]["actor/reward_margin"], label="reward margin")
    ax.set_title("dpo")
    ax = axes[0][1]
    for key in ("reward/mean", "tool/used", "reward/answer_from_tool", "reward/answer_correct"):
        ax.plot(s["tool_rl"][key], label=key)
    ax.set_title("tool_rl")
    ax = axes[0][2]
    ax.plot(s["curriculum"]["curriculum/level"], label="level")
    ax.plot(s["curriculum"]["reward/mean"], label="reward/mean")
    ax.set_title("curriculum")
    for ax in axes[0]:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    return fig
