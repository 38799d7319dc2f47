"""``dataflow``: overlap, staleness, micro-batch sizes and custom nodes."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from pipeline.config.base import NonNegInt, PosInt, _section


class NodeSpec(msgspec.Struct, **_section()):
    """A custom DataFlow node from YAML: ``node_class`` is ``module:attr``."""

    name: str
    node_class: str
    input_from: str | None = None
    kwargs: dict[str, Any] = {}


class DataflowConfig(msgspec.Struct, **_section()):
    """``max_staleness`` is η: 0 with ``async_execution: false`` is exactly on-policy.

    With ``async_execution: true`` generation of step k's samples may begin once the
    rollout serves version ``k - max_staleness + tail_slack``; η = 0 still overlaps
    stages inside a step but never trains on a sample older than the current weights.

    ``max_staleness: auto`` starts at ``max(1, train.sync_interval - 1)`` and raises η,
    at most to ``max_staleness_cap``, where the measured steps show the trainer waiting
    for a rollout that the staleness limit holds back (``pipeline/staleness.py``).
    """

    async_execution: bool = True
    max_staleness: NonNegInt | Literal["auto"] = 1
    max_staleness_cap: PosInt = 4  # the most ``max_staleness: auto`` may choose
    # Steps of η kept for samples that finish after their step (a long tail): generation
    # of step k's prompts starts at version k - (max_staleness - tail_slack), so a sample
    # that reaches the trainer up to tail_slack steps after its step is still within η.
    # 0: generation runs η steps ahead and any sample that arrives after its step (a long
    # one overtaken by shorter, later ones) is dropped as stale.
    tail_slack: NonNegInt = 0
    # A sample that reaches the trainer staler than η (a long one, generated across more
    # updates than η allows while shorter, later ones were trained): "drop" (nothing
    # staler than η is trained on; the source replaces it, so long samples are the ones
    # lost) or "train" (η then bounds how far generation runs ahead, not each sample's
    # staleness, as in AReaL and Tinker: nothing generated is thrown away and long samples
    # keep their share; the per-token behaviour log-probs and algorithm.off_policy correct
    # for the lag). Each step reports the staleness it trained (staleness/max, /hist) and
    # samples/late counts those trained beyond η.
    late_samples: Literal["drop", "train"] = "drop"
    prompts_per_micro_batch: PosInt = 4
    queue_size: PosInt = 4  # default bound (micro-batches) of every edge
    queue_sizes: dict[str, PosInt] = {}  # per edge, "producer->consumer": bound
    nodes: list[NodeSpec] = []  # custom graph; empty = the built-in RL graph
