"""Bounded queues between stages, over Ray's object store.

Guarantees:
- An item on a queue is an ``ObjectRef`` to a micro-batch; the queue actor holds the
  reference only (wrapped in a list so Ray does not resolve it), never the tensors.
- ``put`` suspends the producer while the queue holds ``bound`` items: backpressure,
  never a silent drop. The depth never exceeds the bound.
- Items leave in the order they entered, so each producer's items keep their order.
- ``close()`` is called once by each producer; when all producers have closed and the
  queue is empty, every ``get`` returns ``END`` (end-of-stream) to every consumer.
- Depth, put-wait and get-wait are measured inside the queue actor (``stats``).
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

import ray


class _End:
    """End-of-stream marker (a class so it compares equal across processes)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _End)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "END"


END = _End()


class QueueClosed(RuntimeError):
    """``put`` on a queue whose producers have all closed it."""


@ray.remote(num_cpus=0, max_concurrency=1000)
class QueueActor:
    """The state of one edge: a deque of wrapped references guarded by a condition."""

    def __init__(self, name: str, bound: int, producers: int = 1) -> None:
        self.name = name
        self.bound = bound
        self._items: collections.deque[list[Any]] = collections.deque()
        self._cond = asyncio.Condition()
        self._open_producers = producers
        self._closed = False
        self._puts = 0
        self._gets = 0
        self._put_wait_s = 0.0
        self._get_wait_s = 0.0
        self._max_depth = 0
        self._depth_area = 0.0  # integral of depth over time, for the mean depth
        self._last_change = time.monotonic()
        self._created = self._last_change

    def _touch(self) -> None:
        now = time.monotonic()
        self._depth_area += len(self._items) * (now - self._last_change)
        self._last_change = now

    async def put(self, wrapped: list[Any]) -> float:
        """Enqueue ``[ref]``; returns the seconds the producer waited for room."""
        t0 = time.monotonic()
        async with self._cond:
            if self._closed:
                raise QueueClosed(f"queue {self.name}: put after all producers closed it")
            await self._cond.wait_for(lambda: len(self._items) < self.bound)
            self._touch()
            self._items.append(wrapped)
            self._puts += 1
            self._max_depth = max(self._max_depth, len(self._items))
            self._cond.notify_all()
        waited = time.monotonic() - t0
        self._put_wait_s += waited
        return waited

    async def get(self) -> Any:
        """Dequeue the next ``[ref]``, or ``END`` once closed and drained."""
        t0 = time.monotonic()
        async with self._cond:
            await self._cond.wait_for(lambda: self._items or self._closed)
            if self._items:
                self._touch()
                item = self._items.popleft()
                self._gets += 1
                self._cond.notify_all()
            else:
                item = END
        self._get_wait_s += time.monotonic() - t0
        return item

    async def close(self) -> int:
        """One producer is done; returns how many producers are still open."""
        async with self._cond:
            self._open_producers = max(0, self._open_producers - 1)
            if self._open_producers == 0:
                self._closed = True
                self._cond.notify_all()
        return self._open_producers

    def stats(self) -> dict[str, float]:
        self._touch()
        elapsed = max(time.monotonic() - self._created, 1e-9)
        return {
            "depth": len(self._items),
            "bound": self.bound,
            "max_depth": self._max_depth,
            "mean_depth": self._depth_area / elapsed,
            "puts": self._puts,
            "gets": self._gets,
            "put_wait_s": self._put_wait_s,
            "get_wait_s": self._get_wait_s,
            "closed": self._closed,
        }


class QueueHandle:
    """Client side of an edge; picklable, so it can be passed to stage actors.

    ``put`` stores the value in the object store once (``ray.put``) and moves only the
    reference; ``get`` returns the reference's value (zero-copy for numpy buffers).
    """

    def __init__(self, name: str, actor: Any, bound: int, producer: str, consumer: str) -> None:
        self.name = name
        self.actor = actor
        self.bound = bound
        self.producer = producer
        self.consumer = consumer

    async def put_ref(self, ref: ray.ObjectRef) -> float:
        return await self.actor.put.remote([ref])

    async def put(self, value: Any) -> float:
        return await self.put_ref(ray.put(value))

    async def get_ref(self) -> Any:
        """The next ``ObjectRef``, or ``END``."""
        item = await self.actor.get.remote()
        return END if item == END else item[0]

    async def get(self) -> Any:
        """The next value, or ``END``."""
        ref = await self.get_ref()
        return END if ref is END or ref == END else await ref

    async def close(self) -> int:
        return await self.actor.close.remote()

    async def stats(self) -> dict[str, float]:
        return await self.actor.stats.remote()


def create_queue(producer: str, consumer: str, bound: int, producers: int = 1) -> QueueHandle:
    """Start the actor of edge ``producer->consumer``."""
    name = f"{producer}->{consumer}"
    actor = QueueActor.options(name=None).remote(name, bound, producers)
    return QueueHandle(name, actor, bound, producer, consumer)
