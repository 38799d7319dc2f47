"""Token-budget passes (pipeline/memory/packing.py) and what they feed: every row once,
the budget kept, pairs whole, less padding than fixed-row chunks on long-tailed lengths,
the step's padding metrics, and reference log-probs that do not depend on the grouping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.memory.admission import ModelShape, estimate_batch_bytes
from pipeline.memory.packing import count_pass_tokens, padding_fraction, plan_passes
from stages.models.logprobs import compute_completion_logprobs
from stages.trainer.metrics import summarise_pass_padding
from stages.trainer.pieces import merge_piece_metrics
from tests.unit.test_logprobs import make_batch, model  # noqa: F401  (model: a fixture)


def long_tail_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Prompt + completion lengths shaped like reasoning traces: a 200-token prompt plus a
    lognormal completion with median 1000 and p99 near 8000 (sigma 0.9: e^(2.33 * 0.9)
    = 8.1 times the median), clipped to [1, 16000]."""
    rng = np.random.default_rng(seed)
    return 200 + np.clip(np.rint(rng.lognormal(np.log(1000), 0.9, n)), 1, 16000).astype(np.int64)


def check_partition(passes: list[np.ndarray], n: int) -> None:
    rows = np.concatenate(passes) if passes else np.zeros(0, np.int64)
    assert sorted(rows.tolist()) == list(range(n))  # every row exactly once
    assert all((np.diff(p) > 0).all() for p in passes)  # ascending inside a pass


@pytest.mark.parametrize("seed", range(5))
def test_passes_keep_the_budget_except_a_single_long_row(seed):
    lens = long_tail_lengths(64, seed)
    budget = 4096
    passes = plan_passes(lens, budget, chunk_size=16)
    check_partition(passes, lens.size)
    for rows in passes:
        cost = len(rows) * int(lens[rows].max())
        assert cost <= budget or (len(rows) == 1 and lens[rows[0]] > budget), (rows, lens[rows])
    assert any(len(p) > 1 for p in passes) and any(lens[p[0]] > budget for p in passes if len(p) == 1)


def test_rows_are_grouped_longest_first_and_greedily():
    # Sorted: 9 (row 2), 5 (row 0), 5 (row 4), 3 (row 1), 1 (row 3). Budget 12: 9 alone
    # (2 x 9 = 18 > 12); 5, 5 (2 x 5 = 10; a third row: 15 > 12); 3, 1 (2 x 3 = 6).
    passes = plan_passes([5, 3, 9, 1, 5], 12, chunk_size=16)
    assert [p.tolist() for p in passes] == [[2], [0, 4], [1, 3]]
    # Computed: 9 + 2 x 5 + 2 x 3 = 25 tokens for 23 real ones.
    assert count_pass_tokens([5, 3, 9, 1, 5], passes) == (23, 25)


def test_zero_budget_is_fixed_row_chunks_in_order():
    passes = plan_passes([5, 3, 9, 1, 5], 0, chunk_size=2)
    assert [p.tolist() for p in passes] == [[0, 1], [2, 3], [4]]
    # Each chunk at its own longest: 2 x 5 + 2 x 9 + 5 = 33.
    assert count_pass_tokens([5, 3, 9, 1, 5], passes) == (23, 33)


def test_pairs_stay_whole_and_in_order():
    # Pairs (0, 1), (2, 3), (4, 5) are 7, 2 and 6 long (the longer row of each). Budget
    # 16: pair (0, 1) and pair (4, 5) would be 4 x 7 = 28, so (0, 1) runs alone; then
    # (4, 5) with (2, 3): 4 x 6 = 24 > 16, alone too; (2, 3) last.
    lens = [7, 3, 2, 1, 6, 6]
    passes = plan_passes(lens, 16, chunk_size=16, unit_rows=2)
    assert [p.tolist() for p in passes] == [[0, 1], [4, 5], [2, 3]]
    for budget in (1, 8, 30, 100):
        for rows in plan_passes(lens, budget, chunk_size=3, unit_rows=2):
            assert len(rows) % 2 == 0 and (rows[0::2] % 2 == 0).all() and (rows[1::2] == rows[0::2] + 1).all()
    # Fixed-row chunks of an odd size hold whole pairs too.
    assert [p.tolist() for p in plan_passes(lens, 0, chunk_size=3, unit_rows=2)] == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"pass_tokens": -1}, "train.pass_tokens: expected >= 0"),
    ({"chunk_size": 0}, "chunk_size: expected >= 1"),
    ({"unit_rows": 2}, "unit_rows: expected >= 1 dividing the 3 rows"),
])
def test_bad_plans_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_passes([1, 2, 3], **{"pass_tokens": 8, "chunk_size": 2, **kwargs})


def test_padding_on_long_tailed_lengths_drops_well_below_fixed_chunks():
    lens = long_tail_lengths(256, seed=1)
    real, unpacked = count_pass_tokens(lens, plan_passes(lens, 0, chunk_size=16))
    real_packed, packed = count_pass_tokens(lens, plan_passes(lens, 16384, chunk_size=16))
    assert real == real_packed == int(lens.sum())
    before, after = padding_fraction(real, unpacked), padding_fraction(real, packed)
    # 16 random lengths padded to their longest waste most of a chunk under this tail.
    assert before > 0.4
    assert after < before / 4
    assert padding_fraction(0, 0) == 0.0


def test_estimates_follow_the_plan():
    shape = ModelShape(hidden_size=64, num_layers=2, num_kv_heads=4, head_dim=16, vocab_size=100, num_params=10**5,
                       intermediate_size=128)
    lens = [1000] + [50] * 31
    chunks = estimate_batch_bytes("trainer", shape, lens, chunk_size=16)
    packed = estimate_batch_bytes("trainer", shape, lens, chunk_size=16, pass_tokens=1000)
    # Fixed chunks: 16 rows padded to 1000 tokens; packed: the long row alone, then 20
    # rows of 50: 1000 tokens a pass at most, a sixteenth (bytes grow with tokens).
    one_pass = estimate_batch_bytes("trainer", shape, [1000], chunk_size=1)
    assert packed == one_pass and chunks == 16 * packed


def test_step_padding_metrics_add_up_the_pieces():
    # Two micro-batches: 600 real of 1000 computed, 300 of 500; unpacked 1600 and 900.
    first = {"passes": 3.0, "pass_real_tokens": 600.0, "pass_tokens": 1000.0, "pass_tokens_unpacked": 1600.0}
    second = {"passes": 1.0, "pass_real_tokens": 300.0, "pass_tokens": 500.0, "pass_tokens_unpacked": 900.0}
    got = summarise_pass_padding([first, second])
    assert got == pytest.approx({"actor/padding_fraction": 1 - 900 / 1500,
                                 "actor/padding_fraction_unpacked": 1 - 900 / 2500, "actor/passes": 4.0,
                                 "actor/pass_tokens": 1500.0})
    assert summarise_pass_padding([{"loss": 0.0}]) == {}
    # A micro-batch trained as pieces counts the tokens of all of them.
    merged = merge_piece_metrics([{**first, "num_samples": 2.0}, {**second, "num_samples": 2.0}], [0.5, 0.5])
    assert merged["pass_tokens"] == 1500.0 and merged["passes"] == 4.0


def test_reference_logprobs_do_not_depend_on_the_grouping(model):  # noqa: F811
    # Ragged prompts and completions: budgets of 12 and 30 tokens group them differently
    # from the 3-sample chunks, and each pass is trimmed to its own rows.
    batch = make_batch([3, 1, 6, 2, 4, 5, 1, 2], [9, 1, 4, 0, 12, 3, 7, 2], group_size=2, seed=4)
    with torch.no_grad():
        dense = compute_completion_logprobs(model, batch, chunk_size=8).numpy()
        chunked = compute_completion_logprobs(model, batch, chunk_size=3).numpy()
        packed = {b: compute_completion_logprobs(model, batch, pass_tokens=b).numpy() for b in (12, 30)}
    np.testing.assert_allclose(chunked, dense, rtol=1e-5, atol=1e-6)
    for got in packed.values():
        np.testing.assert_allclose(got, dense, rtol=1e-5, atol=1e-6)
        assert (got[np.arange(got.shape[1])[None, :] >= batch.completion_lens[:, None]] == 0).all()
    assert np.abs(dense).sum() > 0  # real log-probs, not zeros everywhere
