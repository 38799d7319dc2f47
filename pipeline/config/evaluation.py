"""``eval``: a held-out set scored between steps through the rollout engine."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from pipeline.config.base import NonNegFloat, NonNegInt, PosInt, _section


class EvalConfig(msgspec.Struct, **_section()):
    """Held-out evaluation between steps (``stages/evaluation/``; docs/evaluation.md). Off
    while ``path`` is null. ``path``: a local JSONL or Parquet file, a ``datasets``
    directory or a Hub dataset id (``split`` of ``config_name`` at ``revision``, fetched
    before the run starts like ``data.path``), its prompt and answer in ``prompt_key``
    and ``answer_key``, rendered like the training data (``data.chat_template``,
    ``data.max_prompt_len``); the first ``num_prompts`` usable rows in file order (0: all).

    Rollout worker 0 evaluates exactly one published policy version at a time: the
    version after every ``every`` optimizer steps (0: none between), version 0 (or a
    resumed run's first) with ``before_train``, and the final weights at the end. Each
    prompt gets one greedy completion and, with ``temperature`` > 0, ``n`` samples at that
    temperature (``seed``: per-request seeds), up to ``max_tokens`` tokens (null:
    ``rollout.max_tokens``), scored by the run's ``reward.function``; a sample passes at a
    reward >= ``pass_threshold`` (pass@k from the unbiased estimator). Results: ``eval/*``
    rows in ``metrics.jsonl``, ``summary.json``'s ``eval`` and ``eval.png``. Nothing an
    evaluation generates enters a queue, the ledger or the trainer."""

    path: Annotated[str, Meta(min_length=1)] | None = None
    split: Annotated[str, Meta(min_length=1)] = "test"
    config_name: str | None = None
    revision: str | None = None
    prompt_key: Annotated[str, Meta(min_length=1)] = "prompt"
    answer_key: Annotated[str, Meta(min_length=1)] = "ground_truth"
    num_prompts: NonNegInt = 0  # 0 = every usable row
    every: NonNegInt = 0  # optimizer steps between evaluations; 0 = only before_train and the final one
    before_train: bool = False
    n: PosInt = 1  # samples per prompt at ``temperature`` (pass@k for k <= n); > 1 needs temperature > 0
    temperature: NonNegFloat = 0.0  # 0: the greedy completion alone
    max_tokens: PosInt | None = None
    pass_threshold: float = 1.0
    seed: NonNegInt = 0

    @property
    def enabled(self) -> bool:
        return self.path is not None
