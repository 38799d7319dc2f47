"""``dataflow.max_staleness: auto``: the measurement, the rule, when it decides, the
schedule of η by step and the config rules. Expected values are derived in comments."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from pipeline.config import ConfigError, decode_config
from pipeline.memory.splitting import merge_rollout_batches, split_rollout_batch
from pipeline.staleness import AutoStaleness, StepTimes, decide_max_staleness, measure_step
from pipeline.types import Prompt, PromptBatch, RolloutBatch, Span
from pipeline.versions import batch_bound, is_too_stale, required_serving_version
from stages.rollout.base import Completion, GenerationResult
from stages.rollout.stage import build_rollout_batch


def span(stage: str, kind: str, start: float, end: float, batch_id: int = -1) -> Span:
    return Span(stage=stage, kind=kind, start=start, end=end, batch_id=batch_id)


# ------------------------------------------------------------------ measurement

def test_a_version_wait_inside_a_busy_span_is_not_generation():
    spans = [
        # Batch 1 is busy [0, 10] but held by the staleness limit for [0, 4] of it;
        # batch 2 generates [2, 6] meanwhile.
        span("rollout", "busy", 0.0, 10.0, 1), span("rollout", "wait_version", 0.0, 4.0, 1),
        span("rollout", "busy", 2.0, 6.0, 2),
        span("trainer", "busy", 1.0, 3.0, 5), span("trainer", "busy", 5.0, 9.0, 6),
        span("trainer", "wait_input", 3.0, 5.0),  # not busy: not counted
        span("reward", "busy", 0.0, 10.0, 1),  # other stages do not count
    ]
    t = measure_step(spans, (0.0, 10.0))
    # generating: batch 1's [4, 10] u batch 2's [2, 6] = [2, 10] = 8 s; held back: the
    # wait [0, 4] minus the generating [2, 10] = [0, 2] = 2 s; trainer [1,3] u [5,9] = 6 s.
    assert t == StepTimes(window_s=10.0, trainer_busy_s=6.0, rollout_generating_s=8.0, rollout_gated_s=2.0)


def test_measurement_is_clipped_to_the_window_and_averaged_over_replicas():
    spans = [
        span("rollout", "busy", -5.0, 4.0, 1), span("rollout", "wait_version", -5.0, 1.0, 1),
        span("rollout:1", "busy", 0.0, 2.0, 2),
        span("rollout:1", "busy", 6.0, 8.0, 3), span("rollout:1", "wait_version", 6.0, 7.0, 3),
        span("trainer", "busy", 8.0, 12.0, 4),
    ]
    t = measure_step(spans, (0.0, 10.0))
    # replica 0: generates [1, 4] = 3 s, held [0, 1] = 1 s; replica 1: generates [0, 2] u
    # [7, 8] = 3 s, held [6, 7] = 1 s. Means: 3 and 1. Trainer: [8, 10] = 2 s of the window.
    assert t == StepTimes(window_s=10.0, trainer_busy_s=2.0, rollout_generating_s=3.0, rollout_gated_s=1.0)


# ------------------------------------------------------------------ the rule

def test_trainer_bound_stays():
    # The trainer is busy 95% of the window: it is the bottleneck, even though the limit
    # holds the rollout back half the time (it is ahead and waits for the trainer).
    d = decide_max_staleness(1, 4, StepTimes(window_s=10.0, trainer_busy_s=9.5, rollout_generating_s=4.0,
                                             rollout_gated_s=5.0))
    assert (d.before, d.after, d.changed) == (1, 1, False)
    assert "trainer busy 95% of step time" in d.reason and "bottleneck" in d.reason
    assert d.describe().startswith("max_staleness auto: stays 1 (trainer busy 95%")


def test_rollout_bound_stays():
    # The trainer waits 40% but the limit held the rollout back 5% only: generation is
    # the bottleneck; letting it run further ahead would not make it generate faster.
    d = decide_max_staleness(1, 4, StepTimes(window_s=10.0, trainer_busy_s=6.0, rollout_generating_s=9.0,
                                             rollout_gated_s=0.5))
    assert not d.changed
    assert d.reason.startswith("trainer waited 40% of step time for data; rollout blocked by staleness 5%, "
                               "generating 90%")
    assert "generation or scoring is the bottleneck" in d.reason


def test_rollout_held_back_while_the_trainer_waits_rises_one_step():
    # R = T = L (generate, train, and the rest of the loop take one unit each). At η = 1
    # the loop of 2 steps takes 3 units: a step takes 1.5, each stage is busy 1/1.5 = 67%,
    # the trainer waits 33% and the rollout waits for weights 33%: one step more.
    d = decide_max_staleness(1, 4, StepTimes(window_s=1.5, trainer_busy_s=1.0, rollout_generating_s=1.0,
                                             rollout_gated_s=0.5))
    assert (d.before, d.after, d.changed) == (1, 2, True)
    assert d.describe() == ("max_staleness auto: 1 -> 2 (trainer waited 33% of step time for data; rollout "
                            "blocked by staleness 33%, generating 67%)")
    # Both signals at the threshold (10%, in whole percent as the reason shows them: 9.5%
    # reads 10%) count; 9.4% (9%) does not.
    at = StepTimes(window_s=10.0, trainer_busy_s=9.0, rollout_generating_s=9.0, rollout_gated_s=0.95)
    assert decide_max_staleness(2, 4, at).after == 3
    below = StepTimes(window_s=10.0, trainer_busy_s=9.0, rollout_generating_s=9.0, rollout_gated_s=0.94)
    assert not decide_max_staleness(2, 4, below).changed


def test_samples_dropped_as_stale_while_the_trainer_waits_raise_it():
    # Long samples outlive η: 20 of 100 made were dropped as stale (generation thrown
    # away) while the trainer waited 30%, though the limit barely held the rollout back.
    waits = dict(window_s=10.0, trainer_busy_s=7.0, rollout_generating_s=9.5, rollout_gated_s=0.2)
    d = decide_max_staleness(1, 4, StepTimes(**waits, samples_trained=80, samples_stale=20))
    assert d.after == 2 and d.reason == ("trainer waited 30% of step time for data; rollout blocked by staleness 2%, "
                                         "generating 95%; 20% of samples dropped as stale")
    # 5 of 100 is not worth a step of staleness; a trainer-bound run is not helped by either.
    assert not decide_max_staleness(1, 4, StepTimes(**waits, samples_trained=95, samples_stale=5)).changed
    busy = dict(waits, trainer_busy_s=9.5)
    assert not decide_max_staleness(1, 4, StepTimes(**busy, samples_trained=50, samples_stale=50)).changed


def test_measure_counts_a_steps_samples_from_the_trainers_running_totals():
    auto = AutoStaleness(cap=4)
    spans = [span("trainer", "busy", 0.0, 1.0, 1)]
    first = auto.measure({"samples/trained": 64, "samples/dropped_stale": 8}, spans, (0.0, 2.0))
    assert (first.samples_trained, first.samples_stale, first.trainer_busy_s) == (0, 0, 1.0)  # nothing before it
    second = auto.measure({"samples/trained": 128, "samples/dropped_stale": 24}, spans, (1.0, 2.0))
    assert (second.samples_trained, second.samples_stale, second.trainer_busy_s) == (64, 16, 0.0)
    assert (first + second).stale_share == 16 / 80


def test_at_the_cap_eta_stays():
    d = decide_max_staleness(4, 4, StepTimes(window_s=10.0, trainer_busy_s=2.5, rollout_generating_s=2.5,
                                             rollout_gated_s=6.0))
    assert not d.changed and d.reason.endswith("at dataflow.max_staleness_cap 4")
    assert d.reason.startswith("trainer waited 75% of step time for data; rollout blocked by staleness 60%")


# ------------------------------------------------------------------ when it decides

GATED = StepTimes(window_s=1.5, trainer_busy_s=1.0, rollout_generating_s=1.0, rollout_gated_s=0.5)  # one step more


class FakeController:
    """The controller's ``set_max_staleness``, recorded."""

    def __init__(self) -> None:
        self.calls = []

    async def set_max_staleness(self, eta: int, reason: str) -> None:
        self.calls.append((eta, reason))


def test_decisions_wait_for_the_warmup_and_a_whole_window_then_measure_from_the_new_eta():
    auto = AutoStaleness(cap=3, warmup=2, window=2)
    controller = FakeController()

    def after(step: int, times: StepTimes, known: int):
        return asyncio.run(auto.after_step(controller, step, times, known))

    assert after(0, GATED, 1) is None and after(1, GATED, 1) is None  # warm-up
    assert after(2, GATED, 1) is None  # the window has one step of two
    d = after(3, GATED, 1)
    # Steps 2 and 3 summed: shares as GATED's, so 1 -> 2.
    assert (d.before, d.after) == (1, 2) and controller.calls == [(2, d.reason)]
    assert auto.log == [{"step": 3, "before": 1, "after": 2, "reason": d.reason}]
    # The rollout takes η 2 with the update published after step 4; what it generated
    # before, up to 2 steps ahead, trains first: measured again from step 3 + 2 + 2 = 7.
    assert auto.measure_from == 7 and auto.current == 2
    # The controller's older report (1) does not take the raise back.
    assert after(4, GATED, 1) is None and after(6, GATED, 1) is None
    assert after(7, GATED, 1) is None
    d = after(8, GATED, 2)
    assert (d.before, d.after) == (2, 3)
    assert after(20, GATED, 3) is None and after(21, GATED, 3) is None  # at the cap: no more decisions
    assert len(controller.calls) == 2


def test_a_verdict_that_keeps_eta_calls_nothing_and_decisions_go_on():
    auto = AutoStaleness(cap=4, warmup=0, window=1)
    controller = FakeController()
    busy = StepTimes(window_s=1.0, trainer_busy_s=1.0, rollout_generating_s=0.2, rollout_gated_s=0.8)
    for step in range(3):
        d = asyncio.run(auto.after_step(controller, step, busy, 1))
        assert d is not None and not d.changed
    # Only the first verdict that keeps η is kept (and shown at info level), and the latest.
    assert controller.calls == [] and [e["step"] for e in auto.log] == [0] and auto.latest["step"] == 2


# ------------------------------------------------------------------ the bound a batch carries

def test_a_batch_carries_the_bound_it_was_generated_under_to_the_trainer():
    pb = PromptBatch(batch_id=3, step=5, prompts=[Prompt(prompt_id="p0", text="1=", token_ids=[1, 2])])
    done = GenerationResult(prompt_token_ids=[1, 2], completions=[
        Completion(token_ids=[3], logprobs=[-0.1], token_versions=[3], text="3", finish_reason="stop"),
        Completion(token_ids=[4], logprobs=[-0.2], token_versions=[3], text="4", finish_reason="stop")])
    batch = build_rollout_batch(pb, [done], n=2, pad_id=0, max_staleness=2)
    assert batch.max_staleness == 2 and batch_bound(batch.max_staleness, 1) == 2
    # Step 5 generated on v3 under η 2 (required_serving_version(5, 2, 1) = 3): trainable at
    # step 5 under its own bound, not under the config's 1.
    assert required_serving_version(5, 2, 1) == 3 and batch.policy_version == 3
    assert not is_too_stale(5, batch.policy_version, batch_bound(batch.max_staleness, 1))
    assert is_too_stale(5, batch.policy_version, 1)
    assert batch_bound(None, 1) == 1  # a custom rollout that sets none: the config's
    # Pieces keep it; merged pieces (a regrouping may mix bounds) take the largest, each
    # having been at most the η in force, which only grows.
    pieces = split_rollout_batch(batch, 1)
    assert [p.max_staleness for p in pieces] == [2] and merge_rollout_batches(pieces).max_staleness == 2
    other = msgspec.structs.replace(batch, sample_ids=["p1/0", "p1/1"],
                                    prompts=[Prompt(prompt_id="p1", text="2=")], max_staleness=1)
    assert merge_rollout_batches([other, batch]).max_staleness == 2
    assert merge_rollout_batches([msgspec.structs.replace(batch, max_staleness=None),
                                  msgspec.structs.replace(other, max_staleness=None)]).max_staleness is None
    assert isinstance(batch, RolloutBatch) and np.asarray(batch.token_versions).min() == 3


# ------------------------------------------------------------------ config

def test_auto_starts_at_one_or_the_sync_interval_and_describes_itself():
    cfg = decode_config({"dataflow": {"max_staleness": "auto"}})
    assert cfg.auto_staleness and cfg.initial_max_staleness == 1 and cfg.dataflow.max_staleness_cap == 4
    assert cfg.describe_staleness == "auto (from 1, at most 4)"
    # Weights every 3 steps: a step may generate on weights 2 steps old, so η starts at 2.
    cfg = decode_config({"dataflow": {"max_staleness": "auto", "max_staleness_cap": 5}, "train": {"sync_interval": 3}})
    assert cfg.initial_max_staleness == 2 and cfg.describe_staleness == "auto (from 2, at most 5)"
    fixed = decode_config({"dataflow": {"max_staleness": 2}})
    assert not fixed.auto_staleness and fixed.initial_max_staleness == 2 and fixed.describe_staleness == "2"


@pytest.mark.parametrize(("raw", "message"), [
    ({"dataflow": {"max_staleness": "auto", "async_execution": False}},
     "dataflow.max_staleness: 'auto' needs dataflow.async_execution: true"),
    ({"dataflow": {"max_staleness": "auto"}, "train": {"sync_interval": 7}},
     "dataflow.max_staleness_cap: expected >= train.sync_interval - 1 (6)"),
    # Settings that are exact only on-policy (η = 0) refuse it, naming the key.
    ({"dataflow": {"max_staleness": "auto"}, "rollout": {"logprobs": False}},
     "dataflow.max_staleness: expected 0 (samples trained by the weights that generated them), got 'auto' "
     "with rollout.logprobs: false"),
    ({"placement": "colocate", "dataflow": {"max_staleness": "auto", "async_execution": False}},
     "dataflow.max_staleness: expected 0 (a step generates on the weights of the step before), got 'auto' "
     "with placement: colocate"),
    ({"dataflow": {"max_staleness": "fast"}},
     "dataflow.max_staleness: expected an integer >= 0 or one of ['auto'], got 'fast'"),
    ({"dataflow": {"max_staleness_cap": 0}}, "dataflow.max_staleness_cap: expected int >= 1, got 0"),
    ({"dataflow": {"max_staleness": 2, "tail_slack": 3}},
     "dataflow.tail_slack: expected <= dataflow.max_staleness - (train.sync_interval - 1) (2)"),
    ({"dataflow": {"max_staleness": 0, "async_execution": False, "tail_slack": 1}},
     "dataflow.tail_slack: expected <= dataflow.max_staleness - (train.sync_interval - 1) (0)"),
])
def test_auto_is_refused_where_it_cannot_apply(raw, message):
    with pytest.raises(ConfigError) as err:
        decode_config(raw)
    assert str(err.value).startswith(message), str(err.value)


def test_auto_is_refused_for_an_offline_algorithm(tmp_path):
    rows = tmp_path / "pairs.jsonl"
    rows.write_text('{"prompt": "1=", "chosen": "1", "rejected": "2"}\n')
    with pytest.raises(ConfigError, match=r"dataflow.max_staleness: 'auto' tunes how far generation runs ahead of "
                                          r"training; algorithm 'dpo' trains on data rows"):
        decode_config({"algorithm": {"name": "dpo", "kl_coef": 0}, "data": {"path": str(rows), "pairs": {}},
                       "rollout": {"n": 2}, "dataflow": {"max_staleness": "auto"}})


def test_conveyor_status_shows_eta_and_the_latest_verdict():
    from pipeline.status import describe_live_staleness

    latest = {"step": 9, "before": 2, "after": 2, "reason": "trainer busy 95% of step time: ..."}
    board = {"current": 2, "start": 1, "auto": True, "decisions": [], "latest": latest}
    assert describe_live_staleness(board) == ["max_staleness auto: 2 now (started at 1)",
                                              "  after step 9: stays 2 (trainer busy 95% of step time: ...)"]
    assert describe_live_staleness({**board, "auto": False}) == [] and describe_live_staleness(None) == []


def test_the_rollout_starts_a_step_later_by_the_tail_slack():
    from pipeline.config import load_config
    from stages.rollout.stage import RolloutStage

    stage = RolloutStage.__new__(RolloutStage)  # only the gate's arithmetic: no engine
    stage.max_staleness = None
    for slack, need in ((0, 3), (1, 4), (2, 5)):
        stage.cfg = load_config(None, ["dataflow.max_staleness=2", f"dataflow.tail_slack={slack}"])
        assert stage._needs(5) == need  # step 5 under η 2: trainable through step 5 + slack
