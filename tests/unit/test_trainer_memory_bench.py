"""``bench trainer_memory --quick``: the three trainer passes (dense head, chunked head,
chunked with gradient checkpointing) at a scaled-down real shape agree with each other."""

from __future__ import annotations

import json

import pytest

from bench.__main__ import main
from bench.common import result_files


def test_trainer_memory_quick_rows_agree_with_the_dense_pass(tmp_path):
    assert main(["trainer_memory", "--quick", "--out", str(tmp_path)]) == 0
    (path,) = result_files(tmp_path, "trainer_memory")
    doc = json.loads(path.read_text())
    (shape,) = doc["shapes"]
    assert shape["shape"] == "qwen3_0.6b" and shape["tied"]
    rows = shape["rows_by"]
    assert [rows[v]["status"] for v in ("dense", "chunked", "chunked_checkpointed")] == ["ok"] * 3
    for variant in ("chunked", "chunked_checkpointed"):
        assert rows[variant]["max_abs_logprob_diff_vs_dense"] < 1e-4
        assert rows[variant]["grad_norm_over_dense"] == pytest.approx(1.0, rel=1e-4)
    # The plan's estimate of the same pass: the chunked head and checkpointing keep less.
    est = {v: rows[v]["estimate_mib"] for v in rows}
    assert est["chunked_checkpointed"] < est["chunked"]
    assert doc["ratios"]["qwen3_0.6b/checkpointed_over_chunked_time"] > 0
