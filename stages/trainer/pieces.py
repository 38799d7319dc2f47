"""A micro-batch trained as several pieces (split for memory, or over data-parallel
ranks): how each piece is weighed and how the pieces' metrics make the micro-batch's.

Guarantees: pure functions of the batches and metrics (no engine, no device); the
pieces' weights sum to 1, so the pieces' weighted losses are the loss of the
micro-batch trained whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pipeline.types import RolloutBatch
from stages.algorithms.aggregation import get_loss_aggregation

# Counts a micro-batch's pieces add up (the passes' token counts: ``TrainerEngine.train_micro_batch``).
SUMMED_METRICS = ("num_samples", "num_tokens", "scale", "passes", "pass_real_tokens", "pass_tokens",
                  "pass_tokens_unpacked")


def compute_piece_weight(piece: RolloutBatch, batch: RolloutBatch, loss_agg: str) -> float:
    """The piece's share of its micro-batch's loss: ``sum(w_k * loss_k)`` over pieces is
    the loss of the micro-batch trained whole (the engine weighs chunks the same way).
    token-mean: its share of loss tokens; seq-mean-token-sum-norm: of samples;
    other seq-mean-*: of samples with at least one loss token. The whole batch weighs
    exactly 1; a batch with no such token or sample falls back to sample shares (its
    loss is 0 anyway)."""
    if piece is batch:
        return 1.0
    return get_loss_aggregation(loss_agg).share(piece, batch)


def merge_piece_metrics(metrics: list[dict[str, float]], weights: list[float]) -> dict[str, float]:
    """One micro-batch's metrics from its pieces': ``*_max`` the max; counts and scales
    (``SUMMED_METRICS``) the sum; reward and advantage statistics pooled over samples; everything else
    (loss, pg_loss, kl, clip_frac, ratio_mean) weighted as the loss is."""
    if len(metrics) == 1:
        return dict(metrics[0])
    n = [m["num_samples"] for m in metrics]
    total = sum(n)

    def pooled(key: str) -> float:
        return sum(m[key] * k for m, k in zip(metrics, n, strict=True)) / total

    out: dict[str, float] = {**pool_logp_mismatch(metrics)}
    for key in metrics[0]:
        if key.startswith("logp_mismatch"):
            continue
        values = [m[key] for m in metrics]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key in SUMMED_METRICS:
            out[key] = sum(values)
        elif key in ("reward_mean", "adv_abs_mean"):
            out[key] = pooled(key)
        elif key != "reward_std":
            out[key] = sum(v * w for v, w in zip(values, weights, strict=True))
    if "reward_std" in metrics[0]:
        mean = pooled("reward_mean")
        second = sum((m["reward_std"] ** 2 + m["reward_mean"] ** 2) * k for m, k in zip(metrics, n, strict=True))
        out["reward_std"] = math.sqrt(max(0.0, second / total - mean**2))
    return out



def pool_logp_mismatch(metrics: list[Mapping[str, float]]) -> dict[str, float]:
    """``logp_mismatch`` over the pieces that measured one, weighted by their
    ``logp_mismatch_tokens`` (summed); empty when none did (no token came from the
    weights being trained: absent, never a 0 that reads as a perfect match)."""
    counted = [(m["logp_mismatch"], m["logp_mismatch_tokens"]) for m in metrics if m.get("logp_mismatch_tokens")]
    tokens = sum(n for _, n in counted)
    if not tokens:
        return {}
    return {"logp_mismatch": sum(v * n for v, n in counted) / tokens, "logp_mismatch_tokens": tokens}
