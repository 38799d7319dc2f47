"""Ray tier: what the control plane costs, over the real stage shells, queues, runner and
controller, with the fake cores that talk to the controller as the real source, rollout
and trainer do (``bench/fake_cores.py``, the overlap benchmark's chain).

The budget (``pipeline/controller.py``): at most one controller call per micro-batch
(the source's admission), one per optimizer step (``finish_step``) and one per weight
update per rollout worker (``wait_for_update``); telemetry is pulled by the driver from
the stages and never reaches the controller.
"""

from __future__ import annotations

import pytest
import ray

from bench.fake_cores import GenerationLengths
from bench.overlap import Scenario, build_overlap_dataflow
from pipeline.controller import ControllerActor
from pipeline.runner import RunResult, run_dataflow

STEPS, MICRO_BATCHES_PER_STEP, PROMPTS_PER_MICRO_BATCH = 6, 4, 2
PROMPTS_PER_STEP = MICRO_BATCHES_PER_STEP * PROMPTS_PER_MICRO_BATCH


def run_fake_chain(async_execution: bool, max_staleness: int, stage_s: float = 0.0) -> RunResult:
    sc = Scenario("test", stage_s, stage_s, stage_s, stage_s, lengths=GenerationLengths(samples=4, sigma=0.0),
                  micro_batches=STEPS * MICRO_BATCHES_PER_STEP, prompts_per_micro_batch=PROMPTS_PER_MICRO_BATCH,
                  prompts_per_step=PROMPTS_PER_STEP, payload_bytes=0, apply_s=0.0)
    # A short tick: telemetry is pulled many times, and must still not reach the controller.
    return run_dataflow(build_overlap_dataflow(sc, max_staleness), None, async_execution=async_execution,
                        micro_batches_per_step=MICRO_BATCHES_PER_STEP, target_prompts=STEPS * PROMPTS_PER_STEP,
                        prompts_per_step=PROMPTS_PER_STEP, tick_s=0.05)


def test_at_most_one_controller_call_per_micro_batch(ray_cluster):
    result = run_fake_chain(async_execution=True, max_staleness=1)
    micro_batches = STEPS * MICRO_BATCHES_PER_STEP
    assert result.result("trainer")["items"] == micro_batches
    calls = result.controller["calls"]
    per_step = calls.pop("finish_step")
    # The watcher's waits: one per published version, plus the one pending at the end.
    per_update = calls.pop("wait_for_update")
    assert per_step == STEPS and per_update == STEPS + 1, result.controller["calls"]
    # What is left is the data path's: the source's admissions (one per micro-batch and
    # the final "no more"), nothing per micro-batch from any other stage.
    assert calls == {"admit_prompts": micro_batches + 1}
    assert (sum(calls.values()) - 1) / micro_batches <= 1.0
    # The confirmations rode on the waits: the board knows the final version served.
    assert result.controller["served"]["rollout:0"]["version"] == STEPS


def test_a_stages_outputs_ride_with_its_next_lease_while_its_input_waits_queued(ray_cluster):
    """The source runs ahead, so the rollout's next input is already leased when an item
    ends: its outputs then go in the call that leases the item after (one call, not two)."""
    result = run_fake_chain(async_execution=True, max_staleness=2, stage_s=0.02)
    edge = result.queues["rollout->reward"]
    assert edge["puts"] == STEPS * MICRO_BATCHES_PER_STEP
    assert edge["puts_with_lease"] >= edge["puts"] // 2, edge
    assert result.queues["source->rollout"]["puts_with_lease"] == 0  # the source leases nothing


def test_lockstep_is_a_step_barrier_over_the_same_queues(ray_cluster):
    """Lock-step moves the micro-batches through the same queues as streaming (the
    driver carries none), and no micro-batch of step k is generated before the trainer
    has finished step k - 1: exactly on-policy, with the same controller budget."""
    result = run_fake_chain(async_execution=False, max_staleness=0, stage_s=0.002)
    micro_batches = STEPS * MICRO_BATCHES_PER_STEP
    trainer = result.result("trainer")
    assert trainer["items"] == micro_batches and trainer["staleness_hist"] == {0: micro_batches}
    assert all(q["puts"] == micro_batches for q in result.queues.values())
    busy = [s for s in result.spans if s.kind == "busy"]
    for k in range(1, STEPS):
        step = range(k * MICRO_BATCHES_PER_STEP, (k + 1) * MICRO_BATCHES_PER_STEP)
        previous = range((k - 1) * MICRO_BATCHES_PER_STEP, k * MICRO_BATCHES_PER_STEP)
        generated_from = min(s.start for s in busy if s.stage == "rollout" and s.batch_id in step)
        trained_until = max(s.end for s in busy if s.stage == "trainer" and s.batch_id in previous)
        assert generated_from >= trained_until, k
    calls = dict(result.controller["calls"])
    assert calls.pop("finish_step") == STEPS and calls.pop("wait_for_update") == STEPS + 1
    assert calls == {"admit_prompts": micro_batches + 1}


def test_weight_updates_carry_eta_which_only_the_driver_raises_and_only_upwards(ray_cluster):
    """``max_staleness: auto``: the driver's raise reaches each rollout worker with its
    next weight update (no call of its own); η never falls."""
    from pipeline.types import WeightUpdate

    actor = ControllerActor.remote(16, 4, None, max_staleness=1, auto_staleness=True)
    update = WeightUpdate(version=1, sha256="0" * 64, fingerprint=(0.0, 0.0), num_bytes=1)
    ray.get(actor.publish.remote(update, [b"w"]))
    assert ray.get(actor.wait_for_update.remote(0, 1.0))[2] == 1
    ray.get(actor.set_max_staleness.remote(3, "measured"))
    got, payload, eta = ray.get(actor.wait_for_update.remote(0, 1.0))
    assert (got.version, payload, eta) == (1, [b"w"], 3)
    assert ray.get(actor.wait_for_update.remote(1, 0.01)) == (None, [], 3)  # timed out: η all the same
    board = ray.get(actor.summary.remote())["max_staleness"]
    assert (board["current"], board["start"], board["auto"]) == (3, 1, True)
    assert [(c["before"], c["after"], c["reason"]) for c in board["changes"]] == [(1, 3, "measured")]
    with pytest.raises(ray.exceptions.RayTaskError, match="below the current 3"):
        ray.get(actor.set_max_staleness.remote(2, "lower"))
    # A fixed η is not the driver's to change; without one, updates carry none.
    fixed = ControllerActor.remote(16, 4, None, max_staleness=1)
    with pytest.raises(ray.exceptions.RayTaskError, match="not 'auto'"):
        ray.get(fixed.set_max_staleness.remote(2, "no"))
    bare = ControllerActor.remote(16, 4)
    assert ray.get(bare.wait_for_update.remote(0, 0.01)) == (None, [], None)
    assert ray.get(bare.summary.remote())["max_staleness"] is None
    for a in (actor, fixed, bare):
        ray.kill(a)
