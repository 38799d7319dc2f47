"""Config decoding: errors name the dotted path; overrides apply; shipped YAMLs decode."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config import ConfigError, apply_overrides, load_config

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("dataflow.max_staleness=-1", "dataflow.max_staleness: expected int >= 0, got -1"),
        ("dataflow.foo=1", "dataflow.foo: unknown field"),
        ("train.lr=abc", "train.lr: expected float, got str"),
        ("rollout.top_p=2", "rollout.top_p: expected float <= 1.0, got 2"),
        ("rollout.n=1", "rollout.n: expected >= 2 for GRPO"),
        ("train.prompts_per_step=6", "train.prompts_per_step: expected a multiple of dataflow.prompts_per_micro_batch"),
        ("train.sync_interval=3", "dataflow.max_staleness: expected >= train.sync_interval - 1 (2)"),
        ("dataflow.nodes=[{name: a}]", "dataflow.nodes[0].node_class: required field missing"),
        ("rollout.backend=nope", "rollout.backend: expected 'vllm', 'hf' or 'module:attr'"),
        ("model.dtype=int8", "model.dtype: expected one of"),
    ],
)
def test_bad_values_name_their_path(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


def test_overrides_apply_and_yaml_floats_parse():
    cfg = load_config(None, ["train.lr=1e-5", "dataflow.async_execution=false", "rollout.max_memory_ratio=0.5"])
    assert cfg.train.lr == 1e-5  # YAML 1.1 reads "1e-5" as a string; it still converts
    assert cfg.dataflow.async_execution is False
    assert cfg.rollout.memory.max_memory_ratio == 0.5  # the shorthand lands in its section


def test_override_into_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match="train.lr is not a section"):
        apply_overrides({"train": {"lr": 1.0}}, ["train.lr.x=1"])


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        load_config(None, ["train.lr"])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_decodes(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# conveyor "), f"{path.name} must open with the command that runs it"
    cfg = load_config(path)
    assert cfg.run.steps >= 1


def test_shipped_configs_exist():
    assert any(p.name == "quickstart.yaml" for p in CONFIGS)


def test_cli_bad_config_exits_2_with_path(capsys):
    code = main(["status", "--config", str(CONFIGS[0]), "dataflow.max_staleness=-1"])
    assert code == 2
    assert "dataflow.max_staleness: expected int >= 0, got -1" in capsys.readouterr().err


def test_cli_status_prints_queue_table(capsys):
    assert main(["status", "--config", str(CONFIGS[0])]) == 0
    out = capsys.readouterr().out
    for needle in ("queue", "producer", "consumer", "bound", "rollout->reward"):
        assert needle in out


def test_cli_unknown_record_edge_exits_2(capsys):
    code = main(["status", "--config", str(CONFIGS[0]), "record.edges=[trainer->nowhere]"])
    assert code == 2
    assert "record.edges" in capsys.readouterr().err
