"""``<stage>.memory``: admission control and out-of-memory recovery, one per stage."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from pipeline.config.base import PosFloat, Ratio, _section


class MemoryConfig(msgspec.Struct, **_section()):
    """Admission control and OOM recovery for one stage (``pipeline/memory/admission.py`` decides,
    ``pipeline/memory/guard.py`` enforces).

    ``oom_protection``: estimate each micro-batch before it runs and admit, defer or split
    it (by whole GRPO groups), and on an out-of-memory error free cached memory, halve
    the piece and retry. Off: neither; the work runs as it comes and an OOM stops the run.

    The budget, in the frame each stage measures:
    - ``reference`` and ``train`` measure their own process (CUDA: allocated tensors;
      CPU: resident set). ``budget_bytes`` is the memory the stage's *work* may take on
      top of what the process holds at rest: activations, logits and their gradients,
      not the resident model (weights, optimizer state, runtime, allocator caches), which
      is re-measured whenever nothing is in flight. A value therefore means the same
      whatever the model's size. Unset, ``max_memory_ratio`` × the device's total memory
      (CPU: the machine's or the container's limit) caps the whole process, rest included.
    - ``rollout`` admits against the KV cache its engine preallocated (vLLM's blocks; a
      backend without one: ``kv_cache_gib``):
      ``budget_bytes`` of KV cache for the micro-batches one worker generates at once
      (prompt + ``max_tokens`` per sample, reserved from its first token to its end);
      unset, ``max_memory_ratio`` × the KV cache. Where that, at ``rollout.max_tokens``,
      lets fewer samples generate at once than vLLM was planned for, the rollout warns at
      start (``kv_admission_limits_generation``) with the keys to change;
      ``rollout.kv_reserve`` chooses what a sample reserves (``none``, the default on
      vLLM: nothing, vLLM's own scheduler fits what it can).
    Either way an item also waits while the machine's free memory cannot hold it;
    ``defer_timeout_s`` bounds that wait, then the stage stops with the numbers; an item
    the free memory cannot hold with nothing of the stage in flight is split, or waits at
    most ``stall_timeout_s``.
    """

    oom_protection: bool = True
    max_memory_ratio: Ratio = 0.85
    budget_bytes: Annotated[int, Meta(ge=1)] | None = None
    defer_timeout_s: PosFloat = 120.0
    # A micro-batch of one group that the device's free memory cannot hold while the
    # stage has nothing in flight waits at most this long (a neighbour's transient pass
    # may end), then the stage stops naming what to lower: nothing of its own will free.
    stall_timeout_s: PosFloat = 10.0
