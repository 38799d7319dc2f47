"""A launched run stopped by SIGTERM (what a scheduler sends), to the driver or to its
whole process group, mid-run or while Ray starts: it drains (or, before the stages run,
stops at once), writes its summary, exits with 128 + the signal number and leaves no
process behind (Ray's or the stages'). Ray's processes, started with the stop signals
held (``pipeline/signals.py``), ignore a SIGTERM sent to the group; the stage actors have
it back. SIGINT takes the same handler (``slow``: Ctrl-C while Ray starts, and the soak's
smoke test in ``tests/ray_local/test_bench_smoke.py``: exit status 130, the accounting).
The runs generate with the HF backend: on CPU vLLM's engine core runs in the rollout's
process, starting none of its own (test_rollout_backends), and the start-up stops come
before any engine starts."""

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

from pipeline.signals import blocked_signals
from tests.descendants import Descendants

ROOT = Path(__file__).parents[2]
LAUNCH = [sys.executable, "-m", "pipeline.cli", "launch", "--config", "configs/quickstart.yaml", "run.steps=500",
          "run.progress=false", "run.tensorboard=false", "rollout.backend=hf"]


def _wait_for_steps(run_dir: Path, proc: subprocess.Popen, steps: int, timeout: float = 600) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before the signal (exit {proc.returncode})")
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.5)
    raise AssertionError(f"no {steps} steps within {timeout}s")


def _check_masks(run_dir: Path, spawned: list[psutil.Process]) -> None:
    """Ray's processes hold SIGTERM (they were started under the held mask); the stage
    actors, and the engine processes the rollout started, have it back."""
    gcs = [p for p in spawned if "gcs_server" in " ".join(p.cmdline())]
    assert gcs and signal.SIGTERM in blocked_signals(gcs[0].pid)
    stages = json.loads((run_dir / "status.json").read_text())["processes"]
    for name, (_, pid) in stages.items():
        assert signal.SIGTERM not in blocked_signals(pid), name
        for child in psutil.Process(pid).children(recursive=True):
            assert signal.SIGTERM not in blocked_signals(child.pid), (name, child.cmdline()[:2])


@pytest.mark.parametrize("to", ["driver", pytest.param("process group", marks=pytest.mark.slow)])
def test_sigterm_stops_the_run_cleanly(tmp_path, to):
    """The group variant is ``slow`` (a second run of a minute or more): its start-up
    sibling below runs in every tier."""
    run_dir = tmp_path / "run"
    # RAY_ADDRESS=local: a cluster of its own, not the test session's.
    env = {**os.environ, "RAY_ADDRESS": "local"}
    proc = subprocess.Popen([*LAUNCH, f"run.dir={run_dir}"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for_steps(run_dir, proc, 3)
        spawned = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in " ".join(p.cmdline()) for p in spawned if p.is_running())
        _check_masks(run_dir, spawned)
        if to == "driver":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    sig = signal.SIGTERM
    assert proc.returncode == 143, err[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == sig.name
    assert json.loads((run_dir / "status.json").read_text())["state"] == "interrupted"
    # Drained, not abandoned: the source's issued prompt ids and the trainer's trained or
    # dropped ones (two separate reports) are the same set, each id once.
    accounting = summary["accounting"]
    assert accounting["reconciles"], accounting
    assert accounting["issued"] == accounting["finished"] == summary["prompts"]["admitted"]
    assert summary["samples"]["in_flight"] == 0
    assert 3 <= summary["steps"] < 500
    assert (run_dir / "checkpoint" / "config.json").is_file()
    # A resumable checkpoint of the last version, and the resume command in the summary.
    assert (run_dir / "checkpoints" / f"step-{summary['policy_version']:08d}" / "state.msgpack").is_file()
    assert summary["resume"] == f"conveyor launch --resume {run_dir}"
    alive = [p for p in spawned if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()[:3]) for p in alive]


@pytest.mark.slow  # SIGINT takes SIGTERM's handler; a stop while Ray starts: the test below, in every run
def test_ctrl_c_while_ray_and_the_stages_start_stops_the_launch(tmp_path):
    """Ctrl-C as a terminal sends it (to the whole process group) right after the
    `launch` line, while Ray starts (``ray.init`` swallows a KeyboardInterrupt) or the
    stages set up: the launch stops there, exit 130, with a summary saying there is
    nothing to resume, and no process behind."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "launch", "--config", "configs/quickstart.yaml", "run.steps=500",
         f"run.dir={run_dir}", "run.progress=false", "run.tensorboard=false"],
        cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        lines = []
        for line in proc.stdout:  # the driver logs to stdout
            lines.append(line)
            if " launch " in line:
                break
        time.sleep(1.0)
        spawned = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, "".join(lines)[-2000:] + out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGINT" and summary["steps"] == 0
    assert summary["resume"] is None and "nothing to resume" in summary["resume_why"]
    assert summary["totals"]["launches"] == 1
    alive = [p for p in spawned if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()[:3]) for p in alive]


def test_sigterm_to_the_process_group_while_ray_starts_stops_the_launch(tmp_path):
    """A scheduler's SIGTERM to the launch's process group as soon as Ray's GCS server
    runs, while the driver connects to it: Ray's processes hold it, the driver takes it
    once Ray is up and stops there (exit 143) with a summary, and no process is left."""
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    # No RAY_ADDRESS: Ray starts in the run itself, after the launch line.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log, "w") as out:
        proc = subprocess.Popen([*LAUNCH, f"run.dir={run_dir}"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    launched = Descendants(proc.pid)
    try:
        while not launched.any_running(lambda p: "gcs_server" in " ".join(p.cmdline())):
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
            launched.look()
        os.killpg(proc.pid, signal.SIGTERM)
        while proc.poll() is None:  # every process the launch starts before it ends
            launched.look()
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert proc.returncode == 143, text[-3000:]
    assert "Failed to connect to GCS" not in text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM" and summary["steps"] == 0
    assert summary["resume"] is None and "nothing to resume" in summary["resume_why"]
    alive = launched.alive()
    assert not alive, [(p.pid, p.cmdline()[:3]) for p in alive]
