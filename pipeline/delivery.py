"""De-duplication of redelivered micro-batches, by the GRPO groups (prompts) they hold.

When a stage actor dies, its input queue delivers the items it held again
(``pipeline/queue.py``); an output it had already passed on can then reach the next
stage twice. Every consumer's shell drops what it has seen: the key of a group is its
prompt's row index (or its ``prompt_id`` when a custom source leaves the index unset),
unique in a run, and a group travels whole inside one micro-batch.

Guarantees:
- ``SeenGroups.filter`` returns the item unchanged when none of its groups was seen,
  ``None`` when all were, and otherwise the item cut down to its unseen groups
  (``RolloutBatch`` through ``pipeline/memory/splitting.py``, ``PromptBatch`` by its prompts);
  an item without ``prompts`` passes unchanged;
- memory is bounded: the newest ``window`` keys are remembered, and exactly-once still
  holds. Invariant: a group comes again only from an item still leased upstream, and an
  item stays leased until what became of it reached the end of the graph
  (``pipeline/queue.py``); queues hand items out in order. So between a group's first
  and second copy a consumer takes in only groups that travel with it or behind it
  through the part of the graph that holds it: at most the queues' bounds plus the
  items inside the stages (concurrency x replicas; a requeue adds the dead process's
  leases, also at most its concurrency), each of at most ``prompts_per_micro_batch``
  groups, plus the step of prompts the trainer holds. ``dedup_window`` is four times
  that (at least ``MIN_DEDUP_WINDOW``): a few hundred to a few thousand keys, full
  within minutes, instead of a fixed 65,536 that kept growing for half an hour of a
  fast run. A window too small would let a duplicate through to the trainer, where the
  id accounting (``summary.json`` ``accounting``) counts it as finished twice.
"""

from __future__ import annotations

import collections
from typing import Any

import msgspec

from pipeline.types import PromptBatch, RolloutBatch

DEDUP_WINDOW = 1 << 16  # when the graph is not known (a consumer built by hand)
MIN_DEDUP_WINDOW = 1024


def dedup_window(df: Any, prompts_per_micro_batch: int, prompts_per_step: int) -> int:
    """Group keys a consumer of ``df`` (a ``DataFlow``) remembers: four times the most
    groups that can be in flight at once (see the module's invariant)."""
    items = sum(df.queue_bound(p, c) for p, c in df.edges)
    items += sum(n.concurrency * n.replicas for n in df.nodes.values())
    return max(MIN_DEDUP_WINDOW, 4 * (items * prompts_per_micro_batch + prompts_per_step))


def group_key(prompt: Any) -> int | str:
    index = getattr(prompt, "index", -1)
    return index if isinstance(index, int) and index >= 0 else str(prompt.prompt_id)


def keep_groups(item: Any, keep: list[bool]) -> Any:
    """``item`` with only the groups (prompts) whose ``keep`` flag is set, in order."""
    if isinstance(item, PromptBatch):
        return msgspec.structs.replace(item, prompts=[p for p, k in zip(item.prompts, keep, strict=True) if k])
    if isinstance(item, RolloutBatch):
        from pipeline.memory.splitting import merge_rollout_batches, split_rollout_batch_at

        counts, flags = [], []
        for k in keep:  # runs of equal flags
            if flags and flags[-1] == k:
                counts[-1] += 1
            else:
                counts.append(1)
                flags.append(k)
        pieces = split_rollout_batch_at(item, counts)
        return merge_rollout_batches([p for p, k in zip(pieces, flags, strict=True) if k])
    raise TypeError(f"cannot select groups of a {type(item).__name__}")


class SeenGroups:
    """The group keys a consumer has taken in, newest ``window`` of them."""

    def __init__(self, window: int = DEDUP_WINDOW) -> None:
        self._keys: set[int | str] = set()
        self._order: collections.deque[int | str] = collections.deque()
        self.window = window
        self.dropped_groups = 0

    def filter(self, item: Any) -> Any:
        prompts = getattr(item, "prompts", None)
        if not isinstance(prompts, list) or not prompts:
            return item
        keys = [group_key(p) for p in prompts]
        keep = [k not in self._keys for k in keys]
        for k, fresh in zip(keys, keep, strict=True):
            if fresh:
                self._remember(k)
        dropped = keep.count(False)
        self.dropped_groups += dropped
        if not dropped:
            return item
        if not any(keep):
            return None
        return keep_groups(item, keep)

    def _remember(self, key: int | str) -> None:
        self._keys.add(key)
        self._order.append(key)
        if len(self._order) > self.window:
            self._keys.discard(self._order.popleft())
