"""Admission: estimators, calibration, the controller state machine, splitting by GRPO
group, and OOM recovery over real RolloutBatches."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
import torch

from pipeline.config import MemoryConfig
from pipeline.memory.admission import (
    AdmissionController,
    AdmissionTimeout,
    Calibration,
    DecisionKind,
    ModelShape,
    count_seq_lens,
    estimate_batch_bytes,
    estimate_forward_bytes,
    estimate_kv_cache_bytes,
    expand_rollout_seq_lens,
    layer_saved_bytes,
)
from pipeline.memory.oom import OomEvent, OomUnrecoverable, is_oom_error, run_with_oom_recovery
from pipeline.memory.readings import MemoryReading
from pipeline.memory.splitting import (
    CannotSplitError,
    check_rollout_batch,
    count_groups,
    merge_rollout_batches,
    split_prompt_batch,
    split_rollout_batch,
)
from pipeline.types import Prompt, PromptBatch, RolloutBatch

MiB = 1 << 20

# 2 layers, 2 kv heads x 64, hidden 128, MLP 256, vocab 100, float32.
SHAPE = ModelShape(
    num_layers=2, num_kv_heads=2, head_dim=64, hidden_size=128, vocab_size=100,
    num_params=353_920, dtype_bytes=4, intermediate_size=256, num_heads=2,
)
LLAMA_DICT = {
    "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
    "head_dim": 64, "intermediate_size": 256, "vocab_size": 100, "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


# ---------------------------------------------------------------------- estimators

def test_kv_cache_bytes_per_token() -> None:
    # 2 layers x 2 kv heads x 64 x 2 (K, V) x 4 bytes = 2048 bytes per token.
    assert estimate_kv_cache_bytes(SHAPE, 1) == 2048
    assert estimate_kv_cache_bytes(SHAPE, 10) == 20_480


def test_forward_bytes_with_and_without_grad() -> None:
    # Per token per layer (float32, d = 4; Q = K = 2 x 64 = 128): two norms (4 + 2d) x 128
    # = 3072; q, k, v, the attention output and its copy d x (3Q + 2K) = 2560; the MLP
    # 4d x 256 = 4096: 9728 bytes. S=2, L=10 -> T=20 tokens; logits 20 x 100 = 2000 elements.
    assert layer_saved_bytes(SHAPE) == 9728
    # No grad: one layer alive: 20*9728 = 194_560, logits 2000*8 = 16_000 -> 210_560.
    assert estimate_forward_bytes(SHAPE, 2, 10, with_grad=False) == 210_560
    # Grad: both layers kept: 389_120, logits 2000*12 = 24_000 -> 413_120.
    assert estimate_forward_bytes(SHAPE, 2, 10, with_grad=True) == 413_120
    # Gradient checkpointing: each layer's input (2 x 128 x 4 = 1024 per token) plus 1.5
    # layers' worth (14_592): 20 * 15_616 = 312_320, logits 24_000 -> 336_320.
    assert estimate_forward_bytes(SHAPE, 2, 10, with_grad=True, checkpointed=True) == 336_320
    # Without grad nothing is kept for backward: checkpointing changes nothing.
    assert estimate_forward_bytes(SHAPE, 2, 10, with_grad=False, checkpointed=True) == 210_560
    assert estimate_batch_bytes("trainer", SHAPE, [10, 10], checkpointed=True) == 336_320


def test_layer_bytes_count_qk_norms_and_gemmas_float32_norms() -> None:
    # Qwen3-0.6B in bf16: H 1024, Q 16 x 128, K 8 x 128, I 3072. Norms 2 x 8H = 16_384;
    # q/k norms (4 + 2)(Q + K) = 18_432; 2(3Q + 2K) = 16_384; MLP 8I = 24_576.
    qwen3 = ModelShape(num_layers=28, num_kv_heads=8, head_dim=128, hidden_size=1024, vocab_size=151_936,
                       num_params=6 * 10**8, dtype_bytes=2, intermediate_size=3072, num_heads=16, qk_norm=True)
    assert layer_saved_bytes(qwen3) == 75_776
    # Gemma's four norms: the pre-norms (8 + d)H, the post-norms 8H; its q/k norms 8(Q + K).
    gemma = msgspec.structs.replace(qwen3, sandwich_norms=True)
    assert layer_saved_bytes(gemma) == 2 * 10 * 1024 + 2 * 8 * 1024 + 8 * 3072 + 16_384 + 24_576
    assert ModelShape.from_hf_config({**LLAMA_DICT, "model_type": "qwen3"}).qk_norm
    gemma3 = ModelShape.from_hf_config({**LLAMA_DICT, "model_type": "gemma3_text"})
    assert gemma3.qk_norm and gemma3.sandwich_norms
    assert not ModelShape.from_hf_config({**LLAMA_DICT, "model_type": "llama"}).qk_norm


def test_batch_bytes_dispatch_by_stage() -> None:
    # rollout: KV of 5 + 7 = 12 tokens (12*2048 = 24_576) + 2 seqs x 100 x 8 = 1_600.
    assert estimate_batch_bytes("rollout", SHAPE, [5, 7]) == 26_176
    # reference, chunks of 2: [10, 10] -> 210_560; [4] -> 4*9728 + 4*100*8 = 42_112; peak 210_560.
    assert estimate_batch_bytes("reference", SHAPE, [10, 10, 4], chunk_size=2) == 210_560
    # one chunk: S=3, L=10, T=30: 30*9728 + 30*800 = 315_840.
    assert estimate_batch_bytes("reference", SHAPE, [10, 10, 4]) == 315_840
    assert estimate_batch_bytes("trainer", SHAPE, [10, 10]) == 413_120
    assert estimate_batch_bytes("trainer", SHAPE, []) == 0
    with pytest.raises(ValueError, match="stage_kind"):
        estimate_batch_bytes("reward", SHAPE, [3])  # type: ignore[arg-type]


def test_seq_len_helpers() -> None:
    # prompts of 3 and 5 tokens, 2 samples each, up to 4 new tokens: 7, 7, 9, 9.
    assert expand_rollout_seq_lens([3, 5], 2, 4) == [7, 7, 9, 9]
    batch = make_batch(num_groups=2, group_size=2)
    expected = [int(p + c) for p, c in zip(batch.prompt_lens, batch.completion_lens, strict=True)]
    assert count_seq_lens(batch) == expected


def test_shape_from_hf_config() -> None:
    # Embeddings 100*128 = 12_800, untied lm_head another 12_800. Per layer: q, o 2*128*128
    # = 32_768; k, v 2*128*128 = 32_768; gate/up/down 3*128*256 = 98_304; norms 256 ->
    # 164_096; 2 layers 328_192; final norm 128. Total 353_920 (LlamaForCausalLM agrees).
    shape = ModelShape.from_hf_config(LLAMA_DICT)
    assert shape == SHAPE
    tied = ModelShape.from_hf_config({**LLAMA_DICT, "tie_word_embeddings": True, "torch_dtype": "bfloat16"})
    assert tied.num_params == 353_920 - 12_800
    assert tied.dtype_bytes == 2
    # head_dim and kv heads derived when absent: 128 // 2 heads = 64, kv heads = heads.
    bare = {k: v for k, v in LLAMA_DICT.items() if k not in ("head_dim", "num_key_value_heads")}
    assert ModelShape.from_hf_config(bare).head_dim == 64
    assert ModelShape.from_hf_config(bare).num_kv_heads == 2


# --------------------------------------------------------------------- calibration

def test_calibration_learns_ratio_with_ema_and_clamps() -> None:
    cal = Calibration(alpha=0.5)
    assert cal.apply(1000) == 1000  # factor 1 before any observation
    assert cal.observe(100, 300) == 3.0  # the first observation sets the factor
    assert cal.apply(333) == 999
    assert cal.observe(100, 100) == pytest.approx(2.0, abs=1e-12)  # 0.5*3 + 0.5*1
    assert cal.observe(100, 10_000) == pytest.approx(5.0, abs=1e-12)  # ratio 100 -> 8: 0.5*2 + 0.5*8
    assert cal.observe(0, 500) == pytest.approx(5.0, abs=1e-12)  # empty estimate: ignored
    low = Calibration()
    assert low.observe(100, 1) == 0.25  # ratio 0.01 clamped up to 0.25


# ---------------------------------------------------------------------- controller

def reading(used: int, free: int, total: int = 8192 * MiB) -> MemoryReading:
    return MemoryReading(used_bytes=used, free_bytes=free, total_bytes=total, source="cpu")


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_controller(budget: int | None = 1000, clock: FakeClock | None = None, **kw: object) -> AdmissionController:
    cfg = MemoryConfig(budget_bytes=budget, defer_timeout_s=10.0, **kw)  # type: ignore[arg-type]
    return AdmissionController("trainer", cfg, now=clock or FakeClock())


def test_admit_under_budget_reserves_bytes() -> None:
    ctl = make_controller()
    # resident 200, + 300 = 500 <= budget 1000, and 300 <= free 5000.
    d = ctl.decide(300, reading(used=200, free=5000))
    assert (d.kind, d.bytes) == (DecisionKind.ADMIT, 300)
    assert ctl.in_flight_bytes == 300
    ctl.release(d.bytes)
    assert ctl.in_flight_bytes == 0
    with pytest.raises(ValueError, match="in flight"):
        ctl.release(1)


def test_budget_from_ratio_of_total() -> None:
    ctl = make_controller(budget=None, max_memory_ratio=0.5)
    assert ctl.budget_for(reading(used=0, free=0, total=10_000)) == 5000


def test_defer_until_in_flight_work_releases() -> None:
    ctl = make_controller()
    first = ctl.decide(500, reading(used=200, free=5000))  # resident 200 learned; 700 <= 1000
    assert first.kind is DecisionKind.ADMIT
    # First item now allocated (used 700): 700 + 400 = 1100 > 1000, but 400 fits the
    # 800 the budget leaves after resident: wait, do not split.
    d = ctl.decide(400, reading(used=700, free=5000), key="b")
    assert (d.kind, d.retry_after_s) == (DecisionKind.DEFER, 0.1)
    assert ctl.decide(400, reading(used=700, free=5000), key="b").kind is DecisionKind.DEFER
    ctl.release(first.bytes)
    assert ctl.decide(400, reading(used=200, free=5000), key="b").kind is DecisionKind.ADMIT
    assert (ctl.admitted, ctl.deferred, ctl.splits) == (2, 1, 0)  # deferrals count items


def test_defer_counts_unallocated_in_flight_against_free_memory() -> None:
    ctl = make_controller()
    ctl.decide(500, reading(used=200, free=5000))
    # Not yet allocated (used still 200): projected max(200, 200+500) + 300 = 1000 <= 1000,
    # but the 500 still to come + 300 = 800 > free 600.
    assert ctl.decide(300, reading(used=200, free=600)).kind is DecisionKind.DEFER
    assert ctl.decide(300, reading(used=200, free=800)).kind is DecisionKind.ADMIT


def test_split_when_item_alone_exceeds_budget() -> None:
    ctl = make_controller()
    # capacity 1000 - 200 = 800; 3000 > 800, > 1600, <= 3200: 4 pieces.
    d = ctl.decide(3000, reading(used=200, free=10**6))
    assert (d.kind, d.pieces) == (DecisionKind.SPLIT, 4)
    assert ctl.decide(3000, reading(used=200, free=10**6), max_pieces=3).pieces == 3
    assert ctl.splits == 2 and ctl.in_flight_bytes == 0


def test_atomic_over_budget_item_runs_alone() -> None:
    ctl = make_controller()
    other = ctl.decide(100, reading(used=200, free=10**6))
    # One group of 900 > capacity 800 cannot be split: it waits for the stage to empty...
    assert ctl.decide(900, reading(used=300, free=10**6), max_pieces=1).kind is DecisionKind.DEFER
    ctl.release(other.bytes)
    # ...then runs alone, over budget (OOM recovery is the last guard).
    assert ctl.decide(900, reading(used=200, free=10**6), max_pieces=1).kind is DecisionKind.ADMIT


def test_timeout_names_stage_and_numbers() -> None:
    clock = FakeClock()
    ctl = make_controller(budget=1024 * MiB, clock=clock)
    ctl.decide(700 * MiB, reading(used=0, free=10_000 * MiB))  # resident 0, in flight 700 MiB
    busy = reading(used=700 * MiB, free=100 * MiB)
    assert ctl.decide(400 * MiB, busy, key=1).kind is DecisionKind.DEFER  # 1100 > 1024
    clock.t = 5.0
    assert ctl.decide(300 * MiB, busy, key=2).kind is DecisionKind.DEFER  # another item
    clock.t = 9.9
    assert ctl.decide(400 * MiB, busy, key=1).kind is DecisionKind.DEFER
    clock.t = 10.0  # item 1 deferred for 10 s = defer_timeout_s
    with pytest.raises(AdmissionTimeout) as err:
        ctl.decide(400 * MiB, busy, key=1)
    text = str(err.value)
    for part in ("stage 'trainer'", "waited 10.0 s", "estimate 400.0 MiB", "free 100.0 MiB",
                 "budget 1024.0 MiB", "in flight 700.0 MiB", "train.memory.budget_bytes"):
        assert part in text, part
    assert ctl.decide(300 * MiB, busy, key=2).kind is DecisionKind.DEFER  # waited 5 s only


def test_admission_restarts_deferral_clock() -> None:
    clock = FakeClock()
    ctl = make_controller(clock=clock)
    # resident 100 + 900 <= 1000, but only 50 bytes are free; one group (no split).
    assert ctl.decide(900, reading(used=100, free=50), key="a", max_pieces=1).kind is DecisionKind.DEFER
    clock.t = 8.0
    assert ctl.decide(900, reading(used=100, free=5000), key="a", max_pieces=1).kind is DecisionKind.ADMIT
    ctl.release(900)
    assert ctl.decide(900, reading(used=100, free=50), key="a", max_pieces=1).kind is DecisionKind.DEFER
    clock.t = 17.0  # 9 s into the second deferral: no timeout
    assert ctl.decide(900, reading(used=100, free=50), key="a", max_pieces=1).kind is DecisionKind.DEFER


def test_idle_stage_splits_what_free_memory_cannot_hold() -> None:
    # Nothing in flight; 900 bytes fit the budget (100 + 900 <= 1000) but 300 are free,
    # and nothing of this stage will free more. It waits stall_timeout_s (2 s) for a
    # neighbour, then splits: 900 / 4 = 225 <= 300 (2 pieces: 450 > 300).
    clock = FakeClock()
    ctl = AdmissionController("trainer", MemoryConfig(budget_bytes=1000, defer_timeout_s=10.0, stall_timeout_s=2.0),
                              now=clock)
    assert ctl.decide(900, reading(used=100, free=300), key="a", max_pieces=8).kind is DecisionKind.DEFER
    clock.t = 2.0
    d = ctl.decide(900, reading(used=100, free=300), key="a", max_pieces=8)
    assert (d.kind, d.pieces) == (DecisionKind.SPLIT, 4)
    assert "free on the device" in d.reason


def test_idle_stage_fails_fast_on_a_group_free_memory_cannot_hold() -> None:
    # One group (max_pieces=1), nothing in flight, 50 bytes free: it waits
    # stall_timeout_s (2 s here), not defer_timeout_s (10 s), then names what to lower.
    clock = FakeClock()
    ctl = AdmissionController("trainer", MemoryConfig(budget_bytes=1000, defer_timeout_s=10.0, stall_timeout_s=2.0),
                              now=clock)
    assert ctl.decide(900, reading(used=100, free=50), key="a", max_pieces=1).kind is DecisionKind.DEFER
    clock.t = 1.9
    assert ctl.decide(900, reading(used=100, free=50), key="a", max_pieces=1).kind is DecisionKind.DEFER
    clock.t = 2.0
    with pytest.raises(AdmissionTimeout) as err:
        ctl.decide(900, reading(used=100, free=50), key="a", max_pieces=1)
    for part in ("stall_timeout_s 2", "train.chunk_size", "rollout.gpu_memory_utilization", "estimate"):
        assert part in str(err.value), part


def test_protection_off_always_admits() -> None:
    ctl = make_controller(oom_protection=False)
    d = ctl.decide(10**12, reading(used=900, free=0))
    assert (d.kind, d.bytes) == (DecisionKind.ADMIT, 10**12)


def test_calibration_scales_the_estimate_and_metrics() -> None:
    ctl = make_controller()
    assert ctl.observe_peak(100, 200) == 2.0
    d = ctl.decide(150, reading(used=100, free=5000))  # 150 x 2 = 300; 100 + 300 <= 1000
    assert (d.kind, d.bytes) == (DecisionKind.ADMIT, 300)
    ctl.record_oom_event(OomEvent(stage="trainer", kind="oom"))
    ctl.record_oom_event(OomEvent(stage="trainer", kind="recovered", count=1))
    assert ctl.metrics() == {
        "memory/trainer/used_bytes": 100.0,
        "memory/trainer/budget_bytes": 1000.0,
        "memory/trainer/in_flight_bytes": 300.0,
        "admission/trainer/admitted": 1.0,
        "admission/trainer/deferred": 0.0,
        "admission/trainer/splits": 0.0,
        "admission/trainer/calibration": 2.0,
        "oom/trainer/events": 1.0,
        "oom/trainer/recovered": 1.0,
    }


# ------------------------------------------------------------------- split / merge

def make_batch(num_groups: int = 4, group_size: int = 2, batch_id: int = 7) -> RolloutBatch:
    """Group k's prompt is k % 3 + 1 tokens; sample i's completion (i * 5) % 4 + 1 tokens;
    arrays right-padded with 0 to the longest; each value encodes its sample and column."""
    n = num_groups * group_size
    plens = np.array([(i // group_size) % 3 + 1 for i in range(n)], dtype=np.int32)
    clens = np.array([(i * 5) % 4 + 1 for i in range(n)], dtype=np.int32)
    p_cols, c_cols = np.arange(plens.max()), np.arange(clens.max())
    p_mask, c_mask = p_cols < plens[:, None], c_cols < clens[:, None]
    rows = np.arange(n)[:, None]
    ids = [f"b{batch_id}:g{i // group_size}:{i % group_size}" for i in range(n)]
    return RolloutBatch(
        batch_id=batch_id, step=3, group_size=group_size, policy_version=5,
        prompts=[Prompt(prompt_id=f"g{k}", text=f"q{k}") for k in range(num_groups)],
        sample_ids=ids,
        prompt_ids=np.where(p_mask, 100 * rows + p_cols + 1, 0).astype(np.int32),
        prompt_lens=plens,
        completion_ids=np.where(c_mask, 100 * rows + c_cols + 50, 0).astype(np.int32),
        completion_lens=clens,
        completions=[f"c{i}" for i in range(n)],
        behaviour_logprobs=np.where(c_mask, -0.01 * (rows + 1), 0).astype(np.float32),
        token_versions=np.where(c_mask, 5, 0).astype(np.int32),
        finish_reasons=["stop" if i % 2 else "length" for i in range(n)],
        rewards=np.arange(n, dtype=np.float32),
        reward_errors=[f"{ids[1]}: boom", "batch-level: no sample"],
        reward_extras={"acc": [float(i % 2) for i in range(n)]},
        ref_logprobs=np.where(c_mask, -0.5, 0).astype(np.float32),
    )


def assert_batches_equal(a: RolloutBatch, b: RolloutBatch) -> None:
    for field in msgspec.structs.fields(RolloutBatch):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), field.name
        else:
            assert x == y, field.name


def test_split_keeps_groups_whole_and_trims_padding() -> None:
    batch = make_batch(num_groups=4, group_size=2)
    parts = split_rollout_batch(batch, 2)
    assert [count_groups(p) for p in parts] == [2, 2]
    first, second = parts
    # Groups 0, 1 (samples 0-3): prompts 1, 2 tokens; completions 1, 2, 3, 4 tokens.
    assert first.sample_ids == batch.sample_ids[:4]
    assert first.prompt_ids.shape == (4, 2) and first.completion_ids.shape == (4, 4)
    # Groups 2, 3 (samples 4-7): prompts 3, 1 tokens; completions 1, 2, 3, 4 tokens.
    assert second.prompt_ids.shape == (4, 3) and second.completion_ids.shape == (4, 4)
    assert first.reward_errors == [f"{batch.sample_ids[1]}: boom", "batch-level: no sample"]
    assert second.reward_errors == []
    assert second.reward_extras == {"acc": [0.0, 1.0, 0.0, 1.0]}
    for p in parts:
        check_rollout_batch(p)
        assert (p.batch_id, p.step, p.policy_version) == (7, 3, 5)
        for k in range(count_groups(p)):  # every group's samples share its prompt
            assert {s.split(":")[1] for s in p.sample_ids[2 * k : 2 * k + 2]} == {p.prompts[k].prompt_id}


def test_split_merge_round_trip_keeps_every_sample_once() -> None:
    batch = make_batch(num_groups=5, group_size=3)
    for parts in (1, 2, 3, 4, 5):
        pieces = split_rollout_batch(batch, parts)
        # 5 groups into k near-equal runs: sizes differ by at most one.
        sizes = [count_groups(p) for p in pieces]
        assert sum(sizes) == 5 and max(sizes) - min(sizes) <= 1 and len(sizes) == parts
        assert sorted(s for p in pieces for s in p.sample_ids) == sorted(batch.sample_ids)
        assert_batches_equal(merge_rollout_batches(pieces), batch)
    # Split again and merge in two levels: still the same batch.
    halves = [split_rollout_batch(h, 2) for h in split_rollout_batch(batch, 2)]
    assert_batches_equal(merge_rollout_batches([merge_rollout_batches(h) for h in halves]), batch)


def test_split_caps_pieces_and_refuses_single_group() -> None:
    batch = make_batch(num_groups=3, group_size=2)
    assert len(split_rollout_batch(batch, 8)) == 3  # never more pieces than groups
    assert split_rollout_batch(batch, 1) == [batch]
    one = make_batch(num_groups=1, group_size=4)
    with pytest.raises(CannotSplitError, match="micro-batch 7 holds 1 GRPO group"):
        split_rollout_batch(one, 2)
    with pytest.raises(ValueError, match="pieces"):
        split_rollout_batch(batch, 0)


def test_split_prompt_batch() -> None:
    batch = PromptBatch(batch_id=2, step=0, prompts=[Prompt(prompt_id=str(i), text="x") for i in range(5)])
    parts = split_prompt_batch(batch, 2)
    assert [p.sample_ids for p in parts] == [["0", "1", "2"], ["3", "4"]]
    assert all((p.batch_id, p.step) == (2, 0) for p in parts)
    with pytest.raises(CannotSplitError):
        split_prompt_batch(PromptBatch(batch_id=2, step=0, prompts=batch.prompts[:1]), 2)


def test_merge_refuses_foreign_duplicate_or_mixed_pieces() -> None:
    a, b = split_rollout_batch(make_batch(num_groups=2), 2)
    with pytest.raises(ValueError, match="present twice"):
        merge_rollout_batches([a, a])
    with pytest.raises(ValueError, match="does not belong"):
        merge_rollout_batches([a, msgspec.structs.replace(b, batch_id=8)])
    with pytest.raises(ValueError, match="rewards"):
        merge_rollout_batches([a, msgspec.structs.replace(b, rewards=None)])


def test_check_rollout_batch_names_bad_field() -> None:
    batch = make_batch(num_groups=2)
    with pytest.raises(ValueError, match="completions has 3 rows, expected 4"):
        check_rollout_batch(msgspec.structs.replace(batch, completions=batch.completions[:3]))


# ------------------------------------------------- OOM recovery over real batches

def test_oom_recovery_processes_every_sample_exactly_once() -> None:
    batch = make_batch(num_groups=8, group_size=2)
    calls: list[int] = []
    processed: list[str] = []
    events: list[OomEvent] = []

    def score(piece: RolloutBatch) -> RolloutBatch:  # runs out of memory above 2 groups
        calls.append(count_groups(piece))
        if count_groups(piece) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        processed.extend(piece.sample_ids)
        return msgspec.structs.replace(piece, rewards=piece.rewards * 10)

    out = asyncio.run(
        run_with_oom_recovery(
            score, batch, split=split_rollout_batch, merge=merge_rollout_batches, stage="reference",
            size=count_groups, on_event=events.append, free_memory=lambda: None,
        )
    )
    # 8 fails -> 4 + 4; the first 4 fails -> 2 + 2 + 4; the second 4 is split before it
    # runs (a 4 already failed): 8, 4, 2, 2, 2, 2.
    assert calls == [8, 4, 2, 2, 2, 2]
    assert processed == batch.sample_ids  # each once, in order
    assert out.sample_ids == batch.sample_ids
    assert np.array_equal(out.rewards, batch.rewards * 10)
    assert [(e.kind, e.size, e.count) for e in events] == [("oom", 8, 0), ("oom", 4, 0), ("recovered", None, 2)]


def test_oom_recovery_gives_up_on_a_single_group() -> None:
    batch = make_batch(num_groups=4, group_size=2)

    def always_oom(piece: RolloutBatch) -> RolloutBatch:
        raise RuntimeError("CUDA out of memory. Tried to allocate 9.00 GiB")

    with pytest.raises(OomUnrecoverable) as err:
        asyncio.run(
            run_with_oom_recovery(
                always_oom, batch, split=split_rollout_batch, stage="reference", free_memory=lambda: None
            )
        )
    # 4 -> 2 + 2 (1st halving), 2 -> 1 + 1 (2nd), 1 cannot be split.
    text = str(err.value)
    assert "stage 'reference'" in text and "1 GRPO group" in text and "after 2 halving(s)" in text
    assert "CUDA out of memory" in text
    assert err.value.stage == "reference" and not is_oom_error(err.value)
