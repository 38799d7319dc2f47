"""How a micro-batch is shared between data-parallel trainer ranks (stages/trainer/ranks.py):
whole groups, balanced, fillers for ranks without a group, equal pass counts."""

from __future__ import annotations

import re

import pytest

from stages.trainer.pieces import compute_piece_weight
from stages.trainer.ranks import count_rank_passes, plan_rank_groups, split_for_ranks
from tests.unit.test_admission import make_batch


@pytest.mark.parametrize(("groups", "ranks", "want"), [
    (4, 2, [2, 2]),  # even
    (3, 2, [2, 1]),  # the first rank takes the extra group
    (7, 3, [3, 2, 2]),  # 7 = 3 * 2 + 1
    (1, 2, [1, 0]),  # fewer groups than ranks: rank 1 has none
    (2, 4, [1, 1, 0, 0]),
    (5, 1, [5]),  # one rank takes all
    (0, 2, [0, 0]),
])
def test_groups_per_rank_are_balanced_and_cover_the_batch(groups, ranks, want) -> None:
    got = plan_rank_groups(groups, ranks)
    assert got == want
    assert sum(got) == groups and max(got) - min(got) <= 1


def test_plan_refuses_zero_ranks() -> None:
    with pytest.raises(ValueError, match="ranks: expected >= 1"):
        plan_rank_groups(3, 0)


@pytest.mark.parametrize(("passes", "want"), [
    ([1, 1], [0, 0]),  # one pass each
    ([2, 1], [0, 1]),  # 2 passes vs 1
    ([3, 1, 1], [0, 2, 2]),  # 3 passes vs 1
    ([1, 4], [3, 0]),  # the busiest need not be rank 0
])
def test_every_rank_pads_to_the_busiest_ranks_passes(passes, want) -> None:
    assert count_rank_passes(passes) == want


def test_split_keeps_groups_whole_and_in_order() -> None:
    batch = make_batch(num_groups=3, group_size=2)
    parts = split_for_ranks(batch, 2)
    assert [(len(p.prompts), real) for p, real in parts] == [(2, True), (1, True)]
    assert [s for p, _ in parts for s in p.sample_ids] == list(batch.sample_ids)
    for part, _ in parts:  # a group's samples stay together
        assert {s.split(":")[1] for s in part.sample_ids} == {p.prompt_id for p in part.prompts}


def test_a_rank_without_a_group_gets_a_filler_of_the_first_group() -> None:
    batch = make_batch(num_groups=1, group_size=4)
    parts = split_for_ranks(batch, 3)
    assert [real for _, real in parts] == [True, False, False]
    assert all(p is parts[0][0] for p, _ in parts)


def test_rank_weights_of_a_split_sum_to_the_whole_loss() -> None:
    # completion_lens (i * 5) % 4 + 1 for i = 0..5: 1 2 3 4 1 2 -> 13 tokens; 2 + 1 groups
    # hold 1 + 2 + 3 + 4 = 10 and 1 + 2 = 3 tokens: token-mean weights 10/13 and 3/13.
    batch = make_batch(num_groups=3, group_size=2)
    parts = split_for_ranks(batch, 2)
    weights = [compute_piece_weight(p, batch, "token-mean") for p, _ in parts]
    assert weights == [10 / 13, 3 / 13]


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.num_ranks=2", "record.edges=[reference->trainer]"], "record.edges: replay retrains a recorded step"),
    (["train.num_ranks=0"], "train.num_ranks"),
])
def test_configs_the_ranks_cannot_run_are_refused(overrides, message) -> None:
    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


class FakeOomEngine:
    """A trainer engine whose every ``train_micro_batch`` runs out of memory; it counts
    the samples of each attempt."""

    chunk_size = 16
    gradients_tainted = False

    def __init__(self) -> None:
        self.attempts: list[int] = []

    def get_rng_state(self) -> bytes:
        return b""

    def set_rng_state(self, state: bytes) -> None:
        return None

    def train_micro_batch(self, batch, scale: float) -> dict[str, float]:
        import torch

        self.attempts.append(batch.num_samples)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("ranks", [1, 2])
def test_an_oom_is_halved_and_retried_with_one_rank_only(ranks) -> None:
    """One rank: 4 groups of 2 fail, then 2, then 1 group, which stops the run
    (``OomUnrecoverable``). Two ranks: the first error stops it as it is, untried again
    (the ranks' engine has already named the rank and how to shrink the work)."""
    import asyncio
    from types import SimpleNamespace

    import torch

    from pipeline.config import MemoryConfig
    from pipeline.memory.guard import MemoryGuard
    from pipeline.memory.oom import OomUnrecoverable
    from stages.trainer.stage import TrainerStage

    stage = TrainerStage()
    stage.cfg = SimpleNamespace(train=SimpleNamespace(num_ranks=ranks), algorithm=SimpleNamespace(loss_agg="token-mean"))
    stage.engine = FakeOomEngine()
    stage.guard = MemoryGuard("trainer", MemoryConfig())
    stage._estimate = lambda piece: 0
    batch = make_batch(num_groups=4, group_size=2)
    with pytest.raises(OomUnrecoverable if ranks == 1 else torch.OutOfMemoryError):
        asyncio.run(stage._train_recovering(batch, 1.0, batch))
    assert stage.engine.attempts == ([8, 4, 2] if ranks == 1 else [8])
