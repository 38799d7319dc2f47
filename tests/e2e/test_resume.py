"""A run killed with SIGKILL (no chance to clean up) resumes from its newest checkpoint:
steps continue without a gap or a repeat, and every prompt is trained exactly once. It
generates with the HF backend: the subject is the driver's and the trainer's state."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.checkpoint import find_latest_checkpoint

ROOT = Path(__file__).parents[2]
STEPS = 16
ARGS = ["run.progress=false", "run.tensorboard=false", "train.checkpoint_every=3", "train.keep_checkpoints=2",
        "rollout.backend=hf"]


def _conveyor(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "RAY_ADDRESS": "local"}  # a cluster of its own, not the test session's
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kw)


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_killed_run_resumes_exactly_once(tmp_path):
    run_dir = tmp_path / "run"
    first = _conveyor("launch", "--config", "configs/quickstart.yaml", f"run.steps={STEPS}", f"run.dir={run_dir}",
                      *ARGS, start_new_session=True)
    try:
        # Killed as soon as the trainer has written its first checkpoint (step 3). The
        # trainer's own files, not metrics.jsonl: the driver writes those rows on its
        # tick, several of the tiny model's steps behind the trainer.
        for _ in range(6000):  # polled for up to 10 minutes
            if find_latest_checkpoint(run_dir) is not None:
                break
            assert first.poll() is None, "the run ended before it was killed"
            time.sleep(0.1)
        else:
            raise AssertionError("the run wrote no checkpoint")
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the driver, its Ray cluster and every stage, at once
        first.wait()
    found = find_latest_checkpoint(run_dir)
    assert found is not None
    checkpoint_version = found[1].version
    assert checkpoint_version % 3 == 0 and checkpoint_version < STEPS, checkpoint_version  # killed mid-run

    # A changed learning setting is refused before anything starts.
    refused = _conveyor("launch", "--resume", str(run_dir), "train.lr=0.1")
    _, err = refused.communicate(timeout=300)
    assert refused.returncode == 2 and "train.lr" in err

    resumed = _conveyor("launch", "--resume", str(run_dir), *ARGS)
    _, err = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, err[-3000:]

    steps = [r["step"] for r in _rows(run_dir)]
    assert steps == list(range(STEPS)), steps  # no gap, no repeat
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy_version"] == STEPS
    assert summary["prompts"]["trained"] == STEPS * 8 and summary["prompts"]["in_flight"] == 0
    # The source's and the trainer's accounts of the prompt ids agree across the resume.
    accounting = summary["accounting"]
    assert accounting["reconciles"], accounting
    assert accounting["issued"] == accounting["finished"] == STEPS * 8 + sum(summary["prompts"]["dropped"].values())
    # Exactly once: the final checkpoint's done set is prompts 0..STEPS*8-1 with nothing above,
    # and as many prompts were trained as the set holds (a repeat would count twice).
    _, final, _ = find_latest_checkpoint(run_dir)
    dropped = sum(final.dropped.values())
    assert final.version == STEPS and final.trained_prompts == STEPS * 8
    assert final.consumed.frontier == STEPS * 8 + dropped and final.consumed.above == []


@pytest.mark.parametrize("flag", ["", "run.overwrite=true"])
def test_a_run_dir_in_use_is_refused_unless_overwritten(tmp_path, flag):
    from pipeline.checkpoint import prepare_run_dir
    from pipeline.config import ConfigError

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    if not flag:
        with pytest.raises(ConfigError, match=r"already holds a run .*--resume"):
            prepare_run_dir(run_dir, None, overwrite=False)
        assert (run_dir / "metrics.jsonl").is_file()  # left exactly as it was
    else:
        prepare_run_dir(run_dir, None, overwrite=True)
        assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
