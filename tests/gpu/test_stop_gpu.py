"""On one GPU: a scheduler's SIGTERM to the launch's process group while the stages set
up, at the moment the rollout's vLLM engine core process exists (it is loading the
model and taking its share of GPU memory; start-up is the longest stretch of a GPU run
before its first step). The launch stops there with exit 143 and a summary saying there
is nothing to resume, no process it started is left, and the GPU memory they held is
free again. The same on the CPU: ``tests/e2e/test_signals.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.descendants import Descendants, is_engine_core
from tests.gpu.test_pipeline_gpu import LOG_DIR, ROOT


def gpu_used_mib() -> int:
    """GPU 0's used memory as the driver reports it (this process holds no CUDA context)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip())


def test_sigterm_while_the_engine_starts_stops_the_launch_and_frees_the_gpu(tmp_path):
    run_dir = tmp_path / "stop"
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / "stop-during-start.log"
    before = gpu_used_mib()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # Ray starts inside the run
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "launch", "--config", str(ROOT / "configs" / "gpu_small.yaml"),
             f"run.dir={run_dir}", "run.steps=50", "run.progress=false", "rollout.engine_core=subprocess"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    launched = Descendants(proc.pid)
    try:
        while not launched.any_running(is_engine_core):  # polled every 0.2 s (the test's timeout bounds it)
            assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before the engine started: {log}"
            time.sleep(0.2)
            launched.look()
        assert not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text().strip()
        stopped_at = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        while proc.poll() is None:  # every process the launch starts before it ends
            launched.look()
            time.sleep(0.2)
        stop_s = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    print(f"stopped {stop_s:.1f} s after SIGTERM; GPU used before {before} MiB, after {gpu_used_mib()} MiB")
    assert proc.returncode == 143, text[-4000:]
    assert "Failed to connect to GCS" not in text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == "SIGTERM" and summary["steps"] == 0, summary
    assert summary["resume"] is None and "nothing to resume" in summary["resume_why"], summary
    alive = launched.alive()
    assert not alive, [(p.pid, p.cmdline()[:3]) for p in alive]
    # The engine's and the trainer's GPU memory is back (the driver frees it as each process ends).
    deadline = time.monotonic() + 30
    while gpu_used_mib() > before + 512 and time.monotonic() < deadline:
        time.sleep(1)
    assert gpu_used_mib() <= before + 512, (before, gpu_used_mib())
