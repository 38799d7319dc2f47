"""Failed stage actors (kill -9 of their processes) in a launched quickstart run.

- with ``run.auto_resume`` a killed trainer: the run resumes from its newest checkpoint
  by itself; then rollout, reward and reference are killed one after another: Ray
  restarts each, the micro-batches it held are delivered again, the run completes every
  step and the source's and the trainer's independent accounts of the prompt ids agree
  (nothing lost, nothing trained twice); the killed rollout's vLLM engine does not
  survive it. The rollout's engine core runs in a process of its own here
  (``rollout.engine_core: subprocess``, as under tensor parallelism): the default one
  runs in the actor's process and dies with it, leaving nothing to reap.
- without ``run.auto_resume`` a killed trainer stops the run (exit status 1) with the
  resume command; that run generates with the HF backend (its subject is the trainer).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from bench.soak import count_steps, read_status

ROOT = Path(__file__).parents[2]
ARGS = ["run.progress=false", "run.tensorboard=false", "train.checkpoint_every=2"]


def _launch(run_dir: Path, steps: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "RAY_ADDRESS": "local"}  # a cluster of its own, not the test session's
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "launch", "--config", "configs/quickstart.yaml",
         f"run.steps={steps}", f"run.dir={run_dir}", *ARGS, *extra],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def _wait(proc: subprocess.Popen, run_dir: Path, what: str, ready, timeout: float = 600) -> dict:
    """Poll status.json until ``ready(status)`` (every 0.2 s, up to ``timeout`` s)."""
    for _ in range(int(timeout / 0.2)):
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}"
        status = read_status(run_dir)
        if status.get("processes") and ready(status):
            return status
        time.sleep(0.2)
    raise AssertionError(f"not reached: {what}")


def _kill(status: dict, stage: str) -> psutil.Process:
    pid = status["processes"][stage][1]
    proc = psutil.Process(pid)
    os.kill(pid, signal.SIGKILL)
    return proc


def _finish(proc: subprocess.Popen, timeout: float = 900) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return err


@pytest.mark.slow  # ~2 min; every run kills a trainer here (below), resumes (test_resume) and restarts fakes (ray_local)
def test_killed_trainer_resumes_and_killed_stage_actors_restart(tmp_path):
    # 40 steps: the tiny model steps in ~0.2 s and the driver sees each restart on its
    # tick, so the last kill must come well before the stages run out of work (a stage
    # killed after its last micro-batch is not restarted, nothing asks it to run again).
    run_dir, steps = tmp_path / "run", 40
    proc = _launch(run_dir, steps, "run.auto_resume=true", "rollout.engine_core=subprocess")
    engines: list[psutil.Process] = []
    try:
        # The trainer first, after the checkpoint of step 2: the run resumes by itself.
        status = _wait(proc, run_dir, "the trainer at step 3", lambda s: count_steps(run_dir) >= 3)
        trainer = status["processes"]["trainer:0"]
        _kill(status, "trainer:0")
        # Then, in the resumed run, each stage once the one before has been restarted
        # (its restart counted) and the run has gone on: one failure at a time.
        restarted: dict[str, int] = {}
        for stage, at_step in (("rollout:0", 5), ("reward:0", 7), ("reference:0", 9)):
            status = _wait(proc, run_dir, f"{stage} at step {at_step}",
                           lambda s, n=at_step, r=restarted: (s["processes"]["trainer:0"] != trainer
                                                              and count_steps(run_dir) >= n and s.get("restarts") == r))
            if stage == "rollout:0":
                engines = psutil.Process(status["processes"][stage][1]).children(recursive=True)
                assert engines, "the rollout actor has no vLLM engine process"
            _kill(status, stage)
            restarted = {**restarted, stage: 1}
        err = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy_version"] == steps
    assert [json.loads(r)["step"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()] == list(range(steps))
    faults = summary["faults"]
    assert [r["stage"] for r in faults["auto_resumes"]] == ["trainer"]
    assert faults["restarts"] == {"rollout:0": 1, "reward:0": 1, "reference:0": 1}
    # Nothing lost, nothing trained twice: the source's issued prompt ids and the
    # trainer's trained or dropped ones, two separate reports, are the same set, each once.
    accounting = summary["accounting"]
    assert accounting["reconciles"], accounting
    assert accounting["missing"] == [] and accounting["repeated_finish"] == 0
    assert summary["prompts"]["trained"] == steps * 8 and summary["prompts"]["in_flight"] == 0
    # The killed rollout's engine was reaped, not left orphaned.
    alive = [p for p in engines if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()[:3]) for p in alive]


def test_killed_trainer_stops_the_run_with_the_resume_command(tmp_path):
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, 50, "rollout.backend=hf")
    try:
        status = _wait(proc, run_dir, "a checkpoint", lambda s: (run_dir / "checkpoints").is_dir() and count_steps(run_dir) >= 3)
        _kill(status, "trainer:0")
        err = _finish(proc, timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    assert "stage 'trainer' failed: actor died" in err
    assert f"resume with: conveyor launch --resume {run_dir}" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["stage"] == "trainer"
    assert summary["resume"] == f"conveyor launch --resume {run_dir}"
