"""Admission control: estimate a micro-batch's bytes, then admit, defer or split it.

Invariant (per stage, while ``oom_protection`` is on): a micro-batch is admitted only if
  max(used, resident + in_flight) + estimate <= budget  and
  estimate + (in-flight bytes not yet allocated) <= free,
where ``resident`` is what the stage holds with nothing in flight and ``in_flight`` the
sum of admitted, unreleased estimates. The controller is a pure state machine (no
asyncio, no threads, an injectable clock); ``AdmissionController`` shows how an actor
drives it.

Guarantees:
- a micro-batch that could never fit is split (whole GRPO groups,
  ``pipeline/memory/splitting.py``), never deferred forever; a single group is admitted
  only when it runs alone;
- deferral is bounded by ``defer_timeout_s`` (``AdmissionTimeout`` with the numbers);
- a stall on device memory waits at most ``stall_timeout_s``, then splits or stops the
  stage naming what to lower (docs/architecture.md, "Admission").
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Literal

import msgspec
import numpy as np

from pipeline.config import MemoryConfig
from pipeline.dtypes import DTYPE_BYTES
from pipeline.memory.oom import OomEvent
from pipeline.memory.packing import plan_passes
from pipeline.memory.readings import MemoryReading
from pipeline.types import RolloutBatch

StageKind = Literal["rollout", "reference", "trainer"]
MiB = float(1 << 20)

# ---------------------------------------------------------------------- estimators

class ModelShape(msgspec.Struct, frozen=True, kw_only=True):
    """What memory estimates need to know of a decoder-only model.
    ``intermediate_size`` 0 means unknown (4 × hidden_size is assumed); ``num_heads`` 0
    means hidden_size // head_dim. ``qk_norm``: q and k are normalised per head (Qwen3,
    Gemma 3); ``sandwich_norms``: four norms a layer, computed in float32 (Gemma 2/3)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    num_params: int
    dtype_bytes: int = 4
    intermediate_size: int = 0
    num_heads: int = 0
    qk_norm: bool = False
    sandwich_norms: bool = False

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any] | Any, *, dtype_bytes: int | None = None, num_params: int | None = None
    ) -> ModelShape:
        """From a Hugging Face config (object or ``config.json`` dict). ``num_params``
        is counted for a Llama-style layout (q/k/v/o, gated MLP, two norms per layer)
        unless given."""
        d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        if "num_hidden_layers" not in d and isinstance(d.get("text_config"), Mapping):
            d = {**d["text_config"], **{k: v for k, v in d.items() if k == "torch_dtype"}}
        layers = int(d.get("num_hidden_layers", d.get("n_layer", 0)))
        hidden = int(d["hidden_size"])
        heads = int(d.get("num_attention_heads", d.get("n_head", 1)))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        inter = int(d.get("intermediate_size") or 4 * hidden)
        vocab = int(d["vocab_size"])
        if num_params is None:
            attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o; k, v
            per_layer = attention + 3 * hidden * inter + 2 * hidden  # + gate/up/down, two norms
            embeddings = vocab * hidden * (1 if d.get("tie_word_embeddings", False) else 2)
            num_params = layers * per_layer + embeddings + hidden
        if dtype_bytes is None:
            dtype = str(d.get("torch_dtype") or d.get("dtype") or "float32").replace("torch.", "")
            dtype_bytes = DTYPE_BYTES.get(dtype, 4)
        model_type = str(d.get("model_type", ""))
        return cls(
            num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden,
            vocab_size=vocab, num_params=num_params, dtype_bytes=dtype_bytes, intermediate_size=inter,
            num_heads=heads, qk_norm=model_type in QK_NORM_MODEL_TYPES,
            sandwich_norms=model_type in SANDWICH_NORM_MODEL_TYPES,
        )


# Families whose layers normalise q and k per head, and those with four float32 norms a layer.
QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3", "gemma3_text", "olmo2"})
SANDWICH_NORM_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text"})


def layer_saved_bytes(shape: ModelShape) -> int:
    """Bytes per token that one decoder layer keeps for its backward, counted from what
    autograd saves in a transformers layer (d the dtype's bytes, Q = heads × head_dim,
    K = kv heads × head_dim, I intermediate):
      - each norm computes in float32: its float32 input (4·H), its normalised output
        (d·H; float32, 4·H, in Gemma's, whose weight multiplies in float32) and the
        output the next projection keeps (d·H; Gemma's post-norms feed a residual add,
        which keeps nothing);
      - q and k after their per-head norms (``qk_norm``: float32 input and output, as
        above) and rotary embedding, v, the attention output and its contiguous copy
        that the output projection keeps: d·(3·Q + 2·K);
      - the gated MLP's gate, activation, up and product: 4·d·I.
    ``python -m bench trainer_memory`` measures a GPU pass against it
    (docs/performance/real-shapes.md)."""
    d, hidden = shape.dtype_bytes, shape.hidden_size
    q = (shape.num_heads or hidden // max(shape.head_dim, 1)) * shape.head_dim
    k = shape.num_kv_heads * shape.head_dim
    inter = shape.intermediate_size or 4 * hidden
    if shape.sandwich_norms:
        norms = 2 * (8 + d) * hidden + 2 * 8 * hidden
        qk = 8 * (q + k) if shape.qk_norm else 0
    else:
        norms = 2 * (4 + 2 * d) * hidden
        qk = (4 + d) * (q + k) if shape.qk_norm else 0
    return norms + qk + d * (3 * q + 2 * k) + 4 * d * inter


def estimate_kv_cache_bytes(shape: ModelShape, num_tokens: int) -> int:
    """layers × kv heads × head_dim × 2 (K and V) × dtype bytes × tokens."""
    return shape.num_layers * shape.num_kv_heads * shape.head_dim * 2 * shape.dtype_bytes * num_tokens


def estimate_forward_bytes(
    shape: ModelShape, num_sequences: int, seq_len: int, with_grad: bool, logit_tokens: int | None = None,
    checkpointed: bool = False,
) -> int:
    """Transient bytes of one forward pass over ``[num_sequences, seq_len]`` tokens.

    Counted, with T = num_sequences × seq_len, H hidden, I intermediate, K = kv heads ×
    head_dim, in the model dtype:
      - per token per layer what a layer keeps for backward (``layer_saved_bytes``); with
        grad every layer's stay alive for backward (× layers), without grad only one
        layer's are alive at a time; ``checkpointed`` (gradient checkpointing, with grad):
        each layer's input (d·H) stays, and one layer at a time is recomputed in backward,
        its saved tensors and the gradients flowing through it (1.5 × one layer's);
      - logits [S, L, V] in float32 and their log_softmax (8 bytes each), plus their
        float32 gradient with grad (12 bytes); with ``logit_tokens`` (the chunked head of
        ``stages.models.logprobs``) only that many rows at once, each in the head's dtype, in
        float32, its softmax and, with grad, two gradients (16 bytes; 10 without).
    Not counted: weights, gradients and optimizer state (resident, measured by the
    reading); [S, heads, L, L] attention scores (a fused kernel never builds them).
    """
    tokens = num_sequences * seq_len
    per_layer = layer_saved_bytes(shape)
    if with_grad and checkpointed:
        activations = tokens * (3 * per_layer // 2 + shape.num_layers * shape.hidden_size * shape.dtype_bytes)
    else:
        activations = tokens * per_layer * (shape.num_layers if with_grad else 1)
    if logit_tokens is None:
        logits = tokens * shape.vocab_size * (12 if with_grad else 8)
    else:
        logits = min(tokens, logit_tokens) * shape.vocab_size * (16 if with_grad else 10)
    return activations + logits


def estimate_batch_bytes(
    stage_kind: StageKind, shape: ModelShape, seq_lens: Sequence[int], *, chunk_size: int | None = None,
    logit_tokens: int | None = None, pass_tokens: int = 0, unit_rows: int = 1, checkpointed: bool = False,
) -> int:
    """Bytes one micro-batch adds to a stage; ``seq_lens`` has one total length per sample.

    rollout: the KV cache of every sample's full length (give prompt + max_tokens, see
    ``expand_rollout_seq_lens``) plus one decode step's float32 logits and probabilities
    per sequence. reference / trainer: the largest forward pass of the engine's plan
    (``packing.plan_passes``: ``pass_tokens`` > 0 token-budget passes of whole
    ``unit_rows`` units, else chunks of ``chunk_size`` samples), each padded to its own
    longest (trainer: with grad, assuming each pass's backward runs before the next
    pass's forward); ``logit_tokens``: rows of logits alive at once (see
    ``estimate_forward_bytes``; None: the dense head); ``checkpointed``: the trainer
    recomputes its blocks in backward (``train.gradient_checkpointing``).
    """
    lens = [int(n) for n in seq_lens]
    if not lens:
        return 0
    if stage_kind == "rollout":
        return estimate_kv_cache_bytes(shape, sum(lens)) + len(lens) * shape.vocab_size * 8
    if stage_kind not in ("reference", "trainer"):
        raise ValueError(f"stage_kind: expected 'rollout', 'reference' or 'trainer', got {stage_kind!r}")
    passes = plan_passes(lens, pass_tokens, chunk_size or len(lens), unit_rows)
    return max(
        estimate_forward_bytes(shape, len(rows), max(lens[i] for i in rows), with_grad=stage_kind == "trainer",
                               logit_tokens=logit_tokens, checkpointed=checkpointed)
        for rows in passes
    )


def expand_rollout_seq_lens(prompt_token_lens: Sequence[int], group_size: int, max_tokens: int) -> list[int]:
    """One length per sample a rollout will generate: each prompt × ``group_size``,
    each as long as it may grow (prompt + ``max_tokens``)."""
    return [int(p) + max_tokens for p in prompt_token_lens for _ in range(group_size)]


def count_seq_lens(batch: RolloutBatch) -> list[int]:
    """Prompt + completion tokens of each sample."""
    return [int(n) for n in np.asarray(batch.prompt_lens) + np.asarray(batch.completion_lens)]


class Calibration:
    """Learns how far estimates are from measured peaks: ``factor`` is an exponential
    moving average of observed / estimated (raw, uncalibrated) bytes, each ratio clamped
    to [low, high] so one odd measurement cannot swing it far. The first observation
    sets the factor outright: it is the only evidence there is."""

    def __init__(self, alpha: float = 0.3, low: float = 0.25, high: float = 8.0) -> None:
        if not 0 < alpha <= 1 or not 0 < low <= 1 <= high:
            raise ValueError(f"Calibration: need 0 < alpha <= 1 and 0 < low <= 1 <= high, got {alpha}, {low}, {high}")
        self.alpha, self.low, self.high = alpha, low, high
        self.factor = 1.0
        self.observations = 0

    def observe(self, estimated_bytes: int, observed_bytes: int) -> float:
        """Fold one (raw estimate, measured peak above baseline) pair in; return the factor."""
        if estimated_bytes <= 0 or observed_bytes < 0:
            return self.factor  # nothing to learn from an empty micro-batch or a bad window
        ratio = min(self.high, max(self.low, observed_bytes / estimated_bytes))
        self.factor = ratio if self.observations == 0 else (1 - self.alpha) * self.factor + self.alpha * ratio
        self.observations += 1
        return self.factor

    def apply(self, estimated_bytes: int) -> int:
        return math.ceil(estimated_bytes * self.factor)


# --------------------------------------------------------------------- controller

class DecisionKind(enum.Enum):
    ADMIT = "admit"
    DEFER = "defer"
    SPLIT = "split"


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """ADMIT: ``bytes`` are now reserved; pass them to ``release`` when the work ends.
    DEFER: ask again after ``retry_after_s``. SPLIT: split into ``pieces`` and decide on
    each piece (its own estimate) again."""

    kind: DecisionKind
    bytes: int
    pieces: int = 1
    retry_after_s: float = 0.0
    reason: str = ""


class AdmissionTimeout(TimeoutError):
    """One micro-batch stayed deferred for longer than ``defer_timeout_s``."""


# Stage name -> config section, so that errors name the knob to turn.
_CONFIG_SECTION = {"rollout": "rollout", "reference": "reference", "trainer": "train", "train": "train"}


class AdmissionController:
    """Per-stage admission state (see the module invariant). Not thread-safe: call it
    from the actor's event loop only.

    An asyncio actor drives it like this (DEFER: wait and ask again; SPLIT reserves
    nothing: run each piece through the same steps, then merge the pieces' results)::

        ctl = AdmissionController("reference", cfg.reference.memory)
        est = estimate_batch_bytes("reference", shape, count_seq_lens(batch))
        while (d := ctl.decide(est, read_memory(), key=batch.batch_id,
                               max_pieces=count_groups(batch))).kind is DecisionKind.DEFER:
            await asyncio.sleep(d.retry_after_s)
        if d.kind is DecisionKind.SPLIT:
            pieces = split_rollout_batch(batch, d.pieces)  # each: estimate, decide, run; merge
        else:
            try:
                out = await run_with_oom_recovery(score, batch, split=split_rollout_batch,
                                                  merge=merge_rollout_batches, stage="reference",
                                                  size=count_groups, on_event=ctl.record_oom_event)
            finally:
                ctl.release(d.bytes)
    """

    def __init__(
        self,
        stage: str,
        config: MemoryConfig,
        *,
        now: Callable[[], float] = time.monotonic,
        calibration: Calibration | None = None,
        poll_interval_s: float = 0.1,
    ) -> None:
        self.stage = stage
        self.config = config
        self.calibration = calibration or Calibration()
        self.poll_interval_s = poll_interval_s
        self.admitted = self.deferred = self.splits = self.oom_recovered = self.oom_events = 0
        self._now = now
        self._in_flight = 0
        self._resident: int | None = None
        self._last: MemoryReading | None = None
        self._deferred_since: dict[Hashable, float] = {}

    @property
    def in_flight_bytes(self) -> int:
        return self._in_flight

    def budget_for(self, reading: MemoryReading) -> int:
        if self.config.budget_bytes is not None:
            return self.config.budget_bytes
        return int(self.config.max_memory_ratio * reading.total_bytes)

    def decide(
        self,
        estimate_bytes: int,
        reading: MemoryReading,
        in_flight_bytes: int | None = None,
        *,
        key: Hashable = None,
        max_pieces: int | None = None,
    ) -> Decision:
        """Admit, defer or split one micro-batch. ``estimate_bytes`` is the raw estimate (the
        calibration factor is applied here); ``in_flight_bytes`` defaults to this
        controller's admitted, unreleased bytes; ``key`` names the micro-batch so deferral time
        accrues per micro-batch; ``max_pieces`` (its GRPO groups) caps a split. Raises
        ``AdmissionTimeout`` when the micro-batch has been deferred for ``defer_timeout_s``."""
        if estimate_bytes < 0:
            raise ValueError(f"estimate_bytes: expected >= 0, got {estimate_bytes}")
        self._last = reading
        est = self.calibration.apply(estimate_bytes)
        if not self.config.oom_protection or est == 0:
            return self._admit(est, key, "oom_protection off" if est else "empty micro-batch")
        budget = self.budget_for(reading)
        in_flight = self._in_flight if in_flight_bytes is None else in_flight_bytes
        if in_flight == 0:
            self._resident = reading.used_bytes
        resident = self._resident if self._resident is not None else max(0, reading.used_bytes - in_flight)
        capacity = budget - resident
        if 0 < capacity < est:
            pieces = 1
            while est > capacity * pieces:
                pieces *= 2
            if max_pieces is None or max_pieces > 1:
                pieces = pieces if max_pieces is None else min(pieces, max_pieces)
                self.splits += 1
                self._deferred_since.pop(key, None)
                return Decision(
                    kind=DecisionKind.SPLIT, bytes=est, pieces=pieces,
                    reason=f"{est / MiB:.1f} MiB exceeds the {capacity / MiB:.1f} MiB left in the budget",
                )
            if in_flight == 0:
                # A single group cannot shrink; the estimate may be pessimistic, so try
                # it with the stage to itself and let OOM recovery have the last word.
                return self._admit(est, key, "over budget, atomic: admitted alone")
            return self._defer(key, est, reading, budget, in_flight, resident)
        if in_flight == 0 and est > reading.free_bytes:
            # Nothing of this stage's will free memory: what is free is all it gets
            # unless a neighbour on the device lets go. Wait ``stall_timeout_s`` for
            # that, then split to fit, or stop (``_defer``).
            since = self._deferred_since.get(key)
            stalled = since is not None and self._now() - since >= self.config.stall_timeout_s
            pieces = 1
            while stalled and est > reading.free_bytes * pieces and pieces < (max_pieces or 1 << 20):
                pieces *= 2
            pieces = pieces if max_pieces is None else min(pieces, max_pieces)
            if pieces > 1:
                self.splits += 1
                self._deferred_since.pop(key, None)
                return Decision(
                    kind=DecisionKind.SPLIT, bytes=est, pieces=pieces,
                    reason=f"{est / MiB:.1f} MiB exceeds the {reading.free_bytes / MiB:.1f} MiB free on the device",
                )
            return self._defer(key, est, reading, budget, in_flight, resident, stalled=True)
        pending = max(0, resident + in_flight - reading.used_bytes)  # admitted, not yet allocated
        projected = max(reading.used_bytes, resident + in_flight) + est
        if projected <= budget and est + pending <= reading.free_bytes:
            return self._admit(est, key, "fits")
        return self._defer(key, est, reading, budget, in_flight, resident)

    def _admit(self, est: int, key: Hashable, reason: str) -> Decision:
        self._deferred_since.pop(key, None)
        self._in_flight += est
        self.admitted += 1
        return Decision(kind=DecisionKind.ADMIT, bytes=est, reason=reason)

    def _defer(
        self, key: Hashable, est: int, reading: MemoryReading, budget: int, in_flight: int, resident: int,
        stalled: bool = False,
    ) -> Decision:
        now = self._now()
        since = self._deferred_since.get(key)
        if since is None:
            since = self._deferred_since[key] = now
            self.deferred += 1  # counts micro-batches, not polls
        numbers = (
            f"estimate {est / MiB:.1f} MiB, free {reading.free_bytes / MiB:.1f} MiB, "
            f"budget {budget / MiB:.1f} MiB, in flight {in_flight / MiB:.1f} MiB, "
            f"resident {resident / MiB:.1f} MiB"
        )
        waited = now - since
        limit = min(self.config.defer_timeout_s, self.config.stall_timeout_s) if stalled else self.config.defer_timeout_s
        if waited >= limit:
            del self._deferred_since[key]
            section = _CONFIG_SECTION.get(self.stage)
            if stalled:
                # The stage holds nothing in flight and the device's free memory stayed
                # below one group's estimate: only a smaller piece or a smaller
                # neighbour can help.
                knob = ("train.pass_tokens (tokens per forward pass; 0: train.chunk_size samples per pass)"
                        + (" or set train.gradient_checkpointing=true" if section == "train" else "")
                        if section in ("train", "reference")
                        else "rollout.max_tokens") + (", lower rollout.gpu_memory_utilization or "
                                                      "rollout.kv_cache_gib (vLLM's share of a shared GPU)")
                raise AdmissionTimeout(
                    f"stage {self.stage!r}: a micro-batch of one group needs more memory than the device has free "
                    f"with nothing of this stage in flight, for {waited:.1f} s (stall_timeout_s "
                    f"{self.config.stall_timeout_s:g}): {numbers}. Lower {knob}, or free memory held by other "
                    f"processes.")
            knob = f"{section}.memory.budget_bytes or max_memory_ratio" if section else "the stage's memory budget"
            raise AdmissionTimeout(
                f"stage {self.stage!r}: a micro-batch waited {waited:.1f} s for memory "
                f"(defer_timeout_s {self.config.defer_timeout_s:g}): {numbers}. Raise {knob}, "
                f"lower dataflow.prompts_per_micro_batch, or free memory held by other processes."
            )
        return Decision(kind=DecisionKind.DEFER, bytes=est, retry_after_s=self.poll_interval_s, reason=numbers)

    def forget(self, key: Hashable) -> None:
        """Drop the deferral clock of a micro-batch the caller gave up on."""
        self._deferred_since.pop(key, None)

    def release(self, nbytes: int) -> None:
        """Return the bytes of an admitted micro-batch whose work has ended (or failed)."""
        if not 0 <= nbytes <= self._in_flight:
            raise ValueError(f"release: {nbytes} bytes, but {self._in_flight} are in flight in stage {self.stage!r}")
        self._in_flight -= nbytes

    def observe_peak(self, estimate_bytes: int, peak_bytes: int) -> float:
        """Teach the calibration one measured peak (bytes above the window's baseline)."""
        return self.calibration.observe(estimate_bytes, peak_bytes)

    def record_oom_event(self, event: OomEvent) -> None:
        """``on_event`` for ``run_with_oom_recovery``."""
        if event.kind == "oom":
            self.oom_events += 1
        elif event.kind == "recovered":
            self.oom_recovered += event.count

    def metrics(self) -> dict[str, float]:
        s = self.stage
        last = self._last
        budget = self.budget_for(last) if last is not None else float(self.config.budget_bytes or 0)
        return {
            f"memory/{s}/used_bytes": float(last.used_bytes if last is not None else 0),
            f"memory/{s}/budget_bytes": float(budget),
            f"memory/{s}/in_flight_bytes": float(self._in_flight),
            f"admission/{s}/admitted": float(self.admitted),
            f"admission/{s}/deferred": float(self.deferred),
            f"admission/{s}/splits": float(self.splits),
            f"admission/{s}/calibration": self.calibration.factor,
            f"oom/{s}/events": float(self.oom_events),
            f"oom/{s}/recovered": float(self.oom_recovered),
        }
