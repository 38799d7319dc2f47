"""Advantage estimators as pure torch functions (no state, no I/O, no device placement).

Guarantees:
- Shapes: S samples, C completion positions; sample ``i`` belongs to group
  ``i // group_size`` (groups are consecutive runs, as in ``RolloutBatch``).
- Outcome estimators (``grpo``, ``rloo``) map ``rewards`` [S] to one advantage per
  sample; token-level estimators (``reinforce_plus_plus*``, ``gae``) return [S, C] and are
  exactly 0 wherever ``mask`` is 0. ``gae`` also returns the critic's targets
  (``returns = advantages + values``, before any whitening).
- Whitening statistics (REINFORCE++) run over the valid tokens of what they are given:
  the registry gives them every micro-batch of a step (``compute_whiten_stats``), before
  any split, so the batch is the step's (as verl's) and an admission or OOM split never
  changes an advantage. The estimators return their values unwhitened.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _check_groups(rewards: Tensor, group_size: int, min_size: int = 1) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected shape [S], got {tuple(rewards.shape)}")
    if group_size < min_size:
        raise ValueError(f"group_size: expected >= {min_size}, got {group_size}")
    if rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards: {rewards.shape[0]} samples is not a multiple of group_size {group_size}; "
            f"groups must stay whole"
        )


def compute_grpo_advantages(
    rewards: Tensor, group_size: int, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Group-relative advantages: ``(r - group mean) / (group std + eps)``.

    ``rewards`` [S] -> advantages [S] (float32). The std is the population std
    (``unbiased=False``): a group's normalised advantages then have mean 0 and mean
    square exactly 1 whatever the group size (for a non-constant group, up to eps),
    and ``group_size == 1`` is well defined (advantage 0). A group whose rewards are all
    equal gets advantage 0: it carries no learning signal. With ``norm_by_std=False``
    the advantage is ``r - group mean`` (Dr. GRPO).
    """
    _check_groups(rewards, group_size)
    num = rewards.shape[0]
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    return _zero_constant_groups(grouped, centred).reshape(num)


def compute_rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Leave-one-out baseline: ``r_i - mean_{j != i} r_j`` within the group.

    ``rewards`` [S] -> [S] float32; ``group_size >= 2``. Equal to
    ``G / (G - 1) * (r_i - group mean)``; a constant group gets exactly 0.
    """
    _check_groups(rewards, group_size, min_size=2)
    grouped = rewards.float().view(-1, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return _zero_constant_groups(grouped, grouped - others).reshape(-1)


def compute_discounted_returns(scores: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Outcome reward placed on each sequence's last valid token, discounted backwards.

    ``scores`` [S], ``mask`` [S, C] -> [S, C]: token ``t`` of a sequence whose last valid
    token is ``T`` gets ``gamma ** (number of valid tokens after t) * score``; 0 where
    ``mask`` is 0. With ``gamma = 1`` every valid token carries the score.
    """
    valid = mask > 0
    # Valid tokens strictly after t: total valid minus the running count up to t.
    after = valid.sum(dim=1, keepdim=True) - valid.long().cumsum(dim=1)
    returns = scores.float().unsqueeze(1) * torch.pow(torch.tensor(float(gamma)), after.float())
    return torch.where(valid, returns, torch.zeros_like(returns))


def compute_whiten_stats(values: Sequence[Tensor], masks: Sequence[Tensor]) -> tuple[Tensor, Tensor, int]:
    """(mean, unbiased variance, count) of the positions where ``masks`` are set, pooled
    over every ``values[k]`` [S_k, C_k] (a step's micro-batches); the variance is 0 below
    two positions."""
    valid = [m > 0 for m in masks]
    n = int(sum(int(v.sum()) for v in valid))
    xs = [torch.where(v, x.float(), torch.zeros_like(x, dtype=torch.float32)) for x, v in zip(values, valid, strict=True)]
    mean = sum((x.sum() for x in xs), torch.tensor(0.0)) / max(n, 1)
    sq = sum((torch.where(v, x - mean, torch.zeros_like(x)).square().sum() for x, v in zip(xs, valid, strict=True)),
             torch.tensor(0.0))
    return mean, sq / (n - 1) if n >= 2 else torch.tensor(0.0), n


def whiten_masked(values: Tensor, mask: Tensor, eps: float = 1e-8, shift_mean: bool = True,
                  stats: tuple[Tensor, Tensor, int] | None = None) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the positions where ``mask`` is set; 0 elsewhere.

    The variance is unbiased (Bessel's correction over the valid positions, as verl's
    ``masked_whiten``); fewer than two valid positions give 0 everywhere. ``stats``:
    ``compute_whiten_stats`` of a larger batch this one belongs to (default: its own).
    ``shift_mean=False`` adds the mean back: ``x / std``-like scaling that keeps the sign
    of a batch whose advantages are all positive.
    """
    valid = mask > 0
    mean, var, n = stats if stats is not None else compute_whiten_stats([values], [mask])
    if n < 2:
        return torch.zeros_like(values, dtype=torch.float32)
    x = torch.where(valid, values.float(), torch.zeros_like(values, dtype=torch.float32))
    centred = torch.where(valid, x - mean, torch.zeros_like(x))
    out = centred * torch.rsqrt(var + eps)
    return out if shift_mean else torch.where(valid, out + mean, out)


def compute_token_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Discounted reward-to-go over each sequence's valid tokens.

    ``token_rewards``, ``mask`` [S, C] -> [S, C]: ``G_t = r_t + gamma * G_next`` where
    ``next`` is the following valid token (positions where ``mask`` is 0 are skipped
    and hold 0). An outcome score on the last valid token gives
    ``compute_discounted_returns``.
    """
    valid = mask > 0
    r = torch.where(valid, token_rewards.float(), torch.zeros_like(token_rewards, dtype=torch.float32))
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        step = r[:, t] + gamma * running
        out[:, t] = torch.where(valid[:, t], step, torch.zeros_like(step))
        running = torch.where(valid[:, t], step, running)
    return out


def compute_reinforce_pp_advantages(rewards: Tensor, mask: Tensor, gamma: float = 1.0,
                                    token_penalty: Tensor | None = None, whiten: bool = True) -> Tensor:
    """REINFORCE++: discounted outcome returns whitened over the batch's valid tokens
    (``whiten=False``: unwhitened, for the caller to whiten over a larger batch).

    ``rewards`` [S], ``mask`` [S, C] -> [S, C] float32 (0 where ``mask`` is 0).
    ``token_penalty`` [S, C] (KL in the reward): subtracted from each token's reward
    before the returns, so token t's return is its discounted score minus the
    discounted penalties from t on.
    """
    returns = compute_discounted_returns(rewards, mask, gamma)
    if token_penalty is not None:
        returns = returns - compute_token_returns(token_penalty, mask, gamma)
    return whiten_masked(returns, mask) if whiten else returns


def compute_reinforce_pp_baseline_advantages(rewards: Tensor, mask: Tensor, group_size: int,
                                             whiten: bool = True) -> Tensor:
    """REINFORCE++ with a group baseline: ``r - group mean`` per sample, broadcast to its
    tokens, then whitened over the batch's valid tokens (``whiten=False``: not).
    ``rewards`` [S], ``mask`` [S, C]."""
    _check_groups(rewards, group_size)
    centred = compute_grpo_advantages(rewards, group_size, norm_by_std=False)
    valid = mask > 0
    per_token = torch.where(valid, centred.unsqueeze(1).expand(mask.shape), torch.zeros(mask.shape))
    return whiten_masked(per_token, mask) if whiten else per_token


def compute_token_rewards(scores: Tensor, mask: Tensor, token_penalty: Tensor | None = None) -> Tensor:
    """Per-token rewards for a token-level estimator: each sample's outcome ``scores`` [S]
    on its last valid token, minus ``token_penalty`` [S, C] (KL in the reward) on every
    valid token. ``mask`` [S, C] -> [S, C] float32, 0 where ``mask`` is 0; a sample with
    no valid token gets nothing."""
    valid = mask > 0
    count = valid.long().cumsum(dim=1)
    last = valid & (count == valid.sum(dim=1, keepdim=True))
    rewards = torch.where(last, scores.float().unsqueeze(1).expand(mask.shape), torch.zeros(mask.shape))
    if token_penalty is not None:
        rewards = rewards - torch.where(valid, token_penalty.float(), torch.zeros(mask.shape))
    return rewards


def compute_gae_advantages(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over each sequence's valid tokens (PPO with a
    critic: the registry's ``ppo`` entry).

    ``token_rewards``, ``values``, ``mask`` [S, C] -> (advantages, returns) [S, C]:
    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V`` 0 past the last valid token,
    ``A_t = delta_t + gamma * lam * A_{t+1}``, ``returns = A + V``. Positions where
    ``mask`` is 0 are skipped (the recursion jumps over them) and hold 0. Not whitened.
    """
    valid = mask > 0
    r = torch.where(valid, token_rewards.float(), torch.zeros_like(token_rewards, dtype=torch.float32))
    v = torch.where(valid, values.float(), torch.zeros_like(values, dtype=torch.float32))
    num, width = r.shape
    next_value = torch.zeros(num)
    running = torch.zeros(num)
    adv = torch.zeros(num, width)
    for t in reversed(range(width)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        step = delta + gamma * lam * running
        adv[:, t] = torch.where(valid[:, t], step, torch.zeros_like(step))
        running = torch.where(valid[:, t], step, running)
        next_value = torch.where(valid[:, t], v[:, t], next_value)
    returns = torch.where(valid, adv + v, torch.zeros_like(adv))
    return adv, returns


def _zero_constant_groups(grouped: Tensor, values: Tensor) -> Tensor:
    # Exactly 0 for constant groups, even with eps=0 (0/0) or a mean that rounds off.
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(values), values)
