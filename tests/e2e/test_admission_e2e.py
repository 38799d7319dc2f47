"""Admission and OOM recovery on the real stages (tiny model, DeepSpeed on CPU).

1. The quickstart under work budgets far below one micro-batch's estimate: every stage
   splits, the run completes and the accounting reconciles; the metrics show it. It
   generates with the HF backend: the rollout's admission is the stage's, whatever its
   engine (vLLM's KV cache sizes its pool in the quickstart's runs, test_pipeline).
2. The trainer core (no Ray) hit by an out-of-memory error in the middle of a step,
   once after a backward had already accumulated part of a micro-batch and once in a
   forward before any backward: the step's update is bitwise the one of a clean run
   that trains the pieces its step record names (as ``conveyor replay`` does), i.e. no
   sample was lost or trained twice.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import load_config, to_dict
from pipeline.launch import launch_run
from pipeline.metrics import read_metrics
from pipeline.recorder import RecordingReader, RecordingWriter
from tests.ray_local.fakes import FakeOomAfterCall, FakeStageContext, make_fake_rollout_batch
from tests.toy import TOY

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
STEPS = 4
STAGES = ("rollout", "reference", "trainer")


@pytest.mark.slow  # about 30 s; admission's splits with fakes run in every run (tests/ray_local/test_oom_recovery.py)
def test_tight_budgets_split_every_stage_and_the_run_reconciles(ray_cluster, tmp_path):
    # One 4-prompt micro-batch of the quickstart needs about 650 KB of KV cache, 2.9 MB
    # for the reference forward and 5.6 MB for the trainer's (estimates, before the
    # calibration, which on CPU can shrink them to a quarter). Work budgets of 400 KB,
    # 256 KiB and 512 KiB are below that quarter: every micro-batch must split.
    cfg = load_config(QUICKSTART, [
        f"run.dir={tmp_path / 'run'}", f"run.steps={STEPS}", "run.progress=false", "run.tensorboard=false",
        "train.save_checkpoint=false", "rollout.memory.budget_bytes=400000",
        "reference.memory.budget_bytes=262144", "train.memory.budget_bytes=524288", "rollout.backend=hf",
    ])
    summary = launch_run(cfg)

    assert summary["steps"] == STEPS
    samples = summary["samples"]
    assert samples["reconciles"] and samples["in_flight"] == 0
    assert samples["trained"] == STEPS * cfg.train.prompts_per_step * cfg.rollout.n
    assert samples["produced"] == samples["trained"] + sum(samples["dropped"].values())
    for stage in STAGES:
        adm = summary["admission"][stage]
        assert adm["admission/splits"] > 0, (stage, adm)
        assert adm["oom/recovered"] == 0  # split in time: nothing ran out of memory
    # The work budget is counted above the process at rest: the absolute budget is the
    # resting process plus 512 KiB, and the process sits close to it, not far above.
    trainer = summary["admission"]["trainer"]
    assert trainer["memory/budget_bytes"] > 524288 and trainer["memory/used_bytes"] > 0

    rows = read_metrics(cfg.run_dir)
    assert len(rows) == STEPS
    for stage in STAGES:
        for name in ("memory/{}/used_bytes", "memory/{}/budget_bytes", "admission/{}/deferred",
                     "admission/{}/splits", "oom/{}/recovered"):
            assert all(name.format(stage) in row for row in rows), name.format(stage)
        splits = [row[f"admission/{stage}/splits"] for row in rows]
        assert splits == sorted(splits) and splits[-1] > 0  # counters since the start
    assert rows[-1]["admission/trainer/splits"] > 0


def train_one_step(trainer, batches) -> None:
    for batch in batches:
        asyncio.run(trainer.process(batch))


@pytest.mark.parametrize(("call", "fail_on", "expected_calls"), [
    # Backward call 4 is micro-batch 1's second chunk: its first chunk's gradients are in.
    # Recovery discards the step's gradients, re-trains micro-batch 0 (2 calls), then
    # micro-batch 1 as two halves of one chunk each: 4 + 2 + 2 = 8 backward calls.
    ("backward", 4, 8),
    # Forward call 3 is micro-batch 1's first chunk, before any of its backwards: the
    # gradients stay, micro-batch 1 runs as two halves: 3 + 2 = 5 forward calls.
    ("forward", 3, 5),
])
def test_trainer_oom_mid_step_trains_every_sample_once(tmp_path, monkeypatch, call, fail_on, expected_calls):
    from stages.trainer.engine import find_free_port
    from stages.trainer.stage import (
        TrainerStage,
        compute_step_grad_scale,
        compute_step_loss,
        read_piece_layout,
        train_as_recorded,
    )

    # The engine's rendezvous variables, scoped to this test: a Ray cluster started later
    # in this process must not inherit a MASTER_PORT this process is listening on.
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(find_free_port())}.items():
        monkeypatch.setenv(key, value)
    cfg = load_config(None, [
        *TOY,
        # The tiny model's rate (the default suits a pretrained checkpoint): updates large
        # enough that a wrong recovery shows in the weights.
        f"run.dir={tmp_path / 'run'}", "train.lr=3e-4", "train.threads=1", "train.save_checkpoint=false",
        "train.sync_interval=100",
        "rollout.n=8", "train.prompts_per_step=8", "dataflow.prompts_per_micro_batch=4", "algorithm.kl_coef=0",
        "dataflow.async_execution=false", "dataflow.max_staleness=99",
        "train.pass_tokens=0",  # fixed chunks of 16 samples: the call counts below are theirs
    ])
    trainer = TrainerStage()
    ctx = FakeStageContext("trainer", cfg)
    asyncio.run(trainer.setup(ctx))
    ctx.recorder = RecordingWriter(tmp_path / "rec", to_dict(cfg), edges=["reference->trainer"])
    engine = trainer.engine
    # 2 micro-batches of 4 groups x 8 samples: 32 samples = 2 chunks of 16 each.
    batches = [make_fake_rollout_batch(b, num_groups=4, group_size=8) for b in range(2)]
    engine.save_state(tmp_path / "before")
    rng = engine.get_rng_state()

    ds = engine.engine
    fake = FakeOomAfterCall(getattr(ds, call), fail_on={fail_on})
    setattr(ds, call, fake)  # an instance attribute shadows the method
    train_one_step(trainer, batches)
    delattr(ds, call)
    assert fake.calls == expected_calls
    assert trainer.steps_done == 1 and trainer.trained_samples == 64 and not engine.gradients_tainted
    metrics = trainer.guard.metrics()
    assert (metrics["oom/trainer/events"], metrics["oom/trainer/recovered"]) == (1.0, 1.0)
    assert [s.kind for s in ctx.spans.drain()] == ["oom"]  # the time lost, on the timeline
    (step,) = [args[2] for name, args in ctx.controller.calls if name == "finish_step"]
    recovered_sha = engine.weights_sha256()
    ctx.recorder.close()
    (record,) = RecordingReader(tmp_path / "rec").steps()
    layouts = [read_piece_layout(record.metrics, b.batch_id) for b in batches]
    assert layouts == [None, [2, 2]]  # micro-batch 0 trained whole, 1 in halves
    assert record.weights_sha256 == recovered_sha

    # A clean run from the same state over the recorded pieces, as replay runs it.
    engine.load_state(tmp_path / "before")
    engine.set_rng_state(rng)
    losses = [train_as_recorded(engine, b, 64, layout)["loss"] for b, layout in zip(batches, layouts, strict=True)]
    grad_scale = compute_step_grad_scale(batches, 64, "token-mean")  # exact token-mean over the step
    clean = engine.optimizer_step(grad_scale)
    assert engine.weights_sha256() == recovered_sha  # bitwise: the failed attempt left no trace
    assert compute_step_loss(losses, batches, 64, "token-mean") == record.loss
    assert clean["grad_norm"] == step["actor/grad_norm"]
    # The step's loss as reported: micro-batch losses (pieces merged) weighted by tokens.
    assert np.average(losses, weights=[b.completion_tokens for b in batches]) == pytest.approx(
        step["actor/loss"], rel=1e-12)

    # And the split itself changes the update only by rounding: micro-batch 1 whole.
    engine.load_state(tmp_path / "before")
    engine.set_rng_state(rng)
    for b in batches:
        train_as_recorded(engine, b, 64, None)
    assert engine.optimizer_step(grad_scale)["grad_norm"] == pytest.approx(clean["grad_norm"], rel=1e-5)
