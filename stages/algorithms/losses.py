"""Losses as pure torch functions: KL estimators, aggregation, the clipped policy loss,
the critic's clipped value loss (an algorithm's own loss lives in its module, as ``dpo``'s).

Guarantees:
- No state, no I/O, no device placement: every function maps tensors to tensors (and
  floats for metrics), so each is unit-tested on CPU with hand-derived numbers.
- Shapes: S samples, C completion positions.
- Token positions where ``mask`` is 0 contribute nothing to a loss, a gradient or a
  metric, even when the log-probs there are garbage (padding, ``-inf``, NaN): they are
  replaced by zeros before any arithmetic, so no ``inf * 0`` NaN can leak through the
  forward or the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from stages.algorithms.aggregation import get_loss_aggregation

KLEstimator = Literal["k1", "k2", "k3", "k1+", "k3+"]
RatioLevel = Literal["token", "sequence"]
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
OffPolicy = Literal["off", "truncate", "reject"]

# exp(20) ~ 4.9e8: far beyond any ratio a healthy run produces, far below float32
# overflow (exp(88.7)). Without the clamp one bad token (e.g. a log-prob of -80 under
# the reference) turns k3 or the ratio into inf and the whole step's gradient into NaN.
LOG_RATIO_CLAMP = 20.0
# verl's bound on the k3 value: beyond it a token adds a constant and no gradient.
KL_VALUE_CLAMP = 10.0


def compute_kl(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens.

    ``logprobs``, ``ref_logprobs`` [S, C] -> [S, C]. With ``d = ref - logp`` (clamped to
    +-LOG_RATIO_CLAMP): k1 = ``-d`` (unbiased, can be negative; its expected gradient is
    0, so as a loss term it only adds noise); k2 = ``d**2 / 2`` (biased, its gradient is
    the KL's); k3 = ``exp(d) - d - 1`` (Schulman's estimator: unbiased and >= 0), clamped
    to +-KL_VALUE_CLAMP as verl does: a token far from the reference contributes at most
    10 and no gradient, instead of up to ``kl_coef * e**20``.
    Straight-through forms (verl's ``k3+`` / ``low_var_kl+``, arXiv 2505.17508): ``k3+``
    has k3's value (low variance, >= 0) and k2's gradient ``logp - ref`` (the KL's);
    ``k1+`` has k1's value and k2's gradient. Written ``g - g.detach() + v.detach()``.
    """
    if estimator.endswith("+"):
        value = compute_kl(logprobs, ref_logprobs, estimator[:-1]).detach()  # type: ignore[arg-type]
        grad = compute_kl(logprobs, ref_logprobs, "k2")
        return grad - grad.detach() + value
    log_ratio = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)
    raise ValueError(f"kl_estimator: expected 'k1', 'k2', 'k3', 'k1+' or 'k3+', got {estimator!r}")


def aggregate_loss(values: Tensor, mask: Tensor, mode: LossAgg, norm_tokens: int | None = None) -> Tensor:
    """Reduce per-token values [S, C] to a scalar over the positions where ``mask`` is set,
    by the mode's class (``stages/algorithms/aggregation.py``):

    - ``token-mean``: sum over all valid tokens / number of valid tokens (every token
      weighs the same; long answers weigh more).
    - ``seq-mean-token-mean``: mean over tokens inside each sequence, then mean over
      sequences (every sequence weighs the same).
    - ``seq-mean-token-sum``: sum over tokens inside each sequence, then mean over
      sequences.
    - ``seq-mean-token-sum-norm``: sum over all valid tokens / (S * ``norm_tokens``), a
      constant normaliser (Dr. GRPO; ``norm_tokens`` is usually the longest completion
      the rollout may produce). Every row counts in S, empty or not.
    Sequence means run over sequences with at least one valid token; with no valid token
    at all the result is 0 (still attached to the graph, so ``backward`` works).
    """
    m = _as_float_mask(mask, values)
    v = torch.where(m > 0, values, torch.zeros_like(values))
    return get_loss_aggregation(mode).reduce(v, m, norm_tokens)


RATIO_LEVELS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {}
OFF_POLICY_CORRECTIONS: dict[str, OffPolicyCorrection] = {}


def register_ratio_level(name: str) -> Callable[[Any], Any]:
    """A ``ratio_level``: ``(logp, log_ratio, mask) -> the log-ratio each token is clipped by``
    (all [S, C]; ``log_ratio = logp - anchor``)."""

    def wrap(fn: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        RATIO_LEVELS[name] = fn
        return fn

    return wrap


@register_ratio_level("token")
def token_log_ratio(logp: Tensor, log_ratio: Tensor, m: Tensor) -> Tensor:
    """PPO / GRPO: one ratio per token."""
    return log_ratio


@register_ratio_level("sequence")
def sequence_log_ratio(logp: Tensor, log_ratio: Tensor, m: Tensor) -> Tensor:
    """GSPO (arXiv 2507.18071): every token of a sample carries the mean of its valid
    tokens' log-ratios, with the token's own gradient (straight-through, GSPO-token)."""
    seq_log_ratio = (log_ratio * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1.0)
    return logp - logp.detach() + seq_log_ratio.detach()


@dataclass(frozen=True)
class OffPolicyCorrection:
    """An ``off_policy`` mode. ``decoupled``: the ratio is anchored on the proximal policy
    (``prox_logprobs``, else the current weights detached), not on the sampler's log-probs;
    ``weigh``: ``(importance weight anchor / behaviour, cap) -> each token's factor``, or None."""

    decoupled: bool
    weigh: Callable[[Tensor, float], Tensor] | None = None


def register_off_policy(name: str, decoupled: bool = True) -> Callable[[Any], Any]:
    """Decorator of an importance-weight rule: registers the ``off_policy`` mode ``name``."""

    def wrap(weigh: Callable[[Tensor, float], Tensor]) -> Callable[[Tensor, float], Tensor]:
        OFF_POLICY_CORRECTIONS[name] = OffPolicyCorrection(decoupled, weigh)
        return weigh

    return wrap


OFF_POLICY_CORRECTIONS["off"] = OffPolicyCorrection(decoupled=False)  # PPO against the sampler


@register_off_policy("truncate")
def truncate_weight(is_weight: Tensor, cap: float) -> Tensor:
    """Truncated importance sampling: ``min(iw, cap)``."""
    return is_weight.clamp(max=cap)


@register_off_policy("reject")
def reject_weight(is_weight: Tensor, cap: float) -> Tensor:
    """``iw`` where ``iw <= cap``, 0 elsewhere (the token still counts in the normaliser)."""
    return torch.where(is_weight <= cap, is_weight, torch.zeros_like(is_weight))


def _pick(registry: dict[str, Any], name: str, field: str) -> Any:
    if name not in registry:
        names = [repr(k) for k in registry]
        raise ValueError(f"{field}: expected {', '.join(names[:-1])} or {names[-1]}, got {name!r}")
    return registry[name]


def _check_policy_inputs(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                         ref_logprobs: Tensor | None, kl_coef: float, clip_ratio_c: float | None) -> None:
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} "
            f"and mask {tuple(mask.shape)} must share the shape [S, C]"
        )
    if advantages.shape not in (logprobs.shape, logprobs.shape[:1]):
        raise ValueError(
            f"advantages: expected shape {tuple(logprobs.shape)} or [{logprobs.shape[0]}], "
            f"got {tuple(advantages.shape)}"
        )
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (the reference stage's output)")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c: expected > 1 (or None), got {clip_ratio_c}")


def clip_surrogate(adv: Tensor, ratio: Tensor, low: float, high: float,
                   clip_ratio_c: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """PPO's clipped surrogate per token, ``-min(ratio * A, clip(ratio, 1 - low, 1 + high) * A)``,
    bounded by ``-A * clip_ratio_c`` where ``A < 0`` (dual clip; None: off). Returns
    (per-token loss, clipped branch taken, dual clip binds), all [S, C]."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    pg_tokens = torch.maximum(unclipped, clipped)  # = -min(ratio*A, clip(ratio)*A)
    took_clip = clipped > unclipped
    dual_binds = torch.zeros_like(took_clip)
    if clip_ratio_c is not None:
        dual = -adv * clip_ratio_c
        dual_binds = (adv < 0) & (pg_tokens > dual)
        pg_tokens = torch.where(dual_binds, dual, pg_tokens)
    return pg_tokens, took_clip, dual_binds


def compute_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg: LossAgg = "token-mean",
    loss_norm_tokens: int | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    off_policy: OffPolicy = "off",
    behav_imp_weight_cap: float = 2.0,
    fresh_mask: Tensor | None = None,
    ratio_level: RatioLevel = "token",
    prox_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with dual-clip, optional off-policy correction and KL penalty.

    Inputs: ``logprobs`` [S, C] (current policy, carries the gradient), ``old_logprobs``
    [S, C] (behaviour: the policy that generated the tokens; NaN where the sampler reported
    none, ``rollout.logprobs: false``, on-policy only: ``logprobs`` detached stands in), ``advantages`` [S, C] per
    token (or [S], broadcast over the sample's tokens), ``mask`` [S, C] bool or float,
    ``ref_logprobs`` [S, C]. Per token, with ``ratio = exp(logp - anchor)``:
        pg = -min(ratio * A, clip(ratio, 1 - low, 1 + high) * A)
        pg = min(pg, -A * clip_ratio_c)   where A < 0  (dual-clip; None: off)
        loss = w * pg + kl_coef * kl
    ``off_policy`` (``OFF_POLICY_CORRECTIONS``, registered rules):
    - ``off``: anchor = behaviour log-probs, ``w = 1`` (PPO against the sampler).
    - ``truncate`` / ``reject`` (AReaL's decoupled objective): the anchor is the proximal
      policy ``prox_logprobs`` [S, C] (detached), the weights that first scored the
      sample in this step: None (the first pass over it) means the current weights, so
      the ratio is 1 there; PPO's later epochs pass the first pass's log-probs, so the
      ratio measures the drift since and the clip bounds it (verl, TRL and AReaL hold
      the old log-probs fixed the same way). The staleness is corrected by the
      importance weight ``iw = prox / behaviour`` (detached): ``truncate`` uses
      ``w = min(iw, cap)`` (TIS), ``reject`` uses ``w = iw`` where ``iw <= cap`` and 0
      elsewhere (the token still counts in the normaliser).
    ``ratio_level`` (``RATIO_LEVELS``, registered functions): ``token`` (PPO / GRPO: one ratio per token) or ``sequence`` (GSPO,
    arXiv 2507.18071): every token of sample i carries the sequence ratio
    ``s_i = exp(mean over its valid tokens of (logp - anchor))``, the geometric mean of
    its token ratios, so clipping (and dual-clip) decides per sequence; its gradient is
    straight-through per token (GSPO-token: ``logp - logp.detach() + log s_i.detach()``),
    so under ``seq-mean-token-mean`` (the paper's aggregation) a token's gradient is
    ``-A_i * s_i / |y_i|`` over the sequences, exactly the sequence objective's.
    Aggregated by ``aggregate_loss(.., loss_agg, loss_norm_tokens)``. Returns (scalar
    loss, metrics), each over valid tokens: ``pg_loss`` (surrogate, same aggregation),
    ``kl`` (token mean, 0 without a reference), ``clip_frac`` (clipped branch taken),
    ``clip_frac_upper`` (taken with A > 0: ratio above 1 + high), ``clip_frac_lower``
    (taken with A < 0: ratio below 1 - low), ``clip_frac_dual`` (dual clip binds),
    ``ratio_mean``, ``ratio_max``, ``is_weight_mean``, ``is_weight_max`` (of ``iw``) and
    ``is_weight_capped_frac`` (``iw > cap``, whether or not a correction is on) and
    ``logp_mismatch`` (mean ``|logp - behaviour|`` over the valid tokens where
    ``fresh_mask`` [S, C] is set: tokens sampled by the very weights being trained, where
    any difference is sampler-vs-trainer numerics, not staleness; tokens without a
    sampler log-prob are not such tokens) with ``logp_mismatch_tokens``, their count:
    both absent when there is none (a 0 would read as a perfect match).
    """
    _check_policy_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, kl_coef, clip_ratio_c)
    correction = _pick(OFF_POLICY_CORRECTIONS, off_policy, "off_policy")
    to_ratio_level = _pick(RATIO_LEVELS, ratio_level, "ratio_level")

    m = _as_float_mask(mask, logprobs)
    valid = m > 0
    logp = zero_where_invalid(logprobs, valid)
    behaviour = zero_where_invalid(old_logprobs, valid)
    # NaN: the sampler did not report the token's log-prob (rollout.logprobs: false,
    # allowed only on-policy): the weights being trained sampled it, so their own
    # log-prob, detached, is the behaviour policy's.
    unreported = torch.isnan(behaviour)
    behaviour = torch.where(unreported, logp.detach().to(behaviour.dtype), behaviour)  # no host sync on the train step
    adv = advantages.to(logp.dtype)
    adv = zero_where_invalid(adv.unsqueeze(1).expand_as(logp) if adv.dim() == 1 else adv, valid)

    anchor = behaviour if not correction.decoupled else logp.detach()
    if correction.decoupled and prox_logprobs is not None:
        anchor = zero_where_invalid(prox_logprobs.to(logp.dtype), valid).detach()
    log_ratio = to_ratio_level(logp, logp - anchor, m)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    pg_tokens, took_clip, dual_binds = clip_surrogate(adv, ratio, clip_eps_low, clip_eps_high, clip_ratio_c)

    with torch.no_grad():
        weighed = anchor if correction.decoupled else logp.detach()
        is_weight = torch.exp((weighed - behaviour).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if correction.weigh is not None:
        pg_tokens = pg_tokens * correction.weigh(is_weight, behav_imp_weight_cap)

    loss_tokens = pg_tokens
    kl_value = 0.0
    if ref_logprobs is not None:  # the kl metric is reported even when kl_coef is 0
        ref = zero_where_invalid(ref_logprobs, valid)
        kl_tokens = compute_kl(logp, ref, kl_estimator)
        kl_value = _masked_mean(kl_tokens.detach(), m)
        if kl_coef > 0:
            loss_tokens = pg_tokens + kl_coef * kl_tokens

    loss = aggregate_loss(loss_tokens, m, loss_agg, loss_norm_tokens)
    with torch.no_grad():
        n_valid = m.sum()
        metrics = {
            "pg_loss": float(aggregate_loss(pg_tokens.detach(), m, loss_agg, loss_norm_tokens)),
            "kl": kl_value,
            "clip_frac": _masked_mean(took_clip.float(), m),
            "clip_frac_upper": _masked_mean((took_clip & (adv > 0)).float(), m),
            "clip_frac_lower": _masked_mean((took_clip & (adv < 0)).float(), m),
            "clip_frac_dual": _masked_mean(dual_binds.float(), m),
            "ratio_mean": _masked_mean(ratio.detach(), m),
            "ratio_max": float(ratio.detach()[valid].max()) if n_valid > 0 else 0.0,
            "is_weight_mean": _masked_mean(is_weight, m),
            "is_weight_max": float(is_weight[valid].max()) if n_valid > 0 else 0.0,
            "is_weight_capped_frac": _masked_mean((is_weight > behav_imp_weight_cap).float(), m),
        }
        if fresh_mask is not None:
            fresh = m * _as_float_mask(fresh_mask, m) * (~unreported).to(m.dtype)
            if fresh.sum() > 0:
                metrics["logp_mismatch"] = _masked_mean((logp.detach() - behaviour).abs(), fresh)
                metrics["logp_mismatch_tokens"] = float(fresh.sum())
    return loss, metrics


def compute_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_eps: float | None = 0.5,
) -> tuple[Tensor, dict[str, float]]:
    """The critic's loss (PPO's clipped value loss, as verl and OpenRLHF):
    ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with ``V_clip = V_old + clip(V - V_old, ±clip_eps)``,
    the token mean over ``mask``; ``clip_eps`` None: ``0.5 * (V - R)^2``.

    ``values`` (with grad), ``old_values`` (what the critic predicted when the batch
    arrived), ``returns``, ``mask`` [S, C]. Metrics: ``vf_loss``, ``vf_clip_frac``
    (tokens whose clipped error was the larger), ``value_mean``, ``return_mean``,
    ``value_error`` (mean |V - R|)."""
    m = _as_float_mask(mask, values)
    valid = m > 0
    v = zero_where_invalid(values, valid)
    old = zero_where_invalid(old_values.to(values.dtype), valid)
    ret = zero_where_invalid(returns.to(values.dtype), valid)
    err = (v - ret).square()
    if clip_eps is None:
        per_token, clipped = err, torch.zeros_like(err)
    else:
        v_clip = old + (v - old).clamp(-clip_eps, clip_eps)
        err_clip = (v_clip - ret).square()
        per_token, clipped = torch.maximum(err, err_clip), (err_clip > err).float()
    loss = 0.5 * aggregate_loss(per_token, m, "token-mean")
    return loss, {
        "vf_loss": float(loss.detach()),
        "vf_clip_frac": _masked_mean(clipped, m),
        "value_mean": _masked_mean(v.detach(), m),
        "return_mean": _masked_mean(ret, m),
        "value_error": _masked_mean((v.detach() - ret).abs(), m),
    }


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


def compute_token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy (nats) of ``softmax(logits / temperature)`` at each position:
    ``logits`` [S, L, V] -> [S, L] float32, ``logsumexp(z) - sum(softmax(z) * z)``."""
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def _as_float_mask(mask: Tensor, like: Tensor) -> Tensor:
    return mask.to(dtype=like.dtype if like.is_floating_point() else torch.float32)


def zero_where_invalid(x: Tensor, valid: Tensor) -> Tensor:
    # where (not multiplication): inf * 0 is NaN, and where's backward sends exactly 0
    # to the positions it did not select.
    return torch.where(valid, x, torch.zeros_like(x))


def _masked_mean(x: Tensor, m: Tensor) -> float:
    return float((torch.where(m > 0, x, torch.zeros_like(x)) * m).sum() / m.sum().clamp(min=1.0))
