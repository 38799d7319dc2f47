"""De-duplication of redelivered micro-batches (``pipeline/delivery.py``)."""

from __future__ import annotations

import msgspec

from pipeline.delivery import MIN_DEDUP_WINDOW, SeenGroups, dedup_window, group_key
from pipeline.types import Prompt, PromptBatch
from tests.ray_local.fakes import make_fake_rollout_batch


def test_a_batch_seen_before_is_dropped_and_a_new_one_passes_unchanged():
    seen = SeenGroups()
    first = make_fake_rollout_batch(0, num_groups=3)
    assert seen.filter(first) is first
    assert seen.filter(first) is None  # delivered again after a death: all 3 groups known
    other = make_fake_rollout_batch(1, num_groups=2)
    assert seen.filter(other) is other
    assert seen.dropped_groups == 3


def test_a_partly_seen_batch_keeps_only_its_new_groups_whole():
    seen = SeenGroups()
    batch = make_fake_rollout_batch(4, num_groups=4, group_size=2)
    # Groups 1 and 3 arrived before (in a piece of this batch cut elsewhere).
    seen.filter(msgspec.structs.replace(make_fake_rollout_batch(4, num_groups=1), prompts=[batch.prompts[1]]))
    seen.filter(msgspec.structs.replace(make_fake_rollout_batch(4, num_groups=1), prompts=[batch.prompts[3]]))
    kept = seen.filter(batch)
    assert [p.prompt_id for p in kept.prompts] == ["b4/g0", "b4/g2"]
    # Each kept group has its own 2 samples, in order, with their values.
    assert kept.sample_ids == ["b4/g0/0", "b4/g0/1", "b4/g2/0", "b4/g2/1"]
    assert kept.rewards.tolist() == [0.0, 1.0, 4.0, 5.0]
    assert seen.dropped_groups == 2


def test_prompt_batches_and_keys():
    seen = SeenGroups()
    rows = [Prompt(prompt_id=f"p{i}", text="", index=i) for i in range(3)]
    seen.filter(PromptBatch(batch_id=0, step=0, prompts=rows[:2]))
    kept = seen.filter(PromptBatch(batch_id=1, step=0, prompts=rows))
    assert [p.index for p in kept.prompts] == [2]
    # The row index is the key; a custom source without one is keyed by its prompt id.
    assert group_key(rows[1]) == 1 and group_key(Prompt(prompt_id="x", text="")) == "x"


def test_memory_is_bounded_by_the_window():
    seen = SeenGroups(window=4)
    for i in range(10):
        seen.filter(PromptBatch(batch_id=i, step=0, prompts=[Prompt(prompt_id=f"p{i}", text="", index=i)]))
    assert len(seen._keys) == 4 and len(seen._order) == 4
    # The newest 4 are remembered, older ones forgotten.
    assert seen.filter(PromptBatch(batch_id=9, step=0, prompts=[Prompt(prompt_id="p9", text="", index=9)])) is None


def test_window_covers_four_times_what_can_be_in_flight():
    from pipeline.config import load_config
    from pipeline.launch import build_dataflow

    keys = ["dataflow.queue_size=64", "dataflow.prompts_per_micro_batch=8", "train.prompts_per_step=64"]
    df = build_dataflow(load_config("configs/quickstart.yaml", keys))
    # 4 edges of 64 items; in the stages source 1 + rollout 4 + reward 1 + reference 1 +
    # trainer 1 = 8 items: (256 + 8) items x 8 groups + a step of 64 = 2176; x 4 = 8704.
    assert dedup_window(df, 8, 64) == 8704
    # The quickstart: (16 + 8) x 4 + 8 = 104, x 4 = 416, below the floor.
    assert dedup_window(build_dataflow(load_config("configs/quickstart.yaml")), 4, 8) == MIN_DEDUP_WINDOW == 1024
