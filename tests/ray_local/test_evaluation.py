"""Held-out evaluation on the real controller and rollout stage, with a backend that
answers better with each version (``FakeAnsweringBackend``): rollout worker 0 evaluates
exactly the versions due, in order, each on its own weights, even when newer ones were
published meanwhile; training generation goes on beside it and counts none of it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from pipeline.config import decode_config
from pipeline.controller import MAX_HELD_EVAL_VERSIONS, ControllerActor, ControllerClient
from pipeline.evaluation import EvalSchedule, build_eval_schedule
from pipeline.types import EvalResult, Prompt, PromptBatch, WeightUpdate
from pipeline.weights import compute_sha256
from stages.evaluation.stage import EvalRolloutStage
from tests.ray_local.fakes import FakeStageContext

HELD_OUT = Path(__file__).resolve().parents[2] / "configs" / "data" / "first_digit_heldout.jsonl"
CONFIG = {
    "rollout": {"backend": "tests.ray_local.fakes:FakeAnsweringBackend", "n": 2, "max_tokens": 2, "max_inflight": 2},
    "dataflow": {"prompts_per_micro_batch": 2},
    "train": {"prompts_per_step": 2, "weight_sync_timeout_s": 30},
    "eval": {"path": str(HELD_OUT), "num_prompts": 6, "every": 2, "before_train": True, "n": 2, "temperature": 1.0},
}


def update(version: int) -> tuple[WeightUpdate, bytes]:
    data = f"weights-v{version}".encode()
    return WeightUpdate(version=version, sha256=compute_sha256(data), fingerprint=(1.0, 1.0), num_bytes=len(data)), data


async def drain_results(controller: ControllerClient, count: int) -> list[EvalResult]:
    found: list[EvalResult] = []
    deadline = time.time() + 60
    while len(found) < count and time.time() < deadline:
        found += (await controller.drain())["eval_results"]
        await asyncio.sleep(0.05)
    return found


def test_worker_zero_evaluates_each_due_version_on_its_own_weights(ray_cluster):
    cfg = decode_config(CONFIG)
    controller = ControllerClient(ControllerActor.remote(target_prompts=8, prompts_per_step=2,
                                                         evals=build_eval_schedule(cfg, 0)))

    async def scenario() -> tuple[list[EvalResult], list[tuple], dict, dict]:
        stage = EvalRolloutStage()
        ctx = FakeStageContext("rollout", cfg)
        ctx.controller = controller
        await stage.setup(ctx)  # the watcher will evaluate version 0 (before_train) first
        backend = stage.backend
        backend.gate = asyncio.Event()  # closed: that evaluation generates nothing yet
        # Meanwhile the trainer publishes four versions; then a training micro-batch arrives.
        for version in range(1, 5):
            await controller.publish(*update(version))
        backend.gate.set()
        batch = PromptBatch(batch_id=0, step=0, prompts=[Prompt(prompt_id="p0", text="41="),
                                                         Prompt(prompt_id="p1", text="52=")])
        trained = await stage.process(batch)
        assert trained.sample_ids == ["p0/0", "p0/1", "p1/0", "p1/1"]  # nothing of the evaluation
        found = await drain_results(controller, 3)
        # The last steps publish 5, 6 (due) and 7 as the run ends: the end evaluates 6, then
        # the final weights, once.
        for version in (5, 6, 7):
            await controller.publish(*update(version))
        await stage.finalize()
        await stage.finalize()
        found += await drain_results(controller, 2)
        status = stage.status()
        summary = await controller.summary()
        await stage.shutdown()
        return found, backend.events, status, summary

    results, events, status, summary = asyncio.run(scenario())
    assert [(r.version, r.kind, r.worker) for r in results] == [
        (0, "before_train", "rollout:0"), (2, "periodic", "rollout:0"), (4, "periodic", "rollout:0"),
        (6, "periodic", "rollout:0"), (7, "final", "rollout:0")]
    # Version 2 answers greedily and with its first sample; later ones with both; 0 never.
    by_version = {r.version: r.metrics for r in results}
    assert [by_version[v]["eval/greedy_reward"] for v in (0, 2, 4, 6, 7)] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [by_version[v]["eval/pass@1"] for v in (0, 2, 4, 6, 7)] == [0.0, 0.5, 1.0, 1.0, 1.0]
    assert [by_version[v]["eval/pass@2"] for v in (0, 2, 4, 6, 7)] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(m["eval/prompts"] == 6.0 for m in by_version.values())
    # Held back for the evaluations: 1 and 3 were never applied (nothing was due there),
    # 2 and 4 were although newer ones had been published; at the end 5 may have been
    # applied on its way (the watcher may have seen it alone); no generation saw a change
    # of weights.
    applied = [e[1] for e in events if e[0] == "update"]
    assert applied in ([2, 4, 6, 7], [2, 4, 5, 6, 7])
    generations = [e for e in events if e[0] == "generate"]
    assert all(began == ended for _, began, ended, _ in generations)
    # Per evaluation: 3 greedy calls and 3 sampled ones (6 prompts, 2 per call); the rest
    # are the warm-up and the training micro-batch.
    assert len(generations) == 1 + 1 + 5 * 6
    assert status["samples"] == 4  # the training micro-batch's only
    assert summary["evals"] == {"reported": 5, "skipped": [], "held": []}
    assert summary["served"]["rollout:0"]["version"] == 7


def test_the_controller_holds_due_versions_oldest_first_and_gives_the_oldest_up(ray_cluster):
    """A worker that evaluates is handed the oldest version due first; beyond
    ``MAX_HELD_EVAL_VERSIONS`` held, the oldest is given up and named."""
    controller = ControllerClient(ControllerActor.remote(target_prompts=8, prompts_per_step=2,
                                                         evals=EvalSchedule(every=1)))

    async def scenario() -> tuple[list[int], dict, dict]:
        for version in range(1, MAX_HELD_EVAL_VERSIONS + 3):  # 1..6: 6 due, 4 held
            await controller.publish(*update(version))
        handed = [(await controller.wait_for_update(0, 5.0, None, True))[0].version,
                  (await controller.wait_for_update(0, 5.0))[0].version]  # one that does not evaluate: the newest
        await controller.report_eval(EvalResult(version=4, kind="periodic", worker="rollout:0", metrics={},
                                                time=0.0, wall_s=0.0))
        handed.append((await controller.wait_for_update(4, 5.0, None, True))[0].version)
        # At the end, the same without waiting: the oldest held first, else the newest.
        handed += [(await controller.latest_update(0, True))[0].version, (await controller.latest_update())[0].version,
                   (await controller.latest_update(6, True))[0].version]
        return handed, (await controller.summary())["evals"], await controller.drain()

    handed, evals, drained = asyncio.run(scenario())
    assert handed == [3, 6, 5, 5, 6, 6]
    assert evals == {"reported": 1, "skipped": [1, 2], "held": [5, 6]}
    assert [r.version for r in drained["eval_results"]] == [4]
