"""Admission under tight memory budgets: the quickstart with and without protection.

Runs ``configs/quickstart.yaml`` (launched in this process by ``pipeline.launch.launch_run``,
``run.dir`` and ``run.steps`` overridden) side by side:

- ``unconstrained``: ``oom_protection: false`` in rollout, reference and train: no
  estimate, no split, no peak measurement; the baseline;
- ``protected-moderate``: work budgets of about half a micro-batch's estimate, so
  micro-batches split in two or three;
- ``protected-tight``: the end-to-end test's budgets, below a quarter of the estimate:
  every micro-batch of every stage splits down to single GRPO groups (vLLM generates a
  micro-batch as parts admitted one after another).

For each: steps, trained samples per s over the runner's wall time (its clock starts once
every actor is set up, so engine start-up is out), the total time, splits, deferrals and
OOM recoveries per stage, and whether the accounting reconciles; the ratios are each
protected run's samples per s over the unconstrained run's. On this CPU the tiny model never
comes near running out of memory, so the unprotected run is the throughput baseline, not
a crash: the figure is the price of splitting. Writes ``bench/results/admission/`` (JSON and PNG).
"""

from __future__ import annotations

import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.common import new_figure, note_config, publish_result

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"
STAGES = ("rollout", "reference", "trainer")
SECTIONS = {"rollout": "rollout", "reference": "reference", "trainer": "train"}
# Work budgets (bytes) per stage. A quickstart micro-batch (4 prompts x 8 samples) is
# estimated at about 650 KB of KV cache, 2.9 MB for the reference forward and 5.6 MB for
# the trainer's; on CPU the calibration may shrink the latter two to a quarter.
BUDGETS: dict[str, dict[str, int] | None] = {
    "unconstrained": None,
    "protected-moderate": {"rollout": 400_000, "reference": 1_000_000, "trainer": 2_000_000},
    "protected-tight": {"rollout": 170_000, "reference": 262_144, "trainer": 524_288},
}


def build_overrides(name: str, steps: int, root: Path) -> list[str]:
    """The command-line overrides of one run."""
    out = [f"run.dir={root / name}", f"run.steps={steps}", "run.progress=false", "run.tensorboard=false",
           "train.save_checkpoint=false", f"run.name=bench-admission-{name}"]
    budgets = BUDGETS[name]
    for stage in STAGES:
        section = SECTIONS[stage]
        if budgets is None:
            out.append(f"{section}.memory.oom_protection=false")
        else:
            out.append(f"{section}.memory.budget_bytes={budgets[stage]}")
    return out


def run_one(name: str, steps: int, root: Path) -> dict[str, Any]:
    from pipeline.config import load_config
    from pipeline.launch import launch_run

    overrides = build_overrides(name, steps, root)
    cfg = load_config(QUICKSTART, overrides)
    note_config(cfg)
    t0 = time.time()
    summary = launch_run(cfg)
    total = time.time() - t0
    trained = summary["samples"]["trained"]
    admission = summary.get("admission", {})
    return {
        "run": name, "overrides": overrides, "budgets": BUDGETS[name], "steps": summary["steps"],
        "train_wall_s": summary["wall_s"], "total_s": total, "samples_trained": trained,
        "samples_dropped": summary["samples"]["dropped"], "reconciles": summary["samples"]["reconciles"],
        "samples_per_s": trained / summary["wall_s"] if summary["wall_s"] > 0 else None,
        "reward_last": summary.get("reward_last"),
        "per_stage": {s: {k: admission.get(s, {}).get(k) for k in
                          ("admission/splits", "admission/deferred", "admission/admitted", "oom/recovered",
                           "admission/calibration")} for s in STAGES},
    }


def _attempt(name: str, steps: int, root: Path) -> dict[str, Any]:
    """One run; a failure becomes a row that says why, so the others still report."""
    try:
        row = run_one(name, steps, root)
        row["status"] = "ok"
        print(f"{name}: {row['samples_per_s']:.1f} samples per s, splits "
              f"{ {s: row['per_stage'][s]['admission/splits'] for s in STAGES} }", flush=True)
    except Exception as exc:
        row = {"run": name, "status": "error", "error": f"{type(exc).__name__}: {exc}",
               "traceback": traceback.format_exc()[-4000:]}
        print(f"{name}: {row['error']}", flush=True)
    return row


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    steps = 3 if quick else 40
    names = ["unconstrained", "protected-tight"] if quick else list(BUDGETS)
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-admission-"))
    try:
        rows = {name: _attempt(name, steps, root) for name in names}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = rows["unconstrained"]
    ratios: dict[str, Any] = {"unconstrained_samples_per_s": base.get("samples_per_s")}
    for name, row in rows.items():
        if name == "unconstrained":
            continue
        key = name.replace("-", "_")
        ratios[f"{key}_samples_per_s"] = row.get("samples_per_s")
        ok = row.get("status") == "ok" and base.get("status") == "ok" and base.get("samples_per_s")
        ratios[f"{key}_over_unconstrained"] = row["samples_per_s"] / base["samples_per_s"] if ok else None
        ratios[f"{key}_completed_and_reconciles"] = bool(
            row.get("status") == "ok" and row.get("reconciles") and row.get("steps") == steps)
    status = "ok" if all(r.get("status") == "ok" for r in rows.values()) else "error"
    payload = {
        "status": status,
        "quick": quick,
        "units": "samples = completions (prompts x group size); seconds; budgets in bytes of work per stage",
        "params": {"config": str(QUICKSTART), "steps": steps, "budgets": {n: BUDGETS[n] for n in names},
                   "note": "ratios < 1: the cost of splitting under the budget"},
        "runs": rows,
        "ratios": ratios,
    }
    return publish_result(out_dir, "admission", payload, plot)


def plot(payload: dict[str, Any]) -> Any:
    fig, axes = new_figure(1, 2, size=(12, 4.5))
    runs = [r for r in payload["runs"].values() if r.get("status") == "ok"]
    ax = axes[0][0]
    bars = ax.bar([r["run"] for r in runs], [r["samples_per_s"] or 0.0 for r in runs], color="#2ca02c")
    base = payload["runs"].get("unconstrained", {}).get("samples_per_s")
    if base:
        ax.bar_label(bars, [f"x{(r['samples_per_s'] or 0.0) / base:.2f}" for r in runs])
    ax.set_ylabel("trained samples / s (after start-up)")
    ax.set_title(f"quickstart, {payload['params']['steps']} steps")
    ax = axes[0][1]
    width = 0.8 / max(1, len(runs))
    for i, r in enumerate(runs):
        xs = [k + i * width for k in range(len(STAGES))]
        ax.bar(xs, [r["per_stage"][s]["admission/splits"] or 0 for s in STAGES], width, label=r["run"])
    ax.set_xticks([k + width * (len(runs) - 1) / 2 for k in range(len(STAGES))], list(STAGES))
    ax.set_ylabel("split decisions (whole run)")
    ax.set_title("admission splits per stage")
    ax.legend(fontsize=8)
    return fig
