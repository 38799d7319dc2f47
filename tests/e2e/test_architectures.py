"""Every common decoder family end to end on CPU: vLLM rollout with weight sync read
back every step, reference, DeepSpeed trainer, and a checkpoint out that transformers
and vLLM load.

Each family is a tiny random-init checkpoint built locally with transformers' own config
class (``stages/models/tiny.py``: tied and untied embeddings, q/k/v bias, q/k norms, GQA,
fused projections, soft-capping, mixtures of experts, byte-level BPE and char
tokenizers, several stop tokens). A few steps each: what is tested is that the weights the trainer publishes
are, bit for bit, the weights the engine serves, for every family's parameter layout.

The whole matrix is the ``slow`` tier (``pytest -m slow``); a plain ``pytest`` runs
``FAST_FAMILIES`` only: qwen3_moe has the most unusual layout (experts held as 3D
tensors and named one at a time outside, q/k norms, untied embeddings, byte-level BPE,
two stop tokens), while the default llama family runs in every other e2e test.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import RolloutConfig, load_config
from pipeline.launch import launch_run
from pipeline.weights import compute_fingerprint, fingerprints_match
from stages.models.tiny import FAMILIES
from stages.rollout import build_backend
from stages.rollout.base import SamplingSettings

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
STEPS = 3
FAST_FAMILIES = ("qwen3_moe",)
SLOW = pytest.mark.slow


def family_params() -> list:
    """One parameter per family, ids by name; those outside ``FAST_FAMILIES`` are slow."""
    return [pytest.param(arch, id=arch, marks=() if arch in FAST_FAMILIES else SLOW) for arch in sorted(FAMILIES)]


def score_digit_share(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A dense reward (the share of digits in the completion), so that every step of a
    random-init model has non-zero advantages and really changes the weights."""
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))


@pytest.fixture(scope="module")
def family_runs(ray_cluster, tmp_path_factory):
    """``run(arch)``: that family's run (run_dir, summary), launched on first use."""
    runs: dict[str, tuple[Path, dict]] = {}

    def run(arch: str) -> tuple[Path, dict]:
        if arch not in runs:
            run_dir = tmp_path_factory.mktemp(f"arch-{arch}")
            cfg = load_config(QUICKSTART, [
                f"run.dir={run_dir}", "run.progress=false", "run.tensorboard=false", f"run.steps={STEPS}",
                f"model.tiny.architecture={arch}", f"model.cache_dir={run_dir / 'models'}",
                "rollout.max_tokens=4", "rollout.temperature=1.0", "train.sync_interval=1",
                "train.weight_sync_monitor=true", "reward.function=tests.e2e.test_architectures:score_digit_share",
                # The mixtures of experts also train their routers' load balance.
                *(["train.router_aux_loss_coef=0.01"] if FAMILIES[arch].moe_experts else []),
            ])
            runs[arch] = (run_dir, launch_run(cfg))
        return runs[arch]

    return run


@pytest.mark.parametrize("arch", family_params())
def test_family_trains_with_every_update_read_back(family_runs, arch):
    run_dir, summary = family_runs(arch)
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
    # The fingerprint cannot see a permutation (an expert's rows put in another expert):
    # the log-probs can. Step 0 trains tokens the engine sampled with the very weights
    # being trained, so the trainer's log-probs must be the engine's up to float32 kernels.
    assert abs(rows[0]["actor/ratio_mean"] - 1.0) < 1e-3, (arch, rows[0]["actor/ratio_mean"])
    assert rows[0]["actor/logp_mismatch"] < 1e-3, (arch, rows[0]["actor/logp_mismatch"])
    # 4 experts, 2 picks a token: 2 when routing is even, at most 4.
    aux = [r.get("actor/router_aux_loss") for r in rows]
    if FAMILIES[arch].moe_experts:
        assert all(1.0 < a <= 4.0 + 1e-6 for a in aux), (arch, aux)
    else:
        assert aux == [None] * STEPS, (arch, aux)


def served_fingerprint(summary: dict) -> tuple:
    (served,) = [tuple(s["fingerprint"]) for s in summary["served"].values()]
    return served


def checkpoint_stops(ckpt: Path) -> set[int]:
    from transformers import GenerationConfig

    stops = GenerationConfig.from_pretrained(ckpt).eos_token_id
    return {stops} if isinstance(stops, int) else set(stops)


@pytest.mark.parametrize("arch", family_params())
def test_checkpoint_is_the_served_policy(family_runs, arch):
    """The exported checkpoint holds exactly the weights the rollout engine served at
    the end (same fingerprint), transformers loads it, and its tokenizer and generation
    config agree on the family's stop tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, summary = family_runs(arch)
    ckpt, served = run_dir / "checkpoint", served_fingerprint(summary)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert fingerprints_match(compute_fingerprint(model.parameters()), served), arch
    tensors = load_file(ckpt / "model.safetensors")
    assert fingerprints_match(compute_fingerprint(tensors.values()), served), arch
    stops = checkpoint_stops(ckpt)
    assert AutoTokenizer.from_pretrained(ckpt).eos_token_id in stops
    assert len(stops) == max(1, len(FAMILIES[arch].stops)), arch


@pytest.mark.parametrize("archs", [
    pytest.param(FAST_FAMILIES, id="fast"),
    pytest.param(tuple(sorted(set(FAMILIES) - set(FAST_FAMILIES))), id="others", marks=SLOW),
])
def test_vllm_serves_every_familys_checkpoint(family_runs, archs):
    """vLLM loads each family's exported checkpoint with the served weights (same live
    fingerprint), and its generation stops on every stop token the family lists. One
    subprocess loads them one after another, each engine core in that process: in this
    one it would join (and end) the torch.distributed world later tests' DeepSpeed
    engines use, and one vLLM import serves them all."""
    runs = {arch: family_runs(arch) for arch in archs}
    ckpts = [str(run_dir / "checkpoint") for run_dir, _ in runs.values()]
    out = subprocess.run([sys.executable, "-m", "tests.e2e.test_architectures", *ckpts],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("served: ")]
    served_by = json.loads(line.removeprefix("served: "))
    assert sorted(served_by) == sorted(ckpts)
    for arch, (run_dir, summary) in runs.items():
        ckpt = run_dir / "checkpoint"
        live, ends = served_by[str(ckpt)]
        assert fingerprints_match(tuple(live), served_fingerprint(summary)), arch
        stops = checkpoint_stops(ckpt)
        assert ends and set(ends) <= stops, (arch, set(ends), stops)
        assert set(ends) == stops, f"{arch}: generation never ended on some stop token ({set(ends)} vs {stops})"


async def serve_checkpoints(ckpts: list[str]) -> dict[str, tuple[list, list[int]]]:
    """For each checkpoint, one after another: vLLM's live fingerprint after loading it,
    and the last token of every completion that stopped (8 prompts x 8 samples)."""
    from transformers import AutoTokenizer

    served = {}
    for ckpt in ckpts:
        tok = AutoTokenizer.from_pretrained(ckpt)
        # A quarter GiB of cache holds 8 x 8 short sequences, not one of a real model's
        # published context length (tens of thousands of tokens): the serving length is the job's.
        # Eager: what is checked is the checkpoint's weights. On a GPU a compile of its own
        # (float32: a cache entry of its own) would check nothing more, and a cold compile
        # is most of an engine's start (docs/performance/real-shapes.md).
        cfg = RolloutConfig(kv_cache_gib=0.25, seed=0, engine_core="in_process", max_model_len=256, enforce_eager=True)
        backend = build_backend("vllm", Path(ckpt), cfg, "float32")
        await backend.start()
        try:
            live = await backend.live_fingerprint()
            prompts = [tok(f"{d}{d}=", add_special_tokens=True)["input_ids"] for d in range(8)]
            results = await backend.generate(prompts, SamplingSettings(n=8, temperature=1.0, max_tokens=32))
        finally:
            await backend.shutdown()
        served[ckpt] = (list(live), [c.token_ids[-1] for r in results for c in r.completions
                                     if c.finish_reason == "stop"])
    return served


if __name__ == "__main__":  # test_vllm_serves_every_familys_checkpoint's subprocess
    print("served: " + json.dumps(asyncio.run(serve_checkpoints(sys.argv[1:]))), flush=True)
