"""GRPO math: every expected number is derived by hand in the comment above it."""

import math

import pytest
import torch

from stages.algorithms import (
    aggregate_loss,
    compute_grpo_advantages,
    compute_kl,
    compute_policy_loss,
    compute_token_logprobs,
)


def test_advantages_use_population_std_per_group():
    # group 0 = [0, 1, 0, 0]: mean 0.25, population var = (3*0.0625 + 0.5625)/4 = 0.1875,
    #   std = 0.4330127 -> (1 - 0.25)/0.4330127 = 1.7320508, (0 - 0.25)/0.4330127 = -0.5773503
    # group 1 = [1, 1, 1, 1]: constant -> 0 everywhere
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = compute_grpo_advantages(rewards, group_size=4, eps=0.0)
    expected = torch.tensor([-0.5773503, 1.7320508, -0.5773503, -0.5773503, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)


def test_advantages_eps_and_pairs():
    # [2, 4]: mean 3, population std 1 -> (+-1) / (1 + 0.5) = +-0.6666667
    adv = compute_grpo_advantages(torch.tensor([2.0, 4.0]), group_size=2, eps=0.5)
    torch.testing.assert_close(adv, torch.tensor([-2 / 3, 2 / 3]), atol=1e-6, rtol=0)


def test_advantages_without_std_normalisation():
    # [1, 2, 3] - 2 = [-1, 0, 1]; [5, 5, 8] - 6 = [-1, -1, 2]
    adv = compute_grpo_advantages(torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 8.0]), 3, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, -1.0, -1.0, 2.0]), atol=0, rtol=0)


def test_advantages_reject_partial_groups():
    with pytest.raises(ValueError, match="not a multiple of group_size 4"):
        compute_grpo_advantages(torch.zeros(6), group_size=4)


def test_kl_estimators():
    # logp = log 0.5, ref = log 0.25 -> d = ref - logp = -log 2 = -0.6931472
    #   k1 = -d = 0.6931472; k3 = exp(d) - d - 1 = 0.5 + 0.6931472 - 1 = 0.1931472
    # equal log-probs -> both 0
    logp = torch.tensor([[math.log(0.5), -1.0]])
    ref = torch.tensor([[math.log(0.25), -1.0]])
    torch.testing.assert_close(compute_kl(logp, ref, "k1"), torch.tensor([[0.6931472, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(compute_kl(logp, ref, "k3"), torch.tensor([[0.1931472, 0.0]]), atol=1e-6, rtol=0)


def test_kl_k3_value_is_clamped_for_extreme_log_ratio():
    # d = 0 - (-200) = 200 is clamped to 20: exp(20) - 21 = 4.85e8, then the value to 10
    # (verl's bound); clamped, the token sends no gradient at all.
    logp = torch.tensor([[-200.0]], requires_grad=True)
    kl = compute_kl(logp, torch.tensor([[0.0]]), "k3")
    assert kl.item() == 10.0
    kl.sum().backward()
    assert logp.grad.item() == 0.0
    # d = log 2 = 0.6931472 -> k3 = 2 - 0.6931472 - 1 = 0.3068528 (inside the clamp)
    mild = compute_kl(torch.tensor([[math.log(0.25)]]), torch.tensor([[math.log(0.5)]]), "k3")
    assert mild.item() == pytest.approx(0.3068528, abs=1e-6)


def test_kl_k2_is_half_the_squared_log_ratio():
    # d = log 0.25 - log 0.5 = -0.6931472 -> k2 = 0.5 * 0.480453 = 0.2402265
    kl = compute_kl(torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]]), "k2")
    assert kl.item() == pytest.approx(0.2402265, abs=1e-6)


def test_policy_loss_clipped_ratio_by_hand():
    # token 0: logp - old = log 1.5 -> ratio 1.5, A = 2, eps 0.2:
    #   -min(1.5*2, clip(1.5, 0.8, 1.2)*2) = -min(3.0, 2.4) = -2.4 (clipped branch)
    # token 1: ratio 1 -> -2.0
    # token-mean over 2 tokens: (-2.4 - 2.0)/2 = -2.2; clip_frac = 1/2; ratio mean 1.25
    logp = torch.tensor([[math.log(1.5), 0.0]], requires_grad=True)
    loss, metrics = compute_policy_loss(
        logp, torch.zeros(1, 2), torch.tensor([2.0]), torch.ones(1, 2, dtype=torch.bool),
        clip_eps_low=0.2, clip_eps_high=0.2,
    )
    assert loss.item() == pytest.approx(-2.2, abs=1e-6)
    assert metrics["pg_loss"] == pytest.approx(-2.2, abs=1e-6)
    assert metrics["clip_frac"] == pytest.approx(0.5, abs=1e-9)
    assert metrics["ratio_mean"] == pytest.approx(1.25, abs=1e-6)
    assert metrics["ratio_max"] == pytest.approx(1.5, abs=1e-6)
    assert metrics["kl"] == 0.0
    loss.backward()
    # d/dlogp: clipped token -> 0; token 1 -> -A * ratio / 2 tokens = -2 * 1 / 2 = -1
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.0]]), atol=1e-6, rtol=0)


def test_policy_loss_without_sampler_logprobs_anchors_on_the_trained_weights():
    """NaN behaviour log-probs (rollout.logprobs: false): loss, gradient and metrics are
    those of a sampler that reported exactly the trainer's log-probs; tokens with a
    sampler log-prob keep it, and only they count in logp_mismatch."""
    current = torch.tensor([[-0.7, -1.9, -0.2], [-2.3, -0.4, -1.1]])
    sampler = torch.tensor([[-0.75, -1.6, -0.25], [-2.0, -0.5, -1.0]])
    advantages, mask = torch.tensor([1.5, -0.5]), torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    fresh = torch.ones(2, 3, dtype=torch.bool)

    def run(old):
        logp = current.clone().requires_grad_(True)
        loss, metrics = compute_policy_loss(logp, old, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.2,
                                            fresh_mask=fresh)
        loss.backward()
        return loss.item(), logp.grad, metrics

    loss, grad, metrics = run(torch.full((2, 3), math.nan))
    ref_loss, ref_grad, ref_metrics = run(current.clone())
    assert loss == ref_loss and torch.equal(grad, ref_grad)
    # No token has a sampler log-prob: the mismatch is not measured (the reference run's is 0).
    assert "logp_mismatch" not in metrics and ref_metrics.pop("logp_mismatch") == 0.0
    ref_metrics.pop("logp_mismatch_tokens")
    assert metrics == ref_metrics and metrics["ratio_mean"] == 1.0 and metrics["clip_frac"] == 0.0
    assert math.isfinite(loss) and grad.abs().sum() > 0
    # Row 0 reported by the sampler, row 1 not: row 0 keeps its own ratio.
    partial = torch.cat([sampler[:1], torch.full((1, 3), math.nan)])
    loss, grad, metrics = run(partial)
    mixed_loss, mixed_grad, mixed_metrics = run(torch.cat([sampler[:1], current[1:]]))
    assert loss == mixed_loss and torch.equal(grad, mixed_grad) and metrics["ratio_mean"] != 1.0
    assert metrics["logp_mismatch"] == pytest.approx((current[0] - sampler[0]).abs().mean().item(), abs=1e-6)
    assert mixed_metrics["logp_mismatch"] < metrics["logp_mismatch"]  # row 1's zeros no longer dilute it


def test_policy_loss_negative_advantage_uses_low_clip():
    # ratio 0.5, A = -1, low 0.2: -min(0.5*-1, 0.8*-1) = -min(-0.5, -0.8) = 0.8 (clipped)
    # ratio 2.0, A = -1, high 0.28: -min(-2.0, -1.28) = 2.0 (unclipped: a bad action
    # that became more likely is always penalised in full)
    logp = torch.tensor([[math.log(0.5)], [math.log(2.0)]])
    loss, metrics = compute_policy_loss(
        logp, torch.zeros(2, 1), torch.tensor([-1.0, -1.0]), torch.ones(2, 1),
        clip_eps_low=0.2, clip_eps_high=0.28,
    )
    # token-mean: (0.8 + 2.0)/2 = 1.4; clipped on 1 of 2 tokens
    assert loss.item() == pytest.approx(1.4, abs=1e-6)
    assert metrics["clip_frac"] == pytest.approx(0.5, abs=1e-9)


def test_policy_loss_adds_kl_penalty():
    # ratio 1 (logp = old = log 0.5), A = 1 -> pg = -1 per token
    # ref = log 0.25: k3 = 0.1931472 (see test_kl_estimators); kl_coef 0.5
    # loss = -1 + 0.5 * 0.1931472 = -0.9034264; metrics: pg_loss -1, kl 0.1931472
    logp = torch.full((1, 2), math.log(0.5))
    loss, metrics = compute_policy_loss(
        logp, logp.clone(), torch.tensor([1.0]), torch.ones(1, 2),
        ref_logprobs=torch.full((1, 2), math.log(0.25)), kl_coef=0.5, kl_estimator="k3",
    )
    assert loss.item() == pytest.approx(-0.9034264, abs=1e-6)
    assert metrics["pg_loss"] == pytest.approx(-1.0, abs=1e-6)
    assert metrics["kl"] == pytest.approx(0.1931472, abs=1e-6)


def test_policy_loss_requires_reference_for_kl():
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), kl_coef=0.1)


def test_masked_positions_contribute_nothing_even_if_garbage():
    # Only token [0, 0] is valid: ratio 1, A = 3 -> loss -3; the masked garbage
    # (inf, -inf, NaN in logp, old and ref) must leave loss, metrics and grad finite.
    nan, inf = float("nan"), float("inf")
    logp = torch.tensor([[0.0, inf], [nan, -inf]], requires_grad=True)
    old = torch.tensor([[0.0, -inf], [nan, 5.0]])
    ref = torch.tensor([[0.0, nan], [inf, -inf]])
    mask = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    loss, metrics = compute_policy_loss(
        logp, old, torch.tensor([3.0, 3.0]), mask, ref_logprobs=ref, kl_coef=0.1
    )
    assert loss.item() == pytest.approx(-3.0, abs=1e-6)
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    loss.backward()
    # d/dlogp at [0, 0]: -A * ratio = -3 (one token); masked positions get exactly 0
    torch.testing.assert_close(logp.grad, torch.tensor([[-3.0, 0.0], [0.0, 0.0]]), atol=1e-6, rtol=0)


def test_aggregate_loss_modes():
    # seq 0: values [1, 3] both valid; seq 1: [10, x] with only 10 valid; seq 2: no tokens
    values = torch.tensor([[1.0, 3.0], [10.0, 99.0], [7.0, 7.0]])
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=torch.bool)
    # token-mean: (1 + 3 + 10) / 3 = 4.6666667
    assert aggregate_loss(values, mask, "token-mean").item() == pytest.approx(14 / 3, abs=1e-6)
    # seq-mean-token-mean: mean(2, 10) over the 2 non-empty sequences = 6
    assert aggregate_loss(values, mask, "seq-mean-token-mean").item() == pytest.approx(6.0, abs=1e-6)
    # seq-mean-token-sum: mean(4, 10) = 7
    assert aggregate_loss(values, mask, "seq-mean-token-sum").item() == pytest.approx(7.0, abs=1e-6)
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate_loss(values, mask, "sum")  # type: ignore[arg-type]


def test_aggregate_loss_all_masked_is_zero_and_differentiable():
    values = torch.ones(2, 3, requires_grad=True)
    out = aggregate_loss(values, torch.zeros(2, 3), "seq-mean-token-mean")
    assert out.item() == 0.0
    out.backward()
    assert torch.equal(values.grad, torch.zeros(2, 3))


def test_token_logprobs_by_hand():
    # vocab 2; logits at position 0 = [0, log 3] -> p = [1/4, 3/4]; next token 1 -> log 0.75
    # position 1 = [log 2, 0] -> p = [2/3, 1/3]; next token 0 -> log(2/3)
    # with temperature 2: logits/2 = [0, log sqrt3] -> p(1) = sqrt3/(1+sqrt3) = 0.6339746
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(2.0), 0.0], [5.0, 5.0]]])
    ids = torch.tensor([[0, 1, 0]])
    out = compute_token_logprobs(logits, ids)
    assert out.shape == (1, 2)
    torch.testing.assert_close(out, torch.tensor([[math.log(0.75), math.log(2 / 3)]]), atol=1e-6, rtol=0)
    hot = compute_token_logprobs(logits, ids, temperature=2.0)
    assert hot[0, 0].item() == pytest.approx(math.log(0.6339746), abs=1e-6)


def test_dual_clip_bounds_negative_advantage_tokens():
    # token 0: ratio 4, A = -1: -min(-4, -1.2) = 4, dual bound -A * 3 = 3 -> 3 (no gradient)
    # token 1: ratio 2, A = -1: -min(-2, -1.2) = 2 < 3 -> 2 (unclipped, gradient -A * ratio)
    # token-mean (3 + 2)/2 = 2.5; d/dlogp = [0, 2 / 2 tokens] = [0, 1]; dual binds on 1 of 2
    logp = torch.tensor([[math.log(4.0), math.log(2.0)]], requires_grad=True)
    loss, metrics = compute_policy_loss(logp, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2),
                                        clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(2.5, abs=1e-6)
    assert metrics["clip_frac_dual"] == pytest.approx(0.5, abs=1e-9)
    assert metrics["clip_frac"] == 0.0  # the PPO clip is not what binds here
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 1.0]]), atol=1e-6, rtol=0)
    # off: token 0 keeps 4 -> (4 + 2)/2 = 3
    off, _ = compute_policy_loss(logp.detach(), torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2),
                                 clip_ratio_c=None)
    assert off.item() == pytest.approx(3.0, abs=1e-6)


def test_clip_fractions_upper_and_lower():
    # ratio 1.5, A = +1: clipped branch 1.2 taken -> upper
    # ratio 0.5, A = -1: -min(-0.5, -0.8) = 0.8 clipped branch taken -> lower
    # ratio 1.0, A = +1: nothing clipped
    # ratio 0.5, A = +1: -min(0.5, 0.8) = -0.5 is the unclipped branch -> nothing
    # -> upper 1/4, lower 1/4, clip_frac 2/4
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, 1.0]])
    _, metrics = compute_policy_loss(logp, torch.zeros(1, 4), adv, torch.ones(1, 4))
    assert (metrics["clip_frac_upper"], metrics["clip_frac_lower"], metrics["clip_frac"]) == (0.25, 0.25, 0.5)


def test_truncated_importance_weights():
    # behaviour = current - log 3 on token 0 (iw = 3), = current on token 1 (iw = 1);
    # decoupled: ratio to the current weights is 1, pg = -A = -1 per token; cap 2:
    #   w = [min(3, 2), 1] = [2, 1] -> loss (-2 - 1)/2 = -1.5, d/dlogp = -w/2 = [-1, -0.5]
    #   metrics: iw mean (3 + 1)/2 = 2, max 3, capped 1 of 2
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0 - math.log(3.0), -2.0]])
    loss, metrics = compute_policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2),
                                        off_policy="truncate", behav_imp_weight_cap=2.0)
    assert loss.item() == pytest.approx(-1.5, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -0.5]]), atol=1e-6, rtol=0)
    assert metrics["is_weight_mean"] == pytest.approx(2.0, abs=1e-6)
    assert metrics["is_weight_max"] == pytest.approx(3.0, abs=1e-6)
    assert metrics["is_weight_capped_frac"] == 0.5
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_frac"] == 0.0


def test_decoupled_ratio_is_anchored_on_the_proximal_log_probs():
    # A later PPO epoch: the weights moved since the first pass (prox), which moved from
    # the sampler (behaviour). truncate, cap 2, A = 1, clip 0.2:
    #   token 0: ratio = exp(-1 - (-1 - ln 2)) = 2 -> clipped to 1.2 (no gradient);
    #            iw = exp(prox - behaviour) = 1.5 -> w 1.5, term -1.5 * 1.2 = -1.8
    #   token 1: ratio 1; iw = 3 -> w = min(3, 2) = 2, term -2, d/dlogp = -2 / 2 = -1
    #   loss (-1.8 - 2) / 2 = -1.9; grad [0, -1]; ratio mean 1.5, clip_frac 0.5,
    #   iw mean (1.5 + 3) / 2 = 2.25 (anchored on the current weights: ratio 1, no clip)
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    prox = torch.tensor([[-1.0 - math.log(2.0), -2.0]])
    old = torch.tensor([[-1.0 - math.log(2.0) - math.log(1.5), -2.0 - math.log(3.0)]])
    loss, metrics = compute_policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2), off_policy="truncate",
                                        behav_imp_weight_cap=2.0, clip_ratio_c=None, prox_logprobs=prox)
    assert loss.item() == pytest.approx(-1.9, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.0]]), atol=1e-6, rtol=0)
    assert metrics["ratio_mean"] == pytest.approx(1.5, abs=1e-6) and metrics["clip_frac"] == 0.5
    assert metrics["is_weight_mean"] == pytest.approx(2.25, abs=1e-6)


def test_rejected_importance_weights_zero_the_token_but_keep_the_count():
    # same tokens, reject: w = [0 (3 > cap 2), 1] -> loss (0 - 1)/2 = -0.5, grad [0, -0.5]
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.0 - math.log(3.0), -2.0]])
    loss, _ = compute_policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2),
                                  off_policy="reject", behav_imp_weight_cap=2.0)
    assert loss.item() == pytest.approx(-0.5, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5]]), atol=1e-6, rtol=0)


def test_per_token_advantages():
    # ratio 1 everywhere, A per token [2, -1]: pg [-2, 1] -> token-mean -0.5
    logp = torch.zeros(1, 2)
    loss, _ = compute_policy_loss(logp, logp.clone(), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-0.5, abs=1e-7)
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss(logp, logp.clone(), torch.zeros(1, 3), torch.ones(1, 2))


def test_seq_mean_token_sum_norm_divides_by_a_constant():
    # the values of test_aggregate_loss_modes: valid sum 1 + 3 + 10 = 14; 3 rows x 4 tokens
    #   -> 14 / 12 = 1.1666667 (the empty row counts)
    values = torch.tensor([[1.0, 3.0], [10.0, 99.0], [7.0, 7.0]])
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=torch.bool)
    out = aggregate_loss(values, mask, "seq-mean-token-sum-norm", norm_tokens=4)
    assert out.item() == pytest.approx(14 / 12, abs=1e-6)
    with pytest.raises(ValueError, match="norm_tokens"):
        aggregate_loss(values, mask, "seq-mean-token-sum-norm")


def test_logp_mismatch_is_measured_on_fresh_tokens_only():
    # tokens: |logp - behaviour| = 0.1 (fresh), 0.3 (fresh), 2.0 (stale, ignored),
    #   0.5 (fresh but masked out) -> (0.1 + 0.3) / 2 = 0.2
    logp = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.1, -0.7, -3.0, -1.5]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    fresh = torch.tensor([[1, 1, 0, 1]], dtype=torch.bool)
    _, metrics = compute_policy_loss(logp, old, torch.tensor([1.0]), mask, fresh_mask=fresh)
    assert metrics["logp_mismatch"] == pytest.approx(0.2, abs=1e-6)
    assert metrics["logp_mismatch_tokens"] == 2.0
    # No fresh token (none given, or every fresh one masked or unreported): absent, not
    # a 0 that would read as a perfect sampler/trainer match.
    _, metrics = compute_policy_loss(logp, old, torch.tensor([1.0]), mask)
    assert "logp_mismatch" not in metrics and "logp_mismatch_tokens" not in metrics
    _, metrics = compute_policy_loss(logp, old, torch.tensor([1.0]), mask, fresh_mask=torch.tensor([[0, 0, 0, 1]]))
    assert "logp_mismatch" not in metrics
