"""Memory soak, three allocator settings side by side: ``python -m bench soak_memory --minutes N``.

The soak's phase 1 (``bench/soak.py``: the quickstart with a step count it will not
reach; RSS and USS of every stage actor, of the rollout's vLLM engine processes (none by
default: the in-process engine's memory is the rollout actor's) and of the driver
sampled every ``MEMORY_SAMPLE_S``, fitted after the first ``WARMUP_FRACTION``) for ``N``
minutes after the first step (default 20), three times at once on the same machine, so
all see the same load. ``MALLOC_ARENA_MAX`` reaches
every process of a run (Ray passes the driver's environment to a local cluster's
workers; the vLLM engine processes inherit it):

- ``glibc_default``: 8 arenas per core, glibc's own limit for 64-bit processes, and no
  trim (``rollout.host_memory_trim_s=0``);
- ``arena_max_2``: 2 arenas, the usual cure for the slow RSS growth of many-threaded
  processes that each thread's arena keeping its free memory causes; no trim;
- ``trim_60s``: glibc's arenas, and ``malloc_trim`` in the rollout's processes after a
  weight update at most once a minute (``rollout.host_memory_trim_s=60``,
  ``pipeline/memory/trim.py``).

Each variant reports the slopes over the whole fit and over its two halves apart
(growth that levels off has a second-half slope near 0), the same per 1,000 trained
steps, and its steps per minute (the runs share the cores, so each runs at a fraction
of the speed of a run alone). No faults are injected. Writes ``bench/results/soak_memory/`` (JSON
and PNG); ``--quick``: the HF rollout backend, 15 s, and the first two
variants only (three clusters at once on two cores took 165 s of the test suite).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from bench.common import new_figure, publish_result
from bench.soak import WARMUP_FRACTION, _Soak, compute_growth, summarise_queues

MEMORY_SAMPLE_S = 30.0
STAGES = ("source:0", "rollout:0", "reward:0", "reference:0", "trainer:0")


class Variant(NamedTuple):
    env: dict[str, str]
    overrides: tuple[str, ...]


QUICK_VARIANTS = 2  # --quick runs the first two: the baseline and one it is compared with


def build_variants(quick: bool = False) -> dict[str, Variant]:
    glibc = {"MALLOC_ARENA_MAX": str(8 * (os.cpu_count() or 1))}
    no_trim = ("rollout.host_memory_trim_s=0",)
    variants = {"glibc_default": Variant(glibc, no_trim),
                "arena_max_2": Variant({"MALLOC_ARENA_MAX": "2"}, no_trim),
                "trim_60s": Variant(glibc, ("rollout.host_memory_trim_s=60",))}
    return dict(list(variants.items())[:QUICK_VARIANTS]) if quick else variants


def summarise_variant(soak: _Soak) -> dict[str, Any]:
    growth = compute_growth(soak.samples, WARMUP_FRACTION * soak.phase_s)
    steps = soak.samples[-1]["steps"] - soak.samples[0]["steps"] if soak.samples else 0
    minutes = soak.samples[-1]["t_s"] / 60 if soak.samples else 0.0
    per_hour = growth["rss_mib_per_hour"]
    steps_per_hour = steps / minutes * 60 if minutes else 0.0
    stage_slopes = [abs(per_hour[s]) for s in STAGES if s in per_hour]
    second_halves = [abs(growth["rss_halves_mib_per_hour"][s][1]) for s in STAGES
                     if s in growth["rss_halves_mib_per_hour"]]
    return {
        "env": soak.env,
        "minutes": minutes,
        "steps": steps,
        "steps_per_minute": steps / minutes if minutes else 0.0,
        "growth": growth,
        "rss_mib_per_1000_steps": {k: v / steps_per_hour * 1000 for k, v in per_hour.items()} if steps else {},
        "max_abs_stage_rss_mib_per_hour": max(stage_slopes, default=None),
        "max_abs_stage_rss_second_half_mib_per_hour": max(second_halves, default=None),
        "engine_rss_mib_per_hour": per_hour.get("rollout:0/engine"),
        "driver_rss_mib_per_hour": per_hour.get("driver"),
        "queues": summarise_queues(soak.samples),
        "samples": soak.samples,
    }


def run(quick: bool, out_dir: Path, minutes: float = 20.0) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="conveyor-soak-memory-"))
    phase_s = 15.0 if quick else minutes * 60
    soaks: dict[str, _Soak] = {}
    status, error = "ok", None
    try:
        for name, variant in build_variants(quick).items():
            (root / name).mkdir()
            soaks[name] = _Soak(quick, phase_s, root / name, variant.env, sample_s=MEMORY_SAMPLE_S,
                                overrides=variant.overrides)
        running = set(soaks)
        while running:  # one that is done runs on (the same load) until all are
            running -= {name for name in sorted(running) if soaks[name].phase1_tick()}
            time.sleep(0.5)
        for soak in soaks.values():
            soak.job.stop(600)
    except Exception as exc:  # the JSON says why, and what was measured until then
        status, error = "failed", f"{type(exc).__name__}: {exc}"
    finally:
        for soak in soaks.values():
            if soak.job.alive():
                soak.job.kill_group()
        shutil.rmtree(root, ignore_errors=True)
    variants = {name: summarise_variant(soak) for name, soak in soaks.items()}
    ratios: dict[str, Any] = {}
    for key in ("max_abs_stage_rss_mib_per_hour", "max_abs_stage_rss_second_half_mib_per_hour",
                "engine_rss_mib_per_hour", "driver_rss_mib_per_hour", "steps_per_minute"):
        for name, v in variants.items():
            ratios[f"{name}_{key}"] = v.get(key)
    base = variants.get("glibc_default", {})
    for name, v in variants.items():
        if name != "glibc_default" and base.get("steps_per_minute") and v.get("steps_per_minute"):
            ratios[f"{name}_over_glibc_default_steps"] = v["steps_per_minute"] / base["steps_per_minute"]
    payload = {
        "quick": quick,
        "status": status,
        "error": error,
        "minutes_requested": None if quick else minutes,
        "params": {"overrides": next(iter(soaks.values())).args if soaks else [], "phase_s": phase_s,
                   "sample_s": MEMORY_SAMPLE_S, "warmup_fraction": WARMUP_FRACTION,
                   "variants": {n: {"env": v.env, "overrides": list(v.overrides)}
                                for n, v in build_variants(quick).items()}},
        "variants": variants,
        "ratios": ratios,
    }
    return publish_result(out_dir, "soak_memory", payload, plot)


def plot(payload: dict[str, Any]) -> Any:
    names = list(payload["variants"])
    fig, axes = new_figure(1, max(1, len(names)), size=(7.0 * max(1, len(names)), 4.5))
    for ax, name in zip(axes[0], names, strict=False):
        samples = payload["variants"][name]["samples"]
        for proc in sorted({p for s in samples for p in s["memory_mib"]}):
            pts = [(s["t_s"] / 60, s["memory_mib"][proc]["rss"]) for s in samples if proc in s["memory_mib"]]
            base = pts[0][1]
            ax.plot([t for t, _ in pts], [m - base for _, m in pts], marker=".", label=proc)
        ax.set(title=f"{name}: RSS change per process", xlabel="minutes after the first step", ylabel="MiB")
        ax.legend(fontsize=7)
    return fig
