"""``rollout``: the generation engine (vLLM or Hugging Face), its sampling, memory,
weights transport and multi-turn tools."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pipeline.config.base import NonNegFloat, NonNegInt, PosFloat, PosInt, Probability, Ratio, _section
from pipeline.config.memory import MemoryConfig


class ToolsConfig(msgspec.Struct, **_section()):
    """Multi-turn rollouts with tools (``stages/rollout/multi_turn.py``, ``stages/rollout/tools.py``).

    ``functions``: ``builtin`` (``calc``, ``python``), ``path/to/file.py:NAME`` or
    ``module:NAME``, a dict of tool name -> callable(str) -> str. The model calls a tool
    by writing ``[name: arguments]``; the result follows as `` -> result`` on its own
    line (at most ``max_result_tokens`` tokens of it; masked out of the loss) and the model
    goes on, for at most ``max_turns`` generation turns; ``rollout.max_tokens`` bounds the
    whole completion, tool output included. A call may take ``timeout_s``; a tool that
    raises or times out gives the model an ``error: ...`` result."""

    functions: Annotated[str, Meta(min_length=1)] = "builtin"
    max_turns: Annotated[int, Meta(ge=2)] = 2
    timeout_s: PosFloat = 5.0
    max_result_tokens: PosInt = 32


# vLLM engine arguments that rollout keys (or Conveyor itself) set, and the key to use.
ENGINE_KWARGS_OWNED: dict[str, str] = {
    "model": "model.path", "tokenizer": "model.path", "dtype": "rollout.dtype / model.dtype",
    "seed": "rollout.seed", "tensor_parallel_size": "rollout.tensor_parallel_size",
    "enforce_eager": "rollout.enforce_eager", "enable_sleep_mode": "rollout.sleep_mode",
    "kv_cache_memory_bytes": "rollout.kv_cache_gib", "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "max_model_len": "rollout.max_model_len", "max_num_seqs": "rollout.max_num_seqs",
    "worker_extension_cls": "(Conveyor's weight loading)",
    "logprobs_mode": "(Conveyor's importance ratios)", "distributed_executor_backend": "(rollout placement)",
    "disable_log_stats": "(Conveyor's logging)", "pipeline_parallel_size": "rollout.tensor_parallel_size",
    "data_parallel_size": "rollout.num_workers (one engine per replica)",
}


class RolloutConfig(msgspec.Struct, **_section()):
    backend: str = "vllm"  # "vllm", "hf", or "module:attr"
    num_workers: PosInt = 1
    tensor_parallel_size: PosInt = 1
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    n: PosInt = 8
    temperature: NonNegFloat = 1.0
    top_p: Probability = 1.0
    top_k: int = -1
    max_tokens: PosInt = 512
    max_inflight: PosInt = 4  # micro-batches generating concurrently per worker
    # KV admission (rollout.memory): what a sample reserves of the KV cache from its first
    # token to its end. "cap": its prompt + max_tokens (its own budget where its prompt
    # has one): the engine never runs short, and a cap far above the usual completion
    # leaves most of the cache unused while generation waits. "observed": its prompt + the
    # smaller of that budget and the 90th percentile of the completions this worker has
    # generated (the budget until it has generated 64); a sample that grows past it is
    # vLLM's to fit (it preempts and later recomputes a request when the cache runs out).
    # "none": nothing reserved; vLLM's scheduler alone admits requests while blocks are
    # free and preempts when they run out, as peers run it (out-of-memory recovery stays on).
    # "auto": "none" on the vLLM backend, whose paged cache schedules itself; "cap" on any
    # other, whose cache grows with what it is given (docs/performance/longtail.md, "The KV
    # cache left to vLLM's scheduler").
    kv_reserve: Literal["auto", "cap", "observed", "none"] = "auto"
    # The vLLM engine's KV cache in GiB (vLLM's kv_cache_memory_bytes). On CPU None is
    # 1.0. On a GPU None sizes it from gpu_memory_utilization, except under
    # ``placement: colocate`` or with rollout replicas sharing a GPU, where the plan sizes
    # it to the job (``size_job_kv_cache``).
    kv_cache_gib: PosFloat | None = None
    # vLLM's longest sequence (prompt + completion). None: the model's own
    # (max_position_embeddings); ``placement: colocate`` sets data.max_prompt_len +
    # rollout.max_tokens when it sizes the KV cache.
    max_model_len: PosInt | None = None
    # vLLM's most sequences at once (its max_num_seqs). None: planned at launch to the
    # most a worker can have generating (max_inflight x dataflow.prompts_per_micro_batch x
    # n, plus an evaluation's), so vLLM captures CUDA graphs and profiles its sampler for
    # batches the job makes, not for 1,024 (its offline default on a GPU of 70 GiB or more).
    max_num_seqs: PosInt | None = None
    # vLLM's share of its GPU's memory. None: chosen by the placement plan (what trainer
    # and reference on the same GPU leave, or 0.9 on a GPU of its own; 0.5 unplanned).
    gpu_memory_utilization: Ratio | None = None
    # None: eager on CPU, CUDA graphs on a GPU (decoding a small model is bound by
    # kernel launches; graphs are captured once at start-up and survive weight updates,
    # which load in place).
    enforce_eager: bool | None = None
    # vLLM's torch.compile of the model, on a GPU without enforce_eager. "off": none;
    # decode batches replay full CUDA graphs, a step that holds a prefill runs eagerly
    # on vLLM's own kernels. "on": vLLM's default (Dynamo and Inductor, piecewise CUDA
    # graphs for prefills too): a cold start some 30-40 s longer, generation as fast
    # colocated and a few percent faster streaming, where prefills join running batches
    # (docs/performance/vllm-engine.md, "torch.compile").
    compile: Literal["on", "off"] = "off"
    # vLLM backend: "subprocess" runs vLLM's engine core in a process of its own
    # (AsyncLLM); "in_process" runs it in the rollout actor's process, stepped by a thread
    # (stages/rollout/vllm_inproc.py), without serialising every step's outputs. "auto":
    # in_process without tensor parallelism (faster steps and start-up, on CPU as on a
    # GPU: docs/performance/vllm-engine.md), subprocess with it.
    engine_core: Literal["auto", "subprocess", "in_process"] = "auto"
    # With the engine core in a process of its own (subprocess): times a rollout worker
    # rebuilds its engine after that process died (killed, crashed), serving the same
    # weights version and generating again the micro-batches that were in flight; one
    # death more fails the run. in_process: the engine dies with the rollout actor, which
    # Ray restarts instead (run.max_restarts).
    max_engine_restarts: NonNegInt = 3
    # The engine reports each sampled token's log-prob (the behaviour policy, PPO's ratio
    # anchor). false: it does not, and the trainer anchors the ratio on its own log-probs
    # of the same weights (detached): exact on-policy only, so false needs every sample
    # trained, in one update, by the weights that sampled it (check_sampler_logprobs).
    # vLLM generates a step faster without them (docs/performance/vllm-engine.md).
    logprobs: bool = True
    # vLLM backend, engine core in_process on a GPU: "auto" takes those log-probs from
    # vLLM's sampler in the rollout's process (stages/rollout/vllm_sampler_tap.py), where
    # vLLM would spend Python on every request at every engine step to report them, where
    # that is exact (vLLM's V2 GPU model runner, no speculative decoding; vLLM then samples
    # without FlashInfer, as it does when it reports them itself); "never": vLLM
    # reports them; "verify": vLLM reports them and every one is checked against the
    # tap's (a request fails on a difference; for a new vLLM or model). The
    # engine-started log line says which source is used.
    sampler_tap: Literal["auto", "never", "verify"] = "auto"
    # vLLM's sleep mode (its GPU memory from an allocator that can release and map it
    # again); ``placement: colocate`` turns it on, to sleep while the trainer steps.
    sleep_mode: bool = False
    # vLLM backend: after a weight update, at most once per this many seconds, the
    # engine's processes and the rollout's own give their freed heap back to the OS
    # (glibc ``malloc_trim``; ``pipeline/memory/trim.py``). 0: never. Off by default:
    # ``bench soak_memory`` saw it lower the engine's mean resident set, not its peak.
    host_memory_trim_s: NonNegFloat = 0.0
    seed: NonNegInt = 0
    # vLLM backend: a weight update pauses the engine and drops the KV cache of every
    # request in flight, which vLLM recomputes with the new weights, so each token after the
    # update is sampled wholly by them. false: requests in flight keep the KV their earlier
    # tokens made under the old weights (PipelineRL's in-flight update), saving at every
    # update a prefill of everything in flight (with hundreds of long requests streaming,
    # most of a step's tokens); vLLM's prefix cache is then off, so no new request starts on
    # blocks the old weights filled. Per-token versions and behaviour log-probs still say
    # what sampled each token. vLLM >= 0.32 or the in-process engine (older vLLM through
    # AsyncLLM always keeps the KV: see docs/architecture.md).
    recompute_on_update: bool = True
    # vLLM backend: further keyword arguments of vLLM's AsyncEngineArgs (verl's
    # rollout.engine_kwargs.vllm), e.g. {async_scheduling: true, max_num_batched_tokens: 8192}. The
    # arguments Conveyor sets from other keys are refused here (ENGINE_KWARGS_OWNED); a
    # name the installed vLLM does not know stops the launch (preflight), naming it.
    engine_kwargs: dict[str, Any] = {}
    memory: MemoryConfig = MemoryConfig()
    max_memory_ratio: Ratio | None = None  # shorthand for memory.max_memory_ratio
    tools: ToolsConfig | None = None  # multi-turn rollouts with tool calls

    @property
    def kv_cache_budget_gib(self) -> float:
        """``kv_cache_gib``, 1.0 where None: the CPU engine's KV cache, and rollout admission's
        KV budget."""
        return 1.0 if self.kv_cache_gib is None else self.kv_cache_gib

    @property
    def kv_reserve_policy(self) -> Literal["cap", "observed", "none"]:
        """``kv_reserve`` with ``auto`` resolved: ``none`` on the vLLM backend, ``cap`` on others."""
        if self.kv_reserve != "auto":
            return self.kv_reserve
        return "none" if self.backend == "vllm" else "cap"
