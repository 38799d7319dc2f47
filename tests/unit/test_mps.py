"""``placement.mps``: when the launch uses NVIDIA MPS, and the daemon's life around a run.

The daemon here is a fake ``nvidia-cuda-mps-control`` (a shell script put first on PATH)
that does what the launch relies on: ``-d`` makes the control socket in
``$CUDA_MPS_PIPE_DIRECTORY`` and returns, ``quit`` on stdin removes it. The CUDA client
probe is replaced by one that checks the same socket from its own process. The real
daemon runs in tests/gpu/test_mps_gpu.py.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pipeline import mps
from pipeline.config import ConfigError
from pipeline.dataflow import DataFlow
from pipeline.placement import PlacementPlan, StagePlacement

FAKE_CONTROL = """#!/bin/sh
# Fake nvidia-cuda-mps-control for tests: records its calls beside the pipe directory.
echo "$@" >> "$FAKE_MPS_CALLS"
[ -n "$FAKE_MPS_FAIL" ] && { echo "fake: cannot start" >&2; exit 1; }
if [ "$1" = "-d" ]; then
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"; echo "fake daemon started" > "$CUDA_MPS_LOG_DIRECTORY/control.log"; exit 0
fi
read cmd; echo "stdin:$cmd" >> "$FAKE_MPS_CALLS"
[ -n "$FAKE_MPS_QUIT_FAIL" ] && { echo "fake: quit refused" >&2; exit 1; }
[ "$cmd" = quit ] && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
"""

# The fake client: connects where the real one would, i.e. finds the control socket.
FAKE_PROBE = "import os, sys; sys.exit(0 if os.path.exists(os.environ['CUDA_MPS_PIPE_DIRECTORY'] + '/control') else 5)"


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / mps.CONTROL
    tool.write_text(FAKE_CONTROL)
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_CALLS", str(calls))
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", tmp_path / "no-default-daemon")
    monkeypatch.setattr(mps, "PROBE", FAKE_PROBE)
    return calls


def plan(*gpus_per_stage: tuple[int, ...], available: int = 1) -> PlacementPlan:
    return PlacementPlan(available, {f"s{i}": StagePlacement(gpus=g, share=(0.5,) * len(g))
                                     for i, g in enumerate(gpus_per_stage)})


SHARED = plan((0,), (0,))  # rollout and trainer on GPU 0
APART = plan((0,), (1,), available=2)
no_tool = {"which": lambda name: None}
with_tool = {"which": lambda name: f"/usr/bin/{name}"}


def test_auto_starts_mps_only_where_two_stage_processes_share_a_gpu_outside_colocate() -> None:
    assert mps.decide_mps("auto", SHARED, False, None, environ={}, **with_tool)[0] == "start"
    assert mps.decide_mps("auto", APART, False, None, environ={}, **with_tool) == (None, None)
    action, note = mps.decide_mps("auto", SHARED, True, None, environ={}, **with_tool)
    assert action is None and "colocated stages take turns" in note
    assert mps.decide_mps(False, SHARED, False, None, environ={}, **with_tool) == (None, None)
    assert mps.decide_mps("auto", plan(available=0), False, None, environ={}, **with_tool) == (None, None)
    assert mps.decide_mps(True, plan(available=0), False, None, environ={}, **with_tool) == (
        None, "placement.mps: not used: no stage runs on a GPU")
    # A fractional Ray GPU count shares a GPU too.
    fractional = PlacementPlan(1, {"a": StagePlacement(num_gpus=0.5), "b": StagePlacement(num_gpus=0.5)})
    assert mps.decide_mps("auto", fractional, False, None, environ={}, **with_tool)[0] == "start"
    # true starts it even where no GPU is shared (a reward model beside the trainer's ranks, say).
    assert mps.decide_mps(True, APART, False, None, environ={}, **with_tool)[0] == "start"


def test_auto_says_why_not_where_mps_cannot_start_and_true_stops_the_launch_naming_the_key() -> None:
    action, note = mps.decide_mps("auto", SHARED, False, None, environ={}, **no_tool)
    assert action is None and "nvidia-cuda-mps-control is not on PATH" in note and "take turns" in note
    with pytest.raises(ConfigError, match=r"placement.mps: true, but nvidia-cuda-mps-control is not on PATH.*"
                                          r"set placement.mps: auto or false"):
        mps.decide_mps(True, SHARED, False, None, environ={}, **no_tool)
    action, note = mps.decide_mps("auto", SHARED, False, "ray://head:10001", environ={}, **with_tool)
    assert action is None and "joins a Ray cluster" in note
    with pytest.raises(ConfigError, match="joins a Ray cluster"):
        mps.decide_mps(True, SHARED, False, None, environ={"RAY_ADDRESS": "head:6379"}, **with_tool)


def test_a_daemon_the_user_runs_is_used_as_it_is(tmp_path, monkeypatch) -> None:
    named = tmp_path / "srv-mps"
    named.mkdir()
    # CUDA_MPS_PIPE_DIRECTORY set but no daemon there: none is running.
    assert mps.decide_mps("auto", SHARED, False, None, environ={mps.PIPE_ENV: str(named)}, **no_tool)[0] is None
    (named / "control").touch()
    action, note = mps.decide_mps("auto", SHARED, False, None, environ={mps.PIPE_ENV: str(named)}, **no_tool)
    assert action == "existing" and str(named) in note
    default = tmp_path / "nvidia-mps"
    default.mkdir()
    (default / "control").touch()
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", default)
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    assert mps.decide_mps("auto", SHARED, False, None, environ={}, **no_tool)[0] == "existing"
    with mps.gpu_sharing("existing", False, tmp_path / "logs") as env:
        assert env == {mps.PIPE_ENV: str(default)}
    assert (default / "control").exists()  # not ours to stop


def test_the_runs_daemon_serves_the_run_and_is_quit_after_it(fake_control, tmp_path) -> None:
    kept = tmp_path / "run" / mps.MPS_LOG_DIR
    with mps.gpu_sharing("start", False, kept) as env:
        pipe = Path(env[mps.PIPE_ENV])
        assert (pipe / "control").exists() and Path(env[mps.LOG_ENV], "control.log").exists()
        assert len(str(pipe / "control")) < 100  # a UNIX socket's path must stay short
    assert not pipe.exists() and not Path(env[mps.LOG_ENV]).exists()
    assert (kept / "control.log").read_text() == "fake daemon started\n"  # the log kept in the run
    assert fake_control.read_text().split() == ["-d", "stdin:quit"]
    with mps.gpu_sharing("start", False, kept):  # a resumed run's next launch
        pass
    assert (kept / "control.log").read_text() == "fake daemon started\n" * 2  # both launches' logs


def test_a_daemon_that_fails_is_passed_over_under_auto_and_stops_a_forced_launch(fake_control, tmp_path,
                                                                                 monkeypatch) -> None:
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    with mps.gpu_sharing("start", False, tmp_path / "logs") as env:
        assert env == {}
    with pytest.raises(ConfigError, match=r"placement.mps: true, but MPS did not start: .*exited 1: fake: cannot start"):
        with mps.gpu_sharing("start", True, tmp_path / "logs"):
            pytest.fail("the run must not start")


def test_a_daemon_no_client_can_reach_is_quit_and_the_run_goes_on_without_it(fake_control, tmp_path,
                                                                            monkeypatch) -> None:
    monkeypatch.setattr(mps, "PROBE", "import sys; sys.exit('CUDA error 805')")
    with mps.gpu_sharing("start", False, tmp_path / "logs") as env:
        assert env == {}
    assert fake_control.read_text().split() == ["-d", "stdin:quit"]
    with pytest.raises(ConfigError, match="a CUDA client could not connect through MPS: CUDA error 805"):
        with mps.gpu_sharing("start", True, tmp_path / "logs"):
            pass


def test_the_gpu_env_goes_to_the_nodes_that_use_a_gpu_only() -> None:
    df = DataFlow()
    df.add_node("source", "m:Source")
    df.add_node("rollout", "m:Rollout", "source", num_gpus=0.5)
    df.add_node("reward", "m:Reward", "rollout")
    df.add_node("trainer", "m:Trainer", "reward")
    df.nodes["trainer"].gpu_bundles, df.nodes["trainer"].gpu_shares = (0,), (0.5,)
    df.set_gpu_env({mps.PIPE_ENV: "/tmp/x"})
    assert {n: node.env for n, node in df.nodes.items()} == {
        "source": {}, "rollout": {mps.PIPE_ENV: "/tmp/x"}, "reward": {}, "trainer": {mps.PIPE_ENV: "/tmp/x"}}


def test_a_probe_that_hangs_is_given_up_and_the_daemon_quit(fake_control, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(mps, "PROBE", "import time; time.sleep(30)")
    monkeypatch.setattr(mps, "PROBE_S", 0.5)
    with mps.gpu_sharing("start", False, tmp_path / "logs") as env:
        assert env == {}
    assert fake_control.read_text().split() == ["-d", "stdin:quit"]


def test_a_daemon_that_refuses_to_quit_keeps_its_pipe_for_a_later_quit(fake_control, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_MPS_QUIT_FAIL", "1")
    with mps.gpu_sharing("start", False, tmp_path / "logs") as env:
        pipe = Path(env[mps.PIPE_ENV])
    assert (pipe / "control").exists()  # still reachable: CUDA_MPS_PIPE_DIRECTORY=pipe ... quit
    assert fake_control.read_text().split() == ["-d", "stdin:quit"]
