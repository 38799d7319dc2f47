"""The algorithm registry: one entry per ``algorithm.name``, made by ``register_algorithm``.

Guarantees:
- An algorithm is one module of this package: its config struct (an
  ``AlgorithmFields`` subclass, tag = its name, its flags as class variables) and its
  estimator, decorated with ``@register_algorithm(TheConfig, ...)``, which registers both
  the config (``pipeline.config.register_algorithm_config``) and the entry here, so
  ``ALGORITHMS``' keys are exactly ``pipeline.config.ALGORITHM_NAMES``. The package
  imports every module in it (``stages/algorithms/__init__.py``).
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

from pipeline.config import AlgorithmFields, register_algorithm_config
from pipeline.types import RolloutBatch
from stages.algorithms.advantages import compute_whiten_stats, whiten_masked
from stages.algorithms.losses import compute_kl, compute_policy_loss

# (rewards [S], loss mask [S, C] bool, group_size, algorithm config, per-token reward
# penalty [S, C] or None) -> advantages [S, C]
Estimator = Callable[[Tensor, Tensor, int, Any, Tensor | None], Tensor]
# (rewards [S], critic values [S, C], loss mask [S, C] bool, algorithm config, per-token
# reward penalty [S, C] or None) -> (advantages [S, C], returns [S, C])
ValueEstimator = Callable[[Tensor, Tensor, Tensor, Any, Tensor | None], tuple[Tensor, Tensor]]


# The config fields ``compute_policy_loss`` reads (``build_policy_loss`` binds them).
POLICY_LOSS_OPTIONS = ("clip_eps_low", "clip_eps_high", "clip_ratio_c", "loss_agg", "loss_norm_tokens",
                       "kl_estimator", "off_policy", "behav_imp_weight_cap", "ratio_level")


@dataclass(frozen=True)
class Algorithm:
    """One registry entry. Its needs are its config's class variables, declared once there:
    ``needs_group`` (``group_baseline``: advantages compare the samples of a prompt,
    ``rollout.n >= 2``), ``needs_values`` (``needs_critic``: ``estimate`` takes the critic's
    per-token values and also gives its returns, a ``ValueEstimator``), ``needs_reference``
    (``offline``: the loss reads reference log-probs beyond the KL term, as ``dpo``'s)."""

    name: str
    config: type[AlgorithmFields]
    estimate: Estimator | ValueEstimator
    loss: Callable[..., tuple[Tensor, dict[str, float]]] = compute_policy_loss
    # The config fields bound into ``loss`` (``build_policy_loss``).
    loss_options: tuple[str, ...] = POLICY_LOSS_OPTIONS
    # The estimate is whitened over the valid tokens of the whole step (REINFORCE++, as
    # verl whitens over its train batch): ``estimate`` returns it unwhitened and
    # ``assign_step_advantages`` whitens with the statistics of every micro-batch of the step.
    whitens_step: bool = False

    @property
    def needs_group(self) -> bool:
        return self.config.group_baseline

    @property
    def needs_values(self) -> bool:
        return self.config.needs_critic

    @property
    def needs_reference(self) -> bool:
        return self.config.offline


ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(config: type[AlgorithmFields], *, loss: Callable[..., tuple[Tensor, dict[str, float]]]
                       = compute_policy_loss, loss_options: tuple[str, ...] = POLICY_LOSS_OPTIONS,
                       whitens_step: bool = False) -> Callable[[Any], Any]:
    """Decorator of an estimator: registers ``config`` (decodable as ``algorithm.name:
    <its tag>``) and the entry ``Algorithm(tag, config, estimator, loss, ...)``."""

    def wrap(estimate: Any) -> Any:
        register_algorithm_config(config)
        name = str(config.__struct_config__.tag)
        ALGORITHMS[name] = Algorithm(name, config, estimate, loss, loss_options, whitens_step)
        return estimate

    return wrap


def per_sample(adv: Tensor, mask: Tensor) -> Tensor:
    """Advantages [S] broadcast to each sample's valid tokens: [S, C], 0 outside ``mask``."""
    return torch.where(mask, adv.unsqueeze(1).expand(mask.shape), torch.zeros(mask.shape))


def outcome_scores(rewards: Tensor, mask: Tensor, penalty: Tensor | None) -> Tensor:
    """One number per sample for an outcome estimator: the score minus the sample's summed
    per-token penalty (verl sums token-level rewards the same way)."""
    if penalty is None:
        return rewards
    return rewards - torch.where(mask, penalty, torch.zeros_like(penalty)).sum(dim=1)


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
    filtering). An entry that ``needs_values`` (``ppo``) reads ``batch.values``
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
    if not algo.needs_values:
        return batch, algo.estimate(rewards, mask, batch.group_size, cfg, penalty), mask, None
    if batch.values is None:
        raise ValueError(f"batch {batch.batch_id}: algorithm {cfg.name!r} needs critic values [S, C] "
                         f"(is a critic stage wired before the trainer?)")
    values = torch.as_tensor(np.asarray(batch.values, dtype=np.float32))
    if values.shape != mask.shape:
        raise ValueError(f"batch {batch.batch_id}: values: expected shape {tuple(mask.shape)} (samples, completion "
                         f"positions), got {tuple(values.shape)}")
    adv, ret = algo.estimate(rewards, values, mask, cfg, penalty)
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
