"""A local cluster started by ``init_ray`` is shut down without Ray's graceful wait: its
processes were born with SIGTERM blocked (``pipeline.signals.hold_stop_signals``), so a
SIGTERM would only wait out Ray's second per process before the SIGKILL. Nothing under
them (agents, workers) outlives the shutdown."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import signal

    import psutil
    import ray
    from ray._private import worker

    from pipeline.runner import init_ray
    from pipeline.signals import blocked_signals

    init_ray()
    node = worker._global_node
    processes = [info.process for infos in node.all_processes.values() for info in infos]
    assert processes, "the local cluster started no processes"
    ray.get(ray.remote(lambda: 1).remote())  # a worker process under the raylet
    below = [c for p in processes for c in psutil.Process(p.pid).children(recursive=True)]
    assert below, "no process under the cluster's own"
    assert all(signal.SIGTERM in blocked_signals(p.pid) for p in processes)
    terminated = []
    for p in processes:
        p.terminate = lambda p=p: terminated.append(p.pid)
    ray.shutdown()
    assert not terminated, f"SIGTERM sent to {terminated}, which block it"
    alive = [p.pid for p in processes if p.poll() is None] + [c.pid for c in below if c.is_running()]
    assert not alive, f"left running: {alive}"
    print("ok", len(processes))
""")


def test_a_local_cluster_is_killed_at_once_and_nothing_is_left():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2] == "ok" and int(done.stdout.split()[-1]) >= 2
