"""DPO (Rafailov et al. 2023, arXiv 2305.18290) on preference pairs, offline: no
advantage; the loss compares each pair's log-ratios to the reference."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import torch
from msgspec import Meta
from torch import Tensor

from pipeline.config import AlgorithmFields, ConfigError, ConveyorConfig, NonNegFloat, PosFloat
from stages.algorithms.losses import zero_where_invalid
from stages.algorithms.registry import register_algorithm


class DpoConfig(AlgorithmFields, tag="dpo"):
    """DPO (Rafailov et al. 2023) on preference pairs from ``data.pairs``, offline: the
    loss is ``-(1 - label_smoothing) * logsigmoid(beta * m) - label_smoothing *
    logsigmoid(-beta * m)`` per pair, with ``m`` the chosen-minus-rejected log-ratio of
    the policy to the reference (``stages/algorithms/dpo.py``); the mean over pairs
    (``loss_agg: seq-mean-token-mean``). A pair is two samples (``rollout.n: 2``). The
    loss has no KL term (``beta`` bounds the move from the reference): ``kl_coef`` must
    stay 0 (``check`` refuses more)."""

    beta: PosFloat = 0.1
    label_smoothing: Annotated[float, Meta(ge=0, lt=0.5)] = 0.0
    kl_coef: NonNegFloat = 0.0
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                      "seq-mean-token-sum-norm"] = "seq-mean-token-mean"
    group_baseline: ClassVar[bool] = False
    offline: ClassVar[bool] = True

    def check(self, cfg: ConveyorConfig) -> None:
        """Pairs over a data file, two samples a pair, the reference on, the pair mean as the loss."""
        data = cfg.data
        if not data.path:
            raise ConfigError("data.pairs: expected data.path (rows with prompt, chosen and rejected), got a task")
        if data.curriculum is not None:
            raise ConfigError("data.curriculum: not available with data.pairs (a curriculum follows rewards)")
        if cfg.rollout.n != 2:
            raise ConfigError(f"rollout.n: expected 2 with algorithm.name dpo (a pair is two samples), "
                              f"got {cfg.rollout.n}")
        if cfg.reference.enabled == "off":
            raise ConfigError("reference.enabled: dpo needs the reference log-probs, got 'off'")
        if self.loss_agg != "seq-mean-token-mean":
            raise ConfigError(f"algorithm.loss_agg: dpo's loss is a mean over pairs; expected "
                              f"'seq-mean-token-mean', got {self.loss_agg!r}")
        if self.kl_coef > 0:  # compute_dpo_loss has no KL term: a coefficient would be silently ignored
            raise ConfigError(f"algorithm.kl_coef: dpo's loss has no KL term (algorithm.beta sets how far the "
                              f"policy may move from the reference); expected 0, got {self.kl_coef:g}")
        if cfg.reward.sources:
            raise ConfigError("reward.sources: dpo trains on preference pairs, not on rewards; remove reward.sources")


def compute_dpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    ref_logprobs: Tensor | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    **_: object,
) -> tuple[Tensor, dict[str, float]]:
    """DPO's loss over preference pairs (Rafailov et al. 2023; conservative DPO with
    ``label_smoothing``), the mean over pairs.

    Rows come in pairs: row ``2i`` is pair i's chosen response, row ``2i + 1`` its
    rejected one. ``logprobs`` (carries the gradient), ``ref_logprobs``, ``mask`` [S, C];
    ``old_logprobs`` and ``advantages`` are unused (no sampler, no advantage). With the
    summed log-prob of each response, policy ``l`` and reference ``r``, the implicit
    rewards are ``beta * (l - r)`` and per pair ``m = beta * ((l_c - r_c) - (l_r - r_r))``:
    ``loss = -(1 - ls) * logsigmoid(m) - ls * logsigmoid(-m)``.
    Metrics: ``preference_accuracy`` (pairs whose chosen reward is strictly above the
    rejected one; 0 while the policy equals the reference), ``reward_margin``,
    ``chosen_reward``, ``rejected_reward`` (means over pairs).
    """
    if ref_logprobs is None:
        raise ValueError("dpo: needs reference log-probs (is the reference stage wired?)")
    if logprobs.shape[0] % 2:
        raise ValueError(f"dpo: expected rows in (chosen, rejected) pairs, got {logprobs.shape[0]} rows")
    valid = mask > 0
    seq = zero_where_invalid(logprobs, valid).sum(dim=1)
    ref_seq = zero_where_invalid(ref_logprobs.to(seq.dtype), valid).sum(dim=1)
    rewards = beta * (seq - ref_seq)
    chosen, rejected = rewards[0::2], rewards[1::2]
    margin = chosen - rejected
    loss = (-(1.0 - label_smoothing) * torch.nn.functional.logsigmoid(margin)
            - label_smoothing * torch.nn.functional.logsigmoid(-margin)).mean()
    m = margin.detach()
    return loss, {
        "preference_accuracy": float((m > 0).float().mean()),
        "reward_margin": float(m.mean()),
        "chosen_reward": float(chosen.detach().mean()),
        "rejected_reward": float(rejected.detach().mean()),
    }


@register_algorithm(DpoConfig, loss=compute_dpo_loss, loss_options=("beta", "label_smoothing"))
def estimate_none(rewards: Tensor, mask: Tensor, group_size: int, cfg: DpoConfig, penalty: Tensor | None) -> Tensor:
    return torch.zeros(mask.shape)
