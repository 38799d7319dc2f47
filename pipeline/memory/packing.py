"""Token-budget passes: which rows of a micro-batch share one forward (and backward) pass.

Guarantees:
- ``plan_passes`` returns int64 arrays of row indices that together hold every row
  exactly once; the rows of a pass are in ascending order;
- ``pass_tokens`` 0: contiguous chunks of ``chunk_size`` rows, in order (fixed-row
  chunks);
- ``pass_tokens`` > 0: units of ``unit_rows`` consecutive rows (2 for preference pairs:
  a pair is never split, its chosen row stays before its rejected one) sorted by length,
  longest first (ties by position, so a plan is a pure function of the lengths), then
  grouped greedily: a pass's rows times its longest row's length is at most
  ``pass_tokens``; a unit longer than that runs alone;
- ``count_pass_tokens`` gives (real, computed) tokens of a plan: a pass computes its rows
  times its longest row (right padding to its own longest, as
  ``stages.models.logprobs.forward_completion_logprobs`` trims it); real counts each row
  at its own length. ``1 - real / computed`` is the padding fraction.
A row's length is its prompt plus its completion: the pass sees the whole sequence.
Pure numpy: the engines (``stages/trainer/engine.py``, ``stages/models/reference.py``)
and the memory estimates (``admission.estimate_batch_bytes``) plan with the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def plan_passes(seq_lens: Sequence[int] | np.ndarray, pass_tokens: int, chunk_size: int,
                unit_rows: int = 1) -> list[np.ndarray]:
    """The passes over rows of lengths ``seq_lens`` (see the module guarantees)."""
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    if pass_tokens < 0:
        raise ValueError(f"train.pass_tokens: expected >= 0 (0: fixed-row chunks), got {pass_tokens}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
    if unit_rows < 1 or lens.size % unit_rows:
        raise ValueError(f"unit_rows: expected >= 1 dividing the {lens.size} rows, got {unit_rows}")
    if pass_tokens == 0:
        step = max(chunk_size - chunk_size % unit_rows, unit_rows)  # whole units in a chunk
        return [np.arange(a, min(a + step, lens.size), dtype=np.int64) for a in range(0, lens.size, step)]
    unit_lens = lens.reshape(-1, unit_rows).max(axis=1)
    order = np.lexsort((np.arange(unit_lens.size), -unit_lens))  # longest first, then by position
    passes: list[np.ndarray] = []
    start = 0
    while start < order.size:
        width = int(unit_lens[order[start]])  # the longest of this pass: the units after it are no longer
        end = start + 1
        while end < order.size and (end - start + 1) * unit_rows * width <= pass_tokens:
            end += 1
        units = np.sort(order[start:end])
        passes.append((units[:, None] * unit_rows + np.arange(unit_rows)[None, :]).reshape(-1))
        start = end
    return passes


def count_pass_tokens(seq_lens: Sequence[int] | np.ndarray, passes: Sequence[np.ndarray]) -> tuple[int, int]:
    """(real, computed) tokens of ``passes`` over rows of lengths ``seq_lens``."""
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    real = computed = 0
    for rows in passes:
        if len(rows):
            part = lens[np.asarray(rows)]
            real += int(part.sum())
            computed += int(part.max()) * len(rows)
    return real, computed


def padding_fraction(real: float, computed: float) -> float:
    """Share of computed tokens that were padding (0 when nothing was computed)."""
    return 1.0 - real / computed if computed > 0 else 0.0
