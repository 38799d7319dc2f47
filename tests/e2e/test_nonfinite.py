"""The trainer stage (real DeepSpeed engine on the tiny model, no Ray) meets steps whose
loss is NaN: each is not applied, not published, its samples dropped as ``nonfinite``,
counted and logged with its step; ``train.max_bad_steps`` of them in a row stop the run,
naming the last good checkpoint. The NaN comes in with the data (a reward that slipped
through as NaN), so the real advantages, loss and engine carry it."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
from structlog.testing import capture_logs

from pipeline.config import load_config
from stages.trainer.engine import find_free_port
from stages.trainer.stage import NONFINITE, NonFiniteSteps, TrainerStage
from tests.ray_local.fakes import FakeStageContext, make_fake_rollout_batch
from tests.toy import TOY


def _step(trainer: TrainerStage, first_id: int, poisoned: bool) -> None:
    """One step: 2 micro-batches of 4 groups x 8 (the step's 8 prompts); poisoned: one
    sample's reward is NaN, so its group's advantages and the step's loss are NaN."""
    for b in (first_id, first_id + 1):
        batch = make_fake_rollout_batch(b, num_groups=4, group_size=8)
        rewards = np.array(batch.rewards)
        rewards[0] = np.nan if poisoned else rewards[0]
        asyncio.run(trainer.process(msgspec.structs.replace(batch, rewards=rewards,
                                                            policy_version=trainer.engine.version)))


def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path, monkeypatch):
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(find_free_port())}.items():
        monkeypatch.setenv(key, value)
    cfg = load_config(None, [
        *TOY,
        f"run.dir={tmp_path / 'run'}", "train.threads=1", "train.save_checkpoint=false", "train.sync_interval=1",
        "rollout.n=8", "train.prompts_per_step=8", "dataflow.prompts_per_micro_batch=4", "algorithm.kl_coef=0",
        "train.checkpoint_every=1", "train.max_bad_steps=2",
    ])
    trainer = TrainerStage()
    ctx = FakeStageContext("trainer", cfg)
    asyncio.run(trainer.setup(ctx))
    engine = trainer.engine

    _step(trainer, 0, poisoned=False)  # version 1, published, checkpoint step-00000001
    sha = engine.weights_sha256()
    with capture_logs() as logs:
        _step(trainer, 2, poisoned=True)
    # Not applied: same version, same weights; not published (one finish_step so far).
    assert engine.version == 1 and engine.weights_sha256() == sha
    assert [name for name, _ in ctx.controller.calls].count("finish_step") == 1
    # Its 2 micro-batches of 4 prompts dropped as nonfinite: 64 samples, 8 prompts told to the ledger.
    assert trainer.dropped == {NONFINITE: 64} and trainer.skipped_nonfinite == 1
    assert [args for name, args in ctx.controller.calls if name == "record_dropped"] == [(4, NONFINITE)] * 2
    (warning,) = [e for e in logs if e["event"] == "nonfinite_step"]
    assert warning["step"] == 1 and warning["in_a_row"] == 1 and np.isnan(warning["loss"])

    _step(trainer, 4, poisoned=False)  # a good step in between: the count in a row starts again
    assert engine.version == 2
    metrics = [args[2] for name, args in ctx.controller.calls if name == "finish_step"][-1]
    assert metrics["actor/skipped_nonfinite"] == 1 and metrics["step"] == 1

    _step(trainer, 6, poisoned=True)  # 1 in a row: skipped
    with pytest.raises(NonFiniteSteps) as info:
        _step(trainer, 8, poisoned=True)  # 2 in a row = train.max_bad_steps
    assert engine.version == 2 and trainer.skipped_nonfinite == 3
    assert "train.max_bad_steps: 2 steps in a row at step 2" in str(info.value)
    assert f"the last good checkpoint is {tmp_path / 'run' / 'checkpoints' / 'step-00000002'}" in str(info.value)
