"""ReferenceModel on the tiny checkpoint: frozen, and scoring like the policy it loads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.config import TinyModelConfig
from pipeline.types import Prompt, RolloutBatch
from stages.models.logprobs import compute_completion_logprobs
from stages.models.reference import ReferenceModel
from stages.models.tiny import build_vocab, ensure_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return ensure_tiny_checkpoint(TinyModelConfig(), tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def policy(checkpoint):
    """The same weights loaded independently of ReferenceModel."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def make_batch() -> RolloutBatch:
    vocab = build_vocab()
    prompts = ["1+2=", "7*3="]
    completions = ["3", "21!", "4", "20 ok"]
    prompt_rows = [[vocab["<bos>"]] + [vocab[c] for c in p] for p in prompts for _ in range(2)]
    comp_rows = [[vocab[c] for c in text] for text in completions]
    prompt_ids = np.zeros((4, 6), np.int32)
    completion_ids = np.zeros((4, 6), np.int32)
    for i in range(4):
        prompt_ids[i, : len(prompt_rows[i])] = prompt_rows[i]
        completion_ids[i, : len(comp_rows[i])] = comp_rows[i]
    return RolloutBatch(
        batch_id=3, step=0, prompts=[Prompt(prompt_id=f"q{j}", text=p) for j, p in enumerate(prompts)],
        group_size=2, sample_ids=["a", "b", "c", "d"], prompt_ids=prompt_ids,
        prompt_lens=np.array([len(r) for r in prompt_rows], np.int32), completion_ids=completion_ids,
        completion_lens=np.array([len(r) for r in comp_rows], np.int32), completions=completions,
        behaviour_logprobs=np.zeros((4, 6), np.float32), token_versions=np.zeros((4, 6), np.int32),
        policy_version=0, rewards=np.array([1, 0, 0, 1], np.float32),
    )


def test_reference_adds_ref_logprobs_without_touching_the_input(checkpoint, policy):
    ref = ReferenceModel(checkpoint, "float32", threads=1, chunk_size=3)
    assert not ref.model.training
    assert not any(p.requires_grad for p in ref.model.parameters())
    batch = make_batch()
    out = ref.compute(batch)
    assert batch.ref_logprobs is None  # a new value, not a mutation
    assert out.ref_logprobs.dtype == np.float32 and out.ref_logprobs.shape == (4, 6)
    pad = np.arange(6)[None, :] >= batch.completion_lens[:, None]
    assert (out.ref_logprobs[pad] == 0).all() and (out.ref_logprobs[~pad] < 0).all()
    np.testing.assert_array_equal(out.rewards, batch.rewards)
    with torch.no_grad():
        want = compute_completion_logprobs(policy, batch).numpy()
    np.testing.assert_allclose(out.ref_logprobs, want, rtol=1e-6, atol=1e-6)


def test_reference_scores_at_the_rollout_temperature(checkpoint, policy):
    batch = make_batch()
    got = ReferenceModel(checkpoint, "float32", temperature=0.5).compute(batch).ref_logprobs
    with torch.no_grad():
        want = compute_completion_logprobs(policy, batch, temperature=0.5).numpy()
        at_one = compute_completion_logprobs(policy, batch, temperature=1.0).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, at_one)


def test_reference_rejects_an_unknown_dtype(checkpoint):
    with pytest.raises(ValueError, match="dtype"):
        ReferenceModel(checkpoint, "float64")


def test_token_budget_passes_score_alike_and_count_their_padding(checkpoint, policy):
    # Sequences of 5 + 1, 5 + 3, 5 + 1 and 5 + 5 tokens. A budget of 12: 10 alone
    # (2 x 10 > 12), then 8 alone (2 x 8 > 12), then the two 6-token rows: 10 + 8 + 12 =
    # 30 computed for 30 real tokens, no padding. Chunks of 3 samples: 3 x 8 + 10 = 34.
    batch = make_batch()
    packed = ReferenceModel(checkpoint, "float32", threads=1, chunk_size=3, pass_tokens=12)
    got = packed.compute(batch).ref_logprobs
    with torch.no_grad():
        want = compute_completion_logprobs(policy, batch, chunk_size=4).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert packed.padding_metrics() == pytest.approx({"ref/padding_fraction": 0.0,
                                                      "ref/padding_fraction_unpacked": 1 - 30 / 34})
    with pytest.raises(ValueError, match="train.pass_tokens"):
        ReferenceModel(checkpoint, "float32", pass_tokens=-1)
