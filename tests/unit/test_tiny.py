"""The embedded tiny model: tokenizer round trip, checkpoint layout, reuse, loading."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.config import ModelConfig, TinyModelConfig
from stages.models.tiny import (
    CHARS,
    build_char_tokenizer,
    build_tiny_model,
    compute_config_hash,
    ensure_tiny_checkpoint,
    resolve_model_path,
)


def test_tokenizer_one_token_per_char_and_exact_round_trip():
    tok = build_char_tokenizer()
    text = CHARS + " 12+34=46\n"
    ids = tok(text).input_ids
    # <bos> (id 1) first, then exactly one id per character, none of them <unk> (id 3)
    assert ids[0] == tok.bos_token_id == 1
    assert len(ids) == len(text) + 1
    assert tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok("48=", add_special_tokens=False).input_ids == [tok.convert_tokens_to_ids(c) for c in "48="]


def test_tokenizer_ids_and_unknown_chars():
    tok = build_char_tokenizer()
    # specials 0..3, then "0".."9" at 4..13; vocab = 4 + 10 + 52 + 2 + 21 punctuation = 89
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok("09", add_special_tokens=False).input_ids == [4, 13]
    assert len(tok) == 89
    assert tok("é", add_special_tokens=False).input_ids == [tok.unk_token_id]


def test_tokenizer_survives_save_and_auto_load(tmp_path):
    build_char_tokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "Hello, World! (7*6=42)"
    ids = tok(text).input_ids
    assert ids[0] == 1 and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_checkpoint_loads_with_transformers_and_generates(tmp_path):
    cfg = TinyModelConfig()
    path = ensure_tiny_checkpoint(cfg, tmp_path)
    assert path.parent == tmp_path and path.name == f"tiny-{compute_config_hash(cfg)}"
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.head_dim == 64 and model.config.num_hidden_layers == 2
    assert model.generation_config.eos_token_id == tok.eos_token_id == 2
    enc = tok(["1234="], return_tensors="pt")
    out = model.generate(**enc, do_sample=False, max_new_tokens=4, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > enc.input_ids.shape[1]
    assert out.shape[1] <= enc.input_ids.shape[1] + 4
    # the saved weights are exactly the seeded init
    fresh = build_tiny_model(cfg, tok)
    with torch.no_grad():
        torch.testing.assert_close(model(**enc).logits, fresh(**enc).logits, atol=0, rtol=0)


def test_checkpoint_is_reused_and_keyed_by_config(tmp_path):
    cfg = TinyModelConfig()
    first = ensure_tiny_checkpoint(cfg, tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_checkpoint(cfg, tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    other = ensure_tiny_checkpoint(TinyModelConfig(seed=1), tmp_path)
    assert other != first
    # no temporary directories are left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])


def test_incomplete_checkpoint_dir_is_rebuilt(tmp_path):
    cfg = TinyModelConfig()
    broken = tmp_path / f"tiny-{compute_config_hash(cfg)}"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    path = ensure_tiny_checkpoint(cfg, tmp_path)
    assert path == broken
    assert (path / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == [broken.name]


def test_resolve_model_path(tmp_path):
    tiny = resolve_model_path(ModelConfig(path="tiny", cache_dir=str(tmp_path)))
    assert (tiny / "config.json").is_file()
    assert resolve_model_path(ModelConfig(path=str(tiny))) == tiny
    with pytest.raises(ValueError, match="model.path: .*not a directory"):
        resolve_model_path(ModelConfig(path=str(tmp_path / "missing")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="model.path: .*no config.json"):
        resolve_model_path(ModelConfig(path=str(tmp_path / "empty")))
