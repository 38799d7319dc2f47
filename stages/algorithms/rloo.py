"""RLOO (Ahmadian et al. 2024, arXiv 2402.14740): a leave-one-out group baseline."""

from __future__ import annotations

from torch import Tensor

from pipeline.config import AlgorithmFields
from stages.algorithms.advantages import compute_rloo_advantages
from stages.algorithms.registry import outcome_scores, per_sample, register_algorithm


class RlooConfig(AlgorithmFields, tag="rloo"):
    """RLOO: ``r - mean of the other samples of the group``."""


@register_algorithm(RlooConfig)
def estimate_rloo(rewards: Tensor, mask: Tensor, group_size: int, cfg: RlooConfig, penalty: Tensor | None) -> Tensor:
    return per_sample(compute_rloo_advantages(outcome_scores(rewards, mask, penalty), group_size), mask)
