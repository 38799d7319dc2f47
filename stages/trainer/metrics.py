"""A trainer step's summary metrics from the micro-batches it trained (pure numpy).

Guarantees: functions of the batches only (no engine, no device); a batch without
rewards contributes nothing to the reward figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline.memory.packing import padding_fraction
from pipeline.types import RolloutBatch
from stages.rewards.shaping import find_zero_variance_groups


def summarise_step_batches(batches: list[RolloutBatch], zero_variance_dropped: int = 0) -> dict[str, float]:
    """A step's response and group statistics: completion length mean and max, the
    fraction cut by the length limit (finish reason ``length``), and the fraction of
    groups whose rewards were all equal, counting ``zero_variance_dropped`` groups the
    reward stage dropped for that (so the figure means the same with dropping on or off)."""
    lens = np.concatenate([np.asarray(b.completion_lens) for b in batches])
    reasons = [r for b in batches for r in b.finish_reasons]
    zero = sum(int(find_zero_variance_groups(b.rewards, b.group_size).sum()) for b in batches if b.rewards is not None)
    groups = sum(len(b.prompts) for b in batches) + zero_variance_dropped
    return {
        "response_length/mean": float(lens.mean()) if lens.size else 0.0,
        "response_length/max": int(lens.max()) if lens.size else 0,
        "response_length/truncated_frac": (sum(r == "length" for r in reasons) / len(reasons)) if reasons else 0.0,
        "batch/zero_std_frac": (zero + zero_variance_dropped) / groups if groups else 0.0,
    }


def summarise_batch_rewards(batches: list[RolloutBatch]) -> dict[str, float]:
    rewards = np.concatenate([b.rewards for b in batches if b.rewards is not None] or [np.zeros(0)])
    if rewards.size == 0:
        return {}
    return {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "reward/max": float(rewards.max()), "reward/min": float(rewards.min())}


def mean_per_sample_field(batches: Sequence[RolloutBatch], field: str) -> dict[str, float]:
    """Each key of the batches' per-sample dict ``field`` (``reward_extras``,
    ``rollout_extras``): its mean over the samples with a finite value (NaN: the sample
    gave none); keys without one are left out."""
    values: dict[str, list[float]] = {}
    for batch in batches:
        for key, per_sample in getattr(batch, field).items():
            values.setdefault(key, []).extend(per_sample)
    out = {}
    for key, vals in sorted(values.items()):
        arr = np.asarray(vals, dtype=np.float64)
        arr = arr[np.isfinite(arr)]
        if arr.size:
            out[key] = float(arr.mean())
    return out


def summarise_rollout_extras(batches: list[RolloutBatch]) -> dict[str, float]:
    """The rollout's per-sample numbers as step metrics under their own keys
    (``tool/used``, ``turn/2/tokens``...)."""
    return mean_per_sample_field(batches, "rollout_extras")


# Trainer reward metrics an extra key must not overwrite (it goes to reward/extra/<key>).
_RESERVED_METRICS = ("mean", "std", "max", "min", "errors")


def summarise_reward_extras(batches: Sequence[Any]) -> dict[str, float]:
    """Step metrics from the batches' reward side: ``reward/errors`` (failed samples)
    and ``reward/<key>``, the mean of each extra over the samples that returned it."""
    out = {"reward/errors": float(sum(len(b.reward_errors) for b in batches))}
    for key, mean in mean_per_sample_field(batches, "reward_extras").items():
        out[f"reward/extra/{key}" if key in _RESERVED_METRICS else f"reward/{key}"] = mean
    return out


def summarise_pass_padding(metrics: Sequence[dict[str, float]], prefix: str = "actor") -> dict[str, float]:
    """``<prefix>/padding_fraction`` (padded / computed tokens over the passes the
    micro-batches' metrics count: ``TrainerEngine.train_micro_batch``), the same for chunks
    of ``chunk_size`` consecutive samples (``_unpacked``), ``<prefix>/passes`` and
    ``<prefix>/pass_tokens`` (the tokens they computed, padding included); empty when a
    micro-batch did not count them."""
    keys = ("passes", "pass_real_tokens", "pass_tokens", "pass_tokens_unpacked")
    if not metrics or not all(k in m for m in metrics for k in keys):
        return {}
    real, packed, unpacked, passes = (sum(m[k] for m in metrics) for k in
                                      ("pass_real_tokens", "pass_tokens", "pass_tokens_unpacked", "passes"))
    return {f"{prefix}/padding_fraction": padding_fraction(real, packed),
            f"{prefix}/padding_fraction_unpacked": padding_fraction(real, unpacked), f"{prefix}/passes": passes,
            f"{prefix}/pass_tokens": packed}
