"""The critic stage: a value model that scores each micro-batch on its way to the trainer
and learns from the returns GAE gives it.

Guarantees:
- ``CriticEngine.compute_values`` returns float32 [S, C] aligned with
  ``completion_ids``: entry ``[i, j]`` is the value of the state before completion token
  ``j`` (the head's output at position ``prompt_len + j - 1``), exactly 0 past
  ``completion_lens[i]``; computed under ``torch.no_grad()`` in ``chunk_size``-sample
  forwards.
- ``CriticStage.process`` sets ``values`` and, through the algorithm registry
  (``assign_advantages``, the only place advantages are computed), ``advantages``,
  ``loss_mask`` and ``returns``; the trainer keeps advantages a batch arrives with. The
  batch leaves with the values predicted *before* the critic learned from it (the
  values GAE used), and only then does the critic train on it: ``critic.epochs`` passes,
  one optimizer step each, of the clipped value loss against those old values.
- The value model is the policy architecture with a one-output token head
  (``AutoModelForTokenClassification``, ``num_labels=1``) loaded from ``critic.path`` or,
  by default, from the policy checkpoint with a fresh head (seeded by ``run.seed``). It
  trains in a DeepSpeed engine built by ``stages.trainer.engine.build_deepspeed_engine``
  with ``train``'s ZeRO stage and the critic's own lr, weight decay and clipping.
- Its state (weights, optimizer, micro-batches seen) is written atomically to
  ``RUN_DIR/critic/state`` every ``train.checkpoint_every`` optimizer steps of the policy
  (by the steps of the micro-batches it sees) and when the stream ends; a resumed run
  (``run.resume_from``) loads it. The critic runs ahead of the trainer by the
  micro-batches in flight, so its state may have learned from a few micro-batches the
  resumed policy will see again; values are a baseline, not part of the exact sample
  accounting.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from pipeline.plugins import register_stage
from pipeline.types import RolloutBatch
from stages.models.logprobs import build_model_inputs

STATE_DIR = "critic"  # under the run dir


def gather_completion_values(scores: torch.Tensor, positions: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """[s, L] per-position head outputs -> [s, C] values of the states before each
    completion token (position ``positions - 1``), 0 where ``completion_mask`` is 0."""
    index = (positions - 1).clamp(min=0, max=scores.shape[1] - 1).to(scores.device)
    values = torch.gather(scores, 1, index)
    valid = completion_mask.to(scores.device) > 0
    return torch.where(valid, values, torch.zeros_like(values))


class CriticEngine:
    """Value model + DeepSpeed optimizer on one process (see the module guarantees).

    ``critic`` is a ``CriticConfig``, ``train`` the run's ``TrainConfig`` (ZeRO stage,
    grad accumulation dtype); ``dtype`` the model dtype (mixed precision on a GPU)."""

    def __init__(self, model_path: Path, critic: Any, train: Any, dtype: str, seed: int,
                 total_steps: int = 0) -> None:
        from transformers import AutoModelForTokenClassification

        from stages.trainer.engine import build_deepspeed_engine, enable_gradient_checkpointing

        if critic.threads > 0:
            torch.set_num_threads(critic.threads)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # the fresh head's initial weights
        self.critic = critic
        self.model_path = Path(model_path)
        model = AutoModelForTokenClassification.from_pretrained(self.model_path, num_labels=1, dtype=torch.float32)
        if train.gradient_checkpointing:  # as the policy's blocks: recomputed in backward
            enable_gradient_checkpointing(model)
        model.train()
        # The critic's optimiser: the run's ZeRO stage and dtype, its own lr and clipping;
        # a constant schedule (the critic steps per micro-batch, not per policy step).
        own = msgspec.structs.replace(train, lr=critic.lr, weight_decay=critic.weight_decay,
                                      grad_clip=critic.grad_clip, lr_scheduler="constant", warmup_steps=0)
        self.engine = build_deepspeed_engine(model, own, dtype, total_steps)
        self.module = self.engine.module
        self.steps = 0

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        device = next(self.module.parameters()).device
        length = int(attention_mask.sum(dim=1).max()) if attention_mask.numel() else 0
        if length == 0:
            return torch.zeros(completion_mask.shape, device=device)
        out = self.engine(input_ids=input_ids[:, :length].to(device),
                          attention_mask=attention_mask[:, :length].to(device), use_cache=False)
        scores = out.logits[..., 0].float()
        return gather_completion_values(scores, positions.clamp(max=length), completion_mask)

    def _chunks(self, num: int) -> list[tuple[int, int]]:
        size = self.critic.chunk_size
        return [(a, min(a + size, num)) for a in range(0, num, size)]

    def compute_values(self, batch: RolloutBatch) -> np.ndarray:
        """[S, C] float32 values of ``batch`` (see the module guarantees)."""
        ids, att, cmask, pos = build_model_inputs(batch)
        self.module.eval()
        try:
            with torch.no_grad():
                parts = [self._forward(ids[a:b], att[a:b], cmask[a:b], pos[a:b]).cpu() for a, b in
                         self._chunks(batch.num_samples)]
        finally:
            self.module.train()
        if not parts:
            return np.zeros(batch.completion_ids.shape, dtype=np.float32)
        return np.ascontiguousarray(torch.cat(parts).numpy(), dtype=np.float32)

    def train_values(self, batch: RolloutBatch) -> dict[str, float]:
        """``critic.epochs`` optimizer steps of the clipped value loss on ``batch``, whose
        ``values`` (old predictions), ``returns`` and ``loss_mask`` are set. Returns the
        metrics of the last pass (its loss before that pass's step)."""
        from stages.algorithms.losses import compute_value_loss

        if batch.values is None or batch.returns is None or batch.loss_mask is None:
            raise ValueError(f"batch {batch.batch_id}: the critic trains on values, returns and loss_mask; "
                             f"assign_advantages must run first")
        ids, att, cmask, pos = build_model_inputs(batch)
        mask = cmask * torch.as_tensor(np.asarray(batch.loss_mask), dtype=cmask.dtype)
        old = torch.as_tensor(np.asarray(batch.values, dtype=np.float32))
        ret = torch.as_tensor(np.asarray(batch.returns, dtype=np.float32))
        total = float(mask.sum())
        metrics: dict[str, float] = {}
        for _ in range(self.critic.epochs):
            metrics = {}
            for a, b in self._chunks(batch.num_samples):
                weight = float(mask[a:b].sum()) / total if total else 0.0
                values = self._forward(ids[a:b], att[a:b], cmask[a:b], pos[a:b])
                device = values.device
                loss, chunk = compute_value_loss(values, old[a:b].to(device), ret[a:b].to(device),
                                                 mask[a:b].to(device), clip_eps=self.critic.value_clip)
                # Token-mean over the micro-batch: each chunk weighs its share of tokens.
                self.engine.backward(loss * weight, scale_wrt_gas=False)
                for key, value in chunk.items():
                    metrics[key] = metrics.get(key, 0.0) + weight * value
            metrics["grad_norm"] = self._step()
        return metrics

    def _step(self) -> float:
        from stages.trainer.engine import compute_grad_norm, optimizer_reports_grad_norm

        own = None if optimizer_reports_grad_norm(self.engine.optimizer) else compute_grad_norm(self.module)
        self.engine.step()
        self.steps += 1
        norm = own if own is not None else self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def save_state(self, path: Path, extra: dict[str, Any]) -> None:
        from stages.trainer.engine import save_engine_state

        save_engine_state(self.engine, path, {"critic_steps": self.steps, **extra})

    def load_state(self, path: Path) -> dict[str, Any]:
        from stages.trainer.engine import load_engine_state

        state = load_engine_state(self.engine, path)
        self.steps = int(state["critic_steps"])
        return state


def write_critic_state(engine: CriticEngine, run_dir: Path, extra: dict[str, Any]) -> Path:
    """``RUN_DIR/critic/state``, replaced atomically (written aside, then renamed)."""
    root = Path(run_dir) / STATE_DIR
    root.mkdir(parents=True, exist_ok=True)
    tmp, final, old = root / "state.tmp", root / "state", root / "state.old"
    shutil.rmtree(tmp, ignore_errors=True)
    engine.save_state(tmp, extra)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def find_critic_state(run_dir: Path) -> Path | None:
    """The critic state a resumed run loads (``state``, or ``state.old`` when a crash
    came between the two renames of ``write_critic_state``)."""
    for name in ("state", "state.old"):
        path = Path(run_dir) / STATE_DIR / name
        if path.is_dir():
            return path
    return None


def build_critic_engine(cfg: Any) -> CriticEngine:
    from stages.models.tiny import resolve_model_path

    path = Path(cfg.critic.path).expanduser() if cfg.critic.path else resolve_model_path(cfg.model)
    return CriticEngine(path, cfg.critic, cfg.train, cfg.model.dtype, cfg.run.seed)


@register_stage("critic")
class CriticStage:
    """Actor shell: values, advantages and returns for each micro-batch, then learning."""

    takes = gives = RolloutBatch  # pipeline/contracts.py
    takes_fields = ("rewards",)
    gives_fields = ("values", "advantages", "loss_mask", "returns")

    async def setup(self, ctx: Any) -> None:
        self.ctx = ctx
        self.cfg = ctx.config
        self.engine = await asyncio.to_thread(build_critic_engine, self.cfg)
        self.batches = 0
        self.last_checkpoint_step = 0
        self.metrics: dict[str, float] = {}
        if self.cfg.run.resume_from:
            path = find_critic_state(self.cfg.run_dir)
            if path is not None:
                state = await asyncio.to_thread(self.engine.load_state, path)
                self.batches = int(state.get("batches", 0))
                self.last_checkpoint_step = int(state.get("checkpoint_step", 0))
                ctx.log.info("critic_resumed", path=str(path), critic_steps=self.engine.steps)

    def _assign(self, batch: RolloutBatch) -> RolloutBatch:
        from stages.algorithms import assign_advantages

        algo = self.cfg.algorithm
        valued = msgspec.structs.replace(batch, values=self.engine.compute_values(batch))
        coef = algo.kl_ctrl.kl_coef if algo.use_kl_in_reward else 0.0
        return assign_advantages(valued, algo, kl_reward_coef=coef)

    async def process(self, batch: RolloutBatch) -> RolloutBatch:
        if batch.num_samples == 0:  # it only carries prompts dropped upstream to the trainer
            return batch
        if batch.rewards is None:
            raise ValueError(f"batch {batch.batch_id}: reaches the critic without rewards (is a reward stage wired?)")
        out = await asyncio.to_thread(self._assign, batch)
        self.metrics = await asyncio.to_thread(self.engine.train_values, out)
        self.batches += 1
        await self._maybe_checkpoint(batch.step)
        return out

    async def _maybe_checkpoint(self, step: int) -> None:
        every = self.cfg.train.checkpoint_every
        if every and self.cfg.train.resumable and step // every > self.last_checkpoint_step // every:
            self.last_checkpoint_step = step
            await asyncio.to_thread(self._write)

    def _write(self) -> Path:
        return write_critic_state(self.engine, self.cfg.run_dir,
                                  {"batches": self.batches, "checkpoint_step": self.last_checkpoint_step})

    async def finish(self) -> None:
        if not self.cfg.train.resumable:
            return
        path = await asyncio.to_thread(self._write)
        self.ctx.log.info("critic_state_saved", path=str(path), critic_steps=self.engine.steps)

    def status(self) -> dict[str, Any]:
        return {"state": "valuing", "batches": self.batches, "critic_steps": self.engine.steps,
                **{f"critic/{k}": v for k, v in self.metrics.items()}}

    def result(self) -> dict[str, Any]:
        return {"batches": self.batches, "critic_steps": self.engine.steps,
                **{f"critic/{k}": v for k, v in self.metrics.items()}}
