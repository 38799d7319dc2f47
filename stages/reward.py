"""Reward-function adapters: the pure core of the reward stage (no Ray, no I/O).

Two signatures are accepted, detected from parameter names (``reward.signature: auto``)
or forced (``score`` / ``batched``):
- verl-style, per sample: ``compute_score(data_source, solution_str, ground_truth,
  extra_info=None) -> float | dict``; a dict carries the reward under ``"score"`` and any
  other numeric keys become extras.
- TRL-style, batched: ``f(prompts, completions, **columns) -> list[float]`` with the
  columns ``ground_truth``, ``data_source`` and ``extra_info`` as lists (one per sample).

Guarantees of ``RewardFn.score``:
- Every sample gets a finite float32 reward. A sample whose function call raises, or
  returns a non-number, NaN or inf, gets ``on_error`` and one entry in ``errors``
  (``"<sample index>: <ExceptionType>: message"`` or ``"<i>: returned non-number ..."``);
  the other samples are scored normally. A batched function that raises as a whole is
  called again one sample at a time, so one bad sample cannot fail its batch.
- A batched function returning the wrong number of values is a bug, not a sample
  failure: it raises ``RewardShapeError`` (a ValueError) naming the function and both lengths.
- ``extras[key]`` has one value per sample, NaN where that sample gave none.

``RewardStage`` is the thin actor shell: it scores each micro-batch in a thread and
logs every failed sample with its error; the run goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from pipeline.types import Prompt
from stages.tasks import import_attr

Signature = Literal["auto", "score", "batched"]

# Keep error strings short: they travel with every batch and end up in logs.
_MAX_MESSAGE_CHARS = 300
_SCORE_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
_COLUMNS = ("ground_truth", "data_source", "extra_info")


class RewardShapeError(ValueError):
    """A batched reward function returned the wrong number of values (a bug in it)."""


@dataclass(frozen=True)
class RewardResult:
    """Rewards of one micro-batch: ``rewards`` [S] float32, errors, extras (each [S])."""

    rewards: np.ndarray
    errors: list[str] = field(default_factory=list)
    extras: dict[str, list[float]] = field(default_factory=dict)


class RewardFn:
    """A user or task reward function behind one calling convention; see the module."""

    def __init__(self, fn: Callable[..., Any], signature: Literal["score", "batched"], on_error: float, name: str) -> None:
        self.fn = fn
        self.signature = signature
        self.on_error = float(on_error)
        self.name = name
        self._params, self._var_kw = _describe_params(fn)

    def score(self, prompts: Sequence[Prompt], group_size: int, completions: Sequence[str]) -> RewardResult:
        """Score ``completions`` [S]; sample ``i`` answers ``prompts[i // group_size]``."""
        num = len(prompts) * group_size
        if len(completions) != num:
            raise ValueError(
                f"reward: got {len(completions)} completions for {len(prompts)} prompts x "
                f"group_size {group_size} = {num} samples"
            )
        owners = [prompts[i // group_size] for i in range(num)]
        if self.signature == "score":
            raw = [self._call_one(p, c) for p, c in zip(owners, completions, strict=True)]
        else:
            raw = self._call_batched(owners, list(completions))
        return self._collect(raw)

    # ------------------------------------------------------------------ calling

    def _call_one(self, prompt: Prompt, completion: str) -> Any:
        """The function's value for one sample, or the exception it raised."""
        values = (prompt.data_source, completion, prompt.ground_truth, prompt.extra_info)
        try:
            if "solution_str" in self._params:
                kwargs = {
                    k: v for k, v in zip(_SCORE_PARAMS, values, strict=True) if k in self._params or self._var_kw
                }
                return self.fn(**kwargs)
            # Forced "score" with other parameter names: verl's positional order.
            return self.fn(*values[: max(3, min(4, len(self._params)))])
        except Exception as exc:  # any user error becomes this sample's error
            return exc

    def _call_batched(self, owners: list[Prompt], completions: list[str]) -> list[Any]:
        try:
            return self._invoke_batched(owners, completions)
        except RewardShapeError:
            raise
        except Exception:  # retry per sample to isolate the bad one
            return [self._call_batched_single(p, c) for p, c in zip(owners, completions, strict=True)]

    def _call_batched_single(self, prompt: Prompt, completion: str) -> Any:
        try:
            return self._invoke_batched([prompt], [completion])[0]
        except RewardShapeError:
            raise  # a wrong-length result is a bug, not this sample's failure
        except Exception as exc:  # any user error becomes this sample's error
            return exc

    def _invoke_batched(self, owners: list[Prompt], completions: list[str]) -> list[Any]:
        columns = {
            "ground_truth": [p.ground_truth for p in owners],
            "data_source": [p.data_source for p in owners],
            "extra_info": [p.extra_info for p in owners],
        }
        texts = [p.text for p in owners]
        kwargs = {k: v for k, v in columns.items() if k in self._params or self._var_kw}
        if "completions" in self._params:
            out = self.fn(prompts=texts, completions=completions, **kwargs)
        else:
            out = self.fn(texts, completions, **kwargs)
        if hasattr(out, "tolist"):  # numpy array or torch tensor
            out = out.tolist()
        if not isinstance(out, (list, tuple)) or len(out) != len(completions):
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else f"a {type(out).__name__}"
            raise RewardShapeError(
                f"reward function {self.name} returned {got} for {len(completions)} "
                f"completions; a batched reward function must return one number per completion"
            )
        return list(out)

    # ------------------------------------------------------------------ collecting

    def _collect(self, raw: list[Any]) -> RewardResult:
        num = len(raw)
        rewards = np.full(num, self.on_error, dtype=np.float32)
        errors: list[str] = []
        extras: dict[str, list[float]] = {}
        for i, value in enumerate(raw):
            if isinstance(value, Exception):
                message = str(value).replace("\n", " ")[:_MAX_MESSAGE_CHARS]
                errors.append(f"{i}: {type(value).__name__}: {message}")
                continue
            score, sample_extras, problem = parse_reward_value(value)
            for key, extra in sample_extras.items():
                extras.setdefault(key, [math.nan] * num)[i] = extra
            if problem is not None:
                errors.append(f"{i}: {problem}")
            else:
                rewards[i] = score
        return RewardResult(rewards=rewards, errors=errors, extras=extras)


def parse_reward_value(value: Any) -> tuple[float, dict[str, float], str | None]:
    """One returned value -> (score, numeric extras, problem or None).

    Accepts a real number (Python, numpy or a 0-d array/tensor) or a dict with a
    ``"score"`` number; a problem string is returned for anything else and for NaN/inf.
    """
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return 0.0, extras, f"returned a dict without 'score' (keys: {sorted(map(str, value))})"
        for key, extra in value.items():
            number = _as_real(extra)
            if key != "score" and number is not None:
                extras[str(key)] = number
        value = value["score"]
    number = _as_real(value)
    if number is None:
        return 0.0, extras, f"returned non-number {_short_repr(value)}"
    if not math.isfinite(number):
        return 0.0, extras, f"returned non-finite {number}"
    return number, extras, None


def detect_signature(fn: Callable[..., Any], name: str) -> Literal["score", "batched"]:
    """``score`` if the function takes ``solution_str``/``data_source``, ``batched`` if
    it takes ``prompts``/``completions``; otherwise a ValueError naming reward.signature."""
    params, _ = _describe_params(fn)
    if "completions" in params or "prompts" in params:
        return "batched"
    if "solution_str" in params or "data_source" in params:
        return "score"
    raise ValueError(
        f"reward.signature: cannot tell how to call {name}{_safe_signature(fn)}; expected "
        f"(data_source, solution_str, ground_truth, extra_info=None) or "
        f"(prompts, completions, **columns), or set reward.signature to 'score' or 'batched'"
    )


def build_reward_fn(spec: str, task: Any = None, signature: Signature = "auto", on_error: float = 0.0) -> RewardFn:
    """``spec`` is ``"task"`` (the data task's ``compute_score``) or ``"module:attr"``."""
    if spec == "task":
        if task is None or not callable(getattr(task, "compute_score", None)):
            raise ValueError("reward.function: 'task' needs a data task with compute_score(...)")
        fn, name = task.compute_score, f"{type(task).__name__}.compute_score"
    elif ":" in spec:
        fn, name = import_attr(spec, "reward.function"), spec
        if not callable(fn):
            raise ValueError(f"reward.function: {spec!r} is a {type(fn).__name__}, not a function")
    else:
        raise ValueError(f"reward.function: expected 'task' or 'module:attr', got {spec!r}")
    if signature == "auto":
        resolved = detect_signature(fn, name)
    elif signature in ("score", "batched"):
        resolved = signature
    else:
        raise ValueError(f"reward.signature: expected 'auto', 'score' or 'batched', got {signature!r}")
    return RewardFn(fn, resolved, on_error, name)


def _describe_params(fn: Callable[..., Any]) -> tuple[list[str], bool]:
    """Parameter names and whether the function takes ``**kwargs``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return [], True  # a builtin without metadata: pass everything by keyword
    names = [p.name for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw


def _safe_signature(fn: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _as_real(value: Any) -> float | None:
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class RewardStage:
    """Actor shell around ``RewardFn`` (``reward.function``, ``reward.signature``, ``reward.on_error``)."""

    async def setup(self, ctx: Any) -> None:
        from stages.tasks import load_task

        self.ctx = ctx
        cfg = ctx.config
        task = load_task(cfg.data.task, **cfg.data.task_kwargs) if cfg.reward.function == "task" else None
        self.fn = build_reward_fn(cfg.reward.function, task, cfg.reward.signature, cfg.reward.on_error)
        self.scored = 0
        self.failed = 0

    async def process(self, batch: Any) -> Any:
        import msgspec

        res = await asyncio.to_thread(self.fn.score, batch.prompts, batch.group_size, batch.completions)
        self.scored += batch.num_samples
        if res.errors:
            self.failed += len(res.errors)
            for err in res.errors:
                self.ctx.log.warning("reward_failed", batch_id=batch.batch_id,
                                     policy_version=batch.policy_version, error=err)
        return msgspec.structs.replace(batch, rewards=res.rewards, reward_errors=res.errors, reward_extras=res.extras)

    def status(self) -> dict[str, Any]:
        return {"state": "scoring", "samples": self.scored, "failed": self.failed}

    def result(self) -> dict[str, Any]:
        return self.status()
