"""``pipeline.bound``: what bounded a run and the key that moves it, from its measured figures.

The first two cases are rows measured on one GPU (docs/performance/longtail.md, the
long-tail job at full lengths, commit 4b81055), typed in from their result file: the
verdict is what reading them by hand concluded."""

from __future__ import annotations

import pytest

from pipeline.bound import diagnose_bound
from pipeline.config import load_config

LONGTAIL = "configs/longtail.yaml"


def stages(rollout: float, trainer: float, rollout_s: dict | None = None, trainer_s: dict | None = None,
           reward: float = 0.001) -> dict:
    return {"rollout": {"busy_ratio": rollout, "seconds": {"busy": 100.0, **(rollout_s or {})}},
            "reward": {"busy_ratio": reward, "seconds": {"busy": reward * 100}},
            "trainer": {"busy_ratio": trainer, "seconds": {"busy": 100.0, **(trainer_s or {})}},
            "source": {"busy_ratio": 0.0, "seconds": {}}}


def engine(mean: float, peak: float, preemptions: int = 0, updates: int = 0, requests: float = 100.0) -> dict:
    return {"engine": {"kv_usage_mean": mean, "kv_usage_max": peak, "preemptions": preemptions,
                       "update_recomputes": updates, "mean_requests": requests}}


def test_admission_holding_generation_back_names_kv_reserve_none():
    """Streaming at ``kv_reserve: cap``: the rollout waited for reserved cache 84% of its
    busy time and deferred 72 micro-batches while vLLM used at most 61% of its cache."""
    cfg = load_config(LONGTAIL, ["rollout.kv_reserve=cap"])
    rollout = {**engine(0.34, 0.61, 288, requests=50.3), "kv_reserve": "cap",
               "admission/rollout/deferred": 72.0, "admission/rollout/admitted": 96.0}
    bound = diagnose_bound(stages(0.99, 0.34, {"busy": 136.45, "wait_memory": 114.5}, {"busy": 47.4}), [rollout],
                           cfg, shares_gpu=True)
    assert (bound.stage, bound.change) == ("rollout", ["rollout.kv_reserve=none"])
    assert "deferred 72 micro-batches" in bound.why and "61% at most" in bound.why


def test_a_full_cache_beside_a_busy_trainer_asks_for_another_gpu_not_a_smaller_pass():
    """Streaming at ``none``: the cache full (2,014 preemptions), the trainer 89% busy."""
    cfg = load_config(LONGTAIL)
    bound = diagnose_bound(stages(0.99, 0.89), [engine(0.79, 1.0, 2014, requests=170.7)], cfg, shares_gpu=True)
    assert bound.stage == "rollout" and bound.change == ["a GPU more (the rollout on its own)"]
    assert "2014 preemptions" in bound.why and "busy 89%" in bound.why
    assert bound.describe().startswith("bound: rollout (99% busy): vLLM's KV cache 79% used on average")


def test_a_full_cache_beside_an_idle_trainer_asks_for_a_smaller_trainer_pass():
    cfg = load_config(LONGTAIL)
    bound = diagnose_bound(stages(0.99, 0.5), [engine(0.8, 1.0, 500, updates=100)], cfg, shares_gpu=True)
    assert bound.change == [f"train.pass_tokens={cfg.train.pass_tokens // 2}", "train.gradient_checkpointing=true"]
    assert "400 preemptions beyond the weight updates'" in bound.why
    # Full once, mostly unused and preempting only for the updates: the cache was not short.
    bound = diagnose_bound(stages(0.99, 0.5), [engine(0.3, 1.0, 100, updates=100)], cfg, shares_gpu=True)
    assert bound.change == ["rollout.num_workers"]
    # On a GPU of its own the cache is vLLM's share to raise, or the size the user gave it.
    bound = diagnose_bound(stages(0.99, 0.5), [engine(0.8, 1.0, 500)], cfg, shares_gpu=False)
    assert bound.change == ["rollout.gpu_memory_utilization", "rollout.num_workers"]
    sized = load_config(LONGTAIL, ["rollout.kv_cache_gib=2"])
    bound = diagnose_bound(stages(0.99, 0.5), [engine(0.8, 1.0, 0)], sized, shares_gpu=False)
    assert bound.change == ["rollout.kv_cache_gib", "rollout.num_workers"]


def test_a_rollout_with_cache_to_spare_asks_for_more_in_flight_only_at_its_limit_or_streaming():
    cfg = load_config(LONGTAIL)  # 64 micro-batches of 1 prompt x 8 samples in flight: 512
    limit = cfg.rollout.max_inflight * cfg.dataflow.prompts_per_micro_batch * cfg.rollout.n
    bound = diagnose_bound(stages(0.98, 0.3), [engine(0.2, 0.4, requests=0.8 * limit)], cfg, shares_gpu=True)
    assert bound.change == [f"rollout.max_inflight={2 * cfg.rollout.max_inflight}"]
    assert f"{0.8 * limit:.0f} requests in flight on average of the {limit} it may have" in bound.why
    # Well under the limit with the cache unused: vLLM's own rate bounds it (a CPU run, measured so).
    bound = diagnose_bound(stages(0.92, 0.3), [engine(0.03, 0.12, requests=149)], cfg, shares_gpu=False)
    assert bound.change == ["rollout.num_workers"] and "vLLM ran at its own rate" in bound.why
    lockstep = load_config(LONGTAIL, ["dataflow.async_execution=false", "dataflow.max_staleness=0"])
    bound = diagnose_bound(stages(0.98, 0.3), [engine(0.2, 0.4, requests=12)], lockstep, shares_gpu=True)
    assert bound.change == ["dataflow.async_execution=true"]


def test_generation_held_by_the_staleness_limit_asks_for_a_larger_eta():
    cfg = load_config(LONGTAIL)
    held = stages(0.95, 0.6, {"wait_version": 30.0})
    bound = diagnose_bound(held, [engine(0.5, 0.9)], cfg, shares_gpu=True)
    assert bound.change == ["dataflow.max_staleness=auto", f"dataflow.max_staleness={cfg.initial_max_staleness + 1}"]
    auto = load_config(LONGTAIL, ["dataflow.max_staleness=auto"])
    assert diagnose_bound(held, [engine(0.5, 0.9)], auto, shares_gpu=True).change == [
        f"dataflow.max_staleness_cap={auto.dataflow.max_staleness_cap + 1}"]


@pytest.mark.parametrize(("trainer_s", "retries", "shares", "peak", "change"), [
    ({"wait_memory": 20.0}, 0.0, True, 0.9, ["train.pass_tokens=8192", "train.gradient_checkpointing=true"]),
    ({}, 3.0, False, 0.9, ["train.pass_tokens=8192", "train.gradient_checkpointing=true"]),
    ({}, 0.0, True, 0.3, ["rollout.kv_cache_gib", "train.pass_tokens"]),
    ({}, 0.0, False, 0.3, ["train.num_ranks", "train.compile=on", "model.lora.enabled=true"]),
])
def test_a_trainer_bound_run_names_its_memory_or_its_rate(trainer_s, retries, shares, peak, change):
    cfg = load_config(LONGTAIL, ["train.pass_tokens=16384"])
    bound = diagnose_bound(stages(0.74, 0.99, trainer_s=trainer_s), [engine(0.2, peak)], cfg, shares_gpu=shares,
                           allocator_retries=retries)
    assert (bound.stage, bound.change) == ("trainer", change)


def test_ties_go_to_the_rollout_and_an_idle_run_names_no_stage():
    cfg = load_config(LONGTAIL)
    assert diagnose_bound(stages(0.9, 0.9), [engine(0.5, 0.7)], cfg, shares_gpu=True).stage == "rollout"
    idle = diagnose_bound(stages(0.3, 0.2), [], cfg, shares_gpu=False)
    assert idle.stage is None and idle.change == [] and "no stage was busy 50%" in idle.why
    reward = diagnose_bound(stages(0.6, 0.4, reward=0.95), [], cfg, shares_gpu=False)
    assert (reward.stage, reward.change) == ("reward", ["reward.signature=batched"])
    # A backend without vLLM's scheduler: the rollout bound, its engine unread.
    assert diagnose_bound(stages(0.99, 0.5), [{}], cfg, shares_gpu=False).change == ["rollout.num_workers"]


def test_the_early_window_is_steps_3_to_6_read_two_steps_later_with_spans_that_ended_late():
    """Steps end every 10 s (step 2 at t=20, step 6 at t=60). A rollout micro-batch busy
    from t=15 to t=70 (waiting for weights 25..45) is reported when it ends, after step 6:
    read at step 8 it counts, clipped to the window, as the whole window busy; a span
    reported after the read counts for nothing. The engine's idle seconds are those
    gained over the window."""
    from pipeline.bound import BoundWindow
    from pipeline.types import Span

    def span(stage, kind, start, end, batch):
        return Span(stage=stage, kind=kind, start=start, end=end, batch_id=batch)

    window = BoundWindow()
    engine = {2: (5.0, 10.0), 6: (25.0, 50.0)}  # cumulative (idle, total) at those steps' ends
    read = []
    for step in range(1, 10):
        if step == 7:
            window.add_spans([span("rollout", "busy", 15.0, 70.0, 1), span("rollout", "wait_version", 25.0, 45.0, 1),
                              span("trainer", "busy", 30.0, 50.0, 2), span("trainer", "busy", 5.0, 12.0, 0)])
        if step == 9:
            window.add_spans([span("trainer", "busy", 20.0, 60.0, 3)])  # after the read: not counted
        idle, total = engine.get(step, (0.0, 0.0))
        status = {"engine_seconds": {"idle": idle, "total": total}, "kv_reserve": "none"}
        read.append(window.step_ended(step, 10.0 * step, [status]))
    assert read == [False] * 7 + [True, False] and window.window == [20.0, 60.0]
    got = window.stages()
    assert got["rollout"]["busy_ratio"] == 1.0 and got["rollout"]["seconds"]["wait_version"] == 20.0
    assert got["trainer"]["busy_ratio"] == 0.5  # 30..50 of 20..60; the span before the window is out
    assert window.rollouts() == [{"engine_seconds": {"idle": 20.0, "total": 40.0}, "kv_reserve": "none"}]
    bound = diagnose_bound(got, window.rollouts(), load_config(LONGTAIL), shares_gpu=True)
    assert bound.stage == "rollout" and bound.change[0] == "dataflow.max_staleness=auto"
    assert bound.why.startswith("vLLM had nothing in flight 50% of the time; micro-batches waited for newer weights "
                                "(the staleness limit) 50% of the time")


def test_the_live_status_shows_the_early_bound():
    from pipeline.status import describe_live_bound

    assert describe_live_bound(None) == []
    line = describe_live_bound({"steps": [3, 6], "stage": "trainer", "busy_share": 0.97,
                                "why": "the trainer ran at its rate", "change": ["train.num_ranks"]})
    assert line == ["bound over steps 3 to 6: trainer (97% busy): the trainer ran at its rate; try train.num_ranks"]
