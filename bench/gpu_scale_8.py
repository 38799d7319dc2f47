"""Eight GPUs (issue 17's run): ``configs/gpu_8.yaml`` streaming and lock-step.

Two rollout replicas with tensor parallelism 2 on four GPUs, four ZeRO-3 trainer ranks
on the other four (the reference beside rank 0), a 1.4B-parameter Llama built locally,
64 prompts x 8 samples x up to 512 tokens per step. On four to seven GPUs the job is
halved (``rollout.num_workers=1``, ``train.num_ranks=2``), on fewer it is skipped.

Per run (async, then sync: ``dataflow.async_execution=false``, ``max_staleness=0``),
beside ``gpu_e2e.run_conveyor``'s figures (samples per s and per GPU, tokens/s, stage busy
shares, weight publish time):

- every GPU's busy share and peak memory, sampled from ``nvidia-smi`` once a second;
- each rollout replica's weight updates (count, mean seconds to apply);
- the staleness histogram of the trained samples, summed over the steady steps.

Ratios: async over sync, and samples per second per GPU against the one-GPU ``gpu_e2e``
async rate of the newest full ``gpu_e2e`` result in ``bench/results`` when present (a
different model: the scaling of the per-GPU rate, not a like-for-like speed-up). Needs
4 or more CUDA GPUs (status "skipped" otherwise).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, new_figure, publish_result, publish_skipped_without_gpu, result_files
from bench.e2e import _attempt
from bench.gpu_e2e import WARMUP_STEPS, run_conveyor
from bench.gpu_scale import list_gpus

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gpu_8.yaml"
HALVED = ("rollout.num_workers=1", "train.num_ranks=2")
SAMPLE_S = 1.0


def parse_gpu_sample(text: str) -> dict[str, tuple[float, float]]:
    """``nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader,nounits``
    output -> {index: (busy %, MiB used)}; lines it cannot read are left out."""
    out: dict[str, tuple[float, float]] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            out[parts[0]] = (float(parts[1]), float(parts[2]))
        except (IndexError, ValueError):
            continue
    return out


def summarise_gpu_samples(samples: list[dict[str, tuple[float, float]]]) -> dict[str, dict[str, float]]:
    """Per GPU: mean busy share (0-1) and peak memory (GiB) over ``samples``."""
    per: dict[str, list[tuple[float, float]]] = {}
    for sample in samples:
        for gpu, value in sample.items():
            per.setdefault(gpu, []).append(value)
    return {gpu: {"busy_share": sum(u for u, _ in vals) / len(vals) / 100,
                  "peak_memory_gib": max(m for _, m in vals) / 1024} for gpu, vals in sorted(per.items())}


def sum_staleness(rows: list[dict[str, Any]]) -> dict[int, int]:
    """The ``staleness/hist/<k>`` counts of metrics ``rows``, summed: {staleness: samples}."""
    total: Counter[int] = Counter()
    for row in rows:
        for key, value in row.items():
            if key.startswith("staleness/hist/"):
                total[int(key.rsplit("/", 1)[1])] += int(value)
    return dict(sorted(total.items()))


class _GpuSampler:
    """``nvidia-smi`` every ``SAMPLE_S`` in a thread, while a run goes on."""

    def __init__(self) -> None:
        self.samples: list[dict[str, tuple[float, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                     timeout=10, check=True).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            self.samples.append(parse_gpu_sample(out))

    def __enter__(self) -> _GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _run_mode(mode: str, steps: int, root: Path, extra: tuple[str, ...], gpus: int) -> dict[str, Any]:
    from pipeline.metrics import read_metrics

    with _GpuSampler() as sampler:
        row = run_conveyor(mode, steps, root, extra, gpus=gpus, config=CONFIG)
    run_dir = root / mode
    summary = json.loads((run_dir / "summary.json").read_text())
    updates = {}
    for i, replica in enumerate(summary.get("rollout", [])):
        w = replica.get("weight_updates", {})
        updates[f"rollout:{i}"] = {"count": w.get("count"),
                                   "mean_apply_s": w["apply_s_total"] / w["count"] if w.get("count") else None}
    return {**row, "gpu_samples": summarise_gpu_samples(sampler.samples), "weight_updates": updates,
            "staleness_hist": sum_staleness(read_metrics(run_dir)[WARMUP_STEPS:])}


def one_gpu_rate(results_dir: Path = RESULTS_DIR) -> float | None:
    """The async rate per GPU (``async_samples_per_s_per_gpu``) of the newest full ``gpu_e2e`` result, if any."""
    paths = result_files(results_dir, "gpu_e2e", "default")
    return json.loads(paths[-1].read_text())["ratios"].get("async_samples_per_s_per_gpu") if paths else None


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    gpus = list_gpus()
    if len(gpus) < 4:
        return publish_skipped_without_gpu(out_dir, "gpu_scale_8", quick, "needs 4 or more CUDA GPUs", gpus=len(gpus))
    from pipeline.config import load_config

    extra = () if len(gpus) >= 8 else HALVED
    used = 8 if len(gpus) >= 8 else 4
    steps = WARMUP_STEPS + 2 if quick else load_config(CONFIG).run.steps
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-gpu-scale-8-"))
    rows: dict[str, dict[str, Any]] = {}
    try:
        for mode in ("async", "sync"):
            rows[mode] = _attempt(mode, _run_mode, mode, steps, root, extra, used)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def rate(mode: str) -> float | None:
        return rows[mode].get("samples_per_s") if rows[mode].get("status") == "ok" else None

    one_gpu = one_gpu_rate()
    a, s = rate("async"), rate("sync")
    ratios = {"devices": [g[1] for g in gpus], "gpus_used": used, "halved": bool(extra),
              "async_samples_per_s": a, "sync_samples_per_s": s,
              "async_over_sync": a / s if a and s else None,
              "async_samples_per_s_per_gpu": a / used if a else None,
              "per_gpu_over_one_gpu_gpu_small": a / used / one_gpu if a and one_gpu else None}
    status = "ok" if all(r.get("status") == "ok" for r in rows.values()) else "error"
    payload = {"status": status, "quick": quick, "units": "samples = completions; seconds",
               "params": {"config": str(CONFIG), "steps": steps, "warmup_steps": WARMUP_STEPS,
                          "overrides": list(extra)},
               "runs": rows, "ratios": ratios}
    return publish_result(out_dir, "gpu_scale_8", payload, plot)


def plot(payload: dict[str, Any]) -> Any:
    fig, axes = new_figure(1, 2, size=(12, 4.5))
    runs = {k: r for k, r in payload.get("runs", {}).items() if r.get("status") == "ok"}
    ax = axes[0][0]
    ax.bar(list(runs), [r.get("samples_per_s") or 0.0 for r in runs.values()])
    ax.set_ylabel("samples / s (steady state)")
    ax.set_title(f"gpu_scale_8 on {payload.get('ratios', {}).get('gpus_used', '?')} GPUs")
    ax = axes[0][1]
    for mode, r in runs.items():
        gpus = r.get("gpu_samples", {})
        ax.plot(list(gpus), [g["busy_share"] for g in gpus.values()], marker="o", label=mode)
    ax.set_xlabel("GPU")
    ax.set_ylabel("busy share (nvidia-smi)")
    ax.legend(fontsize=8)
    return fig
