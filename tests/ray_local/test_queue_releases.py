"""Ray tier: releases forwarded upstream (``QueueActor._forward``) all arrive.

A producer leases three items from its input queue and puts one output for each, tagged
with the lease's ``Origin``; the consumer takes the three after the last put, so no put
reply collects their releases and they leave together, one call after
``forward_interval_s``. Every lease on the input queue must then be released
(``wait_drained`` returns), also when the origin's queue is introduced only by the first
put, as a stage shell does. While items flow, releases ride in the replies to the
producer's puts and upstream with its leases instead.
"""

from __future__ import annotations

import asyncio

from pipeline.queue import Origin, create_queue, is_end


def test_coalesced_releases_reach_the_upstream_queue(ray_cluster):
    async def go() -> tuple[dict, dict]:
        up = create_queue("source", "stage", bound=4)
        out = create_queue("stage", "sink", bound=4, forward_interval_s=0.5)
        for i in range(3):
            await up.put(i)
        await up.close()
        leases = [await up.lease("stage@1", [], []) for _ in range(3)]
        assert [value for value, _ in leases] == [0, 1, 2]
        for value, seq in leases:
            await out.put_entry(value * 10, Origin(up.name, "stage@1", seq, 1), up)
        assert (await up.stats())["leased"] == 3  # held until what became of them is released
        assert [await out.get() for _ in range(3)] == [0, 10, 20]
        await up.wait_drained()
        return await up.stats(), await out.stats()

    up_stats, out_stats = asyncio.run(go())
    assert up_stats["leased"] == 0 and up_stats["depth"] == 0
    assert out_stats["gets"] == 3


def test_a_put_reply_carries_releases_upstream_with_the_next_lease(ray_cluster):
    """While items flow, a release rides back in the reply to the producer's next put and
    upstream with its next lease, with no call of its own: the forward interval is longer
    than the test, so no other path can release anything here."""

    async def go() -> list[int]:
        up = create_queue("source", "stage", bound=4)
        out = create_queue("stage", "sink", bound=4, forward_interval_s=3600)
        for i in range(3):
            await up.put(i)
        await up.close()
        leased = []
        (v0, s0), (v1, s1) = [await up.lease("stage@1", [], []) for _ in range(2)]
        await out.put_entry(v0, Origin(up.name, "stage@1", s0, 1), up)
        assert await out.get() == 0  # lease s0's release waits in out's outbox
        await out.put_entry(v1, Origin(up.name, "stage@1", s1, 1), up)  # its reply brings it
        v2, s2 = await up.lease("stage@1", [], [])  # and this carries it to up
        leased.append((await up.stats())["leased"])  # s1, s2 (s0 released)
        assert await out.get() == 1
        await out.put_entry(v2, Origin(up.name, "stage@1", s2, 1), up)  # brings s1's release
        end, _ = await up.lease("stage@1", [], [])
        assert is_end(end)  # the lease that finds the end still carries it
        leased.append((await up.stats())["leased"])  # s2: its output was not taken yet
        return leased

    assert asyncio.run(go()) == [2, 1]
