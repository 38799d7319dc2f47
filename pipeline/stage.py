"""The thin Ray actor shell every DataFlow node runs in.

A node's ``node_class`` is a plain *core* object (``setup``, ``generate`` for a source,
``process``, ``finish``, ``finalize``, ``status``, ``result``: docs/custom-nodes.md); the shell owns
everything Ray: awaiting the input queue, storing outputs in the object store, putting
references on the output queues, recording spans, taps and status.

Guarantees:
- every input item is processed exactly once; an exception in a core ends ``run`` with a
  ``StageError`` naming the stage (the runner stops the whole graph), and so does a failure
  the core's own background task reports with ``ctx.fail``, at once, even while no item
  is in the core;
- ``concurrency == 1``: outputs leave in input order; more: completion order; a core
  with ``max_gather`` > 1 gets the items already queued (never waited for), up to that
  many, in one ``process_many`` call;
- the event loop never runs heavy compute, so control calls are answered while a core works;
- telemetry leaves in one pull per driver tick; a core reaches the controller only
  through ``ctx.controller``, and what it posted has taken effect before ``run`` returns;
- output queues close exactly once; inputs are leased, so a dead actor's items are
  delivered again to its restarted self (docs/architecture.md, "The stage shell").
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import time
import traceback
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import ray

from pipeline.contracts import inspect_first_micro_batch, read_contract
from pipeline.controller import ControllerClient
from pipeline.delivery import DEDUP_WINDOW, SeenGroups
from pipeline.log import configure_logging, get_logger, redirect_process_output
from pipeline.profiler import SpanRecorder
from pipeline.queue import END, Origin, QueueHandle, fits_inline, is_end, resolve_entry


class StageError(RuntimeError):
    """A stage's core raised; carries the stage name and the remote traceback.
    ``died``: the stage's process died (killed, crashed) rather than its code raising."""

    def __init__(self, stage: str, message: str, remote_traceback: str = "", died: bool = False) -> None:
        super().__init__(f"stage {stage!r} failed: {message}")
        self.stage = stage
        self.message = message
        self.remote_traceback = remote_traceback
        self.died = died

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle their ``args``; ours has more, so say how to rebuild it.
        return (StageError, (self.stage, self.message, self.remote_traceback, self.died))

    @property
    def where(self) -> str:
        """Where the core's exception was raised (``describe_where``); "" if unknown."""
        return describe_where(self.remote_traceback)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent) + os.sep


def describe_where(remote_traceback: str, root: str = _PROJECT_ROOT) -> str:
    """The innermost frame of a formatted traceback as ``path:line in function`` and,
    where that frame is a library's (outside ``root``, this project's checkout), the
    innermost of the project's frames that led there (``..., called from ...``). Paths
    from the project root or the library's package; "" for a traceback without frames."""
    frames = _FRAME.findall(remote_traceback or "")
    if not frames:
        return ""

    def ours(path: str) -> bool:
        return path.startswith(root) and "-packages" + os.sep not in path[len(root):]

    def short(path: str) -> str:
        if ours(path):
            return path[len(root):]
        for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
            if marker in path:
                return path.split(marker, 1)[1]
        return path

    def text(frame: tuple[str, str, str]) -> str:
        return f"{short(frame[0])}:{frame[1]} in {frame[2]}"

    last = frames[-1]
    project = [f for f in frames if ours(f[0])]
    if ours(last[0]) or not project:
        return text(last)
    return f"{text(last)}, called from {text(project[-1])}"


def core_error_message(exc: BaseException) -> str:
    """``Type: message`` of a core's exception; assigning to a frozen wire value (an
    ``AttributeError: immutable type``) also says how to derive a new one instead."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, AttributeError) and str(exc).startswith("immutable type"):
        text += ("; wire types are frozen: return a changed copy, e.g. "
                 "msgspec.structs.replace(batch, rewards=new_rewards) (docs/custom-nodes.md)")
    return text


class StageContext:
    """What a core may use: its identity, the config, the controller, spans and a logger."""

    def __init__(self, name: str, replica: int, config: Any, controller: ControllerClient, spans: SpanRecorder) -> None:
        self.name = name
        self.replica = replica
        self.worker_id = f"{name}:{replica}"
        self.config = config
        self.controller = controller
        self.spans = spans
        self.log = get_logger(stage=name, replica=replica)
        self.recorder: Any = None  # set by the shell when a tap needs it
        self.failure: BaseException | None = None
        self._failed = asyncio.Event()

    def fail(self, exc: BaseException) -> None:
        """A core's own background task (a weight watcher) failed: the stage's ``run``
        ends with ``exc`` now, not at the next ``process`` call, which may never come
        (its input can wait on what the failure holds back). The first failure stands."""
        if self.failure is None:
            self.failure = exc
            self._failed.set()

    async def wait_failed(self) -> BaseException:
        await self._failed.wait()
        assert self.failure is not None
        return self.failure


def lease_id(worker_id: str, pid: int) -> str:
    """The id a stage process leases its inputs under: one per process, so a late call
    of a dead one is told apart from its restarted successor's."""
    return f"{worker_id}@{pid}"


def _as_list(out: Any) -> list[Any]:
    if out is None:
        return []
    return list(out) if isinstance(out, list) else [out]


@ray.remote(num_cpus=0, enable_task_events=False)  # as QueueActor: no per-call task events
class StageActor:
    def __init__(
        self,
        name: str,
        replica: int,
        node_class: Any,
        kwargs: dict[str, Any],
        config: Any,
        concurrency: int,
        tap: tuple[str, str] | None = None,
        log_level: str = "info",
        dedup: bool = False,
        dedup_window: int = DEDUP_WINDOW,
        debug: bool = False,
    ) -> None:
        created = time.monotonic()
        run_dir = getattr(config, "run_dir", None)
        console = None
        if run_dir is not None and log_level != "debug":  # a launched run: its stages log to files
            file_name = f"{name}.log" if replica == 0 else f"{name}-{replica}.log"
            console = redirect_process_output(Path(run_dir) / "logs" / file_name)
        configure_logging(log_level, console_fd=console)
        self.name = name
        self.concurrency = concurrency
        self.spans = SpanRecorder(stage=name if replica == 0 else f"{name}:{replica}")
        self.ctx = StageContext(name, replica, config, None, self.spans)  # the controller comes with setup
        if isinstance(node_class, str):
            from pipeline.plugins import import_object

            node_class = import_object(node_class, f"node {name!r} node_class")
        self.core = node_class(**kwargs)
        self._gen: AsyncIterator[Any] | None = None
        self._processed = 0
        self._emitted = 0
        self._state = "created"
        # (input edge, recording dir): what this stage consumes is written there, so a
        # recording holds exactly what the consumer saw (and the trainer's step records).
        self._tap = tap
        self._recorder: Any = None
        self.lease_id = lease_id(self.ctx.worker_id, os.getpid())
        self._released: list[int] = []  # leases done with, nothing emitted for them
        self._lost: list[int] = []  # leases whose object died with its producer
        self._seen = SeenGroups(dedup_window) if dedup else None
        self._lost_inputs = 0  # inputs whose producer died before they were read
        self._release_at_once = False  # lock-step: releases are not piggybacked
        # Debug runs: the first micro-batch of the input edge is printed and checked
        # against what the core declares it takes (pipeline/contracts.py).
        self._debug_pending = debug
        self._console = 2 if console is None else console
        self._constructed_s = time.monotonic() - created  # imports and the core's constructor

    # ---------------------------------------------------------------- lifecycle
    async def setup(self, controller: ControllerClient) -> dict[str, float]:
        """Set the stage up (again after a restart), with the controller's handle.

        The handle comes here, not with the constructor's arguments: Ray runs a
        restarted actor's constructor again with its first arguments, and warns at
        creation (``core_worker.cc``, once per run) that an argument holding an object
        reference (an actor handle does) may be gone by then. The runner calls ``setup``
        after every restart anyway. Returns where the start-up went, in seconds.
        """
        self.ctx.controller = controller
        self._state = "setup"
        self._open_taps()  # before the core's setup: the trainer saves its step-0 state there
        began = time.monotonic()
        if hasattr(self.core, "setup"):
            await self.core.setup(self.ctx)
        self._state = "ready"
        # Where a stage's start-up went: its process's age covers Ray starting it too.
        timings = {"process_age_s": round(time.time() - psutil.Process().create_time(), 2),
                   "constructed_s": round(self._constructed_s, 2), "setup_s": round(time.monotonic() - began, 2),
                   # The core's own phases (``startup_phases``: name -> seconds), where it times them.
                   **{f"{k}_s": round(v, 2) for k, v in getattr(self.core, "startup_phases", {}).items()}}
        self.ctx.log.info("stage ready", **timings)
        return timings

    def _open_taps(self) -> None:
        if self._tap is None:
            return
        from pipeline.config import to_dict
        from pipeline.recorder import RecordingWriter

        edge, root = self._tap
        cfg = self.ctx.config
        self._recorder = RecordingWriter(
            root, to_dict(cfg) if cfg is not None else None,
            every=cfg.record.every if cfg is not None else 1,
            run_name=cfg.run.name if cfg is not None else "", edges=[edge],
        )
        self.ctx.recorder = self._recorder

    def _record_input(self, item: Any) -> None:
        if self._recorder is not None:
            self._recorder.write_item(self._tap[0], item)

    async def run(self, inp: QueueHandle | None, outs: list[QueueHandle], step_items: int = 0) -> dict[str, Any]:
        """Stream until end-of-stream; returns counters and the core's result.
        ``step_items`` > 0: lock-step, that many source items per step (see the guarantees)."""
        self._state = "running"
        self._release_at_once = step_items > 0
        try:
            await self._unless_core_fails(self._stream(inp, outs, step_items))
        except BaseException as exc:
            self._state = "failed"
            raise StageError(self.name, core_error_message(exc), traceback.format_exc()) from exc
        finally:
            for out in outs:
                await out.close(self.ctx.worker_id)
            self.close_taps()
        self._state = "done"
        return self.report()

    async def _stream(self, inp: QueueHandle | None, outs: list[QueueHandle], step_items: int) -> None:
        if inp is None:
            emitted = 0
            async for item in self._source_items():
                await self._emit(item, outs)
                emitted += 1
                if step_items and emitted % step_items == 0:
                    with self.spans.span("wait_output"):  # blocked until the step has drained
                        await asyncio.gather(*(out.wait_drained() for out in outs))
        else:
            await self._consume(inp, outs)
        if hasattr(self.core, "finish"):
            for item in _as_list(await self.core.finish()):
                await self._emit(item, outs)
        await self.ctx.controller.settle()  # what the core posted has taken effect

    async def _unless_core_fails(self, work: Any) -> None:
        """``work``, cancelled where the core reports a failure first (``ctx.fail``)."""
        task = asyncio.ensure_future(work)
        failed = asyncio.ensure_future(self.ctx.wait_failed())
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also where ``run`` itself is cancelled
            failed.cancel()
            stopped = not task.done()
            if stopped:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if stopped:
            raise self.ctx.failure  # type: ignore[misc]
        task.result()

    def _source_items(self) -> AsyncIterator[Any]:
        if self._gen is None:
            if not hasattr(self.core, "generate"):
                raise TypeError(f"node {self.name!r} has no input and its core has no generate()")
            self._gen = self.core.generate()
        return self._gen

    async def _fetch(self, inp: QueueHandle, limit: int = 1, puts: list[Any] = ()) -> list[tuple[Any, int]]:
        """The next input item and up to ``limit`` - 1 more already queued, each with its
        lease, with wait and transfer spans; or [(``END``, -1)]. ``puts``: outputs
        (``QueueHandle.put_args``) that go in the same call, before the lease."""
        while True:
            t0 = time.time()
            released, self._released = self._released, []
            lost, self._lost = self._lost, []
            if puts:
                _, leased = await inp.put_and_lease(list(puts), self.lease_id, released, lost, limit)
                puts = ()
            else:
                leased = await inp.lease_ready(self.lease_id, released, lost, limit)
            if is_end(leased[0][0]):
                self.spans.add("wait_input", t0, time.time())
                return [(END, -1)]
            t1 = time.time()
            got = []
            for ref, seq in leased:
                item = await self._resolve(inp, ref, seq)
                if item is None:
                    continue
                batch_id = getattr(item, "batch_id", -1)
                # Waiting for an item and moving it are told apart: "transfer" is the hop's cost.
                self.spans.add("wait_input", t0, t1, batch_id)
                self.spans.add("transfer", t1, time.time(), batch_id)
                got.append((item, seq))
            if got:
                return got

    async def _resolve(self, inp: QueueHandle, ref: Any, seq: int) -> Any:
        """The leased item, or None when it is lost or a duplicate (its lease settled)."""
        try:
            item = await resolve_entry(ref)
        except ray.exceptions.ObjectLostError:
            # Its producer died before this read it; the producer's own input is
            # still leased upstream and is delivered again to its restarted self.
            self._lost_inputs += 1
            self._lost.append(seq)
            self.ctx.log.warning("input_lost", edge=inp.name, detail="its producer died; redelivered upstream")
            return None
        if self._seen is not None:
            item = self._seen.filter(item)
            if item is None:
                self._released.append(seq)
                self.ctx.log.info("duplicate_dropped", edge=inp.name)
                return None
        self._record_input(item)
        if self._debug_pending:
            self._debug_pending = False
            text = inspect_first_micro_batch(inp.name, item, read_contract(type(self.core), self.name), self.name)
            # On the console (the user asked for it) and in this stage's log.
            for fd in {self._console, 2}:
                os.write(fd, (text + "\n").encode())
        return item

    async def _consume(self, inp: QueueHandle, outs: list[QueueHandle]) -> None:
        if self.concurrency == 1:
            await self._consume_in_order(inp, outs)
        else:
            await self._consume_concurrently(inp, outs)

    async def _consume_in_order(self, inp: QueueHandle, outs: list[QueueHandle]) -> None:
        """One item at a time, in order, with the hops hidden behind compute: the next
        input is fetched while the core works, and an item's outputs go with the lease
        after it when that lease is already back (one call for both), else in a put of
        their own at once (never held back: in lock-step the next input comes only after
        them). This stage then holds at most one item beyond its input queue and one
        beyond its output queue; backpressure still reaches the producer one item later.
        A core with ``max_gather`` > 1 gets what is already queued, up to that many items
        at once, in one ``process_many`` call (one item: ``process``)."""
        limit = self._gather_limit()
        fetch = asyncio.create_task(self._fetch(inp, limit))
        sender: asyncio.Task[None] | None = None
        riding: list[Any] = []  # outputs that go with the next lease
        try:
            while True:
                got = await fetch
                if is_end(got[0][0]):
                    break
                fetch = asyncio.create_task(self._fetch(inp, limit, riding))
                riding = []
                items = [item for item, _ in got]
                with self.spans.span("busy", batch_id=getattr(items[0], "batch_id", -1)):
                    outs_each = await self._process_items(items)
                self._processed += len(items)
                if sender is not None:
                    await sender  # a failed put surfaces here
                    sender = None
                puts = self._output_puts(outs_each, [seq for _, seq in got], outs, inp)
                if fetch.done():
                    riding = puts
                elif puts:
                    sender = asyncio.create_task(self._send(inp, puts))
            if riding:
                await self._send(inp, riding)
            if sender is not None:
                await sender
        finally:
            for task in (fetch, sender):
                if task is not None and not task.done():
                    task.cancel()

    def _gather_limit(self) -> int:
        """Items the core takes at once (its ``max_gather``, read after ``setup``)."""
        limit = int(getattr(self.core, "max_gather", 1) or 1)
        if limit > 1 and not hasattr(self.core, "process_many"):
            raise TypeError(f"node {self.name!r}: max_gather is {limit} but its core has no process_many()")
        return max(1, limit)

    async def _process_items(self, items: list[Any]) -> list[Any]:
        """The core's output for each of ``items``, in order."""
        if len(items) == 1:
            return [await self.core.process(items[0])]
        outs = await self.core.process_many(items)
        if not isinstance(outs, list) or len(outs) != len(items):
            raise TypeError(f"node {self.name!r}: process_many must return a list of one output per item "
                            f"({len(items)}), got {type(outs).__name__}")
        return outs

    def _output_puts(self, outs_each: list[Any], seqs: list[int], outs: list[QueueHandle],
                     inp: QueueHandle) -> list[Any]:
        """The puts (``QueueHandle.put_args``) of each item's outputs, in order, each tagged
        with its input lease's origin (``_origin``)."""
        puts = []
        for out, seq in zip(outs_each, seqs, strict=True):
            items = _as_list(out)
            origin = self._origin(inp, seq, len(items) * len(outs))
            for o in items if origin is not None else ():
                entry = self._entry(o)
                puts.extend(q.put_args(entry, origin) for q in outs)
        return puts

    async def _send(self, inp: QueueHandle, puts: list[Any]) -> None:
        """``puts`` in their order, each waiting for room (backpressure); the graph's
        edges share ``inp``'s queue actor."""
        with self.spans.span("wait_output"):
            for args in puts:
                await inp.actor.put.remote(*args)

    def _origin(self, inp: QueueHandle, seq: int, parts: int) -> Origin | None:
        """The origin of ``parts`` outputs of input lease ``seq``; with none, the lease is
        released instead (nothing downstream will release it) and None returned."""
        if parts:
            return Origin(inp.name, self.lease_id, seq, parts)
        if self._release_at_once:
            inp.release(self.lease_id, seq)
        else:
            self._released.append(seq)
        return None

    async def _consume_concurrently(self, inp: QueueHandle, outs: list[QueueHandle]) -> None:
        """Up to ``concurrency`` items in the core at once; outputs in completion order."""
        pending: set[asyncio.Task[None]] = set()
        errors: list[BaseException] = []
        slots = asyncio.Semaphore(self.concurrency)

        def done(task: asyncio.Task[None]) -> None:
            pending.discard(task)
            slots.release()
            if not task.cancelled() and task.exception() is not None:
                errors.append(task.exception())  # type: ignore[arg-type]

        while True:
            await slots.acquire()
            if errors:
                raise errors[0]
            ((item, seq),) = await self._fetch(inp)
            if is_end(item):
                slots.release()
                break
            task = asyncio.create_task(self._handle(item, outs, inp, seq))
            pending.add(task)
            task.add_done_callback(done)
        if pending:
            await asyncio.gather(*pending)
        if errors:
            raise errors[0]

    async def _handle(self, item: Any, outs: list[QueueHandle], inp: QueueHandle, seq: int) -> None:
        with self.spans.span("busy", batch_id=getattr(item, "batch_id", -1)):
            out = await self.core.process(item)
        self._processed += 1
        puts = self._output_puts([out], [seq], outs, inp)
        if puts:
            await self._send(inp, puts)

    def _entry(self, item: Any) -> Any:
        """``item`` as it travels: itself when small enough to ride inline, else a
        reference, put into the object store once for every output queue."""
        with self.spans.span("transfer", batch_id=getattr(item, "batch_id", -1)):
            entry = item if fits_inline(item) else ray.put(item)
        self._emitted += 1
        return entry

    async def _emit(self, item: Any, outs: list[QueueHandle], origin: Origin | None = None) -> None:
        entry = self._entry(item)
        for out in outs:
            with self.spans.span("wait_output", batch_id=getattr(item, "batch_id", -1)):
                await out.put_entry(entry, origin)

    def close_taps(self) -> None:
        if self._recorder is not None:
            self._recorder.close()

    # ---------------------------------------------------------------- control calls
    def process_id(self) -> tuple[str, int]:
        """(host name, pid) of this actor, so the driver can reap what it spawned (and
        name its leases, ``lease_id``, when it dies)."""
        import socket

        return socket.gethostname(), os.getpid()

    def setup_doing(self) -> str | None:
        """What the core's set-up is doing now (its ``setup_doing``: "starting vLLM's
        engine", ...), for the driver's ``setting_up`` lines; None where it does not say."""
        doing = getattr(self.core, "setup_doing", None) if self._state == "setup" else None
        return doing if isinstance(doing, str) and doing else None

    def telemetry(self) -> dict[str, Any]:
        """What the driver's tick takes from this stage, in one call: the spans since the
        last call and the core's status (None without ``status()``)."""
        return {"spans": self.spans.drain(), "status": self.core.status() if hasattr(self.core, "status") else None}

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "stage": self.name,
            "state": self._state,
            "processed": self._processed,
            "emitted": self._emitted,
        }
        if hasattr(self.core, "status"):
            out["core"] = self.core.status()
        if hasattr(self.core, "result"):
            out["result"] = self.core.result()
        if self._recorder is not None:
            out["recording"] = self._recorder.stats()
        if self._seen is not None or self._lost_inputs:
            out["delivery"] = {"duplicate_groups_dropped": self._seen.dropped_groups if self._seen else 0,
                               "lost_inputs_skipped": self._lost_inputs}
        return out

    async def finalize(self) -> None:
        """After every stage drained, before the driver's last tick: the core's
        ``finalize()`` (the rollout's final evaluation); an exception is a ``StageError``."""
        if not hasattr(self.core, "finalize"):
            return
        self._state = "finalizing"
        try:
            await self.core.finalize()
        except BaseException as exc:
            self._state = "failed"
            raise StageError(self.name, core_error_message(exc), traceback.format_exc()) from exc
        self._state = "done"

    async def shutdown(self) -> None:
        if hasattr(self.core, "shutdown"):
            res = self.core.shutdown()
            if inspect.isawaitable(res):
                await res
