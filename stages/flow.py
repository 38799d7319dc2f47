"""The built-in stages under the names a DataFlow script uses, as in verl's HybridFlow
examples (``conveyor launch --config C --script flow.py``; ``configs/ppo_flow.py``).

Each name is the stage class itself, not a wrapper: a script's graph runs exactly the
code the YAML-built graph runs.
"""

from stages.data.source import PromptSource
from stages.evaluation.stage import EvalRolloutStage as EvaluatingRollout
from stages.models.reference import ReferenceStage as Reference
from stages.rewards.reward import RewardStage as RuleReward
from stages.rewards.reward_model import RewardModelStage as RewardModelScorer
from stages.rollout.stage import RolloutStage as ActorRollout
from stages.trainer.critic import CriticStage as Critic
from stages.trainer.ppo import PPOTrainerStage as PPOTrainer
from stages.trainer.stage import TrainerStage as Trainer

__all__ = ["ActorRollout", "Critic", "EvaluatingRollout", "PPOTrainer", "PromptSource", "Reference",
           "RewardModelScorer", "RuleReward", "Trainer"]
