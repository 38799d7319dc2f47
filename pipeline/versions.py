"""Policy versions, the staleness rules and exact sample accounting (pure, no Ray).

Invariants stated where they are enforced:
- The policy version is the number of optimizer steps the trainer has taken; it only
  grows. A rollout worker serves exactly one version at a time and tags each token with it.
- Staleness of a batch = trainer version at consumption − the oldest version that
  produced any of its tokens. ``is_too_stale`` is applied where data is consumed (the
  trainer), so nothing staler than ``max_staleness`` is ever trained on, whatever the
  producers did; unless ``dataflow.late_samples: train``, under which η bounds only how
  far generation runs ahead (``required_serving_version``) and a late sample is trained
  and counted.
- ``required_serving_version`` is only an economy: it holds generation of step k's prompts
  until the rollout serves a version trainable at step k (with ``tail_slack``, at step
  k + slack), so samples are rarely produced only to be dropped. η = 0 in sync mode is
  exactly on-policy.
- A micro-batch's bound is the η the rollout generated it under, which it carries
  (``batch_bound``): the rollout waits and the trainer gates by the same number while
  ``max_staleness: auto`` raises η; a bound never exceeds the η in force, which only grows.
- ``Ledger`` reconciles: admitted = trained + dropped + in flight, per prompt, at all times.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


def compute_staleness(trainer_version: int, policy_version: int) -> int:
    return trainer_version - policy_version


def is_too_stale(trainer_version: int, policy_version: int, max_staleness: int) -> bool:
    """The gate at the trainer: drop when ``trainer_version - policy_version > max_staleness``."""
    return compute_staleness(trainer_version, policy_version) > max_staleness


def batch_bound(batch_max_staleness: int | None, default: int) -> int:
    """The η a micro-batch is held to: the one it was generated under, else ``default``
    (the config's; a custom rollout that sets none)."""
    return default if batch_max_staleness is None else batch_max_staleness


def compute_lookahead(max_staleness: int, tail_slack: int, sync_interval: int) -> int:
    """Steps generation may run ahead of training: η less the ``tail_slack`` kept for
    samples that arrive after their step, never below ``sync_interval - 1`` (the version
    a step waits for must be published by earlier steps: see ``required_serving_version``)."""
    return max(max_staleness - tail_slack, sync_interval - 1, 0)


def required_serving_version(step: int, max_staleness: int, sync_interval: int) -> int:
    """The version a worker must serve before it generates for train step ``step``.

    The trainer trains step k at version k and publishes only multiples of
    ``sync_interval`` (s). A sample of version v is trainable at step k iff
    ``k - v <= max_staleness`` (η), so the answer is the first multiple of s at or after
    ``k - η``: ``ceil((k - η) / s) * s``. It is never newer than k when ``η >= s - 1``
    (``check_config`` enforces that), so it is published after step ``v - 1 < k``, from
    earlier steps' data only: waiting for it cannot deadlock. (Rounding down instead
    would generate step k from a version up to s - 1 steps older than η allows, and
    every such sample would be dropped as stale.)
    """
    need = max(0, step - max_staleness)
    return -(-need // sync_interval) * sync_interval


@dataclass
class Ledger:
    """Prompt accounting for a run that must train ``target`` prompts.

    ``admit`` hands out prompts (with the step they are destined for) until the prompts
    that are trained or still in flight cover the target; a drop reopens room, so
    dropped prompts are replaced and the run still trains ``target`` prompts.
    """

    target: int
    prompts_per_step: int
    admitted: int = 0
    trained: int = 0
    dropped: Counter[str] = field(default_factory=Counter)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def in_flight(self) -> int:
        return self.admitted - self.trained - self.dropped_total

    @property
    def live(self) -> int:
        """Prompts trained or still on their way to be."""
        return self.trained + self.in_flight

    @property
    def room(self) -> int:
        return max(0, self.target - self.live)

    @property
    def finished(self) -> bool:
        return self.trained >= self.target

    def admit(self, want: int) -> tuple[int, int]:
        """Grant up to ``want`` prompts; returns (granted, destined step)."""
        granted = min(want, self.room)
        step = self.live // self.prompts_per_step
        self.admitted += granted
        return granted, step

    def record_trained(self, prompts: int) -> None:
        self._check(prompts)
        self.trained += prompts

    def record_dropped(self, prompts: int, reason: str) -> None:
        self._check(prompts)
        self.dropped[reason] += prompts

    def _check(self, prompts: int) -> None:
        if prompts > self.in_flight:
            raise ValueError(
                f"ledger: {prompts} prompts reported but only {self.in_flight} in flight "
                f"(admitted {self.admitted}, trained {self.trained}, dropped {self.dropped_total})"
            )

    def summary(self) -> dict[str, object]:
        return {
            "admitted": self.admitted,
            "trained": self.trained,
            "dropped": dict(self.dropped),
            "dropped_total": self.dropped_total,
            "in_flight": self.in_flight,
            "reconciles": self.admitted == self.trained + self.dropped_total + self.in_flight,
        }

