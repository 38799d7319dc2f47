"""The whole run configuration (``ConveyorConfig``): one field per section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from pipeline.config.algorithm import AlgorithmFields, default_algorithm
from pipeline.config.base import _section
from pipeline.config.data import DataConfig
from pipeline.config.dataflow import DataflowConfig
from pipeline.config.evaluation import EvalConfig
from pipeline.config.model import ModelConfig
from pipeline.config.placement import PlacementConfig
from pipeline.config.reward import ReferenceConfig, RewardConfig
from pipeline.config.rollout import RolloutConfig
from pipeline.config.run import RecordConfig, RunConfig
from pipeline.config.train import CriticConfig, TrainConfig


class ConveyorConfig(msgspec.Struct, **_section()):
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    reward: RewardConfig = RewardConfig()
    reference: ReferenceConfig = ReferenceConfig()
    train: TrainConfig = TrainConfig()
    critic: CriticConfig = CriticConfig()
    algorithm: AlgorithmFields = msgspec.field(default_factory=default_algorithm)
    dataflow: DataflowConfig = DataflowConfig()
    placement: PlacementConfig = PlacementConfig()
    run: RunConfig = RunConfig()
    record: RecordConfig = RecordConfig()
    eval: EvalConfig = EvalConfig()

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir.format(name=self.run.name)).expanduser()

    @property
    def reference_enabled(self) -> bool:
        if self.reference.enabled == "auto":
            return self.algorithm.kl_coef > 0 or self.algorithm.use_kl_in_reward or self.algorithm.offline
        return self.reference.enabled == "on"

    @property
    def scoring_temperature(self) -> float:
        """The temperature the trainer and the reference take log-probs at: the rollout's
        (the distribution the sampler drew from), or 1 for offline data (``dpo``'s pairs
        were sampled by no rollout: its log-ratios are the model's own)."""
        return 1.0 if self.algorithm.offline else float(self.rollout.temperature)

    @property
    def reward_model_enabled(self) -> bool:
        return bool(self.reward.sources)

    @property
    def critic_enabled(self) -> bool:
        return self.algorithm.needs_critic

    @property
    def micro_batches_per_step(self) -> int:
        return -(-self.train.prompts_per_step // self.dataflow.prompts_per_micro_batch)

    @property
    def auto_staleness(self) -> bool:
        """``dataflow.max_staleness: auto``: η is chosen from the run's measured steps."""
        return self.dataflow.max_staleness == "auto"

    @property
    def describe_staleness(self) -> str:
        """``1``, or ``auto (from 1, at most 4)``: for the launch line and ``conveyor status``."""
        if not self.auto_staleness:
            return str(self.dataflow.max_staleness)
        return f"auto (from {self.initial_max_staleness}, at most {self.dataflow.max_staleness_cap})"

    @property
    def initial_max_staleness(self) -> int:
        """η at the start of a run: ``dataflow.max_staleness``, or with ``auto`` the
        smallest η that still overlaps steps and trains every sync interval's samples,
        ``max(1, train.sync_interval - 1)``."""
        eta = self.dataflow.max_staleness
        return max(1, self.train.sync_interval - 1) if eta == "auto" else int(eta)


def to_dict(cfg: ConveyorConfig) -> dict[str, Any]:
    """The fully resolved config as plain data (written next to every run)."""
    return msgspec.to_builtins(cfg)
