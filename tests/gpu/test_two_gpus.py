"""Two GPUs: a two-rank trainer, a tensor-parallel (TP 2) vLLM engine, two rollout
replicas. Not in ``run.sh``'s default list (the default machine has one GPU); on a
machine with two or more: ``bash tests/gpu/run.sh tests/gpu/test_two_gpus.py``.

Every test asserts that two GPUs are visible: on fewer it fails, it is never skipped.
The runs go through the command line in a subprocess, as a user starts them, with
``configs/gpu_small.yaml`` (268.7M parameters, bf16) cut to a few steps.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from pipeline.metrics import read_metrics
from pipeline.placement import detect_gpus
from pipeline.weights import build_payload, fingerprints_match
from tests.gpu.test_engines_gpu import MODEL, perturbed_state
from tests.gpu.test_pipeline_gpu import LOG_DIR, ROOT, _conveyor

GPU_SMALL = ROOT / "configs" / "gpu_small.yaml"
STEPS = 8


@pytest.fixture(scope="module")
def two_gpus() -> int:
    count, _ = detect_gpus(None)  # nvidia-smi: no CUDA context in this process
    assert count >= 2, f"these tests need 2 GPUs, {count} visible (CUDA_VISIBLE_DEVICES respected)"
    return count


def _launch_small(tmp_path, name: str, *overrides: str) -> tuple[dict, list[dict], str]:
    run_dir = tmp_path / name
    done = _conveyor("launch", "--config", str(GPU_SMALL), f"run.dir={run_dir}", f"run.steps={STEPS}",
                     "run.progress=false", "train.checkpoint_every=4", *overrides, log=LOG_DIR / f"{name}.log")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary, read_metrics(run_dir / "metrics.jsonl"), done.stdout


def _assert_complete(summary: dict, rows: list[dict], workers: int) -> None:
    s = summary["samples"]
    assert s["reconciles"] and s["in_flight"] == 0 and s["trained"] == STEPS * 32 * 8
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert summary["accounting"]["reconciles"]
    # Every rollout replica took every version it was sent and read it back.
    assert len(summary["served"]) == workers, summary["served"]
    for worker, state in summary["served"].items():
        assert state["version"] == summary["policy_version"] == STEPS, (worker, state)
        assert state["verified"], worker


def test_two_trainer_ranks_train_gpu_small_on_two_gpus(two_gpus, tmp_path):
    """train.num_ranks=2: rank 0 (with the rollout) on GPU 0, rank 1 on GPU 1, NCCL
    between them; the weights go out from rank 0 and every version is served."""
    summary, rows, _ = _launch_small(tmp_path, "two_ranks", "train.num_ranks=2")
    _assert_complete(summary, rows, workers=1)
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    assert len(set(summary["trainer"]["rank_devices"])) == 2, summary["trainer"]  # a GPU each
    assert summary["trainer"]["weight_transport"] == "shm"  # two GPUs: not one shared by all
    run_dir = tmp_path / "two_ranks"
    assert "trainer_ranks" in (run_dir / "logs" / "trainer.log").read_text()
    assert (run_dir / "logs" / "trainer-rank1.log").exists()
    final = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    # bf16 on a GPU: DeepSpeed names them bf16_zero_pp_rank_<r>_mp_rank_00_optim_states.pt.
    ranks = {re.search(r"zero_pp_rank_(\d+)_", p.name).group(1) for p in final.rglob("*zero_pp_rank_*")}
    assert ranks == {"0", "1"}, ranks


def test_two_rollout_replicas_each_serve_every_version(two_gpus, tmp_path):
    """rollout.num_workers=2 with one trainer rank: the replicas on GPU 0, the trainer
    on GPU 1; the weights (shm transport across GPUs) reach both replicas every step."""
    summary, rows, _ = _launch_small(tmp_path, "two_replicas", "rollout.num_workers=2")
    _assert_complete(summary, rows, workers=2)
    assert summary["trainer"]["weight_transport"] == "shm"


def test_tensor_parallel_engine_loads_new_weights_and_generates_with_them(two_gpus, tmp_path):
    """A vLLM engine with tensor_parallel_size 2 (one worker process per GPU) loads a
    published payload in both workers: the live fingerprint, folded over the ranks'
    shards, equals the payload's, and generation after it is tagged with its version."""
    from stages.models.tiny import ensure_tiny_checkpoint

    checkpoint = ensure_tiny_checkpoint(MODEL, tmp_path / "models")
    asyncio.run(_exercise_tp_engine(checkpoint))


async def _exercise_tp_engine(checkpoint) -> None:
    import torch

    from pipeline.config import RolloutConfig
    from stages.rollout import build_backend
    from stages.rollout.base import SamplingSettings

    cfg = RolloutConfig(backend="vllm", tensor_parallel_size=2, gpu_memory_utilization=0.3, seed=0)
    backend = build_backend("vllm", checkpoint, cfg, "bfloat16")
    await backend.start()
    sampling = SamplingSettings(n=4, temperature=1.0, max_tokens=8, seed=1)
    try:
        before = await backend.live_fingerprint()
        for version in (1, 2):
            state = perturbed_state(checkpoint, 1.0 + version / 50, torch.device("cpu"))
            data, _, fp = build_payload(state)
            assert not fingerprints_match(before, fp)
            live = await backend.update_weights(data, version)
            assert fingerprints_match(live, fp), (live, fp)
            assert fingerprints_match(await backend.live_fingerprint(), fp)
            assert backend.version == version
            out = await backend.generate([[1, 5, 6, 7]], sampling)
            assert len(out[0].completions) == 4
            assert all(v == version for c in out[0].completions for v in c.token_versions)
    finally:
        await backend.shutdown()
