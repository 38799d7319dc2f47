"""Wire types round-trip through msgpack exactly."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from pipeline.types import Prompt, PromptBatch, RolloutBatch, Span, StepRecord, WeightUpdate, decode, encode


def make_rollout(**extra) -> RolloutBatch:
    return RolloutBatch(
        batch_id=3, step=1, prompts=[Prompt(prompt_id="p0", text="12=", ground_truth="1", extra_info={"k": 1})],
        group_size=2, sample_ids=["p0/0", "p0/1"],
        prompt_ids=np.array([[1, 5, 6], [1, 5, 6]], np.int32), prompt_lens=np.array([3, 3], np.int32),
        completion_ids=np.array([[7, 2], [8, 0]], np.int32), completion_lens=np.array([2, 1], np.int32),
        completions=["1", "2"], behaviour_logprobs=np.array([[-0.5, -1.0], [-2.0, 0.0]], np.float32),
        token_versions=np.array([[0, 1], [1, -1]], np.int32), policy_version=0, **extra,
    )


@pytest.mark.parametrize(
    "value",
    [
        Prompt(prompt_id="p1", text="x"),
        PromptBatch(batch_id=0, step=0, prompts=[Prompt(prompt_id="p1", text="x")]),
        make_rollout(),
        make_rollout(rewards=np.array([1.0, 0.0], np.float32), ref_logprobs=np.zeros((2, 2), np.float32),
                     reward_errors=["1: ValueError: x"], reward_extras={"acc": [1.0, 0.0]}),
        WeightUpdate(version=2, sha256="ab", fingerprint=(1.5, 2.25), num_bytes=10),
        Span(stage="trainer", kind="busy", start=1.0, end=2.0, batch_id=4),
        StepRecord(step=0, policy_version=1, batch_ids=[0, 1], loss=0.5, grad_norm=1.0, weights_sha256="cd",
                   rng_state=b"\x00\x01"),
    ],
    ids=lambda v: type(v).__name__,
)
def test_round_trip(value):
    back = decode(encode(value), type(value))
    for field in value.__struct_fields__:
        a, b = getattr(value, field), getattr(back, field)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        else:
            assert a == b, field


def test_rollout_counts():
    b = make_rollout()
    assert b.num_samples == 2
    assert b.completion_tokens == 3  # 2 + 1
    assert b.num_tokens == 9  # prompts 3 + 3, completions 2 + 1


def test_structs_are_frozen():
    b = make_rollout()
    with pytest.raises(AttributeError):
        b.policy_version = 5
    assert msgspec.structs.replace(b, policy_version=5).policy_version == 5
