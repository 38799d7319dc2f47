"""The long-tail workload of ``bench longtail``: a completion length per prompt, shaped like
reasoning traces, and the prompt file every system reads.

A prompt's length is drawn from a lognormal distribution with the given median and 99th
percentile (sigma = ln(p99 / median) / z(0.99)), rounded and clipped to
``[floor, cap]``; ``scale`` multiplies all four (a CPU run at 1/64 of the GPU's lengths
keeps the shape). The draw for prompt ``i`` is the inverse normal CDF of a uniform read
from sha256(seed, i), so it depends on nothing else: every system, every row order and
every machine gets the same length for the same prompt.

Guarantees:
- ``LengthSchedule.length(i)`` is deterministic in (parameters, seed, i) and lies in
  ``[floor, cap]``; ``describe`` gives the schedule's own median, p99 and max over the
  prompts a run uses, to set beside what each system generated;
- ``write_prompt_file`` writes each row with ``max_tokens`` = ``min_tokens`` = its
  length (``data.max_tokens_field`` / ``min_tokens_field``): generation is held to exactly
  that many tokens, end-of-sequence tokens held back until then (no ``ignore_eos``
  needed; a random-init model rarely samples one anyway).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

from stages.rollout.occupancy import summarize_length_counts

Z99 = NormalDist().inv_cdf(0.99)
MAX_FIELD, MIN_FIELD = "max_tokens", "min_tokens"


@dataclass(frozen=True)
class LengthSchedule:
    """Lognormal completion lengths (tokens) at full scale, times ``scale``."""

    median: int = 1024
    p99: int = 8192
    cap: int = 16384
    floor: int = 32
    scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"--scale: expected > 0, got {self.scale}")
        if not 1 <= self.floor <= self.median < self.p99 <= self.cap:
            raise ValueError(f"length schedule: expected 1 <= floor <= median < p99 <= cap, got floor {self.floor}, "
                             f"median {self.median}, p99 {self.p99}, cap {self.cap}")

    @property
    def sigma(self) -> float:
        return math.log(self.p99 / self.median) / Z99

    @property
    def bounds(self) -> tuple[int, int]:
        """(floor, cap) at this scale, in tokens (at least 1)."""
        return max(1, round(self.floor * self.scale)), max(1, round(self.cap * self.scale))

    def length(self, index: int) -> int:
        """Prompt ``index``'s completion length in tokens."""
        digest = hashlib.sha256(f"longtail:{self.seed}:{index}".encode()).digest()
        u = (int.from_bytes(digest[:8], "big") + 0.5) / 2**64  # in (0, 1), never 0 or 1
        raw = math.exp(math.log(self.median * self.scale) + self.sigma * NormalDist().inv_cdf(u))
        low, high = self.bounds
        return int(min(high, max(low, round(raw))))

    def lengths(self, count: int) -> list[int]:
        return [self.length(i) for i in range(count)]

    def describe(self, count: int) -> dict[str, Any]:
        """The schedule and its lengths over prompts 0..count-1 (median, p99, max, mean)."""
        lens = self.lengths(count)
        low, high = self.bounds
        return {"median_target": self.median * self.scale, "p99_target": self.p99 * self.scale,
                "floor": low, "cap": high, "scale": self.scale, "seed": self.seed, "sigma": self.sigma,
                "prompts": count, **describe_lengths(lens)}


def describe_lengths(lengths: Any) -> dict[str, Any]:
    """mean, median, p90, p99 and max of a sequence of lengths, as the rollout reports
    what it generated (``summarize_length_counts``), so the two compare exactly."""
    return summarize_length_counts(Counter(int(n) for n in lengths))


def write_prompt_file(rows: list[dict[str, Any]], schedule: LengthSchedule, path: Path) -> Path:
    """``rows`` (prompt, ground_truth, data_source) as JSONL at ``path``, row i with
    ``max_tokens`` = ``min_tokens`` = ``schedule.length(i)``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for i, row in enumerate(rows):
            n = schedule.length(i)
            fh.write(json.dumps({"prompt": row["prompt"], "ground_truth": row["ground_truth"],
                                 "data_source": row["data_source"], MAX_FIELD: n, MIN_FIELD: n}) + "\n")
    return path
