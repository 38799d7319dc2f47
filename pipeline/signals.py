"""Stop signals (SIGINT, SIGTERM) of a launch, from its first line to its summary.

The launch installs ``STOP_SIGNALS`` before anything starts; the driver's loop takes
over while the stages run (``pipeline.runner``). Ray's start is the delicate part: a
stop sent to the launch's process group (Ctrl-C, a scheduler's SIGTERM) also reaches
the Ray processes ``ray.init`` starts, and a GCS server killed while the driver connects
to it aborts the driver inside Ray's C++ core ("Failed to connect to GCS"), leaving no
summary.

Guarantees:
- under ``hold_stop_signals`` SIGINT and SIGTERM are blocked in the calling thread, so a
  process or thread it starts meanwhile (Ray's GCS server, raylet, their threads) is
  born with them blocked: a stop sent to the process group later reaches the driver,
  which drains the run, not Ray's processes under it (Ray itself blocks SIGINT there);
- leaving it, ``on_release`` runs first (the launch's handlers back in place of
  Ray's), then the mask is restored, which delivers a signal held meanwhile to them;
- ``unblock_sigterm`` (every Ray worker's set-up hook) gives Ray's workers SIGTERM back,
  so a stage and the engine processes it starts stop on SIGTERM as usual;
- ``STOP_SIGNALS`` records the first signal for ``check`` to raise, nothing else.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pipeline.log import get_logger

log = get_logger(stage="driver")
STOP_SET = frozenset({signal.SIGINT, signal.SIGTERM})
# Ray runs it in every worker process of the job as it starts (runtime_env's
# worker_process_setup_hook), before any actor's code.
WORKER_SETUP_HOOK = "pipeline.signals.unblock_sigterm"


@contextlib.contextmanager
def hold_stop_signals(on_release: Callable[[], None] | None = None) -> Iterator[None]:
    """SIGINT and SIGTERM blocked in this thread while the body runs (module guarantees)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SET)
    try:
        yield
    finally:
        try:
            if on_release is not None:
                on_release()
        finally:
            # CPython runs the handlers of the signals this unblocks before it returns.
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock_sigterm() -> None:
    """SIGTERM unblocked in this thread (and the threads and processes it starts later)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def blocked_signals(pid: int | str = "self") -> set[signal.Signals]:
    """The signals blocked in process ``pid``'s main thread (Linux ``/proc``)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    return {s for s in signal.Signals if 0 < s.value <= 64 and mask >> (s.value - 1) & 1}


class RunInterrupted(RuntimeError):
    """A second SIGINT/SIGTERM forced the run down before it drained."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"run forced down by a second {signal_name}")
        self.signal_name = signal_name


class StopSignals:
    """The launch's SIGINT/SIGTERM handler before and between the driver loop's: the
    first signal is recorded (and logged) for ``check`` to raise at the next safe point.
    Nothing else: an exception raised inside ``ray.init`` is swallowed by it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                previous = signal.signal(sig, self._on_signal)
                if previous != self._on_signal:
                    self._previous.setdefault(sig, previous)

    def reinstall(self) -> None:
        """``install`` again if installed (``ray.init`` replaces the SIGTERM handler)."""
        if self.installed:
            self.install()

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def uninstall(self) -> None:
        """The handlers from before the first ``install``, and no signal recorded."""
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
        self._previous.clear()
        self.received = None

    def record(self, sig: signal.Signals) -> None:
        if self.received is None:
            self.received = sig.name
            log.warning("stopping", signal=sig.name, detail="before the stages run: stopping now")

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.record(signal.Signals(signum))

    def check(self) -> None:
        """Raise ``RunInterrupted`` if a signal came."""
        if self.received is not None:
            raise RunInterrupted(self.received)


STOP_SIGNALS = StopSignals()
