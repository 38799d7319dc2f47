# conveyor launch --config configs/quickstart.yaml --script configs/length_penalty_flow.py
"""A node of one's own, the worked example of docs/custom-nodes.md: ``LengthPenalty``
subtracts ``per_token`` × completion length from each sample's reward, between the
reward and the reference stages. Wire batches are frozen msgspec Structs: the node
derives a new batch with ``msgspec.structs.replace`` instead of assigning a field."""

from typing import Any

import msgspec
import numpy as np

from pipeline.dataflow import DataFlow
from pipeline.types import RolloutBatch
from stages.flow import ActorRollout, PromptSource, Reference, RuleReward, Trainer


class LengthPenalty:
    """A stage core: ``process`` takes one micro-batch and returns the one to pass on."""

    takes = gives = RolloutBatch  # checked on every edge before anything starts
    takes_fields = ("rewards",)  # the reward stage must have set them upstream
    gives_fields = ("rewards",)

    def __init__(self, per_token: float = 0.01) -> None:
        self.per_token = per_token

    async def setup(self, ctx: Any) -> None:
        self.log = ctx.log  # also ctx.config (the run's config), ctx.name, ctx.replica

    async def process(self, batch: RolloutBatch) -> RolloutBatch:
        penalty = self.per_token * batch.completion_lens.astype(np.float32)
        # batch.rewards = ... would raise AttributeError: immutable type: 'RolloutBatch'
        return msgspec.structs.replace(batch, rewards=batch.rewards - penalty)

    def status(self) -> dict[str, Any]:
        return {"per_token": self.per_token}


def build_dataflow(cfg) -> DataFlow:
    df = DataFlow()
    df.add_node("source", PromptSource)
    df.add_node("rollout", ActorRollout, input_from="source", replicas=cfg.rollout.num_workers,
                concurrency=cfg.rollout.max_inflight)
    df.add_node("reward", RuleReward, input_from="rollout")
    df.add_node("length_penalty", LengthPenalty, input_from="reward", per_token=0.01)
    learner_input = "length_penalty"
    if cfg.reference_enabled:
        df.add_node("reference", Reference, input_from="length_penalty")
        learner_input = "reference"
    df.add_node("trainer", Trainer, input_from=learner_input)
    return df
