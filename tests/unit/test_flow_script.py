"""A user's DataFlow script (run.script, ``conveyor launch --script``): the PPO graph
written in Python equals the one configs/ppo.yaml builds, and bad scripts stop the
command with exit 2 naming run.script."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.launch import build_dataflow

FLOW = str(Path(__file__).parents[2] / "configs" / "ppo_flow.py")


def _shape(df):
    return [(s["name"], s["input_from"], s["replicas"], s["concurrency"]) for s in df.describe()["stages"]]


def test_the_python_flow_builds_the_yaml_graph():
    yaml_df = build_dataflow(load_config("configs/ppo.yaml"))
    script_df = build_dataflow(load_config("configs/ppo.yaml", [f"run.script={FLOW}"]))
    assert _shape(script_df) == _shape(yaml_df)
    assert [n for n, *_ in _shape(script_df)] == ["source", "rollout", "reward", "reward_model", "reference",
                                                  "critic", "trainer"]
    classes = {s["name"]: s["class"] for s in script_df.describe()["stages"]}
    assert classes["critic"] == "stages.trainer.critic:CriticStage"
    assert classes["trainer"] == "stages.trainer.ppo:PPOTrainerStage"
    # Placement from the config applies to the script's nodes by name.
    placed = build_dataflow(load_config("configs/ppo.yaml", [f"run.script={FLOW}", "placement.critic.num_cpus=2"]))
    assert placed.nodes["critic"].num_cpus == 2.0


def test_bad_scripts_are_refused_naming_run_script(tmp_path):
    with pytest.raises(ConfigError, match=r"run.script: .*does not exist"):
        build_dataflow(load_config("configs/ppo.yaml", [f"run.script={tmp_path / 'nope.py'}"]))
    empty = tmp_path / "empty.py"
    empty.write_text("def other(cfg):\n    return None\n")
    with pytest.raises(ConfigError, match=r"run.script: .* defines no 'build_dataflow' \(its functions: other\)"):
        build_dataflow(load_config("configs/ppo.yaml", [f"run.script={empty}"]))
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def build_dataflow(cfg):\n    return 3\n")
    with pytest.raises(ConfigError, match=r"returned int, expected a pipeline.dataflow.DataFlow"):
        build_dataflow(load_config("configs/ppo.yaml", [f"run.script={wrong}"]))
    with pytest.raises(ConfigError, match=r"run.script: set either a DataFlow script or dataflow.nodes"):
        load_config("configs/ppo.yaml", [f"run.script={FLOW}",
                                         "dataflow.nodes=[{name: a, node_class: 'x:y'}]"])


def test_launch_with_a_bad_script_exits_2_before_ray(tmp_path, capsys):
    from pipeline.cli import main

    code = main(["launch", "--config", "configs/ppo.yaml", "--script", str(tmp_path / "missing.py"),
                 f"run.dir={tmp_path / 'run'}"])
    assert code == 2 and "run.script" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
