"""The embedded default model: a random-init Llama with a char-level tokenizer.

Guarantees:
- Nothing is downloaded: the tokenizer is built with the ``tokenizers`` library and the
  weights are drawn from ``torch`` with ``TinyModelConfig.seed``, so the same config gives
  bit-identical weights on every machine.
- The tokenizer maps every vocabulary character to exactly one token, prepends ``<bos>``
  when ``add_special_tokens=True``, and decodes (``skip_special_tokens=True``) back to the
  exact input text; characters outside the vocabulary become ``<unk>``.
- ``ensure_tiny_checkpoint`` returns a complete Hugging Face checkpoint directory
  (config, safetensors weights, tokenizer, generation config) that transformers and vLLM
  load from disk. It is idempotent and safe under concurrent callers: a checkpoint is
  written to a private temporary directory and renamed into place in one atomic step,
  so a directory under its final name is always complete.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import msgspec
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from pipeline.config import ModelConfig, TinyModelConfig

# Bump when the checkpoint layout, the vocabulary or the init changes: old cache entries
# then stop matching instead of being silently reused.
FORMAT_VERSION = 1

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD, BOS, EOS, UNK = SPECIAL_TOKENS
CHARS = (
    "0123456789"
    "abcdefghijklmnopqrstuvwxyz"
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    " \n"
    "+-=*/:;,.?!()[]<>_'\"#"
)

# Files whose presence makes a checkpoint directory usable by transformers and vLLM.
_REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


def build_vocab() -> dict[str, int]:
    """Token -> id: the four special tokens first (ids 0..3), then one id per character."""
    tokens = list(SPECIAL_TOKENS) + list(CHARS)
    assert len(set(tokens)) == len(tokens), "duplicate character in the vocabulary"
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A char-level fast tokenizer over ``build_vocab()``; see the module guarantees."""
    vocab = build_vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # "isolated" keeps each matched character as its own piece; [\s\S] also matches "\n",
    # which "." would not.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A $B",
        special_tokens=[(BOS, vocab[BOS])],
    )
    # Fuse concatenates the pieces; the default WordLevel decoding would join with spaces.
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    return hf


def build_tiny_model(
    cfg: TinyModelConfig,
    vocab_size: int,
    *,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    pad_token_id: int = 0,
) -> LlamaForCausalLM:
    """A random-init float32 ``LlamaForCausalLM`` of the configured shape.

    The global torch RNG is forked, so building the model neither depends on nor
    disturbs the caller's random state.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def compute_config_hash(cfg: TinyModelConfig) -> str:
    """Short stable hash of the model shape, seed, vocabulary and format version."""
    blob = msgspec.json.encode(
        {"cfg": msgspec.to_builtins(cfg), "vocab": CHARS, "format": FORMAT_VERSION}
    )
    return hashlib.sha256(blob).hexdigest()[:12]


def is_complete_checkpoint(path: Path) -> bool:
    return path.is_dir() and all((path / name).is_file() for name in _REQUIRED_FILES)


def write_tiny_checkpoint(cfg: TinyModelConfig, out_dir: Path) -> None:
    """Write config, weights, tokenizer and generation config into ``out_dir``."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(
        cfg,
        len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # Only the special ids: sampling settings come from the run config, and vLLM would
    # otherwise pick up transformers' defaults from this file.
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out_dir)


def ensure_tiny_checkpoint(cfg: TinyModelConfig, cache_dir: str | Path) -> Path:
    """Return ``<cache_dir>/tiny-<hash>``, writing it first if it is missing or incomplete."""
    root = Path(cache_dir).expanduser()
    final = root / f"tiny-{compute_config_hash(cfg)}"
    if is_complete_checkpoint(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        write_tiny_checkpoint(cfg, tmp)
        for _ in range(3):  # retries only matter when a damaged directory is being replaced
            if final.exists() and not is_complete_checkpoint(final):
                _discard_directory(final, root)
            try:
                os.rename(tmp, final)
                break
            except OSError:
                # A concurrent caller renamed its own copy first: theirs is identical.
                if is_complete_checkpoint(final):
                    break
        else:
            raise RuntimeError(f"could not move the tiny checkpoint into {final}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _discard_directory(path: Path, root: Path) -> None:
    """Remove a damaged checkpoint dir (left by something other than this module: rename
    never leaves half a directory), first moving it aside atomically so a concurrent
    caller never sees it half deleted."""
    stale = Path(tempfile.mkdtemp(prefix=f".{path.name}.stale.", dir=root))
    try:
        os.replace(path, stale / "old")
    except OSError:
        pass  # a concurrent caller moved it first
    shutil.rmtree(stale, ignore_errors=True)


def resolve_model_path(model_cfg: ModelConfig) -> Path:
    """``model.path``: "tiny" -> the embedded checkpoint; otherwise an existing local
    HF checkpoint directory containing ``config.json``."""
    if model_cfg.path == "tiny":
        return ensure_tiny_checkpoint(model_cfg.tiny, model_cfg.cache_dir)
    path = Path(model_cfg.path).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model.path: expected 'tiny' or a local Hugging Face checkpoint directory, "
            f"got {model_cfg.path!r} (not a directory; nothing is downloaded)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model.path: expected a Hugging Face checkpoint directory with config.json, "
            f"got {model_cfg.path!r} (no config.json in it)"
        )
    return path
