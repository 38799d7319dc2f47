"""PPO with a critic (Schulman et al. 2017, arXiv 1707.06347): GAE (arXiv 1506.02438)
over each sample's tokens from the critic's values."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from msgspec import Meta
from torch import Tensor

from pipeline.config import AlgorithmFields
from stages.algorithms.advantages import compute_gae_advantages, compute_token_rewards, whiten_masked
from stages.algorithms.registry import register_algorithm


class PpoConfig(AlgorithmFields, tag="ppo"):
    """PPO with a critic: GAE over each sample's tokens (``stages/algorithms/advantages.py``),
    the outcome score on the last token and, with ``use_kl_in_reward``, the KL penalty on
    every token. ``gamma``/``lam``: GAE's discount and lambda. ``adv_whiten``:
    ``whiten`` (mean 0, std 1 over the micro-batch's tokens), ``scale`` (std 1, mean
    kept) or ``none``. Needs the ``critic`` stage (its values, [S, C]); no group
    baseline (``rollout.n`` may be 1)."""

    gamma: Annotated[float, Meta(ge=0, le=1)] = 1.0
    lam: Annotated[float, Meta(ge=0, le=1)] = 0.95
    adv_whiten: Literal["whiten", "scale", "none"] = "whiten"
    group_baseline: ClassVar[bool] = False
    needs_critic: ClassVar[bool] = True


@register_algorithm(PpoConfig)
def estimate_gae(rewards: Tensor, values: Tensor, mask: Tensor, cfg: PpoConfig,
                 penalty: Tensor | None) -> tuple[Tensor, Tensor]:
    # Token-level rewards as PPO users expect: the score on the last token, the KL
    # penalty on every token; returns (the critic's targets) are never whitened.
    adv, returns = compute_gae_advantages(compute_token_rewards(rewards, mask, penalty), values, mask,
                                          gamma=cfg.gamma, lam=cfg.lam)
    if cfg.adv_whiten != "none":
        adv = whiten_masked(adv, mask, shift_mean=cfg.adv_whiten == "whiten")
    return adv, returns
