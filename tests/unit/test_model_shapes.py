"""Real-shape checkpoints: the registry's configs are the published models' (parameter
counts, architecture, ties, q/k norms), and a scaled-down build is a complete checkpoint."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from stages.models.shapes import (
    MARKER,
    REAL_SHAPES,
    SCALED_DOWN,
    build_real_shape_checkpoint,
    build_shape_config,
    count_parameters,
    default_shape_dir,
)


def _meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", sorted(REAL_SHAPES))
def test_each_shape_has_its_published_parameter_count_and_architecture(name):
    shape = REAL_SHAPES[name]
    config = build_shape_config(name)
    model = _meta_model(config)
    count = sum(p.numel() for p in model.parameters())
    # published_params: the model card's figure (listed in stages/models/shapes.py).
    assert abs(count / shape.published_params - 1) < 0.02, (name, count, shape.published_params)
    assert type(model).__name__ == shape.architecture == config.architectures[0]
    assert config.model_type == shape.model_type
    assert config.vocab_size == shape.config["vocab_size"] and config.tie_word_embeddings == shape.config[
        "tie_word_embeddings"]
    names = [n for n, _ in model.named_parameters()]
    assert any("q_norm" in n for n in names) == shape.qk_norm, name
    # named_parameters lists a tied head once, under the embedding's name.
    assert ("lm_head.weight" in names) == (not shape.config["tie_word_embeddings"]), name


def test_qwen3_0_6b_count_by_hand():
    # Embedding 151936*1024 = 155,582,464 (tied: the head adds nothing). Per layer:
    # q 1024*2048 + k 1024*1024 + v 1024*1024 + o 2048*1024 = 6,291,456; MLP 3*1024*3072
    # = 9,437,184; norms 2*1024 + q/k norms 2*128 = 2,304 -> 15,730,944; x28 =
    # 440,466,432; final norm 1,024. Total 596,049,920.
    assert count_parameters(build_shape_config("qwen3_0.6b")) == 596_049_920


def test_shapes_keep_family_specifics():
    gemma = build_shape_config("gemma3_1b")
    # Gemma 3: every sixth layer global, the others a 512-token window with their own rope base.
    assert gemma.sliding_window == 512 and gemma.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert gemma.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert gemma.rope_parameters["full_attention"]["rope_theta"] == 1000000.0
    llama = build_shape_config("llama3.2_1b")
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["factor"] == 32.0


def test_unknown_shape_or_override_is_refused():
    with pytest.raises(ValueError, match="model shape: expected one of .*qwen3_0.6b"):
        build_real_shape_checkpoint("qwen9_1b")
    with pytest.raises(ValueError, match=r"qwen3_0.6b: overrides name fields it does not have: \['hidden'\]"):
        build_shape_config("qwen3_0.6b", overrides={"hidden": 8})


@pytest.mark.parametrize("name", ["qwen3_0.6b", "llama3.1_8b", "gemma3_1b"])
def test_scaled_down_checkpoint_is_complete_and_loads(tmp_path, name):
    shape = REAL_SHAPES[name]
    path = build_real_shape_checkpoint(name, tmp_path / name, overrides=SCALED_DOWN, seed=3)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == SCALED_DOWN["vocab_size"]
    assert len(tok) < model.config.vocab_size  # as in real checkpoints
    assert model.config.eos_token_id == tok.eos_token_id
    with safe_open(path / "model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not shape.config["tie_word_embeddings"])
    gen = GenerationConfig.from_pretrained(path)
    assert gen.do_sample and all(getattr(gen, k) == v for k, v in shape.sampling.items())
    stops = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert tok.eos_token_id in stops and len(stops) == len(shape.family.stops)
    prompt = tok.apply_chat_template([{"role": "user", "content": "4821="}], tokenize=False, add_generation_prompt=True)
    assert "4821=" in prompt and prompt != "4821="
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 3


def test_build_is_idempotent_and_rebuilds_another_key(tmp_path):
    small = {**SCALED_DOWN, "num_hidden_layers": 1}
    out = tmp_path / "m"
    path = build_real_shape_checkpoint("qwen2.5_0.5b", out, overrides=small)
    weights = (path / "model.safetensors").stat().st_mtime_ns
    assert build_real_shape_checkpoint("qwen2.5_0.5b", out, overrides=small) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == weights  # reused, not rewritten
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary directory left
    # Another seed under the same directory: the marker no longer matches, so it is rebuilt.
    build_real_shape_checkpoint("qwen2.5_0.5b", out, overrides=small, seed=1)
    assert json.loads((out / MARKER).read_text())["seed"] == 1
    assert default_shape_dir("qwen2.5_0.5b", tmp_path) != default_shape_dir("qwen2.5_0.5b", tmp_path, seed=1)
