"""Bounded queues between stages, over Ray's object store.

Guarantees:
- an item is an ``ObjectRef`` to a micro-batch (the queue actor holds the reference, never
  the tensors), or the value itself inline when small (``fits_inline``); consumers take
  either (``resolve_entry``);
- ``put`` suspends the producer while ``bound`` items are held: backpressure, never a
  silent drop; the depth never exceeds the bound (except by requeued leases);
- items leave in the order they entered, so each producer's items keep their order;
- once every producer has called ``close()`` and the queue is empty, every ``get`` returns
  ``END`` to every consumer;
- depth, put-wait and get-wait are measured inside the queue actor (``stats``);
- every edge of a graph lives in one queue actor (``QueueActor``): a release reaches the
  edge upstream as a local call, and a stage's put and its next lease can travel as one
  call (``put_and_lease``); each producer process numbers its puts, so they enter in its
  order even when its calls start out of order;
- ``wait_drained`` returns once nothing is queued or leased here;
- a leased item stays held until what became of it reached the end of the graph; when its
  consumer dies, ``requeue`` puts it back at the front for the restarted actor. An item may
  be delivered twice, so consumers de-duplicate (docs/architecture.md, "Queues").
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from typing import Any, NamedTuple

import msgspec
import numpy as np
import ray

# Ray carries call arguments up to 100 KiB inside the call; a value estimated below this
# stays well under it (the estimate leaves out per-object overhead).
INLINE_MAX_BYTES = 64 << 10


def fits_inline(value: Any, limit: int = INLINE_MAX_BYTES) -> bool:
    """Whether ``value`` is small enough to travel inside the queue calls: its numpy
    buffers, bytes and strings (through Structs, lists, tuples and dicts) add up to at
    most ``limit`` bytes, other leaves counted at 16 bytes. Stops at the first overflow."""
    left = limit
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, np.ndarray):
            left -= v.nbytes
        elif isinstance(v, str | bytes | bytearray):
            left -= len(v)
        elif isinstance(v, msgspec.Struct):
            stack.extend(getattr(v, f) for f in v.__struct_fields__)
        elif isinstance(v, list | tuple):
            left -= 8 * len(v)
            stack.extend(v)
        elif isinstance(v, dict):
            left -= 8 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        else:
            left -= 16
        if left < 0:
            return False
    return True


async def resolve_entry(entry: Any) -> Any:
    """The value of a queue entry: fetched when it is an ``ObjectRef``, else the value."""
    return await entry if isinstance(entry, ray.ObjectRef) else entry


class _End:
    """End-of-stream marker (a class so it compares equal across processes)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _End)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "END"


END = _End()


def is_end(x: Any) -> bool:
    """Whether ``x`` is the end-of-stream marker (never ``==``: an inline numpy value
    would compare elementwise)."""
    return isinstance(x, _End)


class QueueClosed(RuntimeError):
    """``put`` on a queue whose producers have all closed it."""


class Origin(NamedTuple):
    """Where an output came from: the producer's lease ``seq`` on the queue named
    ``queue`` under ``consumer``; ``parts`` outputs (times output queues) derive from it.
    The queue travels by name: every edge of a graph lives in the same queue actor."""

    queue: str
    consumer: str
    seq: int
    parts: int


class _Lease:
    """An item out with a consumer (``wrapped`` keeps its object alive)."""

    __slots__ = ("origin", "released_parts", "wrapped")

    def __init__(self, wrapped: list[Any], origin: Origin | None) -> None:
        self.wrapped = wrapped
        self.origin = origin
        self.released_parts = 0


class _Edge:
    """The state of one edge: a deque of wrapped references guarded by a condition.
    ``release_upstream(origin)``: one output derived from lease ``origin`` was released
    here (the edge named ``origin.queue`` lives in the same hub, so this is a local call)."""

    def __init__(self, name: str, bound: int, producers: int, release_upstream: Any) -> None:
        self.name = name
        self.bound = bound
        self._release_upstream = release_upstream
        # Each entry: (wrapped reference, its Origin or None).
        self._items: collections.deque[tuple[list[Any], Origin | None]] = collections.deque()
        self._cond = asyncio.Condition()
        self._open_producers = producers
        self._closed_by: set[str] = set()
        self._closed = False
        self._leases: dict[str, dict[int, _Lease]] = collections.defaultdict(dict)
        self._next_put: dict[str, int] = {}  # producer process -> the number of its next put
        self._seq = 0
        self._redelivered = 0
        self._dead: set[str] = set()  # consumer ids of processes that died
        self._drained = asyncio.Event()  # set while nothing is queued or leased
        self._drained.set()
        self._puts = 0
        self._puts_with_lease = 0
        self._gets = 0
        self._put_wait_s = 0.0
        self._get_wait_s = 0.0
        self._max_depth = 0
        self._depth_area = 0.0  # integral of depth over time, for the mean depth
        self._last_change = time.monotonic()
        self._created = self._last_change

    def _note_drained(self) -> None:
        if not self._items and not any(self._leases.values()):
            self._drained.set()
        else:
            self._drained.clear()

    async def wait_drained(self) -> None:
        await self._drained.wait()

    def _touch(self) -> None:
        now = time.monotonic()
        self._depth_area += len(self._items) * (now - self._last_change)
        self._last_change = now

    async def put(self, wrapped: list[Any], origin: Origin | None = None, producer: str | None = None,
                  number: int | None = None, with_lease: bool = False) -> float:
        """Enqueue ``[ref]``; returns the seconds the producer waited (for its earlier puts
        and for room). ``number``: the producer's count of puts to this edge before this
        one; its puts enter in that order, whatever order their calls arrive in.
        ``with_lease``: it came in a ``put_and_lease`` call (counted)."""
        t0 = time.monotonic()
        self._puts_with_lease += with_lease
        async with self._cond:
            if number is not None:
                await self._cond.wait_for(lambda: self._next_put.get(producer, 0) == number)
            if self._closed:
                raise QueueClosed(f"queue {self.name}: put after all producers closed it")
            await self._cond.wait_for(lambda: len(self._items) < self.bound)
            self._touch()
            self._items.append((wrapped, origin))
            if number is not None:
                self._next_put[producer] = number + 1
            self._drained.clear()
            self._puts += 1
            self._max_depth = max(self._max_depth, len(self._items))
            self._cond.notify_all()
        waited = time.monotonic() - t0
        self._put_wait_s += waited
        return waited

    async def _pop(self) -> tuple[list[Any], Origin | None] | None:
        t0 = time.monotonic()
        async with self._cond:
            await self._cond.wait_for(lambda: self._items or self._closed)
            entry = None
            if self._items:
                self._touch()
                entry = self._items.popleft()
                self._gets += 1
                self._cond.notify_all()
        self._get_wait_s += time.monotonic() - t0
        return entry

    async def get(self) -> Any:
        """Dequeue the next ``[ref]``, or ``END`` once closed and drained (no lease: the
        item is released at once)."""
        entry = await self._pop()
        if entry is None:
            return END
        if entry[1] is not None:
            self._release_upstream(entry[1])
        self._note_drained()
        return entry[0]

    async def lease_ready(self, consumer: str, released: list[int] = (), lost: list[int] = (),
                          limit: int = 1) -> Any:
        """``[[ref, seq], ...]``: the next item, held under ``consumer`` until released,
        then up to ``limit`` - 1 more that are already queued (never waited for), each
        leased alike; or ``END``. ``released``: leases the consumer is done with (it
        emitted nothing for them); ``lost``: leases whose object died with its producer
        (dropped, their origins stay leased upstream, where that producer's requeue
        delivers them again)."""
        if consumer in self._dead:
            return END  # a call from a process that died, arriving late
        held = self._leases[consumer]
        for seq in released:
            self.release(consumer, seq)
        for seq in lost:
            held.pop(seq, None)
        entry = await self._pop()
        if entry is None:
            return END
        if consumer in self._dead:  # it died while this call waited: the item stays here
            async with self._cond:
                self._items.appendleft(entry)
                self._cond.notify_all()
            return END
        taken = [entry]
        if limit > 1 and self._items:
            async with self._cond:
                if consumer not in self._dead:
                    while len(taken) < limit and self._items:
                        self._touch()
                        taken.append(self._items.popleft())
                        self._gets += 1
                    self._cond.notify_all()
        out, leases = [], self._leases[consumer]
        for wrapped, origin in taken:
            self._seq += 1
            leases[self._seq] = _Lease(wrapped, origin)
            out.append([wrapped[0], self._seq])
        self._note_drained()
        return out

    def release_parts(self, parts: list[tuple[str, int, int]]) -> None:
        """For each ``(consumer, seq, parts)``: one output derived from lease ``seq`` was
        released downstream; the lease is released when all ``parts`` were (unknown or
        requeued leases are ignored)."""
        for consumer, seq, n in parts:
            lease = self._leases.get(consumer, {}).get(seq)
            if lease is None:
                continue
            lease.released_parts += 1
            if lease.released_parts >= n:
                self.release(consumer, seq)

    def release(self, consumer: str, seq: int) -> None:
        """``consumer`` is done with lease ``seq``: released, and its origin upstream."""
        lease = self._leases.get(consumer, {}).pop(seq, None)
        if lease is not None and lease.origin is not None:
            self._release_upstream(lease.origin)
        self._note_drained()

    async def requeue(self, consumer: str) -> int:
        """``consumer``'s process died: its leased items go back to the front, in order.
        The id is retired (a restarted actor leases under a new one)."""
        self._dead.add(consumer)
        held = self._leases.pop(consumer, {})
        async with self._cond:
            self._touch()
            for seq in sorted(held, reverse=True):
                self._items.appendleft((held[seq].wrapped, held[seq].origin))
            self._redelivered += len(held)
            self._max_depth = max(self._max_depth, len(self._items))
            self._note_drained()
            self._cond.notify_all()
        return len(held)

    async def close(self, producer: str | None = None) -> int:
        """One producer is done; returns how many producers are still open. A named
        producer counts once however often it closes (a restarted actor closes again)."""
        async with self._cond:
            if producer is None or producer not in self._closed_by:
                if producer is not None:
                    self._closed_by.add(producer)
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
            "puts_with_lease": self._puts_with_lease,
            "gets": self._gets,
            "put_wait_s": self._put_wait_s,
            "get_wait_s": self._get_wait_s,
            "closed": self._closed,
            "leased": sum(len(h) for h in self._leases.values()),
            "redelivered": self._redelivered,
        }


# No task events (Ray's per-call records for its dashboard and state API): Conveyor keeps
# its own spans, so the control-plane actors (queues, controller, stage shells) skip
# recording and reporting them for every call. bench/queue_hop's ``call_cost`` measures
# the difference side by side: about 5% of a call's CPU time on an idle 2-core machine.
@ray.remote(num_cpus=0, max_concurrency=1000, enable_task_events=False)
class QueueActor:
    """Every edge of a graph in one actor: a release reaches the edge upstream as a local
    call, and a stage's put and its next lease travel as one call (``put_and_lease``).
    Each method takes the edge's name first."""

    def __init__(self) -> None:
        self._edges: dict[str, _Edge] = {}

    def add_edge(self, name: str, bound: int, producers: int = 1) -> None:
        self._edges[name] = _Edge(name, bound, producers, self._release_upstream)

    def _release_upstream(self, origin: Origin) -> None:
        edge = self._edges.get(origin.queue)
        if edge is not None:
            edge.release_parts([(origin.consumer, origin.seq, origin.parts)])

    async def put(self, edge: str, wrapped: list[Any], origin: Origin | None = None, producer: str | None = None,
                  number: int | None = None) -> float:
        return await self._edges[edge].put(wrapped, origin, producer, number)

    async def get(self, edge: str) -> Any:
        return await self._edges[edge].get()

    async def lease_ready(self, edge: str, consumer: str, released: list[int] = (), lost: list[int] = (),
                          limit: int = 1) -> Any:
        return await self._edges[edge].lease_ready(consumer, released, lost, limit)

    async def put_and_lease(self, puts: list[tuple[str, list[Any], Origin | None, str, int]], edge: str,
                            consumer: str, released: list[int] = (), lost: list[int] = (),
                            limit: int = 1) -> tuple[float, Any]:
        """The ``puts`` (``put``'s arguments, each edge's in order), then ``lease_ready`` on
        ``edge``: the seconds the puts waited and the leased items (or ``END``)."""
        waited = 0.0
        for out, wrapped, origin, producer, number in puts:
            waited += await self._edges[out].put(wrapped, origin, producer, number, with_lease=True)
        return waited, await self._edges[edge].lease_ready(consumer, released, lost, limit)

    def release(self, edge: str, consumer: str, seq: int) -> None:
        """``consumer`` is done with lease ``seq`` and emitted nothing for it."""
        self._edges[edge].release(consumer, seq)

    async def requeue(self, edge: str, consumer: str) -> int:
        return await self._edges[edge].requeue(consumer)

    async def close(self, edge: str, producer: str | None = None) -> int:
        return await self._edges[edge].close(producer)

    async def wait_drained(self, edge: str) -> None:
        await self._edges[edge].wait_drained()

    def stats(self, edge: str) -> dict[str, float]:
        return self._edges[edge].stats()


class QueueHandle:
    """Client side of an edge; picklable, so it can be passed to stage actors.

    ``put`` stores the value in the object store once (``ray.put``) and moves only the
    reference, or moves a small value inline; ``get`` returns the value (zero-copy for
    numpy buffers read from the store). Each process numbers its puts to the edge, so
    they enter in the order it made them.
    """

    def __init__(self, name: str, actor: Any, bound: int, producer: str, consumer: str) -> None:
        self.name = name
        self.actor = actor
        self.bound = bound
        self.producer = producer
        self.consumer = consumer
        self._key: str | None = None  # this process's name for its puts
        self._count = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_key": None, "_count": 0}  # a new process numbers anew

    def put_args(self, entry: Any, origin: Origin | None = None) -> tuple[str, list[Any], Origin | None, str, int]:
        """``QueueActor.put``'s arguments for ``entry``, numbered: call it only for a put
        that is sent (a number taken and never sent would hold every later put back)."""
        if self._key is None:
            self._key = uuid.uuid4().hex
        self._count += 1
        return self.name, [entry], origin, self._key, self._count - 1

    async def put_entry(self, entry: Any, origin: Origin | None = None) -> float:
        """Enqueue ``entry``: an ``ObjectRef``, or a value that ``fits_inline``;
        ``origin`` names the lease it derives from."""
        return await self.actor.put.remote(*self.put_args(entry, origin))

    async def put(self, value: Any) -> float:
        return await self.put_entry(value if fits_inline(value) else ray.put(value))

    async def get_entry(self) -> Any:
        """The next entry (an ``ObjectRef`` or an inline value), or ``END``."""
        item = await self.actor.get.remote(self.name)
        return END if is_end(item) else item[0]

    async def get(self) -> Any:
        """The next value, or ``END``."""
        entry = await self.get_entry()
        return END if is_end(entry) else await resolve_entry(entry)

    async def lease(self, consumer: str, released: list[int], lost: list[int]) -> tuple[Any, int]:
        """(next entry, its lease seq), or (``END``, -1); see ``_Edge.lease_ready``."""
        return (await self.lease_ready(consumer, released, lost, 1))[0]

    async def lease_ready(self, consumer: str, released: list[int], lost: list[int],
                          limit: int) -> list[tuple[Any, int]]:
        """[(entry, its lease seq), ...]: the next one and up to ``limit`` - 1 already
        queued, or [(``END``, -1)]; see ``_Edge.lease_ready``."""
        got = await self.actor.lease_ready.remote(self.name, consumer, released, lost, limit)
        return [(END, -1)] if is_end(got) else [(ref, seq) for ref, seq in got]

    async def put_and_lease(self, puts: list[tuple[str, list[Any], Origin | None, str, int]], consumer: str,
                            released: list[int], lost: list[int], limit: int) -> tuple[float, list[tuple[Any, int]]]:
        """``puts`` (``put_args`` of the output edges), then ``lease_ready`` here, in one call."""
        waited, got = await self.actor.put_and_lease.remote(puts, self.name, consumer, released, lost, limit)
        return waited, [(END, -1)] if is_end(got) else [(ref, seq) for ref, seq in got]

    def release(self, consumer: str, seq: int) -> None:
        """Fire and forget: ``consumer`` emitted nothing for lease ``seq``."""
        self.actor.release.remote(self.name, consumer, seq)

    async def wait_drained(self) -> None:
        await self.actor.wait_drained.remote(self.name)

    async def requeue(self, consumer: str) -> int:
        return await self.actor.requeue.remote(self.name, consumer)

    async def close(self, producer: str | None = None) -> int:
        return await self.actor.close.remote(self.name, producer)

    async def stats(self) -> dict[str, float]:
        return await self.actor.stats.remote(self.name)


def start_queue_actor() -> Any:
    """The actor that holds every edge of one graph (``create_queue`` adds them)."""
    return QueueActor.options(name=None).remote()


def create_queue(producer: str, consumer: str, bound: int, producers: int = 1, actor: Any = None) -> QueueHandle:
    """Add edge ``producer->consumer`` to ``actor`` (a new queue actor when None: edges
    whose releases reach each other must share one)."""
    name = f"{producer}->{consumer}"
    actor = actor if actor is not None else start_queue_actor()
    ray.get(actor.add_edge.remote(name, bound, producers))  # before any stage can put to it
    return QueueHandle(name, actor, bound, producer, consumer)
