"""Out-of-memory recognition and recovery by halving.

Guarantees:
- ``is_oom_error`` is true for exactly the errors a smaller batch can cure: torch's
  ``OutOfMemoryError``, ``MemoryError``, and ``RuntimeError``s whose message says the
  allocator ran out of memory (also when raised ``from`` one of those). It is false for
  ``OomUnrecoverable``, so nested recovery never retries a verdict already given.
- Recovery (``OomRecovery`` and its two drivers) processes every sample of a batch
  exactly once: a piece either succeeds and its result is kept, or fails as a whole and
  only that piece is split in two and retried; results come back in the batch's order.
  A piece that cannot be split any further and still fails raises ``OomUnrecoverable``
  naming the stage. ``fn`` must therefore leave no trace of a failed call (for a
  trainer: no gradients accumulated by a forward/backward that ran out of memory).
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, Literal, TypeVar

import msgspec

T = TypeVar("T")
R = TypeVar("R")


# ------------------------------------------------------------------ OOM recognition

class OomUnrecoverable(RuntimeError):
    """A piece that cannot be split any further still ran out of memory."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


_OOM_MESSAGES = ("out of memory", "can't allocate memory")  # CUDA/HIP/XPU; DefaultCPUAllocator


def _torch_oom_types() -> tuple[type, ...]:
    torch = sys.modules.get("torch")  # no torch loaded: no torch error can exist
    if torch is None:
        return ()
    found = (getattr(torch, "OutOfMemoryError", None), getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None))
    return tuple(t for t in found if isinstance(t, type))


def is_oom_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or the error it was raised ``from``) is an out-of-memory error."""
    torch_types = _torch_oom_types()
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OomUnrecoverable):
            return False
        if isinstance(current, MemoryError) or (torch_types and isinstance(current, torch_types)):
            return True
        if isinstance(current, RuntimeError) and any(m in str(current).lower() for m in _OOM_MESSAGES):
            return True
        current = current.__cause__
    return False


def freeze_setup_heap() -> None:
    """Collect once, then move every object alive now out of the collector's generations
    (``gc.freeze``), for a process whose set-up is done: what it built (modules, the
    model, the engine) lives as long as the process, and a full collection walks all of
    it each time. A colocated trainer collects twice a step (``free_cached_memory``,
    before it hands its cached GPU memory to vLLM), and a full collection over the
    trainer's set-up objects costs a large share of the handover
    (docs/performance/colocate.md). Objects made later are collected as before; frozen ones are still
    freed when their last reference goes, only a cycle among them is not."""
    gc.collect()
    gc.freeze()


def free_cached_memory() -> None:
    """Collect garbage cycles and hand the CUDA allocator's cached blocks back."""
    gc.collect()
    torch = sys.modules.get("torch")  # not loaded: there is no CUDA cache to empty
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------- OOM recovery

class OomEvent(msgspec.Struct, frozen=True, kw_only=True):
    """``oom``: a piece of ``size`` ran out of memory and was split into ``pieces``.
    ``recovered``: the whole batch finished after ``count`` such errors."""

    stage: str
    kind: Literal["oom", "recovered"]
    error: str = ""
    size: int | None = None
    pieces: int = 0
    count: int = 0


class OomRecovery(Generic[T, R]):
    """Pure work list for one batch: ``next_piece`` → run it → ``succeeded(result)`` or
    ``failed(oom_error)``; ``results`` holds the pieces' results in batch order.

    ``split(piece, 2)`` must return pieces that together hold exactly the piece's
    samples, and raise ``ValueError`` for a piece that cannot be split. With ``size``
    (e.g. GRPO groups per piece), a pending piece at least as large as one that already
    ran out of memory is split before it runs, instead of failing the same way again.
    """

    def __init__(
        self,
        batch: T,
        split: Callable[[T, int], Sequence[T]],
        *,
        stage: str,
        size: Callable[[T], int] | None = None,
    ) -> None:
        self.stage = stage
        self.results: list[R] = []
        self.events: list[OomEvent] = []
        self._split = split
        self._size = size
        self._pending: deque[T] = deque([batch])
        self._running: list[T] = []  # at most one piece: the one handed out last
        self._failed_size: int | None = None

    @property
    def oom_count(self) -> int:
        return len(self.events)

    def next_piece(self) -> T | None:
        """The next piece to run, or ``None`` when every piece has succeeded."""
        if self._running:
            raise RuntimeError("next_piece: report the running piece first (succeeded/failed)")
        while self._pending:
            piece = self._pending.popleft()
            if self._should_presplit(piece):
                self._pending.extendleft(reversed(list(self._split(piece, 2))))
                continue
            self._running.append(piece)
            return piece
        return None

    def _should_presplit(self, piece: T) -> bool:
        if self._size is None or self._failed_size is None:
            return False
        size = self._size(piece)
        return size > 1 and size >= self._failed_size

    def succeeded(self, result: R) -> None:
        if not self._running:
            raise RuntimeError("succeeded: no piece is running")
        self._running.pop()
        self.results.append(result)

    def failed(self, error: BaseException) -> OomEvent:
        """Split the running piece in two and queue the halves first; raise
        ``OomUnrecoverable`` when it cannot be split."""
        if not self._running:
            raise RuntimeError("failed: no piece is running")
        piece = self._running.pop()
        size = self._size(piece) if self._size is not None else None
        text = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        try:
            halves = list(self._split(piece, 2))
        except ValueError as exc:
            raise OomUnrecoverable(
                self.stage,
                f"stage {self.stage!r}: out of memory on a piece that cannot be split further "
                f"({exc}) after {self.oom_count} halving(s); last error: {text}. Lower the "
                f"sequence lengths or give the stage more memory.",
            ) from error
        if len(halves) < 2:
            raise OomUnrecoverable(
                self.stage,
                f"stage {self.stage!r}: out of memory and split returned {len(halves)} piece(s); last error: {text}",
            ) from error
        self._pending.extendleft(reversed(halves))
        if size is not None:
            self._failed_size = size if self._failed_size is None else min(self._failed_size, size)
        event = OomEvent(stage=self.stage, kind="oom", error=text, size=size, pieces=len(halves))
        self.events.append(event)
        return event

    def recovered_event(self) -> OomEvent | None:
        """The closing event once every piece succeeded after at least one OOM."""
        if self._pending or self._running or not self.events:
            return None
        return OomEvent(stage=self.stage, kind="recovered", count=self.oom_count)


def _finish(
    rec: OomRecovery[T, R], merge: Callable[[list[R]], Any] | None, on_event: Callable[[OomEvent], None] | None
) -> Any:
    done = rec.recovered_event()
    if done is not None and on_event is not None:
        on_event(done)
    return merge(rec.results) if merge is not None else rec.results


async def run_with_oom_recovery(
    fn: Callable[[T], R] | Callable[[T], Awaitable[R]],
    batch: T,
    *,
    split: Callable[[T, int], Sequence[T]],
    stage: str,
    merge: Callable[[list[R]], Any] | None = None,
    size: Callable[[T], int] | None = None,
    on_event: Callable[[OomEvent], None] | None = None,
    free_memory: Callable[[], None] = free_cached_memory,
    in_thread: bool = True,
) -> Any:
    """Run ``fn`` over ``batch``, halving pieces on OOM; returns ``merge(results)`` or
    the list of per-piece results (see the module guarantees). A coroutine function is
    awaited; a plain one runs in a worker thread (``in_thread``) so the actor's event
    loop keeps answering control calls while it computes."""
    rec: OomRecovery[T, R] = OomRecovery(batch, split, stage=stage, size=size)
    while (piece := rec.next_piece()) is not None:
        try:
            if inspect.iscoroutinefunction(fn) or not in_thread:
                result = fn(piece)
            else:
                result = await asyncio.to_thread(fn, piece)
            if inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            event = rec.failed(exc)
        else:
            rec.succeeded(result)
            continue
        # Only after the except block has dropped the error and its traceback (whose
        # frames hold the failed piece's tensors) can that memory actually be freed.
        free_memory()
        if on_event is not None:
            on_event(event)
    return _finish(rec, merge, on_event)
