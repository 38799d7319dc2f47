"""Token-budget passes in the trainer (``train.pass_tokens``) against one dense pass over
the whole padded micro-batch: the same loss and the same gradient of every parameter,
for token-mean, seq-mean and DPO's pairs, on ragged, long-tailed lengths with a loss
mask that has holes; decoupled PPO's anchors land on their own samples; the padding
counts the engine reports drop below the dense figure.

TrainerEngine on the tiny checkpoint with real DeepSpeed on CPU (ZeRO 0): after
``train_micro_batch`` the accumulated gradients sit in each parameter's ``.grad``.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from pipeline.config import TinyModelConfig, TrainConfig
from pipeline.types import Prompt, RolloutBatch
from stages.algorithms import assign_advantages
from stages.algorithms.dpo import DpoConfig
from stages.algorithms.grpo import GrpoConfig
from stages.models.logprobs import compute_completion_logprobs
from stages.models.tiny import build_vocab, ensure_tiny_checkpoint
from stages.trainer.engine import TrainerEngine

GROUPS, GROUP = 6, 4
BUDGET = 96  # tokens a pass: rows of ~10 to ~75 tokens make passes of 1 to 8 rows


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return ensure_tiny_checkpoint(TinyModelConfig(), tmp_path_factory.mktemp("models"))


def make_batch(group_size: int = GROUP, seed: int = 0) -> RolloutBatch:
    """GROUPS prompts of 2..11 tokens, each ``group_size`` completions with lognormal
    lengths (median 8, clipped to [1, 64]: a few rows far longer than the rest); random
    rewards. In every third sample the loss mask drops tokens 2 and 3 (a tool's output
    in a multi-turn rollout)."""
    rng = np.random.default_rng(seed)
    vocab = build_vocab()
    first_char, last_char = vocab["0"], len(vocab) - 1
    num = GROUPS * group_size
    prompt_lens = np.repeat(rng.integers(2, 12, GROUPS), group_size).astype(np.int32)
    prompt_ids = rng.integers(first_char, last_char + 1, (num, int(prompt_lens.max()))).astype(np.int32)
    prompt_ids[:, 0] = vocab["<bos>"]
    prompt_ids[np.arange(prompt_ids.shape[1])[None, :] >= prompt_lens[:, None]] = 0
    completion_lens = np.clip(np.rint(rng.lognormal(np.log(8), 1.0, num)), 1, 64).astype(np.int32)
    width = int(completion_lens.max())
    completion_ids = rng.integers(first_char, last_char + 1, (num, width)).astype(np.int32)
    completion_ids[np.arange(width)[None, :] >= completion_lens[:, None]] = 0
    loss_mask = np.ones((num, width), bool)
    loss_mask[::3, 2:4] = False
    return RolloutBatch(
        batch_id=3, step=0, group_size=group_size,
        prompts=[Prompt(prompt_id=f"p{g}", text="") for g in range(GROUPS)],
        sample_ids=[f"p{i // group_size}-{i % group_size}" for i in range(num)],
        prompt_ids=prompt_ids, prompt_lens=prompt_lens, completion_ids=completion_ids,
        completion_lens=completion_lens, completions=[""] * num,
        behaviour_logprobs=np.zeros((num, width), np.float32), token_versions=np.zeros((num, width), np.int32),
        policy_version=0, rewards=rng.random(num).astype(np.float32), loss_mask=loss_mask,
    )


def off_policy(engine: TrainerEngine, batch: RolloutBatch, seed: int = 1) -> RolloutBatch:
    """Behaviour and reference log-probs near the engine's own (noise of 0.3 nats, so
    ratios leave 1, some clip, and the KL term is not 0), advantages assigned."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        current = compute_completion_logprobs(engine.module, batch).numpy()
    inside = np.arange(current.shape[1])[None, :] < batch.completion_lens[:, None]
    noisy = [np.where(inside, current + rng.normal(0, 0.3, current.shape), 0).astype(np.float32) for _ in range(2)]
    batch = msgspec.structs.replace(batch, behaviour_logprobs=noisy[0], ref_logprobs=noisy[1])
    return assign_advantages(batch, engine.algo)


def train(engine: TrainerEngine, batch: RolloutBatch, pass_tokens: int, chunk_size: int) -> tuple[dict, dict]:
    """(metrics, gradient of every parameter) of one ``train_micro_batch`` under the
    given plan; the gradients are dropped afterwards."""
    engine.pass_tokens, engine.chunk_size = pass_tokens, chunk_size
    metrics = engine.train_micro_batch(batch, scale=1.0)
    grads = {n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None}
    engine.discard_gradients()
    return metrics, grads


def assert_same_update(packed: tuple[dict, dict], dense: tuple[dict, dict]) -> None:
    assert packed[0]["loss"] == pytest.approx(dense[0]["loss"], rel=1e-5, abs=1e-7)
    assert packed[1].keys() == dense[1].keys() and len(dense[1]) > 0
    for name, grad in dense[1].items():
        assert grad.abs().sum() > 0, name  # every parameter is trained: a real comparison
        # Float rounding only: within 2e-6 of the parameter's largest gradient entry.
        torch.testing.assert_close(packed[1][name], grad, rtol=1e-4, atol=2e-6 * float(grad.abs().max()), msg=name)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_passes_give_the_dense_loss_and_gradients(checkpoint, loss_agg):
    algo = GrpoConfig(loss_agg=loss_agg, loss_norm_tokens=64, kl_coef=0.04)
    engine = TrainerEngine(checkpoint, TrainConfig(lr=1e-3, threads=1), algo, temperature=0.9, dtype="float32",
                           seed=0)
    batch = off_policy(engine, make_batch())
    dense = train(engine, batch, pass_tokens=0, chunk_size=batch.num_samples)  # one pass, padded to the longest
    packed = train(engine, batch, pass_tokens=BUDGET, chunk_size=batch.num_samples)
    assert dense[0]["passes"] == 1 and packed[0]["passes"] >= 4
    assert packed[0]["clip_frac"] > 0  # the clipped branch is exercised
    assert_same_update(packed, dense)
    # What a pass computes: the dense pass pads every row to the longest; the packed ones
    # waste far less. The same real tokens either way.
    assert packed[0]["pass_real_tokens"] == dense[0]["pass_real_tokens"] == batch.num_tokens
    dense_pad = 1 - dense[0]["pass_real_tokens"] / dense[0]["pass_tokens"]
    packed_pad = 1 - packed[0]["pass_real_tokens"] / packed[0]["pass_tokens"]
    assert packed[0]["pass_tokens_unpacked"] == dense[0]["pass_tokens"]
    assert dense_pad > 0.5 and packed_pad < dense_pad / 2


def test_dpo_pairs_stay_whole_and_give_the_dense_loss(checkpoint):
    engine = TrainerEngine(checkpoint, TrainConfig(lr=1e-3, threads=1), DpoConfig(beta=0.5), temperature=1.0,
                           dtype="float32", seed=0)
    assert engine.unit_rows == 2
    batch = off_policy(engine, make_batch(group_size=2, seed=5))
    passes = engine.plan_passes(msgspec.structs.replace(batch))
    assert all(len(p) % 2 == 0 and (p[1::2] == p[0::2] + 1).all() and (p[0::2] % 2 == 0).all() for p in passes)
    dense = train(engine, batch, pass_tokens=0, chunk_size=batch.num_samples)
    packed = train(engine, batch, pass_tokens=BUDGET, chunk_size=batch.num_samples)
    assert packed[0]["passes"] >= 3
    assert_same_update(packed, dense)


def test_decoupled_anchors_follow_their_samples_across_plans(checkpoint):
    # PPO's later epochs anchor each sample's ratio on the log-probs its first pass
    # computed, kept by sample id. Anchors taken under the packed plan (rows in another
    # order) and read under the dense one must be each sample's own: with unchanged
    # weights the anchored update is then the first pass's exactly.
    algo = GrpoConfig(off_policy="truncate", kl_coef=0.0)
    engine = TrainerEngine(checkpoint, TrainConfig(lr=1e-3, threads=1, ppo_epochs=2), algo, temperature=1.0,
                           dtype="float32", seed=0)
    assert engine.keeps_anchor
    batch = off_policy(engine, make_batch(seed=7))
    first = train(engine, batch, pass_tokens=BUDGET, chunk_size=batch.num_samples)
    assert len(engine._anchors) == batch.num_samples
    again = train(engine, batch, pass_tokens=0, chunk_size=5)
    assert_same_update(again, first)
    # A wrong anchor would move the ratio away from 1 for its sample: the clipped mean
    # ratio stays exactly 1 only when every anchor is the sample's own.
    assert again[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gathered_micro_batches_give_the_step_loss_and_gradients_of_one_at_a_time(checkpoint, loss_agg):
    # ``train.gather_micro_batches``: micro-batches that waited for the trainer together
    # are trained as one call, their rows packed into shared passes. The step's loss and
    # accumulated gradient must be those of training each alone at its own scale.
    from pipeline.memory.splitting import gather_micro_batches, split_rollout_batch_at
    from stages.trainer.stage import compute_micro_batch_scale, compute_step_loss

    algo = GrpoConfig(loss_agg=loss_agg, loss_norm_tokens=64, kl_coef=0.04)
    engine = TrainerEngine(checkpoint, TrainConfig(lr=1e-3, threads=1), algo, temperature=0.9, dtype="float32",
                           seed=0)
    engine.pass_tokens = BUDGET
    step_samples = 4 * GROUPS * GROUP  # this step is a quarter done after these
    parts = split_rollout_batch_at(off_policy(engine, make_batch(seed=3)), [1, 2, 1, 2])
    parts = [msgspec.structs.replace(p, batch_id=10 + k, policy_version=k) for k, p in enumerate(parts)]

    def grads() -> dict[str, torch.Tensor]:
        out = {n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None}
        engine.discard_gradients()
        return out

    alone = [engine.train_micro_batch(p, compute_micro_batch_scale(p, step_samples, loss_agg)) for p in parts]
    alone_loss = compute_step_loss([m["loss"] for m in alone], parts, step_samples, loss_agg)
    alone_grads = grads()
    unit = gather_micro_batches(parts)
    assert (unit.batch_id, unit.policy_version, unit.num_samples) == (10, 0, GROUPS * GROUP)
    metrics = engine.train_micro_batch(unit, compute_micro_batch_scale(unit, step_samples, loss_agg))
    gathered_loss, gathered_grads = compute_step_loss([metrics["loss"]], [unit], step_samples, loss_agg), grads()
    assert metrics["passes"] < sum(m["passes"] for m in alone)  # shared passes: fewer, fuller
    assert_same_update(({"loss": gathered_loss}, gathered_grads), ({"loss": alone_loss}, alone_grads))


def test_a_replayed_step_rebuilds_its_gathered_units_and_lands_on_the_same_weights(checkpoint):
    # ``conveyor replay`` trains a recorded step again from its micro-batches: the step
    # record names the units the trainer gathered, and replay must train those same
    # units (the same passes, the same float sums) to land on the same weights, bit for bit.
    from pipeline.memory.splitting import gather_micro_batches, split_rollout_batch_at
    from stages.trainer.stage import (
        compute_micro_batch_scale,
        compute_step_grad_scale,
        compute_step_loss,
        encode_gathers,
        train_recorded_step,
    )

    def fresh() -> TrainerEngine:
        engine = TrainerEngine(checkpoint, TrainConfig(lr=1e-3, threads=1), GrpoConfig(kl_coef=0.0),
                               temperature=0.9, dtype="float32", seed=0)
        engine.pass_tokens = BUDGET
        return engine

    live = fresh()
    step_samples = GROUPS * GROUP
    parts = split_rollout_batch_at(off_policy(live, make_batch(seed=4)), [2, 1, 1, 2])
    parts = [msgspec.structs.replace(p, batch_id=20 + k) for k, p in enumerate(parts)]
    units = [gather_micro_batches(parts[:3]), parts[3]]  # as the trainer took them
    agg = live.algo.loss_agg
    losses = [live.train_micro_batch(u, compute_micro_batch_scale(u, step_samples, agg))["loss"] for u in units]
    live.optimizer_step(compute_step_grad_scale(units, step_samples, agg))
    loss = compute_step_loss(losses, units, step_samples, agg)

    def weights(engine: TrainerEngine) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    replayed = fresh()
    again, _ = train_recorded_step(replayed, parts, step_samples, {"grad_norm": 0.0, **encode_gathers({20: [20, 21, 22]})})
    assert again == loss
    assert all(torch.equal(a, b) for a, b in zip(weights(live).values(), weights(replayed).values(), strict=True))
    # Without the record the micro-batches are trained one by one: other passes, other sums.
    alone = fresh()
    train_recorded_step(alone, parts, step_samples, {"grad_norm": 0.0})
    assert not all(torch.equal(a, b) for a, b in zip(weights(live).values(), weights(alone).values(), strict=True))
