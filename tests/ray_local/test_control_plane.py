"""Ray tier: what the control plane costs, over the real stage shells, queues, runner and
controller, with the fake cores that talk to the controller as the real source, rollout
and trainer do (``bench/fake_cores.py``, the overlap benchmark's chain).

The budget (``pipeline/controller.py``): at most one controller call per micro-batch
(the source's admission), one per optimizer step (``finish_step``) and one per weight
update per rollout worker (``wait_for_update``); telemetry is pulled by the driver from
the stages and never reaches the controller.
"""

from __future__ import annotations

from bench.fake_cores import GenerationLengths
from bench.overlap import Scenario, build_overlap_dataflow
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
