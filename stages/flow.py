"""The built-in stages under the names a DataFlow script uses, as in verl's HybridFlow
examples (``conveyor launch --config C --script flow.py``; ``configs/ppo_flow.py``).

Each name is the stage class itself, not a wrapper: a script's graph runs exactly the
code the YAML-built graph runs.
"""

from stages.critic import CriticStage as Critic
from stages.ppo_trainer import PPOTrainerStage as PPOTrainer
from stages.reference import ReferenceStage as Reference
from stages.reward import RewardStage as RuleReward
from stages.reward_model import RewardModelStage as RewardModelScorer
from stages.rollout.stage import RolloutStage as ActorRollout
from stages.source import PromptSource
from stages.trainer import TrainerStage as Trainer

__all__ = ["ActorRollout", "Critic", "PPOTrainer", "PromptSource", "Reference", "RewardModelScorer", "RuleReward",
           "Trainer"]
