"""PPO against GRPO on the quickstart task: the task's correctness against trained samples.

Runs ``configs/quickstart.yaml`` (GRPO, the task's rule as the reward) and
``configs/ppo.yaml`` (PPO: the tiny reward model as the reward, a critic with GAE, KL in
the reward; the task's rule logged with weight 0 as ``reward/rule``) one after the other,
in this process through ``pipeline.launch.launch_run``, for the same number of steps; both
configs draw the same prompts (same task and seed) with the same samples per step, so the
curves share their x axis: trained samples. For each, per step: trained samples, the
task's correctness (GRPO: ``reward/mean``; PPO: ``reward/rule``) and, for PPO, the reward
model's score (``reward/mean``, what PPO maximises). Figures: correctness of the first and
last 10 steps, and the samples after which the 5-step moving average of the correctness
first reaches each of ``THRESHOLDS``. Nothing is timed against a bound; the wall times
are reported for reading. Writes ``bench/results/ppo_vs_grpo/`` (JSON and PNG).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import new_figure, note_config, publish_result
from bench.e2e import QUICKSTART, SMOOTH_STEPS, _attempt, first_time_reaching

PPO = QUICKSTART.parent / "ppo.yaml"
CONFIGS = {"grpo": (QUICKSTART, "reward/mean"), "ppo": (PPO, "reward/rule")}
THRESHOLDS = (0.1, 0.2, 0.5)
EDGE_STEPS = 10  # steps averaged for the first and last correctness


def samples_per_step(cfg: Any) -> int:
    return cfg.train.prompts_per_step * cfg.rollout.n


def run_config(name: str, steps: int, root: Path) -> dict[str, Any]:
    from pipeline.config import load_config
    from pipeline.launch import launch_run
    from pipeline.metrics import read_metrics

    path, correctness_key = CONFIGS[name]
    overrides = [f"run.dir={root / name}", f"run.steps={steps}", "run.progress=false",
                 "run.tensorboard=false", f"run.name=bench-ppo-vs-grpo-{name}"]
    cfg = load_config(path, overrides)
    note_config(cfg)
    t0 = time.time()
    summary = launch_run(cfg)
    total = time.time() - t0
    rows = read_metrics(cfg.run_dir)
    samples = [int(r["samples/trained"]) for r in rows]
    correct = [float(r[correctness_key]) for r in rows]
    curve = list(zip(samples, correct, strict=True))
    edge = min(EDGE_STEPS, len(correct))
    return {
        "system": name, "config": str(path), "overrides": overrides, "steps": summary["steps"],
        "samples_per_step": samples_per_step(cfg), "samples_trained": summary["samples"]["trained"],
        "samples_dropped": summary["samples"]["dropped"], "reconciles": summary["samples"]["reconciles"],
        "train_wall_s": summary["wall_s"], "total_s": total, "correctness_key": correctness_key,
        "correctness_first": float(np.mean(correct[:edge])), "correctness_final": float(np.mean(correct[-edge:])),
        "samples_to_correctness": {str(th): first_time_reaching(curve, th, SMOOTH_STEPS) for th in THRESHOLDS},
        "curve": {"samples": samples, "correctness": correct,
                  "reward": [float(r["reward/mean"]) for r in rows]},
    }


def _describe(row: dict[str, Any]) -> str:
    return (f"{row['samples_trained']} samples, correctness {row['correctness_first']:.3f} -> "
            f"{row['correctness_final']:.3f}, samples to thresholds {row['samples_to_correctness']}")


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    from pipeline.config import load_config

    grpo_cfg, ppo_cfg = load_config(QUICKSTART), load_config(PPO)
    if samples_per_step(grpo_cfg) != samples_per_step(ppo_cfg) or grpo_cfg.data != ppo_cfg.data:
        raise ValueError(f"{QUICKSTART.name} and {PPO.name} must share data and samples per step "
                         "(train.prompts_per_step x rollout.n) for their curves to share an axis")
    steps = 3 if quick else grpo_cfg.run.steps
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-ppo-vs-grpo-"))
    try:
        rows = {name: _attempt(name, run_config, name, steps, root, describe=_describe) for name in CONFIGS}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ok = all(r["status"] == "ok" for r in rows.values())
    ratios: dict[str, Any] = {}
    if ok:
        g, p = rows["grpo"], rows["ppo"]
        ratios = {"samples_each": g["samples_trained"],
                  "grpo_correctness_first": g["correctness_first"], "grpo_correctness_final": g["correctness_final"],
                  "ppo_correctness_first": p["correctness_first"], "ppo_correctness_final": p["correctness_final"],
                  "ppo_rm_score_first": float(np.mean(p["curve"]["reward"][:EDGE_STEPS])),
                  "ppo_rm_score_final": float(np.mean(p["curve"]["reward"][-EDGE_STEPS:])),
                  **{f"{k}_samples_to_correctness_{th}": rows[k]["samples_to_correctness"][str(th)]
                     for k in CONFIGS for th in THRESHOLDS},
                  "ppo_over_grpo_train_wall_s": p["train_wall_s"] / g["train_wall_s"]}
    payload = {
        "status": "ok" if ok else "error",
        "quick": quick,
        "units": "samples = trained completions (prompts x group size); correctness = the task's rule score in [0, 1]",
        "params": {"configs": {k: str(v[0]) for k, v in CONFIGS.items()}, "steps": steps,
                   "thresholds": list(THRESHOLDS), "smooth_steps": SMOOTH_STEPS, "edge_steps": EDGE_STEPS},
        "runs": rows,
        "ratios": ratios,
    }
    return publish_result(out_dir, "ppo_vs_grpo", payload, plot)


def plot(payload: dict[str, Any]) -> Any:
    fig, axes = new_figure(1, 2, size=(12, 4.5))
    ax, rm = axes[0][0], axes[0][1]
    for name, row in payload["runs"].items():
        if row.get("status") != "ok":
            continue
        xs, ys = np.asarray(row["curve"]["samples"]), np.asarray(row["curve"]["correctness"], dtype=float)
        ax.plot(xs, ys, linewidth=0.6, alpha=0.35)
        k = min(SMOOTH_STEPS, len(ys))
        smooth = np.convolve(ys, np.ones(k) / k, mode="valid")
        ax.plot(xs[k - 1:], smooth, linewidth=1.6, color=ax.lines[-1].get_color(),
                label=f"{name} ({row['correctness_key']})")
    ax.set_xlabel("trained samples")
    ax.set_ylabel("task correctness (per step; 5-step mean bold)")
    ax.set_title("quickstart task: PPO (reward model) vs GRPO (rule)")
    ax.legend(fontsize=8)
    ppo = payload["runs"].get("ppo", {})
    if ppo.get("status") == "ok":
        rm.plot(ppo["curve"]["samples"], ppo["curve"]["reward"], linewidth=1, color="tab:orange")
    rm.set_xlabel("trained samples")
    rm.set_ylabel("reward-model score (PPO's reward/mean)")
    rm.set_title("what PPO maximises")
    return fig
