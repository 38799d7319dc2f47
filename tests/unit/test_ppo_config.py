"""PPO's config and graph: the critic stage joins the chain when the algorithm needs
values, is never restarted (it holds training state), and configs it cannot serve are
refused before anything starts."""

from __future__ import annotations

import typing

import pytest

from pipeline.config import AlgorithmConfig, ConfigError, load_config
from pipeline.launch import build_dataflow
from stages.algorithms import ALGORITHMS


def test_registry_entries_that_need_values_are_the_configs_that_need_a_critic():
    for cls in typing.get_args(AlgorithmConfig):
        assert ALGORITHMS[cls.__struct_config__.tag].needs_values == cls.needs_critic


def test_ppo_graph_puts_the_critic_before_the_trainer():
    cfg = load_config("configs/quickstart.yaml", ["algorithm.name=ppo", "run.max_restarts=3"])
    assert cfg.critic_enabled
    df = build_dataflow(cfg)
    assert df.topological_order() == ["source", "rollout", "reward", "reference", "critic", "trainer"]
    assert df.nodes["critic"].max_restarts == 0 and df.nodes["reference"].max_restarts == 3
    # Without any KL term the reference drops out and the critic reads the reward's output.
    plain = load_config("configs/quickstart.yaml", ["algorithm.name=ppo", "algorithm.kl_coef=0"])
    assert build_dataflow(plain).topological_order() == ["source", "rollout", "reward", "critic", "trainer"]
    grpo = load_config("configs/quickstart.yaml")
    assert not grpo.critic_enabled and "critic" not in build_dataflow(grpo).nodes


def test_ppo_with_an_adaptive_kl_controller_is_refused():
    with pytest.raises(ConfigError, match=r"algorithm.kl_ctrl.type: expected 'fixed' with algorithm.name 'ppo'"):
        load_config("configs/quickstart.yaml", ["algorithm.name=ppo", "algorithm.use_kl_in_reward=true",
                                                "algorithm.kl_ctrl.type=adaptive"])


def test_critic_keys_are_validated_with_their_path():
    with pytest.raises(ConfigError, match=r"critic.lr"):
        load_config("configs/quickstart.yaml", ["critic.lr=-1"])
    with pytest.raises(ConfigError, match=r"critic.epochs"):
        load_config("configs/quickstart.yaml", ["critic.epochs=0"])
