"""``placement: colocate`` on the real controller and rollout stage, with a backend that
sleeps like vLLM's sleep mode (``FakeSleepingBackend``): the rollout frees the GPU only
once nothing generates, the trainer's handoff returns only after that, and the next
version wakes it (weights, the update, then the KV cache) before any generation."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.config import decode_config
from pipeline.controller import ControllerActor, ControllerClient, resolve_payload
from pipeline.types import Prompt, PromptBatch, WeightUpdate
from pipeline.weights import WeightSyncError, compute_sha256
from stages.rollout.stage import RolloutStage
from tests.ray_local.fakes import FakeSleepingBackend, FakeStageContext

CONFIG = {
    "placement": "colocate",
    "dataflow": {"async_execution": False, "max_staleness": 0, "prompts_per_micro_batch": 1},
    "rollout": {"backend": "tests.ray_local.fakes:FakeSleepingBackend", "n": 2, "max_tokens": 2},
    "train": {"prompts_per_step": 2, "weight_sync_timeout_s": 30},
}


def batch(batch_id: int, step: int) -> PromptBatch:
    return PromptBatch(batch_id=batch_id, step=step, prompts=[Prompt(prompt_id=f"p{batch_id}", text="12")])


@pytest.mark.parametrize("by_reference", [False, True])
def test_the_rollout_sleeps_when_idle_and_wakes_with_the_next_version(ray_cluster, by_reference):
    """The next version wakes it whether its payload came inline (as a CUDA IPC
    descriptor does) or as a reference."""
    cfg = decode_config(CONFIG)
    controller = ControllerClient(ControllerActor.remote(target_prompts=8, prompts_per_step=2, barrier=True))

    async def scenario() -> tuple[list[tuple], list[str], dict]:
        stage = RolloutStage()
        ctx = FakeStageContext("rollout", cfg)
        ctx.controller = controller
        await stage.setup(ctx)
        backend = stage.backend
        # Step 0: two micro-batches generating when the trainer asks for the GPU.
        gens = [asyncio.create_task(stage.process(batch(i, 0))) for i in range(2)]
        await asyncio.sleep(0.05)
        asleep = await controller.hand_gpus_to_trainer(0, 1, 30.0)
        assert all(g.done() for g in gens), "the handoff returned while the rollout still generated"
        assert stage.asleep and backend.events[-1] == ("sleep",)
        # Step 1's micro-batch arrives before the trainer publishes: it waits for the wake.
        early = asyncio.create_task(stage.process(batch(2, 1)))
        await asyncio.sleep(0.2)
        assert not early.done() and backend.events[-1] == ("sleep",)
        data = b"weights-v1"
        await controller.publish(WeightUpdate(version=1, sha256=compute_sha256(data), fingerprint=(1.0, 1.0),
                                              num_bytes=len(data)), ray_cluster.put(data) if by_reference else data)
        out = await early
        assert set(out.token_versions.ravel()) == {1}
        status = stage.status()
        await stage.shutdown()
        return backend.events, asleep, status

    events, asleep, status = asyncio.run(scenario())
    assert asleep == ["rollout:0"]
    after_warmup = events[events.index(("generate", 0)) + 1:]
    assert after_warmup == [("generate", 0), ("generate", 0), ("sleep",), ("wake", "weights"), ("update", 1),
                            ("wake", "kv_cache"), ("generate", 1), ("shutdown",)]
    assert status["sleeps"] == 1 and not status["asleep"] and status["state"] == "generating"


@pytest.mark.parametrize("waiting", [True, False])
def test_an_update_that_fails_verification_fails_the_waiting_generation_and_the_stage_at_once(
        ray_cluster, monkeypatch, waiting):
    """Colocated, the woken engine refuses version 1 (its read-back differs). A micro-batch
    waiting for that version fails with the refusal, not after train.weight_sync_timeout_s;
    and whether one waits or not (step 1's prompts may not have reached the rollout), the
    stage reports the refusal through ``ctx.fail`` at once, so its shell ends the run
    rather than waiting for the next ``process`` call."""
    monkeypatch.setattr(FakeSleepingBackend, "REFUSE", frozenset({1}))
    cfg = decode_config(CONFIG)
    controller = ControllerClient(ControllerActor.remote(target_prompts=8, prompts_per_step=2, barrier=True))

    async def scenario() -> tuple[BaseException | None, BaseException]:
        stage = RolloutStage()
        ctx = FakeStageContext("rollout", cfg)
        ctx.controller = controller
        await stage.setup(ctx)
        await stage.process(batch(0, 0))
        await controller.hand_gpus_to_trainer(0, 1, 30.0)
        early = asyncio.create_task(stage.process(batch(1, 1))) if waiting else None
        assert ctx.failure is None
        data = b"weights-v1"
        await controller.publish(WeightUpdate(version=1, sha256=compute_sha256(data), fingerprint=(1.0, 1.0),
                                              num_bytes=len(data)), data)
        try:
            reported = await asyncio.wait_for(ctx.wait_failed(), 10.0)
            if early is None:
                return None, reported
            try:
                await asyncio.wait_for(early, 10.0)
            except WeightSyncError as err:
                return err, reported
            return None, reported
        finally:
            await stage.shutdown()

    raised, reported = asyncio.run(scenario())
    assert isinstance(reported, WeightSyncError) and "did not arrive intact" in str(reported), reported
    if waiting:
        assert raised is reported


def test_a_payload_travels_by_value_or_by_reference(ray_cluster):
    """The trainer publishes a payload that fits inline (a CUDA IPC descriptor) as bytes,
    a larger one as a reference; a worker reads either with ``resolve_payload``."""
    controller = ControllerClient(ControllerActor.remote(target_prompts=8, prompts_per_step=2, barrier=False))
    small, large = b"descriptor", bytes(range(256)) * 4096

    def update(version: int, data: bytes) -> WeightUpdate:
        return WeightUpdate(version=version, sha256=compute_sha256(data), fingerprint=(1.0, 1.0), num_bytes=len(data))

    async def scenario() -> tuple[object, bytes, object, bytes]:
        await controller.publish(update(1, small), small)
        _, first, _ = await controller.wait_for_update(0, 10.0)
        await controller.publish(update(2, large), ray_cluster.put(large))
        _, second, _ = await controller.wait_for_update(1, 10.0)
        return first, await resolve_payload(first), second, await resolve_payload(second)

    first, first_data, second, second_data = asyncio.run(scenario())
    assert isinstance(first, bytes) and first_data == small
    assert not isinstance(second, bytes) and second_data == large


def test_a_handoff_that_no_worker_confirms_times_out_with_those_asleep(ray_cluster):
    controller = ControllerClient(ControllerActor.remote(target_prompts=8, prompts_per_step=2, barrier=True))

    async def scenario() -> tuple[list[str], list[str]]:
        alone = await controller.hand_gpus_to_trainer(0, 1, 0.3)
        waiter = asyncio.create_task(controller.wait_for_sleep_request(0))
        handoff = asyncio.create_task(controller.hand_gpus_to_trainer(1, 2, 30.0))
        assert await waiter == 1
        await controller.confirm_asleep("rollout:0", 0)  # a stale confirmation counts for nothing
        await controller.confirm_asleep("rollout:0", 1)
        await asyncio.sleep(0.2)
        assert not handoff.done()
        await controller.confirm_asleep("rollout:1", 1)
        return alone, await handoff

    alone, both = asyncio.run(scenario())
    assert alone == [] and both == ["rollout:0", "rollout:1"]


def test_a_backend_that_cannot_sleep_is_refused_under_colocate(ray_cluster):
    cfg = decode_config({**CONFIG, "rollout": {**CONFIG["rollout"], "backend": "stages.rollout.hf_backend:HFBackend"}})
    stage = RolloutStage()
    ctx = FakeStageContext("rollout", cfg)
    with pytest.raises(ValueError, match="placement: colocate needs a rollout backend that can sleep"):
        asyncio.run(stage.setup(ctx))
