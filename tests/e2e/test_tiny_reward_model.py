"""The tiny reward model (stages/rewards/tiny_reward_model.py): built locally with no download,
it learns the quickstart task's correctness from generated examples, and the scorer
stage's model ranks right completions above wrong ones."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import torch

from pipeline.config import load_config
from pipeline.types import Prompt
from stages.data.tasks import load_task
from stages.rewards.reward_model import RewardModel, resolve_reward_model_path
from stages.rewards.tiny_reward_model import build_reward_examples, ensure_tiny_reward_model
from tests.unit.test_admission import make_batch


def test_examples_are_labelled_by_the_task():
    task = load_task("first_digit")
    examples = build_reward_examples(task, 4, seed=0)
    assert len(examples) == 20
    for prompt, completion, label in examples:
        assert label == (1.0 if completion[:1] == prompt[:1] else 0.0)
    assert {label for *_, label in examples} == {0.0, 1.0}


def test_tiny_reward_model_learns_the_task_and_scores_rollouts(tmp_path):
    torch.set_num_threads(1)
    path = ensure_tiny_reward_model("first_digit", tmp_path)
    assert ensure_tiny_reward_model("first_digit", tmp_path) == path  # built once
    fit = json.loads((path / "fit.json").read_text())
    # Held-out prompts: clearly above the 60% of always answering "wrong" (a trend, not a number).
    assert fit["held_out_accuracy"] > 0.75, fit
    cfg = load_config("configs/quickstart.yaml", [f"model.cache_dir={tmp_path}"])
    assert resolve_reward_model_path("tiny", cfg) == path
    # Rollouts of new prompts: the right first digit scores above a wrong one on most prompts.
    rows = load_task("first_digit").generate_rows(123, 40)
    batch = make_batch(num_groups=40, group_size=2)
    prompts = [Prompt(prompt_id=f"g{i}", text=r["prompt"]) for i, r in enumerate(rows)]
    wrong = {d: str((int(d) + 5) % 10) for d in "0123456789"}
    completions = [c for r in rows for c in (r["ground_truth"], wrong[r["ground_truth"]])]
    batch = msgspec.structs.replace(batch, prompts=prompts, completions=completions)
    scores = RewardModel(path).score(batch).reshape(40, 2)
    assert np.mean(scores[:, 0] > scores[:, 1]) > 0.75
