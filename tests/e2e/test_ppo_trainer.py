"""PPO's mini-batches and epochs (stages/trainer/ppo.py) on the tiny checkpoint with real
DeepSpeed on CPU: one step makes ppo_epochs x ppo_mini_batches updates and moves the
policy version once, and learns more from the same data than one update does."""

from __future__ import annotations

import pytest

from pipeline.config import load_config
from pipeline.memory.splitting import split_rollout_batch_at
from stages.trainer.ppo import PPOTrainerStage
from stages.trainer.stage import TrainerStage, compute_micro_batch_scale, compute_step_grad_scale
from tests.e2e.test_trainer_engine import build_engine, make_batch, on_policy, rewarded_gap
from tests.unit.test_admission import make_batch as make_small_batch


def test_update_grad_scale_hand_derived():
    # make_small_batch(1 group) has 3 loss tokens (lens 1, 2); (3 groups) 13 tokens, 6 samples.
    a, b = make_small_batch(num_groups=1, batch_id=1), make_small_batch(num_groups=3, batch_id=2)
    # token-mean, step of 8 samples: mini-batch [a] -> 8 / 3; [b] -> 8 / 13; both = the step's 8 / 16
    assert compute_step_grad_scale([a], 8, "token-mean") == 8 / 3
    assert compute_step_grad_scale([b], 8, "token-mean") == 8 / 13
    assert compute_step_grad_scale([a, b], 8, "token-mean") == 8 / 16
    # seq modes: step samples / the mini-batch's non-empty rows: [a] 8 / 2 = 4; whole step 1
    assert compute_step_grad_scale([a], 8, "seq-mean-token-mean") == 4.0
    assert compute_step_grad_scale([a, b], 8, "seq-mean-token-mean") == 1.0


def _stage(engine, epochs: int, minis: int) -> PPOTrainerStage:
    """The stage's update logic around an engine (no Ray actor, no controller)."""
    stage = PPOTrainerStage.__new__(PPOTrainerStage)
    TrainerStage.__init__(stage)
    stage.engine = engine
    stage.cfg = load_config("configs/quickstart.yaml", [f"train.ppo_epochs={epochs}",
                                                        f"train.ppo_mini_batches={minis}"])
    stage.step_samples, stage.epochs, stage.mini_samples = 64, epochs, 64 // minis
    stage._applied, stage._groups, stage.updates = 0, [], 0
    return stage


def _ppo_step(stage: PPOTrainerStage, halves) -> dict[str, float]:
    # What process() does around the engine: train the first half, apply it as a
    # first-epoch mini-batch, train the second, then the step's update.
    agg = stage.cfg.algorithm.loss_agg
    stage.engine.train_micro_batch(halves[0], compute_micro_batch_scale(halves[0], 64, agg))
    if stage.mini_samples < 64:
        stage._update([halves[0]], False)
        stage._groups, stage._applied = [(0, 1)], 1
    stage.engine.train_micro_batch(halves[1], compute_micro_batch_scale(halves[1], 64, agg))
    return stage._apply_step_update(list(halves))


def test_epochs_and_mini_batches_make_several_updates_and_one_version(tmp_path):
    engine = build_engine(_checkpoint(tmp_path))
    batch = on_policy(engine, make_batch(seed=3))
    halves = split_rollout_batch_at(batch, [4, 4])
    start, gap0 = engine.version, rewarded_gap(engine, batch)
    engine.save_state(tmp_path / "start")

    ppo = _stage(engine, epochs=2, minis=2)
    out = _ppo_step(ppo, halves)
    assert engine.version == start + 1  # one policy version per step
    assert ppo.updates == 4 and out["updates"] == 4.0
    gap_ppo = rewarded_gap(engine, batch)

    engine.load_state(tmp_path / "start")
    plain = _stage(engine, epochs=1, minis=1)
    out = _ppo_step(plain, halves)
    assert engine.version == start + 1 and plain.updates == 1
    gap_plain = rewarded_gap(engine, batch)
    # Four updates on the same data separate rewarded from unrewarded completions
    # further than one (a trend, not a number).
    assert gap_ppo - gap0 > 1.5 * (gap_plain - gap0) > 0, (gap0, gap_plain, gap_ppo)


def _checkpoint(tmp_path):
    import torch

    from pipeline.config import TinyModelConfig
    from stages.models.tiny import ensure_tiny_checkpoint

    torch.set_num_threads(1)
    return ensure_tiny_checkpoint(TinyModelConfig(), tmp_path / "models")


def test_mini_batches_must_split_a_step_into_whole_micro_batches():
    from pipeline.config import ConfigError

    # 8 prompts per step, 4 per micro-batch: 2 mini-batches fit, 4 do not.
    load_config("configs/quickstart.yaml", ["train.ppo_mini_batches=2"])
    with pytest.raises(ConfigError, match=r"train.ppo_mini_batches: expected train.prompts_per_step \(8\)"):
        load_config("configs/quickstart.yaml", ["train.ppo_mini_batches=4"])
    with pytest.raises(ConfigError, match=r"record.edges: a recorded trainer input replays one optimizer update"):
        load_config("configs/quickstart.yaml", ["train.ppo_epochs=2", "record.edges=[reference->trainer]"])


def test_decoupled_objective_keeps_the_first_pass_anchor_across_epochs(tmp_path):
    """algorithm.off_policy truncate with train.ppo_epochs 2: the second pass over a batch
    measures its ratio against the first pass's log-probs (held by sample id), so after
    an update it is no longer 1 and the clip binds (a trust region, as verl, TRL and AReaL
    keep); the step's last update (the version bump) drops them: the next step's first
    pass is anchored on its own weights again (ratio exactly 1)."""
    from pipeline.config import TrainConfig
    from stages.algorithms.grpo import GrpoConfig
    from stages.trainer.engine import TrainerEngine
    from tests.e2e.test_trainer_engine import make_batch, on_policy

    train = TrainConfig(lr=1e-2, grad_clip=1.0, threads=1, ppo_epochs=2)
    engine = TrainerEngine(_checkpoint(tmp_path), train, GrpoConfig(kl_coef=0.0, off_policy="truncate"),
                           temperature=1.0, dtype="float32", seed=0, chunk_size=24)
    batch = on_policy(engine, make_batch(seed=3))
    first = engine.train_micro_batch(batch, 1.0)
    engine.optimizer_step(bump_version=False)  # an update inside the step
    second = engine.train_micro_batch(batch, 1.0)
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-12) and first["clip_frac"] == 0.0
    assert abs(second["ratio_mean"] - 1.0) > 1e-3 and second["clip_frac"] > 0.0, second
    engine.optimizer_step()  # the step's last update
    third = engine.train_micro_batch(batch, 1.0)
    assert third["ratio_mean"] == pytest.approx(1.0, abs=1e-12) and third["clip_frac"] == 0.0
