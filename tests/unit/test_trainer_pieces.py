"""The trainer's rules for a micro-batch trained as several pieces (stages/trainer/stage.py):
piece weights, merged metrics, the recorded layout."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from pipeline.memory.splitting import split_rollout_batch, split_rollout_batch_at
from stages.trainer.pieces import compute_piece_weight, merge_piece_metrics
from stages.trainer.stage import encode_piece_layout, read_piece_layout
from tests.unit.test_admission import make_batch


def test_piece_weights_are_token_or_sequence_shares_and_sum_to_one() -> None:
    batch = make_batch(num_groups=4, group_size=2)
    # completion_lens (i * 5) % 4 + 1 for i = 0..7: 1 2 3 4 1 2 3 4 -> 20 tokens; pieces
    # of 1 + 3 groups hold 1 + 2 = 3 and 17 tokens.
    pieces = split_rollout_batch_at(batch, [1, 3])
    token = [compute_piece_weight(p, batch, "token-mean") for p in pieces]
    assert token == [3 / 20, 17 / 20]
    # Every sample has a completion token: sequence shares are sample shares, 2/8 and 6/8.
    seq = [compute_piece_weight(p, batch, "seq-mean-token-mean") for p in pieces]
    assert seq == [0.25, 0.75]
    assert compute_piece_weight(batch, batch, "token-mean") == 1.0  # whole: exactly the old scale
    halves = split_rollout_batch(batch, 2)
    assert math.fsum(compute_piece_weight(p, batch, "token-mean") for p in halves) == pytest.approx(1.0, abs=1e-15)


def test_piece_weights_fall_back_to_samples_without_tokens() -> None:
    batch = make_batch(num_groups=2, group_size=2)
    empty = msgspec.structs.replace(batch, completion_lens=np.zeros(4, np.int32))
    first, _ = split_rollout_batch(empty, 2)
    assert compute_piece_weight(first, empty, "token-mean") == 0.5
    assert compute_piece_weight(first, empty, "seq-mean-token-sum") == 0.5


def test_merge_piece_metrics_weighs_losses_and_pools_rewards() -> None:
    rewards = [np.array([0.0, 1.0, 1.0]), np.array([0.0, 0.0, 1.0, 1.0, 1.0])]
    pieces = [{"loss": 2.0, "kl": 0.1, "ratio_max": 1.5, "num_samples": float(len(r)), "num_tokens": 10.0,
               "scale": 0.25, "reward_mean": float(r.mean()), "reward_std": float(r.std()),
               "adv_abs_mean": a} for r, a in zip(rewards, (0.3, 0.7), strict=True)]
    pieces[1].update(loss=4.0, kl=0.3, ratio_max=1.2, num_tokens=30.0, scale=0.5)
    out = merge_piece_metrics(pieces, [0.25, 0.75])
    allr = np.concatenate(rewards)
    assert out["loss"] == 0.25 * 2.0 + 0.75 * 4.0  # 3.5
    assert out["kl"] == pytest.approx(0.25 * 0.1 + 0.75 * 0.3, abs=1e-15)
    assert out["ratio_max"] == 1.5
    assert (out["num_samples"], out["num_tokens"], out["scale"]) == (8.0, 40.0, 0.75)
    assert out["reward_mean"] == pytest.approx(allr.mean(), abs=1e-15)  # 5/8
    assert out["reward_std"] == pytest.approx(allr.std(), abs=1e-12)  # pooled, not averaged
    assert out["adv_abs_mean"] == pytest.approx((3 * 0.3 + 5 * 0.7) / 8, abs=1e-15)
    assert merge_piece_metrics(pieces[:1], [1.0]) == pieces[0]


def test_piece_layout_round_trips_through_step_metrics() -> None:
    metrics = {"grad_norm": 1.0, **encode_piece_layout({7: [2, 1, 1], 12: [3, 3]})}
    assert metrics["pieces/7/0"] == 2.0
    assert read_piece_layout(metrics, 7) == [2, 1, 1]
    assert read_piece_layout(metrics, 12) == [3, 3]
    assert read_piece_layout(metrics, 1) is None  # trained whole
    assert read_piece_layout(encode_piece_layout({1: [1] * 12}), 1) == [1] * 12  # keys sort as numbers


def test_logp_mismatch_pools_over_the_pieces_that_measured_it() -> None:
    # Pieces: mismatch 0.1 on 2 fresh tokens, none measured, 0.4 on 1 token ->
    # (0.1 * 2 + 0.4 * 1) / 3 = 0.2 over 3 tokens, whatever the loss weights; with no
    # piece measuring it the merged metrics have no logp_mismatch at all.
    base = {"loss": 1.0, "num_samples": 2.0, "num_tokens": 4.0, "scale": 0.1, "reward_mean": 0.0, "reward_std": 0.0}
    pieces = [{**base, "logp_mismatch": 0.1, "logp_mismatch_tokens": 2.0}, dict(base),
              {**base, "logp_mismatch": 0.4, "logp_mismatch_tokens": 1.0}]
    out = merge_piece_metrics(pieces, [0.5, 0.25, 0.25])
    assert out["logp_mismatch"] == pytest.approx(0.2, abs=1e-15) and out["logp_mismatch_tokens"] == 3.0
    assert "logp_mismatch" not in merge_piece_metrics([dict(base), dict(base)], [0.5, 0.5])


def test_later_epochs_metrics_are_token_weighted() -> None:
    from stages.trainer.ppo import summarise_later_epochs

    # Two micro-batches of the second epoch: ratio 1.1 on 10 tokens, 0.8 on 30 tokens ->
    # (11 + 24) / 40 = 0.875; clip 0.5 and 0.1 -> (5 + 3) / 40 = 0.2. One epoch: nothing.
    out = summarise_later_epochs([{"num_tokens": 10.0, "ratio_mean": 1.1, "clip_frac": 0.5},
                                  {"num_tokens": 30.0, "ratio_mean": 0.8, "clip_frac": 0.1}])
    assert out == pytest.approx({"later_epochs_ratio_mean": 0.875, "later_epochs_clip_frac": 0.2}, abs=1e-12)
    assert summarise_later_epochs([]) == {}
