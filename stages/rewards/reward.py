"""Reward-function adapters: the pure core of the reward stage, and its actor shell.

A function comes from ``reward.function``: ``task``, a built-in in ``BUILTIN_REWARDS``,
``module:attr`` or ``path/to/file.py:name``. Two signatures are accepted, detected from
parameter names or forced by ``reward.signature``: verl's per-sample ``compute_score``
(a float, or a dict with ``"score"`` and extras) and TRL's batched ``f(prompts,
completions, **columns)``; either may be ``async def``. Details: docs/architecture.md,
"Reward".

Guarantees of ``RewardFn.score``:
- every sample gets a finite float32 reward: one whose call raises, times out
  (``reward.timeout_s``) or returns a non-number gets ``on_error`` and one ``errors``
  entry, the others are scored normally; one bad sample never fails its batch;
- a batched function returning the wrong number of values raises ``RewardShapeError``;
- ``extras[key]`` has one value per sample, NaN where that sample gave none.
``RewardStage`` makes failures visible (a warning, ``reward/errors``, ``summary.json``);
a step whose every sample failed stops the run with ``RewardFailedError``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from pipeline.plugins import register_stage
from pipeline.types import Prompt, RolloutBatch
from stages.data.tasks import import_attr

Signature = Literal["auto", "score", "batched"]

# Keep error strings short: they travel with every batch and end up in logs.
_MAX_MESSAGE_CHARS = 300
_SCORE_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
_COLUMNS = ("ground_truth", "data_source", "extra_info")

# Built-in reward functions, by the name reward.function gives them (stages/rewards/verifiable.py
# says what each checks and which columns it reads).
BUILTIN_REWARDS: dict[str, str] = {
    "math": "stages.rewards.verifiable:compute_math_score",
    "gsm8k": "stages.rewards.verifiable:compute_gsm8k_score",
    "format": "stages.rewards.verifiable:compute_format_score",
    "think_format": "stages.rewards.verifiable:compute_think_format_score",
}


class RewardShapeError(ValueError):
    """A batched reward function returned the wrong number of values (a bug in it)."""


class RewardTimeout(TimeoutError):
    """One call of the reward function took longer than ``reward.timeout_s``."""


class RewardFailedError(RuntimeError):
    """Every sample of an optimizer step failed: the reward function is broken, not the data."""


@dataclass(frozen=True)
class RewardResult:
    """Rewards of one micro-batch: ``rewards`` [S] float32, errors, extras (each [S])."""

    rewards: np.ndarray
    errors: list[str] = field(default_factory=list)
    extras: dict[str, list[float]] = field(default_factory=dict)


class RewardFn:
    """A user or task reward function behind one calling convention; see the module."""

    def __init__(self, fn: Callable[..., Any], signature: Literal["score", "batched"], on_error: float, name: str,
                 timeout_s: float | None = None) -> None:
        self.fn = fn
        self.signature = signature
        self.on_error = float(on_error)
        self.name = name
        self.timeout_s = timeout_s
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
        self._params, self._var_kw = _describe_params(fn)

    def score(self, prompts: Sequence[Prompt], group_size: int, completions: Sequence[str]) -> RewardResult:
        """Score ``completions`` [S]; sample ``i`` answers ``prompts[i // group_size]``.
        Call it from a thread without a running event loop (async functions run in one
        of their own)."""
        num = len(prompts) * group_size
        if len(completions) != num:
            raise ValueError(
                f"reward: got {len(completions)} completions for {len(prompts)} prompts x "
                f"group_size {group_size} = {num} samples"
            )
        owners = [prompts[i // group_size] for i in range(num)]
        if self.signature == "batched":
            raw = self._call_batched(owners, list(completions))
        elif self.is_async:
            raw = asyncio.run(self._gather_scores(owners, list(completions)))
        else:
            raw = [self._call_one(p, c) for p, c in zip(owners, completions, strict=True)]
        return self._collect(raw)

    # ------------------------------------------------------------------ calling

    def _score_call(self, prompt: Prompt, completion: str) -> Callable[[], Any]:
        """The per-sample call with the arguments the function takes."""
        values = (prompt.data_source, completion, prompt.ground_truth, prompt.extra_info)
        if "solution_str" in self._params:
            kwargs = {k: v for k, v in zip(_SCORE_PARAMS, values, strict=True) if k in self._params or self._var_kw}
            return lambda: self.fn(**kwargs)
        # Forced "score" with other parameter names: verl's positional order.
        return lambda: self.fn(*values[: max(3, min(4, len(self._params)))])

    def _call_one(self, prompt: Prompt, completion: str) -> Any:
        """The function's value for one sample, or the exception it raised."""
        try:
            return call_with_timeout(self._score_call(prompt, completion), self.timeout_s)
        except Exception as exc:  # any user error becomes this sample's error
            return exc

    async def _gather_scores(self, owners: list[Prompt], completions: list[str]) -> list[Any]:
        """An ``async def`` per-sample function: all samples awaited at once, each bounded."""

        async def one(prompt: Prompt, completion: str) -> Any:
            try:
                return await asyncio.wait_for(self._score_call(prompt, completion)(), self.timeout_s)
            except TimeoutError:
                return RewardTimeout(timeout_message(self.timeout_s))
            except Exception as exc:  # any user error becomes this sample's error
                return exc

        return list(await asyncio.gather(*(one(p, c) for p, c in zip(owners, completions, strict=True))))

    def _call_batched(self, owners: list[Prompt], completions: list[str]) -> list[Any]:
        try:
            return self._invoke_batched(owners, completions)
        except RewardShapeError:
            raise
        except RewardTimeout as exc:  # per sample it would take len(completions) timeouts
            return [exc] * len(completions)
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
            out = call_with_timeout(lambda: self.fn(prompts=texts, completions=completions, **kwargs), self.timeout_s)
        else:
            out = call_with_timeout(lambda: self.fn(texts, completions, **kwargs), self.timeout_s)
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


def build_reward_fn(spec: str, task: Any = None, signature: Signature = "auto", on_error: float = 0.0,
                    timeout_s: float | None = None) -> RewardFn:
    """``spec`` is ``"task"`` (the data task's ``compute_score``), a ``BUILTIN_REWARDS`` name, ``"module:attr"`` or
    ``"path/to/file.py:name"``; errors are ValueErrors naming ``reward.function``."""
    file_spec = split_file_spec(spec)
    if spec == "task":
        if task is None or not callable(getattr(task, "compute_score", None)):
            raise ValueError("reward.function: 'task' needs a data task with compute_score(...)")
        fn, name = task.compute_score, f"{type(task).__name__}.compute_score"
    elif spec in BUILTIN_REWARDS:
        fn, name = import_attr(BUILTIN_REWARDS[spec], "reward.function"), spec
    elif file_spec is not None:
        fn, name = load_reward_file(*file_spec), spec
    elif ":" in spec:
        fn, name = import_attr(spec, "reward.function"), spec
    else:
        raise ValueError(f"reward.function: expected 'task', a built-in ({', '.join(BUILTIN_REWARDS)}), "
                         f"'module:attr' or 'path/to/file.py:name', got {spec!r}")
    if not callable(fn):
        raise ValueError(f"reward.function: {spec!r} is a {type(fn).__name__}, not a function")
    if signature == "auto":
        resolved = detect_signature(fn, name)
    elif signature in ("score", "batched"):
        resolved = signature
    else:
        raise ValueError(f"reward.signature: expected 'auto', 'score' or 'batched', got {signature!r}")
    return RewardFn(fn, resolved, on_error, name, timeout_s)


def build_run_reward_fn(cfg: Any) -> RewardFn:
    """The run's reward function (``reward.*``; ``task``: ``data.task``'s), as the reward
    stage and the held-out evaluation both score with it."""
    from stages.data.tasks import load_task

    spec = resolve_reward_spec(cfg.reward)
    task = load_task(cfg.data.task, **cfg.data.task_kwargs) if spec == "task" else None
    return build_reward_fn(spec, task, cfg.reward.signature, cfg.reward.on_error, cfg.reward.timeout_s)


def resolve_reward_spec(reward_cfg: Any) -> str:
    """``reward.function``, or verl's ``reward.path`` + ``reward.name`` as ``path:name``."""
    if getattr(reward_cfg, "path", None):
        return f"{reward_cfg.path}:{reward_cfg.name}"
    return str(reward_cfg.function)


def split_file_spec(spec: str) -> tuple[str, str] | None:
    """``"dir/file.py:fn"`` -> ("dir/file.py", "fn"); None for any other spec."""
    file, sep, name = spec.rpartition(":")
    if not sep or not file.endswith(".py"):
        return None
    return file, name


def load_reward_file(file: str, name: str) -> Any:
    """``name`` from the Python file ``file``, executed as a module of its own (once per
    process: the module is keyed by the file's absolute path)."""
    from pipeline.plugins import load_file_object

    return load_file_object(file, name, "reward.function", prefix="conveyor_reward")


def call_with_timeout(call: Callable[[], Any], timeout_s: float | None) -> Any:
    """``call()``'s value (awaited if it returns an awaitable), or the exception it
    raised; ``RewardTimeout`` after ``timeout_s`` seconds (see the module guarantees)."""
    if timeout_s is None:
        return _await_if_needed(call())
    box: list[Any] = []

    def target() -> None:
        try:
            box.append((True, _await_if_needed(call())))
        except BaseException as exc:  # handed to the caller
            box.append((False, exc))

    worker = threading.Thread(target=target, name="reward-call", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not box:
        raise RewardTimeout(timeout_message(timeout_s))
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _await_if_needed(value: Any) -> Any:
    if inspect.isawaitable(value):

        async def wait() -> Any:
            return await value

        return asyncio.run(wait())
    return value


def timeout_message(timeout_s: float | None) -> str:
    return f"the call took longer than reward.timeout_s = {timeout_s} s"


def label_errors(errors: Sequence[str], sample_ids: Sequence[str]) -> list[str]:
    """``"<sample index>: message"`` -> ``"<sample id>: message"``, the wire format of
    ``RolloutBatch.reward_errors`` (splitting a batch keeps each error with its sample)."""
    out = []
    for err in errors:
        index, sep, message = err.partition(": ")
        out.append(f"{sample_ids[int(index)]}: {message}" if sep and index.isdigit() else err)
    return out


class StepFailureTracker:
    """Scored and failed samples per optimizer step (``batch.step``); says when a
    step's every sample failed. A step is complete once ``samples_per_step`` samples of
    it were scored; its entry is then dropped, so memory stays bounded."""

    def __init__(self, samples_per_step: int) -> None:
        self.samples_per_step = samples_per_step
        self._steps: dict[int, list[int]] = {}

    def record(self, step: int, samples: int, failed: int) -> bool:
        """Add a micro-batch's counts; True when ``step`` is complete and all of it failed."""
        counts = self._steps.setdefault(step, [0, 0])
        counts[0] += samples
        counts[1] += failed
        if counts[0] < self.samples_per_step:
            return False
        del self._steps[step]
        return counts[1] == counts[0]


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


@register_stage("reward")
class RewardStage:
    """Actor shell around ``RewardFn`` (``reward.*``); see the module for what it reports."""

    takes = gives = RolloutBatch  # pipeline/contracts.py
    gives_fields = ("rewards",)

    async def setup(self, ctx: Any) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.fn = build_run_reward_fn(cfg)
        self.tracker = StepFailureTracker(cfg.train.prompts_per_step * cfg.rollout.n)
        self.scored = 0
        self.failed = 0
        self.first_error: str | None = None
        # DAPO's overlong penalty and dynamic sampling (stages/rewards/shaping.py), here
        # unless a reward model replaces this score downstream.
        from stages.rewards.shaping import RewardShaper, shapes_rewards

        self.shaper = RewardShaper(cfg) if shapes_rewards(cfg) == "reward" else None

    async def process(self, batch: Any) -> Any:
        import msgspec

        res = await asyncio.to_thread(self.fn.score, batch.prompts, batch.group_size, batch.completions)
        errors = label_errors(res.errors, batch.sample_ids)
        self.scored += batch.num_samples
        if errors:
            self.failed += len(errors)
            if self.first_error is None:
                self.first_error = errors[0]
                self.ctx.log.warning("reward_failed", function=self.fn.name, batch_id=batch.batch_id,
                                     policy_version=batch.policy_version, error=errors[0],
                                     note="the first failure; all are counted in reward/errors")
            for err in errors:
                self.ctx.log.debug("reward_failed", batch_id=batch.batch_id, error=err)
        if self.tracker.record(batch.step, batch.num_samples, len(errors)):
            raise RewardFailedError(
                f"reward function {self.fn.name} failed on every sample of step {batch.step} "
                f"({self.tracker.samples_per_step} samples); first error: {errors[0]}"
            )
        out = msgspec.structs.replace(batch, rewards=res.rewards, reward_errors=errors, reward_extras=res.extras)
        return out if self.shaper is None else await self.shaper.shape(out, self.ctx)

    async def finish(self) -> Any:
        return self.shaper.flush() if self.shaper is not None else None

    def status(self) -> dict[str, Any]:
        return {"state": "scoring", "samples": self.scored, "failed": self.failed, "first_error": self.first_error,
                **(self.shaper.status() if self.shaper is not None else {})}

    def result(self) -> dict[str, Any]:
        return self.status()
