"""Stop signals held while Ray starts (``pipeline/signals.py``, ``pipeline.runner.init_ray``):
what the mask blocks, what a process started meanwhile inherits, and where a signal
that came meanwhile goes once the mask is restored. Ray itself is replaced by a fake
start (``fake_ray_start``) that does what ``ray.init`` does to signals: it replaces the
SIGTERM handler and starts a process."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest

import pipeline.runner as runner
from pipeline.signals import STOP_SIGNALS, RunInterrupted, blocked_signals, hold_stop_signals, unblock_sigterm

STOP = {signal.SIGINT, signal.SIGTERM}


def current_mask() -> set[signal.Signals]:
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, []))


def send_to_this_thread(sig: signal.Signals) -> None:
    """Thread-directed: held by this thread's mask, never taken by another thread."""
    signal.pthread_kill(threading.get_ident(), sig)


def pending(pid: int) -> set[signal.Signals]:
    """Signals sent to process ``pid`` and not yet delivered (its ``ShdPnd``)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("ShdPnd:"))
    return {s for s in signal.Signals if 0 < s.value <= 64 and mask >> (s.value - 1) & 1}


@pytest.fixture(autouse=True)
def clean_state():
    saved = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    handlers = {s: signal.getsignal(s) for s in STOP}
    yield
    STOP_SIGNALS.uninstall()
    for s, h in handlers.items():
        signal.signal(s, h)
    signal.pthread_sigmask(signal.SIG_SETMASK, saved)


def test_the_hold_blocks_both_and_restores_the_mask_it_found():
    signal.pthread_sigmask(signal.SIG_SETMASK, {signal.SIGINT})  # as Ray's own processes have it
    with hold_stop_signals():
        assert STOP <= current_mask()
    assert current_mask() == {signal.SIGINT}


def test_a_process_started_in_the_hold_ignores_a_sigterm_one_started_after_does_not():
    with hold_stop_signals():
        held = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    free = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert STOP <= blocked_signals(held.pid)
        assert not STOP & blocked_signals(free.pid)
        held.send_signal(signal.SIGTERM)
        assert signal.SIGTERM in pending(held.pid)  # held, not acted on: it lives on
        assert held.poll() is None
        free.send_signal(signal.SIGTERM)
        assert free.wait() == -signal.SIGTERM
    finally:
        held.kill()
        free.kill()
        held.wait()
        free.wait()


def test_a_signal_held_meanwhile_reaches_the_handler_put_back_on_release():
    got: list[str] = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append("first"))

    def replaced_by_ray() -> None:
        signal.signal(signal.SIGTERM, lambda s, f: got.append("ray's"))
        send_to_this_thread(signal.SIGTERM)
        assert got == []  # held

    with hold_stop_signals(on_release=lambda: signal.signal(signal.SIGTERM, lambda s, f: got.append("put back"))):
        replaced_by_ray()
    assert got == ["put back"]  # delivered as the mask was restored, once


def test_the_mask_is_restored_when_the_release_fails():
    def fail() -> None:
        raise RuntimeError("release failed")

    with pytest.raises(RuntimeError, match="release failed"), hold_stop_signals(on_release=fail):
        pass
    assert not STOP & current_mask()


def test_a_worker_gets_sigterm_back_and_keeps_rays_sigint_block():
    signal.pthread_sigmask(signal.SIG_SETMASK, STOP)  # what a worker inherits from a held raylet
    unblock_sigterm()
    assert current_mask() == {signal.SIGINT}


def fake_ray_start(signum: signal.Signals | None = None, exit_code: int | None = None):
    """``_start_ray`` as ``ray.init`` treats signals: its own SIGTERM handler, then
    ``signum`` arriving while Ray starts, or its handler's ``sys.exit(exit_code)``."""
    started: list[subprocess.Popen] = []

    def start(address: str | None) -> None:
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(s))
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        if signum is not None:
            send_to_this_thread(signum)
        if exit_code is not None:
            sys.exit(exit_code)

    return start, started


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_ray_starts_stops_the_launch_right_after(monkeypatch, sig):
    start, started = fake_ray_start(sig)
    monkeypatch.setattr(runner, "_start_ray", start)
    monkeypatch.setattr(runner.ray, "is_initialized", lambda: False)
    STOP_SIGNALS.install()
    try:
        with pytest.raises(RunInterrupted) as caught:
            runner.init_ray()
        assert caught.value.signal_name == sig.name and STOP_SIGNALS.received == sig.name
        # The launch's handler is back in place of Ray's; Ray's process holds both.
        assert signal.getsignal(signal.SIGTERM) == STOP_SIGNALS._on_signal
        assert STOP <= blocked_signals(started[0].pid)
    finally:
        started[0].kill()
        started[0].wait()


def test_rays_own_handler_exiting_inside_ray_init_is_a_stop_too(monkeypatch):
    """A thread started before Ray (a tracker's), whose mask is not held, can take the
    signal while Ray's handler is in place: its ``sys.exit(15)`` becomes a stop."""
    start, started = fake_ray_start(exit_code=signal.SIGTERM)
    monkeypatch.setattr(runner, "_start_ray", start)
    monkeypatch.setattr(runner.ray, "is_initialized", lambda: False)
    STOP_SIGNALS.install()
    try:
        with pytest.raises(RunInterrupted, match="SIGTERM"):
            runner.init_ray()
    finally:
        started[0].kill()
        started[0].wait()


def test_outside_a_launch_nothing_is_converted(monkeypatch):
    """Without the launch's handlers (a test, a bench) Ray's exit stands, and no stop
    is raised for a start that saw no signal."""
    start, started = fake_ray_start(exit_code=signal.SIGTERM)
    monkeypatch.setattr(runner, "_start_ray", start)
    monkeypatch.setattr(runner.ray, "is_initialized", lambda: False)
    with pytest.raises(SystemExit):
        runner.init_ray()
    quiet, more = fake_ray_start()
    monkeypatch.setattr(runner, "_start_ray", quiet)
    runner.init_ray()
    for p in started + more:
        p.kill()
        p.wait()
