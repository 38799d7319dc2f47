"""The reward-model scorer stage: a local sequence classifier scores each completion, and
``reward.sources`` combines its score with the rule reward.

Guarantees:
- ``RewardModel`` loads a local ``AutoModelForSequenceClassification`` checkpoint with
  exactly one logit (else refused, naming the path), frozen, in eval mode;
- ``score`` returns float32 [S]: the logit a direct transformers forward gives for each
  sample's text; padding never moves the position the classifier pools;
- ``combine_reward_sources`` is pure: each source's scores are normalised (``none``,
  ``batch`` or ``running``) and summed with their weights; raw scores travel on as
  ``reward_extras[<source name>]``;
- ``RewardModelStage`` scores under ``reward_model`` memory admission, every sample once;
  running statistics restart with the actor;
- DAPO's overlong penalty and dynamic sampling run here, on the combined reward.
Details: docs/architecture.md, "Reward model".
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from pipeline.plugins import register_stage
from pipeline.types import RolloutBatch


class RunningMoments:
    """Mean and population variance of every value added so far (Chan et al. merge of
    batch moments), for ``normalize: running``."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0

    def update(self, values: np.ndarray) -> None:
        x = np.asarray(values, dtype=np.float64)
        if x.size == 0:
            return
        n, mean, m2 = x.size, float(x.mean()), float(((x - x.mean()) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0


def normalize_scores(scores: np.ndarray, mode: str, moments: RunningMoments | None = None,
                     eps: float = 1e-6) -> np.ndarray:
    """``scores`` [S] normalised by ``mode`` (see the module guarantees); ``running``
    updates ``moments`` with ``scores`` first. A constant batch normalises to 0."""
    x = np.asarray(scores, dtype=np.float64)
    if mode == "none":
        return x.astype(np.float32)
    if mode == "batch":
        mean, std = (float(x.mean()), float(x.std())) if x.size else (0.0, 0.0)
    elif mode == "running":
        if moments is None:
            raise ValueError("normalize 'running': needs the stage's RunningMoments")
        moments.update(x)
        mean, std = moments.mean, moments.std
    else:
        raise ValueError(f"normalize: expected 'none', 'batch' or 'running', got {mode!r}")
    if std < eps:
        return np.zeros_like(x, dtype=np.float32)
    return ((x - mean) / std).astype(np.float32)


def combine_reward_sources(raw: Mapping[str, np.ndarray], sources: Mapping[str, Any],
                           moments: Mapping[str, RunningMoments]) -> np.ndarray:
    """``sum(weight * normalize(raw[name]))`` over ``sources`` (name -> a config with
    ``weight`` and ``normalize``), float32 [S]."""
    total: np.ndarray | None = None
    for name, src in sources.items():
        if name not in raw:
            raise ValueError(f"reward.sources.{name}: no scores for this source")
        part = src.weight * normalize_scores(raw[name], src.normalize, moments.get(name)).astype(np.float64)
        total = part if total is None else total + part
    if total is None:
        raise ValueError("reward.sources: no source to combine")
    return total.astype(np.float32)


def pick_pad_id(sequences: Sequence[Sequence[int]], preferred: int | None) -> int:
    """``preferred`` (the tokenizer's pad id) unless a sequence holds it; otherwise the
    smallest id none of ``sequences`` holds."""
    used = {t for seq in sequences for t in seq}
    if preferred is not None and preferred not in used:
        return preferred
    return next(i for i in range(len(used) + 1) if i not in used)


class RewardModel:
    """Frozen sequence classifier with one logit (see the module guarantees)."""

    def __init__(self, path: Path, dtype: str = "float32", chunk_size: int = 16, device: str | None = None,
                 max_length: int | None = None) -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        from pipeline.dtypes import MODEL_DTYPES, resolve_dtype

        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise ValueError(f"reward.sources: model path {str(self.path)!r}: expected a local Hugging Face "
                             f"checkpoint directory with config.json (nothing is downloaded)")
        labels = AutoConfig.from_pretrained(self.path).num_labels
        if labels != 1:
            raise ValueError(f"reward.sources: model {str(self.path)!r} has {labels} labels; a reward model "
                             f"gives one logit (num_labels 1)")
        if chunk_size < 1:
            raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self.max_length = max_length
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        model = AutoModelForSequenceClassification.from_pretrained(
            self.path, dtype=resolve_dtype(dtype, "model.dtype", MODEL_DTYPES)
        )
        model.requires_grad_(False)
        self.model = model.eval().to(self.device)

    def encode(self, batch: RolloutBatch) -> list[list[int]]:
        """Token ids of each sample: a chat prompt (``Prompt.messages``) and its completion
        as the assistant's reply rendered by the reward model's own chat template when its
        tokenizer has one (the policy's template may not be the one it was trained on);
        otherwise the prompt as the policy saw it + the completion."""
        bos = self.tokenizer.bos_token
        templated = getattr(self.tokenizer, "chat_template", None) is not None
        out = []
        for i, completion in enumerate(batch.completions):
            prompt = batch.prompts[i // batch.group_size]
            if prompt.messages and templated:
                text = self.tokenizer.apply_chat_template(
                    [*prompt.messages, {"role": "assistant", "content": completion}], tokenize=False)
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                special = not (bos and prompt.text.startswith(bos))
                ids = self.tokenizer(prompt.text + completion, add_special_tokens=special)["input_ids"]
            out.append(list(ids[-self.max_length:]) if self.max_length else list(ids))
        return out

    def score_ids(self, sequences: Sequence[Sequence[int]]) -> np.ndarray:
        """float32 [len(sequences)]: the logit of each sequence."""
        scores: list[np.ndarray] = []
        for start in range(0, len(sequences), self.chunk_size):
            chunk = sequences[start:start + self.chunk_size]
            pad = pick_pad_id(chunk, self.tokenizer.pad_token_id)
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            att = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, seq in enumerate(chunk):
                ids[row, :len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
                att[row, :len(seq)] = 1
            # The classifier pools at each row's last token that is not pad_token_id.
            self.model.config.pad_token_id = pad
            with torch.no_grad():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=att.to(self.device)).logits
            scores.append(logits[:, 0].float().cpu().numpy())
        return np.concatenate(scores).astype(np.float32) if scores else np.zeros(0, dtype=np.float32)

    def score(self, batch: RolloutBatch) -> np.ndarray:
        return self.score_ids(self.encode(batch))


def resolve_reward_model_path(path: str, cfg: Any) -> Path:
    """A model source's ``path``: ``tiny`` -> the tiny reward model of ``data.task``, built
    locally when missing (``stages/rewards/tiny_reward_model.py``); otherwise the directory."""
    if path == "tiny":
        from stages.rewards.tiny_reward_model import ensure_tiny_reward_model

        if cfg.data.path:
            raise ValueError("reward.sources: path 'tiny' is the tiny reward model of a built-in data.task; "
                             "a data file needs a reward model checkpoint of its own")
        return ensure_tiny_reward_model(cfg.data.task, cfg.model.cache_dir)
    return Path(path).expanduser()


def split_sources(sources: Mapping[str, Any]) -> tuple[str | None, str]:
    """(name of the ``function`` source or None, name of the ``model`` source)."""
    function = [n for n, s in sources.items() if s.kind == "function"]
    model = [n for n, s in sources.items() if s.kind == "model"]
    if len(model) != 1 or len(function) > 1:
        raise ValueError(f"reward.sources: expected one 'model' source and at most one 'function' source, "
                         f"got {dict((n, s.kind) for n, s in sources.items())}")
    return (function[0] if function else None), model[0]


@register_stage("reward_model")
class RewardModelStage:
    """Actor shell: scores each micro-batch with ``reward.sources``' model and combines.
    Without a ``function`` source it may read the rollout's output directly."""

    takes = gives = RolloutBatch  # pipeline/contracts.py
    gives_fields = ("rewards",)

    async def setup(self, ctx: Any) -> None:
        from pipeline.memory.admission import count_seq_lens, estimate_batch_bytes
        from pipeline.memory.guard import MemoryGuard
        from stages.models.reference import build_model_shape

        cfg = ctx.config
        self.ctx = ctx
        self.sources = dict(cfg.reward.sources)
        self.function_name, self.model_name = split_sources(self.sources)
        src = self.sources[self.model_name]
        path = await asyncio.to_thread(resolve_reward_model_path, src.path, cfg)
        self.model = await asyncio.to_thread(RewardModel, path, cfg.model.dtype, src.chunk_size)
        self.shape = build_model_shape(self.model.model, cfg.model.dtype)
        self.guard = MemoryGuard(ctx.name, src.memory, spans=ctx.spans)
        self._estimate_bytes = lambda piece: estimate_batch_bytes(
            "reference", self.shape, count_seq_lens(piece), chunk_size=self.model.chunk_size)
        self.moments = {n: RunningMoments() for n, s in self.sources.items() if s.normalize == "running"}
        self.batches = 0
        from stages.rewards.shaping import RewardShaper, shapes_rewards

        # This score replaces the reward stage's: DAPO's shaping runs here, on the final reward.
        self.shaper = RewardShaper(cfg) if shapes_rewards(cfg) == "reward_model" else None

    async def process(self, batch: RolloutBatch) -> RolloutBatch | list[RolloutBatch]:
        from pipeline.memory.splitting import count_groups, merge_rollout_batches, split_rollout_batch

        if batch.num_samples == 0:  # it only carries prompts dropped upstream to the trainer
            return batch
        if batch.rewards is None and self.function_name is not None:
            raise ValueError(f"batch {batch.batch_id}: reward.sources.{self.function_name} (kind function) needs the "
                             f"reward stage's scores; is a reward stage wired before the reward model?")
        scored = await self.guard.run(
            batch, self._score_recovering, estimate=self._estimate_bytes, split=split_rollout_batch,
            merge=merge_rollout_batches, size=count_groups, key=batch.batch_id,
        )
        raw = {self.model_name: np.asarray(scored.reward_extras[self.model_name], dtype=np.float32)}
        if self.function_name is not None:
            raw[self.function_name] = np.asarray(batch.rewards, dtype=np.float32)
        rewards = combine_reward_sources(raw, self.sources, self.moments)
        extras = {**scored.reward_extras, **{n: [float(v) for v in r] for n, r in raw.items()}}
        self.batches += 1
        out = msgspec.structs.replace(scored, rewards=rewards, reward_extras=extras)
        return out if self.shaper is None else await self.shaper.shape(out, self.ctx)

    async def finish(self) -> list[RolloutBatch] | None:
        return self.shaper.flush() if self.shaper is not None else None

    def _score(self, piece: RolloutBatch) -> RolloutBatch:
        scores = self.model.score(piece)
        return msgspec.structs.replace(
            piece, reward_extras={**piece.reward_extras, self.model_name: [float(s) for s in scores]})

    async def _score_recovering(self, piece: RolloutBatch) -> RolloutBatch:
        from pipeline.memory.oom import run_with_oom_recovery
        from pipeline.memory.splitting import count_groups, merge_rollout_batches, split_rollout_batch

        async def measured(p: RolloutBatch) -> RolloutBatch:
            return await self.guard.measure(self._estimate_bytes(p), lambda: asyncio.to_thread(self._score, p))

        if not self.guard.protected:
            return await asyncio.to_thread(self._score, piece)
        return await run_with_oom_recovery(
            measured, piece, split=split_rollout_batch, merge=merge_rollout_batches, stage=self.guard.stage,
            size=count_groups, on_event=self.guard.on_oom(piece.batch_id),
        )

    def status(self) -> dict[str, Any]:
        return {"state": "scoring", "batches": self.batches, **self.guard.status(),
                **(self.shaper.status() if self.shaper is not None else {})}
