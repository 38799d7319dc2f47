"""``pipeline.replay.compare_step``: what counts as a reproduced step, on CPU and on a GPU."""

from __future__ import annotations

from pipeline.replay import ATOL, GPU_RTOL, RTOL, compare_step
from pipeline.types import StepRecord

RECORD = StepRecord(step=3, policy_version=4, batch_ids=[6, 7], loss=0.5, grad_norm=2.0, weights_sha256="ab" * 32)


def _ok(checks) -> list[bool]:
    return [c.ok for c in checks]


def test_cpu_needs_bitwise_weights_and_rtol_1e6():
    assert _ok(compare_step(RECORD, 0.5, 2.0, "ab" * 32)) == [True, True, True]
    # 0.5 * (1 + 2e-6): a relative change of 2e-6 > RTOL 1e-6 (ATOL 1e-9 adds nothing here).
    assert _ok(compare_step(RECORD, 0.5 * (1 + 2 * RTOL), 2.0, "ab" * 32)) == [False, True, True]
    assert _ok(compare_step(RECORD, 0.5, 2.0, "cd" * 32)) == [True, True, False]


def test_gpu_allows_rounding_up_to_gpu_rtol_and_reports_the_sha():
    # grad norm 2.0 * (1 + 5e-4): within GPU_RTOL 1e-3; the sha differs and is not required.
    checks = compare_step(RECORD, 0.5, 2.0 * (1 + 0.5 * GPU_RTOL), "cd" * 32, on_gpu=True)
    assert _ok(checks) == [True, True, True]
    assert "not required on a GPU" in checks[2].describe()
    # A 2% change of the grad norm (one flipped reward on CPU) still fails there.
    checks = compare_step(RECORD, 0.5, 2.04, "ab" * 32, on_gpu=True)
    assert _ok(checks) == [True, False, True] and f"> rtol {GPU_RTOL:g}" in checks[1].describe()
    assert ATOL < GPU_RTOL * RECORD.loss


def test_replay_takes_the_item_the_trainer_trained_of_two_with_one_batch_id(tmp_path):
    """Batch 6 recorded twice (a restarted rollout generated it again): version 0, too
    stale for step 3 under η 1, then version 3. Under ``drop`` the trainer dropped the
    first and trained the second; under ``late_samples: train`` it trained the first."""
    from types import SimpleNamespace

    from pipeline.replay import _find_step_batches
    from tests.unit.test_admission import make_batch

    def item(seq: int, version: int):
        value = make_batch(num_groups=1, batch_id=6)
        header = SimpleNamespace(edge="reward->trainer", batch_id=6, seq=seq, policy_version=version)
        return SimpleNamespace(header=header, value=value)

    first, second = item(0, 0), item(1, 3)
    reader = SimpleNamespace(manifest={}, root=tmp_path, errors=[], items=lambda edge, on_error: [first, second])
    record = StepRecord(step=3, policy_version=4, batch_ids=[6], loss=0.5, grad_norm=2.0, weights_sha256="ab" * 32)
    drop = _find_step_batches(reader, "reward->trainer", [record], max_staleness=1)
    train = _find_step_batches(reader, "reward->trainer", [record], max_staleness=1, train_late=True)
    assert [b is second.value for b in drop[3]] == [True] and [b is first.value for b in train[3]] == [True]
