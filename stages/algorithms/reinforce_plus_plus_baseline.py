"""REINFORCE++ with a group baseline (Hu 2025, arXiv 2501.03262): ``r - group mean``,
whitened over the step's tokens."""

from __future__ import annotations

from torch import Tensor

from pipeline.config import AlgorithmFields
from stages.algorithms.advantages import compute_reinforce_pp_baseline_advantages
from stages.algorithms.registry import outcome_scores, register_algorithm


class ReinforcePlusPlusBaselineConfig(AlgorithmFields, tag="reinforce_plus_plus_baseline"):
    """REINFORCE++ with a group baseline: ``r - group mean``, whitened over the tokens."""


@register_algorithm(ReinforcePlusPlusBaselineConfig, whitens_step=True)
def estimate_reinforce_pp_baseline(rewards: Tensor, mask: Tensor, group_size: int,
                                   cfg: ReinforcePlusPlusBaselineConfig, penalty: Tensor | None) -> Tensor:
    scores = outcome_scores(rewards, mask, penalty)
    return compute_reinforce_pp_baseline_advantages(scores, mask, group_size, whiten=False)
