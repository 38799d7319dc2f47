"""The trainer stage: the Ray actor shell around ``TrainerEngine`` (DeepSpeed, GRPO).

Guarantees:
- staleness is enforced here, where data is consumed: a batch with
  ``trainer_version - policy_version > dataflow.max_staleness`` is dropped, counted
  (reason ``stale``) and replaced by the source; nothing staler is ever trained on;
- each micro-batch is trained on as it arrives (gradients accumulate, scaled by its
  share of the step's samples) and the optimizer steps once a step's
  ``train.prompts_per_step`` groups are in: one optimizer step = one policy version;
- every ``train.sync_interval`` steps the weights are published once to the object
  store with their sha256 and fingerprint; rollout workers pull and confirm them;
- when the run records the trainer's input, a ``StepRecord`` (batch ids, loss, grad
  norm, weights sha after the step, RNG state before it) is written per step, plus
  the trainer state at step 0 and every ``record.state_every`` steps, for replay.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

from pipeline.types import RolloutBatch, StepRecord, WeightUpdate
from pipeline.versions import compute_staleness, is_too_stale


def summarise_batch_rewards(batches: list[RolloutBatch]) -> dict[str, float]:
    rewards = np.concatenate([b.rewards for b in batches if b.rewards is not None] or [np.zeros(0)])
    if rewards.size == 0:
        return {}
    return {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
            "reward/max": float(rewards.max()), "reward/min": float(rewards.min())}


class TrainerStage:
    def __init__(self) -> None:
        self.dropped: dict[str, int] = {}
        self.trained_samples = 0
        self.steps_done = 0
        self.sync_seconds: list[float] = []
        self._step_batches: list[RolloutBatch] = []
        self._step_metrics: list[dict[str, float]] = []
        self._step_staleness: list[int] = []
        self._step_rng = b""
        self._step_started = time.time()

    async def setup(self, ctx: Any) -> None:
        from stages.tiny import resolve_model_path
        from stages.trainer_engine import TrainerEngine

        self.ctx = ctx
        cfg = ctx.config
        self.cfg = cfg
        self.max_staleness = cfg.dataflow.max_staleness
        self.step_samples = cfg.train.prompts_per_step * cfg.rollout.n
        self.model_path = resolve_model_path(cfg.model)
        self.engine = await asyncio.to_thread(
            TrainerEngine, self.model_path, cfg.train, cfg.algorithm,
            temperature=cfg.rollout.temperature, dtype=cfg.model.dtype, seed=cfg.run.seed,
        )
        self.run_dir = cfg.run_dir
        self._step_rng = self.engine.get_rng_state()
        if ctx.recorder is not None:
            await asyncio.to_thread(self._save_state_for_replay)

    # ------------------------------------------------------------------ per batch
    async def process(self, batch: RolloutBatch) -> None:
        version = self.engine.version
        if is_too_stale(version, batch.policy_version, self.max_staleness):
            await self._drop(batch, "stale")
            return None
        if batch.rewards is None:
            raise ValueError(f"batch {batch.batch_id}: reaches the trainer without rewards (is a reward stage wired?)")
        if not self._step_batches:
            self._step_started = time.time()
            self._step_rng = self.engine.get_rng_state()
        scale = batch.num_samples / self.step_samples
        metrics = await asyncio.to_thread(self.engine.train_micro_batch, batch, scale)
        self._step_batches.append(batch)
        self._step_metrics.append(metrics)
        self._step_staleness += [compute_staleness(version, batch.policy_version)] * batch.num_samples
        if sum(b.num_samples for b in self._step_batches) >= self.step_samples:
            await self._optimizer_step()
        return None

    async def _drop(self, batch: RolloutBatch, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + batch.num_samples
        self.ctx.log.info("batch_dropped", reason=reason, batch_id=batch.batch_id,
                          policy_version=batch.policy_version, trainer_version=self.engine.version)
        await self.ctx.controller.record_dropped.remote(len(batch.prompts), reason)

    async def _optimizer_step(self) -> None:
        batches, pieces = self._step_batches, self._step_metrics
        self._step_batches, self._step_metrics = [], []
        staleness, self._step_staleness = self._step_staleness, []
        step_out = await asyncio.to_thread(self.engine.optimizer_step)
        version = self.engine.version
        step = version - 1
        samples = sum(b.num_samples for b in batches)
        self.trained_samples += samples
        self.steps_done += 1
        controller = self.ctx.controller
        await controller.record_trained.remote(sum(len(b.prompts) for b in batches))
        await controller.set_trainer_version.remote(version)
        sync_s = 0.0
        if version % self.cfg.train.sync_interval == 0:
            sync_s = await self._publish(version)
        now = time.time()
        step_s = now - self._step_started
        tokens = sum(b.num_tokens for b in batches)
        weight = [p.get("num_tokens", 1.0) for p in pieces]
        metrics: dict[str, Any] = {
            "step": step,
            "time": now,
            "policy_version": version,
            **summarise_batch_rewards(batches),
            "staleness/mean": float(np.mean(staleness)),
            "staleness/max": int(np.max(staleness)),
            **{f"staleness/hist/{k}": int(v) for k, v in zip(*np.unique(staleness, return_counts=True), strict=True)},
            "samples/trained": self.trained_samples,
            "samples/dropped": sum(self.dropped.values()),
            "time/step_s": step_s,
            "throughput/tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            "timing_s/weight_publish": sync_s,
            "response_length/mean": float(np.mean([b.completion_lens.mean() for b in batches])),
            **{f"actor/{k}": float(np.average([p[k] for p in pieces], weights=weight))
               for k in ("loss", "pg_loss", "kl", "clip_frac", "ratio_mean") if all(k in p for p in pieces)},
            **{f"actor/{k}": float(v) for k, v in step_out.items()},
        }
        await controller.report_step.remote(metrics)
        if self.ctx.recorder is not None:
            await asyncio.to_thread(self._record_step, step, version, batches, pieces, step_out)

    async def _publish(self, version: int) -> float:
        t0 = time.time()
        with self.ctx.spans.span("sync"):
            data, sha, fingerprint = await asyncio.to_thread(self.engine.export_weights)
            update = WeightUpdate(version=version, sha256=sha, fingerprint=fingerprint, num_bytes=len(data))
            await self.ctx.controller.publish.remote(update, [ray.put(data)])
        seconds = time.time() - t0
        self.sync_seconds.append(seconds)
        return seconds

    # ------------------------------------------------------------------ replay support
    def _record_step(self, step: int, version: int, batches: list[RolloutBatch],
                     pieces: list[dict[str, float]], step_out: dict[str, float]) -> None:
        loss = float(sum(p["loss"] * b.num_samples / self.step_samples for p, b in zip(pieces, batches, strict=True)))
        record = StepRecord(
            step=step, policy_version=version, batch_ids=[b.batch_id for b in batches],
            loss=loss, grad_norm=float(step_out["grad_norm"]),
            weights_sha256=self.engine.weights_sha256(),
            metrics={k: float(v) for k, v in step_out.items()}, rng_state=self._step_rng,
        )
        self.ctx.recorder.write_step(record)
        every = self.cfg.record.state_every
        if every and version % every == 0:
            self._save_state_for_replay()

    def _save_state_for_replay(self) -> None:
        root = Path(self.ctx.recorder.root) / "states"
        root.mkdir(parents=True, exist_ok=True)
        self.engine.save_state(root / f"state-{self.engine.version:08d}.pt")

    # ------------------------------------------------------------------ end of stream
    async def finish(self) -> None:
        if self._step_batches:
            # The ledger admits whole steps, so this only happens when a run is cut short.
            for b in self._step_batches:
                await self._drop(b, "incomplete_step")
            self._step_batches = []
        if self.cfg.train.save_checkpoint:
            out = self.run_dir / "checkpoint"
            await asyncio.to_thread(self.engine.save_pretrained, out)
            self.ctx.log.info("checkpoint_saved", path=str(out), policy_version=self.engine.version)
        return None

    def status(self) -> dict[str, Any]:
        return {"state": "training", "policy_version": self.engine.version, "steps": self.steps_done}

    def result(self) -> dict[str, Any]:
        return {
            "steps": self.steps_done,
            "policy_version": self.engine.version,
            "samples_trained": self.trained_samples,
            "samples_dropped": dict(self.dropped),
            "weight_publish_s": {"count": len(self.sync_seconds),
                                 "mean": float(np.mean(self.sync_seconds)) if self.sync_seconds else 0.0},
            "checkpoint": str(self.run_dir / "checkpoint") if self.cfg.train.save_checkpoint else None,
        }
