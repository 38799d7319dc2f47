"""Rewards as users write them: a .py file, dict extras, async def, a per-call timeout,
and failures that are counted, shown and, when a whole step fails, stop the run."""

from __future__ import annotations

import asyncio
import math
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline.config import ConfigError, RewardConfig, decode_config
from pipeline.types import Prompt, RolloutBatch
from stages.rewards.reward import (
    RewardFailedError,
    RewardStage,
    StepFailureTracker,
    build_reward_fn,
    label_errors,
    resolve_reward_spec,
    split_file_spec,
)
from stages.trainer.metrics import summarise_reward_extras

VERL_STYLE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "length": len(solution_str)}

def helper():
    return 1
'''


def _prompts(*answers: str) -> list[Prompt]:
    return [Prompt(prompt_id=f"p{i}", text=f"{a}=", ground_truth=a, index=i) for i, a in enumerate(answers)]


# ------------------------------------------------------------------ where the function comes from

def test_a_reward_file_is_loaded_by_path(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(VERL_STYLE)
    fn = build_reward_fn(f"{path}:compute_score")
    assert fn.name == f"{path}:compute_score" and fn.signature == "score"
    result = fn.score(_prompts("7"), 2, ["7", "71"])
    np.testing.assert_array_equal(result.rewards, np.array([1.0, 0.0], dtype=np.float32))
    assert result.extras == {"length": [1.0, 2.0]}


@pytest.mark.parametrize(
    ("body", "name", "message"),
    [
        (None, "compute_score", "does not exist (expected a .py file defining compute_score)"),
        (VERL_STYLE, "score_fn", "defines no 'score_fn' (its functions: compute_score, helper)"),
        ("x = 1 / 0\n", "f", "raised ZeroDivisionError: division by zero"),
    ],
)
def test_reward_file_errors_name_the_field(tmp_path, body, name, message):
    path = tmp_path / "r.py"
    if body is not None:
        path.write_text(body)
    with pytest.raises(ValueError) as info:
        build_reward_fn(f"{path}:{name}")
    assert str(info.value).startswith("reward.function: ") and message in str(info.value)


def test_verl_spelling_path_and_name():
    assert resolve_reward_spec(RewardConfig(path="rewards/gsm8k.py")) == "rewards/gsm8k.py:compute_score"
    assert resolve_reward_spec(RewardConfig(path="r.py", name="acc")) == "r.py:acc"
    assert resolve_reward_spec(RewardConfig(function="pkg.mod:f")) == "pkg.mod:f"
    with pytest.raises(ConfigError, match=r"^reward.path: set either reward.function \('pkg:f'\) or reward.path"):
        decode_config({"reward": {"function": "pkg:f", "path": "r.py"}})


def test_split_file_spec():
    assert split_file_spec("a/b.py:f") == ("a/b.py", "f")
    assert split_file_spec("pkg.mod:f") is None
    assert split_file_spec("task") is None


# ------------------------------------------------------------------ async and timeouts

def test_async_score_function_awaits_samples_together():
    started = []

    async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        started.append(solution_str)
        await asyncio.sleep(0)  # every call starts before any returns
        if solution_str == "x":
            raise ValueError("unparseable")
        return float(solution_str == ground_truth)

    fn = build_reward_fn_from(compute_score)
    assert fn.is_async
    result = fn.score(_prompts("1", "2"), 2, ["1", "x", "2", "2"])
    np.testing.assert_array_equal(result.rewards, np.array([1, 0, 1, 1], dtype=np.float32))
    assert result.errors == ["1: ValueError: unparseable"]
    assert started == ["1", "x", "2", "2"]


def test_async_batched_function():
    async def score_all(prompts, completions, ground_truth):
        return [float(c == g) for c, g in zip(completions, ground_truth, strict=True)]

    result = build_reward_fn_from(score_all).score(_prompts("1"), 2, ["1", "0"])
    np.testing.assert_array_equal(result.rewards, np.array([1, 0], dtype=np.float32))


def test_a_plain_call_past_the_timeout_scores_on_error():
    release = threading.Event()

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            release.wait()  # never set until the test ends
        return 1.0

    try:
        result = build_reward_fn_from(compute_score, on_error=-1.0, timeout_s=0.05).score(
            _prompts("1"), 2, ["ok", "hang"])
    finally:
        release.set()
    np.testing.assert_array_equal(result.rewards, np.array([1.0, -1.0], dtype=np.float32))
    assert result.errors == ["1: RewardTimeout: the call took longer than reward.timeout_s = 0.05 s"]


def test_an_async_call_past_the_timeout_is_cancelled():
    cancelled = []

    async def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            try:
                await asyncio.Event().wait()  # never set
            except asyncio.CancelledError:
                cancelled.append(solution_str)
                raise
        return 1.0

    result = build_reward_fn_from(compute_score, timeout_s=0.05).score(_prompts("1"), 2, ["hang", "ok"])
    np.testing.assert_array_equal(result.rewards, np.array([0.0, 1.0], dtype=np.float32))
    assert result.errors == ["0: RewardTimeout: the call took longer than reward.timeout_s = 0.05 s"]
    assert cancelled == ["hang"]


def test_a_batched_timeout_fails_the_batch_without_per_sample_retries():
    calls = []
    release = threading.Event()

    def score_all(prompts, completions):
        calls.append(len(completions))
        release.wait()
        return [1.0] * len(completions)

    try:
        result = build_reward_fn_from(score_all, timeout_s=0.05).score(_prompts("1"), 3, ["a", "b", "c"])
    finally:
        release.set()
    assert calls == [3]  # one call; retrying one sample at a time would wait 3 more timeouts
    assert len(result.errors) == 3 and all("RewardTimeout" in e for e in result.errors)


def build_reward_fn_from(fn, **kwargs):
    import sys
    import types

    module = types.ModuleType("reward_forms_plugin")
    module.fn = fn
    sys.modules["reward_forms_plugin"] = module
    try:
        return build_reward_fn("reward_forms_plugin:fn", **kwargs)
    finally:
        del sys.modules["reward_forms_plugin"]


# ------------------------------------------------------------------ metrics and failures

def test_step_metrics_count_errors_and_average_extras():
    batches = [
        SimpleNamespace(reward_errors=["s1: KeyError: x"], reward_extras={"acc": [1.0, math.nan], "mean": [4.0, 2.0]}),
        SimpleNamespace(reward_errors=[], reward_extras={"acc": [0.0, 0.5], "fmt": [math.nan, math.nan]}),
    ]
    # acc: (1 + 0 + 0.5) / 3 samples that returned it = 0.5; "mean" would overwrite the
    # trainer's reward/mean, so it moves to reward/extra/mean = 3; fmt has no value at all
    assert summarise_reward_extras(batches) == {"reward/errors": 1.0, "reward/acc": 0.5, "reward/extra/mean": 3.0}


def test_step_failure_tracker_fires_only_for_a_complete_all_failed_step():
    tracker = StepFailureTracker(samples_per_step=4)
    assert not tracker.record(0, 2, 2)  # half of step 0, all failed so far
    assert not tracker.record(1, 2, 1)
    assert tracker.record(0, 2, 2)  # step 0 complete: 4 of 4 failed
    assert not tracker.record(1, 2, 2)  # step 1 complete: 3 of 4 failed
    assert tracker._steps == {}  # complete steps are forgotten


def _stage(reward_fn_spec: str, prompts_per_step=2, n=2):
    cfg = decode_config({"reward": {"function": reward_fn_spec}, "rollout": {"n": n},
                         "train": {"prompts_per_step": prompts_per_step},
                         "dataflow": {"prompts_per_micro_batch": 1}})
    warnings = []
    log = SimpleNamespace(warning=lambda event, **kw: warnings.append((event, kw)), debug=lambda *a, **k: None)
    stage = RewardStage()
    asyncio.run(stage.setup(SimpleNamespace(config=cfg, log=log)))
    return stage, warnings


def _batch(step: int, batch_id: int, group: int = 2) -> RolloutBatch:
    zeros = np.zeros((group, 1), np.int32)
    return RolloutBatch(
        batch_id=batch_id, step=step, prompts=_prompts("1"), group_size=group,
        sample_ids=[f"b{batch_id}s{i}" for i in range(group)], prompt_ids=zeros, prompt_lens=np.ones(group, np.int32),
        completion_ids=zeros, completion_lens=np.ones(group, np.int32), completions=["1"] * group,
        behaviour_logprobs=zeros.astype(np.float32), token_versions=zeros, policy_version=0,
    )


def test_a_step_whose_every_sample_fails_stops_the_run(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    raise KeyError('answer')\n")
    stage, warnings = _stage(f"{path}:compute_score")  # a step = 2 prompts x n 2 = 4 samples
    out = asyncio.run(stage.process(_batch(step=0, batch_id=0)))
    # errors name their sample ids on the wire (the core numbers samples 0, 1)
    assert out.reward_errors == ["b0s0: KeyError: 'answer'", "b0s1: KeyError: 'answer'"]
    with pytest.raises(RewardFailedError) as info:
        asyncio.run(stage.process(_batch(step=0, batch_id=1)))
    assert str(info.value) == (f"reward function {path}:compute_score failed on every sample of step 0 "
                               f"(4 samples); first error: b1s0: KeyError: 'answer'")
    # the first failure, once, at warning level with the function's name
    assert [(e, kw["function"], kw["error"]) for e, kw in warnings] == [
        ("reward_failed", f"{path}:compute_score", "b0s0: KeyError: 'answer'")]
    assert stage.result() == {"state": "scoring", "samples": 4, "failed": 4,
                              "first_error": "b0s0: KeyError: 'answer'"}


def test_errors_are_labelled_with_sample_ids():
    assert label_errors(["1: ValueError: x: y", "0: returned non-number 'a'"], ["s:a", "s:b"]) == [
        "s:b: ValueError: x: y", "s:a: returned non-number 'a'"]


def test_a_step_with_one_good_sample_goes_on(tmp_path):
    path = tmp_path / "flaky.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    if extra_info.get('ok'):\n        return 1.0\n    raise ValueError('no')\n")
    stage, _ = _stage(f"{path}:compute_score")
    asyncio.run(stage.process(_batch(step=0, batch_id=0)))
    good = _batch(step=0, batch_id=1)
    good = RolloutBatch(**{**{f: getattr(good, f) for f in good.__struct_fields__},
                           "prompts": [Prompt(prompt_id="p9", text="1=", ground_truth="1", extra_info={"ok": True})]})
    out = asyncio.run(stage.process(good))
    np.testing.assert_array_equal(out.rewards, np.array([1.0, 1.0], dtype=np.float32))
    assert stage.result()["failed"] == 2
