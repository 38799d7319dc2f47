"""Staleness study: how much off-policy-ness the quickstart task tolerates, with and
without off-policy correction (the way AReaL reports its staleness sweep).

Runs the quickstart (``configs/quickstart.yaml``, launched in this process by
``pipeline.launch.launch_run``, every run with the same seed, steps and data) as:

- ``sync``: lock-step, η = 0 (``dataflow.async_execution=false``): exactly on-policy,
  the baseline;
- streaming with ``dataflow.max_staleness`` η in ``ETAS``, each with
  ``algorithm.off_policy=off`` (PPO ratio against the sampler) and ``truncate``
  (decoupled objective, importance weights truncated at ``behav_imp_weight_cap``);
- at η ``EPOCH_ETA`` with ``train.ppo_epochs`` 2, the decoupled corrections
  (``truncate``, ``reject``): the second epoch's ratio is anchored on the first pass's
  log-probs, so its clip bounds the drift within the step (``later_epochs_*``).

For each run: the reward curve against trained samples and against wall time, the
final reward (mean of the last 10 steps), the samples and seconds until the reward's
``SMOOTH_STEPS``-step moving average first reaches each of ``REWARD_THRESHOLDS``, the
mean and max staleness actually trained on, the samples dropped as stale, and the
importance-weight statistics. One seed per configuration: differences of a few
hundredths in final reward are within run-to-run noise. Writes ``bench/results/staleness/`` (JSON
and PNG).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import new_figure, note_config, publish_result
from bench.e2e import SMOOTH_STEPS, _attempt, summarize_curve

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"
ETAS = (0, 1, 2, 4)
CORRECTIONS = ("off", "truncate")
EPOCH_ETA, EPOCH_CORRECTIONS, EPOCHS = 2, ("truncate", "reject"), 2
REWARD_THRESHOLDS = (0.2, 0.5)


def first_samples_reaching(curve: list[tuple[int, float]], threshold: float, window: int) -> int | None:
    """Trained samples at the first step where the mean of the last ``window`` rewards >= threshold."""
    vals: list[float] = []
    for samples, r in curve:
        vals.append(r)
        if len(vals) >= window and float(np.mean(vals[-window:])) >= threshold:
            return samples
    return None


def build_cases(quick: bool) -> list[dict[str, Any]]:
    """(name, overrides) of every run: the lock-step baseline, then η x correction."""
    cases = [{"name": "sync", "eta": 0, "off_policy": "off", "ppo_epochs": 1,
              "overrides": ["dataflow.async_execution=false", "dataflow.max_staleness=0"]}]
    etas, corrections = ((2,), ("truncate",)) if quick else (ETAS, CORRECTIONS)
    runs = [(eta, corr, 1) for eta in etas for corr in corrections]
    runs += [(EPOCH_ETA, corr, EPOCHS) for corr in (EPOCH_CORRECTIONS[:1] if quick else EPOCH_CORRECTIONS)]
    for eta, corr, epochs in runs:
        cases.append({"name": f"eta{eta}-{corr}" + (f"-epochs{epochs}" if epochs > 1 else ""), "eta": eta,
                      "off_policy": corr, "ppo_epochs": epochs,
                      "overrides": ["dataflow.async_execution=true", f"dataflow.max_staleness={eta}",
                                    # quoted: YAML reads a bare off as false
                                    f"algorithm.off_policy='{corr}'", f"train.ppo_epochs={epochs}"]})
    return cases


def run_case(case: dict[str, Any], steps: int, root: Path, extra: list[str]) -> dict[str, Any]:
    from pipeline.config import load_config
    from pipeline.launch import launch_run
    from pipeline.metrics import read_metrics

    overrides = [f"run.dir={root / case['name']}", f"run.steps={steps}", "run.progress=false",
                 "run.tensorboard=false", f"run.name=bench-staleness-{case['name']}", *case["overrides"], *extra]
    cfg = load_config(QUICKSTART, overrides)
    note_config(cfg)
    t0 = time.time()
    summary = launch_run(cfg)
    total = time.time() - t0
    rows = read_metrics(cfg.run_dir)
    per_step = cfg.train.prompts_per_step * cfg.rollout.n
    by_samples = [((i + 1) * per_step, float(r["reward/mean"])) for i, r in enumerate(rows) if "reward/mean" in r]
    trained = summary["samples"]["trained"]
    out = {
        "system": case["name"], "eta": case["eta"], "off_policy": case["off_policy"],
        "ppo_epochs": case["ppo_epochs"], "overrides": overrides,
        "steps": summary["steps"], "train_wall_s": summary["wall_s"], "total_s": total,
        "samples_trained": trained, "samples_dropped": summary["samples"]["dropped"],
        "samples_per_s": trained / summary["wall_s"] if summary["wall_s"] else None,
        "staleness_mean": float(np.mean([r["staleness/mean"] for r in rows])) if rows else None,
        "staleness_max": int(max(r["staleness/max"] for r in rows)) if rows else None,
        "is_weight_mean": float(np.mean([r.get("actor/is_weight_mean", 1.0) for r in rows])) if rows else None,
        "is_weight_capped_frac": float(np.mean([r.get("actor/is_weight_capped_frac", 0.0) for r in rows]))
        if rows else None,
        # The later PPO epochs' ratio and clip (their anchor: the step's first pass); None with one epoch.
        **{key: (float(np.mean([r[f"actor/{key}"] for r in rows]))
                 if rows and all(f"actor/{key}" in r for r in rows) else None)
           for key in ("later_epochs_ratio_mean", "later_epochs_clip_frac")},
        "samples_to_threshold": {str(th): first_samples_reaching(by_samples, th, SMOOTH_STEPS)
                                 for th in REWARD_THRESHOLDS},
        "curve_samples": [[s, r] for s, r in by_samples],
        **summarize_curve([(row["time"] - t0, row.get("reward/mean")) for row in rows]),
    }
    # summarize_curve's thresholds are the e2e benchmark's; keep this study's only.
    out["time_to_threshold_s"] = {str(th): _first_time(out["curve"], th) for th in REWARD_THRESHOLDS}
    out.pop("time_to_threshold_after_first_step_s", None)
    return out


def _first_time(curve: list[list[Any]], threshold: float) -> float | None:
    from bench.e2e import first_time_reaching

    return first_time_reaching([(t, r) for t, r in curve], threshold, SMOOTH_STEPS)


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    from pipeline.config import load_config

    steps = 3 if quick else load_config(QUICKSTART).run.steps
    # Quick: the HF backend starts in seconds where vLLM takes most of a minute.
    extra = ["rollout.backend=hf", "train.save_checkpoint=false", "train.checkpoint_every=0"] if quick else []
    cases = build_cases(quick)
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-staleness-"))
    try:
        rows = {c["name"]: _attempt(c["name"], run_case, c, steps, root, extra) for c in cases}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = rows["sync"]
    ratios: dict[str, Any] = {}
    for name, row in rows.items():
        if row.get("status") != "ok":
            ratios[f"{name}_reward_final"] = None
            continue
        ratios[f"{name}_reward_final"] = row["reward_final"]
        if name != "sync" and base.get("status") == "ok":
            ratios[f"{name}_minus_sync_reward_final"] = row["reward_final"] - base["reward_final"]
            ratios[f"{name}_over_sync_samples_per_s"] = row["samples_per_s"] / base["samples_per_s"]
    status = "ok" if all(r.get("status") == "ok" for r in rows.values()) else "error"
    payload = {
        "status": status,
        "quick": quick,
        "units": "samples = completions (prompts x group size); seconds",
        "params": {"config": str(QUICKSTART), "steps": steps, "etas": list(ETAS), "corrections": list(CORRECTIONS),
                   "epoch_runs": {"eta": EPOCH_ETA, "corrections": list(EPOCH_CORRECTIONS), "ppo_epochs": EPOCHS},
                   "reward_thresholds": list(REWARD_THRESHOLDS), "smooth_steps": SMOOTH_STEPS, "extra": extra,
                   "note": "one seed per configuration; reward_final = mean reward of the last 10 steps"},
        "runs": rows,
        "table": build_table(rows),
        "ratios": ratios,
    }
    return publish_result(out_dir, "staleness", payload, plot)


def build_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown rows (the README's table): one per run."""
    lines = ["| run | η | correction | final reward | samples to 0.5 | s to 0.5 | staleness mean | dropped stale |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        if r.get("status") != "ok":
            lines.append(f"| {name} | | | {r.get('status')}: {r.get('error', '')[:60]} | | | | |")
            continue
        s05 = r["samples_to_threshold"].get("0.5")
        t05 = r["time_to_threshold_s"].get("0.5")
        lines.append(
            f"| {name} | {r['eta']} | {r['off_policy']} | {r['reward_final']:.2f} | "
            f"{'-' if s05 is None else f'{s05:,}'} | {'-' if t05 is None else f'{t05:.0f}'} | "
            f"{r['staleness_mean']:.2f} | {r['samples_dropped'].get('stale', 0)} |")
    return lines


def plot(payload: dict[str, Any]) -> Any:
    fig, axes = new_figure(1, 2, size=(13, 4.8))
    styles = {"off": "--", "truncate": "-", "reject": "-."}
    for row in payload["runs"].values():
        if row.get("status") != "ok" or not row.get("curve_samples"):
            continue
        style = ":" if row["system"] == "sync" else styles[row["off_policy"]]
        colour = "black" if row["system"] == "sync" else f"C{ETAS.index(row['eta'])}"
        samples, rewards = np.array(row["curve_samples"], dtype=float).T
        width = 2.2 if row.get("ppo_epochs", 1) > 1 else 1.2  # thick: two PPO epochs
        axes[0][0].plot(samples, _smooth(rewards), style, color=colour, label=row["system"], linewidth=width)
        ts = np.array([t for t, r in row["curve"] if r is not None], dtype=float)
        axes[0][1].plot(ts, _smooth(rewards[: len(ts)]), style, color=colour, label=row["system"], linewidth=width)
    axes[0][0].set_xlabel("trained samples")
    axes[0][1].set_xlabel("seconds since launch (start-up included)")
    for ax in axes[0]:
        ax.set_ylabel(f"mean reward ({SMOOTH_STEPS}-step moving average)")
        ax.legend(fontsize=7, ncol=2)
    axes[0][0].set_title("quickstart: reward vs samples (dashed: no correction, solid: truncate, dash-dot: "
                         "reject; thick: 2 PPO epochs)")
    axes[0][1].set_title("reward vs wall time")
    return fig


def _smooth(values: np.ndarray) -> np.ndarray:
    out = np.empty_like(values)
    for i in range(len(values)):
        out[i] = values[max(0, i - SMOOTH_STEPS + 1): i + 1].mean()
    return out
