"""Every process a launch starts, for tests that stop it: seen while it runs (a process
that has ended cannot be found from its parent), checked for survivors afterwards."""

from __future__ import annotations

from collections.abc import Callable

import psutil


class Descendants:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, psutil.Process] = {}

    def look(self) -> None:
        """Record the launch's descendants now (nothing once it has exited)."""
        try:
            self.seen.update((p.pid, p) for p in psutil.Process(self.pid).children(recursive=True))
        except psutil.Error:
            pass

    def any_running(self, match: Callable[[psutil.Process], bool]) -> bool:
        """Whether a recorded process still runs and ``match`` holds for it."""
        for p in list(self.seen.values()):
            try:
                if p.is_running() and match(p):
                    return True
            except psutil.Error:
                pass
        return False

    def alive(self) -> list[psutil.Process]:
        """The recorded processes still running (zombies are gone in all but name)."""
        return [p for p in self.seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
