"""Soak and fault bench: ``conveyor bench soak --minutes N`` (``python -m bench soak``).

Launches the quickstart (``configs/quickstart.yaml``: vLLM rollout, reward, reference,
DeepSpeed trainer) with ``conveyor launch`` in a subprocess, on a local Ray cluster of
its own (``RAY_ADDRESS=local``) and with a step count it will not reach, then:

- phase 1, the first half of the minutes (after the first step): every ``SAMPLE_S``
  the RSS and USS of every stage actor's process, of the vLLM engine processes under the
  rollout actor (none by default: the in-process engine runs its model in the actor's
  process and is counted in its figure; ``rollout.engine_core=subprocess`` separates
  them) and of the driver, the bytes in Ray's object store and the queue depths
  (the driver's ``status.json``). Growth per process: the least-squares slope in
  MiB/hour over the samples after the warm-up (the first ``WARMUP_FRACTION`` of the
  phase). Target: ~0.
- phase 2, the second half: every ``KILL_EVERY_S`` a SIGKILL of one of rollout, reward
  and reference, drawn at random (seeded); its restart by Ray is awaited (the status'
  ``restarts``). Once, after the first of them, the driver is killed with its process
  group (its Ray cluster and every stage: a ``kill -9`` of the job) and the run is
  continued with ``conveyor launch --resume``. At the end SIGINT stops the run
  gracefully and the id accounting of its ``summary.json`` (the source's issued prompt
  ids against the trainer's trained or dropped ones, across the resume, each once)
  counts the samples lost and duplicated. Target: 0.

``--quick`` (the smoke test): the HF rollout backend, phases of seconds, one stage kill
and the driver kill. Writes ``bench/results/soak/`` (its ``minutes`` is what ran,
which may be less than asked).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import fit_line, new_figure, note_config, publish_result
from pipeline.config import load_config
from pipeline.runner import reap_processes

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
KILLABLE = ("rollout:0", "reward:0", "reference:0")
SAMPLE_S, QUICK_SAMPLE_S = 60.0, 3.0
KILL_EVERY_S = 180.0
WARMUP_FRACTION = 0.2
RESTART_TIMEOUT_S = 600.0
FIRST_STEP_TIMEOUT_S = 900.0
SEED = 0
MIB = 1 << 20


class _Job:
    """One ``conveyor launch`` of the soak's run, its output kept in a log file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self._out = log.open("w")
        # Each run's trainer chooses its own rendezvous port: a MASTER_PORT inherited from
        # this process (set by a trainer built in it) would be one port for runs side by side.
        inherited = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
        env = {**inherited, "RAY_ADDRESS": "local", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "launch", *args], cwd=ROOT, env=env,
                                     stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 3000) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")[-chars:]

    def kill_group(self) -> None:
        """SIGKILL the driver's whole process group, then whatever it spawned elsewhere."""
        import psutil

        try:
            spawned = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            spawned = []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        reap_processes(spawned)
        self._out.close()

    def stop(self, timeout: float) -> int:
        """SIGINT (a graceful stop), then the group's SIGKILL if it has not ended in time."""
        if self.alive():
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill_group()
        self._out.close()
        return self.proc.returncode


def read_status(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def count_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def measure_processes(status: dict[str, Any], driver_pid: int) -> dict[str, dict[str, float]]:
    """{name: {"rss": MiB, "uss": MiB}} of every stage actor, the rollout's engine
    processes (summed, as ``<rollout>/engine``) and the driver."""
    import psutil

    def mem(procs: list[Any]) -> dict[str, float] | None:
        rss = uss = 0.0
        for p in procs:
            try:
                info = p.memory_full_info()
            except psutil.Error:
                continue
            rss, uss = rss + info.rss / MIB, uss + info.uss / MIB
        return {"rss": rss, "uss": uss} if rss else None

    out: dict[str, dict[str, float]] = {}
    named = [("driver", driver_pid)] + [(k, v[1]) for k, v in (status.get("processes") or {}).items()]
    for name, pid in named:
        try:
            proc = psutil.Process(pid)
        except psutil.Error:
            continue
        if (m := mem([proc])) is not None:
            out[name] = m
        if name.startswith("rollout"):
            try:
                children = proc.children(recursive=True)
            except psutil.Error:
                children = []
            if children and (m := mem(children)) is not None:
                out[f"{name}/engine"] = m
    return out


def take_sample(run_dir: Path, job: _Job, t0: float, phase: int) -> dict[str, Any]:
    status = read_status(run_dir)
    used = status.get("object_store_used_bytes")
    return {
        "t_s": time.time() - t0,
        "phase": phase,
        "steps": count_steps(run_dir),
        "memory_mib": measure_processes(status, job.proc.pid),
        "object_store_mib": used / MIB if used is not None else None,
        "queues": {q: {"depth": v["depth"], "bound": v["bound"], "max_depth": v["max_depth"]}
                   for q, v in (status.get("queues") or {}).items()},
    }


def compute_growth(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """MiB/hour slopes (RSS and USS per process, and the object store) over the samples
    after ``warmup_s``; a process needs 3 samples to be fitted. ``rss_halves_mib_per_hour``:
    the RSS slope over the first and over the second half of those samples, fitted apart
    (growth that levels off has a second slope near 0), where each half has 3."""
    late = [s for s in samples if s["t_s"] >= warmup_s]
    out: dict[str, Any] = {"rss_mib_per_hour": {}, "uss_mib_per_hour": {}, "rss_halves_mib_per_hour": {},
                           "samples_fitted": len(late)}
    names = sorted({n for s in late for n in s["memory_mib"]})
    for name in names:
        points = [(s["t_s"] / 3600, s["memory_mib"][name]) for s in late if name in s["memory_mib"]]
        if len(points) < 3:
            continue
        for kind in ("rss", "uss"):
            out[f"{kind}_mib_per_hour"][name] = fit_line(*zip(*[(h, m[kind]) for h, m in points], strict=True))[1]
        half = len(points) // 2
        if half >= 3:
            out["rss_halves_mib_per_hour"][name] = [
                fit_line(*zip(*[(h, m["rss"]) for h, m in part], strict=True))[1]
                for part in (points[:half], points[half:])]
    store = [(s["t_s"] / 3600, s["object_store_mib"]) for s in late if s["object_store_mib"] is not None]
    out["object_store_mib_per_hour"] = fit_line(*zip(*store, strict=True))[1] if len(store) >= 3 else None
    return out


def summarise_queues(samples: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for s in samples:
        for q, v in s["queues"].items():
            row = out.setdefault(q, {"bound": v["bound"], "max_depth": 0})
            row["max_depth"] = max(row["max_depth"], v["max_depth"], v["depth"])
    return out


class _Soak:
    def __init__(self, quick: bool, phase_s: float, root: Path, env: dict[str, str] | None = None,
                 sample_s: float = SAMPLE_S, overrides: tuple[str, ...] = ()) -> None:
        self.quick = quick
        self.phase_s = phase_s
        self.sample_s = QUICK_SAMPLE_S if quick else sample_s
        self.env = env
        self.root = root
        self.run_dir = root / "run"
        self.args = [f"run.dir={self.run_dir}", "run.steps=1000000", "run.progress=false", "run.tensorboard=false",
                     "run.name=bench-soak", "run.max_restarts=1000", "train.checkpoint_every=2" if quick else
                     "train.checkpoint_every=50", *(["rollout.backend=hf"] if quick else []), *overrides]
        self.samples: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.jobs = 0
        note_config(load_config(QUICKSTART, self.args))  # as the launched job resolves it
        self.job = self._launch(["--config", str(QUICKSTART), *self.args])
        self.t0 = time.time()
        self.started = False  # phase 1's clock runs

    def _launch(self, args: list[str]) -> _Job:
        self.jobs += 1
        return _Job(args, self.root / f"driver-{self.jobs}.log", self.env)

    def _check(self) -> None:
        if not self.job.alive():
            raise RuntimeError(f"the run ended (exit {self.job.proc.returncode}): {self.job.tail()}")

    def wait_for(self, what: str, ready: Any, timeout: float) -> dict[str, Any]:
        """Poll status.json (sampling on schedule meanwhile) until ``ready(status)``."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            self._check()
            status = read_status(self.run_dir)
            if status.get("processes") and ready(status):
                return status
            self.sample_when_due(2)
            time.sleep(0.5)
        raise RuntimeError(f"not within {timeout:.0f}s: {what}")

    def sample_when_due(self, phase: int) -> None:
        if not self.samples or time.time() - self.t0 - self.samples[-1]["t_s"] >= self.sample_s:
            self.samples.append(take_sample(self.run_dir, self.job, self.t0, phase))

    def phase1_tick(self) -> bool:
        """One poll of phase 1 (True once it is over). Its clock starts at the first
        step: start-up is not a soak."""
        self._check()
        if not self.started:
            if count_steps(self.run_dir) < 1:
                if time.time() - self.t0 > FIRST_STEP_TIMEOUT_S:
                    raise RuntimeError(f"not within {FIRST_STEP_TIMEOUT_S:.0f}s: the first step")
                return False
            self.t0, self.samples, self.started = time.time(), [], True
        self.sample_when_due(1)
        return time.time() - self.t0 >= self.phase_s

    def phase1(self) -> None:
        while not self.phase1_tick():
            time.sleep(0.5)

    def kill_stage(self, stage: str) -> None:
        status = read_status(self.run_dir)
        before = int((status.get("restarts") or {}).get(stage, 0))
        pid = status["processes"][stage][1]
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        self.wait_for(f"{stage} restarted", lambda s: int((s.get("restarts") or {}).get(stage, 0)) > before,
                      RESTART_TIMEOUT_S)
        self.events.append({"t_s": t - self.t0, "kind": "stage", "stage": stage, "pid": pid,
                            "restart_s": time.time() - t, "job": self.jobs})

    def kill_driver(self) -> None:
        steps = count_steps(self.run_dir)
        t = time.time()
        self.job.kill_group()
        self.job = self._launch(["--resume", str(self.run_dir)])
        self.wait_for("the resumed run's next step", lambda s: s.get("state") == "running" and
                      count_steps(self.run_dir) > 0 and s.get("pid") == self.job.proc.pid, 900)
        self.events.append({"t_s": t - self.t0, "kind": "driver", "steps_before": steps,
                            "resume_s": time.time() - t, "job": self.jobs})

    def phase2(self) -> None:
        rng = random.Random(SEED)
        end = time.time() + self.phase_s
        next_kill = time.time()
        killed_driver = False
        while True:
            self._check()
            self.sample_when_due(2)
            if time.time() >= next_kill and (time.time() < end or not killed_driver):
                self.kill_stage("reward:0" if self.quick else rng.choice(KILLABLE))
                if not killed_driver:
                    self.kill_driver()
                    killed_driver = True
                next_kill = time.time() + KILL_EVERY_S
            if time.time() >= end and killed_driver:
                break
            time.sleep(0.5)
        if self.quick:  # a couple of steps of the resumed run before it is stopped
            steps = count_steps(self.run_dir)
            self.wait_for("two more steps", lambda s: count_steps(self.run_dir) >= steps + 2, 600)

    def finish(self) -> dict[str, Any]:
        self.samples.append(take_sample(self.run_dir, self.job, self.t0, 2))
        elapsed = time.time() - self.t0
        code = self.job.stop(600)
        summary = json.loads((self.run_dir / "summary.json").read_text())
        return {"exit_code": code, "summary": summary, "minutes": elapsed / 60}


def run(quick: bool, out_dir: Path, minutes: float = 60.0) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="conveyor-soak-"))
    soak = None
    try:
        soak = _Soak(quick, 15.0 if quick else minutes * 60 / 2, root)
        soak.phase1()
        phase1_samples = list(soak.samples)
        soak.phase2()
        end = soak.finish()
        status, error = "ok", None
    except Exception as exc:  # the JSON says why, and what was measured until then
        end, status, error = {}, "failed", f"{type(exc).__name__}: {exc}"
        if soak is not None and soak.job.alive():
            soak.job.kill_group()
        phase1_samples = [s for s in (soak.samples if soak else []) if s["phase"] == 1]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    samples = soak.samples if soak else []
    phase_s = soak.phase_s if soak else 0.0
    growth = compute_growth(phase1_samples, WARMUP_FRACTION * phase_s)
    summary = end.get("summary", {})
    accounting = summary.get("accounting", {})
    n = 8  # quickstart's rollout.n: samples per prompt
    stage_kills = [e for e in (soak.events if soak else []) if e["kind"] == "stage"]
    lost = len(accounting.get("missing", [])) * n if accounting else None
    duplicated = (accounting.get("repeated_finish", 0) + accounting.get("repeated_issue", 0)) * n if accounting else None
    rss = growth["rss_mib_per_hour"]
    payload = {
        "quick": quick,
        "status": status,
        "error": error,
        "minutes": end.get("minutes", (time.time() - soak.t0) / 60 if soak else 0.0),
        "minutes_requested": None if quick else minutes,
        "params": {"config": str(QUICKSTART), "overrides": soak.args if soak else [], "phase_s": phase_s,
                   "sample_s": soak.sample_s if soak else None, "warmup_fraction": WARMUP_FRACTION,
                   "kill_every_s": KILL_EVERY_S, "killable": list(KILLABLE), "seed": SEED},
        "phase1": {"growth": growth, "queues": summarise_queues(phase1_samples)},
        "phase2": {"events": soak.events if soak else [], "queues": summarise_queues(
                       [s for s in samples if s["phase"] == 2]),
                   "exit_code": end.get("exit_code"), "run_status": summary.get("status"),
                   "accounting": accounting, "faults": summary.get("faults"),
                   "prompts": summary.get("prompts"), "policy_version": summary.get("policy_version")},
        "samples": samples,
        "ratios": {
            "minutes": end.get("minutes"),
            "steps": samples[-1]["steps"] if samples else 0,
            "max_abs_rss_growth_mib_per_hour": max((abs(v) for v in rss.values()), default=None),
            "object_store_growth_mib_per_hour": growth["object_store_mib_per_hour"],
            "stage_kills": len(stage_kills),
            "driver_kills": sum(e["kind"] == "driver" for e in (soak.events if soak else [])),
            "samples_lost": lost,
            "samples_duplicated": duplicated,
            "accounting_reconciles": accounting.get("reconciles"),
        },
    }
    return publish_result(out_dir, "soak", payload, plot)


def plot(payload: dict[str, Any]) -> Any:
    fig, axes = new_figure(1, 3, size=(16.0, 4.5))
    samples = payload["samples"]
    kills = payload["phase2"]["events"]
    ax = axes[0][0]
    for name in sorted({n for s in samples for n in s["memory_mib"]}):
        pts = [(s["t_s"] / 60, s["memory_mib"][name]["rss"]) for s in samples if name in s["memory_mib"]]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=name)
    for e in kills:
        ax.axvline(e["t_s"] / 60, color="red" if e["kind"] == "driver" else "grey", lw=0.8, ls="--")
    ax.set(title="RSS per process (dashed: kills, red: driver)", xlabel="minutes", ylabel="MiB")
    ax.legend(fontsize=7)
    ax = axes[0][1]
    pts = [(s["t_s"] / 60, s["object_store_mib"]) for s in samples if s["object_store_mib"] is not None]
    if pts:
        ax.plot(*zip(*pts, strict=True), marker=".")
    ax.set(title="Ray object store in use", xlabel="minutes", ylabel="MiB")
    ax = axes[0][2]
    for q in sorted({q for s in samples for q in s["queues"]}):
        pts = [(s["t_s"] / 60, s["queues"][q]["depth"]) for s in samples if q in s["queues"]]
        ax.plot(*zip(*pts, strict=True), marker=".", label=q)
    bounds = {s["queues"][q]["bound"] for s in samples for q in s["queues"]}
    for b in bounds:
        ax.axhline(b, color="black", lw=0.8, ls=":")
    r = payload["ratios"]
    ax.set(title=f"queue depths (dotted: bounds); lost {r['samples_lost']}, duplicated {r['samples_duplicated']}",
           xlabel="minutes", ylabel="items")
    ax.legend(fontsize=7)
    return fig
