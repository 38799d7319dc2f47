"""NVIDIA MPS for stage processes that share a GPU (``placement.mps``).

Two processes on one GPU take turns on it in time slices: while vLLM decodes the few
long samples left in a step, the trainer's kernels wait for their slice although most of
the GPU is idle. Under MPS (the Multi-Process Service) one server runs the kernels of
every process that connects to it side by side, so the trainer's passes fill what the
rollout leaves. Measured on one H100 with the long-tail job (docs/placement.md, "One GPU:
MPS"): streaming 1.35-1.54x its samples per second without MPS, lock-step 1.27-1.29x.

The launch decides (``decide_mps``, from the placement plan, before any actor starts),
then ``gpu_sharing`` starts a control daemon of the run's own (its pipe directory private
to the run, so no other process joins it), checks that a CUDA client connects through
it, gives every stage that uses a GPU the two variables that point its CUDA at that
daemon (the stage's engine processes inherit them), and quits the daemon when the run
ends. A daemon the user already runs (``CUDA_MPS_PIPE_DIRECTORY`` set, or one at the
default ``/tmp/nvidia-mps``) is used as it is and left running.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pipeline.config.base import ConfigError
from pipeline.log import get_logger

log = get_logger(stage="driver")

CONTROL = "nvidia-cuda-mps-control"
MPS_LOG_DIR = "logs/mps"  # under the run directory: the daemon's control.log and server.log
DEFAULT_PIPE_DIR = Path("/tmp/nvidia-mps")
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
READY_S = 10.0  # the control socket appears within this after `-d`
QUIT_S = 30.0  # `quit` waits for the servers' clients to leave
PROBE_S = 60.0  # the probe's CUDA context, through the server it makes the daemon start

# A CUDA client in a process of its own: its context connects to the MPS server (error
# 805, CUDA_ERROR_MPS_CONNECTION_FAILED, where it cannot). No torch: a second or less.
PROBE = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
for call in (lambda: cuda.cuInit(0), lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0),
             lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)):
    rc = call()
    if rc:
        sys.exit(f"CUDA error {rc}")
cuda.cuDevicePrimaryCtxRelease(dev)
"""


def existing_daemon(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The pipe directory of an MPS daemon already serving this machine's processes:
    ``CUDA_MPS_PIPE_DIRECTORY``'s, else the default, where its control socket is."""
    found = Path(environ[PIPE_ENV]) if environ.get(PIPE_ENV) else DEFAULT_PIPE_DIR
    return found if (found / "control").exists() else None


def shares_a_gpu(plan: Any) -> bool:
    """True when two stage processes of ``plan`` run on one GPU: an index planned for two
    actors, or a fractional Ray GPU count."""
    used = Counter(g for s in plan.stages.values() for g in s.gpus)
    return any(n > 1 for n in used.values()) or any(0 < s.num_gpus < 1 for s in plan.stages.values())


def decide_mps(setting: bool | str, plan: Any, colocated: bool, address: str | None,
               environ: Mapping[str, str] = os.environ, which: Any = None) -> tuple[str | None, str | None]:
    """What the run does about MPS, and the plan's note saying why: ``("start", note)``
    (a daemon of the run's own), ``("existing", note)`` (the user's), or ``(None, note)``.
    ``placement.mps: true`` that cannot be honoured is a ``ConfigError`` (exit 2, before
    any actor starts); ``auto`` then runs without MPS and says why."""
    forced = setting is True
    if setting is False or not plan.available_gpus:
        return None, "placement.mps: not used: no stage runs on a GPU" if forced else None
    if colocated:
        return None, "placement.mps: not used: colocated stages take turns on the GPU (vLLM sleeps while the trainer steps)"
    if not forced and not shares_a_gpu(plan):
        return None, None
    found = existing_daemon(environ)
    if found is not None:
        return "existing", f"placement.mps: stages share their GPU through the MPS daemon at {found} (already running)"
    if address or environ.get("RAY_ADDRESS"):
        why = ("the run joins a Ray cluster, whose GPU nodes it does not start daemons on: run "
               f"`{CONTROL} -d` on each of them")
    elif (which or shutil.which)(CONTROL) is None:
        why = f"{CONTROL} is not on PATH (it comes with the NVIDIA driver)"
    else:
        return "start", "placement.mps: stages that share a GPU run their kernels side by side (NVIDIA MPS)"
    if forced:
        raise ConfigError(f"placement.mps: true, but {why}; set placement.mps: auto or false")
    return None, f"placement.mps: not used: {why}; stages that share a GPU take turns on it"


class MpsDaemon:
    """A control daemon of the run's own. Its pipe and log directories are in a fresh
    temporary directory (a short path: it holds UNIX sockets); the logs are appended to
    those in ``keep_logs`` when it stops."""

    def __init__(self, keep_logs: Path) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="conveyor-mps-"))
        self.pipe_dir, self.log_dir, self.keep_logs = self.root / "pipe", self.root / "log", Path(keep_logs)
        self.pipe_dir.mkdir()
        self.log_dir.mkdir()
        self.env = {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    def start(self) -> None:
        """Start it and check that a CUDA client connects through it; where either fails
        (or hangs), quit it and raise ``RuntimeError`` naming the step."""
        try:
            self._start()
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            self.stop()
            raise RuntimeError(str(exc)) from exc

    def _start(self) -> None:
        env = {**os.environ, **self.env}
        # Its output to a file, not a pipe: the daemon it forks could hold a pipe open.
        out = self.log_dir / "start.log"
        with out.open("w") as f:
            rc = subprocess.run([CONTROL, "-d"], env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                timeout=READY_S, check=False, start_new_session=True).returncode
        if rc != 0:
            raise RuntimeError(f"{CONTROL} -d exited {rc}: {out.read_text().strip()[-300:]}")
        deadline = time.monotonic() + READY_S
        while not (self.pipe_dir / "control").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{CONTROL} made no control socket in {self.pipe_dir} in {READY_S:g} s")
            time.sleep(0.05)
        # A session of its own, as the daemon's and quit's: Ctrl-C at the terminal is the
        # launch's to handle (pipeline/signals.py), not a failure of MPS.
        probe = subprocess.run([sys.executable, "-c", PROBE], env=env, text=True, capture_output=True,
                               timeout=PROBE_S, check=False, start_new_session=True)
        if probe.returncode != 0:
            raise RuntimeError(f"a CUDA client could not connect through MPS: {probe.stderr.strip()[-300:]} "
                               f"(the daemon's log: {self.keep_logs})")

    def stop(self) -> None:
        """Quit the daemon (it waits for its servers' clients to leave, at most ``QUIT_S``).
        Where that fails, its pipe directory stays, so that a later quit can reach it."""
        try:
            done = subprocess.run([CONTROL], input="quit\n", env={**os.environ, **self.env}, text=True,
                                  capture_output=True, timeout=QUIT_S, check=False, start_new_session=True)
            failed = done.returncode != 0 and (self.pipe_dir / "control").exists()
            why = f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            failed, why = True, str(exc)
        if failed:
            log.warning("mps_quit_failed", error=why, pipe_dir=str(self.pipe_dir),
                        hint=f"CUDA_MPS_PIPE_DIRECTORY={self.pipe_dir} {CONTROL} <<< quit")
            return
        self._remove()

    def _remove(self) -> None:
        # Appended, not copied over: a resumed run's launches keep one log each in turn.
        with contextlib.suppress(OSError):
            self.keep_logs.mkdir(parents=True, exist_ok=True)
            for log_file in sorted(self.log_dir.iterdir()):
                with (self.keep_logs / log_file.name).open("a") as kept:
                    kept.write(log_file.read_text(errors="replace"))
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def gpu_sharing(action: str | None, forced: bool, log_dir: Path) -> Iterator[dict[str, str]]:
    """The environment that GPU stages get for the run's MPS (empty: none), the daemon
    started before and stopped after when ``action`` is ``"start"``. A daemon that will
    not start stops the run under ``placement.mps: true`` and is passed over (a warning)
    under ``auto``."""
    if action == "existing":  # a daemon the user runs, left as it is
        found = existing_daemon()
        yield {PIPE_ENV: str(found)} if found is not None else {}
        return
    if action != "start":
        yield {}
        return
    try:
        daemon = MpsDaemon(log_dir)
        daemon.start()
        failure = None
    except (OSError, RuntimeError) as exc:
        failure = str(exc)  # handled below, outside this block: the run is not its consequence
    if failure is not None:
        if forced:
            raise ConfigError(f"placement.mps: true, but MPS did not start: {failure}; set placement.mps: auto or false")
        log.warning("mps_not_started", error=failure, hint="stages that share a GPU take turns on it")
        yield {}
        return
    log.info("mps_started", pipe_dir=str(daemon.pipe_dir), logs=str(daemon.keep_logs))
    try:
        yield dict(daemon.env)
    finally:
        daemon.stop()
