"""The sampler tap's ledger (``stages/rollout/vllm_sampler_tap.py``): rows filed by the
sampled token's position, in the order the GPU made them, read once copied."""

from __future__ import annotations

import numpy as np
import pytest

from stages.rollout.vllm_sampler_tap import SampledLogprobLedger

NOT_SAMPLED = -1  # the position vLLM's rows carry when it keeps no token from them


class CopyDone:
    """Stands for a record's CUDA event: done, or done once waited on."""

    def __init__(self, done: bool = True) -> None:
        self.done, self.waited = done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited, self.done = True, True


def record(ledger: SampledLogprobLedger, rows: dict[str, tuple[float, int]], ready: CopyDone | None = None) -> None:
    """One engine step: request id -> (log-prob, position of the sampled token or NOT_SAMPLED)."""
    values = np.array([[v for v, _ in rows.values()], [p for _, p in rows.values()]], dtype=np.float32)
    ledger.push(list(rows), values, ready or CopyDone())


def test_values_are_filed_by_position_so_discarded_rows_never_shift_a_request() -> None:
    ledger = SampledLogprobLedger()
    ledger.track("a", prompt_len=3, max_tokens=4)
    ledger.track("b", prompt_len=1, max_tokens=2)
    record(ledger, {"a": (-4.0, NOT_SAMPLED), "b": (-0.1, 1)})  # a: a chunk of its prefill, no token
    record(ledger, {"a": (-0.5, 3), "b": (-0.2, 2), "gone": (-3.0, 9)})  # a's token 0 (3 - 3); an untracked row
    record(ledger, {"a": (-1.0, 4)})  # token 1
    record(ledger, {"a": (-9.0, 5)})  # token 2 sampled in flight, then discarded: a was preempted
    record(ledger, {"a": (-5.0, NOT_SAMPLED)})  # the recompute's first chunk: no token
    record(ledger, {"a": (-0.25, 5)})  # token 2 sampled again: the later row wins
    record(ledger, {"a": (-2.0, 6)})  # token 3, the last (max_tokens 4)
    record(ledger, {"a": (-7.0, 7)})  # sampled in flight after a finished: past max_tokens, dropped
    assert ledger.take("a", 4) == [-0.5, -1.0, -0.25, -2.0]
    assert ledger.take("b", 2) == pytest.approx([-0.1, -0.2])
    assert ledger.records == 8


def test_outputs_with_only_new_tokens_take_the_next_values() -> None:
    ledger = SampledLogprobLedger()
    ledger.track("a", prompt_len=2, max_tokens=3)
    record(ledger, {"a": (-0.5, 2)})
    assert ledger.take("a", 1) == [-0.5]
    record(ledger, {"a": (-1.5, 3)})
    record(ledger, {"a": (-2.5, 4)})
    assert ledger.take("a", 2) == [-1.5, -2.5]
    with pytest.raises(LookupError, match="4 tokens, more than its max_tokens 3"):
        ledger.take("a", 1)


def test_a_record_is_read_only_once_its_copy_is_done_and_in_the_order_made() -> None:
    ledger = SampledLogprobLedger()
    ledger.track("a", prompt_len=1, max_tokens=2)
    first, second = CopyDone(done=False), CopyDone()
    record(ledger, {"a": (-0.5, 1)}, first)
    record(ledger, {"a": (-0.75, 2)}, second)
    ledger.settle()
    assert ledger.records == 0  # the later copy is done, but the earlier one is not: neither is read
    # Asked for a value the ledger lacks, it waits for the copies in flight.
    assert ledger.take("a", 2) == [-0.5, -0.75]
    assert first.waited and ledger.records == 2


def test_a_missing_value_fails_the_request_naming_the_token() -> None:
    ledger = SampledLogprobLedger()
    ledger.track("a", prompt_len=2, max_tokens=3)
    record(ledger, {"a": (-0.5, 2)})
    record(ledger, {"a": (-0.5, 4)})  # token 2; token 1 never came
    with pytest.raises(LookupError, match="no log-prob for token 1 of request 'a' \\(1 of 3 missing\\)"):
        ledger.take("a", 3)
    ledger.forget("a")
    with pytest.raises(LookupError, match="does not track request 'a'"):
        ledger.take("a", 1)


def test_a_nan_log_prob_is_a_value_not_a_missing_token() -> None:
    ledger = SampledLogprobLedger()
    ledger.track("a", prompt_len=1, max_tokens=1)
    record(ledger, {"a": (float("nan"), 1)})
    (value,) = ledger.take("a", 1)
    assert value != value  # NaN, handed on (the trainer then anchors on its own log-prob)


def test_once_the_tap_failed_every_take_says_why() -> None:
    ledger = SampledLogprobLedger()
    ledger.track("a", prompt_len=1, max_tokens=1)
    record(ledger, {"a": (-0.5, 1)})
    ledger.broken = RuntimeError("a step sampled 2 rows for 1 requests (0 draft tokens)")
    with pytest.raises(LookupError, match="the sampler tap failed: RuntimeError"):
        ledger.take("a", 1)
