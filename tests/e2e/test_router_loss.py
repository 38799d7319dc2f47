"""``train.router_aux_loss_coef`` on the tiny mixtures of experts with real DeepSpeed on CPU.

A batch whose rewards are all equal has zero GRPO advantages, so its policy loss has no
gradient: whatever the optimizer does is the router's load-balancing loss. The routers
are first skewed so that nearly every token picks expert 0 (its row of each router
pushed along the layer's mean input), then the loss alone has to even them out again.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.config import TinyModelConfig, TrainConfig
from pipeline.types import Prompt, RolloutBatch
from stages.algorithms import assign_advantages
from stages.algorithms.grpo import GrpoConfig
from stages.models.logprobs import build_model_inputs
from stages.models.tiny import ensure_tiny_checkpoint
from stages.trainer.engine import TrainerEngine

PROMPTS, GROUP, PROMPT_LEN, COMPLETION = 4, 8, 12, 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("models")
    return {arch: ensure_tiny_checkpoint(TinyModelConfig(architecture=arch), root)
            for arch in ("qwen3_moe", "mixtral", "llama")}


def build(path, coef: float) -> TrainerEngine:
    train = TrainConfig(lr=1e-3, grad_clip=1.0, threads=1, router_aux_loss_coef=coef)
    return TrainerEngine(path, train, GrpoConfig(kl_coef=0.0), temperature=1.0, dtype="float32", seed=0, chunk_size=16)


def flat_batch(engine: TrainerEngine) -> RolloutBatch:
    """32 samples of random tokens, every reward 1 (zero advantages), uneven lengths so
    padding is part of every forward pass."""
    rng = np.random.default_rng(0)
    vocab = engine.module.config.vocab_size
    num = PROMPTS * GROUP
    completion_lens = rng.integers(COMPLETION // 2, COMPLETION + 1, num).astype(np.int32)
    completion_ids = rng.integers(1, vocab, (num, COMPLETION)).astype(np.int32)
    completion_ids[np.arange(COMPLETION)[None, :] >= completion_lens[:, None]] = 0
    batch = RolloutBatch(
        batch_id=1, step=0, prompts=[Prompt(prompt_id=f"p{g}", text="") for g in range(PROMPTS)], group_size=GROUP,
        sample_ids=[f"p{i // GROUP}-{i % GROUP}" for i in range(num)],
        prompt_ids=np.repeat(rng.integers(1, vocab, (PROMPTS, PROMPT_LEN)), GROUP, axis=0).astype(np.int32),
        prompt_lens=np.full(num, PROMPT_LEN, np.int32), completion_ids=completion_ids,
        completion_lens=completion_lens, completions=[""] * num,
        behaviour_logprobs=np.zeros((num, COMPLETION), np.float32),
        token_versions=np.zeros((num, COMPLETION), np.int32), policy_version=0, rewards=np.ones(num, np.float32),
    )
    return assign_advantages(batch, engine.algo)


def weights(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def routers(engine: TrainerEngine) -> list[torch.nn.Module]:
    found = [m for m in engine.module.modules() if type(m).__name__.endswith("TopKRouter")]
    assert found, "no router modules in the tiny mixture of experts"
    return found


def run_routers(engine: TrainerEngine, batch: RolloutBatch, hook: str) -> tuple[torch.Tensor, list[tuple]]:
    """(the real-token mask of the flattened rows, what ``hook`` saw at each router: its
    args or outputs), one forward pass over ``batch`` without gradients."""
    ids, mask, _, _ = build_model_inputs(batch)
    seen: list[tuple] = []
    register = {"pre": lambda m: m.register_forward_pre_hook(lambda _m, args: seen.append(args)),
                "post": lambda m: m.register_forward_hook(lambda _m, _a, out: seen.append(out))}[hook]
    handles = [register(m) for m in routers(engine)]
    try:
        with torch.no_grad():
            engine.module(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return mask.reshape(-1).bool(), seen


def skew_to_expert_0(engine: TrainerEngine, batch: RolloutBatch) -> None:
    real, inputs = run_routers(engine, batch, "pre")
    with torch.no_grad():
        for router, args in zip(routers(engine), inputs, strict=True):
            rows = args[0].reshape(-1, args[0].shape[-1])[real]
            mean = rows.mean(dim=0)
            router.weight[0] += 4.0 * mean / (mean @ mean)


def expert_0_share(engine: TrainerEngine, batch: RolloutBatch) -> float:
    """Share of real tokens with expert 0 among their picks, over all layers."""
    real, outputs = run_routers(engine, batch, "post")
    picks = torch.cat([out[2].reshape(-1, out[2].shape[-1])[real] for out in outputs])
    return float((picks == 0).any(dim=-1).float().mean())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_router_loss_alone_evens_out_skewed_routing(models, arch):
    engine = build(models[arch], 1.0)
    batch = flat_batch(engine)
    assert not np.asarray(batch.advantages).any()
    skew_to_expert_0(engine, batch)
    skewed = expert_0_share(engine, batch)
    assert skewed > 0.9
    losses = []
    for _ in range(5):
        metrics = engine.train_micro_batch(batch, 1.0)
        losses.append(metrics["router_aux_loss"])
        engine.optimizer_step()
    # 4 experts, 2 picks a token: the loss is 2 when routing is even, up to 4 when one
    # expert is in every pick with all the probability.
    assert losses[0] > 3.0 and losses[-1] < 0.8 * losses[0], losses
    assert expert_0_share(engine, batch) < skewed - 0.2
    assert metrics["loss"] == pytest.approx(metrics["pg_loss"] + losses[-1], abs=1e-5)


def test_without_the_coefficient_the_same_batch_moves_nothing(models):
    engine = build(models["qwen3_moe"], 0.0)
    batch = flat_batch(engine)
    skew_to_expert_0(engine, batch)
    before = weights(engine)
    metrics = engine.train_micro_batch(batch, 1.0)
    engine.optimizer_step()
    assert "router_aux_loss" not in metrics
    after = weights(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_a_model_without_a_router_refuses_the_coefficient(models):
    with pytest.raises(ValueError, match="train.router_aux_loss_coef: 0.5 needs a mixture of experts; "
                                         "LlamaForCausalLM at .* has no router"):
        build(models["llama"], 0.5)
