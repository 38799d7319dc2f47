"""Real-shape checkpoints: random-init models at the published shapes of models people RL-tune.

Guarantees:
- ``REAL_SHAPES`` holds, per name, the values the model's published ``config.json`` gives
  (layers, hidden and intermediate sizes, heads, key/value heads, head_dim, vocabulary,
  tied embeddings, rope, norm epsilon, context length, sliding window, soft-capping),
  its architecture, whether it has q/k norms, its published parameter count and the
  sampling defaults of its published ``generation_config.json``. Nothing is downloaded.
- ``build_real_shape_checkpoint`` writes a complete Hugging Face checkpoint directory that
  transformers and vLLM load: the family's config class with those values, random-init
  weights in ``dtype`` drawn on the GPU when there is one (else the CPU) from ``seed``,
  safetensors shards of at most ``SHARD_SIZE``, the char-level tokenizer of
  ``stages.models.tiny`` with the family's special tokens and chat template (so, as in real
  checkpoints, the tokenizer is smaller than the model's vocabulary), and a generation
  config with the family's stop tokens and sampling defaults. The special ids in the
  config are the tokenizer's.
- It is idempotent and atomic: the directory is written under a private name and renamed
  into place, and a directory already there is reused only when its ``MARKER`` file names
  the same shape, overrides, seed and dtype (``stages.models.tiny.write_checkpoint_atomically``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

from stages.models.tiny import (
    FAMILIES,
    UNK,
    Family,
    build_char_tokenizer,
    is_complete_checkpoint,
    write_checkpoint_atomically,
)

FORMAT_VERSION = 1  # bump when the layout or the init changes: old directories are rebuilt
MARKER = "conveyor_shape.json"
SHARD_SIZE = "5GB"

_LLAMA3_CHAT = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Llama 3's instruct conventions: <|eot_id|> ends a turn, three stop tokens, byte-level BPE.
LLAMA3 = Family("LlamaConfig", ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                "<|eot_id|>", "<|eom_id|>", "<|finetune_right_pad_id|>", UNK),
                eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", bos="<|begin_of_text|>",
                stops=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"), chat_template=_LLAMA3_CHAT, byte_level=True)


@dataclass(frozen=True)
class RealShape:
    """One published model: ``family`` (tokenizer conventions and config class),
    ``architecture`` (the checkpoint's ``architectures[0]``), ``config`` (the published
    ``config.json`` values), ``published_params`` (the parameter count its model card
    gives, tied embeddings counted once), ``qk_norm`` (RMSNorm on queries and keys, a
    property of the architecture) and ``sampling`` (its generation config's defaults)."""

    family: Family
    architecture: str
    model_type: str
    published_params: float
    config: dict[str, Any]
    qk_norm: bool = False
    sampling: dict[str, float] = field(default_factory=dict)


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool, params: float) -> RealShape:
    return RealShape(FAMILIES["qwen3"], "Qwen3ForCausalLM", "qwen3", params, qk_norm=True,
                     sampling={"temperature": 0.6, "top_k": 20, "top_p": 0.95},
                     config={"vocab_size": 151936, "hidden_size": hidden, "intermediate_size": intermediate,
                             "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
                             "head_dim": 128, "tie_word_embeddings": tied, "rope_theta": 1000000.0,
                             "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "attention_bias": False,
                             "use_sliding_window": False, "sliding_window": None, "max_window_layers": layers})


def _llama3(hidden: int, intermediate: int, layers: int, heads: int, head_dim: int, tied: bool, factor: float,
            params: float) -> RealShape:
    return RealShape(LLAMA3, "LlamaForCausalLM", "llama", params, sampling={"temperature": 0.6, "top_p": 0.9},
                     config={"vocab_size": 128256, "hidden_size": hidden, "intermediate_size": intermediate,
                             "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
                             "head_dim": head_dim, "tie_word_embeddings": tied, "rope_theta": 500000.0,
                             "rope_scaling": {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                             "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "attention_bias": False,
                             "mlp_bias": False})


# Published parameter counts (model cards; tied embeddings counted once):
#   Qwen2.5-0.5B 0.49B, Qwen3-0.6B 0.6B (0.596B counted), Qwen3-1.7B 1.7B, Qwen3-4B 4.0B,
#   Qwen3-8B 8.2B, Llama-3.2-1B 1.23B, Llama-3.1-8B 8.03B, Gemma-3-1B 1.0B (999,885,952).
REAL_SHAPES: dict[str, RealShape] = {
    "qwen2.5_0.5b": RealShape(
        FAMILIES["qwen2"], "Qwen2ForCausalLM", "qwen2", 0.49e9,
        sampling={"temperature": 0.7, "top_k": 20, "top_p": 0.8},
        config={"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": True,
                "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 24}),
    "qwen3_0.6b": _qwen3(1024, 3072, 28, 16, tied=True, params=0.6e9),
    "qwen3_1.7b": _qwen3(2048, 6144, 28, 16, tied=True, params=1.7e9),
    "qwen3_4b": _qwen3(2560, 9728, 36, 32, tied=True, params=4.0e9),
    "qwen3_8b": _qwen3(4096, 12288, 36, 32, tied=False, params=8.2e9),  # the 7-8B entry of the GPU matrix
    "llama3.2_1b": _llama3(2048, 8192, 16, 32, 64, tied=True, factor=32.0, params=1.23e9),
    "llama3.1_8b": _llama3(4096, 14336, 32, 32, 128, tied=False, factor=8.0, params=8.03e9),
    "gemma3_1b": RealShape(
        FAMILIES["gemma3"], "Gemma3ForCausalLM", "gemma3_text", 1.0e9, qk_norm=True,
        sampling={"top_k": 64, "top_p": 0.95},  # its generation config sets no temperature (1.0)
        config={"vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
                "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "tie_word_embeddings": True,
                "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
                "max_position_embeddings": 32768, "sliding_window": 512, "sliding_window_pattern": 6,
                "query_pre_attn_scalar": 256, "final_logit_softcapping": None, "attn_logit_softcapping": None,
                "hidden_activation": "gelu_pytorch_tanh"}),
}

# A shape small enough for a CPU test that keeps the family's structure (ties, biases,
# q/k norms, GQA, sliding windows) and a vocabulary still larger than the tokenizer.
SCALED_DOWN: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                               "vocab_size": 512}


def get_shape(name: str) -> RealShape:
    """``REAL_SHAPES[name]``; ``ValueError`` naming the known shapes otherwise."""
    if name not in REAL_SHAPES:
        raise ValueError(f"model shape: expected one of {sorted(REAL_SHAPES)}, got {name!r}")
    return REAL_SHAPES[name]


def build_shape_config(name: str, tokenizer: Any = None, overrides: dict[str, Any] | None = None) -> Any:
    """The transformers config of shape ``name`` (``overrides`` replace published values;
    a key the shape does not have is refused), its special ids the tokenizer's."""
    shape = get_shape(name)
    unknown = sorted(set(overrides or {}) - set(shape.config))
    if unknown:
        raise ValueError(f"model shape {name}: overrides name fields it does not have: {unknown}")
    tokenizer = tokenizer if tokenizer is not None else build_char_tokenizer(shape.family)
    config_class = getattr(transformers, shape.family.config_class)
    return config_class(**{**shape.config, **(overrides or {})}, architectures=[shape.architecture],
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)


def count_parameters(config: Any) -> int:
    """Parameters of the model ``config`` describes, tied ones once (built on the meta
    device: no memory, no init)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def compute_shape_key(name: str, overrides: dict[str, Any] | None, seed: int, dtype: torch.dtype) -> dict[str, Any]:
    """What a built directory must match to be reused (written to its ``MARKER``)."""
    return {"name": name, "overrides": dict(sorted((overrides or {}).items())), "seed": seed,
            "dtype": str(dtype).removeprefix("torch."), "format": FORMAT_VERSION}


def default_shape_dir(name: str, cache_dir: str | Path = "~/.cache/conveyor", overrides: dict[str, Any] | None = None,
                      seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """``<cache_dir>/shapes/<name>-<hash of the key>``."""
    blob = json.dumps(compute_shape_key(name, overrides, seed, dtype), sort_keys=True).encode()
    return Path(cache_dir).expanduser() / "shapes" / f"{name}-{hashlib.sha256(blob).hexdigest()[:12]}"


def build_real_shape_checkpoint(name: str, out_dir: str | Path | None = None, dtype: torch.dtype = torch.bfloat16,
                                seed: int = 0, overrides: dict[str, Any] | None = None) -> Path:
    """The checkpoint directory of shape ``name`` (``out_dir``; default
    ``default_shape_dir``), written unless a complete one of the same key is there."""
    get_shape(name)
    final = Path(out_dir).expanduser() if out_dir is not None else default_shape_dir(name, overrides=overrides,
                                                                                     seed=seed, dtype=dtype)
    key = compute_shape_key(name, overrides, seed, dtype)

    def is_done(path: Path) -> bool:
        marker = path / MARKER
        return is_complete_checkpoint(path) and marker.is_file() and json.loads(marker.read_text()) == key

    if not is_done(final):
        write_checkpoint_atomically(final, lambda tmp: write_real_shape_checkpoint(name, tmp, dtype, seed, overrides),
                                    is_done)
    return final


def build_in_subprocess(name: str, timeout_s: float = 900.0) -> Path:
    """``build_real_shape_checkpoint(name)`` (its default directory) in a process of its
    own, so that the caller never holds the CUDA context or cached memory of the init
    (a launch's plan reads the GPU's free memory)."""
    done = subprocess.run([sys.executable, "-m", "stages.models.shapes", name], capture_output=True, text=True,
                          timeout=timeout_s, cwd=Path(__file__).resolve().parent.parent)
    if done.returncode != 0:
        raise RuntimeError(f"building model shape {name} failed (status {done.returncode}): {done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def write_real_shape_checkpoint(name: str, out: Path, dtype: torch.dtype, seed: int,
                                overrides: dict[str, Any] | None) -> None:
    """Config, weights (shards), tokenizer, generation config and ``MARKER`` into ``out``."""
    shape = get_shape(name)
    tokenizer = build_char_tokenizer(shape.family)
    config = build_shape_config(name, tokenizer, overrides)
    model = init_model(config, dtype, seed)
    model.save_pretrained(out, max_shard_size=SHARD_SIZE)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the caller's GPU memory back, not kept in torch's cache
    tokenizer.save_pretrained(out)
    fam = shape.family
    stops = [tokenizer.convert_tokens_to_ids(s) for s in fam.stops] or tokenizer.eos_token_id
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id,
                     do_sample=True, **shape.sampling).save_pretrained(out)
    (out / MARKER).write_text(json.dumps(compute_shape_key(name, overrides, seed, dtype), sort_keys=True))


def init_model(config: Any, dtype: torch.dtype, seed: int) -> Any:
    """Random-init weights in ``dtype`` on the GPU when there is one (an 8B model in
    seconds), else on the CPU; the caller's random state is left as it was."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    with torch.random.fork_rng(devices=[device.index] if cuda else []):
        torch.manual_seed(seed)
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


if __name__ == "__main__":  # python -m stages.models.shapes NAME [--out DIR]: builds it, prints its path
    parser = argparse.ArgumentParser(prog="python -m stages.models.shapes", description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(REAL_SHAPES))
    parser.add_argument("--out", default=None, help="checkpoint directory (default: ~/.cache/conveyor/shapes/NAME-...)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_real_shape_checkpoint(args.name, args.out, seed=args.seed), flush=True)
