"""The algorithm registry (stages/algorithms/registry.py) and exact streaming
aggregation (the trainer's scales, stages/trainer/stage.py) on a tiny torch policy."""

from __future__ import annotations

import math
import typing

import msgspec
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.config import ALGORITHM_NAMES, AlgorithmConfig
from pipeline.memory.splitting import split_rollout_batch_at
from stages.algorithms import ALGORITHMS, assign_advantages, assign_step_advantages, compute_policy_loss
from stages.algorithms.grpo import GrpoConfig
from stages.algorithms.reinforce_plus_plus import ReinforcePlusPlusConfig
from stages.algorithms.rloo import RlooConfig
from stages.trainer.pieces import compute_piece_weight
from stages.trainer.stage import compute_micro_batch_scale, compute_step_grad_scale, compute_step_loss
from tests.unit.test_admission import make_batch


def test_registry_and_config_name_the_same_algorithms():
    assert tuple(ALGORITHMS) == ALGORITHM_NAMES
    for cls in typing.get_args(AlgorithmConfig):
        entry = ALGORITHMS[cls.__struct_config__.tag]
        assert entry.needs_group == cls.group_baseline, entry.name
        assert entry.needs_values == (entry.name == "ppo")  # GAE reads the critic's values


def test_assign_advantages_fills_per_token_fields_without_mutating():
    batch = make_batch(num_groups=2, group_size=2)  # rewards 0 1 | 2 3, lens 1 2 | 3 4
    out = assign_advantages(batch, GrpoConfig())
    assert batch.advantages is None and batch.loss_mask is None  # a new value
    assert out.advantages.shape == out.loss_mask.shape == batch.completion_ids.shape == (4, 4)
    assert out.advantages.dtype == np.float32 and out.loss_mask.dtype == bool
    # each group [r, r + 1]: mean r + 0.5, population std 0.5 -> [-1, +1] on every valid token
    want = np.array([[-1, 0, 0, 0], [1, 1, 0, 0], [-1, -1, -1, 0], [1, 1, 1, 1]], dtype=np.float32)
    np.testing.assert_allclose(out.advantages, want, atol=1e-5, rtol=0)
    assert out.loss_mask.sum() == out.loss_tokens == batch.completion_tokens == 10
    # Dr. GRPO: no std: [-0.5, +0.5]; RLOO with pairs: [-1, +1]
    dr = assign_advantages(batch, GrpoConfig(norm_adv_by_std=False))
    assert dr.advantages[0, 0] == -0.5 and dr.advantages[3, 3] == 0.5
    rloo = assign_advantages(batch, RlooConfig())
    assert rloo.advantages[0, 0] == -1.0 and rloo.advantages[1, 1] == 1.0


def test_upstream_loss_mask_and_advantages_are_kept():
    batch = make_batch(num_groups=2, group_size=2)
    tool = np.ones((4, 4), dtype=bool)
    tool[3, 1] = False  # a tool-output token inside sample 3's completion
    masked = assign_advantages(msgspec.structs.replace(batch, loss_mask=tool), ReinforcePlusPlusConfig())
    assert masked.loss_tokens == 9 and not masked.loss_mask[3, 1] and masked.advantages[3, 1] == 0.0
    given = np.full((4, 4), 7.0, dtype=np.float32)
    kept = assign_advantages(msgspec.structs.replace(batch, advantages=given), GrpoConfig())
    assert kept.advantages is given and kept.loss_mask.sum() == 10


def test_pieces_carry_the_advantages_of_the_whole_micro_batch():
    # REINFORCE++ whitens over the micro-batch: a split after assignment keeps its numbers.
    whole = assign_advantages(make_batch(num_groups=4, group_size=2), ReinforcePlusPlusConfig())
    first, rest = split_rollout_batch_at(whole, [1, 3])
    np.testing.assert_array_equal(first.advantages, whole.advantages[:2, : first.advantages.shape[1]])
    np.testing.assert_array_equal(rest.advantages, whole.advantages[2:, : rest.advantages.shape[1]])


def test_token_mean_scales_rebuild_the_step_token_mean():
    # Step of 8 samples: micro-batch A (1 group, lens 1 2 -> 3 tokens), B (3 groups,
    # lens 1 2 3 4 1 2 -> 13 tokens). token-mean scale = tokens / 8 -> 3/8, 13/8; the step
    # rescales by 8 / 16: each micro-batch's token-mean counts with weight tokens / 16.
    a, b = make_batch(num_groups=1, batch_id=1), make_batch(num_groups=3, batch_id=2)
    assert compute_micro_batch_scale(a, 8, "token-mean") == 3 / 8
    assert compute_micro_batch_scale(b, 8, "token-mean") == 13 / 8
    assert compute_step_grad_scale([a, b], 8, "token-mean") == 0.5
    # losses 2 and 4 -> (3 * 2 + 13 * 4) / 16 = 3.625 (sample shares would give 3.5)
    assert compute_step_loss([2.0, 4.0], [a, b], 8, "token-mean") == pytest.approx(3.625, abs=1e-12)
    # seq modes: sample shares 2/8, 6/8 and no rescale -> 0.5 + 3 = 3.5
    assert compute_step_grad_scale([a, b], 8, "seq-mean-token-mean") == 1.0
    assert compute_step_loss([2.0, 4.0], [a, b], 8, "seq-mean-token-sum-norm") == pytest.approx(3.5, abs=1e-12)
    assert compute_step_grad_scale([], 8, "token-mean") == 0.0  # no token: no gradient


def _policy_logprobs(weight: torch.Tensor, batch, seed: int) -> torch.Tensor:
    """Tiny shared policy: fixed features [S, C, 5] @ weight [5, 7] -> log-probs of the
    completion ids (mod 7)."""
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(*batch.completion_ids.shape, 5, generator=gen)
    tokens = torch.as_tensor(batch.completion_ids.astype(np.int64) % 7)
    return torch.log_softmax(feats @ weight, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def test_seq_mean_scales_count_the_steps_non_empty_rows():
    # overlong_mask empties rows: A (2 samples) keeps both, B (6 samples) keeps 2 of 6
    # (4 cut by the length limit). The step's seq-mean runs over its 4 non-empty rows:
    # scales 2/8 and 2/8, step rescale 8/4 = 2; losses 2 (A's mean over 2 rows) and 4
    # (B's over 2 rows) -> (2*2 + 2*4) / 4 = 3.0 (sample shares 2/8, 6/8 gave 3.5).
    a, b = _overlong_batches(GrpoConfig(loss_agg="seq-mean-token-mean", overlong_mask=True))
    assert (a.loss_rows, b.loss_rows) == (2, 2)
    assert compute_micro_batch_scale(a, 8, "seq-mean-token-mean") == 2 / 8
    assert compute_micro_batch_scale(b, 8, "seq-mean-token-sum") == 2 / 8
    assert compute_step_grad_scale([a, b], 8, "seq-mean-token-mean") == 2.0
    assert compute_step_loss([2.0, 4.0], [a, b], 8, "seq-mean-token-mean") == pytest.approx(3.0, abs=1e-12)
    # seq-mean-token-sum-norm counts every row: 2/8, 6/8, rescale 8/8 -> 3.5
    assert compute_step_loss([2.0, 4.0], [a, b], 8, "seq-mean-token-sum-norm") == pytest.approx(3.5, abs=1e-12)


def _overlong_batches(cfg):
    """A: 1 group, both samples stopped; B: 3 groups, samples 0-3 cut by the length limit."""
    a = msgspec.structs.replace(make_batch(num_groups=1, batch_id=1), finish_reasons=["stop"] * 2)
    b = msgspec.structs.replace(make_batch(num_groups=3, batch_id=2), finish_reasons=["length"] * 4 + ["stop"] * 2)
    return [assign_advantages(x, cfg) for x in (a, b)]


@pytest.mark.parametrize("loss_agg,overlong", [
    ("token-mean", False), ("seq-mean-token-mean", False), ("seq-mean-token-sum-norm", False),
    ("token-mean", True), ("seq-mean-token-mean", True), ("seq-mean-token-sum", True),
    ("seq-mean-token-sum-norm", True)])
def test_streaming_gradient_equals_the_one_big_batch_gradient(loss_agg, overlong):
    """Uneven micro-batches (3 and 13 tokens, B split again in two pieces as an OOM
    split would) accumulated with the trainer's scales give the gradient of the loss
    over all 8 samples as one batch; also when ``overlong_mask`` empties rows unevenly
    (A keeps 2 of 2 rows, B 2 of 6)."""
    cfg = GrpoConfig(loss_agg=loss_agg, loss_norm_tokens=4, overlong_mask=overlong)
    torch.manual_seed(0)
    weight = torch.randn(5, 7, requires_grad=True)
    batches = (_overlong_batches(cfg) if overlong else
               [assign_advantages(make_batch(num_groups=g, batch_id=i), cfg) for i, g in ((1, 1), (2, 3))])
    behaviour = {b.batch_id: _policy_logprobs(weight, b, b.batch_id).detach() + 0.1 for b in batches}

    def piece_loss(piece, whole):
        logp = _policy_logprobs(weight, whole, whole.batch_id)
        rows = [whole.sample_ids.index(s) for s in piece.sample_ids]
        width = piece.completion_ids.shape[1]
        return compute_policy_loss(
            logp[rows, :width], behaviour[whole.batch_id][rows, :width], torch.as_tensor(piece.advantages),
            torch.as_tensor(piece.loss_mask), loss_agg=loss_agg, loss_norm_tokens=4,
        )[0]

    for batch in batches:
        pieces = split_rollout_batch_at(batch, [1, 2]) if batch.batch_id == 2 else [batch]
        scale = compute_micro_batch_scale(batch, 8, loss_agg)
        for piece in pieces:
            (piece_loss(piece, batch) * scale * compute_piece_weight(piece, batch, loss_agg)).backward()
    streamed = weight.grad * compute_step_grad_scale(batches, 8, loss_agg)

    weight.grad = None
    width = max(b.completion_ids.shape[1] for b in batches)
    cat = {k: torch.cat([F.pad(t, (0, width - t.shape[1])) for t in ts]) for k, ts in {
        "logp": [_policy_logprobs(weight, b, b.batch_id) for b in batches],
        "old": [behaviour[b.batch_id] for b in batches],
        "adv": [torch.as_tensor(b.advantages) for b in batches],
        "mask": [torch.as_tensor(b.loss_mask) for b in batches],
    }.items()}
    big, _ = compute_policy_loss(cat["logp"], cat["old"], cat["adv"], cat["mask"], loss_agg=loss_agg,
                                 loss_norm_tokens=4)
    big.backward()
    torch.testing.assert_close(streamed, weight.grad, rtol=1e-5, atol=1e-7)
    if loss_agg == "token-mean":
        # The old rule (sample shares of micro-batch token-means) is measurably different.
        weight.grad = None
        for batch in batches:
            (piece_loss(batch, batch) * batch.num_samples / 8).backward()
        assert not torch.allclose(weight.grad, streamed, rtol=1e-3, atol=1e-6)


def _step_of_two():
    # Two micro-batches of one group of 2 (lens 1, 2): A rewards 0, 1; B rewards 4, 4.
    a = make_batch(num_groups=1, batch_id=1)
    b = msgspec.structs.replace(make_batch(num_groups=1, batch_id=2), rewards=np.array([4.0, 4.0], np.float32))
    return a, b


def test_reinforce_pp_whitens_over_the_step_not_the_micro_batch():
    # gamma 1: every token carries its sample's reward. Step tokens: A 0 | 1 1, B 4 | 4 4
    # -> mean 14/6 = 7/3, squared deviations 49/9 + 2 * 16/9 + 3 * 25/9 = 156/9, unbiased
    # var 156/9 / 5 = 52/15, std 1.8618987 -> A: -7/3 / std = -1.2532, -4/3 / std = -0.7161;
    # B: 5/3 / std = 0.8951. (Per micro-batch B would be constant: all 0.)
    a, b = assign_step_advantages(list(_step_of_two()), ReinforcePlusPlusConfig())
    std = math.sqrt(52 / 15)
    np.testing.assert_allclose(a.advantages, [[-7 / 3 / std, 0.0], [-4 / 3 / std, -4 / 3 / std]], rtol=0, atol=1e-5)
    np.testing.assert_allclose(b.advantages, [[5 / 3 / std, 0.0], [5 / 3 / std, 5 / 3 / std]], rtol=0, atol=1e-5)


def test_trainer_holds_a_reinforce_pp_step_and_whitens_it_whole():
    import asyncio
    from types import SimpleNamespace

    from pipeline.config import load_config
    from stages.trainer.stage import TrainerStage, holds_whole_step

    cfg = load_config(None, ["algorithm.name=reinforce_plus_plus", "algorithm.kl_coef=0", "rollout.n=2",
                             "train.prompts_per_step=2", "dataflow.prompts_per_micro_batch=1"])
    assert holds_whole_step(cfg) and not holds_whole_step(load_config(None, []))  # grpo streams
    stage = TrainerStage()
    stage.cfg, stage.engine, stage.max_staleness = cfg, SimpleNamespace(version=5), 0  # make_batch: version 5
    stage.holds_step, stage.step_samples = True, 4
    trained = []

    async def train_into_step(unit):  # the engine's part, recorded
        trained.extend(batch for batch, _ in unit)

    stage._train_into_step = train_into_step
    a, b = _step_of_two()
    asyncio.run(stage.process(a))
    assert trained == []  # held: the step's whitening needs B too
    asyncio.run(stage.process(b))
    std = math.sqrt(52 / 15)  # as derived above
    assert [t.batch_id for t in trained] == [1, 2]
    assert trained[1].advantages[0, 0] == pytest.approx(5 / 3 / std, abs=1e-5)
