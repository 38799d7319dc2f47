"""The embedded default model: a random-init decoder with a char-level tokenizer.

Guarantees:
- Nothing is downloaded: the tokenizer is built with the ``tokenizers`` library, the
  model with transformers' own config class of the family, and the weights are drawn
  from ``torch`` with ``TinyModelConfig.seed``, so the same config gives bit-identical
  weights on every machine.
- The tokenizer maps every vocabulary character to exactly one token and each special
  token to one token; it prepends the family's BOS when ``add_special_tokens=True``
  (families without BOS, like Qwen, prepend nothing), and decodes
  (``skip_special_tokens=True``) back to the exact input text; characters outside the
  vocabulary become ``<unk>``.
- ``FAMILIES`` carries each architecture's real quirks (``TinyModelConfig.architecture``):
  Llama (untied, no bias; no chat template: the case of a base model), Qwen2 (q/k/v
  bias, tied embeddings, ChatML, no BOS, two stop tokens), Qwen3 (q/k RMSNorm, tied,
  ChatML), Mistral (grouped-query attention, sliding window, ``[INST]`` template),
  Gemma3 (tied, (1 + w) norms, q/k norm, scaled embeddings, logit soft-capping,
  ``<start_of_turn>`` template, ``<end_of_turn>`` stops) and Phi3 (fused qkv and
  gate/up projections in the checkpoint, ``<|end|>`` stops). Two are mixtures of
  experts, ``MOE_EXPERTS`` per layer with two routed per token: Qwen3-MoE (ChatML,
  normalised top-k weights) and Mixtral (the Mistral conventions, ``w1``/``w2``/``w3``
  experts under ``block_sparse_moe`` in the checkpoint). Every family but Llama and
  Mixtral uses one key/value head (GQA). The generation config lists every stop token.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast

from pipeline.config import ModelConfig, TinyModelConfig

# Bump when the checkpoint layout, the vocabulary or the init changes: old cache entries
# then stop matching instead of being silently reused.
FORMAT_VERSION = 1

MOE_EXPERTS = 4  # experts per layer of the mixture-of-experts families

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


# GPT-2's byte -> printable character map, for the two characters of CHARS outside it.
_BYTE_LEVEL = {ord(" "): "\u0120", ord("\n"): "\u010a"}

_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_GEMMA = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}"
    "\n{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
_PHI3 = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@dataclass(frozen=True)
class Family:
    """One architecture's model class and tokenizer conventions (see module guarantees).

    ``specials`` take ids 0..k-1 in this order; ``stops`` are the generation config's
    ``eos_token_id`` list (the tokenizer's ``eos`` first); ``bos`` None means none is
    prepended. ``config`` holds extra arguments of the transformers config class."""

    config_class: str
    specials: tuple[str, ...]
    eos: str
    pad: str
    bos: str | None = None
    stops: tuple[str, ...] = ()
    chat_template: str | None = None
    byte_level: bool = False  # a byte-level BPE (no merges) like GPT-2/Qwen, not a word-level vocab
    kv_heads: int | None = 1  # None: TinyModelConfig.num_kv_heads
    moe_experts: str | None = None  # the config field of the expert count, for mixture-of-experts families
    config: dict[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", SPECIAL_TOKENS, eos=EOS, pad=PAD, bos=BOS, kv_heads=None,
                    config={"tie_word_embeddings": False}),
    "qwen2": Family("Qwen2Config", ("<|endoftext|>", "<|im_start|>", "<|im_end|>", UNK), eos="<|im_end|>",
                    pad="<|endoftext|>", stops=("<|im_end|>", "<|endoftext|>"), chat_template=_CHATML,
                    byte_level=True, config={"tie_word_embeddings": True}),
    "qwen3": Family("Qwen3Config", ("<|endoftext|>", "<|im_start|>", "<|im_end|>", UNK), eos="<|im_end|>",
                    pad="<|endoftext|>", stops=("<|im_end|>", "<|endoftext|>"), chat_template=_CHATML,
                    byte_level=True, config={"tie_word_embeddings": True}),
    "mistral": Family("MistralConfig", (UNK, "<s>", "</s>", "[INST]", "[/INST]"), eos="</s>", pad="</s>", bos="<s>",
                      chat_template=_MISTRAL, config={"tie_word_embeddings": False, "sliding_window": 128}),
    "gemma3": Family("Gemma3TextConfig", (PAD, EOS, BOS, UNK, "<start_of_turn>", "<end_of_turn>"), eos=EOS, pad=PAD,
                     bos=BOS, stops=(EOS, "<end_of_turn>"), chat_template=_GEMMA,
                     config={"tie_word_embeddings": True}),
    # Mixture-of-experts: 4 experts of the model's intermediate size, 2 routed per token
    # on every layer. transformers holds each layer's experts as 3D tensors; checkpoints
    # and vLLM name them one expert at a time (see stages.models.checkpoint_names).
    "qwen3_moe": Family("Qwen3MoeConfig", ("<|endoftext|>", "<|im_start|>", "<|im_end|>", UNK), eos="<|im_end|>",
                        pad="<|endoftext|>", stops=("<|im_end|>", "<|endoftext|>"), chat_template=_CHATML,
                        byte_level=True, moe_experts="num_experts",
                        config={"tie_word_embeddings": False, "num_experts_per_tok": 2, "norm_topk_prob": True}),
    "mixtral": Family("MixtralConfig", (UNK, "<s>", "</s>", "[INST]", "[/INST]"), eos="</s>", pad="</s>", bos="<s>",
                      chat_template=_MISTRAL, kv_heads=None, moe_experts="num_local_experts",
                      config={"tie_word_embeddings": False, "num_experts_per_tok": 2}),
    "phi3": Family("Phi3Config", (UNK, "<s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"),
                   eos="<|endoftext|>", pad="<|endoftext|>", bos="<s>", stops=("<|endoftext|>", "<|end|>"),
                   chat_template=_PHI3, config={"tie_word_embeddings": False}),
}


def build_vocab(specials: tuple[str, ...] = SPECIAL_TOKENS, byte_level: bool = False) -> dict[str, int]:
    """Token -> id: the special tokens first (ids 0..k-1), then one id per character
    (``byte_level``: spelled as a byte-level BPE spells that character's byte)."""
    chars = list(CHARS)
    if byte_level:
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        chars = [c if c in alphabet else _BYTE_LEVEL[ord(c)] for c in chars]
    tokens = list(specials) + chars
    assert len(set(tokens)) == len(tokens), "duplicate character in the vocabulary"
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer(architecture: str | Family = "llama") -> PreTrainedTokenizerFast:
    """A char-level fast tokenizer with the family's special tokens and chat template
    (``architecture``: a ``FAMILIES`` key, or a ``Family`` of its own); see the module
    guarantees."""
    fam = FAMILIES[architecture] if isinstance(architecture, str) else architecture
    vocab = build_vocab(fam.specials, fam.byte_level)
    if fam.byte_level:
        # No merges: every byte stays its own token. transformers rebuilds some families'
        # tokenizers (Qwen2) as byte-level BPE from this vocabulary, which this matches.
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
        # "isolated" keeps each matched character as its own piece; [\s\S] also matches
        # "\n", which "." would not.
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Special tokens are matched whole before the character split.
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in fam.specials])
    if fam.bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{fam.bos} $A", pair=f"{fam.bos} $A $B", special_tokens=[(fam.bos, vocab[fam.bos])])
    # Fuse concatenates the pieces; the default WordLevel decoding would join with spaces.
    tok.decoder = decoders.ByteLevel() if fam.byte_level else decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=fam.bos,
        eos_token=fam.eos,
        pad_token=fam.pad,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    if fam.chat_template is not None:
        hf.chat_template = fam.chat_template
    return hf


def build_tiny_model(cfg: TinyModelConfig, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A random-init float32 causal LM of the configured family and shape whose special
    ids are the tokenizer's.

    The global torch RNG is forked, so building the model neither depends on nor
    disturbs the caller's random state.
    """
    fam = FAMILIES[cfg.architecture]
    config_class = getattr(transformers, fam.config_class)
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads if fam.kv_heads is None else fam.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **fam.config,
        **({fam.moe_experts: MOE_EXPERTS, "moe_intermediate_size": cfg.intermediate_size} if fam.moe_experts else {}),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def compute_config_hash(cfg: TinyModelConfig) -> str:
    """Short stable hash of the model shape, seed, vocabulary and format version."""
    blob = msgspec.json.encode(
        {"cfg": msgspec.to_builtins(cfg), "vocab": CHARS, "format": FORMAT_VERSION}
    )
    return hashlib.sha256(blob).hexdigest()[:12]


def is_complete_checkpoint(path: Path) -> bool:
    """Config, tokenizer, generation config and weights: one ``model.safetensors`` or the
    shards' index (shards are written before it)."""
    required = [n for n in _REQUIRED_FILES if n != "model.safetensors"]
    weights = (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    return path.is_dir() and weights and all((path / name).is_file() for name in required)


def write_tiny_checkpoint(cfg: TinyModelConfig, out_dir: Path) -> None:
    """Write config, weights, tokenizer and generation config into ``out_dir``."""
    fam = FAMILIES[cfg.architecture]
    tokenizer = build_char_tokenizer(cfg.architecture)
    model = build_tiny_model(cfg, tokenizer)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    stops = [tokenizer.convert_tokens_to_ids(s) for s in fam.stops] or tokenizer.eos_token_id
    # Only the special ids: sampling settings come from the run config, and vLLM would
    # otherwise pick up transformers' defaults from this file.
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=stops,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out_dir)


def ensure_tiny_checkpoint(cfg: TinyModelConfig, cache_dir: str | Path) -> Path:
    """Return ``<cache_dir>/tiny-<hash>``, writing it first if it is missing or incomplete."""
    final = Path(cache_dir).expanduser() / f"tiny-{compute_config_hash(cfg)}"
    if not is_complete_checkpoint(final):
        write_checkpoint_atomically(final, lambda tmp: write_tiny_checkpoint(cfg, tmp))
    return final


def write_checkpoint_atomically(final: Path, write: Callable[[Path], None],
                                is_done: Callable[[Path], bool] = is_complete_checkpoint) -> Path:
    """``write(tmp)`` into a private directory beside ``final``, then rename it into place
    in one step (a damaged ``final``, one ``is_done`` rejects, is discarded first). A
    concurrent caller that renamed its copy first wins: the copies are identical."""
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        write(tmp)
        for _ in range(3):  # retries only matter when a damaged directory is being replaced
            if final.exists() and not is_done(final):
                _discard_directory(final, root)
            try:
                os.rename(tmp, final)
                break
            except OSError:
                if is_done(final):
                    break
        else:
            raise RuntimeError(f"could not move the checkpoint into {final}")
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
    HF checkpoint directory containing ``config.json`` (a Hub id was replaced by its
    cached snapshot in pre-flight)."""
    if model_cfg.path == "tiny":
        return ensure_tiny_checkpoint(model_cfg.tiny, model_cfg.cache_dir)
    path = Path(model_cfg.path).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model.path: expected 'tiny', a local Hugging Face checkpoint directory or a Hub id (org/name, "
            f"fetched by pre-flight: pipeline/hub.py), got {model_cfg.path!r} (not a directory)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model.path: expected a Hugging Face checkpoint directory with config.json, "
            f"got {model_cfg.path!r} (no config.json in it)"
        )
    return path
