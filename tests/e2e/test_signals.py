"""A launched run stopped by SIGTERM (what a scheduler sends): it drains, writes its
summary, exits with 128 + the signal number and leaves no process behind (Ray's, vLLM's
or the stages'). SIGINT takes the same handler: the soak's smoke test
(``tests/ray_local/test_bench_smoke.py``) stops its resumed run with it and checks the
exit status 130, the interrupted status and the accounting."""

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

ROOT = Path(__file__).parents[2]


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


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143)])
def test_signal_stops_the_run_cleanly(tmp_path, sig, code):
    run_dir = tmp_path / "run"
    # RAY_ADDRESS=local: a cluster of its own, not the test session's.
    env = {**os.environ, "RAY_ADDRESS": "local"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "launch", "--config", "configs/quickstart.yaml", "run.steps=500",
         f"run.dir={run_dir}", "run.progress=false", "run.tensorboard=false"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        _wait_for_steps(run_dir, proc, 3)
        spawned = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in " ".join(p.cmdline()) for p in spawned if p.is_running())
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err[-2000:]
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
