"""``model``: the policy checkpoint (the embedded tiny default, a local directory or a Hub
id), its dtype and LoRA adapters."""

from __future__ import annotations

import glob
import os
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from pipeline.config.base import NonNegInt, PosFloat, PosInt, _section

TinyArchitecture = Literal["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "qwen3_moe", "mixtral"]


class TinyModelConfig(msgspec.Struct, **_section()):
    """Shape of the embedded default model: a random-init decoder with a char tokenizer.

    ``architecture`` picks the transformers model class and the tokenizer conventions
    of that family (special tokens, BOS or not, stop tokens, chat template); the
    default Llama has no chat template (see ``stages/models/tiny.py``)."""

    architecture: TinyArchitecture = "llama"
    hidden_size: PosInt = 128
    num_layers: PosInt = 2
    num_heads: PosInt = 2
    num_kv_heads: PosInt = 2
    head_dim: PosInt = 64
    intermediate_size: PosInt = 256
    max_position_embeddings: PosInt = 256
    seed: NonNegInt = 0


class LoraConfig(msgspec.Struct, **_section()):
    """LoRA adapters on the policy, through ``peft`` (``stages/models/lora.py``; the pip
    extra ``conveyor[lora]``). ``rank`` 0: off, the whole model trains. Otherwise only the
    adapters train (scale ``alpha / rank``, ``dropout`` on their input): the optimizer
    holds their state alone and checkpoints save them alone; the rollout keeps serving full
    weights, the adapters merged into the modules they adapt (only those modules' layers
    are sent; the whole merged model where the rollout sleeps, ``rollout.sleep_mode``, as
    colocated it does, since a sleeping engine discards its weights). ``target_modules``:
    ``all-linear`` (every linear layer but the output head), a list of module names
    (``[q_proj, v_proj]``, matched as name suffixes) or a regular expression peft matches
    against full module names. At the end of a run
    ``<run dir>/checkpoint`` holds the adapter (``adapter_model.safetensors``,
    ``adapter_config.json``); ``export_merged`` also writes the merged model, loadable by
    transformers, to ``<run dir>/checkpoint/merged``."""

    rank: NonNegInt = 0
    alpha: PosFloat = 16.0
    target_modules: str | list[str] = "all-linear"
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    export_merged: bool = False

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class ModelConfig(msgspec.Struct, **_section()):
    """``path: tiny`` builds the embedded default locally; any local HF checkpoint dir
    works, and so does a Hub id (``Qwen/Qwen2.5-0.5B-Instruct``) at ``revision`` (a
    branch, tag or commit; None: ``main``), fetched into the Hugging Face cache before
    the run starts (``pipeline/hub.py``).

    ``dtype``: the weights' and activations' precision in the trainer, the reference and
    (``rollout.dtype: auto``) the rollout. ``auto`` becomes ``bfloat16`` where this
    machine has a CUDA GPU and ``float32`` where it has none (bf16 matmuls on most CPUs
    are slow or missing); it is decided when the config is built, so the run directory's
    ``config.yaml`` records the value the run used. A driver without a GPU in front of a
    GPU cluster (``run.address``) should set it."""

    path: str = "tiny"
    revision: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    tiny: TinyModelConfig = TinyModelConfig()
    cache_dir: str = "~/.cache/conveyor"
    lora: LoraConfig = LoraConfig()

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            msgspec.structs.force_setattr(self, "dtype", default_model_dtype())


def default_model_dtype() -> str:
    """``model.dtype: auto``: ``bfloat16`` where this process sees a CUDA GPU, else
    ``float32``. Read from the device nodes and ``CUDA_VISIBLE_DEVICES``, without torch."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return "float32"
    return "bfloat16" if glob.glob("/dev/nvidia[0-9]*") else "float32"
