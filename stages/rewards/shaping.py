"""What the reward stage does to a scored micro-batch beyond scoring it: DAPO's soft
overlong penalty and dynamic sampling (groups without learning signal dropped).

Guarantees:
- ``compute_overlong_penalty`` is a pure function of the completion lengths: 0 up to
  ``max_tokens - buffer_len`` tokens, then falling linearly to ``-factor`` at
  ``max_tokens`` (DAPO, arXiv 2503.14476, eq. 13);
- ``GroupFilter`` drops every group whose samples all got the same reward and emits kept
  groups as micro-batches of exactly ``groups_per_batch`` groups, in arrival order, so a
  step never overshoots its size;
- every dropped prompt is recorded exactly once by the trainer and reported to the
  ledger at once, so the source replaces it; ``flush`` loses none at end of stream;
- both run on the final reward (``shapes_rewards`` names the stage);
- a run whose groups never vary raises ``NoLearningSignalError`` after
  ``MAX_CONSECUTIVE_DROPS_PER_STEP * prompts_per_step`` drops in a row.
Details: docs/architecture.md, "Reward shaping".
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec
import numpy as np

from pipeline.memory.splitting import merge_rollout_batches, split_rollout_batch_at
from pipeline.types import RolloutBatch

ZERO_VARIANCE = "zero_variance"
MAX_CONSECUTIVE_DROPS_PER_STEP = 100


class NoLearningSignalError(RuntimeError):
    """Every group for a long time got equal rewards: dynamic sampling cannot fill a step."""


def compute_overlong_penalty(completion_lens: np.ndarray, max_tokens: int, buffer_len: int,
                             factor: float = 1.0) -> np.ndarray:
    """[S] float32 penalties <= 0: ``-factor * (len - (max_tokens - buffer_len)) / buffer_len``
    where positive, else 0 (``buffer_len`` 0: all 0). Lengths never exceed ``max_tokens``."""
    lens = np.asarray(completion_lens, dtype=np.float64)
    if buffer_len <= 0:
        return np.zeros(lens.shape, dtype=np.float32)
    over = np.clip(lens - (max_tokens - buffer_len), 0.0, None)
    return (-factor * over / buffer_len).astype(np.float32)


def find_zero_variance_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """[G] bool: groups whose rewards are all equal (exactly: max == min)."""
    grouped = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    return grouped.max(axis=1) == grouped.min(axis=1)


def empty_like(batch: RolloutBatch) -> RolloutBatch:
    """A batch with no groups (it only carries ``dropped_prompts``) under the id
    ``-1 - batch.batch_id``: never a source's (those are >= 0), so a recording never
    holds two items of one id."""
    def blank(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else np.zeros((0, 0) if a.ndim == 2 else (0,), dtype=a.dtype)

    arrays = ("prompt_ids", "prompt_lens", "completion_ids", "completion_lens", "behaviour_logprobs",
              "token_versions", "rewards", "ref_logprobs", "advantages", "loss_mask", "values", "returns")
    return msgspec.structs.replace(
        batch, batch_id=-1 - batch.batch_id, prompts=[], sample_ids=[], completions=[], finish_reasons=[], reward_errors=[],
        reward_extras={k: [] for k in batch.reward_extras}, rollout_extras={k: [] for k in batch.rollout_extras},
        dropped_prompts={},
        **{name: blank(getattr(batch, name)) for name in arrays})


class GroupFilter:
    """Dynamic sampling for one reward stage (see the module guarantees)."""

    def __init__(self, groups_per_batch: int, prompts_per_step: int) -> None:
        self.groups_per_batch = groups_per_batch
        self.max_consecutive = MAX_CONSECUTIVE_DROPS_PER_STEP * prompts_per_step
        self.kept: deque[RolloutBatch] = deque()  # single-group pieces waiting for a batch
        self.pending: list[int] = []  # dropped prompt indices not yet handed on
        self.dropped_groups = 0
        self.consecutive = 0
        self._last: RolloutBatch | None = None

    def add(self, batch: RolloutBatch) -> tuple[list[RolloutBatch], int]:
        """(batches to emit, groups dropped from ``batch``)."""
        if batch.rewards is None:
            raise ValueError(f"batch {batch.batch_id}: no rewards to filter on")
        zero = find_zero_variance_groups(batch.rewards, batch.group_size)
        dropped = int(zero.sum())
        self.dropped_groups += dropped
        self.consecutive = self.consecutive + dropped if dropped == len(zero) else 0
        if self.consecutive > self.max_consecutive:
            raise NoLearningSignalError(
                f"algorithm.drop_zero_variance_groups: the last {self.consecutive} groups all had equal rewards "
                f"within each group; no learning signal to train on (turn it off, or check the reward)")
        self._last = batch
        if not dropped and not self.kept and len(zero) == self.groups_per_batch:
            return [self._with_pending(batch)], 0
        # A batch's kept groups join the queue as one-group pieces; they leave in order.
        pieces = split_rollout_batch_at(batch, [1] * len(zero)) if len(zero) > 1 else [batch]
        for piece, is_zero in zip(pieces, zero, strict=True):
            if is_zero:
                self.pending.extend(p.index for p in piece.prompts)
            else:
                self.kept.append(msgspec.structs.replace(piece, dropped_prompts={}))
        out = []
        while len(self.kept) >= self.groups_per_batch:
            out.append(self._with_pending(self._join([self.kept.popleft() for _ in range(self.groups_per_batch)])))
        return out, dropped

    def flush(self) -> list[RolloutBatch]:
        """What is left at the end of the stream: kept groups short of a whole batch, or
        an empty batch carrying drops not yet handed on."""
        if self.kept:
            parts = list(self.kept)
            self.kept.clear()
            return [self._with_pending(self._join(parts))]
        if self.pending and self._last is not None:
            return [self._with_pending(empty_like(self._last))]
        return []

    def _join(self, parts: list[RolloutBatch]) -> RolloutBatch:
        first = parts[0]
        return merge_rollout_batches([msgspec.structs.replace(p, batch_id=first.batch_id, step=first.step)
                                      for p in parts])

    def _with_pending(self, batch: RolloutBatch) -> RolloutBatch:
        if not self.pending:
            return batch
        drops = {**batch.dropped_prompts}
        drops[ZERO_VARIANCE] = [*drops.get(ZERO_VARIANCE, []), *self.pending]
        self.pending = []
        return msgspec.structs.replace(batch, dropped_prompts=drops)


def shapes_rewards(cfg: Any) -> str:
    """The stage that shapes the run's rewards: the last one to set them, ``reward_model``
    when ``reward.sources`` wires one (it replaces the reward stage's score), else
    ``reward``. Shaping an earlier score would lose the penalty to the overwrite and
    filter groups on a score that is not the one trained on."""
    return "reward_model" if cfg.reward_model_enabled else "reward"


class RewardShaper:
    """DAPO's overlong penalty, then dynamic sampling (``GroupFilter``), on the final
    reward of each micro-batch; run by the stage ``shapes_rewards`` names."""

    def __init__(self, cfg: Any) -> None:
        algo = cfg.algorithm
        self.max_tokens, self.buffer_len, self.factor = (
            cfg.rollout.max_tokens, algo.overlong_buffer_len, algo.overlong_penalty_factor)
        self.filter = (GroupFilter(cfg.dataflow.prompts_per_micro_batch, cfg.train.prompts_per_step)
                       if algo.drop_zero_variance_groups else None)

    def penalise(self, batch: RolloutBatch) -> RolloutBatch:
        """``batch`` with the overlong penalty added to its rewards (and logged as
        ``reward_extras["overlong_penalty"]``); unchanged when ``overlong_buffer_len`` is 0."""
        if self.buffer_len <= 0:
            return batch
        penalty = compute_overlong_penalty(batch.completion_lens, self.max_tokens, self.buffer_len, self.factor)
        return msgspec.structs.replace(batch, rewards=(np.asarray(batch.rewards) + penalty).astype(np.float32),
                                       reward_extras={**batch.reward_extras, "overlong_penalty": penalty.tolist()})

    async def shape(self, batch: RolloutBatch, ctx: Any) -> RolloutBatch | list[RolloutBatch]:
        """The penalised batch, or (dynamic sampling) the batches to emit now; dropped
        groups are reported to the controller's ledger at once, so the source replaces
        them while the kept groups wait."""
        out = self.penalise(batch)
        if self.filter is None:
            return out
        emitted, dropped = self.filter.add(out)
        if dropped:
            await ctx.controller.record_dropped(dropped, ZERO_VARIANCE)
            ctx.log.debug("groups_dropped", reason=ZERO_VARIANCE, groups=dropped, batch_id=batch.batch_id,
                          policy_version=batch.policy_version)
        return emitted

    def flush(self) -> list[RolloutBatch] | None:
        return self.filter.flush() if self.filter is not None else None

    def status(self) -> dict[str, int]:
        return {"groups_dropped_zero_variance": self.filter.dropped_groups} if self.filter is not None else {}
