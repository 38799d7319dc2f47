"""OPO: on-policy RL with the optimal reward baseline (Hao et al. 2025, "On-Policy RL with
Optimal Reward Baseline", arXiv 2505.23585).

The variance-minimising baseline weighs each sample's reward by the squared norm of its
log-likelihood gradient; the paper approximates that norm by the response length, so
sample i of a group is scored against the length-weighted group mean
``b = sum_j(len_j * r_j) / sum_j(len_j)`` (lengths counted over the loss mask), and
``A_i = r_i - b`` on every one of its tokens. A constant group gets exactly 0; a group
with no loss token has baseline 0. Needs ``rollout.n >= 2``; the paper trains exactly
on-policy (``dataflow.max_staleness: 0``), which this file leaves to the config.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipeline.config import AlgorithmFields
from stages.algorithms.registry import outcome_scores, per_sample, register_algorithm


class OpoConfig(AlgorithmFields, tag="opo"):
    """OPO: ``r - sum_j(len_j * r_j) / sum_j(len_j)`` over the group (the length-weighted
    mean), the paper's approximation of the optimal baseline."""


@register_algorithm(OpoConfig)
def estimate_opo(rewards: Tensor, mask: Tensor, group_size: int, cfg: OpoConfig, penalty: Tensor | None) -> Tensor:
    scores = outcome_scores(rewards, mask, penalty).float().view(-1, group_size)
    lengths = mask.float().sum(dim=1).view(-1, group_size)
    baseline = (lengths * scores).sum(dim=1, keepdim=True) / lengths.sum(dim=1, keepdim=True).clamp(min=1.0)
    constant = scores.amax(dim=1, keepdim=True) == scores.amin(dim=1, keepdim=True)
    adv = torch.where(constant, torch.zeros_like(scores), scores - baseline)
    return per_sample(adv.reshape(-1), mask)
