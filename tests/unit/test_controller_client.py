"""ControllerClient's posted calls (``finish_step``, ``record_dropped``): sent without
waiting for the reply, in order, one at a time, errors surfacing at the next call or at
``settle``. The actor is a stand-in whose replies the test resolves by hand (no Ray)."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest

from pipeline.controller import ControllerClient


class _Method:
    def __init__(self, name: str, sent: list[tuple[str, tuple[Any, ...], asyncio.Future[Any]]]) -> None:
        self.name, self.sent = name, sent

    def remote(self, *args: Any) -> asyncio.Future[Any]:
        reply = asyncio.get_running_loop().create_future()
        self.sent.append((self.name, args, reply))
        return reply


class _Actor:
    """Records each call with its (unresolved) reply."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple[Any, ...], asyncio.Future[Any]]] = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(name, self.sent)


def test_posted_calls_go_out_in_order_one_at_a_time() -> None:
    async def main() -> None:
        actor = _Actor()
        client = ControllerClient(actor)
        await asyncio.wait_for(client.finish_step(4, 1, {"step": 0}), 1)  # returns with no reply yet
        assert [name for name, _, _ in actor.sent] == ["finish_step"]
        second = asyncio.ensure_future(client.record_dropped(2, "stale"))
        await asyncio.sleep(0.01)
        assert not second.done() and len(actor.sent) == 1  # waits for the first reply before sending
        actor.sent[0][2].set_result(None)
        await asyncio.wait_for(second, 1)
        assert [(name, args) for name, args, _ in actor.sent] == [
            ("finish_step", (4, 1, {"step": 0}, None, [])), ("record_dropped", (2, "stale"))]
        settled = asyncio.ensure_future(client.settle())
        await asyncio.sleep(0.01)
        assert not settled.done()
        actor.sent[1][2].set_result(None)
        await asyncio.wait_for(settled, 1)
        await asyncio.wait_for(client.settle(), 1)  # nothing posted: returns at once

    asyncio.run(main())


def test_a_failed_posted_call_fails_the_next_call_and_settle() -> None:
    async def main() -> None:
        actor = _Actor()
        client = ControllerClient(actor)
        await client.finish_step(4, 1, {})
        actor.sent[0][2].set_exception(ValueError("publish: version 1 is not newer than 1"))
        with pytest.raises(ValueError, match="not newer"):
            await client.finish_step(4, 2, {})
        assert len(actor.sent) == 1  # the failed one's successor was not sent
        await client.record_dropped(1, "stale")
        actor.sent[1][2].set_exception(RuntimeError("controller died"))
        with pytest.raises(RuntimeError, match="controller died"):
            await client.settle()

    asyncio.run(main())


def test_a_pickled_client_carries_no_pending_reply() -> None:
    async def main() -> None:
        client = ControllerClient("handle")
        client._posted = asyncio.get_running_loop().create_future()
        copy = pickle.loads(pickle.dumps(client))
        assert copy.actor == "handle" and copy._posted is None
        await asyncio.wait_for(copy.settle(), 1)

    asyncio.run(main())
