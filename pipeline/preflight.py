"""Pre-flight: every path and import a run needs, checked before Ray starts.

Guarantees of ``run_preflight``:
- It starts no Ray cluster and no actor; it either returns a ``PreflightReport`` or
  raises ``ConfigError`` whose message begins with the field at fault (``model.path``,
  ``data.path``, ``data.prompt_key``, ``data.chat_template``, ``reward.function``,
  ``reference.path``, ``rollout.backend``, ``dataflow.nodes[i].node_class``...), which
  the CLI turns into exit status 2.
- First, Hugging Face Hub ids in ``model.path``, ``reference.path``, ``data.path`` and
  ``eval.path`` are fetched into the user's Hub cache and replaced by local paths
  (``pipeline/hub.py``).
- Checked, in order: the model directory (or ``tiny``, built locally) and its tokenizer;
  the reference checkpoint when a reference runs; the rollout backend and custom node
  classes named by ``module:attr`` (imported, not started) and the rollout's tools
  (``rollout.tools.functions``, loaded); the data (``data.path``
  read once, streaming, and validated whole: rows in total and skipped by reason, a
  file without one usable row is refused; or ``data.task`` loaded); the held-out set
  (``eval.path``) the same way, its errors naming ``eval.*``; the reward function
  (imported or loaded from its file, its signature recognised); with ``train.compile:
  on``, a compiler for torch.compile's kernels (``find_compiler``); with
  ``train.router_aux_loss_coef`` above 0, a router in the model (its ``config.json``
  configures ``output_router_logits``, as transformers' mixtures of experts do); with
  ``model.lora``, peft installed and the target modules found in the model; the
  trackers of ``run.trackers`` installed (``pipeline/trackers.py``).
- The returned config has ``data.path``, ``eval.path``, a reward file's and a tools file's path
  made absolute, so actors started in another working directory read the same files.

The model-aware checks live in ``stages/`` and are reached by import path
(``pipeline/plugins.py``) when a check runs, so importing this module loads no model code.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from pipeline.config import ConfigError, ConveyorConfig
from pipeline.hub import resolve_hub_names
from pipeline.plugins import import_object, load_builtin
from pipeline.trackers import check_trackers


@dataclass
class PreflightReport:
    """What the checks found: the resolved model path, the data report (file data
    only) and the reward function's name."""

    model_path: str
    reward_function: str
    data: Any = None  # stages.data.prompt_rows.DataReport when data.path is set
    notes: list[str] = field(default_factory=list)
    eval_data: Any = None  # the same for eval.path, when set

    def to_summary(self) -> dict[str, Any]:
        """Keys for ``summary.json``: ``data/rows_total``, ``data/rows_skipped/<reason>``..."""
        return self.data.to_summary() if self.data is not None else {}

    def describe(self) -> str:
        lines = [f"preflight: model {self.model_path}; reward {self.reward_function}"]
        if self.data is not None:
            lines.append(self.data.describe())
        if self.eval_data is not None:
            lines.append(self.eval_data.describe("eval"))
        return "\n".join(lines + self.notes)


def run_preflight(cfg: ConveyorConfig) -> tuple[ConveyorConfig, PreflightReport]:
    """Run every check (see the module guarantees); return the config with absolute
    data and reward-file paths, and the report."""
    cfg, hub_notes = resolve_hub_names(cfg)
    model_path, tokenizer = check_model(cfg)
    check_router_loss(cfg, model_path)
    check_lora(cfg, model_path)
    check_reference(cfg)
    check_imports(cfg)
    check_compile(cfg)
    check_trackers(cfg.run.trackers if cfg.run.tensorboard else [t for t in cfg.run.trackers if t != "tensorboard"])
    cfg = absolutise_paths(cfg)
    data = check_data(cfg, tokenizer, model_path)
    eval_data = check_eval_data(cfg, tokenizer, model_path)
    reward = check_reward(cfg)
    return cfg, PreflightReport(model_path=str(model_path), reward_function=reward, data=data, eval_data=eval_data,
                                notes=hub_notes + check_learning_settings(cfg, model_path))


# Above this rate a pretrained checkpoint is usually wrecked by RL (verl and TRL default
# to 1e-6); models at least this wide are not the embedded tiny ones.
LR_WARN_ABOVE = 1e-4
TINY_HIDDEN_BELOW = 512


def check_learning_settings(cfg: ConveyorConfig, model_path: Path) -> list[str]:
    """Warnings (the report's notes) for settings that run but are rarely meant: a
    learning rate above ``LR_WARN_ABOVE`` on a model at least ``TINY_HIDDEN_BELOW`` wide,
    and a KL penalty both in the reward and in the loss."""
    notes = []
    hidden = read_hidden_size(model_path)
    if cfg.train.lr > LR_WARN_ABOVE and hidden >= TINY_HIDDEN_BELOW:
        notes.append(f"warning: train.lr {cfg.train.lr:g} is above {LR_WARN_ABOVE:g} for the model at {model_path} "
                     f"(hidden size {hidden}); RL on a pretrained checkpoint runs at about 1e-6 (verl's and TRL's "
                     f"default, and Conveyor's): set train.lr to that order")
    algo = cfg.algorithm
    if algo.use_kl_in_reward and algo.kl_coef > 0:
        notes.append(f"warning: algorithm.use_kl_in_reward subtracts a KL penalty from the reward and "
                     f"algorithm.kl_coef {algo.kl_coef:g} adds another to the loss: KL is applied twice; set "
                     f"algorithm.kl_coef=0 to keep only the reward's")
    return notes


def read_hidden_size(model_path: Path) -> int:
    """The model's hidden size from its ``config.json`` (a multimodal one's text
    config); 0 when it names none."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    config = config.get("text_config", config)
    for key in ("hidden_size", "d_model", "n_embd"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return 0


def check_model(cfg: ConveyorConfig) -> tuple[Path, Any]:
    """``model.path`` resolved (``tiny`` is built locally) and its tokenizer loaded."""
    try:
        path = load_builtin("resolve_model_path")(cfg.model)
        return path, load_builtin("load_tokenizer")(path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_router_loss(cfg: ConveyorConfig, model_path: Path) -> None:
    """A router load-balancing loss needs a model with a router."""
    coef = cfg.train.router_aux_loss_coef
    if not coef:
        return
    try:
        config = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"train.router_aux_loss_coef: cannot read {model_path / 'config.json'} ({exc})") from None
    if "output_router_logits" not in config:
        raise ConfigError(f"train.router_aux_loss_coef: {coef:g} needs a mixture of experts, but the model at "
                          f"{model_path} ({config.get('model_type', 'unknown type')}) has no router "
                          f"(no output_router_logits in its config.json); set it to 0")


def check_lora(cfg: ConveyorConfig, model_path: Path) -> None:
    """``model.lora`` with a rank: peft installed (else the pip command) and the target
    modules found in the model, linear and untied."""
    if not cfg.model.lora.enabled:
        return
    try:
        load_builtin("check_lora_model")(model_path, cfg.model.lora)
    except ValueError as exc:
        text = str(exc)
        raise ConfigError(text if text.startswith("model.lora") else f"model.lora: {text}") from None


def check_reference(cfg: ConveyorConfig) -> None:
    """``reference.path``, when a reference model runs and a path is given: a checkpoint dir."""
    path = cfg.reference.path
    if not cfg.reference_enabled or path is None or path == "tiny":
        return
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        what = "no config.json in it" if p.is_dir() else "not a directory"
        raise ConfigError(f"reference.path: expected a local Hugging Face checkpoint directory, got {path!r} ({what})")


def check_imports(cfg: ConveyorConfig) -> None:
    """Every ``module:attr`` a run names, imported (nothing is constructed)."""
    if ":" in cfg.rollout.backend:
        _import(cfg.rollout.backend, "rollout.backend")
    for i, node in enumerate(cfg.dataflow.nodes):
        _import(node.node_class, f"dataflow.nodes[{i}].node_class")
    if cfg.rollout.tools is not None:
        try:
            load_builtin("load_tools")(cfg.rollout.tools.functions)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if cfg.rollout.engine_kwargs and cfg.rollout.backend == "vllm":
        # Imports vLLM here only when engine arguments were given; importing it sets
        # environment variables, which the actors started after this would inherit.
        saved = dict(os.environ)
        try:
            load_builtin("check_engine_kwargs")(cfg.rollout.engine_kwargs)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        finally:
            os.environ.clear()
            os.environ.update(saved)


def find_compiler(on_gpu: bool) -> str | None:
    """The compiler torch.compile would build its kernels with, found on PATH, or None:
    on a GPU Triton's C launcher (``$CC``, else gcc, else clang), on CPU inductor's C++
    (``$CXX``, else g++), as those two look for them."""
    if on_gpu:
        tools = [os.environ["CC"]] if os.environ.get("CC") else ["gcc", "clang"]
    else:
        tools = [os.environ.get("CXX") or "g++"]
    return next((found for found in map(shutil.which, tools) if found), None)


def check_compile(cfg: ConveyorConfig) -> None:
    """``train.compile: on`` compiles wherever the trainer runs: refused when this
    machine has neither compiler (``auto`` leaves such a trainer eager instead)."""
    if cfg.train.compile == "on" and find_compiler(on_gpu=True) is None and find_compiler(on_gpu=False) is None:
        raise ConfigError("train.compile: on needs a compiler for torch.compile's kernels on PATH, a C compiler "
                          "on a GPU ($CC, gcc or clang) or a C++ one on CPU ($CXX or g++); none found. "
                          "Set train.compile: auto (eager without one) or off")


def _import(spec: str, field_name: str) -> Any:
    try:
        return import_object(spec, field_name)
    except ImportError as exc:
        raise ConfigError(str(exc)) from None
    except Exception as exc:  # the module itself raised while importing
        raise ConfigError(f"{field_name}: importing {spec!r} raised {type(exc).__name__}: {exc}") from None


def absolutise_paths(cfg: ConveyorConfig) -> ConveyorConfig:
    """``data.path``, ``eval.path``, a reward ``file.py:name`` and a tools ``file.py:NAME``
    made absolute (``~`` expanded)."""
    data, reward, ev = cfg.data, cfg.reward, cfg.eval
    if data.path:
        data = msgspec.structs.replace(data, path=str(Path(data.path).expanduser().absolute()))
    if ev.path:
        ev = msgspec.structs.replace(ev, path=str(Path(ev.path).expanduser().absolute()))
    spec = load_builtin("resolve_reward_spec")(reward)
    file_spec = load_builtin("split_file_spec")(spec)
    if file_spec is not None:
        file, name = file_spec
        reward = msgspec.structs.replace(reward, function=f"{Path(file).expanduser().absolute()}:{name}", path=None)
    rollout = cfg.rollout
    if rollout.tools is not None and ".py:" in rollout.tools.functions:
        file, _, name = rollout.tools.functions.rpartition(":")
        tools = msgspec.structs.replace(rollout.tools, functions=f"{Path(file).expanduser().absolute()}:{name}")
        rollout = msgspec.structs.replace(rollout, tools=tools)
    return msgspec.structs.replace(cfg, data=data, reward=reward, rollout=rollout, eval=ev)


def check_data(cfg: ConveyorConfig, tokenizer: Any, model_path: Path) -> Any:
    """``data.path`` validated whole (a ``DataReport``), or ``data.task`` loaded (None)."""
    if cfg.data.path:
        return load_builtin("check_data_file")(cfg.data, tokenizer, model_path)
    try:
        load_builtin("load_task")(cfg.data.task, **cfg.data.task_kwargs)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return None


def check_eval_data(cfg: ConveyorConfig, tokenizer: Any, model_path: Path) -> Any:
    """``eval.path`` validated whole as ``data.path`` is (a ``DataReport``; None when
    ``eval`` is off): read with ``data``'s chat template and prompt length."""
    ev = cfg.eval
    if not ev.enabled:
        return None
    held_out = msgspec.structs.replace(cfg.data, path=ev.path, prompt_key=ev.prompt_key, answer_key=ev.answer_key,
                                       max_tokens_field=None, min_tokens_field=None, curriculum=None, pairs=None)
    return load_builtin("check_data_file")(held_out, tokenizer, model_path, "eval")


def check_reward(cfg: ConveyorConfig) -> str:
    """The reward function loads and its calling convention is recognised; its name."""
    spec = load_builtin("resolve_reward_spec")(cfg.reward)
    try:
        task = load_builtin("load_task")(cfg.data.task, **cfg.data.task_kwargs) if spec == "task" else None
        return load_builtin("build_reward_fn")(spec, task, cfg.reward.signature, cfg.reward.on_error, cfg.reward.timeout_s).name
    except ValueError as exc:
        text = str(exc)
        raise ConfigError(text if text.startswith(("reward.", "data.")) else f"reward.function: {text}") from None
