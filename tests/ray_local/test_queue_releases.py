"""Ray tier: releases forwarded upstream in batches (``QueueActor._forward``) all arrive.

A producer leases three items from its input queue and puts one output for each, tagged
with the lease's ``Origin``; the consumer takes the three at once, so the second and
third releases fall inside the first one's ``forward_interval_s`` and leave together.
Every lease on the input queue must then be released (``wait_drained`` returns), also
when the origin's queue is introduced only by the first put, as a stage shell does.
"""

from __future__ import annotations

import asyncio

from pipeline.queue import Origin, create_queue


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
