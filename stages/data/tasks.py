"""Built-in synthetic digit tasks and the loader for ``data.task``.

Guarantees:
- A task turns a seed into prompt rows ``{"prompt", "ground_truth", "data_source",
  "extra_info"}`` deterministically: the same (seed, task arguments) gives the same rows
  on every machine, and ``generate_rows(seed, n)`` is the first ``n`` rows of
  ``iter_rows(seed)`` (asking for more never changes the earlier rows).
- ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` (the
  verl-style reward signature) returns a float in [0, 1] and never raises on any string.
- Built-ins live in the explicit ``TASKS`` dict; anything else is named ``module:attr``
  and loaded by ``load_task``. Importing this module registers nothing elsewhere.

Answer parsing shared by copy/reverse/add: the answer is the run of digits at the start
of the completion (it ends at the first non-digit, e.g. where the model stopped with
``<eos>``, which the decoded text omits). Prompts are ``<digits>=`` (``<a>+<b>=`` for add).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Task(Protocol):
    """What the source and reward stages need from a task. Built-ins also offer
    ``iter_rows(seed)``, an endless iterator whose prefix is ``generate_rows(seed, n)``."""

    def generate_rows(self, seed: int, n: int) -> list[dict[str, Any]]: ...

    def compute_score(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> float: ...


class DigitTask:
    """Base of the digit tasks: prompts of ``min_digits..max_digits`` random digits."""

    name = "digits"

    def __init__(self, min_digits: int = 4, max_digits: int = 6) -> None:
        if not 1 <= min_digits <= max_digits:
            raise ValueError(
                f"data.task_kwargs: expected 1 <= min_digits <= max_digits, "
                f"got {min_digits}, {max_digits}"
            )
        self.min_digits = min_digits
        self.max_digits = max_digits

    def iter_rows(self, seed: int) -> Iterator[dict[str, Any]]:
        # A private Random: row generation never touches (or depends on) global state.
        rng = random.Random(f"{self.name}:{seed}")
        while True:
            prompt, answer = self.build_example(rng)
            yield {"prompt": prompt, "ground_truth": answer, "data_source": self.name, "extra_info": {}}

    def generate_rows(self, seed: int, n: int) -> list[dict[str, Any]]:
        rows = self.iter_rows(seed)
        return [next(rows) for _ in range(n)]

    def draw_digits(self, rng: random.Random) -> str:
        length = rng.randint(self.min_digits, self.max_digits)
        return "".join(rng.choice("0123456789") for _ in range(length))

    def build_example(self, rng: random.Random) -> tuple[str, str]:
        raise NotImplementedError

    def compute_score(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> float:
        raise NotImplementedError


class FirstDigitTask(DigitTask):
    """``48213=`` -> ``4``. Reward 1 if the completion's first character is the prompt's
    first digit, else 0 (what follows is ignored). The quickstart task: the answer is
    one token and a random-init model hits it by chance (~1/89 per sample), so GRPO
    has a signal from the first step."""

    name = "first_digit"

    def build_example(self, rng: random.Random) -> tuple[str, str]:
        digits = self.draw_digits(rng)
        return f"{digits}=", digits[0]

    def compute_score(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> float:
        return 1.0 if solution_str[:1] == str(ground_truth) else 0.0


class CopyTask(DigitTask):
    """``4821=`` -> ``4821``. Partial credit: the number of positions where the answer
    matches the target, divided by max(len(target), len(answer)); 1.0 only for the
    exact answer, and both missing and extra digits cost credit."""

    name = "copy"

    def build_example(self, rng: random.Random) -> tuple[str, str]:
        digits = self.draw_digits(rng)
        return f"{digits}=", digits

    def compute_score(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> float:
        return compute_position_match(parse_digits(solution_str), str(ground_truth))


class ReverseTask(CopyTask):
    """``4821=`` -> ``1284``; partial credit as for copy."""

    name = "reverse"

    def build_example(self, rng: random.Random) -> tuple[str, str]:
        digits = self.draw_digits(rng)
        return f"{digits}=", digits[::-1]


class AddTask(DigitTask):
    """``37+85=`` -> ``122``; each operand has ``min_digits..max_digits`` digits (default
    2..3, no leading zeros). Reward 1.0 for the exact sum; otherwise partial credit
    0.5 * (digits matching the sum when both are aligned at the units digit) /
    max(len(sum), len(answer)), so a wrong answer never scores 0.5 or more and
    getting the low digits (the ones carries are computed from) right is rewarded."""

    name = "add"

    def __init__(self, min_digits: int = 2, max_digits: int = 3) -> None:
        super().__init__(min_digits, max_digits)

    def draw_operand(self, rng: random.Random) -> int:
        length = rng.randint(self.min_digits, self.max_digits)
        low = 0 if length == 1 else 10 ** (length - 1)
        return rng.randint(low, 10**length - 1)

    def build_example(self, rng: random.Random) -> tuple[str, str]:
        a, b = self.draw_operand(rng), self.draw_operand(rng)
        return f"{a}+{b}=", str(a + b)

    def compute_score(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> float:
        answer, target = parse_digits(solution_str), str(ground_truth)
        if answer == target:
            return 1.0
        return 0.5 * compute_position_match(answer[::-1], target[::-1])


def parse_digits(solution_str: str) -> str:
    """The run of digits at the start of a completion: ``"123=4"`` -> ``"123"``."""
    end = 0
    while end < len(solution_str) and solution_str[end] in "0123456789":
        end += 1
    return solution_str[:end]


def compute_position_match(answer: str, target: str) -> float:
    """Matching positions / max(len(answer), len(target)); 0 when both are empty."""
    longest = max(len(answer), len(target))
    if longest == 0:
        return 0.0
    return sum(a == t for a, t in zip(answer, target, strict=False)) / longest


TASKS: dict[str, type[DigitTask]] = {
    FirstDigitTask.name: FirstDigitTask,
    CopyTask.name: CopyTask,
    ReverseTask.name: ReverseTask,
    AddTask.name: AddTask,
}


def load_task(name: str, **kwargs: Any) -> Task:
    """A built-in task by name, or ``module:attr`` naming a task class, a factory (called
    with ``kwargs``) or a ready task object. Raises ``ValueError`` naming ``data.task``."""
    if name in TASKS:
        return _construct(TASKS[name], name, kwargs)
    if ":" not in name:
        raise ValueError(
            f"data.task: unknown task {name!r}; expected one of {', '.join(sorted(TASKS))} "
            f"or 'module:attr'"
        )
    target = import_attr(name, "data.task")
    task = _construct(target, name, kwargs) if callable(target) and not _looks_like_task(target) else target
    if kwargs and task is target:
        raise ValueError(f"data.task: {name!r} is a task object, it takes no data.task_kwargs")
    if not _looks_like_task(task):
        raise ValueError(
            f"data.task: {name!r} gave a {type(task).__name__}, expected an object with "
            f"generate_rows(seed, n) and compute_score(...)"
        )
    return task


def import_attr(spec: str, field: str) -> Any:
    """``"package.module:attr"`` -> the attribute; errors are ``ValueError``s naming the config ``field``."""
    from pipeline.plugins import import_object

    try:
        return import_object(spec, field)
    except ImportError as exc:
        raise ValueError(str(exc)) from None


def _construct(factory: Any, name: str, kwargs: dict[str, Any]) -> Any:
    try:
        return factory(**kwargs)
    except TypeError as exc:  # typically an unknown or missing keyword argument
        raise ValueError(f"data.task_kwargs: cannot build task {name!r} with {kwargs!r} ({exc})") from exc


def _looks_like_task(obj: Any) -> bool:
    # A class also has these attributes (as unbound functions): only instances count.
    if isinstance(obj, type):
        return False
    return all(callable(getattr(obj, m, None)) for m in ("generate_rows", "compute_score"))

