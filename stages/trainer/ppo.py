"""The PPO trainer: the trainer stage with ``train.ppo_epochs`` passes and
``train.ppo_mini_batches`` optimizer updates over each step's data.

Guarantees:
- A step's micro-batches are cut, in arrival order, into ``ppo_mini_batches``
  mini-batches of whole micro-batches (``step samples / ppo_mini_batches`` samples each;
  the config refuses a step that does not split so). In the first epoch a mini-batch is
  applied as soon as its micro-batches are in, so the first epoch streams like the plain
  trainer; the further epochs run when the step's last micro-batch is in, over the same
  mini-batches in the same order.
- Each update is the exact aggregated loss of its mini-batch (``compute_step_grad_scale``
  over its micro-batches: their loss tokens, non-empty rows or rows), with the
  registry's policy loss. With ``algorithm.off_policy: off`` the old policy of every
  epoch is the sampler (``behaviour_logprobs``), so the ratio and its clip measure the
  drift from the weights that generated the data, across all the updates of a step;
  with ``truncate`` / ``reject`` it is the log-probs of the sample's first pass in the
  step (the engine holds them by sample id until the step's last update), so from the
  second epoch on the ratio and its clip bound the drift since (a trust region), and
  the importance weight first pass / sampler corrects the staleness.
- The policy version moves once per step (the last update), so staleness, weight
  publication and checkpoints count steps exactly as without epochs; the updates inside a
  step do not publish weights. Advantages are assigned once per micro-batch, before the
  first epoch.
- The step's metrics add ``actor/later_epochs_ratio_mean`` and ``_clip_frac`` (the
  epochs after the first, where the anchor is held: the trust region at work).
- Later epochs train each micro-batch whole (no admission split); a micro-batch that
  needed splitting in the first epoch can run out of memory there, which stops the run.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pipeline.plugins import register_stage
from pipeline.types import RolloutBatch
from stages.trainer.stage import TrainerStage, compute_micro_batch_scale, compute_step_grad_scale


def summarise_later_epochs(metrics: list[dict[str, float]]) -> dict[str, float]:
    """``later_epochs_ratio_mean`` and ``later_epochs_clip_frac``: the policy ratio and the
    clipped fraction of the epochs after the first, averaged over their micro-batches by
    tokens (step metrics ``actor/...``); empty with one epoch."""
    if not metrics:
        return {}
    tokens = [m["num_tokens"] for m in metrics]
    total = sum(tokens) or 1.0
    return {f"later_epochs_{key}": sum(m[key] * n for m, n in zip(metrics, tokens, strict=True)) / total
            for key in ("ratio_mean", "clip_frac")}


@register_stage("ppo_trainer")  # the trainer with train.ppo_epochs/mini-batches
class PPOTrainerStage(TrainerStage):
    async def setup(self, ctx: Any) -> None:
        await super().setup(ctx)
        self.epochs = self.cfg.train.ppo_epochs
        self.mini_samples = self.step_samples // self.cfg.train.ppo_mini_batches
        self._applied = 0  # micro-batches of this step already in an update
        self._groups: list[tuple[int, int]] = []  # the step's applied mini-batches (index ranges)
        self.updates = 0

    async def _micro_batch_trained(self) -> None:
        pending = self._step_batches[self._applied:]
        if pending and sum(b.num_samples for b in pending) >= self.mini_samples:
            # A first-epoch mini-batch complete inside the step: apply it now.
            t0 = time.time()
            await asyncio.to_thread(self._update, pending, False)
            self._step_update_s += time.time() - t0
            self._groups.append((self._applied, len(self._step_batches)))
            self._applied = len(self._step_batches)
            # Only the pieces since this update remain to re-accumulate after an OOM.
            self._step_pieces = []
            self._step_rng = self.engine.get_rng_state()

    def _next_boundary(self) -> int:
        """The end of the current first-epoch mini-batch: units never span two."""
        applied = sum(b.num_samples for b in self._step_batches[:self._applied])
        return min(self.step_samples, applied + self.mini_samples)

    def _update(self, batches: list[RolloutBatch], bump_version: bool) -> dict[str, float]:
        self.updates += 1
        scale = compute_step_grad_scale(batches, self.step_samples, self.cfg.algorithm.loss_agg)
        return self.engine.optimizer_step(scale, bump_version=bump_version)

    def _apply_step_update(self, batches: list[RolloutBatch]) -> dict[str, float]:
        groups = [*self._groups, (self._applied, len(batches))]
        self._groups, self._applied = [], 0
        agg = self.cfg.algorithm.loss_agg
        out = self._update(batches[groups[-1][0]:], bump_version=self.epochs == 1)
        later: list[dict[str, float]] = []
        for epoch in range(1, self.epochs):
            for k, (a, b) in enumerate(groups):
                for mb in batches[a:b]:
                    later.append(self.engine.train_micro_batch(mb, compute_micro_batch_scale(mb, self.step_samples,
                                                                                             agg)))
                last = epoch == self.epochs - 1 and k == len(groups) - 1
                out = self._update(batches[a:b], bump_version=last)
        return {**out, "updates": float(self.epochs * len(groups)), **summarise_later_epochs(later)}

    def status(self) -> dict[str, Any]:
        return {**super().status(), "updates": self.updates}
