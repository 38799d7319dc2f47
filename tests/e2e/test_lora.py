"""LoRA (``model.lora``) on the tiny Llama: real peft, DeepSpeed on CPU, vLLM (CPU) and
transformers rollouts.

The adapters target ``q_proj``, ``v_proj`` and ``up_proj`` only, so a sync must send
whole layers that vLLM fuses (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``)
while leaving others (the embeddings, the head, the norms) out. One engine serves the
module; each test starts from its current state. The vLLM rollout is the session's
(``shared_vllm``, tests/e2e/conftest.py: test_rollout_backends drives it too).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

# peft comes with the cpu extra (install.sh cpu); a missing peft fails here, not skips.
import peft
import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import LoraConfig, RolloutConfig, TinyModelConfig, TrainConfig
from pipeline.metrics import read_metrics
from pipeline.weights import (
    REST_FINGERPRINT_KEY,
    WeightSyncError,
    compute_fingerprint,
    deserialize_weights,
    encode_rest_fingerprint,
    fingerprints_match,
    read_payload_metadata,
    serialize_weights,
)
from stages.algorithms import assign_advantages
from stages.algorithms.grpo import GrpoConfig
from stages.models.tiny import ensure_tiny_checkpoint
from stages.rollout import build_backend
from stages.rollout.base import SamplingSettings
from stages.trainer.engine import TrainerEngine, load_state_file
from tests.e2e.test_rollout_backends import LOGPROB_ATOL, PROMPTS, recompute_logprobs
from tests.e2e.test_trainer_engine import make_batch

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"])
TARGETS = ("q_proj", "v_proj", "up_proj")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return ensure_tiny_checkpoint(TinyModelConfig(), tmp_path_factory.mktemp("lora-models"))


def build_engine(checkpoint, lora: LoraConfig = LORA) -> TrainerEngine:
    return TrainerEngine(checkpoint, TrainConfig(lr=2e-2, threads=1), GrpoConfig(kl_coef=0.0), temperature=1.0,
                         dtype="float32", seed=0, lora=lora)


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = build_engine(checkpoint)
    for seed in (0, 1):  # two steps: after the first, B is no longer 0, so A moves too
        train_step(engine, seed)
    return engine


def train_step(engine: TrainerEngine, seed: int) -> dict[str, float]:
    batch = assign_advantages(make_batch(seed), engine.algo)
    engine.train_micro_batch(batch, 1.0)
    return engine.optimizer_step()


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def peft_merged(engine: TrainerEngine) -> torch.nn.Module:
    """peft's own merge of the engine's adapters, on a copy."""
    return copy.deepcopy(engine.peft_model).merge_and_unload().eval()


def test_only_the_adapters_train_and_the_base_stays_bit_identical(engine, checkpoint) -> None:
    before = {n: t.clone() for n, t in engine.module.state_dict().items()}
    out = train_step(engine, seed=2)
    assert out["skipped_nonfinite"] == 0.0
    after = engine.module.state_dict()
    changed = {n for n in after if not torch.equal(after[n], before[n])}
    adapters = {n for n in after if is_adapter(n)}
    # Every adapter of the 2 layers x 3 targets (A and B) moved, and nothing else did.
    assert changed == adapters and len(adapters) == 2 * len(TARGETS) * 2
    # The base equals the checkpoint on disk bit for bit, under its own names.
    base = {n.replace(".base_layer.", "."): t for n, t in after.items() if not is_adapter(n)}
    assert all(torch.equal(base[n], t) for n, t in load_file(checkpoint / "model.safetensors").items())
    # The optimizer holds the adapters alone: 4 * (in + out) per target, far below the model.
    in_optimizer = sum(p.numel() for g in engine.engine.optimizer.param_groups for p in g["params"])
    assert in_optimizer == sum(after[n].numel() for n in adapters)
    assert in_optimizer * 20 < sum(t.numel() for t in base.values())


def test_a_sync_sends_the_merged_layers_holding_adapters_and_names_the_rest(engine, checkpoint) -> None:
    data, _, published = engine.export_weights()
    payload = deserialize_weights(data)
    merged = peft_merged(engine).state_dict()
    # Whole attention and MLP blocks (the layers vLLM fuses), under the base model's names;
    # embeddings, norms and the head stay out.
    expected = {n for n in merged if ".self_attn." in n or ".mlp." in n}
    assert set(payload) == expected
    for name, tensor in payload.items():
        assert torch.equal(tensor, merged[name]), name  # W + scale * B @ A, as peft merges it
    assert any(not torch.equal(payload[n], t) for n, t in load_file(checkpoint / "model.safetensors").items()
               if n in payload and n.endswith(f"{TARGETS[0]}.weight"))
    # The published fingerprint is the whole merged model's; the rest is what the payload leaves out.
    rest = json.loads(read_payload_metadata(data)[REST_FINGERPRINT_KEY])
    assert fingerprints_match(tuple(rest), compute_fingerprint(t for n, t in merged.items() if n not in payload))
    assert fingerprints_match(published, compute_fingerprint(merged.values()))



def test_a_sleeping_rollout_gets_the_whole_merged_model_and_no_rest(engine, checkpoint) -> None:
    """``rollout.sleep_mode`` (colocated) discards the engine's weights while it sleeps,
    so the layers a partial payload leaves out would be undefined after it wakes: each
    sync then carries the whole merged model under the served names, with no rest."""
    engine.whole_syncs = True
    try:
        data, _, published = engine.export_weights()
    finally:
        engine.whole_syncs = False
    payload = deserialize_weights(data)
    merged = peft_merged(engine).state_dict()
    assert set(payload) == set(load_file(checkpoint / "model.safetensors"))  # every served name, ties once
    for name, tensor in payload.items():
        assert torch.equal(tensor, merged[name]), name
    assert REST_FINGERPRINT_KEY not in read_payload_metadata(data)
    assert fingerprints_match(published, compute_fingerprint(merged.values()))
    # Off again: the adapted layers alone, with their rest.
    assert REST_FINGERPRINT_KEY in read_payload_metadata(engine.export_weights()[0])

@pytest.fixture(scope="module")
def loop(rollout_loop):
    return rollout_loop


# vLLM is slow (about 30 s): the same payload and check on the HF backend run in every run; the GPU
# tier serves LoRA merged syncs on vLLM (tests/gpu/test_day_one_gpu.py).
@pytest.mark.parametrize("name", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_the_rollout_serves_the_trainers_merged_model_after_a_sync(engine, checkpoint, loop, shared_vllm, name) -> None:
    """Behaviour log-probs of the served model after a partial sync equal a transformers
    forward pass of peft's merged model: the partial payload landed, nothing else moved."""
    # vLLM's engine core in a process of its own (the session's engine): in this one it
    # would tear down the torch.distributed world the DeepSpeed engines of this module share.
    if name == "vllm":
        backend = shared_vllm.get()
    else:
        cfg = RolloutConfig(backend=name, kv_cache_gib=0.25, seed=0, engine_core="subprocess")
        backend = build_backend(name, checkpoint, cfg, "float32")
        loop.run_until_complete(backend.start())
    try:
        # The base model first, whole, whatever the engine served before: a partial payload's
        # rest (embeddings, norms, head) is the checkpoint's, and the engine checks it.
        base = load_file(checkpoint / "model.safetensors")
        loop.run_until_complete(backend.update_weights(serialize_weights(base), backend.version + 1))
        version = backend.version + 1
        data, _, published = engine.export_weights()
        live = loop.run_until_complete(backend.update_weights(data, version))
        assert fingerprints_match(live, published)
        sampling = SamplingSettings(n=4, temperature=1.0, max_tokens=6)
        results = loop.run_until_complete(backend.generate(PROMPTS, sampling))
        merged = peft_merged(engine)
        worst = 0.0
        for prompt, result in zip(PROMPTS, results, strict=True):
            for c in result.completions:
                assert set(c.token_versions) == {version}
                want = recompute_logprobs(merged, prompt, c.token_ids)
                worst = max(worst, float(np.abs(np.asarray(c.logprobs) - np.asarray(want)).max()))
        assert worst < LOGPROB_ATOL, worst
        # A partial payload whose rest is not what the engine holds is refused, not served.
        forged = serialize_weights(deserialize_weights(data), encode_rest_fingerprint((1.0, 1.0)))
        with pytest.raises(WeightSyncError):
            loop.run_until_complete(backend.update_weights(forged, version + 1))
    finally:
        if name != "vllm":
            loop.run_until_complete(backend.shutdown())


def test_state_holds_the_adapters_and_resumes_exactly(engine, checkpoint, tmp_path) -> None:
    engine.save_state(tmp_path / "state")
    files = [p for p in (tmp_path / "state").rglob("*.pt")]
    module = {}
    for path in files:
        module.update(load_state_file(str(path)).get("module") or {})
    assert module and all(is_adapter(n) for n in module)  # no frozen base in the state
    resumed = build_engine(checkpoint)
    resumed.load_state(tmp_path / "state")
    assert resumed.version == engine.version
    for one in (engine, resumed):
        train_step(one, seed=5)
    ours, theirs = engine.module.state_dict(), resumed.module.state_dict()
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)  # optimizer moments came back too


def test_a_state_of_other_adapters_is_refused(engine, checkpoint, tmp_path) -> None:
    engine.save_state(tmp_path / "state")
    other = build_engine(checkpoint, LoraConfig(rank=4, alpha=8.0, target_modules=["k_proj"]))
    with pytest.raises(ValueError, match="trainable parameters missing"):
        other.load_state(tmp_path / "state")


def test_export_writes_an_adapter_peft_loads_and_a_merged_model_transformers_loads(engine, checkpoint, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    out = engine.save_pretrained(tmp_path / "checkpoint", merged=True)
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert "model.safetensors" not in {p.name for p in out.iterdir()}  # the adapter alone
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]])
    with torch.no_grad():
        want = peft_merged(engine)(ids).logits
        base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        adapter = peft.PeftModel.from_pretrained(base, out).eval()
        torch.testing.assert_close(adapter(ids).logits, want, rtol=0, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
        torch.testing.assert_close(merged(ids).logits, want, rtol=0, atol=1e-5)
    assert not (out / "merged" / "adapter_config.json").exists()


def test_targets_the_model_lacks_are_refused(checkpoint) -> None:
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules"):
        build_engine(checkpoint, LoraConfig(rank=4, target_modules=["no_such_proj"]))


@pytest.mark.slow  # a 150-step launched run (several minutes on 2 cores)
def test_a_launched_lora_run_learns(ray_cluster, tmp_path) -> None:
    """The quickstart job with LoRA (only the adapters train, partial syncs verified each
    step) raises the reward; its checkpoint is the adapter."""
    from pipeline.config import load_config
    from pipeline.launch import launch_run

    cfg = load_config(REPO / "configs" / "quickstart.yaml",
                      [f"run.dir={tmp_path}", "run.progress=false", "run.tensorboard=false", "model.lora.rank=8",
                       "train.lr=2e-3"])
    summary = launch_run(cfg)
    assert summary["status"] == "completed"
    rows = read_metrics(tmp_path / "metrics.jsonl")
    rewards = np.array([r["reward/mean"] for r in rows if "reward/mean" in r])
    first, last = rewards[:10].mean(), rewards[-20:].mean()
    print(f"LoRA reward first 10 steps {first:.3f}, last 20 steps {last:.3f}")
    assert last > first + 0.2  # measured 0.008 -> 0.62 (docs/lora.md)
    assert (tmp_path / "checkpoint" / "adapter_model.safetensors").is_file()
    assert summary["served"]["rollout:0"]["verified"]  # every partial sync checked against the whole model

