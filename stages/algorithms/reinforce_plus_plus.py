"""REINFORCE++ (Hu 2025, arXiv 2501.03262): discounted outcome returns whitened over the
step's tokens, no critic and no group baseline."""

from __future__ import annotations

from typing import Annotated, ClassVar

from msgspec import Meta
from torch import Tensor

from pipeline.config import AlgorithmFields
from stages.algorithms.advantages import compute_reinforce_pp_advantages
from stages.algorithms.registry import register_algorithm


class ReinforcePlusPlusConfig(AlgorithmFields, tag="reinforce_plus_plus"):
    """REINFORCE++: outcome return discounted by ``gamma`` per token, whitened over the
    micro-batch's tokens; no group baseline (``rollout.n`` may be 1)."""

    gamma: Annotated[float, Meta(ge=0, le=1)] = 1.0
    group_baseline: ClassVar[bool] = False


@register_algorithm(ReinforcePlusPlusConfig, whitens_step=True)
def estimate_reinforce_pp(rewards: Tensor, mask: Tensor, group_size: int, cfg: ReinforcePlusPlusConfig,
                          penalty: Tensor | None) -> Tensor:
    return compute_reinforce_pp_advantages(rewards, mask, gamma=cfg.gamma, token_penalty=penalty, whiten=False)
