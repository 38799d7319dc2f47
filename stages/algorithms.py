"""GRPO math as pure torch functions: advantages, KL estimators, clipped policy loss.

Guarantees:
- No state, no I/O, no device placement: every function maps tensors to tensors (and
  floats for metrics), so each is unit-tested on CPU with hand-derived numbers.
- Shapes: S samples, C completion positions. Sample ``i`` belongs to GRPO group
  ``i // group_size`` (groups are consecutive runs, as in ``RolloutBatch``).
- Token positions where ``mask`` is 0 contribute nothing to a loss, a gradient or a
  metric, even when the log-probs there are garbage (padding, ``-inf``, NaN): they are
  replaced by zeros before any arithmetic, so no ``inf * 0`` NaN can leak through the
  forward or the backward pass.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k3"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]

# exp(20) ~ 4.9e8: far beyond any ratio a healthy run produces, far below float32
# overflow (exp(88.7)). Without the clamp one bad token (e.g. a log-prob of -80 under
# the reference) turns k3 or the ratio into inf and the whole step's gradient into NaN.
LOG_RATIO_CLAMP = 20.0


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
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected shape [S], got {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size: expected >= 1, got {group_size}")
    num = rewards.shape[0]
    if num % group_size:
        raise ValueError(
            f"rewards: {num} samples is not a multiple of group_size {group_size}; "
            f"GRPO groups must stay whole"
        )
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if norm_by_std:
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    # Exactly 0 for constant groups, even with eps=0 (0/0) or a mean that rounds off.
    constant = grouped.amax(dim=1, keepdim=True) == grouped.amin(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(centred), centred).reshape(num)


def compute_kl(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens.

    ``logprobs``, ``ref_logprobs`` [S, C] -> [S, C]. With ``d = ref - logp`` (clamped to
    +-LOG_RATIO_CLAMP): k1 = ``-d`` (unbiased, can be negative); k3 = ``exp(d) - d - 1``
    (Schulman's estimator: unbiased and always >= 0).
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"kl_estimator: expected 'k1' or 'k3', got {estimator!r}")


def aggregate_loss(values: Tensor, mask: Tensor, mode: LossAgg) -> Tensor:
    """Reduce per-token values [S, C] to a scalar over the positions where ``mask`` is set.

    - ``token-mean``: sum over all valid tokens / number of valid tokens (every token
      weighs the same; long answers weigh more).
    - ``seq-mean-token-mean``: mean over tokens inside each sequence, then mean over
      sequences (every sequence weighs the same).
    - ``seq-mean-token-sum``: sum over tokens inside each sequence, then mean over
      sequences.
    Sequence means run over sequences with at least one valid token; with no valid token
    at all the result is 0 (still attached to the graph, so ``backward`` works).
    """
    m = _as_float_mask(mask, values)
    v = torch.where(m > 0, values, torch.zeros_like(values))
    if mode == "token-mean":
        return (v * m).sum() / m.sum().clamp(min=1.0)
    seq_tokens = m.sum(dim=1)
    seq_sum = (v * m).sum(dim=1)
    if mode == "seq-mean-token-mean":
        per_seq = seq_sum / seq_tokens.clamp(min=1.0)
    elif mode == "seq-mean-token-sum":
        per_seq = seq_sum
    else:
        raise ValueError(
            f"loss_agg: expected 'token-mean', 'seq-mean-token-mean' or "
            f"'seq-mean-token-sum', got {mode!r}"
        )
    has_tokens = (seq_tokens > 0).float()
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


def compute_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    loss_agg: LossAgg = "token-mean",
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
) -> tuple[Tensor, dict[str, float]]:
    """PPO/GRPO clipped surrogate with an optional KL penalty in the loss.

    Inputs: ``logprobs`` [S, C] (current policy, carries the gradient), ``old_logprobs``
    [S, C] (the policy that generated the tokens), ``advantages`` [S] (one per sample,
    broadcast over its tokens), ``mask`` [S, C] bool or float, ``ref_logprobs`` [S, C].
    Per token, with ``ratio = exp(logp - old_logp)``:
        loss = -min(ratio * A, clip(ratio, 1 - low, 1 + high) * A) + kl_coef * kl
    aggregated by ``aggregate_loss(.., loss_agg)``. Returns (scalar loss, metrics):
    ``pg_loss`` (surrogate part, same aggregation), ``kl`` (token mean, 0 without a
    reference), ``clip_frac`` (fraction of valid tokens where the clipped branch is the
    one taken), ``ratio_mean`` and ``ratio_max`` over valid tokens.
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must share the shape [S, C]"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages: expected shape [{logprobs.shape[0]}], got {tuple(advantages.shape)}"
        )
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference stage's output)")

    m = _as_float_mask(mask, logprobs)
    valid = m > 0
    logp = _zero_where_invalid(logprobs, valid)
    old = _zero_where_invalid(old_logprobs, valid)

    log_ratio = (logp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    pg_tokens = torch.maximum(unclipped, clipped)  # = -min(ratio*A, clip(ratio)*A)

    loss_tokens = pg_tokens
    kl_value = 0.0
    if ref_logprobs is not None:  # the kl metric is reported even when kl_coef is 0
        ref = _zero_where_invalid(ref_logprobs, valid)
        kl_tokens = compute_kl(logp, ref, kl_estimator)
        kl_value = _masked_mean(kl_tokens.detach(), m)
        if kl_coef > 0:
            loss_tokens = pg_tokens + kl_coef * kl_tokens

    loss = aggregate_loss(loss_tokens, m, loss_agg)
    with torch.no_grad():
        n_valid = m.sum()
        metrics = {
            "pg_loss": float(aggregate_loss(pg_tokens.detach(), m, loss_agg)),
            "kl": kl_value,
            "clip_frac": _masked_mean((clipped > unclipped).float(), m),
            "ratio_mean": _masked_mean(ratio.detach(), m),
            "ratio_max": float(ratio.detach()[valid].max()) if n_valid > 0 else 0.0,
        }
    return loss, metrics


def compute_token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-prob of each next token: ``logits`` [S, L, V], ``input_ids`` [S, L] -> [S, L-1].

    Entry ``[s, t]`` is ``log p(input_ids[s, t+1] | input_ids[s, :t+1])`` under
    ``softmax(logits / temperature)``: the same distribution the sampler drew from, so
    these match the behaviour log-probs of a rollout at that temperature. Computed in
    float32 whatever the logits' dtype.
    """
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)} must share [S, L]"
        )
    scaled = logits[:, :-1, :].float()
    if temperature != 1.0:
        scaled = scaled / temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    targets = input_ids[:, 1:].long().unsqueeze(-1)
    return log_probs.gather(-1, targets).squeeze(-1)


def _as_float_mask(mask: Tensor, like: Tensor) -> Tensor:
    return mask.to(dtype=like.dtype if like.is_floating_point() else torch.float32)


def _zero_where_invalid(x: Tensor, valid: Tensor) -> Tensor:
    # where (not multiplication): inf * 0 is NaN, and where's backward sends exactly 0
    # to the positions it did not select.
    return torch.where(valid, x, torch.zeros_like(x))


def _masked_mean(x: Tensor, m: Tensor) -> float:
    return float((torch.where(m > 0, x, torch.zeros_like(x)) * m).sum() / m.sum().clamp(min=1.0))
