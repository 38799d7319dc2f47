"""The reward-model scorer (stages/rewards/reward_model.py): scores equal a direct transformers
forward of each sample alone, source combination and normalisation, config checks."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
import transformers

from pipeline.config import ConfigError, RewardSourceConfig, TinyModelConfig, load_config
from pipeline.launch import build_dataflow
from stages.models.tiny import build_char_tokenizer
from stages.rewards.reward_model import (
    RewardModel,
    RunningMoments,
    combine_reward_sources,
    normalize_scores,
    pick_pad_id,
)
from tests.unit.test_admission import make_batch


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    """A tiny random Llama sequence classifier (one logit) with the char tokenizer."""
    out = tmp_path_factory.mktemp("rm")
    tok = build_char_tokenizer("llama")
    cfg = TinyModelConfig()
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, num_labels=1, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _texts_batch():
    batch = make_batch(num_groups=2, group_size=2)  # prompts q0, q1; completions c0..c3
    prompts = [msgspec.structs.replace(p, text=t) for p, t in zip(batch.prompts, ["12+3=", "7*8="], strict=True)]
    return msgspec.structs.replace(batch, prompts=prompts, completions=["15", "1", "56 ok", ""])


def test_scores_match_a_direct_transformers_forward_of_each_sample(rm_path):
    rm = RewardModel(rm_path, chunk_size=3)  # chunks of 3 and 1: padding inside the first
    batch = _texts_batch()
    got = rm.score(batch)
    tok = transformers.AutoTokenizer.from_pretrained(rm_path)
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    texts = ["12+3=15", "12+3=1", "7*8=56 ok", "7*8="]
    want = []
    for text in texts:
        ids = tok(text, return_tensors="pt")["input_ids"]  # one sequence, no padding at all
        with torch.no_grad():
            want.append(float(ref(input_ids=ids).logits[0, 0]))
    assert got.dtype == np.float32 and got.shape == (4,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(set(np.round(got, 6))) == 4  # distinct texts, distinct scores: nothing pooled the padding


def test_a_classifier_with_two_labels_is_refused(tmp_path, rm_path):
    config = transformers.AutoConfig.from_pretrained(rm_path)
    config.num_labels = 2
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has 2 labels; a reward model gives one logit"):
        RewardModel(tmp_path)


def test_pad_id_avoids_tokens_of_the_chunk():
    assert pick_pad_id([[5, 6], [7]], preferred=0) == 0
    assert pick_pad_id([[0, 1], [2]], preferred=0) == 3  # 0 occurs: the smallest free id
    assert pick_pad_id([[1, 2]], preferred=None) == 0


def test_normalisation_and_weighted_combination():
    # batch z-score of [1, 2, 3]: mean 2, population std sqrt(2/3) -> [-1.2247, 0, 1.2247]
    np.testing.assert_allclose(normalize_scores(np.array([1.0, 2.0, 3.0]), "batch"),
                               [-1.2247449, 0.0, 1.2247449], rtol=0, atol=1e-6)
    assert np.all(normalize_scores(np.array([4.0, 4.0]), "batch") == 0)  # constant -> 0
    # running: after [0, 2] (mean 1, std 1), the next [4]: moments over [0, 2, 4] are
    # mean 2, std sqrt(8/3) = 1.63299 -> (4 - 2) / 1.63299 = 1.22474
    m = RunningMoments()
    normalize_scores(np.array([0.0, 2.0]), "running", m)
    assert (m.mean, m.std) == (1.0, 1.0)
    np.testing.assert_allclose(normalize_scores(np.array([4.0]), "running", m), [1.2247449], rtol=0, atol=1e-6)
    # rule [1, 0] weight 1 (raw) + model [2, 4] weight 0.5 (batch z: [-1, 1]) -> [0.5, 0.5]
    sources = {"rule": RewardSourceConfig(kind="function"),
               "rm": RewardSourceConfig(kind="model", path="x", weight=0.5, normalize="batch")}
    got = combine_reward_sources({"rule": np.array([1.0, 0.0]), "rm": np.array([2.0, 4.0])}, sources, {})
    np.testing.assert_allclose(got, [0.5, 0.5], rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match="reward.sources.rm: no scores"):
        combine_reward_sources({"rule": np.array([1.0])}, sources, {})


def test_reward_sources_config_and_graph(rm_path):
    keys = ["reward.sources={rule: {kind: function}, rm: {kind: model, path: " + str(rm_path) + ", weight: 0.5}}"]
    cfg = load_config("configs/quickstart.yaml", keys)
    assert build_dataflow(cfg).topological_order() == ["source", "rollout", "reward", "reward_model", "reference",
                                                       "trainer"]
    with pytest.raises(ConfigError, match=r"reward.sources.rm.path: expected a local reward model"):
        load_config("configs/quickstart.yaml", ["reward.sources={rm: {kind: model}}"])
    with pytest.raises(ConfigError, match=r"reward.sources: expected one source of kind 'model'"):
        load_config("configs/quickstart.yaml", ["reward.sources={rule: {kind: function}}"])
    with pytest.raises(ConfigError, match=r"reward\.sources\[\.\.\.\]\.normalize: invalid enum value .zscore."):
        load_config("configs/quickstart.yaml", [f"reward.sources={{rm: {{kind: model, path: {rm_path}, "
                                                f"normalize: zscore}}}}"])


def test_dapo_shaping_runs_on_the_reward_models_final_reward(rm_path, tmp_path):
    """With a reward model the overlong penalty and zero-variance filtering apply to the
    combined reward (rule weight 0, as configs/ppo.yaml), not to the rule score the
    reward stage sets and the reward model replaces."""
    import asyncio

    from stages.rewards.reward_model import RewardModelStage
    from stages.rewards.shaping import shapes_rewards
    from tests.ray_local.fakes import FakeStageContext

    cfg = load_config("configs/quickstart.yaml", [
        f"run.dir={tmp_path}", "rollout.n=2", "rollout.max_tokens=4", "train.prompts_per_step=2",
        "dataflow.prompts_per_micro_batch=2", "algorithm.overlong_buffer_len=1",
        "reward.sources={rule: {kind: function, weight: 0.0}, rm: {kind: model, path: " + str(rm_path) + "}}"])
    assert shapes_rewards(cfg) == "reward_model"  # the reward stage leaves its score unshaped
    ctx = FakeStageContext("reward_model", cfg)
    stage = RewardModelStage()
    asyncio.run(stage.setup(ctx))
    # completion lengths 1 2 3 4 (make_batch); max_tokens 4, buffer 1: only length 4 is
    # penalised, by -(4 - 3) / 1 = -1; the rule score (0 1 2 3) counts with weight 0.
    out = asyncio.run(stage.process(_texts_batch()))
    raw = np.asarray(out.reward_extras["rm"], dtype=np.float32)
    np.testing.assert_allclose(out.rewards, raw + np.array([0, 0, 0, -1], np.float32), rtol=0, atol=1e-6)
    assert out.reward_extras["overlong_penalty"] == [0.0, 0.0, 0.0, -1.0]

    # Dynamic sampling: group 0's two completions are the same text, so the same model
    # score (their lengths 1 and 2 get no penalty) while their rule scores (0, 1)
    # differ: dropped on the final reward, reported at once; group 1 waits for a whole
    # micro-batch and leaves at the end carrying the drop.
    cfg = msgspec.structs.replace(cfg, algorithm=msgspec.structs.replace(cfg.algorithm,
                                                                         drop_zero_variance_groups=True))
    ctx = FakeStageContext("reward_model", cfg)
    stage = RewardModelStage()
    asyncio.run(stage.setup(ctx))
    batch = msgspec.structs.replace(_texts_batch(), completions=["15", "15", "56 ok", ""])
    assert asyncio.run(stage.process(batch)) == []
    assert ctx.controller.calls == [("record_dropped", (1, "zero_variance"))]
    (rest,) = asyncio.run(stage.finish())
    assert rest.sample_ids == batch.sample_ids[2:] and rest.dropped_prompts == {"zero_variance": [-1]}
    assert stage.status()["groups_dropped_zero_variance"] == 1


def test_a_chat_prompt_is_scored_under_the_reward_models_own_template():
    # The policy rendered "1=" with its template ("<policy>" marks it here); the reward
    # model's tokenizer (qwen2-style, with a chat template) renders the messages plus the
    # completion as the assistant's reply itself. A plain prompt keeps text + completion.
    from pipeline.types import Prompt

    tok = build_char_tokenizer("qwen2")
    assert tok.chat_template is not None
    rm = RewardModel.__new__(RewardModel)  # encode only: no model weights needed
    rm.tokenizer, rm.max_length = tok, None
    messages = [{"role": "user", "content": "1="}]
    batch = make_batch(num_groups=2, group_size=2)
    prompts = [Prompt(prompt_id="c", text="<policy>1=", messages=messages), Prompt(prompt_id="p", text="2=")]
    batch = msgspec.structs.replace(batch, prompts=prompts, completions=["1", "11", "2", "22"])
    got = rm.encode(batch)
    own = tok.apply_chat_template([*messages, {"role": "assistant", "content": "11"}], tokenize=False)
    assert "<policy>" not in own and got[1] == tok(own, add_special_tokens=False)["input_ids"]
    assert got[2] == tok("2=2")["input_ids"]
