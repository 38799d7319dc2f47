"""stages/models/logprobs.py on a tiny random Llama: layout of the model inputs, and the
gathered log-probs against a plain per-sample loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.config import TinyModelConfig
from pipeline.types import Prompt, RolloutBatch
from stages.models.logprobs import build_model_inputs, compute_completion_logprobs, forward_completion_logprobs

VOCAB = 23


def make_batch(prompt_lens: list[int], completion_lens: list[int], group_size: int, seed: int = 0) -> RolloutBatch:
    """Random tokens in [1, VOCAB), right-padded with 0; arrays one column wider than
    needed so the code cannot rely on the array width being the longest length."""
    rng = np.random.default_rng(seed)
    num = len(prompt_lens)
    p_width, c_width = max(prompt_lens) + 1, max(completion_lens) + 1
    prompt_ids = rng.integers(1, VOCAB, (num, p_width)).astype(np.int32)
    completion_ids = rng.integers(1, VOCAB, (num, c_width)).astype(np.int32)
    prompt_ids[np.arange(p_width)[None, :] >= np.array(prompt_lens)[:, None]] = 0
    completion_ids[np.arange(c_width)[None, :] >= np.array(completion_lens)[:, None]] = 0
    num_prompts = num // group_size
    return RolloutBatch(
        batch_id=0,
        step=0,
        prompts=[Prompt(prompt_id=f"p{i}", text="") for i in range(num_prompts)],
        group_size=group_size,
        sample_ids=[f"s{i}" for i in range(num)],
        prompt_ids=prompt_ids,
        prompt_lens=np.array(prompt_lens, dtype=np.int32),
        completion_ids=completion_ids,
        completion_lens=np.array(completion_lens, dtype=np.int32),
        completions=[""] * num,
        behaviour_logprobs=np.zeros((num, c_width), np.float32),
        token_versions=np.zeros((num, c_width), np.int32),
        policy_version=0,
    )


@pytest.fixture(scope="module")
def model():
    from stages.models.tiny import build_char_tokenizer, build_tiny_model

    torch.set_num_threads(1)
    cfg = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                          intermediate_size=64, max_position_embeddings=64, seed=3)
    return build_tiny_model(cfg, build_char_tokenizer()).eval()  # tokens drawn below VOCAB


def reference_logprobs(model, batch: RolloutBatch, temperature: float = 1.0) -> np.ndarray:
    """One unpadded sequence at a time: completion token j of sample i sits at position
    p_i + j and is predicted by the logits at position p_i + j - 1."""
    out = np.zeros(batch.completion_ids.shape, np.float32)
    for i in range(batch.num_samples):
        p, c = int(batch.prompt_lens[i]), int(batch.completion_lens[i])
        seq = np.concatenate([batch.prompt_ids[i, :p], batch.completion_ids[i, :c]])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(seq[None], dtype=torch.long)).logits[0]
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        for j in range(c):
            out[i, j] = float(logp[p + j - 1, seq[p + j]])
    return out


def test_build_model_inputs_concatenates_prompt_and_completion():
    batch = make_batch([2, 3], [3, 1], group_size=2)
    input_ids, attention_mask, completion_mask, positions = build_model_inputs(batch)
    p, c = batch.prompt_ids, batch.completion_ids
    # Sample 0: 2 prompt + 3 completion tokens = 5 = L; sample 1: 3 + 1 = 4, one pad.
    assert input_ids.tolist() == [
        [p[0, 0], p[0, 1], c[0, 0], c[0, 1], c[0, 2]],
        [p[1, 0], p[1, 1], p[1, 2], c[1, 0], 0],
    ]
    assert attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # completion_ids has width 4 (longest + 1): the last column is always padding.
    assert completion_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    # positions = prompt_len + j, clamped to L - 1 = 4 on padding.
    assert positions.tolist() == [[2, 3, 4, 4], [3, 4, 4, 4]]
    for i in range(2):
        n = int(completion_mask[i].sum())
        assert input_ids[i, positions[i, :n]].tolist() == c[i, :n].tolist()


def test_completion_logprobs_match_per_sample_loop(model):
    # Chunks of 3 over 6 samples with mixed lengths, including an empty completion.
    batch = make_batch([4, 4, 1, 1, 7, 7], [5, 0, 9, 2, 3, 6], group_size=2, seed=1)
    got = compute_completion_logprobs(model, batch, chunk_size=3)
    want = reference_logprobs(model, batch)
    assert got.shape == batch.completion_ids.shape and got.dtype == torch.float32
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-5, atol=1e-5)
    pad = np.arange(got.shape[1])[None, :] >= batch.completion_lens[:, None]
    assert (got.detach().numpy()[pad] == 0.0).all()
    assert (got.detach().numpy()[~pad] < 0.0).all()


def test_completion_logprobs_do_not_depend_on_chunking(model):
    batch = make_batch([3, 3, 5, 5, 2, 2, 6, 6], [4, 7, 1, 3, 8, 2, 5, 5], group_size=2, seed=2)
    whole = compute_completion_logprobs(model, batch, chunk_size=8)
    for chunk in (1, 3, 5):
        np.testing.assert_allclose(compute_completion_logprobs(model, batch, chunk_size=chunk).detach().numpy(),
                                   whole.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_temperature_scales_the_logits(model):
    batch = make_batch([3, 2], [4, 5], group_size=2, seed=3)
    got = compute_completion_logprobs(model, batch, temperature=0.7)
    np.testing.assert_allclose(got.detach().numpy(), reference_logprobs(model, batch, 0.7), rtol=1e-5, atol=1e-5)


def test_logits_to_keep_gives_the_full_logits_answer(model):
    batch = make_batch([6, 2, 4, 4], [3, 5, 1, 6], group_size=2, seed=4)
    inputs = build_model_inputs(batch)
    kept = forward_completion_logprobs(model, *inputs, use_logits_to_keep=True)
    full = forward_completion_logprobs(model, *inputs, use_logits_to_keep=False)
    np.testing.assert_allclose(kept.detach().numpy(), full.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_gradient_reaches_the_model_only_through_real_tokens(model):
    batch = make_batch([3, 3], [2, 4], group_size=2, seed=5)
    model.zero_grad()
    logprobs = compute_completion_logprobs(model, batch)
    assert logprobs.requires_grad
    # Sample 0 has 2 completion tokens: entry [0, 3] is padding, and backward through it
    # alone must leave every gradient at zero.
    logprobs[0, 3].backward(retain_graph=True)
    assert all(p.grad is None or float(p.grad.abs().sum()) == 0.0 for p in model.parameters())
    logprobs[0, 1].backward()
    assert float(model.lm_head.weight.grad.abs().sum()) > 0.0
    model.zero_grad()


def test_chunk_size_must_be_positive(model):
    with pytest.raises(ValueError, match="chunk_size"):
        compute_completion_logprobs(model, make_batch([2, 2], [1, 1], group_size=2), chunk_size=0)


def test_entropy_of_each_completion_position_matches_a_per_sample_loop(model):
    batch = make_batch([4, 4, 1, 1, 7, 7], [5, 0, 9, 2, 3, 6], group_size=2, seed=6)
    inputs = build_model_inputs(batch)
    got: list[torch.Tensor] = []
    forward_completion_logprobs(model, *inputs, temperature=0.7, entropy_out=got)
    want = np.zeros(batch.completion_ids.shape, np.float32)
    for i in range(batch.num_samples):  # completion token j is predicted at position p + j - 1
        p, c = int(batch.prompt_lens[i]), int(batch.completion_lens[i])
        seq = np.concatenate([batch.prompt_ids[i, :p], batch.completion_ids[i, :c]])
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=torch.tensor(seq[None], dtype=torch.long)).logits[0] / 0.7, dim=-1)
        for j in range(c):
            want[i, j] = float(-(probs[p + j - 1] * probs[p + j - 1].log()).sum())
    assert not got[0].requires_grad
    np.testing.assert_allclose(got[0].numpy(), want, rtol=1e-5, atol=1e-5)
