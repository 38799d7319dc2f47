"""Fake stage cores for the Ray tier: they sleep instead of computing.

Named fakes on purpose: they exist only to prove the plumbing (queues, ordering,
backpressure, failure, overlap) without models. Items are ``FakeItem``s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec


class FakeItem(msgspec.Struct, frozen=True, kw_only=True):
    batch_id: int
    producer: str
    seq: int
    size: int = 1
    trail: tuple[str, ...] = ()


class FakeSource:
    def __init__(self, count: int, delay_s: float = 0.0, label: str = "src") -> None:
        self.count, self.delay_s, self.label = count, delay_s, label

    async def setup(self, ctx) -> None:
        self.ctx = ctx
        self.label = f"{self.label}{ctx.replica}"

    async def generate(self) -> AsyncIterator[FakeItem]:
        for i in range(self.count):
            if self.delay_s:
                await asyncio.to_thread(time.sleep, self.delay_s)
            yield FakeItem(batch_id=i, producer=self.label, seq=i)


class FakeStage:
    """Sleeps ``delay_s`` per item in a thread (as real compute would run off the loop);
    raises at item ``fail_at``."""

    def __init__(self, delay_s: float = 0.0, fail_at: int = -1, tag: str = "") -> None:
        self.delay_s, self.fail_at, self.tag = delay_s, fail_at, tag
        self.seen = 0

    async def setup(self, ctx) -> None:
        self.tag = self.tag or ctx.name

    async def process(self, item: FakeItem) -> FakeItem:
        if self.seen == self.fail_at:
            raise ValueError(f"fake failure at item {self.seen}")
        self.seen += 1
        if self.delay_s:
            await asyncio.to_thread(time.sleep, self.delay_s)
        return msgspec.structs.replace(item, trail=(*item.trail, self.tag))


class FakeSink(FakeStage):
    """Terminal fake: records what arrived, in arrival order."""

    def __init__(self, delay_s: float = 0.0, fail_at: int = -1) -> None:
        super().__init__(delay_s, fail_at)
        self.arrived: list[tuple[str, int, tuple[str, ...]]] = []

    async def process(self, item: FakeItem) -> None:
        out = await super().process(item)
        self.arrived.append((out.producer, out.seq, out.trail))
        return None

    def result(self) -> list[tuple[str, int, tuple[str, ...]]]:
        return self.arrived
