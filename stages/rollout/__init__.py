"""Rollout backends: the built-in registry and the factory the actor shell calls.

Guarantees:
- ``BACKENDS`` names the built-ins by import path, so importing this package imports
  neither vLLM nor transformers: ``hf`` works where vLLM is absent, and the vLLM worker
  processes that import ``stages.rollout.vllm_worker_ext`` pay for nothing else.
- ``build_backend`` accepts a built-in name or ``module:attr`` (a class or factory
  called as ``attr(model_path, rollout_cfg, dtype)``) and returns an object that
  satisfies ``RolloutBackend``, not yet started; anything else raises ``ValueError``.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.config import RolloutConfig
from pipeline.plugins import import_object
from stages.rollout.base import (
    Completion,
    GenerationResult,
    RolloutBackend,
    SamplingSettings,
    build_sampling_settings,
)

BACKENDS: dict[str, str] = {
    "vllm": "stages.rollout.vllm_backend:VLLMBackend",
    "hf": "stages.rollout.hf_backend:HFBackend",
}

__all__ = [
    "BACKENDS",
    "Completion",
    "GenerationResult",
    "RolloutBackend",
    "SamplingSettings",
    "build_backend",
    "build_sampling_settings",
    "resolve_backend",
]


def resolve_backend(name_or_import_path: str) -> object:
    """``vllm`` / ``hf`` / ``module:attr`` -> the class or factory it names."""
    target = BACKENDS.get(name_or_import_path, name_or_import_path)
    if ":" not in target:
        raise ValueError(
            f"rollout.backend: expected one of {sorted(BACKENDS)} or 'module:attr', "
            f"got {name_or_import_path!r}"
        )
    try:
        return import_object(target, "rollout.backend")
    except ImportError as exc:
        raise ValueError(str(exc)) from None


def build_backend(
    name_or_import_path: str, model_path: Path, rollout_cfg: RolloutConfig, dtype: str
) -> RolloutBackend:
    """Construct (not start) the backend named by ``rollout.backend``."""
    factory = resolve_backend(name_or_import_path)
    if not callable(factory):
        raise ValueError(f"rollout.backend: {name_or_import_path!r} is not callable")
    backend = factory(Path(model_path), rollout_cfg, dtype)
    if not isinstance(backend, RolloutBackend):
        raise ValueError(
            f"rollout.backend: {name_or_import_path!r} built a {type(backend).__name__}, "
            f"which lacks the RolloutBackend methods (start, generate, update_weights, "
            f"live_fingerprint, shutdown, version)"
        )
    return backend
