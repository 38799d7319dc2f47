"""Code named by import path: the one resolver of ``module:attr``, and the one list of
what ``pipeline`` calls in ``stages`` and ``bench``.

Guarantees:
- ``pipeline`` holds no import statement of ``stages`` or ``bench`` (a unit test reads
  every module): it reaches them only through the paths below, imported when first
  called. Importing ``pipeline.launch`` or ``pipeline.cli`` therefore loads no model
  code, and the plumbing can be tested, and replaced piece by piece, without it.
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

# The built-in stages, by the name they have in a launched graph.
STAGE_CLASSES: dict[str, str] = {
    "source": "stages.source:PromptSource",
    "pairs": "stages.pairs:PairSource",  # the source of an offline algorithm (dpo)
    "rollout": "stages.rollout.stage:RolloutStage",
    "reward": "stages.reward:RewardStage",
    "reward_model": "stages.reward_model:RewardModelStage",
    "reference": "stages.reference:ReferenceStage",
    "critic": "stages.critic:CriticStage",
    "trainer": "stages.trainer:TrainerStage",
    "ppo_trainer": "stages.ppo_trainer:PPOTrainerStage",  # the trainer with train.ppo_epochs/mini-batches
}

# What the plumbing asks of model-aware code (pre-flight, plan, replay, CLI).
BUILTINS: dict[str, str] = {
    "resolve_model_path": "stages.tiny:resolve_model_path",  # model.path, "tiny" built locally
    "load_tokenizer": "stages.prompt_rows:load_tokenizer",
    "check_data_file": "stages.prompt_rows:check_data_file",
    "load_task": "stages.tasks:load_task",
    "resolve_reward_spec": "stages.reward:resolve_reward_spec",
    "split_file_spec": "stages.reward:split_file_spec",
    "build_reward_fn": "stages.reward:build_reward_fn",
    "build_trainer_engine": "stages.trainer:build_trainer_engine",
    "load_tools": "stages.tools:load_tools",
    "check_engine_kwargs": "stages.rollout.vllm_backend:check_engine_kwargs",
    "train_recorded_step": "stages.trainer:train_recorded_step",  # replay: the trainer's own rules
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
