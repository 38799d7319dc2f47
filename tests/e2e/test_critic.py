"""The critic (stages/trainer/critic.py) on the tiny checkpoint with real DeepSpeed on CPU: its
values line up with the completion tokens, its clipped value loss falls on a fixed
batch, and its state round-trips."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from pipeline.config import CriticConfig, TinyModelConfig, TrainConfig
from stages.algorithms import assign_advantages
from stages.algorithms.losses import compute_value_loss
from stages.algorithms.ppo import PpoConfig
from stages.trainer.critic import CriticEngine, find_critic_state, write_critic_state
from tests.e2e.test_trainer_engine import make_batch


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from stages.models.tiny import ensure_tiny_checkpoint

    torch.set_num_threads(1)
    return ensure_tiny_checkpoint(TinyModelConfig(), tmp_path_factory.mktemp("models"))


def build_critic(checkpoint, gradient_checkpointing: bool = False, **kw) -> CriticEngine:
    critic = CriticConfig(lr=kw.pop("lr", 2e-4), chunk_size=24, threads=1, **kw)
    train = TrainConfig(threads=1, gradient_checkpointing=gradient_checkpointing)
    return CriticEngine(checkpoint, critic, train, "float32", seed=0)


def test_values_are_zero_on_padding_and_independent_of_chunking(checkpoint):
    batch = make_batch(seed=1)
    engine = build_critic(checkpoint)
    values = engine.compute_values(batch)
    assert values.shape == batch.completion_ids.shape and values.dtype == np.float32
    pad = np.arange(values.shape[1])[None, :] >= batch.completion_lens[:, None]
    assert np.all(values[pad] == 0) and np.all(np.isfinite(values))
    assert np.count_nonzero(values[~pad]) == np.count_nonzero(~pad)
    # Right padding never reaches a real position (causal mask): the value of a sample
    # is the same in a forward of its own.
    one = msgspec.structs.replace(
        batch, prompts=batch.prompts[:1], group_size=1, sample_ids=batch.sample_ids[:1],
        prompt_ids=batch.prompt_ids[:1], prompt_lens=batch.prompt_lens[:1],
        completion_ids=batch.completion_ids[:1], completion_lens=batch.completion_lens[:1],
        completions=batch.completions[:1], behaviour_logprobs=batch.behaviour_logprobs[:1],
        token_versions=batch.token_versions[:1], rewards=batch.rewards[:1], finish_reasons=[])
    np.testing.assert_allclose(engine.compute_values(one)[0], values[0], rtol=1e-4, atol=1e-5)


def test_critic_loss_decreases_on_a_fixed_batch(checkpoint, tmp_path):
    engine = build_critic(checkpoint)
    batch = make_batch(seed=2)
    cfg = PpoConfig(gamma=1.0, lam=0.95)
    losses = []
    for _ in range(8):
        valued = msgspec.structs.replace(batch, values=engine.compute_values(batch))
        out = assign_advantages(valued, cfg)
        # Fixed targets: the first pass's returns (learning towards a fixed batch).
        if not losses:
            returns = out.returns
        out = msgspec.structs.replace(out, returns=returns)
        metrics = engine.train_values(out)
        losses.append(metrics["vf_loss"])
        assert np.isfinite(metrics["grad_norm"])
    assert engine.steps == 8
    # A trend: the last losses are clearly below the first.
    assert np.mean(losses[-2:]) < 0.5 * losses[0], losses
    # The state round-trips: a second critic loaded from it predicts the same values.
    path = write_critic_state(engine, tmp_path, {"batches": 8})
    assert find_critic_state(tmp_path) == path
    other = build_critic(checkpoint)
    state = other.load_state(path)
    assert other.steps == 8 and state["batches"] == 8
    np.testing.assert_allclose(other.compute_values(batch), engine.compute_values(batch), rtol=0, atol=1e-6)


def test_gradient_checkpointing_trains_the_critic_as_without_it(checkpoint):
    """train.gradient_checkpointing reaches the critic: its blocks are recomputed in
    backward, and its update is the one without it."""
    batch = make_batch(seed=3)
    plain, kept = build_critic(checkpoint), build_critic(checkpoint, gradient_checkpointing=True)
    assert kept.module.is_gradient_checkpointing and not plain.module.is_gradient_checkpointing
    valued = msgspec.structs.replace(batch, values=plain.compute_values(batch))
    out = assign_advantages(valued, PpoConfig(gamma=1.0, lam=0.95))
    torch.manual_seed(0)  # the same dropout masks in the token-classification head
    want = plain.train_values(out)
    torch.manual_seed(0)
    got = kept.train_values(out)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    np.testing.assert_allclose(kept.compute_values(batch), plain.compute_values(batch), rtol=0, atol=1e-6)


def test_value_loss_clipping_hand_derived():
    # One token, return 1.0, old value 0.0, clip 0.2. New value 0.5: unclipped error
    # (0.5 - 1)^2 = 0.25; clipped value 0.2, error 0.64; loss 0.5 * max = 0.32 (clipped).
    v = torch.tensor([[0.5, 7.0]], requires_grad=True)
    loss, m = compute_value_loss(v, torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[1, 0]]), clip_eps=0.2)
    assert loss.item() == pytest.approx(0.32, abs=1e-6) and m["vf_clip_frac"] == 1.0
    loss.backward()  # the clipped branch is constant in v: no gradient, none on the masked token
    assert torch.equal(v.grad, torch.zeros(1, 2))
    # Unclipped: 0.5 * 0.25 = 0.125, gradient (v - R) = -0.5.
    v.grad = None
    loss, m = compute_value_loss(v, torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[1, 0]]), clip_eps=None)
    assert loss.item() == pytest.approx(0.125, abs=1e-6) and m["vf_clip_frac"] == 0.0
    loss.backward()
    assert v.grad[0, 0].item() == pytest.approx(-0.5, abs=1e-6) and v.grad[0, 1].item() == 0.0
