"""The real engines on a GPU: DeepSpeed in bf16, vLLM and HF rollout backends with
weight sync verified over both transports (shm bytes and cuda_ipc handles)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from pipeline.config import GrpoConfig, RolloutConfig, TinyModelConfig, TrainConfig
from pipeline.transport import CudaIpcExporter
from pipeline.weights import WeightSyncError, build_payload, fingerprints_match
from stages.algorithms import assign_advantages
from stages.rollout import build_backend
from stages.rollout.base import SamplingSettings
from stages.tiny import ensure_tiny_checkpoint
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
    from stages.trainer_engine import TrainerEngine

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
