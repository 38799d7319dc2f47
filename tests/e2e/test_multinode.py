"""A real two-node Ray cluster on this machine: ``ray start --head`` and a second
``ray start --address``, each with its own temp dir and a custom resource. The quickstart,
launched with ``RAY_ADDRESS`` set, places the rollout on one node and the trainer on the
other through ``placement.<stage>.resources`` and must complete with every sample
accounted for. Weights travel through Ray's object store (the ``shm`` transport writes a
/dev/shm file only on the consuming engine's own host, ``cuda_ipc`` needs one GPU for the
whole cluster), so nothing relies on a path both nodes see.

The nodes are stopped in a ``finally`` by the pids of their own processes (found by
their temp dirs and port): ``ray stop`` would stop every Ray cluster on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_node(temp_dir: str, *args: str, env: dict[str, str]) -> None:
    """``ray start`` with ``args``; on a busy machine a raylet may miss Ray's fixed 30 s
    start-up window: what it left is stopped and the start tried again, three times at most."""
    attempts = 3
    for _ in range(attempts):
        out = subprocess.run([RAY, "start", *args, f"--temp-dir={temp_dir}", "--disable-usage-stats"],
                             capture_output=True, text=True, timeout=600, env=env)
        if out.returncode == 0:
            return
        _stop_nodes([temp_dir])
    raise AssertionError(f"ray start {' '.join(args)} failed {attempts} times:\n{out.stdout}\n{out.stderr[-3000:]}")


def _stop_nodes(markers: list[str]) -> None:
    """Kill the processes of the nodes this test started (and nothing else)."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] not in mine and any(m in cmdline for m in markers):
            try:
                proc.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass


def _node_of_each_stage(run_dir: Path, temp_dirs: dict[str, str]) -> dict[str, str]:
    """Stage -> the node its replica 0 ran on: each node's raylet keeps the logs of the
    workers it started (``python-core-worker-<id>_<pid>.log``) under its own temp dir."""
    processes = json.loads((run_dir / "status.json").read_text())["processes"]
    placed = {}
    for key, (_, pid) in processes.items():
        stage, _, replica = key.partition(":")
        if replica == "0":
            hits = [node for node, tmp in temp_dirs.items()
                    if any(Path(tmp).glob(f"session_*/logs/python-core-worker-*_{pid}.log"))]
            placed[stage] = hits[0] if len(hits) == 1 else f"unknown ({hits})"
    return placed


@pytest.mark.slow  # about 50 s: a second Ray node; the multi-node plan's unit tests run in every run
def test_quickstart_runs_on_two_nodes_with_rollout_and_trainer_apart(tmp_path):
    port = _free_port()
    # Short paths: Ray's socket paths live under the temp dir and must stay below 108 bytes.
    head_tmp, worker_tmp = tempfile.mkdtemp(prefix="cvh"), tempfile.mkdtemp(prefix="cvw")
    address = f"127.0.0.1:{port}"
    # One authentication mode for every process of this cluster: a token file in ~/.ray
    # would otherwise turn it on for the head only.
    base = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    base.pop("RAY_ADDRESS", None)
    env = {**base, "RAY_ADDRESS": address}
    try:
        _start_node(head_tmp, "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=4",
                    '--resources={"node_a": 1}', "--include-dashboard=false", env=base)
        _start_node(worker_tmp, f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=4",
                    '--resources={"node_b": 1}', env=base)
        run_dir = tmp_path / "run"
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "launch", "--config", "configs/quickstart.yaml",
             f"run.dir={run_dir}", "run.steps=3", "run.progress=false", "run.tensorboard=false",
             "placement.rollout.resources={node_b: 0.01}", "placement.trainer.resources={node_a: 0.01}"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 3
        assert summary["samples"]["reconciles"]
        placed = _node_of_each_stage(run_dir, {"node_a": head_tmp, "node_b": worker_tmp})
        assert placed["rollout"] == "node_b" and placed["trainer"] == "node_a", placed
        # The weights crossed nodes: the rollout confirmed, verified, a version the trainer
        # published after its first step (sync_interval 1, staleness 1: step 2 or 3).
        served = summary["served"]["rollout:0"]
        assert served["verified"] and served["version"] >= 2, served
    finally:
        _stop_nodes([head_tmp, worker_tmp, f":{port}"])
        shutil.rmtree(head_tmp, ignore_errors=True)
        shutil.rmtree(worker_tmp, ignore_errors=True)
