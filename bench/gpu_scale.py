"""GPU scaling: the same job (``configs/gpu_small.yaml``) on one GPU and on two.

Runs, one after the other, each on a fresh local Ray cluster that sees only the GPUs it
may use (``CUDA_VISIBLE_DEVICES``), the same steps, prompts and samples per step:

- ``shared_1gpu``: one GPU, every stage on it streaming, weights over CUDA IPC;
- ``colocate_1gpu``: the same GPU taken in turns (``placement: colocate``, lock-step:
  vLLM sleeps while the trainer steps);
- ``disaggregated_2gpu``: two GPUs, the rollout on GPU 0 and the trainer on GPU 1
  (``placement: auto``), weights over shared memory;
- ``replicas_ranks_2gpu``: two GPUs, two rollout replicas and two trainer ranks
  (``rollout.num_workers=2``, ``train.num_ranks=2``): each GPU holds a replica and a
  rank (the ranks take every GPU, so the replicas share them).

Reports steady-state samples per s (after ``gpu_e2e.WARMUP_STEPS``) per configuration, per
GPU, and the ratios of each two-GPU configuration to the one-GPU one (target 1.8, the
GPU-scaling issue's). A configuration needing more GPUs than the machine has is a row
marked skipped. Writes ``bench/results/gpu_scale/`` (JSON and PNG); the machine's GPUs are
named in the ratios. Needs a CUDA GPU (status "skipped" without one).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.common import new_figure, publish_result
from bench.e2e import _attempt
from bench.gpu_e2e import CONFIG, WARMUP_STEPS, run_conveyor

# name -> (GPUs it uses, overrides beside the config's)
CONFIGS: dict[str, tuple[int, tuple[str, ...]]] = {
    "shared_1gpu": (1, ()),
    "colocate_1gpu": (1, ("placement=colocate", "dataflow.async_execution=false", "dataflow.max_staleness=0")),
    "disaggregated_2gpu": (2, ()),
    "replicas_ranks_2gpu": (2, ("rollout.num_workers=2", "train.num_ranks=2")),
}
TARGET_TWO_OVER_ONE = 1.8
STEADY_STEPS = 7


def list_gpus() -> list[tuple[str, str]]:
    """(CUDA_VISIBLE_DEVICES entry, name) of each GPU this process may use, from
    nvidia-smi (no CUDA context here: the runs' actors own the GPUs)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = [tuple(x.strip() for x in line.split(",", 1)) for line in out.splitlines() if "," in line]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        keep = [v.strip() for v in visible.split(",") if v.strip()]
        gpus = [g for g in gpus if g[0] in keep]
    return gpus


def run_on_gpus(name: str, devices: list[str], extra: tuple[str, ...], steps: int, root: Path) -> dict[str, Any]:
    """``run_conveyor`` on a Ray cluster started for ``devices`` alone."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    try:
        row = run_conveyor(name, steps, root, extra, gpus=len(devices))
    finally:
        ray.shutdown()
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    return {**row, "devices": devices}


def parse_configs(systems: str | None) -> tuple[str, ...]:
    """``--systems`` for this bench: a comma-separated subset of ``CONFIGS`` (default all,
    in their order); an unknown name raises ``ValueError`` naming the known ones."""
    if systems is None:
        return tuple(CONFIGS)
    chosen = tuple(s.strip() for s in systems.split(",") if s.strip())
    unknown = [s for s in chosen if s not in CONFIGS]
    if unknown or not chosen:
        raise ValueError(f"--systems: gpu_scale runs {', '.join(CONFIGS)}; got {systems!r}")
    return chosen


def run(quick: bool, out_dir: Path, systems: str | None = None) -> dict[str, Any]:
    """``systems``: the configurations to run (``parse_configs``). All four take about 8
    minutes; a subset (``shared_1gpu,disaggregated_2gpu``) fits one call's limit with
    room to spare and is labelled with their names, never taken for the full result."""
    chosen = parse_configs(systems)
    label = "default" if chosen == tuple(CONFIGS) else "-".join(chosen)
    gpus = list_gpus()
    if not gpus:
        return publish_result(out_dir, "gpu_scale", {"status": "skipped", "error": "no CUDA GPU", "ratios": {}},
                              plot, label)
    # 7 steady steps after the warm-up: four runs (each starting its engines), about 8 minutes.
    steps = WARMUP_STEPS + (2 if quick else STEADY_STEPS)
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-gpu-scale-"))
    rows: dict[str, dict[str, Any]] = {}
    try:
        for name in chosen:
            count, extra = CONFIGS[name]
            if count > len(gpus):
                rows[name] = {"system": name, "status": "skipped",
                              "error": f"needs {count} GPUs, {len(gpus)} visible"}
                continue
            rows[name] = _attempt(name, run_on_gpus, name, [g[0] for g in gpus[:count]], extra, steps, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def rate(name: str) -> float | None:
        row = rows.get(name, {})
        return row.get("samples_per_s") if row.get("status") == "ok" else None

    one = rate("shared_1gpu")
    over_one = {f"{name}_over_shared_1gpu": (rate(name) / one if rate(name) and one else None)
                for name, (count, _) in CONFIGS.items() if count == 2}
    best = max((v for v in over_one.values() if v is not None), default=None)
    ratios = {
        "devices": [g[1] for g in gpus], "gpus": len(gpus),
        **{f"{name}_samples_per_s": rate(name) for name in chosen},
        **over_one, "best_two_gpu_over_one_gpu": best,
        "colocate_over_shared_1gpu": rate("colocate_1gpu") / one if rate("colocate_1gpu") and one else None,
        "targets": {"best_two_gpu_over_one_gpu": TARGET_TWO_OVER_ONE},
    }
    # A configuration this machine has too few GPUs for is skipped, not failed.
    status = "ok" if all(r.get("status") in ("ok", "skipped") for r in rows.values()) and any(
        r.get("status") == "ok" for r in rows.values()) else "error"
    payload = {"status": status, "quick": quick, "units": "samples = completions; seconds",
               "params": {"config": str(CONFIG), "steps": steps, "warmup_steps": WARMUP_STEPS,
                          "configs": {k: {"gpus": CONFIGS[k][0], "overrides": list(CONFIGS[k][1])} for k in chosen}},
               "runs": rows, "ratios": ratios}
    return publish_result(out_dir, "gpu_scale", payload, plot, label)


def plot(payload: dict[str, Any]) -> Any:
    fig, axes = new_figure(1, 1, size=(8, 4.5))
    ax = axes[0][0]
    runs = payload.get("runs", {})
    ax.bar(list(runs), [r.get("samples_per_s") or 0.0 for r in runs.values()])
    ax.set_ylabel("samples / s (steady state)")
    devices = payload.get("ratios", {}).get("devices") or ["?"]
    ax.set_title(f"gpu_scale on {len(devices)} x {devices[0]}")
    ax.tick_params(axis="x", labelsize=8)
    return fig
