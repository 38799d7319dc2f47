"""Reference stage core: the frozen initial policy scoring completion tokens.

Guarantees:
- The model is loaded once from a local checkpoint, put in eval mode with every
  parameter frozen (``requires_grad=False``), and never changes afterwards.
- ``compute`` returns a new ``RolloutBatch`` (the input is not mutated) whose
  ``ref_logprobs`` is float32 [S, C], aligned with ``completion_ids``, zero on padding,
  computed under ``torch.no_grad()`` in the trainer's passes: ``pass_tokens`` padded
  tokens a pass, rows grouped by length (``pipeline/memory/packing.py``), or
  ``chunk_size``-sample passes with it 0 (see ``stages/models/logprobs.py``); the
  grouping changes no value beyond float rounding. ``ref/padding_fraction`` (and
  ``_unpacked``, for ``chunk_size`` chunks) count every pass it ran so far.
- Log-probs are taken at ``temperature``, which should be the rollout temperature: the
  trainer scores the current policy at that temperature, and the KL penalty compares
  the two distributions, so both sides must use the same one.

``ReferenceStage`` is the thin actor shell: it loads the model in a thread and scores
each micro-batch off the event loop, under ``reference.memory``: a micro-batch is
admitted against the budget or split by whole GRPO groups, an out-of-memory error halves
the failing piece, and the pieces' results are merged back into one micro-batch with
every sample once (``pipeline/memory/guard.py``); each forward's peak teaches the
estimate's calibration.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from pipeline.dtypes import MODEL_DTYPES, resolve_dtype
from pipeline.memory.admission import ModelShape, count_seq_lens, estimate_batch_bytes
from pipeline.memory.guard import MemoryGuard
from pipeline.memory.oom import run_with_oom_recovery
from pipeline.memory.packing import count_pass_tokens, padding_fraction, plan_passes
from pipeline.memory.splitting import count_groups, merge_rollout_batches, split_rollout_batch
from pipeline.plugins import register_stage
from pipeline.types import RolloutBatch
from stages.models.logprobs import LOGIT_CHUNK_TOKENS, compute_completion_logprobs, find_chunkable_head


def build_model_shape(model: Any, dtype: str) -> ModelShape:
    """What memory estimates need of a loaded Hugging Face model that computes in
    ``dtype`` (the activations' dtype, which can differ from the checkpoint's)."""
    return ModelShape.from_hf_config(
        {**model.config.to_dict(), "torch_dtype": dtype},
        # ds_numel: a ZeRO 3 partitioned parameter's whole size (its numel is its partition's).
        num_params=sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
    )


class ReferenceModel:
    """Frozen causal LM that adds ``ref_logprobs`` to rollout batches.

    ``temperature``: see the module guarantees. ``threads`` > 0 sets torch's intra-op
    thread count for this process (0 leaves the default); ``device`` defaults to CUDA
    when available.
    """

    def __init__(
        self,
        model_path: Path,
        dtype: str | torch.dtype = "float32",
        threads: int = 0,
        temperature: float = 1.0,
        chunk_size: int = 16,
        device: str | None = None,
        logit_chunk_tokens: int = LOGIT_CHUNK_TOKENS,
        pass_tokens: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if threads > 0:
            torch.set_num_threads(threads)
        if chunk_size < 1:
            raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
        self.model_path = Path(model_path)
        if pass_tokens < 0:
            raise ValueError(f"train.pass_tokens: expected >= 0 (0: chunks of chunk_size samples), got {pass_tokens}")
        self.chunk_size = chunk_size
        self.pass_tokens = pass_tokens
        # Tokens of every pass so far: real (prompt + completion), computed (padding
        # included), and what chunk_size chunks would have computed.
        self.real_tokens = self.computed_tokens = self.unpacked_tokens = 0
        self.temperature = float(temperature)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=resolve_dtype(dtype, "model.dtype", MODEL_DTYPES))
        model.requires_grad_(False)
        self.model = model.eval().to(self.device)
        # Rows of logits alive at once (stages.models.logprobs); None: the dense head.
        chunkable = logit_chunk_tokens and find_chunkable_head(self.model) is not None
        self.logit_tokens = logit_chunk_tokens if chunkable else None

    def compute(self, batch: RolloutBatch) -> RolloutBatch:
        """``batch`` with ``ref_logprobs`` [S, C] float32 filled in."""
        lens = count_seq_lens(batch)
        passes = plan_passes(lens, self.pass_tokens, self.chunk_size)
        with torch.no_grad():
            logprobs = compute_completion_logprobs(
                self.model, batch, temperature=self.temperature, chunk_size=self.chunk_size,
                chunk_tokens=self.logit_tokens or 0, passes=passes,
            )
        ref = np.ascontiguousarray(logprobs.to("cpu", torch.float32).numpy(), dtype=np.float32)
        real, computed = count_pass_tokens(lens, passes)
        self.real_tokens += real
        self.computed_tokens += computed
        self.unpacked_tokens += count_pass_tokens(lens, plan_passes(lens, 0, self.chunk_size))[1]
        return msgspec.structs.replace(batch, ref_logprobs=ref)

    def padding_metrics(self) -> dict[str, float]:
        """``ref/padding_fraction`` and ``ref/padding_fraction_unpacked`` over every pass so far."""
        return {"ref/padding_fraction": padding_fraction(self.real_tokens, self.computed_tokens),
                "ref/padding_fraction_unpacked": padding_fraction(self.real_tokens, self.unpacked_tokens)}


@register_stage("reference")
class ReferenceStage:
    """Actor shell: ``reference.path`` (default ``model.path``) scored at the rollout temperature
    (``scoring_temperature``: 1 for offline pairs)."""

    takes = gives = RolloutBatch  # pipeline/contracts.py
    gives_fields = ("ref_logprobs",)

    async def setup(self, ctx: Any) -> None:
        importing = time.monotonic()
        from stages.models.tiny import resolve_model_path

        cfg = ctx.config
        path = Path(cfg.reference.path).expanduser() if cfg.reference.path else resolve_model_path(cfg.model)
        loading = time.monotonic()
        self.setup_doing = f"loading the reference model from {path}"  # the driver's setting_up lines
        self.model = await asyncio.to_thread(
            ReferenceModel, path, cfg.model.dtype, temperature=cfg.scoring_temperature,
            logit_chunk_tokens=cfg.train.logit_chunk_tokens, pass_tokens=cfg.train.pass_tokens,
        )
        # In the launch's start-up report (pipeline/stage.py): imports (torch,
        # transformers), then the model read onto its device.
        self.startup_phases = {"imports": loading - importing, "model": time.monotonic() - loading}
        self.ctx = ctx
        self.shape = build_model_shape(self.model.model, cfg.model.dtype)
        self.guard = MemoryGuard(ctx.name, cfg.reference.memory, spans=ctx.spans)
        self.batches = 0

    async def process(self, batch: RolloutBatch) -> RolloutBatch:
        if batch.num_samples == 0:  # it only carries prompts dropped upstream to the trainer
            return batch
        out = await self.guard.run(
            batch, self._score_recovering, estimate=self._estimate, split=split_rollout_batch,
            merge=merge_rollout_batches, size=count_groups, key=batch.batch_id,
        )
        self.batches += 1
        return out

    def _estimate(self, piece: RolloutBatch) -> int:
        return estimate_batch_bytes("reference", self.shape, count_seq_lens(piece), chunk_size=self.model.chunk_size,
                                    logit_tokens=self.model.logit_tokens, pass_tokens=self.model.pass_tokens)

    async def _score_recovering(self, piece: RolloutBatch) -> RolloutBatch:
        if not self.guard.protected:
            return await asyncio.to_thread(self.model.compute, piece)
        return await run_with_oom_recovery(
            self._score, piece, split=split_rollout_batch, merge=merge_rollout_batches, stage=self.guard.stage,
            size=count_groups, on_event=self.guard.on_oom(piece.batch_id),
        )

    async def _score(self, piece: RolloutBatch) -> RolloutBatch:
        return await self.guard.measure(self._estimate(piece), lambda: asyncio.to_thread(self.model.compute, piece))

    def status(self) -> dict[str, Any]:
        return {"state": "scoring", "batches": self.batches, **self.guard.status(), **self.model.padding_metrics()}
