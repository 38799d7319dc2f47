"""The quickstart, unchanged, on one GPU: a short streaming run with its trainer input
recorded, then ``conveyor replay --verify`` of that GPU recording.

The run goes through the command line in a subprocess, as a user starts it, so its log
can be checked for shutdown noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.metrics import read_metrics

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
STEPS = 20
LOG_DIR = Path(os.environ.get("CONVEYOR_GPU_LOG_DIR", ROOT / "runs" / "gpu-tests"))


def _conveyor(*args: str, log: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """``conveyor ARGS`` in a subprocess; its output goes to ``log`` (stdout, then stderr)
    as it runs, so a launch stopped by a time limit leaves what it printed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    err_log = log.with_name(log.name + ".stderr")
    with log.open("w") as out, err_log.open("w") as err:
        code = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, stdout=out, stderr=err,
                              text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    stdout, stderr = log.read_text(), err_log.read_text()
    log.write_text(stdout + "\n----- stderr -----\n" + stderr)
    err_log.unlink()
    return subprocess.CompletedProcess(args, code, stdout, stderr)


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("quickstart")
    done = _conveyor("launch", "--config", str(QUICKSTART), f"run.dir={run_dir}", f"run.steps={STEPS}",
                     "run.progress=false", "record.edges=[reference->trainer]", "record.state_every=5",
                     log=LOG_DIR / "quickstart.log")
    assert done.returncode == 0, done.stderr[-4000:]
    return run_dir, json.loads((run_dir / "summary.json").read_text()), read_metrics(run_dir / "metrics.jsonl"), done


def test_quickstart_accounting_reconciles(quickstart_run):
    _, summary, rows, _ = quickstart_run
    s = summary["samples"]
    assert s["reconciles"] and s["in_flight"] == 0
    assert s["produced"] == s["trained"] + sum(s["dropped"].values())
    assert s["trained"] == STEPS * 8 * 8  # steps x prompts_per_step x n
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert max(r["staleness/max"] for r in rows) <= 1
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)


def test_quickstart_serves_the_trainers_weights_over_cuda_ipc(quickstart_run):
    _, summary, _, _ = quickstart_run
    for worker, state in summary["served"].items():
        assert state["version"] == summary["policy_version"] == STEPS, worker
        assert state["verified"], worker
    trainer = summary["trainer"]
    print(f"transport {trainer['weight_transport']}, publish {trainer['weight_publish_s']}, served {summary['served']}")
    assert trainer["weight_transport"] == "cuda_ipc", "one GPU: the trainer should publish over cuda_ipc"


def test_quickstart_shuts_down_quietly(quickstart_run):
    run_dir, _, _, done = quickstart_run
    # The console, and every stage's log file (its engine processes write there too).
    text = done.stdout + done.stderr + "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert "engine started" in (run_dir / "logs" / "rollout.log").read_text()
    for noise in ("EngineDeadError", "force killing"):
        assert noise not in text, f"{noise!r} in the run's output (see {LOG_DIR / 'quickstart.log'})"


def test_replay_of_the_gpu_recording_verifies(quickstart_run):
    run_dir, _, _, _ = quickstart_run
    done = _conveyor("replay", str(run_dir / "recording"), "--from-step", "6", "--steps", "4", "--verify",
                     log=LOG_DIR / "replay.log")
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "reproduce" in done.stdout


def test_a_mixture_of_experts_serves_the_trainers_experts(tmp_path):
    """The tiny Qwen3-MoE in lock-step on the GPU: the weights go over cuda_ipc one expert
    at a time, vLLM re-runs its post-load processing for its fused experts, and every
    token the trainer scores was sampled with the very weights it trains, so its
    log-probs must be the engine's. A fingerprint cannot see an expert's rows put in
    another expert; the log-probs can."""
    steps = 4
    run_dir = tmp_path / "moe"
    done = _conveyor("launch", "--config", str(QUICKSTART), f"run.dir={run_dir}", f"run.steps={steps}",
                     "run.progress=false", "model.tiny.architecture=qwen3_moe", "dataflow.async_execution=false",
                     "dataflow.max_staleness=0", "rollout.max_tokens=4", "rollout.temperature=1.0",
                     "reward.function=tests.e2e.test_architectures:score_digit_share",
                     log=LOG_DIR / "moe.log")
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer"]["weight_transport"] == "cuda_ipc"
    for worker, state in summary["served"].items():
        assert state["version"] == steps and state["verified"], worker
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == steps and all(r["actor/grad_norm"] > 0 for r in rows)
    print("moe ratio/mismatch", [(r["actor/ratio_mean"], r["actor/logp_mismatch"]) for r in rows])
    for r in rows:
        assert abs(r["actor/ratio_mean"] - 1.0) < 1e-2 and r["actor/logp_mismatch"] < 1e-2, r
