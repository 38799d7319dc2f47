"""Ray tier: an error on any data-parallel trainer rank stops ``DataParallelEngine``
at once with ``TrainerRankError`` naming the rank, while rank 0 waits in what stands for
a collective (``FakeBlockedRankZero``) or the others do (``FakeTrainerRank``)."""

from __future__ import annotations

import pytest
import ray

from stages.trainer.ranks import DataParallelEngine, TrainerRankError
from tests.ray_local.fakes import FakeBlockedRankZero, FakeTrainerRank
from tests.unit.test_admission import make_batch

FakeRankActor = ray.remote(num_cpus=0)(FakeTrainerRank)


def test_an_error_on_rank_1_stops_rank_0_waiting_in_a_collective(ray_cluster):
    local = FakeBlockedRankZero()
    engine = DataParallelEngine(local, [FakeRankActor.remote("fake failure in forward")], ["", ""])
    try:
        with pytest.raises(TrainerRankError, match=r"trainer rank 1 of 2 failed: ValueError: fake failure in forward"):
            engine.train_micro_batch(make_batch(num_groups=4), 1.0)
    finally:
        local.release.set()  # rank 0's thread: out of its stand-in collective
    # The engine is done: a later call raises the same error without running anything.
    local.release.clear()  # it would wait again if it ran
    with pytest.raises(TrainerRankError, match="trainer rank 1 of 2"):
        engine.train_micro_batch(make_batch(num_groups=4), 1.0)


def test_an_oom_on_rank_1_is_fatal_and_says_how_to_shrink_the_work(ray_cluster):
    local = FakeBlockedRankZero()
    engine = DataParallelEngine(local, [FakeRankActor.remote("oom"), FakeRankActor.remote(None)], ["", "", ""])
    try:
        with pytest.raises(TrainerRankError) as info:
            engine.train_micro_batch(make_batch(num_groups=6), 1.0)
    finally:
        local.release.set()
    text = str(info.value)
    assert text.startswith("trainer rank 1 of 3 failed: OutOfMemoryError: CUDA out of memory"), text
    assert "train.num_ranks=3" in text and "dataflow.prompts_per_micro_batch" in text, text


def test_an_error_on_rank_0_stops_the_ranks_waiting_for_it(ray_cluster):
    """Rank 2 would wait forever (as in a collective rank 0 never reaches): it is killed."""
    ranks = [FakeRankActor.remote(None), FakeRankActor.remote(None)]
    engine = DataParallelEngine(FakeBlockedRankZero(error=ValueError("bad batch")), ranks, ["", "", ""])
    with pytest.raises(TrainerRankError, match=r"trainer rank 0 of 3 failed: ValueError: bad batch"):
        engine.train_micro_batch(make_batch(num_groups=6), 1.0)
    for actor in ranks:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.train.remote(make_batch(num_groups=1), 1.0, 0))
