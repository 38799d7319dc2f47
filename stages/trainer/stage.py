"""The trainer stage: the Ray actor shell around ``TrainerEngine`` (DeepSpeed, GRPO).

Guarantees:
- staleness is enforced here, where data is consumed: a batch with
  ``trainer_version - policy_version`` above its bound (the η it was admitted under,
  ``dataflow.max_staleness`` or what ``auto`` chose) is dropped, counted (``stale``) and
  replaced by the source, or with ``dataflow.late_samples: train`` trained and counted
  (``samples/late``); offline data (DPO pairs) is not gated; each step reports its
  bound (``dataflow/max_staleness``) and checkpoints keep it;
- micro-batches are trained as they arrive and the optimizer steps once a step's
  ``train.prompts_per_step`` groups are in: one optimizer step = one policy version; the
  step's gradient is that of the loss aggregated over the whole step as one batch;
- neither a split into memory-bounded pieces nor ``train.num_ranks`` > 1 changes the
  update beyond float rounding, and every sample is trained exactly once; a single group
  that still runs out of memory stops the run (``OomUnrecoverable``);
- colocated: the step trains only once every rollout worker has slept, and the publish
  wakes them;
- every ``train.sync_interval`` steps the weights are published once with their sha256
  and fingerprint;
- a non-finite step is neither applied nor published; ``train.max_bad_steps`` in a row
  stop the run; recorded runs write one ``StepRecord`` per step for replay.
Mechanisms: docs/architecture.md, "Trainer stage".
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import ray

from pipeline.memory.admission import count_seq_lens, estimate_batch_bytes
from pipeline.memory.guard import MemoryGuard
from pipeline.memory.oom import OomRecovery, free_cached_memory, freeze_setup_heap, is_oom_error
from pipeline.memory.readings import read_allocator_counters
from pipeline.memory.splitting import count_groups, gather_micro_batches, split_rollout_batch, split_rollout_batch_at
from pipeline.plugins import register_stage
from pipeline.queue import fits_inline
from pipeline.transport import TRANSPORT_ENV, select_transport
from pipeline.types import RolloutBatch, StepRecord, WeightUpdate
from pipeline.versions import batch_bound, compute_staleness
from stages.algorithms.aggregation import get_loss_aggregation
from stages.trainer.checkpoint import TrainerCheckpoints
from stages.trainer.metrics import (
    summarise_batch_rewards,
    summarise_pass_padding,
    summarise_reward_extras,
    summarise_rollout_extras,
    summarise_step_batches,
)
from stages.trainer.pieces import compute_piece_weight, merge_piece_metrics, pool_logp_mismatch

_LAYOUT = "pieces"  # StepRecord.metrics["pieces/<batch_id>/<k>"] = groups in piece k
_GATHER = "gathered"  # StepRecord.metrics["gathered/<batch_id>/<k>"] = k-th micro-batch of the unit
NONFINITE = "nonfinite"  # the drop reason of a step's samples when its loss or gradient was not finite


class NonFiniteSteps(RuntimeError):
    """``train.max_bad_steps`` steps in a row had a non-finite loss or gradient norm."""


def count_loss_units(batch: RolloutBatch, loss_agg: str) -> int:
    """What ``loss_agg`` divides by, counted in ``batch``: ``token-mean`` its loss tokens;
    ``seq-mean-token-sum-norm`` its samples (the constant normaliser counts every row);
    the other seq-mean modes its samples with at least one loss token (a row that
    ``overlong_mask`` emptied counts in no mean)."""
    return get_loss_aggregation(loss_agg).count(batch)


def compute_micro_batch_scale(batch: RolloutBatch, step_samples: int, loss_agg: str = "seq-mean-token-mean") -> float:
    """Gradient scale of one micro-batch before the step's rescale: its loss units
    (``count_loss_units``) / the step's samples, so that scale x its aggregated loss is
    its sum over those units divided by a constant (streaming cannot know the step's
    count before its last micro-batch; ``compute_step_grad_scale`` divides by it at the
    step)."""
    return count_loss_units(batch, loss_agg) / step_samples


def compute_step_grad_scale(batches: list[RolloutBatch], step_samples: int, loss_agg: str) -> float:
    """The ``grad_scale`` of an optimizer update over ``batches`` (a step, or one of PPO's
    mini-batches): step samples / their loss units (0 when they have none), which turns
    the accumulated sums into the exact one-big-batch aggregate: the token mean over
    their loss tokens, the mean over their non-empty sequences, or the constant
    ``samples * loss_norm_tokens`` normaliser."""
    units = sum(count_loss_units(b, loss_agg) for b in batches)
    return step_samples / units if units else 0.0


def compute_step_loss(piece_losses: list[float], batches: list[RolloutBatch], step_samples: int,
                      loss_agg: str = "seq-mean-token-mean") -> float:
    """``StepRecord.loss``: the step's aggregated loss, from each micro-batch's (unscaled)
    loss, its scale and the step's grad scale."""
    total = sum(loss * compute_micro_batch_scale(b, step_samples, loss_agg)
                for loss, b in zip(piece_losses, batches, strict=True))
    return float(total * compute_step_grad_scale(batches, step_samples, loss_agg))


def _encode_lists(prefix: str, lists: Mapping[int, list[int]]) -> dict[str, float]:
    """``StepRecord.metrics`` entries ``<prefix>/<batch_id>/<k>`` = the k-th value of each list."""
    return {f"{prefix}/{bid}/{k}": float(v) for bid, values in lists.items() for k, v in enumerate(values)}


def _read_list(metrics: Mapping[str, float], prefix: str, batch_id: int) -> list[int] | None:
    """The list ``_encode_lists`` recorded for ``batch_id``, or None."""
    head = f"{prefix}/{batch_id}/"
    found = {int(k[len(head):]): int(v) for k, v in metrics.items() if k.startswith(head)}
    return [found[k] for k in range(len(found))] if found else None


def encode_piece_layout(layouts: Mapping[int, list[int]]) -> dict[str, float]:
    """``StepRecord.metrics`` entries for the micro-batches trained as several pieces."""
    return _encode_lists(_LAYOUT, layouts)


def read_piece_layout(metrics: Mapping[str, float], batch_id: int) -> list[int] | None:
    """Groups per piece of ``batch_id`` as recorded, or None when it was trained whole."""
    return _read_list(metrics, _LAYOUT, batch_id)


def encode_gathers(gathers: Mapping[int, list[int]]) -> dict[str, float]:
    """``StepRecord.metrics`` entries for the micro-batches trained as one unit: the
    unit's ``batch_id`` (its first micro-batch's) -> the ids of its micro-batches."""
    return _encode_lists(_GATHER, gathers)


def regather_units(batches: list[RolloutBatch], metrics: Mapping[str, float]) -> list[RolloutBatch]:
    """A recorded step's micro-batches as its trainer trained them: those the record
    says were gathered (``encode_gathers``) concatenated again, in the same order."""
    by_id = {b.batch_id: b for b in batches}
    members = {b.batch_id: ids for b in batches if (ids := _read_list(metrics, _GATHER, b.batch_id))}
    inside = {m for ids in members.values() for m in ids}
    units = []
    for b in batches:
        if b.batch_id in members:
            missing = [i for i in members[b.batch_id] if i not in by_id]
            if missing:
                raise ValueError(f"step record: micro-batches {missing} gathered with {b.batch_id} are not recorded")
            units.append(gather_micro_batches([by_id[i] for i in members[b.batch_id]]))
        elif b.batch_id not in inside:
            units.append(b)
    return units


def train_as_recorded(engine: Any, batch: RolloutBatch, step_samples: int, layout: list[int] | None,
                      kl_reward_coef: float = 0.0) -> dict[str, float]:
    """Train ``batch`` as the trainer did: advantages assigned (with the step's
    KL-in-reward coefficient, ``StepRecord.metrics["kl_reward_coef"]``), then whole or as
    the pieces ``layout`` names, with the same scales in the same order (``conveyor
    replay`` calls this; the step's ``grad_scale`` is ``compute_step_grad_scale``)."""
    from stages.algorithms import assign_advantages

    batch = assign_advantages(batch, engine.algo, kl_reward_coef=kl_reward_coef)
    pieces = split_rollout_batch_at(batch, layout) if layout else [batch]
    scale = compute_micro_batch_scale(batch, step_samples, engine.algo.loss_agg)
    weights = [compute_piece_weight(p, batch, engine.algo.loss_agg) for p in pieces]
    return merge_piece_metrics([engine.train_micro_batch(p, scale * w) for p, w in zip(pieces, weights, strict=True)],
                               weights)



def train_recorded_step(engine: Any, batches: list[RolloutBatch], step_samples: int,
                        metrics: Mapping[str, float]) -> tuple[float, dict[str, float]]:
    """One recorded step trained again as the trainer trained it (``conveyor replay``):
    each unit (micro-batches gathered as the record says: ``regather_units``) through
    ``train_as_recorded`` with the pieces and KL-in-reward
    coefficient the step record's ``metrics`` name, then the optimizer step with the
    step's grad scale. Advantages are assigned over the whole step first, as the trainer
    does for an algorithm that whitens over it. Returns the step's loss (as
    ``StepRecord.loss``) and what ``optimizer_step`` returned."""
    from stages.algorithms import assign_step_advantages

    kl_coef = float(metrics.get("kl_reward_coef", 0.0))
    units = regather_units(assign_step_advantages(batches, engine.algo, kl_reward_coef=kl_coef), metrics)
    losses = [train_as_recorded(engine, u, step_samples, read_piece_layout(metrics, u.batch_id), kl_coef)["loss"]
              for u in units]
    loss_agg = engine.algo.loss_agg
    step_out = engine.optimizer_step(compute_step_grad_scale(units, step_samples, loss_agg))
    return compute_step_loss(losses, units, step_samples, loss_agg), step_out


def holds_whole_step(cfg: Any) -> bool:
    """Whether the trainer holds a step's micro-batches until the step is whole before it
    trains any: colocated (the GPU is the rollout's meanwhile), or for advantages
    whitened over the whole step (REINFORCE++: ``Algorithm.whitens_step``)."""
    from stages.algorithms.registry import get_algorithm  # imports torch: not at module level

    return cfg.placement.mode == "colocate" or get_algorithm(cfg.algorithm.name).whitens_step


def _count_cluster_gpus() -> float:
    """GPUs in the Ray cluster (0 outside Ray)."""
    return float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0


@register_stage("trainer")
class TrainerStage:
    takes = RolloutBatch  # pipeline/contracts.py; ref_logprobs too when a KL term needs them
    takes_fields = ("rewards",)

    def __init__(self, rank_gpus: list[tuple[int, float]] | None = None) -> None:
        # (placement-group bundle, GPU share) of data-parallel ranks 1.. (``train.num_ranks``).
        self.rank_gpus = list(rank_gpus or [])
        self.lora_params: dict[str, int] = {}  # model.lora: trainable and all parameters
        self.dropped: dict[str, int] = {}
        self.trained_samples = 0
        self._step_late = 0  # samples admitted staler than their bound (dataflow.late_samples: train)
        self.steps_done = 0
        self.publishes, self.publish_s_total = 0, 0.0  # running totals: a long run keeps no list
        self.skipped_nonfinite, self._bad_in_a_row = 0, 0  # steps not applied: in all, and since the last good one
        self._step_batches: list[RolloutBatch] = []  # the step's micro-batches as they came
        self._step_units: list[RolloutBatch] = []  # ... as trained: several gathered into one
        self._step_metrics: list[dict[str, float]] = []  # one per unit
        self._step_staleness: list[int] = []
        self._step_train_s = 0.0  # forward/backward of the step's micro-batches so far
        self._step_update_s = 0.0  # optimizer updates inside the step so far (PPO's mini-batches)
        self._step_rng = b""
        self._step_started = time.time()
        self._published_sha: tuple[int, str] = (-1, "")
        self.transport = "shm"  # chosen in setup (pipeline.transport.select_transport)
        # Every piece trained in the current step, with its scale: re-accumulated in
        # order when an OOM leaves partial gradients behind.
        self._step_pieces: list[tuple[RolloutBatch, float]] = []
        self._step_layouts: dict[int, list[int]] = {}
        self._step_gathers: dict[int, list[int]] = {}  # unit's batch_id -> its micro-batches' ids
        self.max_gather = 1  # micro-batches trained as one (train.gather_micro_batches, set in setup)
        # Groups dropped upstream for zero reward variance since the last step, and the
        # KL-in-reward penalty measured on each micro-batch of the step (kl, samples).
        self._step_zero_variance = 0
        self._step_kl: list[tuple[float, int]] = []
        # placement: colocate: the step's micro-batches (with their staleness) held until
        # the whole step is in, and the GPU handoff's figures for the step's metrics.
        self.colocated = False
        self.holds_step = False  # set in setup: colocated, or advantages over the whole step
        self._held: list[tuple[RolloutBatch, int]] = []
        self._colocate_metrics: dict[str, float] = {}

    async def setup(self, ctx: Any) -> None:
        from stages.models.reference import build_model_shape  # imports torch: not at module level

        self.ctx = ctx
        cfg = ctx.config
        self.cfg = cfg
        self.max_staleness = cfg.initial_max_staleness  # a batch admitted without a bound is held to it
        self.colocated = cfg.placement.mode == "colocate"
        self.holds_step = holds_whole_step(cfg)
        self.step_samples = cfg.train.prompts_per_step * cfg.rollout.n
        self.max_gather = cfg.train.gather_micro_batches
        began = time.monotonic()
        self.setup_doing = "building the model, optimizer and DeepSpeed engine"  # the driver's setting_up lines
        if cfg.train.num_ranks > 1:
            from stages.trainer.ranks import build_data_parallel_engine

            self.engine = await asyncio.to_thread(build_data_parallel_engine, cfg, self.rank_gpus)
            ctx.log.info("trainer_ranks", ranks=cfg.train.num_ranks, devices=self.engine.devices)
        else:
            from stages.trainer.engine import build_trainer_engine  # imports torch: not at module level

            self.engine = await asyncio.to_thread(build_trainer_engine, cfg)
        self.startup_phases = {"engine": time.monotonic() - began}  # model, optimizer, DeepSpeed
        if self.engine.compiled_blocks:
            # Built here, beside vLLM's start, instead of in the first step.
            self.setup_doing = "compiling the trainer's blocks (torch.compile, forward and backward)"
            self.startup_phases["compile"] = await asyncio.to_thread(self.engine.warm_up_compile)
        module = self.engine.module
        self.shape = build_model_shape(module, str(next(module.parameters()).dtype).removeprefix("torch."))
        self.guard = MemoryGuard(ctx.name, cfg.train.memory, spans=ctx.spans)
        self.run_dir = cfg.run_dir
        self._step_rng = self.engine.get_rng_state()
        self.transport = select_transport(self.engine.weights_on_gpu, _count_cluster_gpus(),
                                          os.environ.get(TRANSPORT_ENV))
        ctx.log.info("weight_transport", transport=self.transport)
        ctx.log.info("trainer_compile", blocks=self.engine.compiled_blocks, skipped=self.engine.compile_skipped)
        if cfg.model.lora.enabled:
            from stages.models.lora import count_parameters

            trainable, total = count_parameters(module)
            self.lora_params = {"trainable_params": trainable, "params": total}
            ctx.log.info("lora", rank=cfg.model.lora.rank, **self.lora_params)
        self.checkpoints = TrainerCheckpoints(cfg, self.engine)
        from stages.algorithms.kl_control import build_kl_controller

        self.kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
        if cfg.run.resume_from:
            self.setup_doing = f"restoring {cfg.run.resume_from}"
            restoring = time.monotonic()
            version = await asyncio.to_thread(self.checkpoints.restore, cfg.run.resume_from)
            self.startup_phases["restore"] = time.monotonic() - restoring
            self.kl_ctrl.load_state(self.engine.extra_state)  # the coefficient the run had reached
            self._step_rng = self.engine.get_rng_state()
            # The rollout starts from the checkpoint's model, not the base one.
            await self.ctx.controller.publish(*(await self._export(version))[:2])
            ctx.log.info("resumed", path=cfg.run.resume_from, policy_version=version)
        if ctx.recorder is not None:
            await asyncio.to_thread(self._save_state_for_replay)
        if self.colocated:
            # Each step collects garbage twice before handing the GPU's cached memory
            # back: without this the collection walks every object set-up made.
            freeze_setup_heap()

    # ------------------------------------------------------------------ per batch
    async def process(self, batch: RolloutBatch) -> None:
        await self.process_many([batch])
        return None

    async def process_many(self, batches: list[RolloutBatch]) -> list[None]:
        """Micro-batches that were waiting in this stage's queue together (the shell hands
        over up to ``max_gather``: ``train.gather_micro_batches``), in order, each gated
        as if it came alone; those admitted into the same step are trained as one call
        (their samples packed into the same passes), never across the end of a step or
        of a PPO mini-batch (``_next_boundary``)."""
        ready: list[tuple[RolloutBatch, int]] = []
        for batch in batches:
            staleness = await self._admit(batch)
            if staleness is None:
                continue
            if self.holds_step:
                await self._hold(batch, staleness)
                continue
            (batch,) = await asyncio.to_thread(self._assign_advantages, [batch])
            ready = await self._grow_unit(ready, batch, staleness)
        if ready:
            await self._train_into_step(ready)
        return [None] * len(batches)

    async def _admit(self, batch: RolloutBatch) -> int | None:
        """The batch's staleness, or None when it brings no samples or is dropped as stale
        (beyond its bound, unless ``dataflow.late_samples: train``)."""
        if batch.dropped_prompts:
            self._record_upstream_drops(batch)
        if batch.num_samples == 0:  # it only carried drops
            return None
        version = self.engine.version
        # Offline data (dpo's pairs) was generated by no policy version: nothing to gate.
        staleness = 0 if self.cfg.algorithm.offline else compute_staleness(version, batch.policy_version)
        if staleness > batch_bound(batch.max_staleness, self.max_staleness):
            if self.cfg.dataflow.late_samples == "drop":
                await self._drop(batch, "stale")
                return None
            self._step_late += batch.num_samples
        if batch.rewards is None and batch.advantages is None:
            raise ValueError(f"batch {batch.batch_id}: reaches the trainer without rewards (is a reward stage wired?)")
        return staleness

    async def _hold(self, batch: RolloutBatch, staleness: int) -> None:
        """Held until the step is whole (``holds_whole_step``), then trained in units."""
        if not self._held:
            self._step_started = time.time()
        self._held.append((batch, staleness))
        if sum(b.num_samples for b, _ in self._held) < self.step_samples:
            return
        if self.colocated:
            await self._take_gpus()
        held, self._held = self._held, []
        assigned = await asyncio.to_thread(self._assign_advantages, [b for b, _ in held])
        unit: list[tuple[RolloutBatch, int]] = []
        for b, (_, s) in zip(assigned, held, strict=True):
            unit = await self._grow_unit(unit, b, s)
        if unit:
            await self._train_into_step(unit)

    async def _grow_unit(self, unit: list[tuple[RolloutBatch, int]], batch: RolloutBatch,
                         staleness: int) -> list[tuple[RolloutBatch, int]]:
        """``unit`` (untrained micro-batches of the current step) with ``batch``; trained,
        and so emptied, once it holds ``max_gather`` of them or reaches ``_next_boundary``."""
        unit = [*unit, (batch, staleness)]
        done = sum(b.num_samples for b in self._step_batches) + sum(b.num_samples for b, _ in unit)
        if len(unit) < self.max_gather and done < self._next_boundary():
            return unit
        await self._train_into_step(unit)
        return []

    def _next_boundary(self) -> int:
        """Samples into the step at which the trained micro-batches are applied: its end
        (``PPOTrainerStage``: the end of the current mini-batch)."""
        return self.step_samples

    async def _take_gpus(self) -> None:
        """placement: colocate: every rollout worker asleep before the step trains."""
        t0 = time.time()
        workers, timeout = self.cfg.rollout.num_workers, self.cfg.train.weight_sync_timeout_s
        asleep = await self.ctx.controller.hand_gpus_to_trainer(self.engine.version, workers, timeout)
        if len(asleep) < workers:
            raise RuntimeError(
                f"placement: colocate: {workers - len(asleep)} of {workers} rollout worker(s) did not free the GPU "
                f"within train.weight_sync_timeout_s ({timeout:g} s) for step {self.engine.version}; asleep: {asleep}")
        free, total = await asyncio.to_thread(self.engine.release_cached_memory)
        self._colocate_metrics = {"colocate/handoff_s": time.time() - t0,
                                  **({"colocate/gpu_free_gib": free / (1 << 30),
                                      "colocate/gpu_free_fraction": free / total} if total else {})}

    async def _train_into_step(self, unit: list[tuple[RolloutBatch, int]]) -> None:
        """Train the micro-batches of ``unit`` (with their staleness) into the current step
        as one batch; the optimizer steps once the step is whole."""
        if not self._step_batches:
            if not self.holds_step:  # held: the step started when its first micro-batch was held
                self._step_started = time.time()
            self._step_rng = self.engine.get_rng_state()
            self._step_pieces, self._step_layouts, self._step_gathers = [], {}, {}
        batches = [b for b, _ in unit]
        batch = gather_micro_batches(batches)
        t0 = time.time()
        trained = await self._train(batch)
        self._step_train_s += time.time() - t0
        pieces = [p for p, _ in trained]
        weights = [compute_piece_weight(p, batch, self.cfg.algorithm.loss_agg) for p in pieces]
        metrics = merge_piece_metrics([m for _, m in trained], weights)
        if len(pieces) > 1:
            self._step_layouts[batch.batch_id] = [count_groups(p) for p in pieces]
        if len(batches) > 1:
            self._step_gathers[batch.batch_id] = [b.batch_id for b in batches]
        self._step_batches.extend(batches)
        self._step_units.append(batch)
        self._step_metrics.append(metrics)
        for b, staleness in unit:
            self._step_staleness += [staleness] * b.num_samples
        if sum(b.num_samples for b in self._step_batches) >= self.step_samples:
            await self._optimizer_step()
        else:
            await self._micro_batch_trained()

    async def _micro_batch_trained(self) -> None:
        """After a micro-batch that did not complete its step (``PPOTrainerStage`` applies
        a complete first-epoch mini-batch here)."""
        return None

    def _assign_advantages(self, batches: list[RolloutBatch]) -> list[RolloutBatch]:
        """``batches`` (one micro-batch, or a held step's) with their advantages
        (``assign_step_advantages``: a step-wide whitening sees them all); with
        ``use_kl_in_reward`` the penalty measured on each joins the step's KL record."""
        from stages.algorithms import assign_step_advantages  # imports torch: not at module level
        from stages.algorithms.registry import build_loss_mask, compute_kl_reward_penalty, summarise_kl_penalty

        algo = self.cfg.algorithm
        if not algo.use_kl_in_reward:
            return assign_step_advantages(batches, algo)
        for batch in batches:
            mask = build_loss_mask(batch)
            self._step_kl.append((summarise_kl_penalty(compute_kl_reward_penalty(batch, algo, mask), mask),
                                  batch.num_samples))
        return assign_step_advantages(batches, algo, kl_reward_coef=self.kl_ctrl.coef)

    def _record_upstream_drops(self, batch: RolloutBatch) -> None:
        """Prompts an upstream stage dropped (it told the ledger already): into this
        trainer's account of the run (counts, done set, checkpoints), once."""
        from stages.rewards.shaping import ZERO_VARIANCE

        for reason, indices in batch.dropped_prompts.items():
            self.dropped[reason] = self.dropped.get(reason, 0) + len(indices) * batch.group_size
            self.checkpoints.record_dropped_prompts(list(indices), reason)
            if reason == ZERO_VARIANCE:
                self._step_zero_variance += len(indices)

    # ------------------------------------------------------------------ memory
    def _estimate(self, piece: RolloutBatch) -> int:
        return estimate_batch_bytes("trainer", self.shape, count_seq_lens(piece), chunk_size=self.engine.chunk_size,
                                    logit_tokens=self.engine.logit_tokens, pass_tokens=self.engine.pass_tokens,
                                    unit_rows=self.engine.unit_rows, checkpointed=self.engine.gradient_checkpointing)

    async def _train(self, batch: RolloutBatch) -> list[tuple[RolloutBatch, dict[str, float]]]:
        """(piece, metrics) for each piece ``batch`` was trained as, in order."""
        scale = compute_micro_batch_scale(batch, self.step_samples, self.cfg.algorithm.loss_agg)
        if not self.guard.protected:
            metrics = await asyncio.to_thread(self.engine.train_micro_batch, batch, scale)
            self._step_pieces.append((batch, scale))
            return [(batch, metrics)]
        return await self.guard.run(
            batch, functools.partial(self._train_recovering, batch, scale), estimate=self._estimate,
            split=split_rollout_batch, merge=lambda parts: [x for part in parts for x in part],
            size=count_groups, key=batch.batch_id,
        )

    async def _train_recovering(
        self, batch: RolloutBatch, scale: float, piece: RolloutBatch
    ) -> list[tuple[RolloutBatch, dict[str, float]]]:
        """Train one admitted piece of ``batch``, halving on OOM (see the module guarantees)."""
        rec: OomRecovery[RolloutBatch, tuple[RolloutBatch, dict[str, float]]] = OomRecovery(
            piece, split_rollout_batch, stage=self.guard.stage, size=count_groups)
        on_event = self.guard.on_oom(batch.batch_id)
        while (p := rec.next_piece()) is not None:
            s = scale * compute_piece_weight(p, batch, self.cfg.algorithm.loss_agg)
            rng = self.engine.get_rng_state()
            try:
                metrics = await self.guard.measure(
                    self._estimate(p), functools.partial(asyncio.to_thread, self.engine.train_micro_batch, p, s))
            except Exception as exc:
                # Several ranks: the retry cannot be coordinated across them yet, so the
                # engine's error (``TrainerRankError``, OOM or not) stops the run.
                if not is_oom_error(exc) or self.cfg.train.num_ranks > 1:
                    raise
                event = rec.failed(exc)  # raises OomUnrecoverable for a single group
            else:
                rec.succeeded((p, metrics))
                self._step_pieces.append((p, s))
                continue
            # Out of the except block: the error's frames (and the piece's tensors) are gone.
            await asyncio.to_thread(self._restore_after_oom, rng)
            on_event(event)
        done = rec.recovered_event()
        if done is not None:
            on_event(done)
        return rec.results

    def _restore_after_oom(self, rng: bytes) -> None:
        free_cached_memory()
        if not self.engine.gradients_tainted:
            self.engine.set_rng_state(rng)  # as if the failed attempt never ran
            return
        self.engine.discard_gradients()
        self.engine.set_rng_state(self._step_rng)
        for piece, scale in self._step_pieces:
            self.engine.train_micro_batch(piece, scale)

    async def _drop(self, batch: RolloutBatch, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + batch.num_samples
        self.checkpoints.record_drop(batch, reason)
        self.ctx.log.info("batch_dropped", reason=reason, batch_id=batch.batch_id,
                          policy_version=batch.policy_version, trainer_version=self.engine.version)
        await self.ctx.controller.record_dropped(len(batch.prompts), reason)

    async def _optimizer_step(self) -> None:
        batches, units, pieces = self._step_batches, self._step_units, self._step_metrics
        self._step_batches, self._step_units, self._step_metrics = [], [], []
        layouts, self._step_layouts = self._step_layouts, {}
        gathers, self._step_gathers = self._step_gathers, {}
        self._step_pieces = []
        staleness, self._step_staleness = self._step_staleness, []
        late, self._step_late = self._step_late, 0
        train_s, self._step_train_s = self._step_train_s, 0.0
        t0 = time.time()
        before = self.engine.version
        step_out = await asyncio.to_thread(self._apply_step_update, batches)
        update_s, self._step_update_s = self._step_update_s + time.time() - t0, 0.0
        if step_out.get("skipped_nonfinite") and self.engine.version == before:
            await self._skip_bad_step(batches, units, pieces, step_out)
            return
        self._bad_in_a_row = 0
        version = self.engine.version
        step = version - 1
        samples = sum(b.num_samples for b in batches)
        kl_metrics = self._update_kl_controller(samples)
        self.trained_samples += samples
        self.steps_done += 1
        update, payload, sync_s = None, None, 0.0
        if version % self.cfg.train.sync_interval == 0:
            update, payload, sync_s = await self._export(version)
        now = time.time()
        step_s = now - self._step_started
        tokens = sum(b.num_tokens for b in batches)
        weight = [p.get("num_tokens", 1.0) for p in pieces]
        metrics: dict[str, Any] = {
            "step": step,
            "time": now,
            "policy_version": version,
            **summarise_batch_rewards(batches),
            **summarise_reward_extras(batches),
            **summarise_rollout_extras(batches),
            "staleness/mean": float(np.mean(staleness)),
            "staleness/max": int(np.max(staleness)),
            "dataflow/max_staleness": self._step_bound(batches),
            **{f"staleness/hist/{k}": int(v) for k, v in zip(*np.unique(staleness, return_counts=True), strict=True)},
            "samples/trained": self.trained_samples,
            "samples/dropped": sum(self.dropped.values()),
            "time/step_s": step_s,
            "throughput/tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            # Where the step's time went in the trainer (the rest of time/step_s: waiting
            # for micro-batches, advantages, the colocated handoff; PPO's update holds its
            # mini-batches and epochs).
            "timing_s/train": train_s,
            "timing_s/update": update_s,
            "timing_s/weight_publish": sync_s,
            **summarise_step_batches(batches, self._take_zero_variance()),
            "samples/dropped_zero_variance": self.dropped.get("zero_variance", 0),
            "samples/dropped_stale": self.dropped.get("stale", 0),
            "samples/late": late,  # of this step's, trained beyond their bound
            **kl_metrics,
            **self.checkpoints.step_curriculum(batches),
            **{f"actor/{k}": float(np.average([p[k] for p in pieces], weights=weight))
               for k in ("loss", "pg_loss", "kl", "clip_frac", "clip_frac_upper", "clip_frac_lower", "clip_frac_dual",
                         "ratio_mean", "is_weight_mean", "is_weight_capped_frac", "adv_abs_mean",
                         "entropy", "router_aux_loss", "preference_accuracy", "reward_margin", "chosen_reward",
                         "rejected_reward")
               if all(k in p for p in pieces)},
            **{f"actor/{k}": float(v) for k, v in pool_logp_mismatch(pieces).items()},
            **{f"actor/{k}": float(max(p[k] for p in pieces))
               for k in ("ratio_max", "is_weight_max") if all(k in p for p in pieces)},
            **{f"actor/{k}": float(v) for k, v in step_out.items()},
            **summarise_pass_padding(pieces),
            "actor/skipped_nonfinite": self.skipped_nonfinite,  # steps not applied so far in this launch
            **{f"memory/trainer_{k}": v for k, v in read_allocator_counters().items()},
            **self._colocate_metrics,
        }

        async def record() -> None:
            self.checkpoints.record_step(batches, metrics)
            if self.ctx.recorder is not None:
                await asyncio.to_thread(self._record_step, step, version, batches, units, pieces, step_out,
                                        {**encode_piece_layout(layouts), **encode_gathers(gathers)},
                                        kl_metrics.get("reward/kl_penalty_coef"))
            if self.checkpoints.due():
                await self._write_checkpoint()

        if self.colocated:
            # The trainer's own GPU work first, then its cache back: the publish below
            # wakes vLLM on this GPU.
            await record()
            await asyncio.to_thread(self.engine.release_cached_memory)
            if self.steps_done == 1:
                # The first step built what set-up left lazy (the compiled blocks' graphs
                # and caches, the optimizer's moments): out of the collections too.
                freeze_setup_heap()
        # One call: the ledger, the step's metrics and, on a sync step, its weights.
        await self.ctx.controller.finish_step(sum(len(b.prompts) for b in batches), version, metrics, update, payload)
        if not self.colocated:
            await record()

    async def _skip_bad_step(self, batches: list[RolloutBatch], units: list[RolloutBatch],
                             pieces: list[dict[str, float]], step_out: dict[str, float]) -> None:
        """The step the engine did not apply (see the module guarantees)."""
        from pipeline.checkpoint import find_latest_checkpoint

        self.skipped_nonfinite += 1
        self._bad_in_a_row += 1
        self._step_kl = []
        loss = compute_step_loss([p["loss"] for p in pieces], units, self.step_samples, self.cfg.algorithm.loss_agg)
        limit = self.cfg.train.max_bad_steps
        self.ctx.log.warning("nonfinite_step", step=self.engine.version, policy_version=self.engine.version,
                             loss=loss, grad_norm=step_out.get("grad_norm"), in_a_row=self._bad_in_a_row,
                             max_bad_steps=limit)
        for b in batches:
            await self._drop(b, NONFINITE)
        if self._bad_in_a_row >= limit:
            found = await asyncio.to_thread(find_latest_checkpoint, self.run_dir)
            last = (f"the last good checkpoint is {found[0]} (conveyor launch --resume {self.run_dir})"
                    if found else "no checkpoint was written yet")
            raise NonFiniteSteps(f"train.max_bad_steps: {limit} steps in a row at step {self.engine.version} had "
                                 f"a non-finite loss or gradient norm and were not applied; {last}")

    def _apply_step_update(self, batches: list[RolloutBatch]) -> dict[str, float]:
        """The step's optimizer update on the gradients its micro-batches accumulated
        (``PPOTrainerStage`` runs its further mini-batches and epochs here)."""
        return self.engine.optimizer_step(compute_step_grad_scale(batches, self.step_samples,
                                                                  self.cfg.algorithm.loss_agg))

    def _step_bound(self, batches: list[RolloutBatch]) -> int:
        """The staleness bound the step's micro-batches were held to (one per step, see
        ``pipeline.versions.StalenessSchedule``; the largest if a regrouping mixed them)."""
        return max(batch_bound(b.max_staleness, self.max_staleness) for b in batches)

    def _take_zero_variance(self) -> int:
        n, self._step_zero_variance = self._step_zero_variance, 0
        return n

    def _update_kl_controller(self, samples: int) -> dict[str, float]:
        """After a step: its KL-in-reward metrics, and the controller's next coefficient
        (kept in the engine's saved state)."""
        measured, self._step_kl = self._step_kl, []
        if not self.cfg.algorithm.use_kl_in_reward or not measured:
            return {}
        kl = float(np.average([k for k, _ in measured], weights=[n for _, n in measured]))
        used = self.kl_ctrl.coef
        self.kl_ctrl.update(kl, samples)
        self.engine.extra_state.update(self.kl_ctrl.state())
        return {"reward/kl_penalty": kl, "reward/kl_penalty_coef": used}

    async def _write_checkpoint(self) -> None:
        path = await asyncio.to_thread(self.checkpoints.write)
        if path is None:  # train.on_checkpoint_error: continue
            self.ctx.log.warning("checkpoint_failed", detail=self.checkpoints.last_error,
                                 policy_version=self.engine.version)
            return
        self.ctx.log.info("checkpoint_written", path=str(path), policy_version=self.engine.version)

    async def _export(self, version: int) -> tuple[WeightUpdate, Any, float]:
        """The weights of ``version``, their ``WeightUpdate`` and their payload (the bytes when
        they fit inline, else a reference to them in the object store; ``finish_step``
        publishes them), and the seconds that took."""
        t0 = time.time()
        with self.ctx.spans.span("sync"):
            if self.transport == "cuda_ipc":
                # A descriptor of buckets on this GPU: its sha guards the descriptor only,
                # so the step record hashes the weights themselves when it needs to.
                data, sha, fingerprint = await asyncio.to_thread(self.engine.export_weights_ipc)
            else:
                data, sha, fingerprint = await asyncio.to_thread(self.engine.export_weights)
                self._published_sha = (version, sha)  # the step record reuses it: no second serialisation
            update = WeightUpdate(version=version, sha256=sha, fingerprint=fingerprint, num_bytes=len(data))
            # A small payload (the CUDA IPC descriptor) travels by value: no object in the
            # store, and none of Ray's per-borrowed-reference bookkeeping, which grows.
            payload = data if fits_inline(data) else ray.put(data)
        seconds = time.time() - t0
        self.publishes += 1
        self.publish_s_total += seconds
        return update, payload, seconds

    # ------------------------------------------------------------------ replay support
    def _record_step(self, step: int, version: int, batches: list[RolloutBatch], units: list[RolloutBatch],
                     pieces: list[dict[str, float]], step_out: dict[str, float],
                     layout: Mapping[str, float], kl_reward_coef: float | None = None) -> None:
        import torch

        # The KL-in-reward coefficient the step's advantages used: replay assigns them the same way.
        kl_coef = {"kl_reward_coef": float(kl_reward_coef)} if kl_reward_coef is not None else {}
        loss = compute_step_loss([p["loss"] for p in pieces], units, self.step_samples,
                                 self.cfg.algorithm.loss_agg)
        record = StepRecord(
            step=step, policy_version=version, batch_ids=[b.batch_id for b in batches],
            loss=loss, grad_norm=float(step_out["grad_norm"]),
            weights_sha256=(self._published_sha[1] if self._published_sha[0] == version
                            else self.engine.weights_sha256()),
            # Replay pins the same thread count: summation order can depend on it.
            metrics={**{k: float(v) for k, v in step_out.items()}, "torch_threads": float(torch.get_num_threads()),
                     **layout, **kl_coef},
            rng_state=self._step_rng,
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
        # Before the drops below: a step cut short by a stop is not done, so a resumed
        # run issues its prompts again.
        if self.checkpoints.enabled and (self.checkpoints.dirty
                                         or self.checkpoints.last_written != self.engine.version):
            await self._write_checkpoint()
        if self._step_batches or self._held:
            # The ledger admits whole steps, so this only happens when a run is cut short
            # (colocated: the step's micro-batches may still be held, untrained).
            for b in [*self._step_batches, *(b for b, _ in self._held)]:
                await self._drop(b, "incomplete_step")
            self._step_batches, self._step_units, self._held = [], [], []
        if self.cfg.train.save_checkpoint:
            out = self.run_dir / "checkpoint"
            await asyncio.to_thread(self.engine.save_pretrained, out)
            self.ctx.log.info("checkpoint_saved", path=str(out), policy_version=self.engine.version)
        return None

    def status(self) -> dict[str, Any]:
        return {"state": "training", "policy_version": self.engine.version, "steps": self.steps_done,
                "skipped_nonfinite": self.skipped_nonfinite,
                "checkpoint_write_failures": self.checkpoints.failed_writes, **self.guard.status()}

    def result(self) -> dict[str, Any]:
        return {
            "steps": self.steps_done,
            "policy_version": self.engine.version,
            "samples_trained": self.trained_samples,
            "samples_dropped": dict(self.dropped),
            "weight_transport": self.transport,
            "skipped_nonfinite": self.skipped_nonfinite,
            "checkpoint_write_failures": self.checkpoints.failed_writes,
            # GPUs each data-parallel rank saw (CUDA_VISIBLE_DEVICES), rank 0 first.
            "rank_devices": getattr(self.engine, "devices", None),
            "weight_publish_s": {"count": self.publishes,
                                 "mean": self.publish_s_total / self.publishes if self.publishes else 0.0},
            "checkpoint": str(self.run_dir / "checkpoint") if self.cfg.train.save_checkpoint else None,
            **({"lora": self.lora_params} if self.lora_params else {}),
            **self.checkpoints.accounting(),
        }
