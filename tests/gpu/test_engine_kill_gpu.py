"""On one GPU: ``configs/gpu_small.yaml`` with the rollout's vLLM engine core in a process
of its own (``rollout.engine_core: subprocess``), killed (SIGKILL) after step 3. The
kill frees the engine's GPU memory; the rollout builds a new engine in its place, loads
the weights it served over CUDA IPC again (or, where the trainer's two-slot ring has
moved on since, starts from the checkpoint and takes the newest version), generates
again what was in flight, and the run
completes every step with every prompt id trained exactly once; the rollout actor
itself never dies. The same on CPU: ``tests/e2e/test_engine_kill.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from bench.soak import count_steps, read_status
from pipeline.metrics import read_metrics
from tests.descendants import find_engine_core
from tests.gpu.test_pipeline_gpu import LOG_DIR, ROOT

STEPS = 12
PROMPTS_PER_STEP = 32  # configs/gpu_small.yaml


def test_a_killed_engine_core_on_the_gpu_is_rebuilt_and_the_run_completes(tmp_path):
    run_dir = tmp_path / "engine-kill"
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / "engine-kill.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "launch", "--config", str(ROOT / "configs" / "gpu_small.yaml"),
             f"run.dir={run_dir}", f"run.steps={STEPS}", "run.progress=false", "rollout.engine_core=subprocess"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    try:
        while True:  # until step 3, polled every 0.5 s (the test's own timeout bounds it)
            assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the kill; see {log}"
            status = read_status(run_dir)
            if status.get("processes") and count_steps(run_dir) >= 3:
                break
            time.sleep(0.5)
        core = find_engine_core(status["processes"]["rollout:0"][1])
        dead = [core, *core.children(recursive=True)]
        os.kill(core.pid, signal.SIGKILL)
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    rollout_log = (run_dir / "logs" / "rollout.log").read_text()
    print("\n".join(line for line in rollout_log.splitlines()
                    if any(k in line for k in ("engine_died", "engine_restarted", "served_weights_gone"))))
    assert proc.returncode == 0, log.read_text()[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy_version"] == STEPS
    assert summary["trainer"]["weight_transport"] == "cuda_ipc"
    faults = summary["faults"]
    assert faults["engine_restarts"]["rollout:0"] >= 1 and faults["restarts"] == {}
    accounting = summary["accounting"]
    assert accounting["reconciles"], accounting
    assert accounting["missing"] == [] and accounting["repeated_finish"] == 0
    assert summary["prompts"]["trained"] == STEPS * PROMPTS_PER_STEP and summary["prompts"]["in_flight"] == 0
    # The death is found by what generates then (generated again) or by the next update.
    print(f"micro-batches generated again: {summary['rollout'][0]['reissued_batches']}")
    served = summary["served"]["rollout:0"]
    assert served["version"] == STEPS and served["verified"], served
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert rows[-1]["rollout/engine_restarts"] >= 1
    assert "engine_restarted" in rollout_log
    alive = [p for p in dead if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.cmdline()[:3]) for p in alive]
