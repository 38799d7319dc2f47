"""Splitting micro-batches along GRPO groups, and merging the pieces back.

Guarantees:
- A split never cuts a GRPO group (``group_size`` consecutive samples of one prompt):
  pieces are runs of whole groups, in order, as equal in group count as possible.
- Every sample lands in exactly one piece with all of its per-sample values (ids,
  lengths, token arrays, texts, log-probs, versions, finish reasons, rewards, reward
  extras, reward errors, reference log-probs, per-token training fields; a batch's
  ``dropped_prompts`` go with its first piece only); columns beyond
  a piece's longest prompt or completion are dropped, so a short piece does not pay for
  a long one.
- Pieces keep the batch's ``batch_id``, ``step``, ``group_size`` and ``policy_version``
  (the oldest version of the whole batch: still a lower bound for every piece, so the
  staleness gate stays conservative).
- ``split_rollout_batch_at`` cuts at given group counts; a piece depends only on the
  batch and its group range, so pieces cut in several rounds (split, then halve a
  piece) equal the pieces cut at once with the final counts: a replay can rebuild them.
- ``merge_rollout_batches`` is the inverse: it concatenates pieces in the given order,
  re-pads with 0 (the wire convention, see ``stages/models/logprobs.py``) and refuses pieces
  of different batches or a sample seen twice; ``gather_micro_batches`` concatenates
  whole micro-batches alike (the trainer trains them as one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from pipeline.types import PromptBatch, RolloutBatch

_ROW_ARRAYS = ("prompt_lens", "completion_lens", "rewards")
_PROMPT_COLS = ("prompt_ids",)
_COMPLETION_COLS = ("completion_ids", "behaviour_logprobs", "token_versions", "ref_logprobs",
                    "advantages", "loss_mask", "values", "returns")


class CannotSplitError(ValueError):
    """The batch holds a single GRPO group (or prompt), which is never split."""


def count_groups(batch: RolloutBatch | PromptBatch) -> int:
    """GRPO groups in a batch: one per prompt."""
    return len(batch.prompts)


def _group_bounds(num_groups: int, pieces: int, what: str) -> list[tuple[int, int]]:
    """[start, end) group ranges of at most ``pieces`` near-equal runs."""
    if pieces < 1:
        raise ValueError(f"pieces: expected >= 1, got {pieces}")
    if num_groups <= 1 and pieces > 1:
        raise CannotSplitError(f"{what} holds {num_groups} GRPO group(s); a group is never split")
    pieces = min(pieces, num_groups) if num_groups else 1
    base, extra = divmod(num_groups, pieces)
    bounds, start = [], 0
    for i in range(pieces):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def split_prompt_batch(batch: PromptBatch, pieces: int) -> list[PromptBatch]:
    """At most ``pieces`` pieces of whole prompts (each prompt is one future group)."""
    bounds = _group_bounds(len(batch.prompts), pieces, f"prompt batch {batch.batch_id}")
    return [msgspec.structs.replace(batch, prompts=batch.prompts[a:b]) for a, b in bounds]


def check_rollout_batch(batch: RolloutBatch) -> None:
    """Raise ``ValueError`` naming the field whose length is not one per sample."""
    num = batch.num_samples
    if batch.group_size < 1 or num != len(batch.prompts) * batch.group_size:
        raise ValueError(
            f"batch {batch.batch_id}: {num} samples is not {len(batch.prompts)} prompts x group_size {batch.group_size}"
        )
    rows: dict[str, Any] = {
        "completions": batch.completions,
        **{f: getattr(batch, f) for f in _ROW_ARRAYS + _PROMPT_COLS + _COMPLETION_COLS},
        **{f"reward_extras[{k!r}]": v for k, v in batch.reward_extras.items()},
        **{f"rollout_extras[{k!r}]": v for k, v in batch.rollout_extras.items()},
    }
    if batch.finish_reasons:
        rows["finish_reasons"] = batch.finish_reasons
    for name, value in rows.items():
        if value is not None and len(value) != num:
            raise ValueError(f"batch {batch.batch_id}: {name} has {len(value)} rows, expected {num}")


def _owner(error: str, ids: set[str]) -> str | None:
    """The sample id an error "sample_id: message" belongs to (ids may contain ':')."""
    at = error.find(":")
    while at != -1:
        if error[:at] in ids:
            return error[:at]
        at = error.find(":", at + 1)
    return None


def _take(arr: np.ndarray | None, rows: slice, width: int | None = None) -> np.ndarray | None:
    if arr is None:
        return None
    piece = arr[rows] if width is None else arr[rows, :width]
    # A contiguous copy: independent of the parent batch, and shareable out of band by
    # Ray's object store (a strided view would be copied through pickle instead).
    return np.ascontiguousarray(piece)


def split_rollout_batch(batch: RolloutBatch, pieces: int) -> list[RolloutBatch]:
    """At most ``pieces`` pieces of whole GRPO groups (fewer when there are fewer
    groups); raises ``CannotSplitError`` for a single group and ``pieces > 1``."""
    check_rollout_batch(batch)
    bounds = _group_bounds(len(batch.prompts), pieces, f"micro-batch {batch.batch_id}")
    if len(bounds) == 1:
        return [batch]
    return _cut(batch, bounds)


def split_rollout_batch_at(batch: RolloutBatch, group_counts: Sequence[int]) -> list[RolloutBatch]:
    """Consecutive pieces of ``group_counts[k]`` whole GRPO groups each (every count >= 1,
    summing to the batch's groups); one count returns the batch itself."""
    check_rollout_batch(batch)
    counts = [int(c) for c in group_counts]
    if not counts or min(counts) < 1 or sum(counts) != len(batch.prompts):
        raise ValueError(
            f"micro-batch {batch.batch_id}: group counts {counts} do not cover its {len(batch.prompts)} groups"
        )
    if len(counts) == 1:
        return [batch]
    ends = np.cumsum(counts).tolist()
    return _cut(batch, list(zip([0, *ends[:-1]], ends, strict=True)))


def _cut(batch: RolloutBatch, bounds: list[tuple[int, int]]) -> list[RolloutBatch]:
    g = batch.group_size
    owners = {e: _owner(e, set(batch.sample_ids)) for e in batch.reward_errors}
    pieces = []
    for index, (a, b) in enumerate(bounds):
        rows = slice(a * g, b * g)
        ids = batch.sample_ids[rows]
        plen = int(batch.prompt_lens[rows].max(initial=0))
        clen = int(batch.completion_lens[rows].max(initial=0))
        id_set = set(ids)
        fields: dict[str, Any] = {
            "prompts": batch.prompts[a:b],
            "sample_ids": ids,
            "completions": batch.completions[rows],
            "finish_reasons": batch.finish_reasons[rows],
            "reward_extras": {k: v[rows] for k, v in batch.reward_extras.items()},
            "rollout_extras": {k: v[rows] for k, v in batch.rollout_extras.items()},
            # An error naming no sample of the batch stays with the first piece: kept once.
            "reward_errors": [
                e for e, who in owners.items() if who in id_set or (who is None and index == 0)
            ],
            "dropped_prompts": batch.dropped_prompts if index == 0 else {},  # kept once
        }
        fields.update({f: _take(getattr(batch, f), rows) for f in _ROW_ARRAYS})
        fields.update({f: _take(getattr(batch, f), rows, plen) for f in _PROMPT_COLS})
        fields.update({f: _take(getattr(batch, f), rows, clen) for f in _COMPLETION_COLS})
        pieces.append(msgspec.structs.replace(batch, **fields))
    return pieces


def _pad_cat(arrays: Sequence[np.ndarray]) -> np.ndarray:
    width = max(a.shape[1] for a in arrays)
    return np.concatenate([np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in arrays])


def _merge_optional(name: str, values: list[np.ndarray | None], pad: bool) -> np.ndarray | None:
    present = [v is not None for v in values]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(f"merge: some pieces have {name} and some do not")
    arrays = [v for v in values if v is not None]
    return _pad_cat(arrays) if pad else np.concatenate(arrays)


def _merge_drops(pieces: Sequence[RolloutBatch]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for p in pieces:
        for reason, indices in p.dropped_prompts.items():
            out.setdefault(reason, []).extend(indices)
    return out


def merge_rollout_batches(pieces: Sequence[RolloutBatch]) -> RolloutBatch:
    """Concatenate pieces of one micro-batch, in order (see the module guarantees)."""
    if not pieces:
        raise ValueError("merge: no pieces")
    first = pieces[0]
    for p in pieces:
        if (p.batch_id, p.step, p.group_size) != (first.batch_id, first.step, first.group_size):
            raise ValueError(
                f"merge: piece of batch {p.batch_id} (step {p.step}, group_size {p.group_size}) does not "
                f"belong with batch {first.batch_id} (step {first.step}, group_size {first.group_size})"
            )
    return _concat(pieces)


def gather_micro_batches(batches: Sequence[RolloutBatch]) -> RolloutBatch:
    """Several micro-batches as one, in order, to be trained in one call (the trainer's
    ``train.gather_micro_batches``): the first's ``batch_id`` and ``step``, the oldest
    ``policy_version``; per-sample values (token versions included) kept as they were."""
    if not batches:
        raise ValueError("gather: no micro-batches")
    first = batches[0]
    for b in batches:
        if b.group_size != first.group_size:
            raise ValueError(f"gather: batch {b.batch_id} has group_size {b.group_size}, "
                             f"batch {first.batch_id} {first.group_size}")
    return _concat([_with_extras(b, {k for x in batches for k in x.reward_extras},
                                 {k for x in batches for k in x.rollout_extras}) for b in batches])


def _with_extras(batch: RolloutBatch, reward_keys: set[str], rollout_keys: set[str]) -> RolloutBatch:
    """``batch`` with every key of the gathered batches' extras, NaN (none) where it had none:
    micro-batches of one run may report different per-sample numbers."""
    if set(batch.reward_extras) == reward_keys and set(batch.rollout_extras) == rollout_keys:
        return batch
    n = batch.num_samples
    return msgspec.structs.replace(
        batch,
        reward_extras={k: batch.reward_extras.get(k, [float("nan")] * n) for k in sorted(reward_keys)},
        rollout_extras={k: batch.rollout_extras.get(k, [float("nan")] * n) for k in sorted(rollout_keys)},
    )


def _concat(pieces: Sequence[RolloutBatch]) -> RolloutBatch:
    first = pieces[0]
    if len(pieces) == 1:
        return first
    for p in pieces:
        check_rollout_batch(p)
    ids = [s for p in pieces for s in p.sample_ids]
    if len(set(ids)) != len(ids):
        twice = sorted({s for s in ids if ids.count(s) > 1})
        raise ValueError(f"merge: batch {first.batch_id}: samples present twice: {twice[:5]}")
    for extras in ("reward_extras", "rollout_extras"):
        keys = set(getattr(first, extras))
        if any(set(getattr(p, extras)) != keys for p in pieces):
            raise ValueError(f"merge: batch {first.batch_id}: pieces disagree on {extras} keys")
    finish = [r for p in pieces for r in p.finish_reasons]
    if finish and len(finish) != len(ids):
        raise ValueError(f"merge: batch {first.batch_id}: some pieces lack finish_reasons")
    fields: dict[str, Any] = {
        "prompts": [q for p in pieces for q in p.prompts],
        "sample_ids": ids,
        "completions": [c for p in pieces for c in p.completions],
        "finish_reasons": finish,
        "reward_errors": [e for p in pieces for e in p.reward_errors],
        "reward_extras": {k: [x for p in pieces for x in p.reward_extras[k]] for k in first.reward_extras},
        "rollout_extras": {k: [x for p in pieces for x in p.rollout_extras[k]] for k in first.rollout_extras},
        "policy_version": min(p.policy_version for p in pieces),
        "dropped_prompts": _merge_drops(pieces),
        # Regrouped pieces may have been generated under different bounds: each was at most
        # the η in force, which only grows, so the largest is too.
        "max_staleness": max((p.max_staleness for p in pieces if p.max_staleness is not None), default=None),
    }
    for name in _ROW_ARRAYS:
        fields[name] = _merge_optional(name, [getattr(p, name) for p in pieces], pad=False)
    for name in _PROMPT_COLS + _COMPLETION_COLS:
        fields[name] = _merge_optional(name, [getattr(p, name) for p in pieces], pad=True)
    return msgspec.structs.replace(first, **fields)
