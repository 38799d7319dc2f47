"""On one GPU: the automatic placement plan (every stage on GPU 0, vLLM's memory share
planned beside trainer and reference), then a run continued with ``--resume`` from its
checkpoint on the GPU: steps continue, the prompt-id accounts reconcile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline.metrics import read_metrics

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
LOG_DIR = Path(os.environ.get("CONVEYOR_GPU_LOG_DIR", ROOT / "runs" / "gpu-tests"))


def _conveyor(*args: str, log: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    (LOG_DIR / log).write_text(done.stdout + "\n----- stderr -----\n" + done.stderr)
    return done


def test_status_prints_the_one_gpu_plan():
    done = _conveyor("status", "--config", str(QUICKSTART), log="status.log")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 GPU(s) found" in done.stdout and "vLLM gpu_memory_utilization" in done.stdout, done.stdout


def test_a_gpu_run_resumes_from_its_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    common = ["run.progress=false", "train.checkpoint_every=3"]
    first = _conveyor("launch", "--config", str(QUICKSTART), f"run.dir={run_dir}", "run.steps=6", *common,
                      log="resume-first.log")
    assert first.returncode == 0, first.stderr[-4000:]
    assert "rollout -> [0]" in first.stdout + first.stderr  # the launch line shows the plan
    resumed = _conveyor("launch", "--resume", str(run_dir), "run.steps=10", *common, log="resume-second.log")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert steps == list(range(10)), steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["policy_version"] == 10 and summary["accounting"]["reconciles"], summary["accounting"]
    assert all(s["verified"] and s["version"] == 10 for s in summary["served"].values())
