"""The trainer's side of resumable checkpoints (``pipeline/checkpoint.py`` holds the format).

Guarantees:
- ``TrainerCheckpoints`` counts, across resumes, the prompts trained and dropped (by
  reason) and the indices of those prompts (``ConsumedPrompts``); what it writes at
  version v covers exactly the optimizer steps before v and the drops recorded so far.
- A checkpoint is written every ``train.checkpoint_every`` versions and at the end of
  every run (an interrupted one too), each atomically, the newest
  ``train.keep_checkpoints`` kept; none with ``train.resumable: false``.
- A write that fails (``OSError``: a full disk) leaves the checkpoints already written
  as they were; under ``train.on_checkpoint_error: stop`` it raises
  ``CheckpointWriteError`` naming the last good checkpoint, under ``continue`` it
  returns None and the next interval (or the run's end) writes again.
- ``restore`` loads the trainer engine's state (model, optimizer, RNG, version) and the
  counters from ``run.resume_from``; the resumed run continues from that version. It
  refuses a checkpoint written by another ``train.num_ranks`` before loading anything.
- It keeps the staleness bound of the last step trained, from which a resumed
  ``max_staleness: auto`` run goes on.
- With ``data.curriculum`` it advances the curriculum once per step from the step's
  rewards (``step_curriculum``) and checkpoints its state with the prompts consumed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from pipeline.checkpoint import (
    TRAINER_DIR,
    ConsumedPrompts,
    ResumeState,
    find_latest_checkpoint,
    load_resume_state,
    write_checkpoint,
)
from pipeline.types import RolloutBatch
from stages.data.curriculum import (
    CurriculumState,
    advance_curriculum,
    select_level_rewards,
    start_curriculum,
    summarise_curriculum,
)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written and ``train.on_checkpoint_error`` is ``stop``."""


class TrainerCheckpoints:
    def __init__(self, cfg: Any, engine: Any) -> None:
        self.run_dir = cfg.run_dir
        self.every = cfg.train.checkpoint_every
        self.enabled = cfg.train.resumable  # false: nothing is written (train.resumable)
        self.keep = cfg.train.keep_checkpoints
        self.train_cfg = cfg.train  # its num_ranks: recorded, and checked on restore
        self.engine = engine
        self.trained_prompts = 0
        self.dropped: dict[str, int] = {}
        self.consumed = ConsumedPrompts()
        self.recent_metrics: list[dict[str, Any]] = []  # steps since the last checkpoint
        self.last_written = -1
        self.dirty = False  # something was recorded since the last write
        self.failed_writes, self.last_error = 0, ""  # writes that failed (on_checkpoint_error: continue)
        self.max_staleness: int | None = None  # the η the last step trained under (max_staleness: auto resumes it)
        self.curriculum_cfg = cfg.data.curriculum
        self.curriculum = start_curriculum(self.curriculum_cfg) if self.curriculum_cfg else None

    def restore(self, checkpoint: str | Path) -> int:
        """Load ``checkpoint`` into the engine and the counters; returns its version."""
        state = load_resume_state(checkpoint)
        ranks = self.train_cfg.num_ranks
        if state.num_ranks is not None and state.num_ranks != ranks:
            raise ValueError(f"train.num_ranks: {checkpoint} was written by {state.num_ranks} trainer ranks, "
                             f"each with its own optimizer partition; resume it with train.num_ranks="
                             f"{state.num_ranks}, got {ranks}")
        self.engine.load_state(Path(checkpoint) / TRAINER_DIR)
        if self.engine.version != state.version:
            raise ValueError(f"run.resume_from: {checkpoint} holds trainer version {self.engine.version} "
                             f"but its state says {state.version}")
        self.trained_prompts, self.dropped, self.consumed = state.trained_prompts, dict(state.dropped), state.consumed
        self.last_written = state.version
        self.max_staleness = state.max_staleness
        if self.curriculum is not None and state.curriculum is not None:
            self.curriculum = msgspec.convert(state.curriculum, CurriculumState)
        return state.version

    def step_curriculum(self, batches: list[RolloutBatch]) -> dict[str, Any]:
        """Advance the curriculum by this step's rewards at its level; the step's
        ``curriculum/`` metrics (none without ``data.curriculum``)."""
        if self.curriculum is None or self.curriculum_cfg is None:
            return {}
        rewards = select_level_rewards(batches, self.curriculum_cfg.key, self.curriculum.level)
        self.curriculum = advance_curriculum(self.curriculum, self.curriculum_cfg, rewards)
        return summarise_curriculum(self.curriculum)

    def record_step(self, batches: list[RolloutBatch], metrics: dict[str, Any]) -> None:
        self.dirty = True
        if "dataflow/max_staleness" in metrics:
            self.max_staleness = int(metrics["dataflow/max_staleness"])
        self.recent_metrics.append(metrics)
        self.trained_prompts += sum(len(b.prompts) for b in batches)
        self.consumed.add(p.index for b in batches for p in b.prompts)

    def record_drop(self, batch: RolloutBatch, reason: str) -> None:
        self.record_dropped_prompts([p.index for p in batch.prompts], reason)

    def record_dropped_prompts(self, indices: list[int], reason: str) -> None:
        """Prompts dropped for ``reason`` (here or upstream: ``RolloutBatch.dropped_prompts``)."""
        self.dirty = True
        self.dropped[reason] = self.dropped.get(reason, 0) + len(indices)
        self.consumed.add(indices)

    def accounting(self) -> dict[str, Any]:
        """The trainer's account of the prompts it finished (trained or dropped): indices
        and count, checked by the driver against the source's."""
        return {"done": msgspec.to_builtins(self.consumed),
                "done_count": self.trained_prompts + sum(self.dropped.values())}

    def due(self) -> bool:
        return (self.enabled and bool(self.every) and self.engine.version % self.every == 0
                and self.engine.version != self.last_written)

    def write(self) -> Path | None:
        """A checkpoint of the engine's current version (call from a thread); None when
        it failed and ``train.on_checkpoint_error`` is ``continue``."""
        try:
            return self._write()
        except OSError as exc:
            found = find_latest_checkpoint(self.run_dir)
            last = f"the last good checkpoint is {found[0]}" if found else "no checkpoint was written yet"
            message = f"checkpoint of version {self.engine.version} could not be written ({exc}); {last}"
            if self.train_cfg.on_checkpoint_error == "stop":
                raise CheckpointWriteError(f"train.on_checkpoint_error: stop: {message}") from exc
            self.failed_writes += 1
            self.last_error = message
            return None

    def _write(self) -> Path:
        state = ResumeState(version=self.engine.version, trained_prompts=self.trained_prompts,
                            dropped=dict(self.dropped), consumed=self.consumed, recent_metrics=self.recent_metrics,
                            curriculum=msgspec.to_builtins(self.curriculum) if self.curriculum else None,
                            num_ranks=self.train_cfg.num_ranks, max_staleness=self.max_staleness)
        path = write_checkpoint(self.run_dir, state, self.engine.save_state, self.keep)
        self.last_written, self.recent_metrics, self.dirty = self.engine.version, [], False
        return path
