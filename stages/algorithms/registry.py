"""The algorithm registry: one explicit entry per ``algorithm.name``.

Guarantees:
- ``ALGORITHMS`` is a plain dict (no import-side-effect registration); its keys are
  exactly ``pipeline.config.ALGORITHM_NAMES`` (a unit test keeps them equal).
- An entry states what it needs (a group of samples per prompt, reference log-probs,
  values from a critic), assigns advantages with a pure function of one micro-batch and
  the algorithm config, and supplies its loss. Nothing here holds state or touches a
  device.
- ``assign_advantages`` runs in the trainer stage before a micro-batch is trained (and
  in replay, on the same recorded micro-batch), never inside the engine: the engine
  only turns ``advantages`` and ``loss_mask`` into gradients. It runs on the whole
  micro-batch before any admission or OOM split, so pieces carry the advantages of the
  whole. An entry that ``whitens_step`` (REINFORCE++) is assigned once per step, over
  all its micro-batches (``assign_step_advantages``): the trainer holds them until the
  step is whole. A batch whose ``advantages`` are already set (an upstream stage assigned them)
  keeps them; an upstream ``loss_mask`` (multi-turn tool output) is kept and narrowed to
  the completion lengths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
from torch import Tensor

from pipeline.types import RolloutBatch
from stages.algorithms.advantages import (
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_rloo_advantages,
    compute_token_rewards,
    compute_whiten_stats,
    whiten_masked,
)
from stages.algorithms.losses import compute_dpo_loss, compute_kl, compute_policy_loss

# (rewards [S], loss mask [S, C] bool, group_size, algorithm config, per-token reward
# penalty [S, C] or None) -> advantages [S, C]
Estimator = Callable[[Tensor, Tensor, int, Any, Tensor | None], Tensor]
# (rewards [S], critic values [S, C], loss mask [S, C] bool, algorithm config, per-token
# reward penalty [S, C] or None) -> (advantages [S, C], returns [S, C])
ValueEstimator = Callable[[Tensor, Tensor, Tensor, Any, Tensor | None], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Algorithm:
    """One registry entry. ``needs_group``: advantages compare the samples of a prompt
    (``rollout.n >= 2``); ``needs_reference``: reference log-probs beyond the KL term
    (``dpo``'s loss reads them; the others only for ``kl_coef > 0``). An entry estimates either
    from rewards alone (``estimate``) or from rewards and a critic's per-token values
    (``estimate_with_values``, which also gives the critic's returns); ``needs_values``
    says which."""

    name: str
    estimate: Estimator | None
    needs_group: bool
    needs_reference: bool = False
    estimate_with_values: ValueEstimator | None = None
    loss: Callable[..., tuple[Tensor, dict[str, float]]] = compute_policy_loss
    # The config fields bound into ``loss`` (``build_policy_loss``).
    loss_options: tuple[str, ...] = ("clip_eps_low", "clip_eps_high", "clip_ratio_c", "loss_agg", "loss_norm_tokens",
                                     "kl_estimator", "off_policy", "behav_imp_weight_cap", "ratio_level")
    # The estimate is whitened over the valid tokens of the whole step (REINFORCE++, as
    # verl whitens over its train batch): ``estimate`` returns it unwhitened and
    # ``assign_step_advantages`` whitens with the statistics of every micro-batch of the step.
    whitens_step: bool = False

    @property
    def needs_values(self) -> bool:
        return self.estimate_with_values is not None


def _per_sample(adv: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, adv.unsqueeze(1).expand(mask.shape), torch.zeros(mask.shape))


def _outcome(rewards: Tensor, mask: Tensor, penalty: Tensor | None) -> Tensor:
    # An outcome estimator sees one number per sample: the score minus the sample's
    # summed per-token penalty (verl sums token-level rewards the same way).
    if penalty is None:
        return rewards
    return rewards - torch.where(mask, penalty, torch.zeros_like(penalty)).sum(dim=1)


def _grpo(rewards: Tensor, mask: Tensor, group_size: int, cfg: Any, penalty: Tensor | None) -> Tensor:
    scores = _outcome(rewards, mask, penalty)
    return _per_sample(compute_grpo_advantages(scores, group_size, norm_by_std=cfg.norm_adv_by_std), mask)


def _rloo(rewards: Tensor, mask: Tensor, group_size: int, cfg: Any, penalty: Tensor | None) -> Tensor:
    return _per_sample(compute_rloo_advantages(_outcome(rewards, mask, penalty), group_size), mask)


def _reinforce_pp(rewards: Tensor, mask: Tensor, group_size: int, cfg: Any, penalty: Tensor | None) -> Tensor:
    return compute_reinforce_pp_advantages(rewards, mask, gamma=cfg.gamma, token_penalty=penalty, whiten=False)


def _reinforce_pp_baseline(rewards: Tensor, mask: Tensor, group_size: int, cfg: Any,
                           penalty: Tensor | None) -> Tensor:
    return compute_reinforce_pp_baseline_advantages(_outcome(rewards, mask, penalty), mask, group_size, whiten=False)


def _gae(rewards: Tensor, values: Tensor, mask: Tensor, cfg: Any, penalty: Tensor | None) -> tuple[Tensor, Tensor]:
    # Token-level rewards as PPO users expect: the score on the last token, the KL
    # penalty on every token; returns (the critic's targets) are never whitened.
    adv, returns = compute_gae_advantages(compute_token_rewards(rewards, mask, penalty), values, mask,
                                          gamma=cfg.gamma, lam=cfg.lam)
    if cfg.adv_whiten != "none":
        adv = whiten_masked(adv, mask, shift_mean=cfg.adv_whiten == "whiten")
    return adv, returns


def _no_advantage(rewards: Tensor, mask: Tensor, group_size: int, cfg: Any, penalty: Tensor | None) -> Tensor:
    return torch.zeros(mask.shape)


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm("grpo", _grpo, needs_group=True),
    "rloo": Algorithm("rloo", _rloo, needs_group=True),
    "reinforce_plus_plus": Algorithm("reinforce_plus_plus", _reinforce_pp, needs_group=False, whitens_step=True),
    "reinforce_plus_plus_baseline": Algorithm("reinforce_plus_plus_baseline", _reinforce_pp_baseline,
                                              needs_group=True, whitens_step=True),
    "ppo": Algorithm("ppo", None, needs_group=False, estimate_with_values=_gae),
    # Offline preference pairs: no advantage, the loss compares each pair's log-ratios.
    "dpo": Algorithm("dpo", _no_advantage, needs_group=False, needs_reference=True, loss=compute_dpo_loss,
                     loss_options=("beta", "label_smoothing")),
}


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm.name: expected one of {sorted(ALGORITHMS)}, got {name!r}")
    return ALGORITHMS[name]


def build_loss_mask(batch: RolloutBatch) -> np.ndarray:
    """[S, C] bool: completion positions inside each sample's length, and-ed with the
    batch's own ``loss_mask`` when an upstream stage set one."""
    width = batch.completion_ids.shape[1]
    mask = np.arange(width)[None, :] < np.asarray(batch.completion_lens)[:, None]
    if batch.loss_mask is not None:
        upstream = np.zeros((batch.num_samples, width), dtype=bool)
        given = np.asarray(batch.loss_mask, dtype=bool)
        upstream[:, : min(width, given.shape[1])] = given[:, :width]
        mask &= upstream
    return mask


def compute_kl_reward_penalty(batch: RolloutBatch, cfg: Any, mask: np.ndarray | None = None) -> Tensor:
    """[S, C] float32: the per-token KL of the behaviour policy to the reference
    (estimator ``cfg.kl_penalty``), 0 outside ``mask`` (default ``build_loss_mask``).
    ``use_kl_in_reward`` subtracts ``coef`` times it from the reward."""
    if batch.ref_logprobs is None:
        raise ValueError(f"batch {batch.batch_id}: algorithm.use_kl_in_reward needs reference log-probs")
    mask = build_loss_mask(batch) if mask is None else mask
    valid = torch.from_numpy(mask)
    behaviour = torch.as_tensor(np.asarray(batch.behaviour_logprobs, dtype=np.float32))
    ref = torch.as_tensor(np.asarray(batch.ref_logprobs, dtype=np.float32))
    zero = torch.zeros_like(behaviour)
    kl = compute_kl(torch.where(valid, behaviour, zero), torch.where(valid, ref, zero), cfg.kl_penalty)
    return torch.where(valid, kl, zero)


def summarise_kl_penalty(penalty: Tensor, mask: np.ndarray) -> float:
    """Mean over samples of each sample's token-mean KL (what the adaptive controller
    compares with ``target_kl``, as verl does); samples without tokens count 0."""
    m = torch.from_numpy(mask).float()
    per_seq = (penalty * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    return float(per_seq.mean()) if per_seq.numel() else 0.0


def build_overlong_mask(batch: RolloutBatch) -> np.ndarray:
    """[S] bool: samples cut by the length limit (finish reason ``length``)."""
    return np.array([r == "length" for r in batch.finish_reasons], dtype=bool).reshape(-1)


def assign_advantages(batch: RolloutBatch, cfg: Any, kl_reward_coef: float = 0.0) -> RolloutBatch:
    """``batch`` with ``loss_mask`` [S, C] bool and ``advantages`` [S, C] float32 set by
    the algorithm ``cfg.name``: ``assign_step_advantages`` of a step of this one batch."""
    return assign_step_advantages([batch], cfg, kl_reward_coef)[0]


def assign_step_advantages(batches: list[RolloutBatch], cfg: Any, kl_reward_coef: float = 0.0) -> list[RolloutBatch]:
    """Each of a step's ``batches`` with ``loss_mask`` [S, C] bool and ``advantages``
    [S, C] float32 set by the algorithm ``cfg.name`` (see the module guarantees); new
    values, never mutated. An entry that ``whitens_step`` whitens over the valid tokens
    of all of them (the step's batch); the others estimate each batch on its own.

    ``kl_reward_coef`` > 0 (``use_kl_in_reward``; the trainer's KL controller chooses it
    per step): ``kl_reward_coef * compute_kl_reward_penalty`` is subtracted from the
    reward before advantages: from each token's reward (REINFORCE++'s returns) or, for
    outcome estimators, the sample's sum from its score. ``cfg.overlong_mask``: samples
    cut by the length limit leave the loss mask after advantages are computed (they
    still count in their group's baseline and the whitening, as in DAPO's overlong
    filtering). An entry with ``estimate_with_values`` (``ppo``) reads ``batch.values``
    and also sets ``returns`` [S, C] float32 (the critic's targets)."""
    algo = get_algorithm(cfg.name)
    estimated = [_estimate(b, algo, cfg, kl_reward_coef) for b in batches]
    todo = [e for e in estimated if e[1] is not None]
    if algo.whitens_step and todo:
        stats = compute_whiten_stats([adv for _, adv, mask, _ in todo], [mask for _, adv, mask, _ in todo])
        estimated = [(b, None if adv is None else whiten_masked(adv, mask, stats=stats), mask, ret)
                     for b, adv, mask, ret in estimated]
    return [_finish(b, adv, mask, ret, cfg) for b, adv, mask, ret in estimated]


def _estimate(batch: RolloutBatch, algo: Algorithm, cfg: Any,
              kl_reward_coef: float) -> tuple[RolloutBatch, Tensor | None, Tensor, np.ndarray | None]:
    """(batch, its advantages [S, C] before any step-wide whitening or None when it came
    with its own, loss mask [S, C] bool, critic returns or None)."""
    mask = torch.from_numpy(build_loss_mask(batch))
    if batch.advantages is not None:
        return batch, None, mask, None
    if batch.rewards is None:
        raise ValueError(f"batch {batch.batch_id}: no rewards; the reward stage must run first")
    rewards = torch.as_tensor(np.array(batch.rewards, dtype=np.float32))
    penalty = (kl_reward_coef * compute_kl_reward_penalty(batch, cfg, mask.numpy())
               if kl_reward_coef > 0 else None)
    if algo.estimate_with_values is None:
        assert algo.estimate is not None
        return batch, algo.estimate(rewards, mask, batch.group_size, cfg, penalty), mask, None
    if batch.values is None:
        raise ValueError(f"batch {batch.batch_id}: algorithm {cfg.name!r} needs critic values [S, C] "
                         f"(is a critic stage wired before the trainer?)")
    values = torch.as_tensor(np.asarray(batch.values, dtype=np.float32))
    if values.shape != mask.shape:
        raise ValueError(f"batch {batch.batch_id}: values: expected shape {tuple(mask.shape)} (samples, completion "
                         f"positions), got {tuple(values.shape)}")
    adv, ret = algo.estimate_with_values(rewards, values, mask, cfg, penalty)
    return batch, adv, mask, ret.numpy().astype(np.float32)


def _finish(batch: RolloutBatch, adv: Tensor | None, mask: Tensor, returns: np.ndarray | None,
            cfg: Any) -> RolloutBatch:
    """The batch with its loss mask (overlong samples removed) and advantages (0 outside it)."""
    loss_mask = _mask_overlong(batch, mask.numpy(), cfg)
    if adv is None:  # assigned upstream: kept
        return msgspec.structs.replace(batch, loss_mask=loss_mask)
    adv = torch.where(torch.from_numpy(loss_mask), adv, torch.zeros_like(adv))
    extra = {} if returns is None else {"returns": returns}
    return msgspec.structs.replace(batch, loss_mask=loss_mask, advantages=adv.numpy().astype(np.float32), **extra)


def _mask_overlong(batch: RolloutBatch, mask: np.ndarray, cfg: Any) -> np.ndarray:
    if not getattr(cfg, "overlong_mask", False) or not batch.finish_reasons:
        return mask
    return mask & ~build_overlong_mask(batch)[:, None]


def build_policy_loss(cfg: Any) -> Callable[..., tuple[Tensor, dict[str, float]]]:
    """The entry's loss with its options (``Algorithm.loss_options``) bound from ``cfg``;
    called as ``loss(logprobs, old_logprobs, advantages, mask, ref_logprobs=..., kl_coef=...)``."""
    algo = get_algorithm(cfg.name)
    return functools.partial(algo.loss, **{name: getattr(cfg, name) for name in algo.loss_options})
