"""Dynamic sampling (zero-variance groups dropped, kept groups regrouped) and DAPO's soft
overlong penalty (stages/rewards/shaping.py); the trainer's step statistics and its
account of prompts dropped upstream."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from pipeline.memory.splitting import merge_rollout_batches, split_rollout_batch
from pipeline.types import RolloutBatch
from stages.rewards.shaping import (
    ZERO_VARIANCE,
    GroupFilter,
    NoLearningSignalError,
    compute_overlong_penalty,
    find_zero_variance_groups,
)
from stages.trainer.checkpoint import TrainerCheckpoints
from stages.trainer.metrics import summarise_step_batches
from tests.unit.test_admission import make_batch


def scored(rewards: list[float], batch_id: int, first_index: int, version: int = 5) -> RolloutBatch:
    """A batch of len(rewards) / 2 groups of 2 with these rewards; prompt k has index first_index + k."""
    batch = make_batch(num_groups=len(rewards) // 2, group_size=2, batch_id=batch_id)
    prompts = [msgspec.structs.replace(p, index=first_index + k) for k, p in enumerate(batch.prompts)]
    return msgspec.structs.replace(batch, prompts=prompts, rewards=np.array(rewards, dtype=np.float32),
                                   policy_version=version)


def test_overlong_penalty_is_linear_over_the_buffer():
    # max 10, buffer 4: free up to 6 tokens, then -(len - 6) / 4: 5, 6 -> 0; 8 -> -0.5; 10 -> -1
    pen = compute_overlong_penalty(np.array([5, 6, 8, 10]), max_tokens=10, buffer_len=4)
    np.testing.assert_array_equal(pen, np.array([0.0, 0.0, -0.5, -1.0], dtype=np.float32))
    np.testing.assert_array_equal(compute_overlong_penalty(np.array([8, 10]), 10, 4, factor=0.5), [-0.25, -0.5])
    assert not compute_overlong_penalty(np.array([10]), 10, 0).any()  # buffer 0: off


def test_zero_variance_groups_are_exactly_the_constant_ones():
    zero = find_zero_variance_groups(np.array([1, 1, 0, 1, 0.5, 0.5, 0, 1e-7]), group_size=2)
    assert zero.tolist() == [True, False, True, False]


def test_filter_drops_constant_groups_and_emits_whole_micro_batches_in_order():
    filt = GroupFilter(groups_per_batch=4, prompts_per_step=8)
    # batch 7: groups g0 [1 1] and g2 [2 2] are constant; g1, g3 kept (2 of the 4 needed)
    out, dropped = filt.add(scored([1, 1, 0, 1, 2, 2, 3, 4], batch_id=7, first_index=0, version=5))
    assert out == [] and dropped == 2 and filt.dropped_groups == 2
    # batch 8: nothing constant; 2 waiting + its first 2 groups make a micro-batch
    out, dropped = filt.add(scored([0, 1, 1, 0, 0, 2, 5, 6], batch_id=8, first_index=4, version=6))
    assert dropped == 0 and len(out) == 1
    joined = out[0]
    assert joined.sample_ids == ["b7:g1:0", "b7:g1:1", "b7:g3:0", "b7:g3:1",
                                 "b8:g0:0", "b8:g0:1", "b8:g1:0", "b8:g1:1"]
    assert joined.rewards.tolist() == [0, 1, 3, 4, 0, 1, 1, 0]
    # the id and step of the batch its first group came from; the oldest version
    assert (joined.batch_id, joined.step, joined.policy_version) == (7, 3, 5)
    assert joined.dropped_prompts == {ZERO_VARIANCE: [0, 2]}  # batch 7's g0 and g2, handed on once
    assert [p.index for p in joined.prompts] == [1, 3, 4, 5]
    # end of stream: the 2 groups left go out short (a stopped run), nothing pending
    (rest,) = filt.flush()
    assert rest.batch_id == 8 and [p.index for p in rest.prompts] == [6, 7] and rest.dropped_prompts == {}
    assert filt.flush() == []


def test_filter_passes_a_clean_batch_through_unchanged():
    filt = GroupFilter(groups_per_batch=4, prompts_per_step=8)
    batch = scored([0, 1, 1, 0, 0, 2, 5, 6], batch_id=3, first_index=0)
    out, dropped = filt.add(batch)
    assert out == [batch] and out[0] is batch and dropped == 0


def test_a_short_batch_waits_for_a_whole_micro_batch():
    # The source grants only the room a drop reopened: a 1-group batch must not reach the
    # trainer alone, or a step could take 4 + 4 + 1 groups and the run's last step never fill.
    filt = GroupFilter(groups_per_batch=2, prompts_per_step=4)
    out, _ = filt.add(scored([0, 1], batch_id=5, first_index=0))
    assert out == [] and len(filt.kept) == 1
    out, _ = filt.add(scored([0, 1, 1, 0], batch_id=6, first_index=1))
    assert [len(b.prompts) for b in out] == [2] and [p.index for p in out[0].prompts] == [0, 1]
    assert len(filt.kept) == 1


def test_drops_left_at_the_end_ride_an_empty_batch():
    filt = GroupFilter(groups_per_batch=2, prompts_per_step=2)
    out, dropped = filt.add(scored([1, 1, 0, 0], batch_id=9, first_index=10))
    assert out == [] and dropped == 2
    (carrier,) = filt.flush()
    assert carrier.num_samples == 0 and carrier.prompts == [] and carrier.rewards.shape == (0,)
    assert carrier.batch_id == -10  # -1 - 9: no source batch has it
    assert carrier.completion_ids.shape == (0, 0) and carrier.dropped_prompts == {ZERO_VARIANCE: [10, 11]}


def test_filter_stops_a_run_without_learning_signal():
    filt = GroupFilter(groups_per_batch=2, prompts_per_step=1)  # at most 100 constant groups in a row
    for k in range(50):
        filt.add(scored([0, 0, 1, 1], batch_id=k, first_index=2 * k))
    with pytest.raises(NoLearningSignalError, match="algorithm.drop_zero_variance_groups"):
        filt.add(scored([0, 0, 1, 1], batch_id=50, first_index=100))  # the 101st and 102nd


def test_a_kept_group_resets_the_run_of_drops():
    filt = GroupFilter(groups_per_batch=2, prompts_per_step=1)
    for k in range(60):
        filt.add(scored([0, 0, 0, 1] if k == 40 else [0, 0, 1, 1], batch_id=k, first_index=2 * k))
    assert filt.consecutive == 19 * 2 and filt.dropped_groups == 119


def test_split_and_merge_keep_dropped_prompts_once():
    batch = msgspec.structs.replace(make_batch(num_groups=4), dropped_prompts={ZERO_VARIANCE: [3, 9]})
    pieces = split_rollout_batch(batch, 2)
    assert pieces[0].dropped_prompts == {ZERO_VARIANCE: [3, 9]} and pieces[1].dropped_prompts == {}
    assert merge_rollout_batches(pieces).dropped_prompts == {ZERO_VARIANCE: [3, 9]}


def test_step_statistics_count_groups_dropped_upstream():
    # rewards [1 1 | 0 1]: one constant group trained, 2 dropped upstream -> 3 / 4
    batch = msgspec.structs.replace(make_batch(num_groups=2), rewards=np.array([1, 1, 0, 1], dtype=np.float32))
    out = summarise_step_batches([batch], zero_variance_dropped=2)
    assert out["batch/zero_std_frac"] == 0.75
    # lengths (i * 5) % 4 + 1 = 1 2 3 4; finish reasons length/stop alternating
    assert out["response_length/mean"] == 2.5 and out["response_length/max"] == 4
    assert out["response_length/truncated_frac"] == 0.5
    assert summarise_step_batches([batch])["batch/zero_std_frac"] == 0.5


def test_trainer_account_takes_upstream_drops_into_its_done_set():
    cfg = SimpleNamespace(run_dir=None, train=SimpleNamespace(checkpoint_every=0, keep_checkpoints=1, resumable=True),
                          data=SimpleNamespace(curriculum=None))
    ckpt = TrainerCheckpoints(cfg, engine=None)
    ckpt.record_dropped_prompts([0, 2], ZERO_VARIANCE)
    ckpt.record_drop(scored([0, 1], batch_id=1, first_index=1), "stale")
    assert ckpt.dropped == {ZERO_VARIANCE: 2, "stale": 1}
    assert ckpt.accounting() == {"done": {"frontier": 3, "above": []}, "done_count": 3}


def test_trainer_records_a_carriers_drops_and_trains_nothing():
    from stages.trainer.stage import TrainerStage

    filt = GroupFilter(groups_per_batch=2, prompts_per_step=2)
    filt.add(scored([1, 1, 0, 0], batch_id=9, first_index=10))
    (carrier,) = filt.flush()
    stage = TrainerStage()  # no engine: an empty batch must not reach it
    cfg = SimpleNamespace(run_dir=None, train=SimpleNamespace(checkpoint_every=0, keep_checkpoints=1, resumable=True),
                          data=SimpleNamespace(curriculum=None))
    stage.checkpoints = TrainerCheckpoints(cfg, engine=None)
    assert asyncio.run(stage.process(carrier)) is None
    assert stage.dropped == {ZERO_VARIANCE: 4}  # 2 prompts x group of 2, in samples
    assert stage.checkpoints.dropped == {ZERO_VARIANCE: 2}
    assert stage.checkpoints.accounting() == {"done": {"frontier": 0, "above": [10, 11]}, "done_count": 2}
    assert stage._take_zero_variance() == 2 and stage._take_zero_variance() == 0
