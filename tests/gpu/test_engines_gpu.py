"""The real engines on a GPU: DeepSpeed in bf16, vLLM and HF rollout backends with
weight sync verified over both transports (shm bytes and cuda_ipc handles)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from pipeline.config import RolloutConfig, TinyModelConfig, TrainConfig
from pipeline.transport import CudaIpcExporter
from pipeline.weights import WeightSyncError, build_payload, fingerprints_match
from stages.algorithms import assign_advantages
from stages.algorithms.grpo import GrpoConfig
from stages.models.tiny import ensure_tiny_checkpoint
from stages.rollout import build_backend
from stages.rollout.base import SamplingSettings
from tests.e2e.test_trainer_engine import make_batch

# Big enough that a missed tensor would show, small enough to start in seconds.
MODEL = TinyModelConfig(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return ensure_tiny_checkpoint(MODEL, tmp_path_factory.mktemp("models"))


def perturbed_state(checkpoint, scale: float, device) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    return {n: (t * scale).to(device) for n, t in model.state_dict().items()}


def test_trainer_engine_steps_in_bf16_and_exports_both_ways(checkpoint, cuda):
    from stages.trainer.engine import TrainerEngine

    engine = TrainerEngine(checkpoint, TrainConfig(lr=1e-3, grad_clip=1.0), GrpoConfig(kl_coef=0.0),
                           temperature=1.0, dtype="bfloat16", seed=0)
    assert engine.weights_on_gpu and engine.engine.bfloat16_enabled()
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    before = {n: t.detach().clone() for n, t in engine.module.state_dict().items()}
    metrics = engine.train_micro_batch(assign_advantages(make_batch(0), engine.algo), 1.0)
    out = engine.optimizer_step()
    assert engine.version == 1 and torch.isfinite(torch.tensor(metrics["loss"])) and out["grad_norm"] > 0
    changed = sum(not torch.equal(before[n], t) for n, t in engine.module.state_dict().items())
    assert changed > len(before) // 2, f"only {changed} of {len(before)} tensors changed"
    _, _, fp_shm = engine.export_weights()
    _, _, fp_ipc = engine.export_weights_ipc()
    assert fingerprints_match(fp_shm, fp_ipc), (fp_shm, fp_ipc)


def test_compiled_blocks_train_as_the_eager_model_does(checkpoint, cuda):
    """``train.compile: auto`` on a GPU compiles every decoder layer in place: the same
    parameter names, log-probs and update as eager, up to the fused kernels' bf16
    rounding, and a batch of other lengths trains without a new graph failing."""
    from stages.models.logprobs import compute_completion_logprobs
    from stages.trainer.engine import TrainerEngine

    def build(mode: str) -> TrainerEngine:
        return TrainerEngine(checkpoint, TrainConfig(lr=1e-3, grad_clip=1.0, compile=mode), GrpoConfig(kl_coef=0.0),
                             temperature=1.0, dtype="bfloat16", seed=0)

    eager, compiled = build("off"), build("auto")
    assert (eager.compiled_blocks, compiled.compiled_blocks) == (0, MODEL.num_layers), compiled.compile_skipped
    assert "off" in eager.compile_skipped and compiled.compile_skipped == ""
    assert list(eager.module.state_dict()) == list(compiled.module.state_dict())
    batch = assign_advantages(make_batch(0), eager.algo)
    with torch.no_grad():
        lp_eager = compute_completion_logprobs(eager.engine, batch, chunk_size=64).float()
        lp_compiled = compute_completion_logprobs(compiled.engine, batch, chunk_size=64).float()
    assert lp_eager.abs().sum() > 0 and (lp_eager - lp_compiled).abs().max() < 0.1, (lp_eager - lp_compiled).abs().max()
    start = [t.detach().float().clone() for t in eager.module.parameters()]
    outs = []
    for engine in (eager, compiled):
        metrics = engine.train_micro_batch(batch, 1.0)
        outs.append((metrics["loss"], engine.optimizer_step()["grad_norm"]))
    (loss_e, norm_e), (loss_c, norm_c) = outs
    assert math.isclose(loss_e, loss_c, rel_tol=0.02, abs_tol=1e-3) and math.isclose(norm_e, norm_c, rel_tol=0.05), outs
    # Both took the same step: the weights differ far less from each other than from the
    # start (Adam's first step is about lr * sign(grad); only near-zero gradients may flip).
    apart = sum(float((a.float() - b.float()).abs().sum())
                for a, b in zip(eager.module.parameters(), compiled.module.parameters(), strict=True))
    moved = sum(float((a.float() - s).abs().sum()) for a, s in zip(eager.module.parameters(), start, strict=True))
    assert moved > 0 and apart < moved / 4, (apart, moved)
    other = assign_advantages(make_batch(1), compiled.algo)  # its longest sequence: 31 tokens, not 29
    assert max(other.prompt_lens + other.completion_lens) != max(batch.prompt_lens + batch.completion_lens)
    assert math.isfinite(compiled.train_micro_batch(other, 1.0)["loss"])


@pytest.mark.parametrize(("backend_name", "engine_core"),
                         [("vllm", "subprocess"), ("vllm", "in_process"), ("hf", "subprocess")])
def test_backend_weight_sync_over_both_transports(checkpoint, cuda, backend_name, engine_core):
    """Both transports into each backend; vLLM with its engine core in its own process
    and in the rollout's (``rollout.engine_core: in_process``)."""
    asyncio.run(_exercise_backend(checkpoint, cuda, backend_name, engine_core))


async def _exercise_backend(checkpoint, cuda, backend_name: str, engine_core: str) -> None:
    cfg = RolloutConfig(backend=backend_name, gpu_memory_utilization=0.3, seed=0, engine_core=engine_core)
    backend = build_backend(backend_name, checkpoint, cfg, "bfloat16")
    await backend.start()
    sampling = SamplingSettings(n=2, temperature=1.0, max_tokens=8, seed=1)
    try:
        out = await backend.generate([[1, 5, 6, 7]], sampling)
        assert len(out[0].completions) == 2
        # shm: safetensors bytes, as on CPU.
        state = perturbed_state(checkpoint, 1.01, cuda)
        data, _, fp = build_payload(state)
        live = await backend.update_weights(data, 1)
        assert fingerprints_match(live, fp), (live, fp)
        # cuda_ipc: buckets on this GPU; vLLM maps them in its engine process, HF (in
        # this process) resolves them to the exporter's own tensors.
        exporter = CudaIpcExporter(torch.bfloat16)
        times = []
        for version in (2, 3, 4):
            state = perturbed_state(checkpoint, 1.0 + version / 100, cuda)
            t0 = time.perf_counter()
            desc, fp = exporter.export(state, version)
            live = await backend.update_weights(desc, version)
            times.append(time.perf_counter() - t0)
            assert fingerprints_match(live, fp) and backend.version == version
            assert fingerprints_match(await backend.live_fingerprint(), fp)
        print(f"{backend_name} ({engine_core}): cuda_ipc publish+apply {[round(1e3 * t, 1) for t in times]} ms; paused "
              f"{round(1e3 * getattr(backend, 'last_pause_s', float('nan')), 1)} ms")
        out = await backend.generate([[1, 5, 6, 7]], sampling)
        assert all(v == 4 for c in out[0].completions for v in c.token_versions)
        # A slot rewritten after publishing (one slot, two exports) is refused before
        # loading: the engine keeps serving version 4.
        one = CudaIpcExporter(torch.bfloat16, slots=1)
        stale, _ = one.export(perturbed_state(checkpoint, 1.2, cuda), 5)
        one.export(perturbed_state(checkpoint, 1.3, cuda), 6)
        with pytest.raises(WeightSyncError):
            await backend.update_weights(stale, 5)
        assert backend.version == 4
        assert fingerprints_match(await backend.live_fingerprint(), fp)
        out = await backend.generate([[1, 5, 6, 7]], sampling)
        assert len(out[0].completions) == 2
    finally:
        await backend.shutdown()


def test_the_sampler_tap_reports_what_vllm_reports(checkpoint, cuda):
    """``rollout.sampler_tap: verify``: vLLM reports every sampled token's log-prob and the
    in-process engine checks each against the tap's. Prompts long enough that their
    prefill is chunked (rows that sample no token), and weight updates mid-generation
    whose keep-mode pause preempts every running request (tokens sampled in flight and
    discarded, then sampled again after the recompute)."""
    asyncio.run(_verify_sampler_tap(checkpoint, cuda))


async def _verify_sampler_tap(checkpoint, cuda) -> None:
    # Eager: a second in-process engine in this process (after the weight-sync test's)
    # failed its CUDA graph capture in PyTorch's allocator; the sampler runs outside the
    # graphs anyway (test_colocate_gpu runs the tap with them).
    cfg = RolloutConfig(backend="vllm", gpu_memory_utilization=0.3, seed=0, engine_core="in_process",
                        sampler_tap="verify", enforce_eager=True, engine_kwargs={"max_num_batched_tokens": 128})
    backend = build_backend("vllm", checkpoint, cfg, "bfloat16")
    await backend.start()
    try:
        assert backend._engine.sampler_tap, backend._engine.sampler_tap_unavailable
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(checkpoint).vocab_size
        prompts = [[3 + (7 * k + j) % (vocab - 3) for j in range(length)] for k, length in enumerate((4, 30, 150, 200))]
        sampling = SamplingSettings(n=8, temperature=1.0, max_tokens=48, seed=3)
        generating = asyncio.create_task(backend.generate(prompts, sampling))
        for version in (1, 2, 3):
            await asyncio.sleep(0.05)
            data, _, _ = build_payload(perturbed_state(checkpoint, 1.0 + version / 100, cuda))
            await backend.update_weights(data, version)
        out = await generating
        tokens = sum(len(c.token_ids) for r in out for c in r.completions)
        stats = backend.engine_stats()
        print(f"sampler tap verified: {stats}, tokens {tokens}, versions "
              f"{sorted({v for r in out for c in r.completions for v in c.token_versions})}")
        assert stats["tap_checked"] == tokens > 0
        assert stats["tap_max_abs_diff"] <= 1e-5
        assert all(math.isfinite(x) and x <= 0 for r in out for c in r.completions for x in c.logprobs)
    finally:
        await backend.shutdown()
