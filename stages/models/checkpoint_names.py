"""Weights named as checkpoints name them: the layout rollout engines load.

transformers converts some checkpoints while it loads them. A mixture-of-experts layer's
experts, stored one expert at a time (``mlp.experts.<e>.gate_proj.weight``, ``up_proj``,
``down_proj``; Mixtral's ``block_sparse_moe.experts.<e>.w1/w3/w2``), become two 3D
tensors in the module (``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``).
Checkpoints on disk and vLLM's loaders spell them one expert at a time.

Guarantees:
- ``checkpoint_state_dict(model, state)`` is ``state`` (the module's names) renamed and
  split as the model's checkpoints spell it, by transformers' own reverse conversion
  (what ``save_pretrained`` writes). It holds the same elements, so fingerprints agree.
  For a model without load-time conversions (the dense families) it is ``state``
  itself, in the same order.
- ``drop_tied_aliases(model, state)`` keeps one name per tied parameter (the source
  name, which the served model holds), whether or not the tensors still share storage.
- ``CheckpointLayout(model)`` is the inverse, for a receiver that holds the module
  (``identity`` when there is nothing to invert): ``assemble(weights)`` puts
  checkpoint-named tensors back together under the module's names, and refuses,
  naming them, unknown names, wrong shapes and module tensors only partly covered.
  The map is found by converting, once and one module tensor at a time, tensors that
  hold every element's position rather than its value: exact for any conversion that
  renames, splits, concatenates or transposes one module tensor. A model without
  load-time conversions costs nothing: its payload is the module's own names.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch

_CONVERTS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def has_conversions(model: Any) -> bool:
    """Whether transformers converts ``model``'s checkpoints while loading them (asked
    once per model: transformers hands back the very dict when there is nothing to do)."""
    if model not in _CONVERTS:
        from transformers.core_model_loading import revert_weight_conversion

        probe: dict[str, torch.Tensor] = {}
        _CONVERTS[model] = revert_weight_conversion(model, probe) is not probe
    return _CONVERTS[model]


def find_tied_aliases(model: Any) -> dict[str, str]:
    """Alias -> source of every parameter ``model`` ties (``lm_head.weight`` ->
    ``model.embed_tokens.weight`` with tied embeddings): those transformers declares
    (``all_tied_weights_keys``, only where the config ties them) and any parameter
    reachable under two names. A rollout engine serving the model holds the source
    alone (vLLM's tied families register no output head of their own)."""
    aliases = {str(k): str(v) for k, v in (getattr(model, "all_tied_weights_keys", None) or {}).items()}
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases.setdefault(name, first[id(param)])
        else:
            first[id(param)] = name
    return aliases


def find_split_ties(model: Any) -> list[str]:
    """``alias -> source`` of the ties transformers declares whose two names are not one
    parameter (an engine that copied one of them): empty for a sound model."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return [f"{alias} -> {source}" for alias, source in find_tied_aliases(model).items()
            if alias in params and source in params and params[alias] is not params[source]]


def drop_tied_aliases(model: Any, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the aliases of tied parameters whose source it holds: each tied
    tensor is sent once, under the name the served model holds."""
    aliases = find_tied_aliases(model)
    return {name: t for name, t in state.items() if aliases.get(name) not in state}


def checkpoint_state_dict(model: Any, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` as the model's checkpoints name and shape it (see module guarantees)."""
    if not has_conversions(model):
        return dict(state)
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(model, dict(state))
    return out if isinstance(out, dict) else dict(out)


class CheckpointLayout:
    """Where each checkpoint-named tensor lives in ``model`` (see module guarantees)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.identity = not has_conversions(model)
        # checkpoint name -> (module name, flat positions in it or None for all of it
        # in order, checkpoint shape)
        self._where: dict[str, tuple[str, torch.Tensor | None, torch.Size]] = {}
        self._shapes: dict[str, torch.Size] = {}  # module name -> its tensor's shape
        if self.identity:
            return
        # One module tensor at a time: each checkpoint tensor comes from one of them,
        # and the positions never take more memory than the largest tensor's.
        for name, tensor in model.state_dict(keep_vars=True).items():
            self._shapes[name] = tensor.shape
            positions = torch.arange(tensor.numel(), dtype=torch.int64).view(tensor.shape)
            try:
                converted = checkpoint_state_dict(model, {name: positions})
            except Exception as err:  # a conversion that needs several module tensors at once
                raise ValueError(f"{name}: its checkpoint conversion cannot be inverted in place ({err})") from err
            for ckpt, pos in converted.items():
                whole = ckpt == name and pos.shape == tensor.shape and torch.equal(pos, positions)
                self._where[ckpt] = (name, None if whole else pos.reshape(-1), pos.shape)

    def assemble(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint-named ``weights`` under the module's names, each module tensor put
        together from its parts. Raises ``ValueError`` naming what does not fit: an
        unknown name, a wrong shape, a module tensor only partly covered."""
        shapes = self._shapes
        out: dict[str, torch.Tensor] = {}
        filled: dict[str, int] = {}
        unknown, misshaped = [], []
        for name, tensor in weights.items():
            if name not in self._where:
                unknown.append(name)
                continue
            source, flat, shape = self._where[name]
            if tuple(tensor.shape) != tuple(shape):
                misshaped.append(f"{name} {tuple(tensor.shape)} != {tuple(shape)}")
                continue
            if source not in out:
                out[source] = torch.empty(shapes[source].numel(), dtype=tensor.dtype, device=tensor.device)
                filled[source] = 0
            if flat is None:
                out[source].copy_(tensor.reshape(-1))
            else:
                out[source][flat.to(tensor.device)] = tensor.reshape(-1)
            filled[source] += tensor.numel()
        partial = [s for s in out if filled[s] != shapes[s].numel()]
        if unknown or misshaped or partial:
            raise ValueError(f"payload does not fit the model's checkpoint layout: unknown names {sorted(unknown)[:5]}, "
                             f"wrong shapes {sorted(misshaped)[:5]}, partly covered {sorted(partial)[:5]}")
        return {source: flat.view(shapes[source]) for source, flat in out.items()}
