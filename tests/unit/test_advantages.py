"""Advantage estimators (stages/algorithms/advantages.py): numbers derived by hand in the
comment above each assertion."""

import pytest
import torch

from stages.algorithms import (
    compute_discounted_returns,
    compute_gae_advantages,
    compute_reinforce_pp_advantages,
    compute_reinforce_pp_baseline_advantages,
    compute_rloo_advantages,
    whiten_masked,
)


def test_rloo_subtracts_the_mean_of_the_other_samples():
    # group [1, 0, 0, 1]: sum 2; i=0: others (2 - 1)/3 = 1/3 -> 1 - 1/3 = 2/3;
    #   i=1: others (2 - 0)/3 = 2/3 -> 0 - 2/3 = -2/3; symmetric for i=2, 3
    adv = compute_rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]), atol=1e-6, rtol=0)
    # pairs [1, 0] -> [1 - 0, 0 - 1]; [3, 5] -> [-2, 2]; constant [2, 2] -> exactly 0
    adv = compute_rloo_advantages(torch.tensor([1.0, 0.0, 3.0, 5.0, 2.0, 2.0]), group_size=2)
    assert adv.tolist() == [1.0, -1.0, -2.0, 2.0, 0.0, 0.0]


def test_rloo_needs_two_samples_per_group():
    with pytest.raises(ValueError, match="group_size: expected >= 2"):
        compute_rloo_advantages(torch.zeros(3), group_size=1)


def test_discounted_returns_put_the_outcome_on_the_last_token():
    # seq 0: 3 valid tokens, score 1, gamma 0.5 -> [0.25, 0.5, 1]
    # seq 1: 2 valid tokens, score 2 -> [1, 2], padding 0
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    out = compute_discounted_returns(torch.tensor([1.0, 2.0]), mask, gamma=0.5)
    torch.testing.assert_close(out, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]), atol=0, rtol=0)


def test_whiten_uses_the_unbiased_variance_over_valid_tokens():
    # valid 1, 2, 3: mean 2, centred -1, 0, 1, unbiased var (1 + 0 + 1)/2 = 1
    #   -> [-1, 0, 1] / sqrt(1 + 1e-8); the masked 99 becomes 0
    out = whiten_masked(torch.tensor([[1.0, 2.0], [3.0, 99.0]]), torch.tensor([[1, 1], [1, 0]]))
    torch.testing.assert_close(out, torch.tensor([[-1.0, 0.0], [1.0, 0.0]]), atol=1e-7, rtol=0)
    assert whiten_masked(torch.tensor([[5.0]]), torch.tensor([[1]])).item() == 0.0  # one token: 0


def test_reinforce_pp_whitens_token_returns_over_the_batch():
    # rewards [1, 0], gamma 1: token returns [[1, 1], [0, pad]]; valid 1, 1, 0: mean 2/3,
    #   centred [1/3, 1/3, -2/3], unbiased var (1/9 + 1/9 + 4/9)/2 = 1/3, std 0.5773503
    #   -> [0.5773503, 0.5773503, -1.1547005]
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    out = compute_reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.5773503, 0.5773503], [-1.1547005, 0.0]]), atol=1e-6, rtol=0)


def test_reinforce_pp_baseline_centres_per_group_then_whitens():
    # groups [1, 0] -> [0.5, -0.5], [2, 2] -> [0, 0]; one token each: mean 0,
    #   unbiased var (0.25 + 0.25)/3 = 1/6, std 0.4082483 -> [1.2247449, -1.2247449, 0, 0]
    mask = torch.ones(4, 1, dtype=torch.bool)
    out = compute_reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), mask, group_size=2)
    torch.testing.assert_close(out, torch.tensor([[1.2247449], [-1.2247449], [0.0], [0.0]]), atol=1e-6, rtol=0)


def test_gae_by_hand():
    # rewards [0, 0, 1], values 0.5 each, gamma 1, lam 0.5:
    #   t=2: delta = 1 + 0 - 0.5 = 0.5, A = 0.5
    #   t=1: delta = 0 + 0.5 - 0.5 = 0, A = 0 + 0.5 * 0.5 = 0.25
    #   t=0: delta = 0, A = 0.5 * 0.25 = 0.125; returns = A + V = [0.625, 0.75, 1.0]
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = compute_gae_advantages(torch.tensor([[0.0, 0.0, 1.0]]), torch.full((1, 3), 0.5), mask, 1.0, 0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.125, 0.25, 0.5]]), atol=1e-7, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[0.625, 0.75, 1.0]]), atol=1e-7, rtol=0)


def test_gae_skips_masked_positions():
    # mask [1, 0, 1] (a tool-output token in the middle), gamma = lam = 1:
    #   t=2: delta = 1 - 0.5 = 0.5, A = 0.5; t=1 skipped (0, its 9s ignored);
    #   t=0: delta = 0 + 0.5 (V of t=2) - 0.5 = 0, A = 0 + 0.5 = 0.5; returns [1, 0, 1]
    mask = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    adv, ret = compute_gae_advantages(torch.tensor([[0.0, 9.0, 1.0]]), torch.tensor([[0.5, 9.0, 0.5]]), mask)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.5]]), atol=0, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0]]), atol=0, rtol=0)
