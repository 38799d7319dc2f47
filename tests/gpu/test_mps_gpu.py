"""``placement.mps: true`` on one GPU: the quickstart streams with its rollout and trainer
connected through an MPS daemon of the run's own, which the launch quits at the end.

(The daemon's gain is measured by ``bench longtail`` rows with ``placement.mps``; here,
that the launch's daemon serves the stage processes and leaves nothing behind.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.mps import MPS_LOG_DIR
from tests.gpu.test_pipeline_gpu import LOG_DIR, QUICKSTART, _conveyor

STEPS = 6


def test_the_quickstart_streams_through_the_runs_own_mps_daemon(tmp_path):
    run_dir = tmp_path / "mps"
    done = _conveyor("launch", "--config", str(QUICKSTART), f"run.dir={run_dir}", f"run.steps={STEPS}",
                     "run.progress=false", "placement.mps=true", log=LOG_DIR / "mps.log")
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mps"] is True and summary["mode"] == "async"
    assert summary["samples"]["reconciles"] and summary["steps"] == STEPS
    assert all(s["verified"] and s["version"] == STEPS for s in summary["served"].values())
    control = (run_dir / MPS_LOG_DIR / "control.log").read_text()
    # Its clients: the launch's probe, then the stage processes (the trainer, and vLLM's
    # engine core or the rollout actor that holds the engine): three processes at least.
    clients = set(re.findall(r"NEW CLIENT (\d+) from user", control))
    assert len(clients) >= 3, control[-3000:]
    pipe = Path(re.search(r"using socket (\S+)/control", control).group(1))
    assert not pipe.exists(), f"the run's MPS pipe directory {pipe} outlived it"
    assert "placement.mps: stages that share a GPU run their kernels side by side" in done.stdout + done.stderr
