"""Reward adapters: both signatures, per-sample error isolation, extras, detection."""

import math
import sys
import types

import numpy as np
import pytest

from pipeline.types import Prompt
from stages.data.tasks import load_task
from stages.rewards.reward import RewardResult, build_reward_fn, parse_reward_value


def _prompts(*answers: str) -> list[Prompt]:
    return [
        Prompt(prompt_id=f"p{i}", text=f"{a}000=", ground_truth=a, data_source="first_digit", index=i)
        for i, a in enumerate(answers)
    ]


@pytest.fixture
def plugin(monkeypatch):
    """A throwaway module users would name as ``reward.function: my_rewards:attr``."""
    module = types.ModuleType("my_rewards")
    monkeypatch.setitem(sys.modules, "my_rewards", module)
    return module


def test_task_reward_scores_each_sample_against_its_prompt():
    # group_size 2: samples 0,1 answer prompt "4"; samples 2,3 answer prompt "7"
    fn = build_reward_fn("task", load_task("first_digit"))
    assert fn.signature == "score"
    result = fn.score(_prompts("4", "7"), 2, ["4", "5", "7x", "4"])
    assert isinstance(result, RewardResult)
    assert result.rewards.dtype == np.float32
    np.testing.assert_array_equal(result.rewards, np.array([1, 0, 1, 0], dtype=np.float32))
    assert result.errors == []
    assert result.extras == {}


def test_score_style_errors_and_non_numbers_are_isolated(plugin):
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "boom":
            raise KeyError("missing")
        if solution_str == "text":
            return "abc"
        if solution_str == "nan":
            return float("nan")
        return {"score": 0.5, "format": 1, "note": "not a number"}

    plugin.compute_score = compute_score
    fn = build_reward_fn("my_rewards:compute_score", on_error=-1.0)
    result = fn.score(_prompts("1", "2"), 2, ["ok", "boom", "text", "nan"])
    # sample 0 scores 0.5; samples 1-3 fail and get on_error = -1
    np.testing.assert_array_equal(result.rewards, np.array([0.5, -1, -1, -1], dtype=np.float32))
    assert result.errors == [
        "1: KeyError: 'missing'",
        "2: returned non-number 'abc'",
        "3: returned non-finite nan",
    ]
    # only sample 0 returned the extra; the others hold NaN; the string key is dropped
    assert list(result.extras) == ["format"]
    assert result.extras["format"][0] == 1.0
    assert all(math.isnan(v) for v in result.extras["format"][1:])


def test_score_style_without_extra_info_parameter(plugin):
    plugin.score3 = lambda data_source, solution_str, ground_truth: float(solution_str == ground_truth)
    result = build_reward_fn("my_rewards:score3").score(_prompts("3"), 2, ["3", "4"])
    np.testing.assert_array_equal(result.rewards, np.array([1, 0], dtype=np.float32))


def test_batched_style_gets_prompts_and_columns(plugin):
    seen = {}

    def reward_len(prompts, completions, ground_truth, **kwargs):
        seen.update(prompts=prompts, ground_truth=ground_truth, keys=sorted(kwargs))
        return [float(len(c)) for c in completions]

    plugin.reward_len = reward_len
    fn = build_reward_fn("my_rewards:reward_len")
    assert fn.signature == "batched"
    result = fn.score(_prompts("1", "2"), 2, ["a", "bb", "", "dddd"])
    np.testing.assert_array_equal(result.rewards, np.array([1, 2, 0, 4], dtype=np.float32))
    # one prompt text and ground truth per sample (repeated group_size times)
    assert seen["prompts"] == ["1000=", "1000=", "2000=", "2000="]
    assert seen["ground_truth"] == ["1", "1", "2", "2"]
    assert seen["keys"] == ["data_source", "extra_info"]


def test_batched_failure_falls_back_to_one_sample_at_a_time(plugin):
    calls = []

    def fragile(prompts, completions, **kwargs):
        calls.append(len(completions))
        if "bad" in completions:
            raise RuntimeError("cannot parse bad")
        return np.array([0.25 for _ in completions])

    plugin.fragile = fragile
    result = build_reward_fn("my_rewards:fragile", on_error=0.0).score(_prompts("1"), 3, ["x", "bad", "y"])
    # whole batch once (raises), then 3 single calls; the bad one alone fails
    assert calls == [3, 1, 1, 1]
    np.testing.assert_array_equal(result.rewards, np.array([0.25, 0.0, 0.25], dtype=np.float32))
    assert result.errors == ["1: RuntimeError: cannot parse bad"]


def test_batched_none_entry_is_a_sample_error(plugin):
    plugin.maybe = lambda prompts, completions, **kw: [1.0, None]
    result = build_reward_fn("my_rewards:maybe", on_error=0.5).score(_prompts("1"), 2, ["a", "b"])
    np.testing.assert_array_equal(result.rewards, np.array([1.0, 0.5], dtype=np.float32))
    assert result.errors == ["1: returned non-number None"]


def test_batched_wrong_length_names_function_and_lengths(plugin):
    plugin.short = lambda prompts, completions, **kw: [1.0]
    fn = build_reward_fn("my_rewards:short")
    with pytest.raises(ValueError, match=r"my_rewards:short returned 1 values for 4 completions"):
        fn.score(_prompts("1", "2"), 2, ["a", "b", "c", "d"])


def test_forced_signature_with_unusual_parameter_names(plugin):
    plugin.pos = lambda src, text, truth: float(text == truth)
    plugin.batch = lambda xs, ys: [float(y == "1") for y in ys]
    with pytest.raises(ValueError, match="reward.signature: cannot tell how to call"):
        build_reward_fn("my_rewards:pos")
    score_fn = build_reward_fn("my_rewards:pos", signature="score")
    np.testing.assert_array_equal(score_fn.score(_prompts("1"), 2, ["1", "2"]).rewards, [1.0, 0.0])
    batch_fn = build_reward_fn("my_rewards:batch", signature="batched")
    np.testing.assert_array_equal(batch_fn.score(_prompts("1"), 2, ["1", "2"]).rewards, [1.0, 0.0])


def test_completion_count_must_match_prompts_times_group():
    fn = build_reward_fn("task", load_task("first_digit"))
    with pytest.raises(ValueError, match="got 3 completions for 2 prompts x group_size 2 = 4"):
        fn.score(_prompts("1", "2"), 2, ["1", "2", "3"])


def test_build_errors_name_the_field():
    with pytest.raises(ValueError, match=r"reward.function: expected 'task', a built-in \(math, gsm8k, format, "
                                         r"think_format\), 'module:attr' or 'path/to/file.py:name'"):
        build_reward_fn("exact_match")
    with pytest.raises(ValueError, match="reward.function: cannot import module"):
        build_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="reward.function: 'math:pi' is a float"):
        build_reward_fn("math:pi")
    with pytest.raises(ValueError, match="reward.function: 'task' needs a data task"):
        build_reward_fn("task", None)


def test_parse_reward_value_cases():
    assert parse_reward_value(1) == (1.0, {}, None)
    assert parse_reward_value(np.float32(0.5)) == (0.5, {}, None)
    assert parse_reward_value(np.array(2.0)) == (2.0, {}, None)
    assert parse_reward_value({"score": 0.0, "acc": True}) == (0.0, {"acc": 1.0}, None)
    assert parse_reward_value({"acc": 1.0})[2] == "returned a dict without 'score' (keys: ['acc'])"
    assert parse_reward_value(float("inf"))[2] == "returned non-finite inf"
    assert parse_reward_value([1.0])[2] == "returned non-number [1.0]"
