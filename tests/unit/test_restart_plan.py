"""Which stages of a run are restarted after a death (``run.max_restarts``), and which
consumers then de-duplicate; no Ray."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from pipeline.dataflow import DataFlow, GraphError
from pipeline.launch import build_dataflow


def _plan(*overrides: str) -> dict[str, int]:
    df = build_dataflow(load_config("configs/quickstart.yaml", list(overrides)))
    return {name: node.max_restarts for name, node in df.nodes.items()}


def test_streaming_restarts_rollout_reward_and_reference_only():
    assert _plan("run.max_restarts=7") == {"source": 0, "rollout": 7, "reward": 7, "reference": 7, "trainer": 0}
    df = build_dataflow(load_config("configs/quickstart.yaml"))
    # Outputs of a restarted stage may arrive twice: everything after the rollout de-duplicates.
    assert [n for n in df.nodes if df.downstream_of_restartable(n)] == ["reward", "reference", "trainer"]


def test_no_restarts_in_lockstep_or_for_a_regrouping_reward():
    assert set(_plan("dataflow.async_execution=false", "dataflow.max_staleness=0").values()) == {0}
    assert _plan("algorithm.drop_zero_variance_groups=true")["reward"] == 0
    assert set(_plan("run.max_restarts=0").values()) == {0}


def test_a_source_cannot_be_restarted():
    with pytest.raises(GraphError, match="node 'src': a source cannot be restarted"):
        DataFlow().add_node("src", "x:y", None, max_restarts=1)
