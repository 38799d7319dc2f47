"""GSPO's sequence-level ratio, the straight-through KL forms, KL in the reward with its
controller, and overlong masking; every expected number derived by hand beside it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.config import ConfigError, KLControlConfig, load_config
from stages.algorithms import assign_advantages, compute_kl, compute_policy_loss
from stages.algorithms.advantages import compute_discounted_returns, compute_token_returns
from stages.algorithms.grpo import GrpoConfig
from stages.algorithms.kl_control import KLController, build_kl_controller
from stages.algorithms.registry import compute_kl_reward_penalty, summarise_kl_penalty
from stages.algorithms.reinforce_plus_plus import ReinforcePlusPlusConfig
from tests.unit.test_admission import make_batch


def _gspo_inputs():
    # sample 0: 2 valid tokens, log-ratios 0.2 and -0.4 -> mean -0.1 -> s0 = e^-0.1
    # sample 1: 3 valid tokens, log-ratios 0.1 each       -> s1 = e^0.1
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.6, 0.0], [-0.6, -0.6, -0.6]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    return logp, old, mask, adv


def test_gspo_sequence_ratio_value_and_gradient():
    logp, old, mask, adv = _gspo_inputs()
    loss, m = compute_policy_loss(logp, old, adv, mask, ratio_level="sequence", loss_agg="seq-mean-token-mean")
    s0, s1 = math.exp(-0.1), math.exp(0.1)  # 0.904837, 1.105171: inside [0.8, 1.2], no clip
    # per token: -A * s -> -s0 on sample 0, +s1 on sample 1; seq-mean-token-mean: (-s0 + s1) / 2
    assert float(loss.detach()) == pytest.approx((-s0 + s1) / 2, abs=1e-6)
    assert m["ratio_mean"] == pytest.approx((2 * s0 + 3 * s1) / 5, abs=1e-6)
    loss.backward()
    # GSPO's objective -(1/2) sum_i A_i exp(mean_t log r_it): d/dlogp_it = -A_i s_i / (2 |y_i|)
    want = torch.tensor([[-s0 / 4, -s0 / 4, 0.0], [s1 / 6, s1 / 6, s1 / 6]])
    torch.testing.assert_close(logp.grad, want, atol=1e-6, rtol=0)


def test_gspo_clips_whole_sequences_where_token_ratios_would_not():
    # token log-ratios 0.5 and 0.1: per token only the first leaves [0.8, 1.2]; their mean
    # 0.3 -> s = e^0.3 = 1.34986 > 1.2 with A > 0: the whole sequence is clipped.
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.1]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([1.0])
    loss, m = compute_policy_loss(logp, old, adv, mask, ratio_level="sequence", loss_agg="token-mean")
    assert float(loss.detach()) == pytest.approx(-1.2, abs=1e-6)  # -clip(s) * A
    assert m["clip_frac"] == 1.0 and m["clip_frac_upper"] == 1.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(1, 2))  # clipped: no gradient anywhere
    logp2 = logp.detach().clone().requires_grad_(True)
    tok_loss, tok = compute_policy_loss(logp2, old, adv, mask, ratio_level="token", loss_agg="token-mean")
    tok_loss.backward()
    assert tok["clip_frac"] == 0.5
    # token 2 unclipped: d/dlogp (-(1/2) e^(logp - old)) = -e^0.1 / 2
    assert float(logp2.grad[0, 1]) == pytest.approx(-math.exp(0.1) / 2, abs=1e-6)


def test_gspo_with_decoupled_correction_has_ratio_one():
    logp, old, mask, adv = _gspo_inputs()
    _, m = compute_policy_loss(logp, old, adv, mask, ratio_level="sequence", off_policy="truncate")
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-7) and m["clip_frac"] == 0.0


def test_unknown_ratio_level_is_refused():
    logp, old, mask, adv = _gspo_inputs()
    with pytest.raises(ValueError, match="ratio_level"):
        compute_policy_loss(logp, old, adv, mask, ratio_level="group")


@pytest.mark.parametrize(("estimator", "value"), [
    # d = ref - logp = -0.5. k3 = e^-0.5 + 0.5 - 1 = 0.1065307; k1 = -d = 0.5
    ("k3+", math.exp(-0.5) - 0.5), ("k1+", 0.5),
])
def test_straight_through_kl_has_k2_gradient(estimator, value):
    logp = torch.tensor([[-1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5]])
    kl = compute_kl(logp, ref, estimator)
    assert float(kl.detach()) == pytest.approx(value, abs=1e-6)
    kl.sum().backward()
    # k2 = (ref - logp)^2 / 2 -> gradient logp - ref = 0.5 (k3's own would be 1 - e^-0.5 = 0.3935)
    assert float(logp.grad) == pytest.approx(0.5, abs=1e-6)


def test_straight_through_kl_keeps_k3_clamp():
    logp = torch.tensor([[-1.0]], requires_grad=True)
    kl = compute_kl(logp, torch.tensor([[14.0]]), "k3+")  # d = 15: e^15 - 16 >> 10
    assert float(kl.detach()) == 10.0
    kl.sum().backward()
    assert float(logp.grad) == pytest.approx(-15.0)  # k2's gradient logp - ref


def test_kl_in_reward_lowers_each_sample_score_by_its_summed_penalty():
    batch = make_batch(num_groups=1, group_size=2)  # rewards [0, 1], lens 1, 2
    # k1 = behaviour - ref: sample 0: -0.01 + 0.5 = 0.49 (1 token); sample 1: 0.48 x 2 tokens
    pen = compute_kl_reward_penalty(batch, GrpoConfig(kl_penalty="k1"))
    torch.testing.assert_close(pen, torch.tensor([[0.49, 0.0], [0.48, 0.48]]), atol=1e-6, rtol=0)
    # per-sample token means 0.49 and 0.48 -> 0.485
    assert summarise_kl_penalty(pen, np.array([[True, False], [True, True]])) == pytest.approx(0.485, abs=1e-6)
    cfg = GrpoConfig(norm_adv_by_std=False, use_kl_in_reward=True)
    plain = assign_advantages(batch, cfg)
    assert plain.advantages[0, 0] == -0.5 and plain.advantages[1, 1] == 0.5
    # coef 0.5: scores 0 - 0.245 = -0.245 and 1 - 0.48 = 0.52; mean 0.1375 -> -+0.3825
    out = assign_advantages(batch, cfg, kl_reward_coef=0.5)
    np.testing.assert_allclose(out.advantages, [[-0.3825, 0.0], [0.3825, 0.3825]], atol=1e-6)


def test_token_returns_skip_masked_positions():
    # gamma 0.5: t2 = 3; t1 masked -> 0 and skipped; t0 = 1 + 0.5 * 3 = 2.5
    out = compute_token_returns(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[1, 0, 1]]), gamma=0.5)
    torch.testing.assert_close(out, torch.tensor([[2.5, 0.0, 3.0]]))
    # an outcome score on the last valid token is compute_discounted_returns
    mask = torch.tensor([[1, 1, 1, 0]])
    scores = torch.tensor([2.0])
    on_last = torch.tensor([[0.0, 0.0, 2.0, 0.0]])
    torch.testing.assert_close(compute_token_returns(on_last, mask, 0.9), compute_discounted_returns(scores, mask, 0.9))


def test_reinforce_pp_subtracts_the_penalty_to_go_before_whitening():
    batch = make_batch(num_groups=1, group_size=2)
    cfg = ReinforcePlusPlusConfig(use_kl_in_reward=True)
    out = assign_advantages(batch, cfg, kl_reward_coef=1.0)
    # returns (gamma 1): sample 0: 0 - 0.49 = -0.49; sample 1: t0 1 - 0.96 = 0.04, t1 1 - 0.48 = 0.52.
    # whitened over the 3 tokens: mean 0.07 / 3; centred -0.513333, 0.016667, 0.496667;
    # unbiased var (0.263511 + 0.000278 + 0.246678) / 2 = 0.255233 -> std 0.505206
    mean = 0.07 / 3
    std = math.sqrt(((-0.49 - mean) ** 2 + (0.04 - mean) ** 2 + (0.52 - mean) ** 2) / 2)
    assert std == pytest.approx(0.505206, abs=1e-6)
    want = [[(-0.49 - mean) / std, 0.0], [(0.04 - mean) / std, (0.52 - mean) / std]]  # -1.01609, 0.03299, 0.98310
    np.testing.assert_allclose(out.advantages, want, atol=1e-5)


def test_adaptive_kl_controller_moves_towards_target():
    ctrl = KLController(coef=0.1, adaptive=True, target_kl=0.1, horizon=1000)
    # kl 0.15: error 0.5 clipped to 0.2 -> x (1 + 0.2 * 64 / 1000) = 1.0128
    assert ctrl.update(0.15, 64) == pytest.approx(0.10128, abs=1e-12)
    # kl 0.08: error -0.2 -> x 0.9872
    assert ctrl.update(0.08, 64) == pytest.approx(0.10128 * 0.9872, abs=1e-12)
    before = ctrl.coef
    assert ctrl.update(0.1, 64) == before  # on target: unchanged
    fixed = build_kl_controller(KLControlConfig(kl_coef=0.02))
    assert fixed.update(5.0, 64) == 0.02 and not fixed.adaptive
    restored = build_kl_controller(KLControlConfig(type="adaptive"))
    restored.load_state(ctrl.state())
    assert restored.coef == ctrl.coef
    with pytest.raises(ValueError, match="kl_ctrl.horizon"):
        KLController(coef=0.1, adaptive=True, horizon=10).update(0.2, 64)


def test_overlong_mask_removes_truncated_samples_after_the_group_baseline():
    batch = make_batch(num_groups=1, group_size=2)  # finish reasons: length, stop; rewards 0, 1
    out = assign_advantages(batch, GrpoConfig(overlong_mask=True))
    # the group still counts sample 0: advantages -1, +1; sample 0 then leaves the loss
    assert not out.loss_mask[0].any() and out.advantages[0, 0] == 0.0
    assert out.advantages[1, 0] == pytest.approx(1.0, abs=1e-5) and out.loss_tokens == 2


@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm.use_kl_in_reward=true", "reference.enabled='off'"], "algorithm.use_kl_in_reward"),
    (["algorithm.name=reinforce_plus_plus", "rollout.n=1", "algorithm.drop_zero_variance_groups=true"],
     "algorithm.drop_zero_variance_groups"),
    (["algorithm.overlong_buffer_len=2", "rollout.max_tokens=2"], "algorithm.overlong_buffer_len"),
    (["algorithm.drop_zero_variance_groups=true", "dataflow.async_execution=false"],
     "algorithm.drop_zero_variance_groups"),
    (["algorithm.ratio_level=group"], "algorithm.ratio_level"),
    (["algorithm.kl_ctrl.type=pid"], "algorithm.kl_ctrl.type"),
    (["algorithm.kl_ctrl.horizon=0"], "algorithm.kl_ctrl.horizon"),
    (["algorithm.kl_estimator=k2+"], "algorithm.kl_estimator"),
    (["algorithm.kl_penalty=k3+"], "algorithm.kl_penalty"),
    (["algorithm.kl_ctrl.kl_coef=-0.1"], "algorithm.kl_ctrl.kl_coef"),
    (["algorithm.kl_ctrl.target_kl=0"], "algorithm.kl_ctrl.target_kl"),
    (["algorithm.overlong_penalty_factor=-1"], "algorithm.overlong_penalty_factor"),
    (["algorithm.drop_zero_variance_groups=maybe"], "algorithm.drop_zero_variance_groups"),
    (["train.grad_accum_dtype=fp16"], "train.grad_accum_dtype"),
])
def test_new_algorithm_fields_are_validated_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(None, overrides)


def test_kl_in_reward_turns_the_reference_on_and_a_bare_off_reads_as_off():
    cfg = load_config(None, ["algorithm.kl_coef=0", "algorithm.use_kl_in_reward=true", "algorithm.off_policy=off"])
    assert cfg.reference_enabled and cfg.algorithm.off_policy == "off"
    assert not load_config(None, ["algorithm.kl_coef=0"]).reference_enabled


def test_token_entropy_by_hand():
    from stages.algorithms import compute_token_entropy

    # [0, 0]: uniform over 2 -> ln 2. [0, ln 3]: p = 1/4, 3/4 -> -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    torch.testing.assert_close(compute_token_entropy(logits), torch.tensor([[math.log(2.0), 0.5623351]]))
    # temperature 2 on [0, 2 ln 3] is the same distribution as [0, ln 3]
    hot = compute_token_entropy(torch.tensor([[[0.0, 2 * math.log(3.0)]]]), temperature=2.0)
    assert float(hot) == pytest.approx(0.5623351, abs=1e-6)
