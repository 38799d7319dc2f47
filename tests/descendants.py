"""Every process a launch starts, for tests that stop it: seen while it runs (a process
that has ended cannot be found from its parent), checked for survivors afterwards; and
the rollout's vLLM engine core among them, for tests that kill it."""

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


def is_engine_core(proc: psutil.Process) -> bool:
    """vLLM titles its engine core process ``VLLM::EngineCore`` where ``setproctitle`` is
    installed; without it (the GPU image) the process is a multiprocessing spawn child."""
    try:
        cmdline = " ".join(proc.cmdline())
        return "EngineCore" in proc.name() or "EngineCore" in cmdline or "spawn_main" in cmdline
    except psutil.Error:
        return False


def find_engine_core(rollout_pid: int) -> psutil.Process:
    """The rollout actor's vLLM engine core process."""
    children = psutil.Process(rollout_pid).children(recursive=True)
    for child in children:
        if is_engine_core(child):
            return child
    raise AssertionError(f"no EngineCore process under the rollout: {[c.cmdline()[:3] for c in children]}")
