"""Dtype names: the one map from the names configs, model configs and weight payloads use
to their sizes, and from a name to torch's dtype.

Guarantees:
- ``DTYPE_BYTES`` lists every dtype name the system reads or writes, with its size in
  bytes; importing this module imports no torch (the plumbing sizes memory without it).
- ``resolve_dtype`` gives torch's dtype for a listed name (a torch dtype passes through)
  and raises ``ValueError`` naming the field for anything else; ``format_dtype`` is its
  inverse for the listed dtypes.
"""

from __future__ import annotations

from typing import Any

DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1,
}
# What a model's weights and activations may be in (model.dtype, rollout.dtype, ...).
MODEL_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def resolve_dtype(dtype: Any, field: str = "dtype", allowed: tuple[str, ...] | None = None) -> Any:
    """``"bfloat16"`` or ``torch.bfloat16`` -> ``torch.bfloat16``; ``allowed``: the names
    accepted here (default: every listed one), e.g. ``MODEL_DTYPES`` for a model."""
    import torch

    names = tuple(DTYPE_BYTES) if allowed is None else allowed
    if isinstance(dtype, torch.dtype):
        if allowed is not None and str(dtype).removeprefix("torch.") not in names:
            raise ValueError(f"{field}: expected one of {sorted(names)}, got {dtype!r}")
        return dtype
    if dtype not in names:
        raise ValueError(f"{field}: expected one of {sorted(names)}, got {dtype!r}")
    return getattr(torch, dtype)


def format_dtype(dtype: Any, field: str = "dtype") -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (a listed dtype; ``ValueError`` otherwise)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"{field}: expected one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return name
