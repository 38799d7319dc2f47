"""Curriculum over data levels: which level the source draws prompts from, and when it moves.

The rules (``advance_curriculum``, pure): rewards of samples whose prompt is at the
current level fill a window of the newest ``window`` rewards; rewards of prompts at other
levels (drawn before a move, still in flight) are ignored. Once the window is full, its
mean at or above ``promote_at`` moves to the next level (none past the last), below
``demote_below`` to the previous one (none before the first); a move empties the window,
so each decision rests on ``window`` rewards at the level it judges.

Where it runs: the trainer observes every trained sample with its prompt's level, so it
advances the state once per optimizer step, reports ``curriculum/level`` in the step's
metrics (the controller relays it to the source's admission) and writes the state into
each checkpoint with the prompts consumed, so a resumed run continues at the same level
with the same window. The source (``stages/data/source.py``) draws from the level it is given.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

from pipeline.config import CurriculumConfig
from pipeline.controller import CURRICULUM_LEVEL
from pipeline.types import RolloutBatch


class CurriculumState(msgspec.Struct, kw_only=True, frozen=True):
    """``level``: the level prompts are drawn from; ``recent``: rewards at it, newest last,
    at most ``window``; ``promotions``/``demotions``: moves so far in the run."""

    level: int
    recent: list[float] = []
    promotions: int = 0
    demotions: int = 0


def start_curriculum(cfg: CurriculumConfig) -> CurriculumState:
    return CurriculumState(level=cfg.levels[0] if cfg.start is None else cfg.start)


def advance_curriculum(state: CurriculumState, cfg: CurriculumConfig, rewards: Iterable[float]) -> CurriculumState:
    """The state after ``rewards`` (of samples at ``state.level``) came in; see the module rules."""
    recent = [*state.recent, *map(float, rewards)][-cfg.window:]
    if len(recent) < cfg.window:
        return msgspec.structs.replace(state, recent=recent)
    mean = sum(recent) / len(recent)
    at = cfg.levels.index(state.level)
    if mean >= cfg.promote_at and at + 1 < len(cfg.levels):
        return CurriculumState(level=cfg.levels[at + 1], promotions=state.promotions + 1, demotions=state.demotions)
    if cfg.demote_below is not None and mean < cfg.demote_below and at > 0:
        return CurriculumState(level=cfg.levels[at - 1], promotions=state.promotions, demotions=state.demotions + 1)
    return msgspec.structs.replace(state, recent=recent)


def select_level_rewards(batches: list[RolloutBatch], key: str, level: int) -> list[float]:
    """Rewards of the samples whose prompt's ``extra_info[key]`` is ``level``."""
    out: list[float] = []
    for b in batches:
        if b.rewards is None:
            continue
        rewards = np.asarray(b.rewards, dtype=np.float64)
        for i, p in enumerate(b.prompts):
            if p.extra_info.get(key) == level:
                out.extend(rewards[i * b.group_size:(i + 1) * b.group_size].tolist())
    return out


def summarise_curriculum(state: CurriculumState) -> dict[str, Any]:
    """The step metrics of a curriculum state."""
    return {CURRICULUM_LEVEL: state.level,
            "curriculum/window_reward_mean": float(np.mean(state.recent)) if state.recent else 0.0,
            "curriculum/window_fill": len(state.recent),
            "curriculum/promotions": state.promotions, "curriculum/demotions": state.demotions}
