"""The worked node of docs/custom-nodes.md (configs/length_penalty_flow.py) runs as the
doc says, and a core that assigns to a frozen batch fails with an error saying how."""

from __future__ import annotations

import asyncio
import runpy
from pathlib import Path

import msgspec
import numpy as np
import pytest

from pipeline.config import load_config
from pipeline.launch import build_dataflow
from pipeline.stage import core_error_message
from pipeline.types import Prompt, RolloutBatch

FLOW = str(Path(__file__).parents[2] / "configs" / "length_penalty_flow.py")


def _batch(rewards: list[float], completion_lens: list[int]) -> RolloutBatch:
    s, c = len(rewards), max(completion_lens)
    return RolloutBatch(
        batch_id=0, step=0, prompts=[Prompt(prompt_id="p0", text="12")], group_size=s,
        sample_ids=[f"p0/{i}" for i in range(s)], prompt_ids=np.zeros((s, 2), np.int32),
        prompt_lens=np.full(s, 2, np.int32), completion_ids=np.zeros((s, c), np.int32),
        completion_lens=np.array(completion_lens, np.int32), completions=["x" * n for n in completion_lens],
        behaviour_logprobs=np.zeros((s, c), np.float32), token_versions=np.zeros((s, c), np.int32),
        policy_version=0, rewards=np.array(rewards, np.float32))


def _node_class() -> type:
    return runpy.run_path(FLOW)["LengthPenalty"]


def test_the_script_inserts_the_node_between_reward_and_reference():
    df = build_dataflow(load_config("configs/quickstart.yaml", [f"run.script={FLOW}"]))
    edges = [(s["input_from"], s["name"]) for s in df.describe()["stages"]]
    assert ("reward", "length_penalty") in edges and ("length_penalty", "reference") in edges
    df.validate()  # the declared contracts fit every edge


def test_the_node_returns_a_new_batch_with_penalised_rewards():
    node = _node_class()(per_token=0.5)
    before = _batch([1.0, 0.0], [2, 4])
    after = asyncio.run(node.process(before))
    # 1.0 - 0.5 * 2 = 0.0; 0.0 - 0.5 * 4 = -2.0; the input batch is left as it was.
    np.testing.assert_allclose(after.rewards, [0.0, -2.0])
    np.testing.assert_allclose(before.rewards, [1.0, 0.0])
    assert after.sample_ids == before.sample_ids


def test_assigning_to_a_frozen_batch_names_the_way_to_change_it():
    batch = _batch([1.0], [1])
    with pytest.raises(AttributeError) as info:
        batch.rewards = np.zeros(1, np.float32)  # what a first try at a node does
    message = core_error_message(info.value)
    assert message.startswith("AttributeError: immutable type: 'RolloutBatch'")
    assert "msgspec.structs.replace(batch, rewards=" in message and "docs/custom-nodes.md" in message
    # Any other error keeps its plain form.
    assert core_error_message(ValueError("bad")) == "ValueError: bad"
    # The suggested call works on the real wire type.
    assert msgspec.structs.replace(batch, rewards=np.zeros(1, np.float32)).rewards[0] == 0.0
