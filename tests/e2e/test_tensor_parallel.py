"""A tensor-parallel rollout on CPU: vLLM with ``tensor_parallel_size`` 2 runs one worker
process per CPU-core group (``VLLM_CPU_OMP_THREADS_BIND`` from ``plan_cpu_binding``), and
every published version is loaded by both workers, folded into one fingerprint and
served, through the whole quickstart pipeline."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.e2e.test_pipeline import QUICKSTART

STEPS = 6


@pytest.mark.slow  # about 80 s: vLLM's CPU tensor parallelism; the TP plan's unit tests run in every run
def test_quickstart_with_a_tensor_parallel_rollout_serves_every_version(tmp_path):
    assert len(os.sched_getaffinity(0)) >= 2, "two CPU cores are needed for two vLLM workers"
    run_dir = tmp_path / "run"
    # INFO from vLLM: its worker processes name themselves in the rollout's log.
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "launch", "--config", str(QUICKSTART), f"run.dir={run_dir}",
         f"run.steps={STEPS}", "run.progress=false", "run.tensorboard=false", "rollout.tensor_parallel_size=2"],
        cwd=QUICKSTART.parents[1], env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples"]["reconciles"] and summary["samples"]["trained"] == STEPS * 8 * 8
    served = summary["served"]["rollout:0"]
    assert served["version"] == summary["policy_version"] == STEPS and served["verified"], served
    log = (run_dir / "logs" / "rollout.log").read_text()
    workers = set(re.findall(r"\((Worker\S*) pid=(\d+)\)", log))
    assert len({pid for _, pid in workers}) == 2, sorted(workers)
