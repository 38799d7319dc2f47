"""The built-in stages and their libraries, in rooms by role: ``data`` (the prompt
source), ``rollout``, ``rewards``, ``models`` (the reference), ``trainer`` (and critic),
``algorithms`` (advantage estimators and losses), ``evaluation`` (the held-out set,
scored between steps); ``flow`` names the stage classes for DataFlow scripts.

``STAGE_MODULES`` is the one list of the modules whose classes register a stage
(``@register_stage`` of ``pipeline.plugins``); the plumbing imports them when a graph
first asks for a stage by name. Importing this package imports nothing else.
"""

STAGE_MODULES = (
    "stages.data.source",
    "stages.data.pairs",
    "stages.rollout.stage",
    "stages.evaluation.stage",
    "stages.rewards.reward",
    "stages.rewards.reward_model",
    "stages.models.reference",
    "stages.trainer.critic",
    "stages.trainer.stage",
    "stages.trainer.ppo",
)
