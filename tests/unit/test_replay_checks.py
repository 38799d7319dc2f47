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
