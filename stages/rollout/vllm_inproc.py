"""vLLM's engine core inside the rollout's own process, stepped by one thread.

``InProcessEngine`` gives ``VLLMBackend`` the part of ``AsyncLLM``'s surface it uses over
vLLM's ``LLMEngine`` with ``multiprocess_mode`` off, so step outputs are not serialised
between processes (``rollout.engine_core: in_process``). Details: docs/architecture.md,
"In-process engine".

Guarantees:
- one thread, the stepper, builds the engine and alone calls it; adds, aborts, pauses and
  RPCs run between two engine steps, so nothing races the scheduler;
- paused: no step runs until ``resume_generation``; pausing returns once the step in
  progress is processed; keep mode recomputes KV with the weights loaded meanwhile;
- a finished request's output reaches its collector on the event loop that added it;
- a step that raises fails every request in flight and every later call; ``shutdown``
  fails what is in flight with ``EngineStopped``;
- with the sampler tap every completion carries one log-prob per token, or fails with
  ``LookupError``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog

from stages.rollout.vllm_common import batch_usage, read_sampled_logprobs
from stages.rollout.vllm_sampler_tap import SampledLogprobs, check_against_vllm, install_sampler_tap

log = structlog.get_logger(stage="rollout")


class EngineStopped(RuntimeError):
    """The in-process engine was shut down (or its stepper died) with the request in flight."""


class SchedulerProbe:
    """What vLLM's scheduler did with the KV cache, read after every engine step on the
    stepper thread: ``kv_usage_mean`` / ``kv_usage_max`` (the share of KV blocks in use) and
    ``preemptions`` (times a running request lost its blocks, to be recomputed: the cache was
    too small for what was in flight, or a weight update's pause dropped every block, which
    recomputes each request in flight with the new weights: those are also counted apart,
    ``update_recomputes``, so the rest is what the cache was short). Reads
    ``scheduler.kv_cache_manager.usage``, ``scheduler.running`` and each live request's
    ``num_preemptions``; a vLLM without them is reported once in ``unavailable`` and read
    no further. A request's count is added when it leaves."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.unavailable = "" if scheduler is not None else "no in-process scheduler"
        self.samples = 0
        self.usage_sum = self.usage_max = 0.0
        self.preempted_done = 0
        self.update_recomputes = 0
        self._live: dict[str, int] = {}

    @classmethod
    def of(cls, llm_engine: Any) -> SchedulerProbe:
        core = getattr(getattr(llm_engine, "engine_core", None), "engine_core", None)
        return cls(getattr(core, "scheduler", None))

    def observe(self) -> None:
        if self.unavailable:
            return
        try:
            usage = float(self.scheduler.kv_cache_manager.usage)
            live = {rid: int(r.num_preemptions) for rid, r in self.scheduler.requests.items()}
        except Exception as err:  # a probe never fails the stepper: another vLLM's internals
            self.unavailable = f"this vLLM's scheduler differs: {err!r}"
            return
        self.samples += 1
        self.usage_sum += usage
        self.usage_max = max(self.usage_max, usage)
        self.preempted_done += sum(n for rid, n in self._live.items() if rid not in live)
        self._live = live

    def before_update_recompute(self) -> None:
        """Just before a weight update's pause drops every block: the running requests,
        which it preempts, are ``update_recomputes``."""
        if self.unavailable:
            return
        try:
            self.update_recomputes += len(self.scheduler.running)
        except Exception as err:
            self.unavailable = f"this vLLM's scheduler differs: {err!r}"

    def stats(self) -> dict[str, float]:
        """The figures so far; safe to read from another thread while the stepper runs
        (the live requests' dict is copied in one step, not iterated while it changes)."""
        if self.unavailable:
            return {}
        return {"kv_usage_mean": self.usage_sum / self.samples if self.samples else 0.0,
                "kv_usage_max": self.usage_max, "preemptions": self.preempted_done + sum(self._live.copy().values()),
                "update_recomputes": self.update_recomputes}


class _Collector:
    """One request's outputs, on the event loop that added it (``AsyncLLM``'s
    collector surface: ``get_nowait`` returns None when empty, ``get`` waits)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:
        self._queue.put_nowait(item)

    def get_nowait(self) -> Any:
        try:
            item = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    async def get(self) -> Any:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class InProcessEngine:
    """``LLMEngine`` (engine core in this process) behind a stepper thread; see the
    module docstring. Construct it off the event loop: it waits for the engine."""

    def __init__(self, engine_args: Any, sampler_tap: str = "never") -> None:
        """``sampler_tap`` (``rollout.sampler_tap``): "auto" or "verify" installs the
        sampler tap (``vllm_sampler_tap``) where that is exact; ``self.sampler_tap``
        says whether it was installed, ``self.sampler_tap_unavailable`` why not."""
        self._cv = threading.Condition()
        self._calls: list[tuple[Callable[[Any], Any], concurrent.futures.Future]] = []
        self._collectors: dict[str, _Collector] = {}
        self._paused = False
        self._stopping = False
        self._failure: BaseException | None = None
        self._engine: Any = None
        self._want_tap = sampler_tap != "never"
        self._ledger: Any = None  # SampledLogprobLedger once the tap is installed
        self._internal: dict[str, str] = {}  # request id -> vLLM's internal id (tapped requests)
        self.sampler_tap_unavailable = "" if self._want_tap else "not asked for"
        # Tokens whose tap value was checked against vLLM's, and the largest difference.
        self._tap_checked, self._tap_max_diff = 0, 0.0
        # The stepper's account (read by ``stats``): engine steps, the seconds inside
        # them, the requests unfinished at each step (summed), and the seconds spent
        # running queued calls (adds, aborts, RPCs) between steps.
        self._steps, self._step_s, self._step_requests, self._calls_s = 0, 0.0, 0, 0.0
        self._tap_s = 0.0  # the sampler tap's reading and filing after the steps
        self._probe = SchedulerProbe(None)  # the engine's, once the stepper has built it
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(engine_args, ready), name="vllm-stepper", daemon=True)
        self._thread.start()
        ready.result()  # the engine's construction error, if any, is raised here
        self.output_processor = self._engine.output_processor
        self.model_config = self._engine.model_config
        self.vllm_config = self._engine.vllm_config  # its cache_config has the KV blocks made
        self.sampler_tap = self._ledger is not None

    # ------------------------------------------------------------------ stepper thread
    def _run(self, engine_args: Any, ready: concurrent.futures.Future) -> None:
        try:
            self._engine = _build_llm_engine(engine_args)
        except BaseException as err:
            ready.set_exception(err)
            return
        if self._want_tap:
            try:
                self._ledger, self.sampler_tap_unavailable = install_sampler_tap(self._engine)
            except Exception as err:  # another vLLM's internals: vLLM reports the log-probs
                self._ledger, self.sampler_tap_unavailable = None, f"installing it failed: {err!r}"
        self._probe = SchedulerProbe.of(self._engine)
        ready.set_result(None)
        try:
            self._loop_steps()
        except BaseException as err:  # a failed step, or a bug here: fail loudly, never hang
            self._fail_everything(err)
            log.error("vLLM engine stepper failed", error=repr(err))
        finally:
            self._release_engine()

    def _loop_steps(self) -> None:
        engine = self._engine
        while True:
            with self._cv:
                while not self._calls and not self._stopping and (self._paused or not engine.has_unfinished_requests()):
                    self._cv.wait()
                calls, self._calls = self._calls, []
                if self._stopping:
                    for _, future in calls:
                        future.set_exception(EngineStopped("the in-process vLLM engine is shut down"))
                    return
            t0 = time.perf_counter()
            for fn, future in calls:
                try:
                    future.set_result(fn(engine))
                except BaseException as err:
                    future.set_exception(err)
            t1 = time.perf_counter()
            self._calls_s += t1 - t0
            if self._paused or not engine.has_unfinished_requests():
                continue
            requests = engine.get_num_unfinished_requests()
            outputs = engine.step()
            self._steps += 1
            self._step_s += time.perf_counter() - t1
            self._step_requests += requests
            t2 = time.perf_counter()
            self._probe.observe()
            if self._ledger is not None:
                self._ledger.settle()  # the copies already done: at most a few steps stay pending
            for out in outputs:
                collector = self._collectors.get(out.request_id)
                if collector is None:  # aborted meanwhile
                    continue
                if out.finished:
                    del self._collectors[out.request_id]
                if self._ledger is not None:
                    out = self._attach_tapped_logprobs(out)
                collector.loop.call_soon_threadsafe(collector.put, out)
            if self._ledger is not None:
                self._tap_s += time.perf_counter() - t2

    def _attach_tapped_logprobs(self, out: Any) -> Any:
        """``out`` with the tap's log-probs on each completion vLLM gave none, and those
        vLLM gave checked against the tap's (the ``LookupError`` instead when the tap has
        none, or they differ or do not fit: the collector raises it, and the request is
        forgotten, so a later output of it cannot read another token's value)."""
        internal = self._internal.get(out.request_id)
        if internal is None:
            return out
        failed = False
        try:
            for comp in out.outputs:
                token_ids = list(comp.token_ids)
                tapped = self._ledger.take(internal, len(token_ids))
                if comp.logprobs is None:
                    comp.logprobs = SampledLogprobs(token_ids, tapped)
                else:
                    diff = check_against_vllm(out.request_id, tapped, read_sampled_logprobs(comp.logprobs, token_ids))
                    self._tap_checked += len(tapped)
                    self._tap_max_diff = max(self._tap_max_diff, diff)
        except (LookupError, ValueError) as err:  # this request fails; the engine steps on
            failed = True
            return err
        finally:
            if out.finished or failed:
                del self._internal[out.request_id]
                self._ledger.forget(internal)
        return out

    def _fail_everything(self, err: BaseException) -> None:
        with self._cv:
            self._failure = err
            calls, self._calls = self._calls, []
        for _, future in calls:
            if not future.done():
                future.set_exception(err)
        collectors, self._collectors = self._collectors, {}
        for collector in collectors.values():
            try:
                collector.loop.call_soon_threadsafe(collector.put, err)
            except RuntimeError:  # that loop is closed: nobody waits on it
                pass

    def _release_engine(self) -> None:
        engine, self._engine = self._engine, None
        core = getattr(engine, "engine_core", None)
        try:
            if core is not None:
                core.shutdown()
        except Exception as err:  # the process is going away; nothing left to free
            log.debug("engine core shutdown failed", error=repr(err))

    # ------------------------------------------------------------------ any thread
    def stats(self) -> dict[str, float]:
        """The stepper's account so far: ``steps``, ``step_s`` (inside ``engine.step``),
        ``mean_step_ms``, ``mean_requests`` (unfinished requests per step) and
        ``calls_s`` (queued calls run between steps); with the sampler tap
        ``tap_records`` (its steps read), ``tap_s`` (its reading and filing after the
        steps, outside ``step_s``), ``tap_checked`` (tokens checked against vLLM's
        log-probs) and ``tap_max_abs_diff`` (the largest difference there); where vLLM's
        scheduler can be read, ``kv_usage_mean``, ``kv_usage_max`` and ``preemptions``
        (``SchedulerProbe``)."""
        steps = self._steps
        return {"steps": steps, "step_s": self._step_s, "calls_s": self._calls_s,
                "tap_records": self._ledger.records if self._ledger is not None else 0, "tap_s": self._tap_s,
                "tap_checked": self._tap_checked, "tap_max_abs_diff": self._tap_max_diff,
                "mean_step_ms": 1000 * self._step_s / steps if steps else 0.0,
                "mean_requests": self._step_requests / steps if steps else 0.0, **self._probe.stats()}

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the stepper between two steps; its result."""
        return await asyncio.wrap_future(self._submit(fn))

    def _submit(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._failure is not None:
                raise EngineStopped(f"the in-process vLLM engine failed: {self._failure!r}") from self._failure
            if self._stopping:
                raise EngineStopped("the in-process vLLM engine is shut down")
            self._calls.append((fn, future))
            self._cv.notify()
        return future

    async def add_request(self, request_id: str, prompt: Any, params: Any) -> _Collector:
        collector = _Collector(asyncio.get_running_loop())

        def add(engine: Any) -> None:
            if self._ledger is not None and params.n != 1:
                raise ValueError(f"the sampler tap files one completion per request, got n={params.n}")
            self._collectors[request_id] = collector
            try:
                internal = engine.add_request(request_id, prompt, params)
            except BaseException:
                del self._collectors[request_id]
                raise
            if self._ledger is not None:
                # vLLM's own count of the prompt: the positions the tap reads are its.
                state = engine.output_processor.request_states.get(internal)
                prompt_len = getattr(state, "prompt_len", None) or len(prompt["prompt_token_ids"])
                max_tokens = params.max_tokens
                if max_tokens is None:
                    max_tokens = engine.model_config.max_model_len - prompt_len
                self._internal[request_id] = internal
                self._ledger.track(internal, prompt_len, max_tokens)

        await self.call(add)
        return collector

    async def abort(self, request_id: str, internal: bool = False) -> None:
        def abort(engine: Any) -> None:
            self._collectors.pop(request_id, None)
            engine.abort_request([request_id], internal=internal)
            if internal:  # vLLM's id: the tapped request it belongs to
                external = next((k for k, v in self._internal.items() if v == request_id), None)
                tapped = request_id if self._internal.pop(external, None) is not None else None
            else:
                tapped = self._internal.pop(request_id, None)
            if tapped is not None:
                self._ledger.forget(tapped)

        await self.call(abort)

    async def pause_generation(self, mode: str = "keep", clear_cache: bool = True) -> None:
        if mode != "keep":
            raise ValueError(f"InProcessEngine pauses in keep mode only, got mode={mode!r}")

        def pause(engine: Any) -> None:
            self._paused = True
            if clear_cache:
                self._probe.before_update_recompute()
                engine.reset_prefix_cache(reset_running_requests=True)

        await self.call(pause)

    async def resume_generation(self) -> None:
        def resume(_: Any) -> None:
            self._paused = False

        await self.call(resume)

    async def sleep(self, level: int = 1) -> None:
        await self.call(lambda engine: engine.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.call(lambda engine: engine.wake_up(tags))

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        return await self.call(lambda engine: engine.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs))

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop stepping, fail what is in flight, release the engine. Idempotent."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("vLLM engine stepper still running after shutdown", timeout_s=timeout)
            return
        collectors, self._collectors = self._collectors, {}
        for collector in collectors.values():
            try:
                collector.loop.call_soon_threadsafe(collector.put, EngineStopped("the in-process vLLM engine is shut down"))
            except RuntimeError:
                pass


def _build_llm_engine(engine_args: Any) -> Any:
    """``LLMEngine`` with its engine core in this process, whatever
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` says (``from_engine_args`` would follow it), under
    the backend's usage context (``batch_usage``).

    On CPU with one worker and no executor chosen, the model runs in this process too
    (vLLM's ``uni`` executor, as on a GPU). vLLM's CPU platform swaps ``uni`` for a worker
    process of its own unless ``VLLM_ENABLE_V1_MULTIPROCESSING`` is 0 while the config is
    made: that process imports torch and vLLM again before it loads the model, and pins
    its OpenMP threads to the first core whatever Ray gave the actor. The quickstart's
    engine started in 7.8 s instead of 15.2 s (2 cores), and a 2-step quickstart took
    33 s instead of 47. vLLM's CPU platform calls this path unsupported for the OpenMP
    binding it would set up (checked with vLLM 0.32): here torch keeps the threads Ray
    gave the actor (its ``num_cpus``). The engine also joins a one-rank torch.distributed
    group in this process, as it does on a GPU.
    """
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    here = (current_platform.is_cpu() and engine_args.tensor_parallel_size == 1
            and engine_args.distributed_executor_backend is None)
    if here:
        engine_args = dataclasses.replace(engine_args, distributed_executor_backend="uni")
    with _environ(VLLM_ENABLE_V1_MULTIPROCESSING="0" if here else None):
        vllm_config = engine_args.create_engine_config(batch_usage())
    set_num_threads = torch.set_num_threads
    try:
        return LLMEngine(
            vllm_config=vllm_config,
            executor_class=Executor.get_class(vllm_config),
            log_stats=not engine_args.disable_log_stats,
            usage_context=batch_usage(),
            multiprocess_mode=False,
        )
    finally:
        # vLLM's CPU worker replaces torch.set_num_threads for its whole process, to keep
        # its pinned threads; in the uni executor that process is the rollout's.
        torch.set_num_threads = set_num_threads


@contextlib.contextmanager
def _environ(**values: str | None) -> Iterator[None]:
    """Set (a value) or leave alone (None) environment variables, restored after."""
    saved = {k: os.environ.get(k) for k, v in values.items() if v is not None}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
