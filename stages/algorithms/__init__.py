"""RL algorithms as pure functions and a registry filled by decorators.

- One module per algorithm (``grpo``, ``rloo``, ``reinforce_plus_plus``,
  ``reinforce_plus_plus_baseline``, ``ppo``, ``dpo``, ...): its config struct, its
  estimator and its loss choice, registered by ``@register_algorithm``.
- ``advantages``: the estimators' shared math (group baselines, returns, GAE, whitening).
- ``losses``: KL estimators, loss aggregation, the clipped policy loss and token log-probs.
- ``registry``: ``ALGORITHMS`` (name -> what it needs, its estimator, its loss) and
  ``assign_advantages``, which the trainer stage calls before training a micro-batch.

Importing this package imports every module in it, so a new algorithm is one new file
here: ``pipeline.config`` finds its config through ``pipeline.plugins``' ``get_algorithm``.
"""

import importlib
import pkgutil

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
    register_algorithm,
)

# The registry's order (error messages, docs/configuration.md): the built-ins as they
# have always been listed, then any other module of the package by name.
_BUILTIN_ORDER = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo", "dpo")
for _name in (*_BUILTIN_ORDER, *(m.name for m in pkgutil.iter_modules(__path__))):
    importlib.import_module(f"{__name__}.{_name}")

__all__ = [
    "ALGORITHMS", "KL_VALUE_CLAMP", "LOG_RATIO_CLAMP", "Algorithm", "aggregate_loss", "assign_advantages",
    "assign_step_advantages",
    "build_loss_mask", "build_policy_loss", "compute_discounted_returns", "compute_gae_advantages",
    "compute_grpo_advantages", "compute_kl", "compute_policy_loss", "compute_reinforce_pp_advantages",
    "compute_reinforce_pp_baseline_advantages", "compute_rloo_advantages", "compute_token_entropy",
    "compute_token_logprobs", "compute_token_rewards",
    "compute_whiten_stats", "register_algorithm", "whiten_masked",
]
