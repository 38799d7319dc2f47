"""End to end on CPU: configs/ppo.yaml (tiny policy, tiny reward model fitted locally,
critic, GAE, KL in the reward) with real Ray, vLLM and DeepSpeed; the task's own
correctness, logged with weight 0 next to the reward model's score, rises."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.config import load_config
from pipeline.launch import launch_run
from pipeline.metrics import read_metrics

PPO = Path(__file__).parents[2] / "configs" / "ppo.yaml"
STEPS = 60


@pytest.mark.slow  # about 75 s of learning; the critic and PPO trainer e2e tests run in every run
def test_ppo_with_a_reward_model_and_a_critic_learns(ray_cluster, tmp_path):
    cfg = load_config(PPO, [f"run.dir={tmp_path}", f"run.steps={STEPS}", "run.progress=false",
                            "run.tensorboard=false"])
    summary = launch_run(cfg)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["samples"]["reconciles"] and len(rows) == STEPS
    # What PPO maximises, the reward model's score, rises clearly (two runs: -2.3 -> -0.3,
    # -3.1 -> -0.9 from first to last step); the task's own correctness, which the reward
    # model only approximates, rises with it (0.02 -> 0.22 and 0.02 -> 0.10 in those runs,
    # 0.05 -> 0.10 in a later one). Ten steps are 640 samples: at a correctness of ~0.05 the
    # difference of two such means has a standard error of ~0.012, so a rise of 0.03 is
    # 2.5 of them (about 1 in 160 runs of a policy that does not improve would pass).
    score = np.array([r["reward/mean"] for r in rows])
    correct = np.array([r["reward/rule"] for r in rows])
    first, last = correct[:10].mean(), correct[-10:].mean()
    print(f"reward model score first 10 steps {score[:10].mean():.3f}, last 10 steps {score[-10:].mean():.3f}; "
          f"task correctness {first:.3f} -> {last:.3f}")
    assert score[-10:].mean() > score[:10].mean() + 0.5
    assert last > first + 0.03, (first, last)
    # The critic ran on every step (its learning on a fixed batch: tests/e2e/test_critic.py;
    # here the returns move with the policy, so its error need not fall within 60 steps).
    errors = np.array([r["critic/value_error"] for r in rows])
    assert np.isfinite(errors).all()
    assert (tmp_path / "critic" / "state").is_dir()
