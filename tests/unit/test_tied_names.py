"""Tied embeddings on the way to a rollout engine: the payload names each tied tensor once,
under the name the served checkpoint holds, whatever the trainer did to the tensors'
storage (stages.models.checkpoint_names.drop_tied_aliases)."""

from __future__ import annotations

import torch

from pipeline.config import TinyModelConfig
from pipeline.weights import build_payload, read_checkpoint_shapes, read_payload_shapes
from stages.models.checkpoint_names import drop_tied_aliases, find_split_ties, find_tied_aliases


def build(architecture: str):
    from stages.models.tiny import build_char_tokenizer, build_tiny_model

    cfg = TinyModelConfig(architecture=architecture, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                          head_dim=16, intermediate_size=64, max_position_embeddings=64, seed=1)
    return build_tiny_model(cfg, build_char_tokenizer(architecture))


def test_tied_families_send_the_embedding_once_under_the_checkpoint_name(tmp_path):
    for architecture in ("qwen2", "qwen3", "gemma3"):
        model = build(architecture)
        assert find_tied_aliases(model) == {"lm_head.weight": "model.embed_tokens.weight"}
        model.save_pretrained(tmp_path / architecture)
        served = read_checkpoint_shapes(tmp_path / architecture)
        assert "lm_head.weight" not in served  # what a served tied model holds
        data, _, _ = build_payload(drop_tied_aliases(model, model.state_dict()))
        assert set(read_payload_shapes(data)) == set(served)


def test_a_tie_whose_storage_was_split_is_still_sent_once():
    # An engine that copies parameters into buffers of its own can leave the two names
    # on different storages: the identity rule alone would then send lm_head.weight,
    # which the served model does not hold. The declared tie still drops it.
    model = build("qwen3")
    state = dict(model.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"].clone()
    assert state["lm_head.weight"].data_ptr() != state["model.embed_tokens.weight"].data_ptr()
    assert "lm_head.weight" not in drop_tied_aliases(model, state)


def test_untied_families_send_both():
    model = build("llama")
    assert find_tied_aliases(model) == {}
    names = set(drop_tied_aliases(model, model.state_dict()))
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= names


def test_a_payload_without_the_source_keeps_the_alias():
    # Only an alias in hand (a partial state): nothing to drop it in favour of.
    model = build("qwen3")
    head = {"lm_head.weight": torch.zeros(3)}
    assert drop_tied_aliases(model, head) == head


def test_a_tie_split_into_two_parameters_is_found():
    model = build("qwen3")
    assert find_split_ties(model) == []
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    assert find_split_ties(model) == ["lm_head.weight -> model.embed_tokens.weight"]
