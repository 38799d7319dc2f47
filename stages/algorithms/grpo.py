"""GRPO (Shao et al. 2024, arXiv 2402.03300) and Dr. GRPO (Liu et al. 2025, arXiv 2503.20783):
each sample's advantage is its score against its group's."""

from __future__ import annotations

from torch import Tensor

from pipeline.config import AlgorithmFields
from stages.algorithms.advantages import compute_grpo_advantages
from stages.algorithms.registry import outcome_scores, per_sample, register_algorithm


class GrpoConfig(AlgorithmFields, tag="grpo"):
    """GRPO: ``(r - group mean) / group std``; ``norm_adv_by_std: false`` is Dr. GRPO."""

    norm_adv_by_std: bool = True


@register_algorithm(GrpoConfig)
def estimate_grpo(rewards: Tensor, mask: Tensor, group_size: int, cfg: GrpoConfig, penalty: Tensor | None) -> Tensor:
    scores = outcome_scores(rewards, mask, penalty)
    return per_sample(compute_grpo_advantages(scores, group_size, norm_by_std=cfg.norm_adv_by_std), mask)
