"""The contract between the rollout actor shell and a generation backend.

A backend owns one inference engine (vLLM, transformers, or a plug-in). Guarantees
every backend gives, and the e2e tests check on the real ones:

- ``generate`` returns one ``GenerationResult`` per prompt, in prompt order, each with
  exactly ``sampling.n`` completions. Many ``generate`` calls may be awaited at once from
  one event loop; the engine interleaves them (continuous batching in vLLM).
- ``Completion.logprobs[t]`` is the log-probability of ``token_ids[t]`` under the
  distribution it was sampled from: logits after temperature, top-k and top-p (greedy:
  the plain softmax). It is finite and <= 0 (NaN at every position where
  ``sampling.logprobs`` is False: the engine reported none). These are the behaviour
  log-probs the trainer's importance ratio divides by.
- ``Completion.token_versions[t]`` is the policy version of the weights that sampled
  ``token_ids[t]``. Each backend documents how exact this is; both built-ins are exact
  (vLLM from 0.32, which labels engine steps with weight versions).
- ``update_weights(data, version, verify=True)`` applies a ``pipeline.weights``
  payload in place, reads the live weights back from the engine, checks them against
  the payload and returns their fingerprint; it raises
  ``pipeline.weights.WeightSyncError`` instead of serving weights it could not verify.
  With ``verify=False`` the read-back is skipped (``train.weight_sync_monitor: false``)
  and the payload's fingerprint, rounded to the served dtype, is returned; a later
  ``live_fingerprint()`` can still check it. ``version`` then reports the new version.
  Versions never go backwards (``ValueError``).
- A backend whose engine runs in a process of its own raises ``EngineDied`` from any
  call once that process is gone (killed, crashed); it then serves nothing more. The
  rollout stage builds a new backend in its place and generates the micro-batches that
  were in flight again (``rollout.max_engine_restarts``).
- Nothing here downloads: a backend loads a local checkpoint directory only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec

from pipeline.config import RolloutConfig
from pipeline.weights import Fingerprint

FINISH_REASONS = ("stop", "length", "abort")

_frozen = dict(frozen=True, kw_only=True)


class EngineDied(RuntimeError):
    """The backend's engine process is gone; every request in flight on it failed."""


class SamplingSettings(msgspec.Struct, **_frozen):
    """How to sample. ``temperature == 0`` is greedy (then top_p/top_k are ignored and
    the n completions are identical); ``top_k == -1`` is off.

    ``min_tokens``: stop tokens are held back until a completion has this many tokens
    (vLLM's ``min_tokens``, transformers' ``min_new_tokens``); with ``min_tokens ==
    max_tokens`` every completion has exactly ``max_tokens`` tokens.

    ``seed``: None draws from the engine's own random stream (the usual choice in RL:
    a prompt seen twice gets fresh samples). With a seed, completion i of prompt j is
    sampled with seed ``seed + j * n + i`` where the engine supports per-request seeds
    (vLLM); the HF backend seeds its whole call with ``seed``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    # False: the engine does not report the sampled tokens' log-probs; completions
    # carry NaN there (``rollout.logprobs``).
    logprobs: bool = True

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"sampling.n: expected >= 1, got {self.n}")
        if not self.temperature >= 0:
            raise ValueError(f"sampling.temperature: expected >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p: expected in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling.top_k: expected -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens: expected >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"sampling.min_tokens: expected in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def build_sampling_settings(cfg: RolloutConfig, seed: int | None = None) -> SamplingSettings:
    """The run config's sampling section as ``SamplingSettings``."""
    return SamplingSettings(
        n=cfg.n,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_tokens=cfg.max_tokens,
        seed=seed,
        logprobs=cfg.logprobs,
    )


def apply_budget(sampling: SamplingSettings, max_tokens: int | None, min_tokens: int | None) -> SamplingSettings:
    """``sampling`` under one row's generation budget (``Prompt.max_tokens`` /
    ``min_tokens``, None: none): the maximum clamped to ``sampling.max_tokens``
    (``rollout.max_tokens`` bounds every request), the minimum to that maximum."""
    high = sampling.max_tokens if max_tokens is None else max(1, min(max_tokens, sampling.max_tokens))
    low = min(min_tokens or 0, high)
    if (high, low) == (sampling.max_tokens, sampling.min_tokens):
        return sampling
    return msgspec.structs.replace(sampling, max_tokens=high, min_tokens=low)


class Completion(msgspec.Struct, **_frozen):
    """One sampled continuation. ``token_ids``, ``logprobs`` and ``token_versions`` have
    equal length (<= max_tokens); a completion that stopped on an end-of-sequence token
    includes that token (the trainer must learn to stop). ``text`` is the detokenized
    completion without special tokens. ``finish_reason`` is one of ``FINISH_REASONS``."""

    token_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    finish_reason: str
    text: str = ""
    # Multi-turn rollouts (stages/rollout/multi_turn.py): False on tokens the loss must
    # not see (tool output; their logprobs are 0); empty: every token is the model's.
    loss_mask: list[bool] = []
    extras: dict[str, float] = {}  # per-sample numbers (tool calls, turns)

    @property
    def oldest_version(self) -> int:
        """The staleness of this completion is measured from its oldest token."""
        return min(self.token_versions, default=-1)


class GenerationResult(msgspec.Struct, **_frozen):
    """All ``n`` completions of one prompt."""

    prompt_token_ids: list[int]
    completions: list[Completion]


@runtime_checkable
class RolloutBackend(Protocol):
    """What the rollout actor shell needs from an engine; see the module guarantees.

    Constructed (cheaply, no engine yet) as ``Backend(model_path, rollout_cfg, dtype)``;
    ``start`` loads the model. All methods are called from one event loop.
    """

    @property
    def version(self) -> int:
        """The policy version served now (0 until the first update)."""
        ...

    async def start(self) -> None: ...

    async def generate(
        self, prompt_token_ids: list[list[int]], sampling: SamplingSettings
    ) -> list[GenerationResult]: ...

    async def update_weights(self, data: bytes, version: int, verify: bool = True) -> Fingerprint: ...

    async def live_fingerprint(self) -> Fingerprint: ...

    async def shutdown(self) -> None: ...


class BackendFactory(Protocol):
    def __call__(self, model_path: Path, rollout_cfg: RolloutConfig, dtype: str) -> RolloutBackend: ...


def check_version_order(current: int, new: int) -> None:
    """Versions are monotonic: re-applying the current one is allowed, going back is not."""
    if new < current:
        raise ValueError(f"weight version {new} is older than the served version {current}")
