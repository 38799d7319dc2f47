"""Typed run configuration: one YAML file, decoded into msgspec Structs, one module per section.

Guarantees:
- Every field is typed and bounded; an unknown key, a wrong type or an out-of-range
  value raises ``ConfigError`` naming the dotted path and the reason, before any actor
  starts (the CLI turns it into exit status 2).
- Dotted overrides (``train.lr=1e-5``) are applied to the raw mapping before decoding,
  so they are validated exactly like the file (``loading``).
- Cross-field rules (``checks``) run after decoding, also before any actor starts.

Section names follow the seed config users know: ``model``, ``data``, ``rollout``,
``reward``, ``reference``, ``train``, ``algorithm``, ``dataflow``, ``placement``, ``run``,
``record``, ``eval``; each lives in the module of that name (``reference`` with ``reward``,
``critic`` with ``train``, ``record`` with ``run``, ``eval`` in ``evaluation``). Import from ``pipeline.config``.
"""

from __future__ import annotations

import typing
from typing import Any

from pipeline.config.algorithm import (
    DEFAULT_ALGORITHM,
    AlgorithmFields,
    algorithm_configs,
    default_algorithm,
    register_algorithm_config,
)
from pipeline.config.base import (
    ConfigError,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
    Probability,
    Ratio,
)
from pipeline.config.checks import (
    check_algorithm,
    check_colocate,
    check_config,
    check_curriculum,
    check_eval,
    check_lora,
    check_pairs,
    check_reward_sources,
    check_sampler_logprobs,
    check_staleness,
)
from pipeline.config.data import CurriculumConfig, DataConfig, PairsConfig
from pipeline.config.dataflow import DataflowConfig, NodeSpec
from pipeline.config.evaluation import EvalConfig
from pipeline.config.loading import apply_overrides, decode_algorithm, decode_config, load_config, parse_override
from pipeline.config.memory import MemoryConfig
from pipeline.config.model import LoraConfig, ModelConfig, TinyArchitecture, TinyModelConfig
from pipeline.config.placement import PlacementConfig, PlacementEntry
from pipeline.config.reward import ReferenceConfig, RewardConfig, RewardSourceConfig
from pipeline.config.rollout import ENGINE_KWARGS_OWNED, RolloutConfig, ToolsConfig
from pipeline.config.root import ConveyorConfig, to_dict
from pipeline.config.run import RecordConfig, RunConfig
from pipeline.config.train import CriticConfig, KLControlConfig, TrainConfig

__all__ = [
    "DEFAULT_ALGORITHM", "ENGINE_KWARGS_OWNED", "AlgorithmFields", "ConfigError", "ConveyorConfig",
    "CriticConfig", "CurriculumConfig", "DataConfig", "DataflowConfig", "EvalConfig", "KLControlConfig", "LoraConfig",
    "MemoryConfig", "ModelConfig", "NodeSpec", "NonNegFloat", "NonNegInt", "PairsConfig", "PlacementConfig",
    "PlacementEntry", "PosFloat", "PosInt", "Probability", "Ratio", "RecordConfig", "ReferenceConfig",
    "RewardConfig", "RewardSourceConfig", "RolloutConfig", "RunConfig", "TinyArchitecture", "TinyModelConfig",
    "ToolsConfig", "TrainConfig", "algorithm_configs", "apply_overrides", "check_algorithm", "check_colocate",
    "check_config", "check_curriculum", "check_eval", "check_lora", "check_pairs", "check_reward_sources",
    "check_sampler_logprobs", "check_staleness", "decode_algorithm", "decode_config", "default_algorithm", "load_config",
    "parse_override", "register_algorithm_config", "to_dict",
]


def __getattr__(name: str) -> Any:
    # Built lazily, on first use, from the registered algorithms: ``AlgorithmConfig`` is
    # their union (a tagged union msgspec decodes), ``ALGORITHM_NAMES`` their names.
    if name == "AlgorithmConfig":
        return typing.Union[tuple(algorithm_configs().values())]  # noqa: UP007
    if name == "ALGORITHM_NAMES":
        return tuple(algorithm_configs())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
