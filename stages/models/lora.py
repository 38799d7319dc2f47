"""LoRA adapters on the trainer's policy (``model.lora``, through ``peft``), and the full
weights the rollout serves from them.

Guarantees:
- ``apply_lora`` injects adapters into the model in place and returns peft's wrapper;
  the model keeps its class and its module names (a target gains ``base_layer``,
  ``lora_A``, ``lora_B``); only adapter parameters require grad, and nothing here ever
  writes a base parameter. ``all-linear`` is every ``torch.nn.Linear`` but the output
  head (so a mixture of experts' 3D expert tensors are never targets).
- Targets are refused, naming ``model.lora.target_modules``, when none matches, when one
  is not a linear layer, or when its weight is tied to another name (an output head tied
  to the embeddings: the served model holds one tensor for both).
- ``LoraWeights`` maps the module's state to the base model's names (``base_layer``
  removed, adapter tensors left out). ``sync_state`` holds the parameters of every module
  that contains a target (``self_attn``, ``mlp``): vLLM fuses siblings such as
  q/k/v into one layer and reloads a layer whole, so a payload covers whole layers; a
  target's weight is merged, ``W + scale * B @ A`` in float32 from the live tensors (what
  peft's ``merge_and_unload`` computes). ``merged_state`` is the whole merged model.
- The parameters a sync leaves out never change (they are frozen), so ``rest_fingerprint``
  measures them once, in the dtype the rollout serves.
- ``save_adapter`` writes peft's ``adapter_model.safetensors`` and ``adapter_config.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pipeline.config import LoraConfig
from pipeline.weights import Fingerprint, compute_fingerprint, drop_tied_duplicates
from stages.models.checkpoint_names import drop_tied_aliases, find_tied_aliases

ADAPTER = "default"  # peft's name of the one adapter
PEFT_INSTALL = "pip install 'conveyor[lora]' (or pip install peft)"


def import_peft() -> Any:
    """The ``peft`` module; ``ImportError`` naming ``model.lora`` and the pip command."""
    try:
        import peft
    except ImportError as exc:
        raise ImportError(f"model.lora: LoRA needs peft, which is not installed ({exc}); {PEFT_INSTALL}") from None
    return peft


def find_linear_names(model: torch.nn.Module) -> list[str]:
    """Leaf names of every ``torch.nn.Linear`` of ``model`` but its output head, sorted
    (``all-linear``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({name.rpartition(".")[2] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and module is not head and name})


def resolve_target_modules(model: torch.nn.Module, lora: LoraConfig) -> str | list[str]:
    """``lora.target_modules`` as peft takes it (``all-linear`` resolved here)."""
    if lora.target_modules == "all-linear":
        return find_linear_names(model)
    return lora.target_modules


def build_peft_config(model: torch.nn.Module, lora: LoraConfig) -> Any:
    """peft's ``LoraConfig`` for ``lora`` on ``model``."""
    peft = import_peft()
    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=resolve_target_modules(model, lora), bias="none")


def check_targets(model: torch.nn.Module, layers: Mapping[str, Any], lora: LoraConfig) -> None:
    """Refuse (``ValueError`` naming ``model.lora.target_modules``) targets that are not
    linear layers or whose weight is tied (see the module guarantees)."""
    from peft.tuners.lora import Linear as LoraLinear

    field = f"model.lora.target_modules ({lora.target_modules!r})"
    if not layers:
        raise ValueError(f"{field}: matches no module of the model")
    odd = sorted(f"{name} ({type(layer).__name__})" for name, layer in layers.items()
                 if not isinstance(layer, LoraLinear))
    if odd:
        raise ValueError(f"{field}: Conveyor merges adapters into linear layers only; it matched {odd[:3]}")
    aliases = find_tied_aliases(model)
    tied = {*aliases, *aliases.values()}
    bad = sorted(name for name in layers if f"{name}.weight" in tied or f"{name}.base_layer.weight" in tied)
    if bad:
        raise ValueError(f"{field}: {bad[:3]} share their weight with another name (tied embeddings); the served "
                         f"model holds one tensor for both, so they cannot take an adapter of their own")


def find_lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """Module name -> peft LoRA layer, outermost only (each target once)."""
    from peft.tuners.lora import LoraLayer

    found: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not any(name.startswith(f"{outer}.") for outer in found):
            found[name] = module
    return found


def apply_lora(model: torch.nn.Module, lora: LoraConfig) -> Any:
    """Inject ``lora``'s adapters into ``model`` in place; returns peft's wrapper
    (``wrapper.get_base_model() is model``). Raises ``ImportError`` without peft and
    ``ValueError`` for targets it refuses."""
    peft = import_peft()
    try:
        wrapped = peft.get_peft_model(model, build_peft_config(model, lora))
    except ValueError as exc:  # peft: "Target modules ... not found in the base model"
        raise ValueError(f"model.lora.target_modules ({lora.target_modules!r}): {exc}") from None
    check_targets(model, find_lora_layers(model), lora)
    return wrapped


def merge_weight(layer: Any) -> torch.Tensor:
    """A LoRA linear layer's ``W + scale * B @ A``, in float32 whatever the weights' dtype
    (peft's own merge multiplies bf16 adapters in bf16 on a GPU)."""
    with torch.no_grad():
        a = layer.lora_A[ADAPTER].weight.detach().float()
        b = layer.lora_B[ADAPTER].weight.detach().float()
        delta = b @ a
        if layer.fan_in_fan_out:
            delta = delta.T
        return layer.get_base_layer().weight.detach().float() + delta * layer.scaling[ADAPTER]


class LoraWeights:
    """The base model's view of a model with adapters injected (see the module guarantees)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.layers = find_lora_layers(model)
        # module state name -> base name, adapter tensors left out
        self.base_names: dict[str, str] = {}
        for name in model.state_dict(keep_vars=True):
            base = self._to_base_name(name)
            if base is not None:
                self.base_names[name] = base
        parents = sorted({layer.rpartition(".")[0] for layer in self.layers})
        self.sync_names = {base for base in self.base_names.values()
                           if any(not p or base.startswith(f"{p}.") for p in parents)}
        self._rest: dict[Any, Fingerprint] = {}

    def _to_base_name(self, name: str) -> str | None:
        owner = max((layer for layer in self.layers if name.startswith(f"{layer}.")), key=len, default=None)
        if owner is None:
            return name
        tail = name[len(owner) + 1:]
        return f"{owner}.{tail.removeprefix('base_layer.')}" if tail.startswith("base_layer.") else None

    def base_state(self) -> dict[str, torch.Tensor]:
        """Base name -> live tensor (unmerged), tied parameters once."""
        state = self.model.state_dict()
        out = {self.base_names[n]: t for n, t in state.items() if n in self.base_names}
        return drop_tied_aliases(self.model, drop_tied_duplicates(out))

    def _merged(self) -> dict[str, torch.Tensor]:
        return {f"{name}.weight": merge_weight(layer) for name, layer in self.layers.items()}

    def sync_state(self) -> dict[str, torch.Tensor]:
        """What a sync sends: the parameters of the modules holding targets, merged."""
        merged = self._merged()
        return {n: merged.get(n, t) for n, t in self.base_state().items() if n in self.sync_names}

    def merged_state(self) -> dict[str, torch.Tensor]:
        """The whole model, adapters merged, under the base names."""
        merged = self._merged()
        return {n: merged.get(n, t) for n, t in self.base_state().items()}

    def rest_fingerprint(self, dtype: torch.dtype) -> Fingerprint:
        """Fingerprint, in ``dtype``, of the parameters ``sync_state`` leaves out (measured
        once per dtype: they are frozen)."""
        if dtype not in self._rest:
            rest = [t for n, t in self.base_state().items() if n not in self.sync_names]
            self._rest[dtype] = compute_fingerprint(rest, dtype=dtype)
        return self._rest[dtype]


def save_adapter(wrapper: Any, out_dir: Path) -> Path:
    """peft's adapter files (``adapter_model.safetensors``, ``adapter_config.json``) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wrapper.save_pretrained(out, safe_serialization=True)
    return out


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter counts, tied parameters once."""
    seen: dict[int, torch.nn.Parameter] = {id(p): p for p in model.parameters()}
    trainable = sum(p.numel() for p in seen.values() if p.requires_grad)
    return trainable, sum(p.numel() for p in seen.values())


def check_lora_model(model_path: Path, lora: LoraConfig) -> int:
    """Pre-flight: peft is installed and ``lora``'s targets fit the model at
    ``model_path`` (built on the meta device: no weights are read). Returns the number of
    target modules; ``ValueError`` naming ``model.lora`` otherwise."""
    try:
        import_peft()
    except ImportError as exc:
        raise ValueError(str(exc)) from None
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    apply_lora(model, lora)
    return len(find_lora_layers(model))
