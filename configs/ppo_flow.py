# conveyor launch --config configs/ppo.yaml --script configs/ppo_flow.py
"""The PPO graph of configs/ppo.yaml, written as a DataFlow in Python (verl's HybridFlow
style). ``conveyor launch --script`` calls ``build_dataflow`` with the resolved config;
the run directory, metrics, status, checkpoints and placement apply as for any launch."""

from pipeline.dataflow import DataFlow
from stages.flow import ActorRollout, Critic, PPOTrainer, PromptSource, Reference, RewardModelScorer, RuleReward


def build_dataflow(cfg) -> DataFlow:
    df = DataFlow()
    df.add_node("source", PromptSource)
    df.add_node("rollout", ActorRollout, input_from="source", replicas=cfg.rollout.num_workers,
                concurrency=cfg.rollout.max_inflight)
    df.add_node("reward", RuleReward, input_from="rollout")
    scored = "reward"
    if cfg.reward.sources:  # the reward model combines its score with the rule's
        df.add_node("reward_model", RewardModelScorer, input_from="reward")
        scored = "reward_model"
    df.add_node("reference", Reference, input_from=scored)
    df.add_node("critic", Critic, input_from="reference")
    df.add_node("trainer", PPOTrainer, input_from="critic")
    return df
