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


@pytest.mark.parametrize("mode", [[], ["dataflow.async_execution=false", "dataflow.max_staleness=0"]],
                         ids=["streaming", "lock-step"])
def test_rollout_reward_and_reference_restart_in_either_mode(mode):
    assert _plan("run.max_restarts=7", *mode) == {"source": 0, "rollout": 7, "reward": 7, "reference": 7, "trainer": 0}
    df = build_dataflow(load_config("configs/quickstart.yaml"))
    # Outputs of a restarted stage may arrive twice: everything after the rollout de-duplicates.
    assert [n for n in df.nodes if df.downstream_of_restartable(n)] == ["reward", "reference", "trainer"]


def test_no_restarts_for_a_regrouping_reward_or_when_turned_off():
    assert _plan("algorithm.drop_zero_variance_groups=true")["reward"] == 0
    assert set(_plan("run.max_restarts=0").values()) == {0}


def test_a_source_cannot_be_restarted():
    with pytest.raises(GraphError, match="node 'src': a source cannot be restarted"):
        DataFlow().add_node("src", "x:y", None, max_restarts=1)


def test_a_tap_recorded_by_a_restartable_stage_is_refused_with_exit_2(capsys):
    from pipeline.cli import main
    from pipeline.config import ConfigError
    from pipeline.launch import record_taps

    def taps(*overrides: str) -> dict[str, str]:
        cfg = load_config("configs/quickstart.yaml", list(overrides))
        return record_taps(cfg, build_dataflow(cfg))

    # The trainer is never restarted: its input can be recorded; so can any edge without restarts.
    assert list(taps("record.edges=[reference->trainer]")) == ["reference->trainer"]
    assert list(taps("record.edges=[rollout->reward]", "run.max_restarts=0")) == ["rollout->reward"]
    with pytest.raises(ConfigError, match=r"record\.edges: 'rollout->reward' is recorded by 'reward'.*run\.max_restarts"):
        taps("record.edges=[rollout->reward]")
    code = main(["status", "--config", "configs/quickstart.yaml", "record.edges=[reward->reference]"])
    err = capsys.readouterr().err
    assert code == 2 and "record.edges" in err and "run.max_restarts" in err
