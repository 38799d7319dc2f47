"""DataFlow validation: every rule names the node at fault."""

from __future__ import annotations

import pytest

from pipeline.dataflow import DataFlow, GraphError
from pipeline.plugins import import_object


def chain(*names: str) -> DataFlow:
    df = DataFlow()
    prev = None
    for n in names:
        df.add_node(n, "builtins:object", prev)
        prev = n
    return df


def test_valid_chain_orders_topologically():
    df = chain("source", "rollout", "reward", "trainer")
    assert df.topological_order() == ["source", "rollout", "reward", "trainer"]
    assert df.edge_names == ["source->rollout", "rollout->reward", "reward->trainer"]
    assert df.terminal == "trainer"


def test_unknown_input_from_is_named():
    df = chain("source", "rollout")
    df.add_node("reward", "builtins:object", "rolout")
    with pytest.raises(GraphError, match="node 'reward': input_from 'rolout' is not a node"):
        df.validate()


def test_duplicate_name():
    df = chain("source")
    with pytest.raises(GraphError, match="node 'source': duplicate name"):
        df.add_node("source", "builtins:object")


def test_cycle_is_reported():
    df = DataFlow()
    df.add_node("a", "builtins:object", "b")
    df.add_node("b", "builtins:object", "a")
    df.add_node("s", "builtins:object", None)
    with pytest.raises(GraphError, match="cycle"):
        df.validate()


def test_node_nobody_consumes():
    df = chain("source", "rollout", "trainer")
    df.add_node("orphan", "builtins:object", "source")
    with pytest.raises(GraphError, match="'trainer', 'orphan' are not consumed"):
        df.validate()


def test_queue_size_for_missing_edge():
    df = chain("source", "trainer")
    df.queue_sizes["source->nowhere"] = 3
    with pytest.raises(GraphError, match="no such edge"):
        df.validate()


def test_fan_out_is_allowed_and_bounds_apply():
    df = DataFlow()
    df.add_node("source", "builtins:object")
    df.add_node("a", "builtins:object", "source", queue_size=7)
    df.add_node("b", "builtins:object", "a")
    assert df.queue_bound("source", "a") == 7
    assert df.queue_bound("a", "b") == df.default_queue_size


def test_import_object_errors_name_the_path():
    with pytest.raises(ImportError, match="cannot import module 'no_such_mod'"):
        import_object("no_such_mod:x")
    with pytest.raises(ImportError, match="has no attribute 'nope'"):
        import_object("json:nope")
    assert import_object("json:dumps").__name__ == "dumps"


def test_setups_run_in_waves_after_the_nodes_each_names():
    df = chain("source", "rollout", "reward", "trainer")
    assert df.setup_waves() == [["source", "rollout", "reward", "trainer"]]
    df.nodes["trainer"].setup_after = ("rollout",)
    df.nodes["reward"].setup_after = ("trainer",)
    assert df.setup_waves() == [["source", "rollout"], ["trainer"], ["reward"]]
    df.nodes["rollout"].setup_after = ("reward",)
    with pytest.raises(GraphError, match=r"setup_after loops among \['reward', 'rollout', 'trainer'\]"):
        df.setup_waves()
    df.nodes["rollout"].setup_after = ("rolout",)
    with pytest.raises(GraphError, match=r"node 'rollout': setup_after \['rolout'\] names no other node"):
        df.setup_waves()
