"""Built-in verifiable rewards (``reward.function: math | gsm8k | format | think_format``),
in verl's signature ``compute_score(data_source, solution_str, ground_truth,
extra_info=None) -> float``.

Expected columns: ``ground_truth`` is the row's ``data.answer_key`` column (set
``data.answer_key: answer`` for GSM8K and most math sets); ``data_source`` and
``extra_info`` are not read. Each function's rule is in its own docstring
(``compute_math_score``, ``compute_gsm8k_score``, ``compute_format_score``,
``compute_think_format_score``).

Guarantees:
- every function returns 1.0 or 0.0 and never raises on any string (a missing or
  non-string ground truth scores 0.0);
- ``math`` uses ``math_verify`` when installed (``pip install conveyor[math]``), else the
  exact-rational fallback ``answers_match``; its own timeouts are off, the reward stage
  bounds a call with ``reward.timeout_s``.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_FORMAT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_THINK = re.compile(r"\s*<think>(.*?)</think>\s*(\S.*)", re.DOTALL)
_FRAC = re.compile(r"^(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")
_REMOVED = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "$", "^\\circ", "^{\\circ}", "\\%", "%")


def compute_math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the completion's final answer equals ``ground_truth``, else 0.0.

    The completion's answer is its last ``\\boxed{...}`` (or ``\\fbox{...}``), else the
    text of its last ``<answer>...</answer>``, else its last number. The reference may be
    plain (``3/4``, ``\\frac{3}{4}``, ``0.75``) or hold a ``\\boxed{}`` itself. Both are
    checked with Hugging Face's ``math_verify`` (``parse`` then ``verify``, its timeouts
    off: the reward stage bounds a call with ``reward.timeout_s``) when that package is
    installed (``pip install conveyor[math]``), else by the fallback ``answers_match``:
    both normalised (``normalize_answer``) and equal as exact rationals (integers,
    decimals, ``a/b``, ``\\frac{a}{b}``) or, failing that, as strings.
    """
    if not isinstance(ground_truth, str | int | float) or isinstance(ground_truth, bool):
        return 0.0
    answer = extract_final_answer(solution_str)
    reference = extract_boxed(str(ground_truth)) or str(ground_truth)
    if answer is None:
        return 0.0
    verify = _math_verify()
    if verify is not None:
        return 1.0 if verify(reference, answer) else 0.0
    return 1.0 if answers_match(answer, reference) else 0.0


def compute_gsm8k_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the completion's ``####`` (else last) number equals the reference's.

    GSM8K's ``#### answer`` convention. The reference is the number after the last
    ``####`` of the answer column (or the whole value, a bare number); the completion's
    answer is the number after its last ``####``, else its last number (verl's flexible
    mode; an instruct model is rarely told to write ``####``). Equal as exact rationals
    (``$1,000.00`` equals ``1000``).
    """
    if not isinstance(ground_truth, str | int | float) or isinstance(ground_truth, bool):
        return 0.0
    reference = _first_number(str(ground_truth).rpartition("####")[2])
    marked = solution_str.rpartition("####")
    answer = _first_number(marked[2]) if marked[1] else last_number(solution_str)
    return 1.0 if reference is not None and answer is not None and reference == answer else 0.0


def compute_format_score(data_source: str, solution_str: str, ground_truth: Any = None, extra_info: Any = None) -> float:
    """1.0 for ``<think>...</think><answer>...</answer>`` (each tag once, with only
    whitespace around them), else 0.0."""
    if _FORMAT.fullmatch(solution_str) is None:
        return 0.0
    return 1.0 if all(solution_str.count(tag) == 1 for tag in ("<think>", "</think>", "<answer>", "</answer>")) else 0.0


def compute_think_format_score(data_source: str, solution_str: str, ground_truth: Any = None,
                               extra_info: Any = None) -> float:
    """1.0 for one ``<think>...</think>`` block followed by a non-empty answer, else 0.0."""
    once = solution_str.count("<think>") == 1 and solution_str.count("</think>") == 1
    return 1.0 if once and _THINK.fullmatch(solution_str) is not None else 0.0


def extract_final_answer(text: str) -> str | None:
    """The last ``\\boxed{}``, else the last ``<answer>`` text, else the last number."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    tags = _ANSWER_TAG.findall(text)
    if tags and tags[-1].strip():
        return extract_boxed(tags[-1]) or tags[-1].strip()
    number = _NUMBER.findall(text)
    return number[-1].replace(",", "") if number else None


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced), or
    of ``\\boxed 5`` (one token); None without one or with unbalanced braces."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:].removeprefix("\\boxed").removeprefix("\\fbox")
    if rest.startswith(" "):
        token = rest.split()
        return token[0].rstrip("$.") if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:i].strip()
    return None


def normalize_answer(text: str) -> str:
    """The fallback's canonical spelling of an answer: spacing, ``$``,
    ``\\left``/``\\right``, ``\\dfrac``, ``\\text{}``, degrees, percent, thousands commas and
    a trailing period dropped."""
    text = text.strip()
    for token in _REMOVED:
        text = text.replace(token, "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}", r"\1", text)
    text = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", text)
    text = re.sub(r"\s+", "", text)
    return text.rstrip(".")


def answers_match(answer: str, reference: str) -> bool:
    """The fallback check: equal as exact rationals, else as normalised strings."""
    a, b = normalize_answer(answer), normalize_answer(reference)
    x, y = to_fraction(a), to_fraction(b)
    return x == y if x is not None and y is not None else a == b


def to_fraction(text: str) -> Fraction | None:
    """``12``, ``-0.5``, ``3/4`` or ``\\frac{3}{4}`` as an exact rational; None otherwise."""
    frac = _FRAC.match(text)
    if frac is not None:
        text = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    try:
        num, _, den = text.partition("/")
        value = Fraction(num) / (Fraction(den) if den else 1)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def last_number(text: str) -> Fraction | None:
    """The last number written in ``text`` (thousands commas allowed) as a rational."""
    numbers = _NUMBER.findall(text)
    return _parse_number(numbers[-1]) if numbers else None


def _first_number(text: str) -> Fraction | None:
    found = _NUMBER.search(text)
    return _parse_number(found.group(0)) if found else None


def _parse_number(token: str) -> Fraction | None:
    try:
        return Fraction(token.replace(",", ""))
    except ValueError:
        return None


def _math_verify() -> Any:
    """``(reference, answer) -> bool`` through math_verify, or None when it is not installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None

    def check(reference: str, answer: str) -> bool:
        gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=None)
        pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
        return bool(verify(gold, pred, timeout_seconds=None))

    return check
