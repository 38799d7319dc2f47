"""RL algorithms as pure functions and an explicit registry.

- ``advantages``: estimators (GRPO / Dr. GRPO, RLOO, REINFORCE++ and its baseline
  variant, GAE for PPO with a critic).
- ``losses``: KL estimators, loss aggregation, the clipped policy loss (dual-clip,
  off-policy correction) and token log-probs.
- ``registry``: ``ALGORITHMS`` (name -> what it needs, its estimator, its loss) and
  ``assign_advantages``, which the trainer stage calls before training a micro-batch.
"""

from stages.algorithms.advantages import (
    compute_discounted_returns,
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_rloo_advantages,
    compute_token_rewards,
    compute_whiten_stats,
    whiten_masked,
)
from stages.algorithms.losses import (
    KL_VALUE_CLAMP,
    LOG_RATIO_CLAMP,
    aggregate_loss,
    compute_kl,
    compute_policy_loss,
    compute_token_entropy,
    compute_token_logprobs,
)
from stages.algorithms.registry import (
    ALGORITHMS,
    Algorithm,
    assign_advantages,
    assign_step_advantages,
    build_loss_mask,
    build_policy_loss,
)

__all__ = [
    "ALGORITHMS", "KL_VALUE_CLAMP", "LOG_RATIO_CLAMP", "Algorithm", "aggregate_loss", "assign_advantages",
    "assign_step_advantages",
    "build_loss_mask", "build_policy_loss", "compute_discounted_returns", "compute_gae_advantages",
    "compute_grpo_advantages", "compute_kl", "compute_policy_loss", "compute_reinforce_pp_advantages",
    "compute_reinforce_pp_baseline_advantages", "compute_rloo_advantages", "compute_token_entropy",
    "compute_token_logprobs", "compute_token_rewards",
    "compute_whiten_stats", "whiten_masked",
]
