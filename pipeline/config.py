"""Typed run configuration: one YAML file, decoded into msgspec Structs.

Guarantees:
- Every field is typed and bounded; an unknown key, a wrong type or an out-of-range
  value raises ``ConfigError`` naming the dotted path and the reason, before any actor
  starts (the CLI turns it into exit status 2).
- Dotted overrides (``train.lr=1e-5``) are applied to the raw mapping before decoding,
  so they are validated exactly like the file.
- Cross-field rules (``check_config``) run after decoding, also before any actor starts.

Section names follow the seed config users know: ``model``, ``data``, ``rollout``,
``reward``, ``reference``, ``train``, ``algorithm``, ``dataflow``, ``placement``, ``run``,
``record``.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import yaml
from msgspec import Meta

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Ratio = Annotated[float, Meta(gt=0, le=1)]
Probability = Annotated[float, Meta(gt=0, le=1)]


class ConfigError(ValueError):
    """A configuration is invalid; the message names the dotted path and the reason."""


def _section(**kw: Any) -> Any:
    return dict(kw, forbid_unknown_fields=True, kw_only=True, frozen=True)


TinyArchitecture = Literal["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "qwen3_moe", "mixtral"]


class TinyModelConfig(msgspec.Struct, **_section()):
    """Shape of the embedded default model: a random-init decoder with a char tokenizer.

    ``architecture`` picks the transformers model class and the tokenizer conventions
    of that family (special tokens, BOS or not, stop tokens, chat template); the
    default Llama has no chat template (see ``stages/models/tiny.py``)."""

    architecture: TinyArchitecture = "llama"
    hidden_size: PosInt = 128
    num_layers: PosInt = 2
    num_heads: PosInt = 2
    num_kv_heads: PosInt = 2
    head_dim: PosInt = 64
    intermediate_size: PosInt = 256
    max_position_embeddings: PosInt = 256
    seed: NonNegInt = 0


class LoraConfig(msgspec.Struct, **_section()):
    """LoRA adapters on the policy, through ``peft`` (``stages/models/lora.py``; the pip
    extra ``conveyor[lora]``). ``rank`` 0: off, the whole model trains. Otherwise only the
    adapters train (scale ``alpha / rank``, ``dropout`` on their input): the optimizer
    holds their state alone and checkpoints save them alone; the rollout keeps serving full
    weights, the adapters merged into the modules they adapt (only those modules' layers
    are sent). ``target_modules``: ``all-linear`` (every linear layer but the output head),
    a list of module names (``[q_proj, v_proj]``, matched as name suffixes) or a regular
    expression peft matches against full module names. At the end of a run
    ``<run dir>/checkpoint`` holds the adapter (``adapter_model.safetensors``,
    ``adapter_config.json``); ``export_merged`` also writes the merged model, loadable by
    transformers, to ``<run dir>/checkpoint/merged``."""

    rank: NonNegInt = 0
    alpha: PosFloat = 16.0
    target_modules: str | list[str] = "all-linear"
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    export_merged: bool = False

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class ModelConfig(msgspec.Struct, **_section()):
    """``path: tiny`` builds the embedded default locally; any local HF checkpoint dir
    works, and so does a Hub id (``Qwen/Qwen2.5-0.5B-Instruct``) at ``revision`` (a
    branch, tag or commit; None: ``main``), fetched into the Hugging Face cache before
    the run starts (``pipeline/hub.py``)."""

    path: str = "tiny"
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    tiny: TinyModelConfig = TinyModelConfig()
    cache_dir: str = "~/.cache/conveyor"
    lora: LoraConfig = LoraConfig()


class CurriculumConfig(msgspec.Struct, **_section()):
    """A curriculum over ``data.path`` rows (``stages/data/curriculum.py`` holds the rules).

    Each row carries an integer level under ``key`` (top-level column); ``levels`` is the
    order they are taught in, starting at ``start`` (default: the first). Prompts are
    drawn from the current level only. Once ``window`` rewards of samples at the current
    level are in, their mean promotes to the next level at ``promote_at`` or above, and
    demotes to the one before below ``demote_below`` (null: never demote); either move
    starts a fresh window."""

    key: Annotated[str, Meta(min_length=1)] = "difficulty"
    levels: Annotated[list[int], Meta(min_length=1)]
    start: int | None = None
    promote_at: float = 0.8
    demote_below: float | None = None
    window: PosInt = 64


class PairsConfig(msgspec.Struct, **_section()):
    """Preference pairs for DPO (``stages/data/pairs.py``): each row holds the prompt
    (``data.prompt_key``) and two responses under ``chosen_key`` and ``rejected_key``:
    strings for a plain prompt, lists of chat messages (the assistant turn) for a chat
    prompt."""

    chosen_key: Annotated[str, Meta(min_length=1)] = "chosen"
    rejected_key: Annotated[str, Meta(min_length=1)] = "rejected"


class DataConfig(msgspec.Struct, **_section()):
    """Prompts: a built-in task (or ``module:attr`` task), or ``path``: a local JSONL or
    Parquet file or a ``datasets`` ``save_to_disk`` directory (``stages/data/prompt_rows.py``).

    ``prompt_key``: the column holding the prompt, a string or a list of chat messages
    (left at ``prompt``, a ``messages`` column is used when there is no ``prompt``).
    ``answer_key``: the column (dotted: a nested key) passed to the reward as
    ``ground_truth``. ``chat_template``: ``auto`` renders chat rows with the tokenizer's
    template and the generation prompt (plain string prompts stay as written);
    ``none`` accepts plain prompts only. ``max_prompt_len`` counts the prompt's token
    ids, template and special tokens included. ``path`` may also be a Hub dataset id
    (``openai/gsm8k``): the ``split`` of ``config_name`` (None: the default or only one)
    at ``revision`` is fetched into the Hugging Face cache before the run starts
    (``pipeline/hub.py``; ``split`` and ``config_name`` concern Hub ids only).
    ``max_tokens_field`` / ``min_tokens_field``: columns holding a per-row generation
    budget (long-tail length schedules, ``bench longtail``): the rollout generates at most
    ``row[max_tokens_field]`` tokens for that row's samples, clamped to
    ``rollout.max_tokens``, and at least ``row[min_tokens_field]`` (stop tokens are held
    back until then; clamped to the row's maximum). Both may name the same column: exact
    lengths. A null value is no budget for that row (``rollout.max_tokens``, no minimum);
    any other value than a whole number (>= 1 for the maximum, >= 0 for the minimum) makes
    the row a ``malformed`` row, named in the data report."""

    task: str = "first_digit"
    path: str | None = None
    split: Annotated[str, Meta(min_length=1)] = "train"
    config_name: str | None = None
    revision: str | None = None
    prompt_key: Annotated[str, Meta(min_length=1)] = "prompt"
    answer_key: Annotated[str, Meta(min_length=1)] = "ground_truth"
    chat_template: Literal["auto", "none"] = "auto"
    max_prompt_len: PosInt = 64
    num_prompts: NonNegInt = 0  # 0 = as many as the run needs
    shuffle: bool = True
    task_kwargs: dict[str, Any] = {}
    max_tokens_field: Annotated[str, Meta(min_length=1)] | None = None
    min_tokens_field: Annotated[str, Meta(min_length=1)] | None = None
    curriculum: CurriculumConfig | None = None  # needs data.path
    pairs: PairsConfig | None = None  # preference pairs (algorithm.name: dpo); needs data.path


class MemoryConfig(msgspec.Struct, **_section()):
    """Admission control and OOM recovery for one stage (``pipeline/memory/admission.py`` decides,
    ``pipeline/memory/guard.py`` enforces).

    ``oom_protection``: estimate each micro-batch before it runs and admit, defer or split
    it (by whole GRPO groups), and on an out-of-memory error free cached memory, halve
    the piece and retry. Off: neither; the work runs as it comes and an OOM stops the run.

    The budget, in the frame each stage measures:
    - ``reference`` and ``train`` measure their own process (CUDA: allocated tensors;
      CPU: resident set). ``budget_bytes`` is the memory the stage's *work* may take on
      top of what the process holds at rest: activations, logits and their gradients,
      not the resident model (weights, optimizer state, runtime, allocator caches), which
      is re-measured whenever nothing is in flight. A value therefore means the same
      whatever the model's size. Unset, ``max_memory_ratio`` × the device's total memory
      (CPU: the machine's or the container's limit) caps the whole process, rest included.
    - ``rollout`` admits against the KV cache its engine preallocated (vLLM's blocks; a
      backend without one: ``kv_cache_gib``):
      ``budget_bytes`` of KV cache for the micro-batches one worker generates at once
      (prompt + ``max_tokens`` per sample); unset, ``max_memory_ratio`` × the KV cache.
    Either way an item also waits while the machine's free memory cannot hold it;
    ``defer_timeout_s`` bounds that wait, then the stage stops with the numbers; an item
    the free memory cannot hold with nothing of the stage in flight is split, or waits at
    most ``stall_timeout_s``.
    """

    oom_protection: bool = True
    max_memory_ratio: Ratio = 0.85
    budget_bytes: Annotated[int, Meta(ge=1)] | None = None
    defer_timeout_s: PosFloat = 120.0
    # A micro-batch of one group that the device's free memory cannot hold while the
    # stage has nothing in flight waits at most this long (a neighbour's transient pass
    # may end), then the stage stops naming what to lower: nothing of its own will free.
    stall_timeout_s: PosFloat = 10.0


class PlacementEntry(msgspec.Struct, **_section()):
    """Where one stage runs (``pipeline/placement.py`` plans and checks it).

    ``gpus``: GPU indices (replica r on ``gpus[r % len]``); a list in YAML
    (``rollout: [0]``) is shorthand for ``{gpus: [0]}``. ``exclusive``: no other stage
    may use those GPUs. ``num_gpus``: a Ray GPU count per replica instead of indices.
    ``resources``: custom Ray resources each replica asks for (``{node_b: 0.01}``), which
    puts the stage on the nodes that offer them (``ray start --resources``).
    """

    num_cpus: NonNegFloat = 0.0
    num_gpus: NonNegFloat = 0.0
    gpus: list[NonNegInt] | None = None
    exclusive: bool = False
    resources: dict[str, PosFloat] = {}

    def __post_init__(self) -> None:
        reserved = sorted(set(self.resources) & {"CPU", "GPU", "memory", "object_store_memory"})
        if reserved:
            raise ValueError(f"resources: {reserved} are not custom resources (use num_cpus / num_gpus)")


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
    "max_model_len": "rollout.max_model_len", "worker_extension_cls": "(Conveyor's weight loading)",
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
    max_tokens: PosInt = 8
    max_inflight: PosInt = 4  # micro-batches generating concurrently per worker
    # The vLLM engine's KV cache in GiB (vLLM's kv_cache_memory_bytes). On CPU None is
    # 1.0. On a GPU None sizes it from gpu_memory_utilization, except under
    # ``placement: colocate`` or with rollout replicas sharing a GPU, where the plan sizes
    # it to the job (``size_job_kv_cache``).
    kv_cache_gib: PosFloat | None = None
    # vLLM's longest sequence (prompt + completion). None: the model's own
    # (max_position_embeddings); ``placement: colocate`` sets data.max_prompt_len +
    # rollout.max_tokens when it sizes the KV cache.
    max_model_len: PosInt | None = None
    # vLLM's share of its GPU's memory. None: chosen by the placement plan (what trainer
    # and reference on the same GPU leave, or 0.9 on a GPU of its own; 0.5 unplanned).
    gpu_memory_utilization: Ratio | None = None
    # None: eager on CPU, CUDA graphs on a GPU (decoding a small model is bound by
    # kernel launches; graphs are captured once at start-up and survive weight updates,
    # which load in place).
    enforce_eager: bool | None = None
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
    # vLLM backend: further keyword arguments of vLLM's AsyncEngineArgs (verl's
    # rollout.engine_kwargs.vllm), e.g. {async_scheduling: true, max_num_seqs: 512}. The
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


class RewardSourceConfig(msgspec.Struct, **_section()):
    """One entry of ``reward.sources`` (``stages/rewards/reward_model.py``). ``kind: function``:
    the reward stage's score (``reward.function``); ``kind: model``: a local
    ``AutoModelForSequenceClassification`` checkpoint with one logit at ``path``, scored
    by the ``reward_model`` stage (``chunk_size`` samples per forward, admitted under
    ``memory``). The reward is ``sum(weight * normalize(score))``; ``normalize``: ``none``,
    ``batch`` (z-score over the micro-batch) or ``running`` (over every score so far)."""

    kind: Literal["function", "model"] = "function"
    weight: float = 1.0
    normalize: Literal["none", "batch", "running"] = "none"
    path: str | None = None
    chunk_size: PosInt = 16
    memory: MemoryConfig = MemoryConfig()


class RewardConfig(msgspec.Struct, **_section()):
    """``function``: ``task`` (the data task's own), a built-in (``math``, ``gsm8k``,
    ``format``, ``think_format``: ``stages/rewards/verifiable.py``), ``module:attr``, or
    ``path/to/file.py:name`` (a file, loaded by path); verl's spelling, ``path`` (a
    ``.py`` file) with ``name`` (default ``compute_score``), means the same.
    Plain or ``async def`` functions; each call may take at most ``timeout_s`` seconds
    (unset: no limit). A call that raises, times out or returns no number scores
    ``on_error`` and is counted in ``reward/errors``; a step whose every sample failed
    stops the run (``stages/rewards/reward.py``)."""

    function: str = "task"
    signature: Literal["auto", "score", "batched"] = "auto"
    on_error: float = 0.0
    timeout_s: PosFloat | None = None
    path: str | None = None
    name: Annotated[str, Meta(min_length=1)] = "compute_score"
    # Empty: the reward is reward.function's score. Otherwise name -> source: one
    # ``model`` source (the reward_model stage) and at most one ``function`` source.
    sources: dict[str, RewardSourceConfig] = {}


class ReferenceConfig(msgspec.Struct, **_section()):
    """Frozen reference model; skipped when ``algorithm.kl_coef`` is 0, ``algorithm.use_kl_in_reward``
    is off and ``enabled: auto``."""

    enabled: Literal["auto", "on", "off"] = "auto"
    path: str | None = None  # default: model.path
    memory: MemoryConfig = MemoryConfig()


class CriticConfig(msgspec.Struct, **_section()):
    """The value model (``stages/trainer/critic.py``), a stage of its own that runs when the
    algorithm needs values (``algorithm.name: ppo``). ``path``: a local
    ``AutoModelForTokenClassification`` checkpoint with one label; None: the policy
    (``model.path``) with a fresh scalar head. It trains with DeepSpeed (``train``'s ZeRO
    stage and dtype) at its own ``lr`` on each micro-batch as it passes: ``epochs``
    passes of the clipped value loss (``value_clip``, None: unclipped) over the
    micro-batch's returns, one optimizer step each. ``chunk_size``: samples per forward."""

    path: str | None = None
    lr: PosFloat = 1e-5
    weight_decay: NonNegFloat = 0.0
    grad_clip: NonNegFloat = 1.0
    value_clip: PosFloat | None = 0.5
    epochs: PosInt = 1
    chunk_size: PosInt = 16
    threads: NonNegInt = 0  # torch threads in the critic; 0 = leave default


class TrainConfig(msgspec.Struct, **_section()):
    # The order verl and TRL use for a pretrained checkpoint; the embedded tiny model
    # learns at a far higher rate, which its configs (configs/quickstart.yaml) set.
    lr: PosFloat = 1e-6
    weight_decay: NonNegFloat = 0.0
    grad_clip: NonNegFloat = 1.0
    zero_stage: Annotated[int, Meta(ge=0, le=3)] = 0
    # Data-parallel DeepSpeed ranks of the one trainer stage (stages/trainer/ranks.py):
    # each on its own GPU where there are GPUs; a step's groups are split across them.
    num_ranks: PosInt = 1
    prompts_per_step: PosInt = 8  # GRPO groups per optimizer step
    sync_interval: PosInt = 1
    # Read the engine's weights back after every update (a mismatch stops the run);
    # off: once, at the end of the run. The payload's sha256 is checked either way.
    weight_sync_monitor: bool = True
    weight_sync_timeout_s: PosFloat = 300.0
    save_checkpoint: bool = True  # a Hugging Face checkpoint in <run dir>/checkpoint at the end
    # Resumable checkpoints (<run dir>/checkpoints/step-N: trainer state, ledger, prompts
    # done) every k steps (0: none) and at the end of every run, interrupted ones included.
    checkpoint_every: NonNegInt = 50
    keep_checkpoints: PosInt = 2
    # A checkpoint that cannot be written (a full disk): stop the run, status failed and
    # the last good checkpoint named (at most checkpoint_every steps to redo), or
    # continue and try again at the next interval.
    on_checkpoint_error: Literal["stop", "continue"] = "stop"
    # A step whose loss or gradient norm is NaN or infinite is not applied nor published
    # (its samples are dropped as nonfinite and replaced); this many in a row stop the
    # run, status failed, with the last good checkpoint named.
    max_bad_steps: PosInt = 3
    threads: NonNegInt = 0  # torch threads in the trainer; 0 = leave default
    # Samples per forward/backward pass when pass_tokens is 0 (verl's
    # ppo_micro_batch_size_per_gpu): activation memory is bounded by one chunk; larger
    # chunks launch fewer kernels per sample (the GPU's win on a small model). Admission
    # (train.memory) estimates with the passes the engine will run.
    chunk_size: PosInt = 16
    # Tokens per forward/backward pass of the trainer and the reference, prompt and
    # completion of each row counted at the length of the pass's longest row
    # (pipeline/memory/packing.py): rows are sorted by length, longest first, and grouped
    # while rows x longest <= pass_tokens (a longer row runs alone), so a pass costs about
    # its real tokens, not the micro-batch's longest sample per row. 0: fixed chunks of
    # chunk_size samples in batch order.
    pass_tokens: NonNegInt = 16384
    # Rows of [tokens, vocabulary] logits alive at once when the trainer and the
    # reference compute log-probs (stages/models/logprobs.py: the output head runs on completion
    # tokens only, this many at a time, recomputed in backward): memory does not grow
    # with the vocabulary.
    # 0: the dense head (all of a pass's logits at once).
    logit_chunk_tokens: NonNegInt = 1024
    # Learning-rate schedule (stages/trainer/lr_schedule.py), counted in optimizer updates
    # (run.steps * ppo_epochs * ppo_mini_batches): update k < warmup_steps uses
    # lr * (k + 1) / warmup_steps, then constant, or linear / cosine decay towards
    # lr * min_lr_ratio at the run's last update.
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: NonNegInt = 0
    min_lr_ratio: Annotated[float, Meta(ge=0, le=1)] = 0.0
    # bf16 runs (a GPU): gradients accumulate across a step's pieces in fp32 next to
    # fp32 master weights (DeepSpeed's BF16 optimizer); bf16 accumulates in the model
    # dtype (less memory, rounding grows with the pieces of a step).
    grad_accum_dtype: Literal["fp32", "bf16"] = "fp32"
    # torch.compile the model's transformer blocks (stages/trainer/engine.py,
    # compile_blocks): each block's elementwise ops (norms, rotary, SiLU gating) fused
    # into few kernels, forward and backward. auto: on a GPU below ZeRO 3 with a C
    # compiler for Triton on PATH; on: wherever (CPU needs a C++ compiler); off: eager.
    # The first step compiles (docs/performance/gpu-engines.md has the gain and cost).
    compile: Literal["auto", "on", "off"] = "auto"
    # Mixtures of experts: the routers' load-balancing loss (transformers'
    # load_balancing_loss_func, Switch Transformer's: the experts a token picks when
    # routing is even, more when it is not) times this coefficient is added to the
    # policy loss of every forward pass. 0: the policy loss alone. A model without a
    # router refuses any other value at launch.
    router_aux_loss_coef: NonNegFloat = 0.0
    # PPO's updates over a step's data (stages/trainer/ppo.py): the step is cut into
    # ppo_mini_batches mini-batches of whole micro-batches, each one optimizer update
    # (the first epoch's as soon as its micro-batches are in), and passed over
    # ppo_epochs times; the policy version still moves once per step.
    ppo_epochs: PosInt = 1
    ppo_mini_batches: PosInt = 1
    memory: MemoryConfig = MemoryConfig()


class KLControlConfig(msgspec.Struct, **_section()):
    """The coefficient of the KL penalty subtracted from the reward
    (``algorithm.use_kl_in_reward``), verl's ``algorithm.kl_ctrl``: ``fixed`` keeps
    ``kl_coef``; ``adaptive`` (Ziegler et al. 2019) multiplies it after every optimizer
    step by ``1 + clip(kl / target_kl - 1, -0.2, 0.2) * samples / horizon``."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: NonNegFloat = 0.001
    target_kl: PosFloat = 0.1
    horizon: PosInt = 10000


class AlgorithmFields(msgspec.Struct, **_section(tag_field="name")):
    """The loss every algorithm shares (``stages/algorithms/losses.py``); each algorithm
    subclasses it in its own file under ``stages/algorithms/`` with its estimator's fields
    (``register_algorithm_config``) and is told apart by ``algorithm.name``.

    - ``clip_ratio_c``: dual-clip bound for tokens with a negative advantage (> 1;
      null: off). ``kl_estimator`` k3 is clamped to +-10 per token.
    - ``loss_agg``: every mode is exact over a streaming step (sums rescaled before
      clipping by the step's count): ``token-mean`` divides by the step's loss tokens,
      ``seq-mean-token-mean`` / ``seq-mean-token-sum`` by its rows with at least one loss
      token, ``seq-mean-token-sum-norm`` by the constant ``samples * loss_norm_tokens``
      (default ``rollout.max_tokens``).
    - ``off_policy``: ``off`` (PPO ratio against the sampler), ``truncate`` or ``reject``
      (decoupled objective: the ratio is anchored on the weights that first trained the
      sample in its step, held across ``train.ppo_epochs``; the importance weight that
      anchor / behaviour is truncated at or rejected above ``behav_imp_weight_cap``).
    - ``ratio_level``: ``token`` (PPO/GRPO) or ``sequence`` (GSPO: the geometric mean of
      a sample's token ratios, clipped per sequence).
    - ``kl_estimator`` ``k3+`` / ``k1+``: k3's (k1's) value with k2's gradient.
    - ``use_kl_in_reward``: ``kl_ctrl.kl_coef * kl_penalty`` (behaviour vs reference,
      per token) is subtracted from the reward before advantages; ``kl_ctrl.type:
      adaptive`` steers the coefficient towards ``kl_ctrl.target_kl``.
    - ``drop_zero_variance_groups``: the stage that sets the final reward (the reward
      model's when ``reward.sources`` wires one, else the reward stage) drops groups whose
      samples all got the same reward (no learning signal; DAPO's dynamic sampling); the
      source replaces them and summary.json counts them (``zero_variance``).
    - ``overlong_mask``: completions cut by ``rollout.max_tokens`` (finish reason
      ``length``) leave the loss; ``overlong_buffer_len`` > 0: DAPO's soft overlong
      penalty, ``-factor * (length - (max_tokens - buffer)) / buffer`` when positive,
      added to the final reward (after a reward model's combination).
    """

    kl_coef: NonNegFloat = 0.04
    kl_estimator: Literal["k1", "k2", "k3", "k1+", "k3+"] = "k3"
    clip_eps_low: NonNegFloat = 0.2
    clip_eps_high: NonNegFloat = 0.2
    clip_ratio_c: Annotated[float, Meta(gt=1)] | None = 3.0
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    loss_norm_tokens: PosInt | None = None
    off_policy: Literal["off", "truncate", "reject"] = "off"
    behav_imp_weight_cap: Annotated[float, Meta(ge=1)] = 2.0
    ratio_level: Literal["token", "sequence"] = "token"
    use_kl_in_reward: bool = False
    kl_penalty: Literal["k1", "k2", "k3"] = "k1"
    kl_ctrl: KLControlConfig = KLControlConfig()
    drop_zero_variance_groups: bool = False
    overlong_mask: bool = False
    overlong_buffer_len: NonNegInt = 0
    overlong_penalty_factor: NonNegFloat = 1.0

    # Advantages compare the samples of one prompt: needs rollout.n >= 2.
    group_baseline: ClassVar[bool] = True
    # Advantages read a critic's per-token values: the graph gets a critic stage.
    needs_critic: ClassVar[bool] = False
    # Trains on data rows with their responses (no rollout, no reward): the graph is
    # source -> reference -> trainer, and the reference always runs.
    offline: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return str(self.__struct_config__.tag)

    def check(self, cfg: ConveyorConfig) -> None:
        """The algorithm's own cross-section rules (``ConfigError`` naming the field); none here."""


# algorithm.name -> its config struct. Filled by ``register_algorithm_config`` when the
# algorithm modules are imported; ``algorithm_configs`` imports them (through
# ``pipeline.plugins``' ``get_algorithm``, so importing this module loads none of them).
_ALGORITHM_CONFIGS: dict[str, type[AlgorithmFields]] = {}
DEFAULT_ALGORITHM = "grpo"


def register_algorithm_config(cls: type[AlgorithmFields]) -> type[AlgorithmFields]:
    """Make ``cls`` (a tagged ``AlgorithmFields`` subclass) decodable as ``algorithm.name: <tag>``."""
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str) or not issubclass(cls, AlgorithmFields):
        raise TypeError(f"{cls.__name__}: expected an AlgorithmFields subclass with tag='<algorithm.name>'")
    known = _ALGORITHM_CONFIGS.get(tag)
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise ValueError(f"algorithm.name {tag!r}: registered twice ({known.__module__} and {cls.__module__})")
    _ALGORITHM_CONFIGS[tag] = cls
    return cls


def algorithm_configs() -> dict[str, type[AlgorithmFields]]:
    """Every registered algorithm config by name, the built-in algorithm modules imported first."""
    from pipeline.plugins import load_builtin

    load_builtin("get_algorithm")  # imports every algorithm module
    return dict(_ALGORITHM_CONFIGS)


def default_algorithm() -> AlgorithmFields:
    return algorithm_configs()[DEFAULT_ALGORITHM]()


def __getattr__(name: str) -> Any:
    # Built lazily, on first use, from the registered algorithms: ``AlgorithmConfig`` is
    # their union (a tagged union msgspec decodes), ``ALGORITHM_NAMES`` their names.
    if name == "AlgorithmConfig":
        return typing.Union[tuple(algorithm_configs().values())]  # noqa: UP007
    if name == "ALGORITHM_NAMES":
        return tuple(algorithm_configs())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class NodeSpec(msgspec.Struct, **_section()):
    """A custom DataFlow node from YAML: ``node_class`` is ``module:attr``."""

    name: str
    node_class: str
    input_from: str | None = None
    kwargs: dict[str, Any] = {}


class DataflowConfig(msgspec.Struct, **_section()):
    """``max_staleness`` is η: 0 with ``async_execution: false`` is exactly on-policy.

    With ``async_execution: true`` generation of step k's samples may begin once the
    rollout serves version ``k - max_staleness``; η = 0 still overlaps stages inside a
    step but never trains on a sample older than the current weights.
    """

    async_execution: bool = True
    max_staleness: NonNegInt = 1
    prompts_per_micro_batch: PosInt = 4
    queue_size: PosInt = 4  # default bound (micro-batches) of every edge
    queue_sizes: dict[str, PosInt] = {}  # per edge, "producer->consumer": bound
    nodes: list[NodeSpec] = []  # custom graph; empty = the built-in RL graph


class PlacementConfig(msgspec.Struct, **_section()):
    """``placement: auto`` (the default, an empty mapping) lets the planner choose GPUs;
    naming GPUs (or ``num_gpus``) for any stage makes the plan explicit: stages not
    named then get no GPU. ``placement: colocate`` (``mode: colocate``) puts every GPU
    stage on the trainer ranks' GPUs and time-shares them: vLLM sleeps (its weights and
    KV cache freed) while the trainer steps, and wakes with the new weights
    (``pipeline/placement.py``); it runs lock-step and on-policy."""

    mode: Literal["auto", "colocate"] = "auto"
    source: PlacementEntry = PlacementEntry()
    rollout: PlacementEntry = PlacementEntry()
    reward: PlacementEntry = PlacementEntry()
    reference: PlacementEntry = PlacementEntry()
    reward_model: PlacementEntry = PlacementEntry()
    critic: PlacementEntry = PlacementEntry()
    trainer: PlacementEntry = PlacementEntry()


class RunConfig(msgspec.Struct, **_section()):
    dir: str = "runs/{name}"
    name: str = "conveyor"
    seed: NonNegInt = 0
    steps: PosInt = 100
    progress: bool = True
    # Experiment trackers (pipeline/trackers.py), any subset; each but TensorBoard is a pip
    # extra (conveyor[mlflow]...): one not installed stops the launch.
    trackers: list[Literal["tensorboard", "mlflow", "wandb", "swanlab", "trackio"]] = msgspec.field(
        default_factory=lambda: ["tensorboard"])
    tensorboard: bool = True  # false: no TensorBoard even where run.trackers names it
    address: str | None = None  # Ray address; default RAY_ADDRESS or a local cluster
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Print the first micro-batch on every edge (wire type, field shapes and dtypes) and
    # check it against what its consumer declares; a mismatch stops the run.
    debug: bool = False
    # A checkpoint directory to continue from (``conveyor launch --resume RUN_DIR`` sets
    # it to the run's newest complete one).
    resume_from: str | None = None
    overwrite: bool = False  # replace a run already in run.dir (otherwise a launch refuses it)
    # Restarts of each rollout, reward and reference actor after its process died (its
    # micro-batches are delivered again); 0: a death stops the run.
    max_restarts: NonNegInt = 5
    # A dead trainer: resume from the newest checkpoint by itself (at most
    # pipeline.launch.AUTO_RESUME_ATTEMPTS times) instead of stopping with the resume command.
    auto_resume: bool = False
    # A Python file defining build_dataflow(cfg) -> DataFlow: the run's graph instead of
    # the built-in one (``conveyor launch --config C --script FILE`` sets it).
    script: str | None = None


class RecordConfig(msgspec.Struct, **_section()):
    """Tap DataFlow edges to disk (``pipeline/recorder.py``)."""

    edges: list[str] = []
    every: PosInt = 1
    dir: str | None = None  # default: <run dir>/recording
    state_every: NonNegInt = 10  # trainer state saved every k steps (replay starts there)


class ConveyorConfig(msgspec.Struct, **_section()):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    reference: ReferenceConfig = ReferenceConfig()
    train: TrainConfig = TrainConfig()
    critic: CriticConfig = CriticConfig()
    algorithm: AlgorithmFields = msgspec.field(default_factory=default_algorithm)
    dataflow: DataflowConfig = DataflowConfig()
    placement: PlacementConfig = PlacementConfig()
    run: RunConfig = RunConfig()
    record: RecordConfig = RecordConfig()

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir.format(name=self.run.name)).expanduser()

    @property
    def reference_enabled(self) -> bool:
        if self.reference.enabled == "auto":
            return self.algorithm.kl_coef > 0 or self.algorithm.use_kl_in_reward or self.algorithm.offline
        return self.reference.enabled == "on"

    @property
    def scoring_temperature(self) -> float:
        """The temperature the trainer and the reference take log-probs at: the rollout's
        (the distribution the sampler drew from), or 1 for offline data (``dpo``'s pairs
        were sampled by no rollout: its log-ratios are the model's own)."""
        return 1.0 if self.algorithm.offline else float(self.rollout.temperature)

    @property
    def reward_model_enabled(self) -> bool:
        return bool(self.reward.sources)

    @property
    def critic_enabled(self) -> bool:
        return self.algorithm.needs_critic

    @property
    def micro_batches_per_step(self) -> int:
        return -(-self.train.prompts_per_step // self.dataflow.prompts_per_micro_batch)


# ---------------------------------------------------------------------------- loading

_PATH_RE = re.compile(r"at `\$(.*?)`")


def _render_error(err: msgspec.ValidationError, raw: dict[str, Any]) -> str:
    """``Expected `int` >= 0 - at `$.dataflow.max_staleness``` ->
    ``dataflow.max_staleness: expected int >= 0, got -1``."""
    text = str(err)
    m = _PATH_RE.search(text)
    path = m.group(1).lstrip(".") if m else ""
    reason = _PATH_RE.sub("", text).rstrip(" -").replace("`", "")
    reason = reason[:1].lower() + reason[1:]
    field = re.match(r"object (contains unknown|missing required) field (\S+)", reason)
    if field:
        kind, name = field.groups()
        path = f"{path}.{name}" if path else name
        return f"{path}: " + ("unknown field (not in the schema)" if kind == "contains unknown" else "required field missing")
    enum = re.match(r"invalid enum value (.*)", reason)
    if enum:
        allowed = _enum_values(path)
        return f"{path}: expected one of {allowed}, got {enum.group(1)}" if allowed else f"{path}: {reason}"
    if path and ", got" not in reason:
        found, value = _lookup(raw, path)
        if found:
            reason += f", got {value!r}"
    return f"{path}: {reason}" if path else reason


def _enum_values(path: str) -> list[Any] | None:
    """The allowed values of the ``Literal`` field at ``path`` (None if not found)."""
    typ: Any = ConveyorConfig
    for part in re.findall(r"[^.\[\]]+", path):
        if part.isdigit():
            args = typing.get_args(typ)
            typ = args[0] if args else typ
            continue
        if isinstance(typ, types.UnionType):  # the algorithm variants share their Literal fields
            typ = typing.get_args(typ)[0]
        hints = typing.get_type_hints(typ, include_extras=True) if isinstance(typ, type) else {}
        if part not in hints:
            return None
        typ = hints[part]
        while typing.get_origin(typ) is typing.Annotated:
            typ = typing.get_args(typ)[0]
        if typing.get_origin(typ) is list:
            typ = typing.get_args(typ)[0]
    return list(typing.get_args(typ)) if typing.get_origin(typ) is typing.Literal else None


def _lookup(raw: Any, path: str) -> tuple[bool, Any]:
    node = raw
    for part in re.findall(r"[^.\[\]]+", path):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node


def parse_override(item: str) -> tuple[list[str], Any]:
    """``train.lr=1e-5`` -> (["train", "lr"], 1e-5); the value is read as YAML."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected KEY.PATH=VALUE")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty key segment")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: value {raw!r} is not valid YAML ({exc})") from exc
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with dotted overrides applied (sections created as needed)."""
    out = _deep_copy(raw)
    for item in overrides:
        parts, value = parse_override(item)
        node = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {item!r}: {where} is not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


def decode_config(raw: dict[str, Any]) -> ConveyorConfig:
    """Decode and cross-check a raw mapping; raise ``ConfigError`` with the dotted path."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(raw).__name__}")
    raw = _read_switch_words(_expand_placement(raw))
    rest = {k: v for k, v in raw.items() if k != "algorithm"}
    try:
        # strict=False: YAML 1.1 reads ``3e-4`` as a string; numbers in strings convert.
        cfg = msgspec.convert(rest, ConveyorConfig, strict=False)
        if "algorithm" in raw:
            cfg = msgspec.structs.replace(cfg, algorithm=decode_algorithm(raw["algorithm"]))
    except msgspec.ValidationError as exc:
        raise ConfigError(_render_error(exc, raw)) from None
    cfg = _normalise(cfg)
    check_config(cfg)
    return cfg


def decode_algorithm(algo: Any) -> AlgorithmFields:
    """The ``algorithm`` section as its registered struct: without a ``name`` it is GRPO;
    an unknown name is refused with the choices. Raises ``msgspec.ValidationError`` with
    paths under ``$.algorithm``."""
    if not isinstance(algo, dict):
        raise ConfigError(f"algorithm: expected a mapping, got {algo!r}")
    configs = algorithm_configs()
    name = algo.get("name", DEFAULT_ALGORITHM)
    if name not in configs:
        raise ConfigError(f"algorithm.name: expected one of {list(configs)}, got {name!r}")
    section = msgspec.defstruct("AlgorithmSection", [("algorithm", configs[name])], forbid_unknown_fields=True)
    return msgspec.convert({"algorithm": {**algo, "name": name}}, section, strict=False).algorithm


# Fields whose words YAML 1.1 reads as booleans when bare (`off`, `on`): the word back.
_SWITCH_WORDS: dict[tuple[str, str], dict[bool, str]] = {
    ("algorithm", "off_policy"): {False: "off"},
    ("reference", "enabled"): {False: "off", True: "on"},
    ("train", "compile"): {False: "off", True: "on"},
}


def _read_switch_words(raw: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    for (section, key), words in _SWITCH_WORDS.items():
        block = out.get(section)
        if isinstance(block, dict) and isinstance(block.get(key), bool) and block[key] in words:
            out[section] = {**block, key: words[block[key]]}
    return out


def _expand_placement(raw: dict[str, Any]) -> dict[str, Any]:
    """``placement: auto`` -> ``{}``; ``placement: {rollout: [0, 1]}`` -> ``{rollout: {gpus: [0, 1]}}``."""
    place = raw.get("placement")
    if place is None or (isinstance(place, dict) and not any(isinstance(v, list) for v in place.values())):
        return raw
    if isinstance(place, str):
        if place not in ("auto", "colocate"):
            raise ConfigError(f"placement: expected 'auto', 'colocate' or a mapping of stage -> GPU indices, "
                              f"got {place!r}")
        return {**raw, "placement": {"mode": place}}
    if not isinstance(place, dict):
        raise ConfigError(f"placement: expected 'auto', 'colocate' or a mapping of stage -> GPU indices, "
                          f"got {place!r}")
    return {**raw, "placement": {k: {"gpus": v} if isinstance(v, list) else v for k, v in place.items()}}


def _normalise(cfg: ConveyorConfig) -> ConveyorConfig:
    """Fold shorthands into their canonical place (``rollout.max_memory_ratio``) and fill
    defaults that depend on other sections (``algorithm.loss_norm_tokens``)."""
    if cfg.rollout.max_memory_ratio is not None:
        mem = msgspec.structs.replace(cfg.rollout.memory, max_memory_ratio=cfg.rollout.max_memory_ratio)
        cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, memory=mem))
    if cfg.algorithm.loss_norm_tokens is None:
        algo = msgspec.structs.replace(cfg.algorithm, loss_norm_tokens=cfg.rollout.max_tokens)
        cfg = msgspec.structs.replace(cfg, algorithm=algo)
    if cfg.placement.mode == "colocate" and not cfg.rollout.sleep_mode:
        cfg = msgspec.structs.replace(cfg, rollout=msgspec.structs.replace(cfg.rollout, sleep_mode=True))
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ConveyorConfig:
    """Read a YAML file (or defaults when ``path`` is None), apply overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r}: not found")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(p)!r}: invalid YAML ({exc})") from None
        raw = loaded if loaded is not None else {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {str(p)!r}: expected a mapping at the top level")
    return decode_config(apply_overrides(raw, overrides or []))


def check_config(cfg: ConveyorConfig) -> None:
    """Cross-field rules that a single field's bounds cannot express."""
    df, tr, ro = cfg.dataflow, cfg.train, cfg.rollout
    check_colocate(cfg)  # first: its reasons say more than the generic rules it implies
    check_sampler_logprobs(cfg)
    if tr.prompts_per_step % df.prompts_per_micro_batch:
        raise ConfigError(
            f"train.prompts_per_step: expected a multiple of dataflow.prompts_per_micro_batch "
            f"({df.prompts_per_micro_batch}) so GRPO groups never straddle a step, "
            f"got {tr.prompts_per_step}"
        )
    if tr.prompts_per_step % (tr.ppo_mini_batches * df.prompts_per_micro_batch):
        raise ConfigError(
            f"train.ppo_mini_batches: expected train.prompts_per_step ({tr.prompts_per_step}) to split into "
            f"{tr.ppo_mini_batches} mini-batches of whole micro-batches (dataflow.prompts_per_micro_batch "
            f"{df.prompts_per_micro_batch}), got {tr.ppo_mini_batches}")
    if (tr.ppo_epochs > 1 or tr.ppo_mini_batches > 1) and any(e.endswith("->trainer") for e in cfg.record.edges):
        raise ConfigError(
            "record.edges: a recorded trainer input replays one optimizer update per step; with "
            "train.ppo_epochs or train.ppo_mini_batches > 1 a step makes several, so it cannot be recorded")
    if df.max_staleness < tr.sync_interval - 1:
        # Step k trains at version k; with weights published every s steps the newest
        # version a step can generate on may be s - 1 steps old (sync mode included).
        raise ConfigError(
            f"dataflow.max_staleness: expected >= train.sync_interval - 1 "
            f"({tr.sync_interval - 1}), or some steps' samples could never be trained, "
            f"got {df.max_staleness}"
        )
    if tr.num_ranks > 1 and any(e.endswith("->trainer") for e in cfg.record.edges):
        raise ConfigError(f"record.edges: replay retrains a recorded step on one rank; record with "
                          f"train.num_ranks 1, got {tr.num_ranks}")
    updates = cfg.run.steps * tr.ppo_epochs * tr.ppo_mini_batches
    if tr.lr_scheduler != "constant" and tr.warmup_steps >= updates:
        raise ConfigError(
            f"train.warmup_steps: expected < the run's optimizer updates ({updates}: run.steps x "
            f"train.ppo_epochs x train.ppo_mini_batches) for a decaying {tr.lr_scheduler} schedule, "
            f"got {tr.warmup_steps}"
        )
    if ro.n < 2 and cfg.algorithm.group_baseline:
        raise ConfigError(f"rollout.n: expected >= 2 for {cfg.algorithm.name} (group baseline), got {ro.n}")
    check_algorithm(cfg)
    # The trainer and the reference score sampled tokens under the full softmax; a
    # truncated sampler renormalises over the kept tokens, so even on-policy the ratio
    # would be the kept mass, not 1, and negative-advantage tokens would lose their
    # gradient. Until the same truncation is applied there, refuse it.
    if ro.top_p < 1.0:
        raise ConfigError(
            f"rollout.top_p: expected 1.0 (trainer and reference log-probs use the full softmax; "
            f"nucleus sampling would make every importance ratio wrong), got {ro.top_p}"
        )
    if ro.top_k != -1:
        raise ConfigError(
            f"rollout.top_k: expected -1 (off; trainer and reference log-probs use the full "
            f"softmax, top-k sampling would make every importance ratio wrong), got {ro.top_k}"
        )
    owned = sorted(k for k in ro.engine_kwargs if k in ENGINE_KWARGS_OWNED)
    if owned:
        raise ConfigError(f"rollout.engine_kwargs.{owned[0]}: set by Conveyor; use {ENGINE_KWARGS_OWNED[owned[0]]}")
    if ro.engine_kwargs and ro.backend != "vllm":
        raise ConfigError(f"rollout.engine_kwargs: vLLM's engine arguments; rollout.backend is {ro.backend!r}")
    if ro.backend not in ("vllm", "hf") and ":" not in ro.backend:
        raise ConfigError(f"rollout.backend: expected 'vllm', 'hf' or 'module:attr', got {ro.backend!r}")
    if ro.sampler_tap == "verify" and (ro.backend != "vllm" or ro.engine_core == "subprocess"
                                       or ro.tensor_parallel_size > 1 or not ro.logprobs):
        raise ConfigError("rollout.sampler_tap: verify checks vLLM's log-probs in the rollout's process: it needs "
                          "rollout.backend vllm, rollout.engine_core in_process or auto, tensor_parallel_size 1 "
                          "and rollout.logprobs true")
    for edge in df.queue_sizes:
        if "->" not in edge:
            raise ConfigError(f"dataflow.queue_sizes.{edge}: expected an edge 'producer->consumer'")
    if cfg.run.script and df.nodes:
        raise ConfigError("run.script: set either a DataFlow script or dataflow.nodes, not both")
    for i, node in enumerate(df.nodes):
        if ":" not in node.node_class:
            raise ConfigError(f"dataflow.nodes[{i}].node_class: expected 'module:attr', got {node.node_class!r}")
    for edge in cfg.record.edges:
        if "->" not in edge:
            raise ConfigError(f"record.edges: expected 'producer->consumer', got {edge!r}")
    check_reward_sources(cfg)
    check_lora(cfg.model.lora)
    check_curriculum(cfg.data)
    check_pairs(cfg)
    cfg.algorithm.check(cfg)  # the algorithm's own rules, in its module
    if cfg.reward.path is not None and cfg.reward.function != "task":
        raise ConfigError(
            f"reward.path: set either reward.function ({cfg.reward.function!r}) or reward.path with "
            f"reward.name (verl's spelling), not both"
        )


def check_colocate(cfg: ConveyorConfig) -> None:
    """``placement: colocate`` time-shares a GPU between generation and training, one
    after the other: lock-step, on-policy, weights after every step (the rollout wakes
    to load them: it dropped its own), vLLM (whose sleep mode frees the memory), each
    replica on one GPU, and GPUs the planner chooses."""
    if cfg.placement.mode != "colocate":
        return
    df, tr, ro = cfg.dataflow, cfg.train, cfg.rollout
    wrong = [("dataflow.async_execution: expected false (generation and training take turns on the GPU), got true",
              df.async_execution),
             (f"algorithm.name: expected an on-policy algorithm (with {cfg.algorithm.name!r} no rollout generates, "
              f"so nothing sleeps)", cfg.algorithm.offline),
             (f"algorithm.name: {cfg.algorithm.name!r} trains a critic, which does not give the GPU back while vLLM "
              f"generates; use placement: auto", cfg.algorithm.needs_critic),
             ("reward.sources: a reward model does not give the GPU back while vLLM generates; use placement: auto",
              cfg.reward_model_enabled),
             (f"dataflow.max_staleness: expected 0 (a step generates on the weights of the step before), "
              f"got {df.max_staleness}", df.max_staleness != 0),
             (f"train.sync_interval: expected 1 (the rollout drops its weights while it sleeps and wakes "
              f"to load the next ones), got {tr.sync_interval}", tr.sync_interval != 1),
             ("rollout.backend: expected 'vllm' (its sleep mode frees the GPU memory) or a plug-in backend with "
              "sleep and wake_up, got 'hf'", ro.backend == "hf"),
             (f"train.ppo_mini_batches: expected 1 (a colocated step trains once it is whole), got "
              f"{tr.ppo_mini_batches}", tr.ppo_mini_batches != 1),
             (f"rollout.tensor_parallel_size: expected 1 (a tensor-parallel replica takes GPUs of its "
              f"own), got {ro.tensor_parallel_size}", ro.tensor_parallel_size != 1),
             *((f"placement.{f}: expected no gpus or num_gpus (colocate plans the GPUs itself)",
                getattr(cfg.placement, f).gpus is not None or getattr(cfg.placement, f).num_gpus > 0)
               for f in cfg.placement.__struct_fields__ if f != "mode")]
    for message, bad in wrong:
        if bad:
            raise ConfigError(f"{message} with placement: colocate")


def check_sampler_logprobs(cfg: ConveyorConfig) -> None:
    """``rollout.logprobs: false``: the trainer's detached log-probs stand in for the
    sampler's, which is exact only where every sample is trained, in one update, by the
    weights that generated it, and nothing else reads the sampler's log-probs."""
    if cfg.rollout.logprobs:
        return
    df, tr, algo = cfg.dataflow, cfg.train, cfg.algorithm
    wrong = [(f"dataflow.max_staleness: expected 0 (samples trained by the weights that generated them), "
              f"got {df.max_staleness}", df.max_staleness != 0),
             (f"train.sync_interval: expected 1 (the rollout serves every step's weights), got {tr.sync_interval}",
              tr.sync_interval != 1),
             (f"train.ppo_epochs: expected 1 (a later epoch's ratio needs the sampler's log-probs), "
              f"got {tr.ppo_epochs}", tr.ppo_epochs != 1),
             (f"train.ppo_mini_batches: expected 1 (after the first update the weights are no longer the "
              f"sampler's), got {tr.ppo_mini_batches}", tr.ppo_mini_batches != 1),
             (f"algorithm.off_policy: expected 'off' (its importance weight divides by the sampler's "
              f"log-probs), got {algo.off_policy!r}", algo.off_policy != "off"),
             ("algorithm.use_kl_in_reward: expected false (its penalty reads the sampler's log-probs)",
              algo.use_kl_in_reward)]
    for message, bad in wrong:
        if bad:
            raise ConfigError(f"{message} with rollout.logprobs: false")


def check_lora(lora: LoraConfig) -> None:
    """``model.lora.target_modules``: ``all-linear``, a non-empty regular expression, or a
    non-empty list of module names."""
    targets = lora.target_modules
    if isinstance(targets, list):
        blank = [i for i, name in enumerate(targets) if not name.strip()]
        if not targets or blank:
            raise ConfigError(f"model.lora.target_modules: expected 'all-linear', a regular expression or a "
                              f"non-empty list of module names, got {targets!r}")
        return
    if not targets.strip():
        raise ConfigError("model.lora.target_modules: expected 'all-linear', a regular expression or a list of "
                          "module names, got an empty string")
    if targets != "all-linear":
        try:
            re.compile(targets)
        except re.error as exc:
            raise ConfigError(f"model.lora.target_modules: {targets!r} is not a valid regular expression ({exc})") from None


def check_curriculum(data: DataConfig) -> None:
    """``data.curriculum``: over a data file, strictly increasing levels, a start among them,
    a demotion threshold below the promotion one."""
    cur = data.curriculum
    if cur is None:
        return
    if not data.path:
        raise ConfigError("data.curriculum: expected data.path (rows with a level column), got a task")
    if any(b <= a for a, b in zip(cur.levels, cur.levels[1:], strict=False)):
        raise ConfigError(f"data.curriculum.levels: expected strictly increasing levels, got {cur.levels}")
    if cur.start is not None and cur.start not in cur.levels:
        raise ConfigError(f"data.curriculum.start: expected one of {cur.levels}, got {cur.start}")
    if cur.demote_below is not None and cur.demote_below >= cur.promote_at:
        raise ConfigError(f"data.curriculum.demote_below: expected < promote_at ({cur.promote_at}), "
                          f"got {cur.demote_below}")


def check_pairs(cfg: ConveyorConfig) -> None:
    """An offline algorithm (``dpo``) and ``data.pairs`` go together; its own rules are its ``check``."""
    algo, data = cfg.algorithm, cfg.data
    if algo.offline != (data.pairs is not None):
        raise ConfigError(f"data.pairs: expected a pairs section exactly with algorithm.name dpo "
                          f"(algorithm.name is {algo.name!r}, data.pairs is {'set' if data.pairs else 'unset'})")


def check_reward_sources(cfg: ConveyorConfig) -> None:
    """``reward.sources``: one model source with a path, at most one function source."""
    sources = cfg.reward.sources
    if not sources:
        return
    kinds = {name: src.kind for name, src in sources.items()}
    if list(kinds.values()).count("model") != 1 or list(kinds.values()).count("function") > 1:
        raise ConfigError(f"reward.sources: expected one source of kind 'model' and at most one of kind "
                          f"'function', got {kinds}")
    for name, src in sources.items():
        if src.kind == "model" and not src.path:
            raise ConfigError(f"reward.sources.{name}.path: expected a local reward model checkpoint directory "
                              f"(AutoModelForSequenceClassification, one logit), got none")
        if src.kind == "function" and src.path:
            raise ConfigError(f"reward.sources.{name}.path: a 'function' source is reward.function's score; "
                              f"path is for kind 'model'")
        if name in ("mean", "std", "max", "min", "errors"):
            raise ConfigError(f"reward.sources.{name}: the name is a reward metric of its own; choose another")


def check_algorithm(cfg: ConveyorConfig) -> None:
    """``algorithm`` fields that depend on other sections."""
    algo, ro = cfg.algorithm, cfg.rollout
    if algo.use_kl_in_reward and not cfg.reference_enabled:
        raise ConfigError("algorithm.use_kl_in_reward: needs reference log-probs, but reference.enabled is 'off'")
    if algo.drop_zero_variance_groups and not cfg.dataflow.async_execution:
        # Lock-step moves a fixed number of micro-batches per step; with dropped groups
        # replaced, the last prompts of a run can sit in the reward stage's regrouping
        # queue while the runner waits for admission room that only they would free.
        raise ConfigError(
            "algorithm.drop_zero_variance_groups: needs dataflow.async_execution: true (lock-step cannot "
            "schedule the replacements of dropped groups)")
    if algo.drop_zero_variance_groups and ro.n < 2:
        raise ConfigError(
            f"algorithm.drop_zero_variance_groups: needs rollout.n >= 2 (a group of one sample always has "
            f"zero variance), got rollout.n {ro.n}")
    if algo.needs_critic and algo.use_kl_in_reward and algo.kl_ctrl.type == "adaptive":
        # The critic assigns advantages and returns upstream of the trainer, whose KL
        # controller moves an adaptive coefficient; the critic sees only the fixed one.
        raise ConfigError(
            f"algorithm.kl_ctrl.type: expected 'fixed' with algorithm.name {algo.name!r} (the critic computes "
            f"returns with kl_ctrl.kl_coef), got 'adaptive'")
    if algo.overlong_buffer_len >= ro.max_tokens:
        raise ConfigError(
            f"algorithm.overlong_buffer_len: expected < rollout.max_tokens ({ro.max_tokens}), "
            f"got {algo.overlong_buffer_len}")


def to_dict(cfg: ConveyorConfig) -> dict[str, Any]:
    """The fully resolved config as plain data (written next to every run)."""
    return msgspec.to_builtins(cfg)
