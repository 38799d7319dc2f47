"""GAE as the registry's ``ppo`` estimator: per-token advantages and returns, token-level
KL in the reward, whitening options (stages/algorithms/advantages.py, registry.py)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from stages.algorithms import assign_advantages, compute_gae_advantages, compute_token_rewards, whiten_masked
from stages.algorithms.ppo import PpoConfig
from tests.unit.test_admission import make_batch

# Two samples: A has 3 valid tokens, B 2 (its third position is padding holding junk).
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
VALUES = torch.tensor([[0.5, 0.6, 0.7], [1.0, 0.5, 9.0]])
SCORES = torch.tensor([1.0, 2.0])


def test_token_rewards_put_the_score_on_the_last_valid_token_and_the_penalty_on_every_token():
    penalty = torch.full((2, 3), 0.1)
    got = compute_token_rewards(SCORES, MASK, penalty)
    # A: [-0.1, -0.1, 1 - 0.1]; B: [-0.1, 2 - 0.1, 0 (padding)]
    want = torch.tensor([[-0.1, -0.1, 0.9], [-0.1, 1.9, 0.0]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)
    # A sample with no valid token gets nothing.
    empty = compute_token_rewards(torch.tensor([5.0]), torch.zeros(1, 2, dtype=torch.bool))
    assert torch.equal(empty, torch.zeros(1, 2))


def test_gae_hand_derived():
    adv, ret = compute_gae_advantages(compute_token_rewards(SCORES, MASK), VALUES, MASK, gamma=1.0, lam=0.5)
    # A: r = [0, 0, 1], V = [0.5, 0.6, 0.7], V after the last token = 0.
    #   t2: delta = 1 - 0.7 = 0.3;          A2 = 0.3
    #   t1: delta = 0.7 - 0.6 = 0.1;        A1 = 0.1 + 0.5 * 0.3  = 0.25
    #   t0: delta = 0.6 - 0.5 = 0.1;        A0 = 0.1 + 0.5 * 0.25 = 0.225
    #   returns = A + V = [0.725, 0.85, 1.0]
    # B: r = [0, 2], V = [1.0, 0.5] (the padded 9.0 never enters)
    #   t1: delta = 2 - 0.5 = 1.5;          A1 = 1.5
    #   t0: delta = 0.5 - 1.0 = -0.5;       A0 = -0.5 + 0.5 * 1.5 = 0.25
    #   returns = [1.25, 2.0]
    torch.testing.assert_close(adv, torch.tensor([[0.225, 0.25, 0.3], [0.25, 1.5, 0.0]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(ret, torch.tensor([[0.725, 0.85, 1.0], [1.25, 2.0, 0.0]]), rtol=0, atol=1e-6)


def test_gae_with_lambda_one_gives_discounted_returns_minus_values():
    adv, ret = compute_gae_advantages(compute_token_rewards(SCORES, MASK), VALUES, MASK, gamma=0.9, lam=1.0)
    # lam = 1: returns are the Monte Carlo returns. B: [0.9 * 2, 2] = [1.8, 2.0];
    # A: [0.81, 0.9, 1.0]; advantages = returns - V: B [0.8, 1.5], A [0.31, 0.3, 0.3].
    torch.testing.assert_close(ret, torch.tensor([[0.81, 0.9, 1.0], [1.8, 2.0, 0.0]]), rtol=0, atol=1e-6)
    torch.testing.assert_close(adv, torch.tensor([[0.31, 0.3, 0.3], [0.8, 1.5, 0.0]]), rtol=0, atol=1e-6)


def _with_values(batch, values):
    return msgspec.structs.replace(batch, values=np.asarray(values, dtype=np.float32))


def test_ppo_entry_sets_advantages_and_returns_with_token_level_kl_in_reward():
    # make_batch(1 group of 2): rewards [0, 1], completion lens [1, 2], behaviour
    # log-probs -0.01 (row 0) and -0.02 (row 1), reference -0.5 on every token.
    batch = _with_values(make_batch(num_groups=1, group_size=2), np.zeros((2, 2)))
    cfg = PpoConfig(gamma=1.0, lam=1.0, adv_whiten="none", use_kl_in_reward=True, kl_penalty="k1")
    out = assign_advantages(batch, cfg, kl_reward_coef=0.5)
    # k1 per token = behaviour - ref: 0.49 (row 0), 0.48 (row 1); x 0.5 -> 0.245, 0.24.
    # row 0 (1 token): r = [0 - 0.245] -> A = returns = [-0.245]
    # row 1 (2 tokens): r = [-0.24, 1 - 0.24] -> A = returns = [0.52, 0.76] (V = 0)
    want = np.array([[-0.245, 0.0], [0.52, 0.76]], dtype=np.float32)
    np.testing.assert_allclose(out.advantages, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(out.returns, want, rtol=0, atol=1e-6)
    assert batch.returns is None and out.returns.dtype == np.float32  # a new value


@pytest.mark.parametrize("mode", ["whiten", "scale"])
def test_whitening_options_change_advantages_not_returns(mode):
    batch = _with_values(make_batch(num_groups=2, group_size=2), np.full((4, 4), 0.25))
    raw = assign_advantages(batch, PpoConfig(adv_whiten="none"))
    out = assign_advantages(batch, PpoConfig(adv_whiten=mode))
    np.testing.assert_array_equal(out.returns, raw.returns)
    valid = out.loss_mask
    x, y = raw.advantages[valid].astype(np.float64), out.advantages[valid].astype(np.float64)
    assert np.all(out.advantages[~valid] == 0)
    # Unit (unbiased) std over the valid tokens either way; "whiten" centres on 0,
    # "scale" keeps the raw mean.
    assert np.std(y, ddof=1) == pytest.approx(1.0, abs=1e-5)
    assert np.mean(y) == pytest.approx(0.0 if mode == "whiten" else np.mean(x), abs=1e-5)
    torch.testing.assert_close(torch.as_tensor(out.advantages),
                               whiten_masked(torch.as_tensor(raw.advantages), torch.as_tensor(valid),
                                             shift_mean=mode == "whiten"))


def test_ppo_without_values_names_the_batch_and_the_missing_stage():
    with pytest.raises(ValueError, match=r"batch 7: algorithm 'ppo' needs critic values"):
        assign_advantages(make_batch(), PpoConfig())
    with pytest.raises(ValueError, match=r"values: expected shape \(8, 4\)"):
        assign_advantages(_with_values(make_batch(), np.zeros((8, 3))), PpoConfig())
