"""Ray tier: the edges of one queue actor (``pipeline.queue.QueueActor``).

A release downstream reaches the lease it derives from upstream at once (both edges live
in the same actor); a producer's puts enter in the order it numbered them, whatever order
their calls arrive in; a put and the next lease travel as one call.
"""

from __future__ import annotations

import asyncio

from pipeline.queue import Origin, create_queue, is_end


def test_a_release_downstream_reaches_the_upstream_lease_at_once(ray_cluster):
    async def go() -> tuple[list[int], dict]:
        up = create_queue("source", "stage", bound=4)
        out = create_queue("stage", "sink", bound=4, actor=up.actor)
        for i in range(3):
            await up.put(i)
        await up.close()
        leases = [await up.lease("stage@1", [], []) for _ in range(3)]
        assert [value for value, _ in leases] == [0, 1, 2]
        for value, seq in leases:
            await out.put_entry(value * 10, Origin(up.name, "stage@1", seq, 1))
        held = [(await up.stats())["leased"]]  # held until what became of them is released
        for _ in range(3):
            await out.get()
            held.append((await up.stats())["leased"])
        await up.wait_drained()
        return held, await out.stats()

    held, out_stats = asyncio.run(go())
    assert held == [3, 2, 1, 0] and out_stats["gets"] == 3


def test_a_producers_puts_enter_in_its_order_whatever_order_the_calls_arrive_in(ray_cluster):
    async def go() -> list[int]:
        q = create_queue("stage", "sink", bound=8)
        args = [q.put_args(i) for i in range(4)]
        calls = [q.actor.put.remote(*a) for a in reversed(args[1:])]  # puts 3, 2, 1 first
        await asyncio.sleep(0.2)
        assert (await q.stats())["depth"] == 0  # nothing enters before put 0
        await asyncio.gather(q.actor.put.remote(*args[0]), *calls)
        return [await q.get() for _ in range(4)]

    assert asyncio.run(go()) == [0, 1, 2, 3]


def test_a_put_and_the_next_lease_travel_as_one_call(ray_cluster):
    async def go() -> None:
        up = create_queue("source", "stage", bound=4)
        out = create_queue("stage", "sink", bound=4, actor=up.actor)
        for i in range(2):
            await up.put(i)
        await up.close()
        (v0, s0), = await up.lease_ready("stage@1", [], [], 1)
        waited, got = await up.put_and_lease([out.put_args(v0 * 10, Origin(up.name, "stage@1", s0, 1))],
                                             "stage@1", [], [], 1)
        assert waited >= 0 and [v for v, _ in got] == [1]
        assert await out.get() == 0  # the put went first; its release reached lease s0
        stats = await up.stats()
        assert stats["leased"] == 1 and stats["puts"] == 2
        _, end = await up.put_and_lease([], "stage@1", [got[0][1]], [], 1)
        assert is_end(end[0][0])  # releases ride with it as with a lease

    asyncio.run(go())
