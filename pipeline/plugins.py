"""Code named by import path: the one resolver of ``module:attr``, the registry of the
stages a launched graph names, and the one list of what ``pipeline`` calls in ``stages``
and ``bench``.

Guarantees:
- ``pipeline`` holds no import statement of ``stages`` or ``bench`` (a unit test reads
  every module): it reaches them only through the paths below, imported when first
  called. Importing ``pipeline.launch`` or ``pipeline.cli`` therefore loads no model
  code, and the plumbing can be tested, and replaced piece by piece, without it.
- A stage registers itself (``@register_stage("trainer")`` on its class); ``pipeline``
  names no stage class. ``stage_class`` imports the modules that ``stages.STAGE_MODULES``
  lists (``BUILTIN_STAGES``) the first time a graph asks for a stage by name, so the
  registry is whole before it is read.
- ``load_file_object`` is the only place a ``.py`` file becomes a module (reward files,
  DataFlow scripts).
- ``import_object`` is the only place a ``module:attr`` string becomes an object
  (built-in stages, custom nodes, rollout backends, tasks, the trainer engine a replay
  builds, benchmarks). Its errors are ``ImportError``s whose message begins with the
  config field (or command) that named the path.
"""

from __future__ import annotations

import importlib
from typing import Any

# The modules whose classes register the built-in stages (a tuple of module names).
BUILTIN_STAGES = "stages:STAGE_MODULES"
_STAGES: dict[str, type] = {}  # name in a launched graph -> its class, filled by ``register_stage``

# What the plumbing asks of model-aware code (pre-flight, plan, replay, CLI).
BUILTINS: dict[str, str] = {
    "resolve_model_path": "stages.models.tiny:resolve_model_path",  # model.path, "tiny" built locally
    "load_tokenizer": "stages.data.prompt_rows:load_tokenizer",
    "check_data_file": "stages.data.prompt_rows:check_data_file",
    "load_task": "stages.data.tasks:load_task",
    "resolve_reward_spec": "stages.rewards.reward:resolve_reward_spec",
    "split_file_spec": "stages.rewards.reward:split_file_spec",
    "build_reward_fn": "stages.rewards.reward:build_reward_fn",
    "build_trainer_engine": "stages.trainer.engine:build_trainer_engine",
    "load_tools": "stages.rollout.tools:load_tools",
    "check_lora_model": "stages.models.lora:check_lora_model",  # model.lora: peft installed, targets fit
    "check_engine_kwargs": "stages.rollout.vllm_backend:check_engine_kwargs",
    "train_recorded_step": "stages.trainer.stage:train_recorded_step",  # replay: the trainer's own rules
    "bench": "bench.__main__:main",  # conveyor bench NAME
    # Importing it imports every module of stages/algorithms: each registers its config.
    "get_algorithm": "stages.algorithms.registry:get_algorithm",
}


def import_object(path: str, what: str = "object") -> Any:
    """``"package.module:attr"`` -> the attribute; errors (``ImportError``) start with ``what``."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ImportError(f"{what}: expected 'module:attr', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"{what}: cannot import module {module_name!r} ({exc})") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportError(f"{what}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_file_object(file: str, name: str, what: str, prefix: str = "conveyor_file") -> Any:
    """``name`` from the Python file ``file``, executed as a module of its own (once per
    process: the module is keyed by the file's absolute path). Errors are ``ValueError``s
    whose message begins with ``what`` (the config field or option that named the file)."""
    import hashlib
    import importlib.util
    import inspect
    import sys
    from pathlib import Path

    path = Path(file).expanduser()
    if not path.is_file():
        raise ValueError(f"{what}: {file!r} does not exist (expected a .py file defining {name})")
    resolved = path.resolve()
    module_name = f"{prefix}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:12]}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, resolved)
        if spec is None or spec.loader is None:
            raise ValueError(f"{what}: {file!r} cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # before running it: dataclasses and pickling look it up
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:
            del sys.modules[module_name]
            raise ValueError(f"{what}: loading {file!r} raised {type(exc).__name__}: {exc}") from None
    if not hasattr(module, name):
        defined = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise ValueError(f"{what}: {file!r} defines no {name!r} (its functions: {', '.join(defined) or 'none'})")
    return getattr(module, name)


def load_builtin(name: str) -> Any:
    """The object ``BUILTINS[name]`` names (``KeyError`` for a name not listed)."""
    return import_object(BUILTINS[name], name)


def register_stage(name: str) -> Any:
    """Class decorator: the stage is ``name`` in a launched graph (``stage_class(name)``).
    A second class under a taken name is a ``ValueError`` naming both."""

    def register(cls: type) -> type:
        taken = _STAGES.get(name)
        if taken is not None and _path_of(taken) != _path_of(cls):
            raise ValueError(f"stage {name!r}: registered by {_path_of(taken)}, again by {_path_of(cls)}")
        _STAGES[name] = cls
        return cls

    return register


def stage_class(name: str) -> type:
    """The class registered as ``name``, once every module of ``BUILTIN_STAGES`` is imported
    (``KeyError`` naming the registered stages for another name)."""
    _import_builtin_stages()
    if name not in _STAGES:
        raise KeyError(f"no stage registered as {name!r} (registered: {', '.join(sorted(_STAGES))})")
    return _STAGES[name]


def registered_stages() -> dict[str, type]:
    """Every registered stage by name (the built-ins imported first)."""
    _import_builtin_stages()
    return dict(_STAGES)


def _import_builtin_stages() -> None:
    for module in import_object(BUILTIN_STAGES, "built-in stages"):
        importlib.import_module(module)  # its classes register themselves


def _path_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"
