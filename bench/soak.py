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
- phase 2, the second half: faults (``--faults``, ``bench/soak_faults.py`` says how each
  is made and checked; default ``stage,driver``). Round one injects each chosen fault once:
  a SIGKILL of one of rollout, reward and reference, drawn at random (seeded), awaiting
  its restart by Ray; right after it the driver killed with its process group (its Ray
  cluster and every stage: a ``kill -9`` of the job) and the run continued with
  ``conveyor launch --resume``; then ``nan``, ``disk_full``, ``ckpt_truncate``,
  ``engine``. After it the repeatable ones (stage, nan, disk_full, engine) take turns,
  one every ``gap_s`` (``KILL_EVERY_S``, less when that would not fit two rounds), until
  the phase is over. A fault the run did not recover from is recorded so and the run
  resumed. At the end SIGINT stops the run gracefully and the id accounting of its
  ``summary.json`` (the source's issued prompt ids against the trainer's trained or
  dropped ones, across every resume, each once) counts the samples lost and duplicated.
  Target: 0, and every fault recovered. ``faults`` in the JSON: one record per fault
  (``kind``, ``t_s``, ``recovered``, ``recovery_s``, ``details``).

``--quick`` (the smoke test): the HF rollout backend (vLLM with ``engine``), phases of
seconds, round one only. Writes ``bench/results/soak/`` (its ``minutes`` is what ran,
which may be less than asked; label ``faults`` unless the faults are the default).
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
from bench.soak_faults import (
    DEFAULT_FAULTS,
    FAULT_DIR_ENV,
    REPEATED,
    FaultNotRecovered,
    Injector,
    count_steps,
    prepare_disk,
    read_rows,
    read_status,
    record,
)
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
                 sample_s: float = SAMPLE_S, overrides: tuple[str, ...] = (),
                 faults: tuple[str, ...] = DEFAULT_FAULTS) -> None:
        self.quick = quick
        self.phase_s = phase_s
        self.sample_s = QUICK_SAMPLE_S if quick else sample_s
        self.faults = faults
        self.gap_s = 0.0 if quick else min(KILL_EVERY_S, phase_s / (2 * len(faults)))
        self.root = root
        self.run_dir = root / "run"
        self.fault_dir = root / "faults"
        self.fault_dir.mkdir(parents=True, exist_ok=True)
        added, extra = self._fault_setup()
        self.env = {**(env or {}), **added} if added else env
        hf = quick and "engine" not in faults  # the engine fault kills vLLM's engine core process
        self.args = [f"run.dir={self.run_dir}", "run.steps=1000000", "run.progress=false", "run.tensorboard=false",
                     "run.name=bench-soak", "run.max_restarts=1000", "train.checkpoint_every=2" if quick else
                     "train.checkpoint_every=50", *(["rollout.backend=hf"] if hf else []), *extra, *overrides]
        self.samples: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []  # one per fault injected
        self.jobs = 0
        self.injector = Injector(self, self.fault_dir, self.disk, RESTART_TIMEOUT_S)
        note_config(load_config(QUICKSTART, self.args))  # as the launched job resolves it
        self.job = self._launch(["--config", str(QUICKSTART), *self.args])
        self.t0 = time.time()
        self.started = False  # phase 1's clock runs

    def _fault_setup(self) -> tuple[dict[str, str], list[str]]:
        """The environment and overrides the chosen faults need (before the launch)."""
        env: dict[str, str] = {}
        extra: list[str] = []
        self.disk = None
        if "nan" in self.faults:
            env[FAULT_DIR_ENV] = str(self.fault_dir)
            extra.append(f"run.script={ROOT / 'bench' / 'soak_flow.py'}")
        if "disk_full" in self.faults:
            self.disk = prepare_disk(self.run_dir, self.fault_dir)
            env.update(self.disk.env)
            extra.append("train.on_checkpoint_error=continue")
        if "engine" in self.faults:
            # As run.max_restarts: the soak kills the engine more often than a run would lose it.
            extra += ["rollout.engine_core=subprocess", "rollout.max_engine_restarts=1000"]
        return env, extra

    def _launch(self, args: list[str]) -> _Job:
        self.jobs += 1
        return _Job(args, self.root / f"driver-{self.jobs}.log", self.env)

    def _check(self) -> None:
        if not self.job.alive():
            raise RuntimeError(f"the run ended (exit {self.job.proc.returncode}): {self.job.tail()}")

    def wait_for(self, what: str, ready: Any, timeout: float) -> dict[str, Any]:
        """Poll status.json (sampling on schedule meanwhile) until ``ready(status)``;
        ``FaultNotRecovered`` when the run ends or ``timeout`` passes first."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.job.alive():
                raise FaultNotRecovered(f"the run ended (exit {self.job.proc.returncode}) before {what}: "
                                        f"{self.job.tail(1500)}")
            status = read_status(self.run_dir)
            if status.get("processes") and ready(status):
                return status
            self.sample_when_due(2)
            time.sleep(0.5)
        raise FaultNotRecovered(f"not within {timeout:.0f}s: {what}")

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

    def kill_stage(self, stage: str) -> dict[str, Any]:
        status = read_status(self.run_dir)
        before = int((status.get("restarts") or {}).get(stage, 0))
        pid = status["processes"][stage][1]
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        self.wait_for(f"{stage} restarted", lambda s: int((s.get("restarts") or {}).get(stage, 0)) > before,
                      RESTART_TIMEOUT_S)
        return record("stage", t - self.t0, time.time() - t, stage=stage, pid=pid,
                      recovery_from="the kill to Ray's restart of the actor")

    def resume_after_kill(self, damage: Any = None) -> float:
        """SIGKILL the driver's process group, call ``damage()`` (if any) while it is
        down, resume it and wait for the resumed run's first step; returns that time."""
        self.job.kill_group()
        if damage is not None:
            damage()
        self.job = self._launch(["--resume", str(self.run_dir)])
        pid = self.job.proc.pid
        self.wait_for("the resumed run's first step", lambda s: s.get("pid") == pid and s.get("state") == "running"
                      and s.get("last_step") is not None, 900)
        return time.time()

    def kill_driver(self) -> dict[str, Any]:
        steps, t = count_steps(self.run_dir), time.time()
        resumed = self.resume_after_kill()
        return record("driver", t - self.t0, resumed - t, steps_before=steps,
                      recovery_from="the kill to the resumed run's first step")

    def inject(self, kind: str, rng: random.Random) -> None:
        """One fault and its check; a run that did not recover is resumed (killed first
        if it still runs) so that the soak and its accounting go on."""
        t = time.time()
        try:
            if kind == "stage":
                out = self.kill_stage("reward:0" if self.quick else rng.choice(KILLABLE))
            elif kind == "driver":
                out = self.kill_driver()
            else:
                out = getattr(self.injector, kind)()
        except FaultNotRecovered as exc:
            resumed = self.resume_after_kill()
            out = record(kind, t - self.t0, None, error=str(exc)[-2000:], resumed_by_soak_s=resumed - t)
        out["details"]["job"] = self.jobs
        self.records.append(out)
        print(f"soak: {kind} at {out['t_s']:.0f}s: recovered {out['recovered']} in "
              f"{out['recovery_s'] or 0:.1f}s", flush=True)

    def phase2(self) -> None:
        """Round one injects every chosen fault once, in ``FAULT_KINDS`` order (the
        driver's kill right after the first stage kill); then the repeatable ones take
        turns every ``gap_s`` until the phase's time is over (``--quick``: round one)."""
        rng = random.Random(SEED)
        end = time.time() + self.phase_s
        first = list(self.faults)
        repeated = [k for k in REPEATED if k in self.faults]
        next_at, turn = time.time(), 0
        while first or (not self.quick and repeated and time.time() < end):
            self._check()
            self.sample_when_due(2)
            if time.time() >= next_at:
                if first:
                    kind = first.pop(0)
                else:
                    kind, turn = repeated[turn % len(repeated)], turn + 1
                self.inject(kind, rng)
                back_to_back = kind == "stage" and first[:1] == ["driver"]
                next_at = time.time() + (0.0 if back_to_back else self.gap_s)
            time.sleep(0.5)
        if self.quick:  # a couple of steps of the run before it is stopped
            steps = count_steps(self.run_dir)
            self.wait_for("two more steps", lambda s: count_steps(self.run_dir) >= steps + 2, 600)

    def finish(self) -> dict[str, Any]:
        self.samples.append(take_sample(self.run_dir, self.job, self.t0, 2))
        elapsed = time.time() - self.t0
        code = self.job.stop(600)
        summary = json.loads((self.run_dir / "summary.json").read_text())
        self.injector.check_final((summary.get("trainer") or {}).get("done"))
        rows, _ = read_rows(self.run_dir / "metrics.jsonl", 0)
        steps = [int(r["step"]) for r in rows]
        return {"exit_code": code, "summary": summary, "minutes": elapsed / 60,
                "metrics_steps_contiguous": steps == list(range(len(steps)))}

    def close(self) -> None:
        if self.job.alive():
            self.job.kill_group()
        if self.disk is not None:
            self.disk.close()


def run(quick: bool, out_dir: Path, minutes: float = 60.0, faults: tuple[str, ...] = DEFAULT_FAULTS) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="conveyor-soak-"))
    soak = None
    try:
        soak = _Soak(quick, 15.0 if quick else minutes * 60 / 2, root, faults=faults)
        soak.phase1()
        phase1_samples = list(soak.samples)
        soak.phase2()
        end = soak.finish()
        status, error = "ok", None
    except Exception as exc:  # the JSON says why, and what was measured until then
        end, status, error = {}, "failed", f"{type(exc).__name__}: {exc}"
        phase1_samples = [s for s in (soak.samples if soak else []) if s["phase"] == 1]
    finally:
        if soak is not None:
            soak.close()
        shutil.rmtree(root, ignore_errors=True)
    samples = soak.samples if soak else []
    records = soak.records if soak else []
    phase_s = soak.phase_s if soak else 0.0
    growth = compute_growth(phase1_samples, WARMUP_FRACTION * phase_s)
    summary = end.get("summary", {})
    accounting = summary.get("accounting", {})
    n = 8  # quickstart's rollout.n: samples per prompt
    lost = len(accounting.get("missing", [])) * n if accounting else None
    duplicated = (accounting.get("repeated_finish", 0) + accounting.get("repeated_issue", 0)) * n if accounting else None
    rss = growth["rss_mib_per_hour"]
    recovery: dict[str, float] = {}
    for r in records:
        if r["recovery_s"] is not None:
            recovery[r["kind"]] = max(recovery.get(r["kind"], 0.0), r["recovery_s"])
    payload = {
        "quick": quick,
        "status": status,
        "error": error,
        "minutes": end.get("minutes", (time.time() - soak.t0) / 60 if soak else 0.0),
        "minutes_requested": None if quick else minutes,
        "params": {"config": str(QUICKSTART), "overrides": soak.args if soak else [], "phase_s": phase_s,
                   "sample_s": soak.sample_s if soak else None, "warmup_fraction": WARMUP_FRACTION,
                   "faults": list(faults), "gap_s": soak.gap_s if soak else None,
                   "disk_full_method": soak.disk.method if soak and soak.disk else None,
                   "kill_every_s": KILL_EVERY_S, "killable": list(KILLABLE), "seed": SEED},
        "phase1": {"growth": growth, "queues": summarise_queues(phase1_samples)},
        "phase2": {"queues": summarise_queues([s for s in samples if s["phase"] == 2]),
                   "exit_code": end.get("exit_code"), "run_status": summary.get("status"),
                   "accounting": accounting, "run_faults": summary.get("faults"),
                   "dropped_prompts": (summary.get("prompts") or {}).get("dropped"),
                   "prompts": summary.get("prompts"), "policy_version": summary.get("policy_version"),
                   "metrics_steps_contiguous": end.get("metrics_steps_contiguous")},
        "faults": records,
        "samples": samples,
        "ratios": {
            "minutes": end.get("minutes"),
            "steps": samples[-1]["steps"] if samples else 0,
            "max_abs_rss_growth_mib_per_hour": max((abs(v) for v in rss.values()), default=None),
            "object_store_growth_mib_per_hour": growth["object_store_mib_per_hour"],
            "faults_injected": len(records),
            "faults_unrecovered": sum(not r["recovered"] for r in records),
            **{f"{kind}_faults": sum(r["kind"] == kind for r in records) for kind in faults},
            **{f"{kind}_recovery_s_max": v for kind, v in recovery.items()},
            "samples_lost": lost,
            "samples_duplicated": duplicated,
            "accounting_reconciles": accounting.get("reconciles"),
        },
    }
    label = "default" if tuple(faults) == DEFAULT_FAULTS else "faults"
    return publish_result(out_dir, "soak", payload, plot, label=label)


FAULT_COLOURS = {"stage": "grey", "driver": "red", "nan": "purple", "disk_full": "orange", "ckpt_truncate": "brown",
                 "engine": "blue"}


def plot(payload: dict[str, Any]) -> Any:
    fig, axes = new_figure(1, 4, size=(21.0, 4.5))
    samples = payload["samples"]
    faults = payload["faults"]
    ax = axes[0][0]
    for name in sorted({n for s in samples for n in s["memory_mib"]}):
        pts = [(s["t_s"] / 60, s["memory_mib"][name]["rss"]) for s in samples if name in s["memory_mib"]]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=name)
    for f in faults:
        ax.axvline(f["t_s"] / 60, color=FAULT_COLOURS.get(f["kind"], "black"), lw=0.8, ls="--")
    ax.set(title="RSS per process (dashed: faults)", xlabel="minutes", ylabel="MiB")
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
    ax = axes[0][3]
    for kind in FAULT_COLOURS:
        pts = [(f["t_s"] / 60, f["recovery_s"] if f["recovered"] else 0.0) for f in faults if f["kind"] == kind]
        if pts:
            ax.scatter(*zip(*pts, strict=True), color=FAULT_COLOURS[kind], label=kind)
    missed = [f for f in faults if not f["recovered"]]
    if missed:
        ax.scatter([f["t_s"] / 60 for f in missed], [0.0] * len(missed), marker="x", color="black", s=80,
                   label="not recovered")
    ax.set(title="recovery time per fault", xlabel="minutes", ylabel="seconds")
    if faults:
        ax.legend(fontsize=7)
    return fig
