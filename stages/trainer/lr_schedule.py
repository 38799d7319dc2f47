"""Learning-rate schedules as pure functions of the optimizer step.

Guarantees:
- ``compute_lr_factor`` is the multiplier of ``train.lr`` used by optimizer step ``k``
  (0-based: the first step is 0). Warm-up: step ``k < warmup_steps`` uses
  ``(k + 1) / warmup_steps`` (no step runs at lr 0). After it, with progress
  ``p = (k - warmup_steps) / (total_steps - warmup_steps)`` clamped to [0, 1]:
  ``constant`` 1; ``linear`` ``m + (1 - m) * (1 - p)``; ``cosine``
  ``m + (1 - m) * (1 + cos(pi * p)) / 2``, with ``m = min_lr_ratio``.
- The trainer hands the schedule to DeepSpeed as a client scheduler (``LambdaLR``):
  DeepSpeed steps it once per optimizer step and saves and restores its position with the
  trainer state, so replay and resume continue the same schedule. (DeepSpeed's own
  WarmupLR / WarmupDecayLR / WarmupCosineLR warm up over at least 2 steps and start at
  the minimum lr for the first two optimizer steps; this schedule is exact.)
"""

from __future__ import annotations

import functools
import math
from typing import Any, Literal

LrSchedule = Literal["constant", "linear", "cosine"]


def compute_lr_factor(step: int, schedule: LrSchedule, warmup_steps: int = 0, total_steps: int = 0,
                      min_lr_ratio: float = 0.0) -> float:
    """The lr multiplier of optimizer step ``step`` (see the module guarantees)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule not in ("linear", "cosine"):
        raise ValueError(f"train.lr_scheduler: expected 'constant', 'linear' or 'cosine', got {schedule!r}")
    if total_steps <= warmup_steps:
        raise ValueError(f"a {schedule} schedule needs total_steps > warmup_steps, got {total_steps} <= {warmup_steps}")
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_lr_scheduler(schedule: LrSchedule, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Any:
    """A callable ``optimizer -> LambdaLR`` for ``deepspeed.initialize(lr_scheduler=...)``,
    or None when the lr is constant from the first step (no scheduler at all)."""
    if schedule == "constant" and warmup_steps == 0:
        return None
    from torch.optim.lr_scheduler import LambdaLR

    factor = functools.partial(compute_lr_factor, schedule=schedule, warmup_steps=warmup_steps,
                               total_steps=total_steps, min_lr_ratio=min_lr_ratio)
    factor(warmup_steps)  # a bad schedule fails here, before DeepSpeed starts
    return functools.partial(LambdaLR, lr_lambda=factor)
