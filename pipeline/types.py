"""Wire types: every value that crosses a queue, a recording or an actor call.

Invariants (each type restates its own):
- Structs are frozen and keyword-only; a stage derives a new value with
  ``msgspec.structs.replace`` and never mutates what it received.
- Every micro-batch carries its ``batch_id`` and the ids of its samples; GRPO groups
  stay whole inside one micro-batch (``group_size`` consecutive samples share a prompt).
- Arrays are numpy arrays: Ray's object store shares their buffers with readers
  (pickle protocol 5, out of band) instead of copying them through the queue actor.
  ``encode``/``decode`` turn them into msgpack extension-free maps for recordings.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

SCHEMA_VERSION = 1

_wire = dict(frozen=True, kw_only=True)


class Prompt(msgspec.Struct, **_wire):
    """One prompt row. ``prompt_id`` is unique in a run; ``index`` is its row number.

    ``token_ids`` is the prompt exactly as the model sees it, tokenized once by the
    source (special tokens and chat template applied); ``text`` is the same prompt as
    text (for rewards and logs). An empty ``token_ids`` (a custom source) means the
    rollout tokenizes ``text`` itself with the tokenizer's special tokens. ``messages``:
    the chat messages ``text`` was rendered from (empty for a plain string prompt); a
    reward model renders them under its own chat template. ``max_tokens`` /
    ``min_tokens``: this row's generation budget (``data.max_tokens_field``), None for
    the rollout's own; the rollout clamps it to ``rollout.max_tokens``.
    """

    prompt_id: str
    text: str
    token_ids: list[int] = []
    messages: list[dict[str, str]] = []
    ground_truth: Any = None
    data_source: str = ""
    extra_info: dict[str, Any] = {}
    index: int = -1
    max_tokens: int | None = None
    min_tokens: int | None = None


class PromptBatch(msgspec.Struct, **_wire):
    """A micro-batch of prompts: the source's output. ``step`` is the optimizer step
    whose train batch these prompts are destined for (0-based)."""

    batch_id: int
    step: int
    prompts: list[Prompt]

    @property
    def sample_ids(self) -> list[str]:
        return [p.prompt_id for p in self.prompts]


class RolloutBatch(msgspec.Struct, **_wire):
    """Generated completions for a micro-batch of prompts; later stages fill the optional
    fields (``rewards`` by reward, ``ref_logprobs`` by reference).

    Shapes, with S = len(prompts) * group_size samples (sample i belongs to prompt
    i // group_size), P the longest prompt and C the longest completion:
      prompt_ids [S, P] int32 right-padded, prompt_lens [S] int32,
      completion_ids [S, C] int32 right-padded, completion_lens [S] int32,
      behaviour_logprobs [S, C] float32 (log-prob of each sampled token under the
      generating policy; NaN where the sampler reported none, ``rollout.logprobs:
      false``), token_versions [S, C] int32 (policy version that produced each
      token), rewards [S] float32, ref_logprobs [S, C] float32.
    Per-token training fields, [S, C], set by the algorithm before training
    (``stages/algorithms``; an upstream stage may set them first, e.g. a multi-turn
    rollout masks tool output): advantages float32, loss_mask bool (1 on the tokens the
    loss sees; never set beyond a completion's length), values and returns float32
    (critic-based algorithms only).
    ``policy_version`` is the oldest version that produced any token of the batch; the
    staleness of the batch is measured against it, and bounded by ``max_staleness``: the
    η the rollout generated it under (None: the config's ``dataflow.max_staleness``).
    """

    batch_id: int
    step: int
    prompts: list[Prompt]
    group_size: int
    sample_ids: list[str]
    prompt_ids: np.ndarray
    prompt_lens: np.ndarray
    completion_ids: np.ndarray
    completion_lens: np.ndarray
    completions: list[str]
    behaviour_logprobs: np.ndarray
    token_versions: np.ndarray
    policy_version: int
    finish_reasons: list[str] = []
    rewards: np.ndarray | None = None
    reward_errors: list[str] = []  # one entry per failed sample: "sample_id: error"
    reward_extras: dict[str, list[float]] = {}
    # Per-sample numbers from the rollout (tool calls, turns: stages/rollout/multi_turn.py),
    # key -> one value per sample (NaN: none for that sample); step metrics under their keys.
    rollout_extras: dict[str, list[float]] = {}
    ref_logprobs: np.ndarray | None = None
    advantages: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    values: np.ndarray | None = None
    returns: np.ndarray | None = None
    # reason -> indices of prompts an upstream stage dropped (already counted in the
    # controller's ledger); they ride to the trainer, which owns the run's done set.
    dropped_prompts: dict[str, list[int]] = {}
    max_staleness: int | None = None

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_lens.sum() + self.completion_lens.sum())

    @property
    def completion_tokens(self) -> int:
        return int(self.completion_lens.sum())

    @property
    def loss_tokens(self) -> int:
        """Completion tokens the loss sees: ``loss_mask`` within the completion lengths,
        or every completion token when no mask is set."""
        if self.loss_mask is None:
            return self.completion_tokens
        return int(np.count_nonzero(self._loss_positions()))

    @property
    def loss_rows(self) -> int:
        """Samples with at least one token the loss sees."""
        if self.loss_mask is None:
            return int(np.count_nonzero(np.asarray(self.completion_lens) > 0))
        return int(np.count_nonzero(self._loss_positions().any(axis=1)))

    def _loss_positions(self) -> np.ndarray:
        mask = np.asarray(self.loss_mask, dtype=bool).reshape(self.num_samples, -1)
        inside = np.arange(mask.shape[1])[None, :] < np.asarray(self.completion_lens)[:, None]
        return mask & inside


class WeightUpdate(msgspec.Struct, **_wire):
    """Published by the trainer every ``train.sync_interval`` steps.

    ``payload`` is an ``ObjectRef`` to safetensors bytes (kept out of this struct so the
    controller never copies weights); ``sha256`` guards the transport, ``fingerprint``
    (sum and sum of squares of all parameters in float64) lets a rollout worker prove
    that the weights it now serves are the trainer's, whatever fusion its engine applies.
    """

    version: int
    sha256: str
    fingerprint: tuple[float, float]
    num_bytes: int


class WeightConfirmation(msgspec.Struct, **_wire):
    """A rollout worker's word that it now serves ``version``: ``fingerprint`` read back
    from its engine when ``verified``; ``apply_s`` the seconds the update took."""

    worker: str
    version: int
    fingerprint: tuple[float, float]
    verified: bool
    apply_s: float


class EvalResult(msgspec.Struct, **_wire):
    """One evaluation of the held-out set (``eval``), reported by rollout worker ``worker``:
    every token it scored was generated by the weights of ``version`` (the number of
    optimizer steps they took). ``kind``: ``before_train``, ``periodic`` or ``final``;
    ``metrics``: the ``eval/*`` values (``stages/evaluation/metrics.py``); ``time``: when
    it ended; ``wall_s``: how long it took."""

    version: int
    kind: str
    worker: str
    metrics: dict[str, float]
    time: float
    wall_s: float


class Span(msgspec.Struct, **_wire):
    """A period one stage spent in one state: busy, wait_input, wait_output, transfer
    (moving an item through the object store), sync (weights), oom (recovering),
    wait_version (a rollout's micro-batch held until the weights its staleness bound
    needs are served; inside that micro-batch's busy span), wait_memory (a micro-batch's
    admission waiting for memory; inside its busy span) or eval (a rollout worker
    evaluating the held-out set)."""

    stage: str
    kind: str
    start: float
    end: float
    batch_id: int = -1


class StepRecord(msgspec.Struct, **_wire):
    """What one optimizer step consumed and produced; enough to replay and verify it."""

    step: int
    policy_version: int
    batch_ids: list[int]
    loss: float
    grad_norm: float
    weights_sha256: str
    metrics: dict[str, float] = {}
    rng_state: bytes = b""


# ------------------------------------------------------------------ msgpack encoding

def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        return {"__nd__": True, "dtype": arr.dtype.str, "shape": list(arr.shape), "data": arr.tobytes()}
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(typ: type, obj: Any) -> Any:
    if typ is np.ndarray and isinstance(obj, dict) and obj.get("__nd__"):
        return np.frombuffer(obj["data"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    raise NotImplementedError(f"cannot decode {typ!r}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(value: Any) -> bytes:
    """msgpack bytes of any wire value (no pickle: decoding never runs code)."""
    return _encoder.encode(value)


def decode(data: bytes, typ: type) -> Any:
    """Inverse of ``encode`` for a known type; raises ``msgspec.DecodeError`` on bad input."""
    return msgspec.msgpack.decode(data, type=typ, dec_hook=_dec_hook)


WIRE_TYPES: dict[str, type] = {
    t.__name__: t for t in (Prompt, PromptBatch, RolloutBatch, WeightUpdate, Span, StepRecord)
}
