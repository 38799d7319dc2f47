"""The rollout stage that evaluates: ``RolloutStage`` whose worker 0 evaluates the
held-out set (``eval``) between weight updates and at the end.

``pipeline.launch`` runs it as the ``rollout`` node of the built-in graph when
``eval.path`` is set (registered as ``rollout_eval``); a DataFlow script or
``dataflow.nodes`` names it as ``stages.evaluation.stage:EvalRolloutStage``. Replicas
other than 0 are plain rollout workers. The exact-version and no-contamination
guarantees are the rollout stage's (``stages/rollout/stage.py``); what is evaluated and
how, ``stages/evaluation/evaluator.py``'s.
"""

from __future__ import annotations

from typing import Any

from pipeline.plugins import register_stage
from stages.evaluation.evaluator import HeldOutEvaluator, build_evaluator
from stages.rollout.stage import RolloutStage


@register_stage("rollout_eval")
class EvalRolloutStage(RolloutStage):
    def build_evaluator(self, ctx: Any, model_path: Any) -> HeldOutEvaluator | None:
        if ctx.replica != 0 or not ctx.config.eval.enabled:
            return None
        return build_evaluator(ctx.config, self.tokenizer, model_path)
