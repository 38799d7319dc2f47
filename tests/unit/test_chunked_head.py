"""The chunked output head of stages/models/logprobs.py against the dense computation: the same
log-probs, entropies and gradients, for every tiny family (tied and untied embeddings,
Gemma's soft-capping), with no more than ``chunk_tokens`` rows of logits at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.config import TinyModelConfig
from stages.models.logprobs import build_model_inputs, find_chunkable_head, forward_completion_logprobs
from tests.unit.test_logprobs import make_batch

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "qwen3_moe", "mixtral"]


def build(architecture: str, **config) -> torch.nn.Module:
    from stages.models.tiny import build_char_tokenizer, build_tiny_model

    torch.set_num_threads(1)
    cfg = TinyModelConfig(architecture=architecture, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                          head_dim=16, intermediate_size=64, max_position_embeddings=64, seed=5)
    model = build_tiny_model(cfg, build_char_tokenizer(architecture))
    for key, value in config.items():
        setattr(model.config, key, value)
    return model.train()


def run(model, inputs, chunk_tokens: int, temperature: float = 0.8):
    """(log-probs, entropy, gradient of every parameter) of the masked log-prob sum."""
    model.zero_grad()
    entropy: list[torch.Tensor] = []
    logp = forward_completion_logprobs(model, *inputs, temperature=temperature, entropy_out=entropy,
                                       chunk_tokens=chunk_tokens)
    # Weights per token, so that every row's gradient is checked, not only their sum.
    weights = torch.linspace(0.5, 1.5, logp.numel()).view_as(logp)
    (logp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy[0], grads


@pytest.mark.parametrize("architecture", FAMILIES)
def test_chunked_head_equals_the_dense_head(architecture):
    model = build(architecture)
    assert find_chunkable_head(model) is not None
    # 6 samples, 24 real completion tokens: chunks of 5 rows cut through samples.
    batch = make_batch([4, 4, 1, 1, 7, 7], [5, 0, 9, 2, 3, 5], group_size=2, seed=11)
    inputs = build_model_inputs(batch)
    dense = run(model, inputs, chunk_tokens=0)
    chunked = run(model, inputs, chunk_tokens=5)
    np.testing.assert_allclose(chunked[0].numpy(), dense[0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(chunked[1].numpy(), dense[1].numpy(), rtol=1e-5, atol=1e-5)
    assert chunked[2].keys() == dense[2].keys()
    for name, grad in dense[2].items():
        torch.testing.assert_close(chunked[2][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert (chunked[0][batch.completion_lens[:, None] <= np.arange(chunked[0].shape[1])[None, :]] == 0).all()


def test_soft_capping_is_applied_once_and_the_config_restored():
    # A cap of 0.5 bites hard on logits of size ~1: applied twice or not at all, the
    # log-probs would differ from the dense head's by far more than rounding.
    model = build("gemma3", final_logit_softcapping=0.5)
    inputs = build_model_inputs(make_batch([3, 3], [6, 4], group_size=2, seed=12))
    dense = run(model, inputs, chunk_tokens=0)
    chunked = run(model, inputs, chunk_tokens=4)
    np.testing.assert_allclose(chunked[0].numpy(), dense[0].numpy(), rtol=1e-5, atol=1e-5)
    assert model.config.final_logit_softcapping == 0.5
    assert "forward" not in vars(model.lm_head)  # the head's own forward is back


def test_no_more_than_chunk_tokens_rows_of_logits_exist(monkeypatch):
    model = build("qwen3")
    head = model.get_output_embeddings()
    rows: list[int] = []
    linear = torch.nn.functional.linear

    def recording_linear(x, weight, bias=None):
        if weight is head.weight:
            rows.append(x.reshape(-1, x.shape[-1]).shape[0])
        return linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", recording_linear)
    batch = make_batch([4, 4, 2, 2], [9, 7, 8, 6], group_size=2, seed=13)  # 30 completion tokens
    run(model, build_model_inputs(batch), chunk_tokens=8)
    # Forward: 8, 8, 8, 6 rows; backward recomputes each chunk once more.
    assert sorted(rows) == sorted([8, 8, 8, 6] * 2)


def test_a_head_with_its_own_scale_takes_the_dense_path():
    model = build("llama")
    model.config.model_type = "cohere"  # a family whose head multiplies by logit_scale
    assert find_chunkable_head(model) is None
