"""Every common decoder family end to end on CPU: vLLM rollout with weight sync read
back every step, reference, DeepSpeed trainer, and a checkpoint out that transformers
and vLLM load.

Each family is a tiny random-init checkpoint built locally with transformers' own config
class (``stages/tiny.py``: tied and untied embeddings, q/k/v bias, q/k norms, GQA,
fused projections, soft-capping, byte-level BPE and char tokenizers, several stop
tokens). A few steps each: what is tested is that the weights the trainer publishes
are, bit for bit, the weights the engine serves, for every family's parameter layout.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import RolloutConfig, load_config
from pipeline.launch import launch_run
from pipeline.weights import compute_fingerprint, fingerprints_match
from stages.rollout import build_backend
from stages.rollout.base import SamplingSettings
from stages.tiny import FAMILIES

QUICKSTART = Path(__file__).parents[2] / "configs" / "quickstart.yaml"
STEPS = 3


def score_digit_share(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A dense reward (the share of digits in the completion), so that every step of a
    random-init model has non-zero advantages and really changes the weights."""
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_run(request, ray_cluster, tmp_path_factory):
    arch = request.param
    run_dir = tmp_path_factory.mktemp(f"arch-{arch}")
    cfg = load_config(QUICKSTART, [
        f"run.dir={run_dir}", "run.progress=false", "run.tensorboard=false", f"run.steps={STEPS}",
        f"model.tiny.architecture={arch}", f"model.cache_dir={run_dir / 'models'}",
        "rollout.max_tokens=4", "rollout.temperature=1.0", "train.sync_interval=1", "train.weight_sync_monitor=true",
        "reward.function=tests.e2e.test_architectures:score_digit_share",
    ])
    summary = launch_run(cfg)
    return arch, run_dir, summary


def test_family_trains_with_every_update_read_back(family_run):
    arch, run_dir, summary = family_run
    assert summary["steps"] == STEPS, arch
    assert summary["samples"]["trained"] == STEPS * 8 * 8
    assert summary["samples"]["dropped"] == {}
    assert summary["served"], f"{arch}: no rollout worker confirmed an update"
    for worker, state in summary["served"].items():
        assert state["version"] == STEPS, (arch, worker)
        assert state["verified"], (arch, worker)
    # Every step moved the weights, so each read-back compared new numbers.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["actor/grad_norm"] > 0 for r in rows), arch


def test_checkpoint_is_the_served_policy_and_vllm_loads_it(family_run):
    """The exported checkpoint holds exactly the weights the rollout engine served at
    the end (same fingerprint), transformers and vLLM load it, and generation stops on
    every stop token the family's generation config lists."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    arch, run_dir, summary = family_run
    ckpt = run_dir / "checkpoint"
    (served,) = [tuple(s["fingerprint"]) for s in summary["served"].values()]
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert fingerprints_match(compute_fingerprint(model.parameters()), served), arch
    tensors = load_file(ckpt / "model.safetensors")
    assert fingerprints_match(compute_fingerprint(tensors.values()), served), arch

    tok = AutoTokenizer.from_pretrained(ckpt)
    stops = GenerationConfig.from_pretrained(ckpt).eos_token_id
    stops = {stops} if isinstance(stops, int) else set(stops)
    assert tok.eos_token_id in stops and len(stops) == max(1, len(FAMILIES[arch].stops))

    async def generate_with_vllm():
        # Its engine core in a process of its own: in this one it would join (and end)
        # the torch.distributed world the DeepSpeed engines of later tests use.
        backend = build_backend("vllm", ckpt, RolloutConfig(kv_cache_gib=0.25, seed=0, engine_core="subprocess"),
                                "float32")
        await backend.start()
        try:
            live = await backend.live_fingerprint()
            prompts = [tok(f"{d}{d}=", add_special_tokens=True)["input_ids"] for d in range(8)]
            results = await backend.generate(prompts, SamplingSettings(n=8, temperature=1.0, max_tokens=32))
        finally:
            await backend.shutdown()
        return live, results

    live, results = asyncio.run(generate_with_vllm())
    assert fingerprints_match(live, served), arch
    ends = [c.token_ids[-1] for r in results for c in r.completions if c.finish_reason == "stop"]
    assert ends and set(ends) <= stops, (arch, set(ends), stops)
    assert set(ends) == stops, f"{arch}: generation never ended on some stop token ({set(ends)} vs {stops})"
