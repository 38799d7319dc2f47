"""Fake stage cores for the Ray tier: they sleep instead of computing.

Named fakes on purpose: they exist only to prove the plumbing (queues, ordering,
backpressure, failure, overlap) without models. Items are ``FakeItem``s, except for the
memory fakes at the end, which carry real ``RolloutBatch``es.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import msgspec
import numpy as np

from pipeline.config import MemoryConfig
from pipeline.memory.guard import MemoryGuard
from pipeline.memory.oom import run_with_oom_recovery
from pipeline.memory.splitting import count_groups, merge_rollout_batches, split_rollout_batch
from pipeline.stage import StageContext
from pipeline.types import Prompt, PromptBatch, RolloutBatch
from stages.trainer.ranks import TrainerRank


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


class FakeWatchedStage:
    """Passes items on; ``fail_after_s`` after set-up its own background task (as the
    rollout's weight watcher) fails and reports ``RuntimeError(message)`` through
    ``ctx.fail``, whether or not an item is in ``process``."""

    def __init__(self, fail_after_s: float = 0.2, message: str = "fake watcher failure") -> None:
        self.fail_after_s, self.message = fail_after_s, message

    async def setup(self, ctx) -> None:
        self.ctx = ctx
        self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        await asyncio.sleep(self.fail_after_s)
        self.ctx.fail(RuntimeError(self.message))

    async def process(self, item: Any) -> Any:
        return item


class FakeStage:
    """Sleeps ``delay_s`` per item in a thread (as real compute would run off the loop);
    raises at item ``fail_at``. Its set-up takes ``setup_s`` (as an engine's start
    would), then raises ``RuntimeError(setup_error)`` if that is set."""

    def __init__(self, delay_s: float = 0.0, fail_at: int = -1, tag: str = "", setup_s: float = 0.0,
                 setup_error: str = "") -> None:
        self.delay_s, self.fail_at, self.tag = delay_s, fail_at, tag
        self.setup_s, self.setup_error = setup_s, setup_error
        self.seen = 0

    async def setup(self, ctx) -> None:
        self.tag = self.tag or ctx.name
        self.setup_doing = f"fake engine start of {self.setup_s:g} s"  # what setting_up lines report
        await asyncio.sleep(self.setup_s)
        if self.setup_error:
            raise RuntimeError(self.setup_error)

    async def process(self, item: FakeItem) -> FakeItem:
        if self.seen == self.fail_at:
            raise ValueError(f"fake failure at item {self.seen}")
        self.seen += 1
        if self.delay_s:
            await asyncio.to_thread(time.sleep, self.delay_s)
        return msgspec.structs.replace(item, trail=(*item.trail, self.tag))


class FakeSink(FakeStage):
    """Terminal fake: records what arrived, in arrival order."""

    def __init__(self, delay_s: float = 0.0, fail_at: int = -1, **setup: Any) -> None:
        super().__init__(delay_s, fail_at, **setup)
        self.arrived: list[tuple[str, int, tuple[str, ...]]] = []

    async def process(self, item: FakeItem) -> None:
        out = await super().process(item)
        self.arrived.append((out.producer, out.seq, out.trail))
        return None

    def result(self) -> list[tuple[str, int, tuple[str, ...]]]:
        return self.arrived


class FakeTimedSetupStage(FakeStage):
    """Passes items on; its set-up takes ``setup_s`` and its result is when that began
    and ended (wall clock, seconds)."""

    async def setup(self, ctx) -> None:
        self.began = time.time()
        await super().setup(ctx)
        self.ended = time.time()

    def result(self) -> dict[str, float]:
        return {"began": self.began, "ended": self.ended}


class FakeTimedSetupSink(FakeSink, FakeTimedSetupStage):
    """``FakeSink`` whose result is its set-up's times (``FakeTimedSetupStage``)."""

    def result(self) -> dict[str, float]:
        return FakeTimedSetupStage.result(self)


class FakeEnvStage(FakeStage):
    """Passes items on (or, ``terminal``, keeps them); its result is the values of
    ``names`` in its process's environment."""

    def __init__(self, names: tuple[str, ...], terminal: bool = False) -> None:
        super().__init__()
        self.names, self.terminal = names, terminal

    async def process(self, item: FakeItem) -> FakeItem | None:
        out = await super().process(item)
        return None if self.terminal else out

    def result(self) -> dict[str, Any]:
        import os
        import signal

        from pipeline.signals import blocked_signals

        # The run's runtime_env set-up hook still ran (it gives workers SIGTERM back).
        return {**{n: os.environ.get(n) for n in self.names}, "sigterm_blocked": signal.SIGTERM in blocked_signals()}


class FakeGatheringSink(FakeSink):
    """Terminal fake that takes up to ``max_gather`` queued items at once (as the
    trainer does): records each call's items; each call takes ``delay_s``."""

    def __init__(self, max_gather: int, delay_s: float = 0.0) -> None:
        super().__init__()
        self.max_gather, self.delay = max_gather, delay_s
        self.calls: list[list[int]] = []

    async def process(self, item: FakeItem) -> None:
        return (await self.process_many([item]))[0]

    async def process_many(self, items: list[FakeItem]) -> list[None]:
        self.calls.append([i.seq for i in items])
        await asyncio.sleep(self.delay)
        self.arrived += [(i.producer, i.seq, (*i.trail, "sink")) for i in items]
        return [None] * len(items)

    def result(self) -> dict[str, Any]:
        return {"arrived": self.arrived, "calls": self.calls}


# ----------------------------------------------------------- memory: admission and OOM
# Fakes for the admission/OOM tests: real ``RolloutBatch`` items, the real ``MemoryGuard``
# and recovery drivers; only the compute is fake (it "runs out of memory" by rule).


def make_fake_rollout_batch(batch_id: int, num_groups: int, group_size: int = 2) -> RolloutBatch:
    """``num_groups`` groups of ``group_size`` samples, ids ``b<batch>/g<group>/<k>``,
    prompts of 1..3 tokens and completions of 1..4 (right-padded with 0)."""
    n = num_groups * group_size
    plens = np.array([1 + (i // group_size) % 3 for i in range(n)], np.int32)
    clens = np.array([1 + i % 4 for i in range(n)], np.int32)
    cmask = np.arange(clens.max())[None, :] < clens[:, None]
    return RolloutBatch(
        batch_id=batch_id, step=batch_id, group_size=group_size, policy_version=0,
        prompts=[Prompt(prompt_id=f"b{batch_id}/g{g}", text=f"q{g}") for g in range(num_groups)],
        sample_ids=[f"b{batch_id}/g{i // group_size}/{i % group_size}" for i in range(n)],
        prompt_ids=np.where(np.arange(plens.max())[None, :] < plens[:, None], 5, 0).astype(np.int32),
        prompt_lens=plens,
        completion_ids=np.where(cmask, 7, 0).astype(np.int32), completion_lens=clens,
        completions=["c"] * n, behaviour_logprobs=np.where(cmask, -0.5, 0).astype(np.float32),
        token_versions=np.zeros(cmask.shape, np.int32), finish_reasons=["length"] * n,
        rewards=np.arange(n, dtype=np.float32),
    )


class FakeGroupSource:
    """Yields ``count`` fake rollout batches of ``groups`` GRPO groups each."""

    def __init__(self, count: int, groups: int = 4, group_size: int = 2) -> None:
        self.count, self.groups, self.group_size = count, groups, group_size

    async def generate(self) -> AsyncIterator[RolloutBatch]:
        for i in range(self.count):
            yield make_fake_rollout_batch(i, self.groups, self.group_size)


class FakeOomStage:
    """A scoring stage under the real ``MemoryGuard`` whose fake compute raises a CUDA
    out-of-memory error whenever a piece holds more than ``max_groups`` groups.
    Estimates ``bytes_per_group`` per group; ``memory`` is its ``MemoryConfig`` fields."""

    def __init__(self, max_groups: int, bytes_per_group: int = 1 << 20, memory: dict[str, Any] | None = None) -> None:
        self.max_groups, self.bytes_per_group = max_groups, bytes_per_group
        self.memory = MemoryConfig(**(memory or {}))
        self.attempts: list[int] = []  # groups per compute call, in order

    async def setup(self, ctx) -> None:
        self.ctx = ctx
        self.guard = MemoryGuard(ctx.name, self.memory, spans=ctx.spans)

    async def process(self, batch: RolloutBatch) -> RolloutBatch:
        out = await self.guard.run(
            batch, self._recovering, estimate=lambda b: self.bytes_per_group * count_groups(b),
            split=split_rollout_batch, merge=merge_rollout_batches, size=count_groups, key=batch.batch_id,
        )
        return out

    async def _recovering(self, piece: RolloutBatch) -> RolloutBatch:
        return await run_with_oom_recovery(
            self._compute, piece, split=split_rollout_batch, merge=merge_rollout_batches, stage=self.guard.stage,
            size=count_groups, on_event=self.guard.on_oom(piece.batch_id),
        )

    def _compute(self, piece: RolloutBatch) -> RolloutBatch:  # runs in a worker thread
        groups = count_groups(piece)
        self.attempts.append(groups)
        if groups > self.max_groups:
            raise RuntimeError(f"CUDA out of memory. Tried to allocate 2.00 GiB (fake: {groups} groups "
                               f"> {self.max_groups})")
        return msgspec.structs.replace(piece, ref_logprobs=np.where(piece.completion_ids > 0, -1.0, 0).astype(np.float32))

    def status(self) -> dict[str, Any]:
        return {"state": "scoring", **self.guard.status()}

    def result(self) -> dict[str, Any]:
        return {"attempts": self.attempts, **self.guard.metrics()}


class FakeSampleSink:
    """Records each arriving micro-batch: (batch_id, sample ids, all ref log-probs set)."""

    def __init__(self) -> None:
        self.arrived: list[tuple[int, list[str], bool]] = []

    async def process(self, batch: RolloutBatch) -> None:
        scored = batch.ref_logprobs is not None and bool(
            np.all((batch.ref_logprobs == -1.0) == (np.arange(batch.completion_ids.shape[1]) < batch.completion_lens[:, None])))
        self.arrived.append((batch.batch_id, list(batch.sample_ids), scored))

    def result(self) -> list[tuple[int, list[str], bool]]:
        return self.arrived


class FakeOomAfterCall:
    """Wraps a callable (the trainer's DeepSpeed ``backward``); on the call numbers in
    ``fail_on`` (1-based) it runs the real call first, then raises a CUDA out-of-memory
    error: the failure leaves that call's gradients half-accumulated, as a real OOM in
    the middle of a micro-batch would."""

    def __init__(self, real: Any, fail_on: set[int]) -> None:
        self.real, self.fail_on, self.calls = real, set(fail_on), 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        out = self.real(*args, **kwargs)
        if self.calls in self.fail_on:
            raise RuntimeError(f"CUDA out of memory. Tried to allocate 1.00 GiB (fake, call {self.calls})")
        return out


class FakeControllerClient:
    """``ctx.controller.<method>(...)`` (a ``ControllerClient``) without Ray: each awaited
    call is recorded as (method, args) and returns None."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any) -> None:
            self.calls.append((name, args))

        return call


class FakeStageContext(StageContext):
    """What ``StageActor`` gives a core, without Ray: the real context (spans, logger,
    ``fail``) around ``FakeControllerClient``, which a test may replace."""

    def __init__(self, name: str, config: Any) -> None:
        from pipeline.profiler import SpanRecorder

        super().__init__(name, 0, config, FakeControllerClient(), SpanRecorder(stage=name))


class FakeDyingStage:
    """Passes batches on after ``delay_s``; at its ``die_at``-th item it SIGKILLs its own
    process (as ``kill -9`` would), once per ``marker`` file: a restarted actor goes on."""

    def __init__(self, die_at: int, marker: str, delay_s: float = 0.0) -> None:
        self.die_at, self.marker, self.delay_s = die_at, marker, delay_s
        self.seen = 0

    async def process(self, batch: RolloutBatch) -> RolloutBatch:
        import os
        import signal
        from pathlib import Path

        self.seen += 1
        if self.seen == self.die_at and not Path(self.marker).exists():
            Path(self.marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.delay_s:
            await asyncio.to_thread(time.sleep, self.delay_s)
        return batch


class FakeScoredSink(FakeSampleSink):
    """``FakeSampleSink`` that declares what it takes (``pipeline/contracts.py``): rollout
    batches with reference log-probs set."""

    takes = RolloutBatch
    takes_fields = ("ref_logprobs",)


class FakeScriptedBackend:
    """A rollout backend that writes scripted text instead of sampling: ``script(context,
    j)`` gives completion j's text for a prompt whose token ids decode to ``context``.
    Tokens carry ``version``, which grows by ``bump`` after every ``generate`` call (as if
    weights landed between turns); log-probs are -0.5."""

    def __init__(self, tok: Any, script: Any, bump: int = 0) -> None:
        self.tok, self.script, self.bump = tok, script, bump
        self.version = 0
        self.calls: list[list[str]] = []

    async def generate(self, prompt_token_ids: list[list[int]], sampling: Any) -> list[Any]:
        from stages.rollout.base import Completion, GenerationResult

        results, contexts = [], []
        for ids in prompt_token_ids:
            context = self.tok.decode(ids, skip_special_tokens=True)
            contexts.append(context)
            comps = []
            for j in range(sampling.n):
                out = self.tok(self.script(context, j), add_special_tokens=False)["input_ids"][: sampling.max_tokens]
                comps.append(Completion(token_ids=out, logprobs=[-0.5] * len(out), token_versions=[self.version] * len(out),
                                        finish_reason="length" if len(out) == sampling.max_tokens else "stop",
                                        text=self.tok.decode(out)))
            results.append(GenerationResult(prompt_token_ids=ids, completions=comps))
        self.calls.append(contexts)
        self.version += self.bump
        return results


class _FakeAlgo(msgspec.Struct, frozen=True, kw_only=True):
    loss_agg: str = "token-mean"


class FakeBlockedRankZero:
    """Rank 0's engine for ``DataParallelEngine`` whose ``train_micro_batch`` waits for
    ``release`` (standing in for a collective the other ranks never join), or raises
    ``error`` at once."""

    chunk_size = 16

    def __init__(self, error: BaseException | None = None) -> None:
        import threading

        self.algo = _FakeAlgo()
        self.release = threading.Event()
        self.error = error

    def train_micro_batch(self, batch: RolloutBatch, scale: float) -> dict[str, float]:
        if self.error is not None:
            raise self.error
        self.release.wait()
        return {"loss": 0.0, "num_samples": batch.num_samples, "num_tokens": 0, "scale": scale}

    def plan_passes(self, batch: RolloutBatch) -> list[list[int]]:
        return [list(range(batch.num_samples))]

    def pad_backwards(self, batch: RolloutBatch, passes: int) -> None:
        return None


class FakeTrainerRank:
    """A trainer rank (``stages.trainer.ranks.TrainerRank``'s calls) whose ``train``
    raises ``error`` (``"oom"``: torch's out-of-memory error), or with ``error`` None
    waits in ``train`` until killed (a rank blocked in a collective)."""

    def __init__(self, error: str | None) -> None:
        self.error = error

    def train(self, part: RolloutBatch, scale: float, pad: int) -> dict[str, float]:
        if self.error == "oom":
            import torch

            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if self.error is not None:
            raise ValueError(self.error)
        while True:
            time.sleep(1)



class FakeFailingTrainerRank(TrainerRank):
    """A real trainer rank whose ``train`` raises before its engine does anything, while
    the other ranks go on into that call's collectives."""

    def train(self, part: RolloutBatch, scale: float, pad: int) -> dict[str, float]:
        raise ValueError(f"fake failure in train on rank {self.rank}")


class FakeSleepingBackend:
    """A rollout backend (``rollout.backend: tests.ray_local.fakes:FakeSleepingBackend``)
    that can sleep and wake like vLLM's sleep mode and logs every call in order. Each
    ``generate`` takes ``GENERATE_S`` and fails if the engine is asleep at its start or
    falls asleep before it ends: what a sleeping vLLM's freed memory would mean."""

    GENERATE_S = 0.3
    REFUSE: frozenset[int] = frozenset()  # versions whose update fails its verification

    def __init__(self, model_path: Any, rollout_cfg: Any, dtype: str) -> None:
        self.version = 0
        self.asleep: set[str] = set()
        self.events: list[tuple[Any, ...]] = []

    async def start(self) -> None:
        self.events.append(("start",))

    async def generate(self, prompt_token_ids: list[list[int]], sampling: Any) -> list[Any]:
        from stages.rollout.base import Completion, GenerationResult

        self.events.append(("generate", self.version))
        for _ in range(2):
            if self.asleep:
                raise RuntimeError(f"generate on a sleeping engine ({sorted(self.asleep)} freed)")
            await asyncio.sleep(self.GENERATE_S / 2)
        return [GenerationResult(prompt_token_ids=ids, completions=[
            Completion(token_ids=[5, 6], logprobs=[-0.5, -0.5], token_versions=[self.version] * 2,
                       finish_reason="length", text="ab") for _ in range(sampling.n)]) for ids in prompt_token_ids]

    async def update_weights(self, data: bytes, version: int, verify: bool = True) -> tuple[float, float]:
        from pipeline.weights import WeightSyncError

        if "weights" in self.asleep:
            raise RuntimeError("update_weights into freed weight memory")
        if version in self.REFUSE:
            raise WeightSyncError(f"fake: version {version} did not arrive intact")
        self.events.append(("update", version))
        self.version = version
        return (1.0, 1.0)

    async def sleep(self) -> None:
        self.events.append(("sleep",))
        self.asleep = {"weights", "kv_cache"}

    async def wake_up(self, tags: list[str]) -> None:
        self.events.append(("wake", *tags))
        self.asleep -= set(tags)

    async def live_fingerprint(self) -> tuple[float, float]:
        return (1.0, 1.0)

    async def shutdown(self) -> None:
        self.events.append(("shutdown",))


class FakeDyingBackend:
    """A rollout backend (``rollout.backend: tests.ray_local.fakes:FakeDyingBackend``) whose
    engine dies as a killed engine process would: after ``kill()`` every call in flight
    and every later one raises ``EngineDied``. ``DIE_AT``: engine i (the i-th built in
    this process, from 0) kills itself at the start of its ``DIE_AT[i]``-th ``generate``
    call (its warm-up is the first); engines past the list live. Each ``generate`` takes
    ``GENERATE_S``; completions are two tokens tagged with the version served. A fresh
    engine serves the checkpoint (fingerprint ``CHECKPOINT``, read at construction); an
    update serves ``fake_fingerprint(data)``; a payload in ``GONE`` is refused with
    ``WeightSyncError`` before anything loads (a ``cuda_ipc`` ring slot rewritten since);
    with ``START_GATE`` set, ``start`` waits for it. With ``CACHE_TOKENS`` set, an engine
    built without a cache size (``rollout.kv_cache_gib``) reports that many tokens of KV
    cache, as vLLM does of the cache it sized itself; one given a size reports that size.
    Every engine built in this process is kept in ``built``, its calls in ``events``, the
    cache size it was given in ``kv_cache_gib``."""

    GENERATE_S = 0.3
    CHECKPOINT = (1.0, 1.0)
    DIE_AT: tuple[int, ...] = ()
    GONE: frozenset[bytes] = frozenset()
    START_GATE: asyncio.Event | None = None
    CACHE_TOKENS: int | None = None
    built: ClassVar[list[FakeDyingBackend]] = []

    def __init__(self, model_path: Any, rollout_cfg: Any, dtype: str) -> None:
        self.kv_cache_gib = rollout_cfg.kv_cache_gib
        self.version = 0
        self.live = FakeDyingBackend.CHECKPOINT
        index = len(FakeDyingBackend.built)
        self.die_at = self.DIE_AT[index] if index < len(self.DIE_AT) else None
        self.calls = 0
        self.dead = asyncio.Event()
        self.events: list[tuple[Any, ...]] = []
        FakeDyingBackend.built.append(self)

    def kill(self) -> None:
        self.dead.set()

    def kv_cache_tokens(self) -> int | None:
        return self.CACHE_TOKENS

    def _check(self) -> None:
        from stages.rollout.base import EngineDied

        if self.dead.is_set():
            raise EngineDied("fake engine process killed")

    async def start(self) -> None:
        if self.START_GATE is not None:
            await self.START_GATE.wait()
        self.events.append(("start",))

    async def generate(self, prompt_token_ids: list[list[int]], sampling: Any) -> list[Any]:
        from stages.rollout.base import Completion, EngineDied, GenerationResult

        self.calls += 1
        if self.calls == self.die_at:
            self.kill()
        self._check()
        self.events.append(("generate", self.version))
        version = self.version
        try:
            await asyncio.wait_for(self.dead.wait(), self.GENERATE_S)
        except TimeoutError:
            return [GenerationResult(prompt_token_ids=ids, completions=[
                Completion(token_ids=[5, 6], logprobs=[-0.5, -0.5], token_versions=[version] * 2,
                           finish_reason="length", text="ab") for _ in range(sampling.n)]) for ids in prompt_token_ids]
        raise EngineDied("fake engine process killed while generating")

    async def update_weights(self, data: bytes, version: int, verify: bool = True) -> tuple[float, float]:
        from pipeline.weights import WeightSyncError

        self._check()
        if data in self.GONE:
            raise WeightSyncError(f"fake: the payload of version {version} was rewritten before it loaded")
        self.events.append(("update", version))
        self.version, self.live = version, fake_fingerprint(data)
        return self.live

    async def live_fingerprint(self) -> tuple[float, float]:
        self._check()
        return self.live

    async def shutdown(self) -> None:
        self.events.append(("shutdown",))


class FakeTwiceDyingBackend(FakeDyingBackend):
    """``FakeDyingBackend`` whose first engine dies at its 3rd call, the second at its 4th."""

    DIE_AT = (3, 4)


def fake_fingerprint(data: bytes) -> tuple[float, float]:
    """``FakeDyingBackend``'s fingerprint of a payload: (length, byte sum)."""
    return float(len(data)), float(sum(data))


class FakePromptSource:
    """``count`` prompt batches of ``prompts`` prompts each, ids ``b<batch>-<i>``, all for
    step 0 (no version to wait for)."""

    def __init__(self, count: int, prompts: int = 2) -> None:
        self.count, self.prompts = count, prompts

    async def generate(self) -> AsyncIterator[PromptBatch]:
        for b in range(self.count):
            yield PromptBatch(batch_id=b, step=0, prompts=[Prompt(prompt_id=f"b{b}-{i}", text=str(i))
                                                           for i in range(self.prompts)])
class FakeAnsweringBackend:
    """A rollout backend (``rollout.backend: tests.ray_local.fakes:FakeAnsweringBackend``)
    that answers better with each version, as training would make it: to a prompt
    ``<d>...=`` a greedy completion answers ``d`` from version 2 on, sampled completion j
    once ``j < version - 1``; any other answer is ``x``. Each ``generate`` takes
    ``GENERATE_S`` (after ``gate``, when one is set, opens) and logs ("generate", version
    at its start, version at its end, temperature); ``update_weights`` logs ("update",
    version)."""

    GENERATE_S = 0.1

    def __init__(self, model_path: Any, rollout_cfg: Any, dtype: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.version = 0
        self.events: list[tuple[Any, ...]] = []
        self.gate: asyncio.Event | None = None

    async def start(self) -> None:
        return None

    async def generate(self, prompt_token_ids: list[list[int]], sampling: Any) -> list[Any]:
        from stages.rollout.base import Completion, GenerationResult

        if self.gate is not None:
            await self.gate.wait()
        began = self.version
        await asyncio.sleep(self.GENERATE_S)
        self.events.append(("generate", began, self.version, sampling.temperature))
        results = []
        for ids in prompt_token_ids:
            digit = self.tok.decode(ids, skip_special_tokens=True)[:1]
            comps = []
            for j in range(sampling.n):
                right = self.version >= 2 if sampling.temperature == 0 else j < self.version - 1
                out = self.tok(digit if right else "x", add_special_tokens=False)["input_ids"]
                comps.append(Completion(token_ids=out, logprobs=[-0.5] * len(out),
                                        token_versions=[self.version] * len(out), finish_reason="stop",
                                        text=digit if right else "x"))
            results.append(GenerationResult(prompt_token_ids=ids, completions=comps))
        return results

    async def update_weights(self, data: bytes, version: int, verify: bool = True) -> tuple[float, float]:
        self.events.append(("update", version))
        self.version = version
        return (1.0, 1.0)

    async def live_fingerprint(self) -> tuple[float, float]:
        return (1.0, 1.0)

    async def shutdown(self) -> None:
        self.events.append(("shutdown",))


class FakeBlockingSetupSink(FakeSink):
    """A sink whose set-up holds its actor's event loop for ``setup_s`` (as importing a
    large library does), so the actor answers no call meanwhile."""

    async def setup(self, ctx) -> None:
        self.tag = ctx.name
        self.setup_doing = "importing"
        time.sleep(self.setup_s)
