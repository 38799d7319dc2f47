"""TrainerEngine on the tiny checkpoint with real DeepSpeed on CPU (ZeRO 0).

One engine serves the whole module (DeepSpeed starts in seconds, not milliseconds).
Tests that need a known starting point take it from the engine's current state and
derive the behaviour log-probs from the current weights, so none depends on the order
the others ran in.
"""

from __future__ import annotations

import errno
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from pipeline.config import TinyModelConfig, TrainConfig
from pipeline.memory.splitting import split_rollout_batch, split_rollout_batch_at
from pipeline.types import Prompt, RolloutBatch
from pipeline.weights import compute_fingerprint, compute_sha256, deserialize_weights
from stages.algorithms import assign_advantages
from stages.algorithms.grpo import GrpoConfig
from stages.models.logprobs import compute_completion_logprobs
from stages.models.tiny import build_vocab, ensure_tiny_checkpoint
from stages.trainer.engine import TrainerEngine
from stages.trainer.pieces import compute_piece_weight
from stages.trainer.stage import compute_micro_batch_scale, compute_step_grad_scale

NUM_PROMPTS, GROUP, MAX_COMPLETION = 8, 8, 20
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return ensure_tiny_checkpoint(TinyModelConfig(), tmp_path_factory.mktemp("models"))


def build_engine(checkpoint, zero_stage: int = 0, gradient_checkpointing: bool = False,
                 offload_optimizer: bool = False) -> TrainerEngine:
    # chunk_size 24 does not divide the 32-sample halves of the 64-sample batch, so a
    # split batch runs different forward passes than the whole one (a real test of
    # accumulation, not a replay of identical arithmetic).
    train = TrainConfig(lr=1e-3, grad_clip=1.0, zero_stage=zero_stage, threads=1,
                        gradient_checkpointing=gradient_checkpointing, offload_optimizer=offload_optimizer)
    return TrainerEngine(checkpoint, train, GrpoConfig(kl_coef=0.04), temperature=1.0,
                         dtype="float32", seed=0, chunk_size=24)


@pytest.fixture(scope="module")
def engine(checkpoint):
    return build_engine(checkpoint)


def make_batch(seed: int = 0) -> RolloutBatch:
    """64 samples (8 prompts x 8), prompts of 3..11 chars, completions of 10..20 chars
    from the tiny vocabulary; in every group samples 0, 2, 4, 6 are rewarded."""
    rng = np.random.default_rng(seed)
    vocab = build_vocab()
    first_char, last_char = vocab["0"], len(vocab) - 1
    num = NUM_PROMPTS * GROUP
    prompt_lens = np.repeat(rng.integers(3, 12, NUM_PROMPTS), GROUP).astype(np.int32)
    prompt_ids = np.zeros((num, int(prompt_lens.max())), np.int32)
    for g in range(NUM_PROMPTS):
        row = rng.integers(first_char, last_char + 1, prompt_ids.shape[1])
        row[0] = vocab["<bos>"]
        prompt_ids[g * GROUP : (g + 1) * GROUP] = np.where(np.arange(row.size) < prompt_lens[g * GROUP], row, 0)
    completion_lens = rng.integers(MAX_COMPLETION // 2, MAX_COMPLETION + 1, num).astype(np.int32)
    completion_ids = rng.integers(first_char, last_char + 1, (num, MAX_COMPLETION)).astype(np.int32)
    completion_ids[np.arange(MAX_COMPLETION)[None, :] >= completion_lens[:, None]] = 0
    return RolloutBatch(
        batch_id=7,
        step=0,
        prompts=[Prompt(prompt_id=f"p{g}", text="") for g in range(NUM_PROMPTS)],
        group_size=GROUP,
        sample_ids=[f"p{i // GROUP}-{i % GROUP}" for i in range(num)],
        prompt_ids=prompt_ids,
        prompt_lens=prompt_lens,
        completion_ids=completion_ids,
        completion_lens=completion_lens,
        completions=[""] * num,
        behaviour_logprobs=np.zeros((num, MAX_COMPLETION), np.float32),
        token_versions=np.zeros((num, MAX_COMPLETION), np.int32),
        policy_version=0,
        rewards=(np.arange(num) % 2 == 0).astype(np.float32),
    )


def on_policy(engine: TrainerEngine, batch: RolloutBatch) -> RolloutBatch:
    """The batch as if the engine's current weights had generated it (ratio exactly 1),
    with its GRPO advantages assigned (as the trainer stage does)."""
    with torch.no_grad():
        logprobs = compute_completion_logprobs(engine.module, batch).numpy()
    batch = msgspec.structs.replace(batch, behaviour_logprobs=logprobs, policy_version=engine.version)
    return assign_advantages(batch, engine.algo)


def rewarded_gap(engine: TrainerEngine, batch: RolloutBatch) -> float:
    """Mean token log-prob of rewarded completions minus that of unrewarded ones."""
    with torch.no_grad():
        logprobs = compute_completion_logprobs(engine.module, batch).numpy()
    per_sample = logprobs.sum(axis=1) / batch.completion_lens
    good = batch.rewards > 0
    return float(per_sample[good].mean() - per_sample[~good].mean())


def gradients(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None}


def test_training_raises_logprob_of_rewarded_completions(engine):
    batch = on_policy(engine, make_batch(seed=1))
    # The reference is the starting policy, so the KL starts at exactly 0.
    batch = msgspec.structs.replace(batch, ref_logprobs=batch.behaviour_logprobs.copy())
    gap_before = rewarded_gap(engine, batch)
    history = []
    for _ in range(6):
        metrics = engine.train_micro_batch(batch, 1.0)
        metrics.update(engine.optimizer_step())
        history.append(metrics)
    gap_after = rewarded_gap(engine, batch)
    # Rewarded and unrewarded completions are random strings: before training their
    # log-probs differ by noise only; six steps at lr 1e-3 separate them clearly.
    assert gap_after > gap_before + 0.5, (gap_before, gap_after)
    assert history[-1]["loss"] < history[0]["loss"] - 0.1
    assert abs(history[0]["ratio_mean"] - 1.0) < 1e-5  # behaviour = current weights
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6) and history[-1]["kl"] > 0.01
    assert all(np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0 for m in history)
    assert history[0]["num_tokens"] == float(batch.completion_lens.sum())
    assert history[0]["reward_mean"] == pytest.approx(0.5)


def test_split_halves_accumulate_to_the_whole_batch_update(engine, tmp_path):
    batch = on_policy(engine, make_batch(seed=2))
    engine.save_state(tmp_path / "start")

    whole = engine.train_micro_batch(batch, 1.0)
    grads_whole = gradients(engine)
    step_whole = engine.optimizer_step()
    weights_whole = engine.state_dict_for_sync()

    engine.load_state(tmp_path / "start")
    pieces = split_rollout_batch(batch, 2)
    # Unequal token counts on purpose: under token-mean a piece weighs its share of the
    # loss tokens, not of the samples (the trainer's own rule, compute_piece_weight).
    assert pieces[0].completion_tokens != pieces[1].completion_tokens
    scales = [compute_piece_weight(p, batch, engine.algo.loss_agg) for p in pieces]
    losses = [engine.train_micro_batch(p, s)["loss"] for p, s in zip(pieces, scales, strict=True)]
    grads_split = gradients(engine)
    step_split = engine.optimizer_step()
    weights_split = engine.state_dict_for_sync()

    assert sum(s * loss for s, loss in zip(scales, losses, strict=True)) == pytest.approx(whole["loss"], abs=1e-6)
    assert step_split["num_pieces"] == 2 and step_whole["num_pieces"] == 1
    assert step_split["grad_norm"] == pytest.approx(step_whole["grad_norm"], rel=1e-5)
    for name, grad in grads_whole.items():
        torch.testing.assert_close(grads_split[name], grad, rtol=1e-5, atol=1e-7)
    worst = max(float((weights_split[n] - w).abs().max()) for n, w in weights_whole.items())
    assert worst <= 1e-5, worst


def test_version_counts_optimizer_steps(engine):
    batch = on_policy(engine, make_batch(seed=3))
    version, ds_steps, sha = engine.version, engine.engine.global_steps, engine.weights_sha256()
    halves = split_rollout_batch(batch, 2)

    engine.train_micro_batch(halves[0], 0.5)
    assert (engine.version, engine.weights_sha256()) == (version, sha)  # accumulate only
    engine.train_micro_batch(halves[1], 0.5)
    engine.optimizer_step()
    assert engine.version == version + 1 and engine.engine.global_steps == ds_steps + 1
    assert engine.weights_sha256() != sha

    engine.train_micro_batch(batch, 1.0)
    engine.optimizer_step()
    assert engine.version == version + 2 and engine.engine.global_steps == ds_steps + 2
    with pytest.raises(RuntimeError, match="no micro-batch"):
        engine.optimizer_step()
    assert engine.version == version + 2


def test_export_weights_match_the_checkpoint_layout(engine, checkpoint):
    payload, sha, fingerprint = engine.export_weights()
    assert sha == compute_sha256(payload) == engine.weights_sha256()
    shipped = deserialize_weights(payload)
    on_disk = deserialize_weights((checkpoint / "model.safetensors").read_bytes())
    assert sorted(shipped) == sorted(on_disk)
    assert all(shipped[n].dtype == on_disk[n].dtype and shipped[n].shape == on_disk[n].shape for n in on_disk)
    assert fingerprint == compute_fingerprint(engine.state_dict_for_sync().values())


def test_saved_checkpoint_reloads_and_generates(engine, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = engine.save_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    live = engine.state_dict_for_sync()
    loaded = model.state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in live.items())

    inputs = tokenizer("12+3=", return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, engine.module(**inputs).logits, rtol=0, atol=1e-6)
        generated = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert generated.shape == (1, inputs["input_ids"].shape[1] + 6)
    assert isinstance(tokenizer.decode(generated[0], skip_special_tokens=True), str)


def test_a_state_save_onto_a_full_disk_raises_enospc(engine, tmp_path):
    """torch's zip writer turns a failed write into a RuntimeError of its own; the
    checkpoint's writer must see the OSError (train.on_checkpoint_error answers it)."""
    engine.save_state(tmp_path / "whole")
    files = [p.relative_to(tmp_path / "whole") for p in (tmp_path / "whole").rglob("*.pt")]
    assert files
    for name in files:  # the same files again, each a link to /dev/full: every write there fails with ENOSPC
        (tmp_path / "full" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "full" / name).symlink_to("/dev/full")
    with pytest.raises(OSError) as info:
        engine.save_state(tmp_path / "full")
    assert info.value.errno == errno.ENOSPC


def test_state_round_trip_reproduces_the_next_step(engine, tmp_path):
    batch = on_policy(engine, make_batch(seed=4))
    engine.extra_state = {"kl_ctrl_coef": 0.0123}  # the trainer stage's KL controller keeps its coefficient here
    engine.save_state(tmp_path / "state")
    engine.extra_state = {"kl_ctrl_coef": 9.0}
    draws = (torch.rand(3).tolist(), float(np.random.rand()), random.random())
    version = engine.version

    first = engine.train_micro_batch(batch, 1.0) | engine.optimizer_step()
    sha_first = engine.weights_sha256()

    engine.load_state(tmp_path / "state")
    assert engine.version == version and engine.extra_state == {"kl_ctrl_coef": 0.0123}
    assert (torch.rand(3).tolist(), float(np.random.rand()), random.random()) == draws
    second = engine.train_micro_batch(batch, 1.0) | engine.optimizer_step()
    # Bitwise: same state, same inputs, same thread count on CPU.
    assert engine.weights_sha256() == sha_first
    assert (second["loss"], second["grad_norm"]) == (first["loss"], first["grad_norm"])


def test_replay_assigns_advantages_with_the_recorded_kl_reward_coefficient(engine):
    """``train_as_recorded`` (what ``conveyor replay`` runs) with a step's recorded
    KL-in-reward coefficient trains exactly what the trainer stage trained."""
    from stages.trainer.stage import train_as_recorded

    batch = on_policy(engine, make_batch(seed=13))
    rng = np.random.default_rng(13)
    ref = batch.behaviour_logprobs - rng.uniform(0.0, 0.5, batch.behaviour_logprobs.shape).astype(np.float32)
    raw = msgspec.structs.replace(batch, advantages=None, loss_mask=None, ref_logprobs=ref)

    def train(b: RolloutBatch) -> dict[str, float]:
        out = engine.train_micro_batch(b, 1.0)
        engine.discard_gradients()
        return out

    staged = train(assign_advantages(raw, engine.algo, kl_reward_coef=0.5))  # as the trainer stage does
    replayed = train_as_recorded(engine, raw, raw.num_samples, None, kl_reward_coef=0.5)
    engine.discard_gradients()
    plain = train_as_recorded(engine, raw, raw.num_samples, None)
    engine.discard_gradients()
    assert (replayed["loss"], replayed["adv_abs_mean"]) == (staged["loss"], staged["adv_abs_mean"])
    assert plain["loss"] != staged["loss"]  # the coefficient matters: 0 would replay another step


def train_one_split_step(engine: TrainerEngine, batch: RolloutBatch) -> dict[str, float]:
    """Two pieces at the trainer's token-mean scales: token sums, rescaled at the step
    (through ZeRO's loss scale on stages 1 and 2)."""
    pieces = split_rollout_batch(batch, 2)
    for piece in pieces:
        engine.train_micro_batch(piece, compute_micro_batch_scale(piece, batch.num_samples, "token-mean"))
    return engine.optimizer_step(compute_step_grad_scale(pieces, batch.num_samples, "token-mean"))


@pytest.fixture(scope="module")
def stage0_reference(checkpoint):
    """A fresh ZeRO-0 engine's first split step: (batch, step metrics, weights after)."""
    fresh = build_engine(checkpoint, zero_stage=0)
    batch = on_policy(fresh, make_batch(seed=5))
    out = train_one_split_step(fresh, batch)
    return batch, out, fresh.state_dict_for_sync()


@pytest.mark.parametrize(("zero_stage", "offload"), [(1, False), (2, False), (0, True), (2, True)])
def test_zero_stages_1_and_2_match_stage_0(checkpoint, stage0_reference, zero_stage, offload, tmp_path):
    """ZeRO 1 and 2, and ZeRO-Offload (the optimizer's state in host memory, stage 0
    raised to 1), take the same step as ZeRO 0 and restore from their own checkpoints."""
    batch, want, weights = stage0_reference
    engine = build_engine(checkpoint, zero_stage=zero_stage, offload_optimizer=offload)
    assert (engine.engine.zero_optimization_stage(), engine.engine.zero_cpu_offload()) == (max(zero_stage, offload),
                                                                                           offload)
    engine.save_state(tmp_path / "start")
    got = train_one_split_step(engine, batch)
    assert engine.version == 1
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
    live = engine.state_dict_for_sync()
    assert max(float((live[n] - w).abs().max()) for n, w in weights.items()) <= 1e-6
    sha = engine.weights_sha256()
    engine.load_state(tmp_path / "start")  # ZeRO keeps its own fp32 master copy
    train_one_split_step(engine, batch)
    assert engine.weights_sha256() == sha


def saved_activation_bytes(engine: TrainerEngine, batch: RolloutBatch) -> int:
    """Bytes autograd keeps for backward after the engine's forward of ``batch``."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        compute_completion_logprobs(engine.module, batch, chunk_size=batch.num_samples)
    return total


def test_gradient_checkpointing_keeps_less_and_steps_the_same(checkpoint, stage0_reference):
    """train.gradient_checkpointing: the blocks' activations are recomputed, not kept
    (autograd holds less after the forward), and the step is the one without it."""
    batch, want, weights = stage0_reference
    engine = build_engine(checkpoint, gradient_checkpointing=True)
    plain = build_engine(checkpoint)
    assert saved_activation_bytes(engine, batch) < 0.7 * saved_activation_bytes(plain, batch)
    got = train_one_split_step(engine, batch)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    live = engine.state_dict_for_sync()
    assert max(float((live[n] - w).abs().max()) for n, w in weights.items()) <= 1e-6


def test_streaming_token_mean_over_uneven_micro_batches_is_the_one_batch_gradient(engine, tmp_path):
    """The trainer's token-mean rule: micro-batches of 3, 1 and 4 groups (uneven token
    counts), the last one split in two pieces as an OOM split would, accumulate the
    gradient of the token-mean over all 64 samples at once."""
    batch = on_policy(engine, make_batch(seed=6))
    engine.save_state(tmp_path / "start")
    engine.train_micro_batch(batch, 1.0)
    grads_whole = gradients(engine)
    step_whole = engine.optimizer_step()

    engine.load_state(tmp_path / "start")
    parts = split_rollout_batch_at(batch, [3, 1, 4])
    parts = [msgspec.structs.replace(p, batch_id=i) for i, p in enumerate(parts)]
    tokens = [p.loss_tokens for p in parts]
    assert len(set(t / p.num_samples for t, p in zip(tokens, parts, strict=True))) == 3  # uneven lengths
    step_samples = batch.num_samples
    for part in parts:
        scale = compute_micro_batch_scale(part, step_samples, "token-mean")
        pieces = split_rollout_batch(part, 2) if len(part.prompts) > 1 else [part]
        for piece in pieces:
            engine.train_micro_batch(piece, scale * compute_piece_weight(piece, part, "token-mean"))
    grad_scale = compute_step_grad_scale(parts, step_samples, "token-mean")
    assert grad_scale == step_samples / batch.completion_tokens
    streamed = {n: g * grad_scale for n, g in gradients(engine).items()}
    step_streamed = engine.optimizer_step(grad_scale)

    for name, grad in grads_whole.items():
        torch.testing.assert_close(streamed[name], grad, rtol=1e-5, atol=1e-7)
    assert step_streamed["grad_norm"] == pytest.approx(step_whole["grad_norm"], rel=1e-5)


def test_lr_schedule_steps_with_the_optimizer_and_survives_a_state_round_trip(checkpoint, tmp_path):
    # lr 1e-3, warmup 2 then linear decay to 0 at step 4: steps 0..3 use
    #   1e-3 * [1/2, 2/2, 1 - 0/2, 1 - 1/2] = [5e-4, 1e-3, 1e-3, 5e-4]
    train = TrainConfig(lr=1e-3, threads=1, lr_scheduler="linear", warmup_steps=2)
    engine = TrainerEngine(checkpoint, train, GrpoConfig(kl_coef=0.0), temperature=1.0, dtype="float32", seed=0,
                           chunk_size=64, total_steps=4)
    batch = on_policy(engine, make_batch(seed=7))
    used = []
    for step in range(4):
        if step == 2:
            engine.save_state(tmp_path / "mid")
        engine.train_micro_batch(batch, 1.0)
        used.append(engine.optimizer_step()["lr"])
    assert used == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4], rel=1e-12)
    engine.load_state(tmp_path / "mid")  # the schedule's position comes back with the state
    engine.train_micro_batch(batch, 1.0)
    assert engine.optimizer_step()["lr"] == pytest.approx(1e-3, rel=1e-12)


@pytest.mark.parametrize(("zero_stage", "grad_accum", "offload"),
                         [(0, "bf16", False), (0, "fp32", False), (2, "fp32", False), (0, "fp32", True)])
def test_grad_scale_equals_a_scaled_loss_under_bf16_optimizers(checkpoint, monkeypatch, zero_stage, grad_accum,
                                                               offload):
    """optimizer_step(grad_scale) reaches the gradients wherever DeepSpeed keeps them: the
    bf16 wrappers a GPU run gets (forced on here: fp16-style unfused for ZeRO 0 with bf16
    accumulation, the BF16 optimizer's fp32 accumulators for the default fp32
    accumulation, ZeRO 2's fp32 partitions, ZeRO-Offload's fp32 partitions in host
    memory stepped by torch's fused AdamW)."""
    force_bf16(monkeypatch)
    results = []
    for loss_scale, grad_scale in ((0.25, 1.0), (1.0, 0.25)):
        engine = build_engine_bf16(checkpoint, zero_stage, grad_accum, offload)
        batch = on_policy(engine, make_batch(seed=8))
        engine.train_micro_batch(batch, loss_scale)
        out = engine.optimizer_step(grad_scale)
        results.append((type(engine.engine.optimizer).__name__, out["grad_norm"], engine.state_dict_for_sync()))
    (name, norm_a, w_a), (_, norm_b, w_b) = results
    want = {(0, "bf16", False): "FP16_UnfusedOptimizer", (0, "fp32", False): "BF16_Optimizer",
            (2, "fp32", False): "DeepSpeedZeroOptimizer", (0, "fp32", True): "DeepSpeedZeroOptimizer"}
    assert name == want[(zero_stage, grad_accum, offload)]
    assert engine.engine.zero_cpu_offload() == offload
    assert bool(engine.engine.basic_optimizer.defaults.get("fused")) == offload  # torch's fused AdamW
    assert norm_a == pytest.approx(norm_b, rel=1e-6)
    assert all(torch.equal(w_a[n], w_b[n]) for n in w_a)


@pytest.mark.parametrize("offload", [False, True])
def test_warm_up_passes_leave_the_next_step_as_without_them(checkpoint, monkeypatch, offload):
    """The compile warm-up's zero-loss passes (``warm_up_passes``, run at set-up where
    blocks compile) through the bf16 optimizers a GPU run gets: the step after them
    updates the weights exactly as a fresh engine's does."""
    force_bf16(monkeypatch)
    weights = []
    for warm in (False, True):
        engine = build_engine_bf16(checkpoint, 0, "fp32", offload)
        batch = on_policy(engine, make_batch(seed=9))
        if warm:
            engine.warm_up_passes()
        engine.train_micro_batch(batch, 1.0)
        engine.optimizer_step()
        weights.append(engine.state_dict_for_sync())
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])


def test_bf16_run_accumulates_gradients_and_keeps_master_weights_in_fp32(checkpoint, monkeypatch, tmp_path):
    """A bf16 run (forced on CPU) by default: fp32 master weights, and a small piece's
    gradient added after a large one survives in the accumulators (bf16 keeps 8 bits of
    mantissa: 1e-3 of a gradient added to it would round away), state saved and reloaded."""
    force_bf16(monkeypatch)
    engine = build_engine_bf16(checkpoint, 0, "fp32")
    opt = engine.engine.optimizer
    assert type(opt).__name__ == "BF16_Optimizer"
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    assert {t.dtype for t in opt.fp32_groups_flat_partition} == {torch.float32}  # master weights
    assert {t.dtype for t in opt.fp32_groups_gradients_flat} == {torch.float32}  # accumulators
    big, small = on_policy(engine, make_batch(seed=11)), on_policy(engine, make_batch(seed=12))

    def accumulated() -> torch.Tensor:
        return torch.cat([g.detach().clone() for g in opt.fp32_groups_gradients_flat])

    engine.train_micro_batch(small, 1e-3)
    small_only = accumulated()
    engine.discard_gradients()
    assert accumulated().abs().max() == 0
    engine.train_micro_batch(big, 1.0)
    big_only = accumulated()
    engine.train_micro_batch(small, 1e-3)
    added = accumulated() - big_only
    # fp32: what was added is the small piece's gradient up to fp32 rounding of the sum
    # (|big| * 2^-24 ~ 6e-8 |big|); bf16 accumulation would be off by up to |big| * 2^-9.
    tol = float(big_only.abs().max()) * 2.0**-20
    assert float(small_only.abs().max()) > 100 * tol  # the test can tell the two apart
    torch.testing.assert_close(added, small_only, atol=tol, rtol=0)
    engine.optimizer_step()
    engine.save_state(tmp_path / "state")
    before = engine.state_dict_for_sync()
    engine.train_micro_batch(big, 1.0)
    engine.optimizer_step()
    engine.load_state(tmp_path / "state")
    assert all(torch.equal(before[n], t) for n, t in engine.state_dict_for_sync().items())


def force_bf16(monkeypatch) -> None:
    """Build DeepSpeed configs as on a GPU (bf16 on) while running on CPU."""
    import stages.trainer.engine as te

    real = te.build_deepspeed_config
    monkeypatch.setattr(te, "build_deepspeed_config", lambda train, dtype, has_gpu: real(train, dtype, True))


def build_engine_bf16(checkpoint, zero_stage: int, grad_accum: str = "fp32", offload: bool = False) -> TrainerEngine:
    train = TrainConfig(lr=1e-3, grad_clip=1.0, zero_stage=zero_stage, threads=1, grad_accum_dtype=grad_accum,
                        offload_optimizer=offload)
    return TrainerEngine(checkpoint, train, GrpoConfig(kl_coef=0.0), temperature=1.0, dtype="bfloat16", seed=0,
                         chunk_size=64)


SHM_PROBE = """
import deepspeed.comm.comm as ds_comm
import torch
from pipeline.config import TrainConfig
from stages.trainer.engine import build_deepspeed_engine

torch.manual_seed(0)
build_deepspeed_engine(torch.nn.Linear(4, 4), TrainConfig(threads=1), "float32")
print("shm_comm_op:", ds_comm.cdb.shm_comm_op)
"""


def test_a_lock_left_by_a_killed_build_does_not_stop_the_engine(tmp_path):
    # A process killed while DeepSpeed built its shared-memory op on this machine left
    # the build's lock file behind. A new engine starts anyway (DeepSpeed would wait on
    # that lock forever) and neither builds nor loads the op.
    ext = tmp_path / "torch_extensions"
    build_dir = ext / "deepspeed_shm_comm"  # torch builds in TORCH_EXTENSIONS_DIR/<name> when it is set
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext), "PYTHONPATH": str(REPO)}
    # This process's engines may hold the rendezvous port they chose: the probe picks its own.
    env.pop("MASTER_PORT", None)
    done = subprocess.run([sys.executable, "-c", SHM_PROBE], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)  # a guard against the hang, not a speed bound
    assert done.returncode == 0, done.stderr[-3000:]
    assert "shm_comm_op: None" in done.stdout, done.stdout[-2000:]
    assert sorted(p.name for p in build_dir.iterdir()) == ["lock"]  # nothing was built there


def _optimizer_moments(engine: TrainerEngine) -> list[torch.Tensor]:
    """Every tensor of the optimizer's state (Adam's moments and step counts), copied."""
    opt = getattr(engine.engine.optimizer, "optimizer", engine.engine.optimizer)
    return [v.detach().clone() for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]


def _poison(engine: TrainerEngine, batch: RolloutBatch, where: str) -> dict[str, float]:
    """Train ``batch`` with a non-finite loss (a NaN advantage) or, its loss finite, an
    infinite gradient (written into one parameter's accumulated gradient)."""
    if where == "loss":
        advantages = np.array(batch.advantages, dtype=np.float32)
        advantages[0, 0] = np.nan
        return engine.train_micro_batch(msgspec.structs.replace(batch, advantages=advantages), 1.0)
    metrics = engine.train_micro_batch(batch, 1.0)
    next(p for p in engine.module.parameters() if p.grad is not None).grad.view(-1)[0] = math.inf
    return metrics


@pytest.mark.parametrize(("zero_stage", "where"), [(0, "loss"), (0, "gradient"), (1, "loss")])
def test_a_nonfinite_step_is_not_applied(checkpoint, zero_stage, where):
    engine = build_engine(checkpoint, zero_stage=zero_stage)
    batch = on_policy(engine, make_batch(seed=5))
    engine.train_micro_batch(batch, 1.0)
    engine.optimizer_step()  # a first step: Adam's moments exist and are not zero
    batch = on_policy(engine, batch)
    version, ds_steps, sha, lr = engine.version, engine.engine.global_steps, engine.weights_sha256(), engine.engine.get_lr()
    moments = _optimizer_moments(engine)

    metrics = _poison(engine, batch, where)
    out = engine.optimizer_step()
    assert out["skipped_nonfinite"] == 1.0 and not math.isfinite(metrics["loss"] if where == "loss" else out["grad_norm"])
    # Nothing moved: weights (bit for bit), version, DeepSpeed's step count, lr, Adam's moments.
    assert (engine.version, engine.engine.global_steps, engine.weights_sha256()) == (version, ds_steps, sha)
    assert engine.engine.get_lr() == lr
    assert all(torch.equal(a, b) for a, b in zip(moments, _optimizer_moments(engine), strict=True))

    # The next step starts from clean gradients: finite, applied, version + 1.
    engine.train_micro_batch(batch, 1.0)
    out = engine.optimizer_step()
    assert out["skipped_nonfinite"] == 0.0 and math.isfinite(out["grad_norm"]) and engine.version == version + 1
    assert engine.weights_sha256() != sha


def test_a_saved_state_is_the_size_the_disk_plan_counts(engine, tmp_path):
    """``pipeline.placement.estimate_checkpoint_bytes``, which refuses a run whose
    checkpoints do not fit its disk, against a state DeepSpeed wrote: float32 weights
    and Adam's two moments, 12 bytes a parameter, plus the pickles' own few KiB."""
    from pipeline.config import decode_config
    from pipeline.memory.admission import ModelShape
    from pipeline.placement import estimate_checkpoint_bytes

    batch = on_policy(engine, make_batch(seed=5))
    engine.train_micro_batch(batch, 1.0)
    engine.optimizer_step()  # Adam's moments exist from the first step on
    engine.save_state(tmp_path / "state")
    written = sum(f.stat().st_size for f in (tmp_path / "state").rglob("*") if f.is_file())
    params = sum(p.numel() for p in engine.module.parameters())
    shape = ModelShape(num_layers=1, num_kv_heads=1, head_dim=1, hidden_size=1, vocab_size=1, num_params=params,
                       dtype_bytes=4)
    expected = estimate_checkpoint_bytes(decode_config({"model": {"dtype": "float32"}}), shape)
    assert expected == 12 * params
    assert expected <= written <= expected + (256 << 10), (written, expected)
