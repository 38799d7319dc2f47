"""``reward`` and ``reference``: the reward functions or reward model that score
samples, and the frozen model whose log-probs anchor the KL term."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from pipeline.config.base import PosFloat, PosInt, _section
from pipeline.config.memory import MemoryConfig


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
