"""End to end: the quickstart job, streaming vs lock-step, and against TRL's GRPOTrainer.

Measures, for the quickstart (``configs/quickstart.yaml``, launched in this process by
``pipeline.launch.launch_run`` with ``run.dir`` and ``run.steps`` overridden):

- async (the file as it is: ``dataflow.async_execution: true``, its ``max_staleness``);
- sync, the baseline measured in the same run (``dataflow.async_execution=false``,
  ``dataflow.max_staleness=0``: exactly on-policy lock-step);
- TRL's ``GRPOTrainer`` (transformers ``generate`` for rollouts, on the same CPU), with
  the same model (``stages.models.tiny.ensure_tiny_checkpoint``), prompts (the task's rows for
  ``run.seed``), group size, completion length, temperature, learning rate, KL
  coefficient, clip, grad clip, token-mean loss and number of optimizer steps;

and for each: trained samples per s over the training wall time (Conveyor's runner clock
starts after every actor's setup; TRL's at ``train()``), the total time including
start-up, the wall time from launch until the reward's 5-step moving average first
reaches each of ``REWARD_THRESHOLDS`` (also counted from the first logged step, start-up
set aside), and the final reward (mean of the last 10 steps). Ratios are
reported whatever they are. Writes ``bench/results/e2e/`` (JSON and PNG).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import new_figure, note_config, publish_result, vllm_compile_cache_entries

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.yaml"
REWARD_THRESHOLDS = (0.05, 0.1, 0.2, 0.5)  # several: a short or slow run still compares at the low ones
SMOOTH_STEPS = 5


def first_time_reaching(curve: list[tuple[float, float | None]], threshold: float, window: int) -> float | None:
    """Seconds of the first point where the mean of the last ``window`` rewards >= threshold."""
    vals: list[float] = []
    for t, r in curve:
        if r is None:
            continue
        vals.append(r)
        if len(vals) >= window and float(np.mean(vals[-window:])) >= threshold:
            return t
    return None


def summarize_curve(curve: list[tuple[float, float | None]]) -> dict[str, Any]:
    """Reward figures of a run; times from launch, and from its first logged step (so
    start-up, where the systems differ most, can be set aside)."""
    rewards = [r for _, r in curve if r is not None]
    reached = {str(th): first_time_reaching(curve, th, SMOOTH_STEPS) for th in REWARD_THRESHOLDS}
    first = curve[0][0] if curve else 0.0
    return {
        "reward_first": rewards[0] if rewards else None,
        "reward_final": float(np.mean(rewards[-10:])) if rewards else None,
        "time_to_threshold_s": reached,
        "time_to_threshold_after_first_step_s": {k: None if v is None else v - first for k, v in reached.items()},
        "curve": [[round(t, 3), r] for t, r in curve],
    }


def run_conveyor(mode: str, steps: int, root: Path) -> dict[str, Any]:
    from pipeline.config import load_config
    from pipeline.launch import launch_run
    from pipeline.metrics import read_metrics

    overrides = [f"run.dir={root / mode}", f"run.steps={steps}", "run.progress=false", f"run.name=bench-e2e-{mode}"]
    if mode == "sync":
        overrides += ["dataflow.async_execution=false", "dataflow.max_staleness=0"]
    cfg = load_config(QUICKSTART, overrides)
    note_config(cfg)
    t0 = time.time()
    summary = launch_run(cfg)
    total = time.time() - t0
    rows = read_metrics(cfg.run_dir)
    trained = summary["samples"]["trained"]
    return {
        "system": f"conveyor-{mode}", "overrides": overrides, "steps": summary["steps"],
        "train_wall_s": summary["wall_s"], "total_s": total, "samples_trained": trained,
        "samples_dropped": summary["samples"]["dropped"], "samples_per_s": trained / summary["wall_s"],
        "samples_per_s_total": trained / total,
        **summarize_curve([(row["time"] - t0, row.get("reward/mean")) for row in rows]),
    }


def run_trl(steps: int, root: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.config import load_config
    from stages.data.tasks import load_task
    from stages.models.tiny import resolve_model_path

    t0 = time.time()
    cfg = load_config(QUICKSTART)
    note_config(cfg, "trl")
    path = resolve_model_path(cfg.model)
    task = load_task(cfg.data.task, **cfg.data.task_kwargs)
    per_step = cfg.train.prompts_per_step
    rows = task.generate_rows(cfg.run.seed, steps * per_step)
    data = build_trl_dataset(rows)

    def reward(prompts: list[str], completions: list[str], ground_truth: list[str], data_source: list[str],
               **_: Any) -> list[float]:
        return [float(task.compute_score(ds, c, gt)) for c, gt, ds in zip(completions, ground_truth, data_source, strict=True)]

    curve: list[tuple[float, float | None]] = []

    class Record(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                curve.append((time.time() - t0, float(logs["reward"])))

    n = cfg.rollout.n
    args = GRPOConfig(**build_trl_args(cfg, root, steps), use_cpu=True, bf16=False,
                      model_init_kwargs={"dtype": torch.float32})
    trainer = GRPOTrainer(model=str(path), reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(path), callbacks=[Record()])
    t_train = time.time()
    trainer.train()
    train_wall = time.time() - t_train
    total = time.time() - t0
    trained = trainer.state.global_step * per_step * n
    return {
        "system": "trl-grpo", "trl_version": _version("trl"), "steps": trainer.state.global_step,
        "train_wall_s": train_wall, "total_s": total, "samples_trained": trained, "samples_dropped": {},
        "samples_per_s": trained / train_wall, "samples_per_s_total": trained / total, **summarize_curve(curve),
    }


def _version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _describe_run(row: dict[str, Any]) -> str:
    return (f"{row['samples_per_s']:.1f} samples per s, final reward {row['reward_final']}, "
            f"time to thresholds {row['time_to_threshold_s']}")


def _attempt(name: str, fn: Any, *args: Any, describe: Any = _describe_run) -> dict[str, Any]:
    """Run one system; a failure becomes a row that says why, so the others still report.
    ``describe(row)`` is the console line of a run that succeeded."""
    load_before = os.getloadavg()[0]
    compiled_before = vllm_compile_cache_entries()
    try:
        row = fn(*args)
        row["status"] = "ok"
        # TRL runs in one process whose torch threads stall on a busy shared machine;
        # the load around each run says how much a figure can be trusted.
        row["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
        # Start-up figures compare only where both rows compiled cold, or both did not.
        row["vllm_compile_cache_entries_added"] = len(vllm_compile_cache_entries() - compiled_before)
    except Exception as exc:
        row = {"system": name, "status": "error", "error": f"{type(exc).__name__}: {exc}",
               "traceback": _clip(traceback.format_exc())}
    print(f"{name}: {_console_line(row, describe)}", flush=True)
    return row


def _console_line(row: dict[str, Any], describe: Any) -> str:
    """A row's console line; a ``describe`` that fails on it costs the line, not the
    row (a benchmark's other rows and its result file still come)."""
    if row["status"] != "ok":
        return row["error"]
    try:
        return describe(row)
    except Exception as exc:  # the row was measured: only its line is lost
        return f"ok ({type(exc).__name__} describing it: {exc})"


def _clip(text: str, head: int = 1500, tail: int = 3000) -> str:
    """A long traceback's first and last frames (where it began and where it failed)."""
    return text if len(text) <= head + tail else f"{text[:head]}\n[...]\n{text[-tail:]}"


def build_trl_dataset(rows: list[dict[str, Any]]) -> Any:
    """The task's rows as the ``datasets.Dataset`` TRL trains on, with a fingerprint of
    their content given rather than computed.

    ``datasets`` otherwise fingerprints a new dataset by pickling its whole state with
    dill, pyarrow's internals included; with Python 3.12 and pyarrow 21 that fails (a
    Cython-made class that pickles as ``builtins.MonthDayNano``, then a recursion without
    end in dill's global-variable walk) and takes TRL's run down before it starts."""
    import hashlib
    import json

    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable

    table = [{"prompt": r["prompt"], "ground_truth": str(r["ground_truth"]), "data_source": r["data_source"]}
             for r in rows]
    digest = hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()[:16]
    return Dataset(InMemoryTable(pa.Table.from_pylist(table)), fingerprint=digest)


def build_trl_args(cfg: Any, root: Path, steps: int) -> dict[str, Any]:
    """``GRPOConfig`` keywords for TRL's run of a Conveyor config (same group size,
    sampling, optimiser and loss); the caller adds the device's (CPU, bf16, vLLM)."""
    ro, alg, tr = cfg.rollout, cfg.algorithm, cfg.train
    return dict(
        output_dir=str(root / "trl"), per_device_train_batch_size=tr.prompts_per_step * ro.n,
        gradient_accumulation_steps=1, num_generations=ro.n, max_completion_length=ro.max_tokens,
        temperature=ro.temperature, top_p=ro.top_p, learning_rate=tr.lr, weight_decay=tr.weight_decay,
        max_grad_norm=tr.grad_clip, lr_scheduler_type="constant", warmup_steps=0, beta=alg.kl_coef,
        epsilon=alg.clip_eps_low, epsilon_high=alg.clip_eps_high, loss_type="dapo",
        scale_rewards="group" if alg.norm_adv_by_std else "none", num_iterations=1, max_steps=steps,
        logging_steps=1, report_to="none", save_strategy="no", seed=cfg.run.seed, shuffle_dataset=False,
        dataloader_num_workers=0, disable_dropout=True, log_completions=False,
        gradient_checkpointing=tr.gradient_checkpointing,
    )


def run_three_systems(run_conveyor: Any, run_trl: Any, steps: int, prefix: str) -> dict[str, dict[str, Any]]:
    """Conveyor async and sync and TRL on the same job, one after the other, each in a
    fresh temporary directory; a failing system is a row with its error."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        rows = {mode: _attempt(f"conveyor-{mode}", run_conveyor, mode, steps, root) for mode in ("async", "sync")}
        rows["trl"] = (_attempt("trl-grpo", run_trl, steps, root) if _version("trl")
                       else {"system": "trl-grpo", "status": "skipped", "error": "trl is not installed"})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    from pipeline.config import load_config

    steps = 3 if quick else load_config(QUICKSTART).run.steps
    rows = run_three_systems(run_conveyor, run_trl, steps, "conveyor-bench-e2e-")

    def ratio(a: str, b: str, key: str, invert: bool = False, threshold: float | None = None) -> float | None:
        ra, rb = rows[a], rows[b]
        if ra.get("status") != "ok" or rb.get("status") != "ok":
            return None
        va, vb = ra.get(key), rb.get(key)
        if threshold is not None:
            va, vb = (va or {}).get(str(threshold)), (vb or {}).get(str(threshold))
        if va is None or vb is None or (va if invert else vb) == 0:
            return None
        return vb / va if invert else va / vb

    ratios = {
        "async_samples_per_s": rows["async"].get("samples_per_s"),
        "sync_samples_per_s": rows["sync"].get("samples_per_s"),
        "trl_samples_per_s": rows["trl"].get("samples_per_s"),
        "async_over_sync_samples_per_s": ratio("async", "sync", "samples_per_s"),
        "async_over_trl_samples_per_s": ratio("async", "trl", "samples_per_s"),
        "async_over_sync_total_time": ratio("async", "sync", "total_s", invert=True),
        "async_over_trl_total_time": ratio("async", "trl", "total_s", invert=True),
        **{f"async_over_sync_time_to_reward_{th}": ratio("async", "sync", "time_to_threshold_s", True, th)
           for th in REWARD_THRESHOLDS},
        **{f"async_over_trl_time_to_reward_{th}": ratio("async", "trl", "time_to_threshold_s", True, th)
           for th in REWARD_THRESHOLDS},
        **{f"async_over_trl_time_to_reward_{th}_after_first_step":
           ratio("async", "trl", "time_to_threshold_after_first_step_s", True, th) for th in REWARD_THRESHOLDS},
        **{f"async_over_sync_time_to_reward_{th}_after_first_step":
           ratio("async", "sync", "time_to_threshold_after_first_step_s", True, th) for th in REWARD_THRESHOLDS},
        **{f"{k}_reward_final": v.get("reward_final") for k, v in rows.items()},
    }
    status = "ok" if rows["async"].get("status") == "ok" and rows["sync"].get("status") == "ok" else "error"
    payload = {
        "status": status,
        "quick": quick,
        "units": "samples = completions (prompts x group size); seconds",
        "params": {"config": str(QUICKSTART), "steps": steps, "reward_thresholds": list(REWARD_THRESHOLDS),
                   "smooth_steps": SMOOTH_STEPS, "note": "ratios > 1 favour Conveyor async"},
        "runs": rows,
        "ratios": ratios,
    }
    return publish_result(out_dir, "e2e", payload, plot)


def plot(payload: dict[str, Any]) -> Any:
    fig, axes = new_figure(1, 2, size=(12, 4.5))
    ax = axes[0][0]
    for row in payload["runs"].values():
        if row.get("status") == "ok" and row.get("curve"):
            ts, rs = zip(*[(t, r) for t, r in row["curve"] if r is not None], strict=True)
            ax.plot(ts, rs, label=row["system"], linewidth=1)
    for th in REWARD_THRESHOLDS:
        ax.axhline(th, color="grey", linestyle=":", linewidth=0.6)
    ax.set_xlabel("seconds since launch (start-up included)")
    ax.set_ylabel("mean reward per step")
    ax.set_title("quickstart: reward vs wall time")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    names = [r["system"] for r in payload["runs"].values()]
    vals = [r.get("samples_per_s") or 0.0 for r in payload["runs"].values()]
    ax.bar(names, vals)
    ax.set_ylabel("trained samples / s (training wall time)")
    ax.set_title("throughput")
    return fig
