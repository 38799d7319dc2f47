"""Node declarations (``pipeline/contracts.py``): graphs whose edges do not fit are
refused by ``DataFlow.validate`` before anything starts, and a debug run's check of one
micro-batch names every mismatch."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.contracts import (
    Contract,
    WireMismatch,
    check_micro_batch,
    describe_micro_batch,
    inspect_first_micro_batch,
    read_contract,
)
from pipeline.dataflow import DataFlow, GraphError
from pipeline.plugins import stage_class
from pipeline.types import Prompt, PromptBatch, RolloutBatch, Span


class Prompts:
    gives = PromptBatch


class Generate:
    takes, gives = PromptBatch, RolloutBatch


class Score:
    takes = gives = RolloutBatch
    gives_fields = ("rewards",)


class Learn:
    takes = RolloutBatch
    takes_fields = ("rewards",)


class Anything:
    """Declares nothing: it may take or set anything."""


def chain(*classes: object) -> DataFlow:
    df = DataFlow()
    prev = None
    for i, cls in enumerate(classes):
        df.add_node(f"n{i}", cls, prev)
        prev = f"n{i}"
    return df


def test_a_chain_that_fits_validates() -> None:
    chain(Prompts, Generate, Score, Learn).validate()
    chain(Prompts, Anything, Learn).validate()  # undeclared upstream: left to the debug run


def test_a_type_mismatch_names_the_edge_and_both_types() -> None:
    with pytest.raises(GraphError, match=r"edge 'n0->n1': n0 gives PromptBatch, n1 takes RolloutBatch"):
        chain(Prompts, Score, Learn).validate()


def test_a_field_no_node_upstream_sets_is_refused() -> None:
    with pytest.raises(GraphError, match=r"edge 'n1->n2': n2 needs \['rewards'\] set.*\(n1, n0\)"):
        chain(Prompts, Generate, Learn).validate()


def test_the_built_in_stages_fit_and_a_trainer_without_reward_is_refused() -> None:
    full = [stage_class(n) for n in ("source", "rollout", "reward", "reference", "trainer")]
    chain(*full).validate()
    with pytest.raises(GraphError, match=r"n3 needs \['rewards'\] set"):
        chain(*[stage_class(n) for n in ("source", "rollout", "reference", "trainer")]).validate()
    with pytest.raises(GraphError, match=r"n0 gives PromptBatch, n1 takes RolloutBatch"):
        chain(stage_class("source"), stage_class("reward"), stage_class("trainer")).validate()


def test_malformed_declarations_name_the_node() -> None:
    class NotWire:
        takes = dict

    class BadField:
        takes = RolloutBatch
        takes_fields = ("reward",)

    class FieldsWithoutType:
        gives_fields = ("rewards",)

    with pytest.raises(ValueError, match="node 'x': takes: expected a wire type"):
        read_contract(NotWire, "x")
    with pytest.raises(ValueError, match=r"node 'x': takes_fields \['reward'\] are not optional fields of RolloutBatch"):
        read_contract(BadField, "x")
    with pytest.raises(ValueError, match="node 'x': gives_fields needs gives declared"):
        read_contract(FieldsWithoutType, "x")
    with pytest.raises(GraphError, match="node 'n1': takes: expected"):
        chain(Prompts, NotWire).validate()


def rollout_batch(rewards: np.ndarray | None = None, completion_rows: int = 2) -> RolloutBatch:
    return RolloutBatch(
        batch_id=3, step=0, prompts=[Prompt(prompt_id="p", text="q")], group_size=2, sample_ids=["a", "b"],
        prompt_ids=np.ones((2, 3), np.int32), prompt_lens=np.array([3, 3], np.int32),
        completion_ids=np.ones((completion_rows, 5), np.int32), completion_lens=np.array([5, 4], np.int32),
        completions=["x", "y"], behaviour_logprobs=np.zeros((2, 5), np.float32),
        token_versions=np.zeros((2, 5), np.int32), policy_version=0, rewards=rewards,
    )


def test_describe_lists_shapes_dtypes_and_lengths() -> None:
    lines = describe_micro_batch(rollout_batch(np.array([1.0, 0.0], np.float32)))
    assert lines[0] == "RolloutBatch"
    fields = {line.split()[0]: " ".join(line.split()[1:]) for line in lines[1:]}
    assert fields["completion_ids"] == "array [2, 5] int32"
    assert fields["rewards"] == "array [2] float32"
    assert fields["prompts"] == "list[Prompt] x1"
    assert fields["ref_logprobs"] == "None"
    assert fields["batch_id"] == "3"


def test_check_names_the_wrong_type_missing_fields_and_bad_rows() -> None:
    learn = read_contract(Learn, "trainer")
    assert check_micro_batch(rollout_batch(np.zeros(2, np.float32)), learn, "trainer") == []
    assert check_micro_batch(PromptBatch(batch_id=0, step=0, prompts=[]), learn, "trainer") == [
        "trainer takes RolloutBatch, got PromptBatch"]
    assert check_micro_batch(rollout_batch(), learn, "trainer") == ["trainer needs rewards set, got None"]
    assert check_micro_batch(Span(stage="s", kind="busy", start=0, end=1), Contract(), "any") == []


def test_first_micro_batch_inspection_prints_or_raises_naming_the_edge() -> None:
    learn = read_contract(Learn, "trainer")
    text = inspect_first_micro_batch("reward->trainer", rollout_batch(np.zeros(2, np.float32)), learn, "trainer")
    assert text.startswith("[debug] first micro-batch on edge 'reward->trainer': RolloutBatch")
    assert "array [2, 5] int32" in text
    with pytest.raises(WireMismatch, match=r"edge 'reward->trainer': trainer needs rewards set, got None"):
        inspect_first_micro_batch("reward->trainer", rollout_batch(), learn, "trainer")
    # One row per sample: a completion array of 3 rows for 2 samples is named.
    with pytest.raises(WireMismatch, match="completion_ids has 3 rows, expected 2"):
        inspect_first_micro_batch("reward->trainer", rollout_batch(np.zeros(2, np.float32), completion_rows=3),
                                  learn, "trainer")
