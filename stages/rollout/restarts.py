"""Engine restarts: the rollout's account of its engine's deaths (pure, no engine).

A backend whose engine process died raises ``EngineDied`` (``stages.rollout.base``); the
rollout stage then builds a new backend in place and generates the micro-batches that
were in flight again, under their own prompt ids. This module decides when that happens.

Guarantees:
- one death is counted once, however many calls saw it fail: each engine has an epoch,
  a call remembers the epoch it started under, and a death reported under an older
  epoch than the current engine's was already answered by a rebuild;
- the ``limit + 1``-th death raises ``EngineRestartsExceeded``, naming
  ``rollout.max_engine_restarts``; nothing is rebuilt past it;
- ``find_engine_death`` sees an ``EngineDied`` inside exception groups (a task group of
  generations), and only where every failure in the group is one.
"""

from __future__ import annotations

from stages.rollout.base import EngineDied


class EngineRestartsExceeded(RuntimeError):
    """More engine deaths than ``rollout.max_engine_restarts`` allows."""


def find_engine_death(exc: BaseException) -> EngineDied | None:
    """The ``EngineDied`` that ``exc`` is or holds (every leaf of an exception group
    being one), else None."""
    if isinstance(exc, EngineDied):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        died, rest = exc.split(EngineDied)
        if died is not None and rest is None:
            while isinstance(died, BaseExceptionGroup):
                died = died.exceptions[0]
            return died  # type: ignore[return-value]
    return None


class EngineRestarts:
    """The deaths of one worker's engine and the epoch of the engine serving now."""

    def __init__(self, limit: int, worker: str) -> None:
        self.limit = limit
        self.worker = worker
        self.count = 0  # rebuilds done (or begun)
        self.epoch = 0  # bumped when a rebuilt engine takes over

    def is_answered(self, epoch: int) -> bool:
        """A death seen by a call begun under ``epoch`` is already answered by a rebuild."""
        return epoch != self.epoch

    def admit(self, death: EngineDied) -> int:
        """Count a death; the restart's number (1, 2, ...). Raises
        ``EngineRestartsExceeded`` past the limit."""
        if self.count >= self.limit:
            raise EngineRestartsExceeded(
                f"{self.worker}: the rollout engine died again ({death}) after {self.count} restart(s); "
                f"rollout.max_engine_restarts is {self.limit}"
            ) from death
        self.count += 1
        return self.count

    def took_over(self) -> None:
        """The rebuilt engine serves from now on."""
        self.epoch += 1
