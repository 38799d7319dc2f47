"""Built-in rewards (``reward.function: math | gsm8k | format | think_format``): answers
extracted and compared as the module says; every expected score derived by hand."""

from __future__ import annotations

import sys
import types
from fractions import Fraction

import pytest

from pipeline.types import Prompt
from stages.rewards import verifiable as vr
from stages.rewards.reward import BUILTIN_REWARDS, build_reward_fn

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.fixture(autouse=True)
def no_math_verify(monkeypatch):
    """The fallback normaliser, whether or not math_verify is installed here."""
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify -> ImportError


@pytest.mark.parametrize(("solution", "truth", "score"), [
    ("so the answer is \\boxed{\\frac{3}{4}}.", "3/4", 1.0),        # \frac{3}{4} = 3/4 as rationals
    ("\\boxed{0.75}", "\\frac{3}{4}", 1.0),                         # 0.75 = 3/4
    ("\\boxed{\\dfrac{3}{4}}", "\\boxed{\\frac34}", 0.0),           # "\frac34" is no rational form: strings differ
    ("first \\boxed{2} then \\boxed{5}", "5", 1.0),                  # the last box counts
    ("\\boxed{{1,2}}", "{1,2}", 1.0),                                # nested braces kept whole
    ("\\fbox{7}", "7", 1.0),
    ("\\boxed 9.", "9", 1.0),                                        # one-token box, trailing period dropped
    ("<answer> 1,000 </answer>", "1000", 1.0),                       # tag text; thousands comma dropped
    ("the total is 12 apples, then 15", "15", 1.0),                  # last number
    ("$\\boxed{90^\\circ}$", "90", 1.0),                             # degree sign dropped
    ("\\boxed{50\\%}", "50", 1.0),                                   # percent dropped
    ("\\boxed{\\text{Tuesday}}", "Tuesday", 1.0),                    # \text{} unwrapped, then strings equal
    ("\\boxed{x+1}", "x + 1", 1.0),                                  # spacing dropped
    ("\\boxed{4}", "5", 0.0),
    ("no answer at all", "5", 0.0),                                  # nothing to extract
    ("\\boxed{5", "5", 1.0),                                         # unbalanced box: none, the last number
    ("\\boxed{6", "5", 0.0),
    ("\\boxed{5}", None, 0.0),                                       # no ground truth
    ("\\boxed{7}", 7, 1.0),                                          # a numeric column
])
def test_math_score(solution, truth, score):
    assert vr.compute_math_score("src", solution, truth) == score


@pytest.mark.parametrize(("solution", "truth", "score"), [
    ("...so 72 clips.\n#### 72", GSM8K_ANSWER, 1.0),                 # marked answer 72 = 72
    ("She sold 72 clips in total.", GSM8K_ANSWER, 1.0),             # flexible: the last number
    ("#### 72\nthat took 3 steps", GSM8K_ANSWER, 1.0),              # the number after the last ####
    ("24 in May, 48 in April: 48", GSM8K_ANSWER, 0.0),              # last number 48 != 72
    ("#### $1,000.00", "#### 1000", 1.0),                           # 1000.00 = 1000 exactly
    ("#### -3", "-3", 1.0),                                         # a bare reference
    ("#### 0.5", "1/2", 0.0),                                       # the reference's first number is 1
    ("no number", GSM8K_ANSWER, 0.0),
    ("72", None, 0.0),
])
def test_gsm8k_score(solution, truth, score):
    assert vr.compute_gsm8k_score("openai/gsm8k", solution, truth) == score


@pytest.mark.parametrize(("solution", "fmt", "think"), [
    ("<think>add them</think><answer>5</answer>", 1.0, 1.0),
    ("  <think>a\nb</think>\n<answer>5</answer>\n", 1.0, 1.0),     # whitespace around is fine
    ("<think>add</think> The answer is 5.", 0.0, 1.0),             # no <answer> tag
    ("<answer>5</answer>", 0.0, 0.0),                               # no thinking
    ("<think>a</think><answer>5</answer> extra", 0.0, 1.0),        # text after the answer
    ("<think>a</think><think>b</think><answer>5</answer>", 0.0, 0.0),  # two think blocks
    ("<think>a</think>   ", 0.0, 0.0),                              # nothing after thinking
])
def test_format_scores(solution, fmt, think):
    assert vr.compute_format_score("src", solution, None) == fmt
    assert vr.compute_think_format_score("src", solution, None) == think


def test_helpers():
    assert vr.extract_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert vr.normalize_answer(" $1,234.$ ") == "1234"
    assert vr.to_fraction("\\frac{-2}{4}") == Fraction(-1, 2)
    assert vr.to_fraction("1/0") is None and vr.to_fraction("x") is None
    assert vr.last_number("from 3 to 1,250") == 1250


def test_math_verify_checks_when_installed(monkeypatch):
    """With math_verify importable, the extracted answers go to its parse/verify (gold
    first), both boxed, with its own timeouts off."""
    calls = []
    fake = types.ModuleType("fake_math_verify")
    fake.parse = lambda text, parsing_timeout: calls.append(("parse", text, parsing_timeout)) or text
    fake.verify = lambda gold, pred, timeout_seconds: calls.append(("verify", gold, pred)) or gold == pred
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    assert vr.compute_math_score("src", "so \\boxed{2}", "2") == 1.0
    assert calls == [("parse", "\\boxed{2}", None), ("parse", "\\boxed{2}", None),
                     ("verify", "\\boxed{2}", "\\boxed{2}")]
    assert vr.compute_math_score("src", "so \\boxed{3}", "2") == 0.0


def test_built_ins_are_reward_functions_by_name():
    prompts = [Prompt(prompt_id="p0", text="q", ground_truth="#### 4", index=0)]
    for name in BUILTIN_REWARDS:
        fn = build_reward_fn(name)
        assert (fn.name, fn.signature) == (name, "score")
    # gsm8k: "#### 4" scores 1, the last number 5 scores 0.
    result = build_reward_fn("gsm8k").score(prompts, 2, ["so #### 4", "it is 5"])
    assert result.rewards.tolist() == [1.0, 0.0] and result.errors == []
