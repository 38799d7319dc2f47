"""The tiny reward model (stages/rewards/tiny_reward_model.py): built locally with no download,
it learns the quickstart task's correctness from generated examples, and the scorer
stage's model ranks right completions above wrong ones. Every run builds it from a short
recipe (the same fit, cache, path and scoring); the default recipe's fit and what it
learned (about 45 s on 2 cores) are ``slow``."""

from __future__ import annotations

import functools
import json

import msgspec
import numpy as np
import pytest
import torch

from pipeline.config import load_config
from pipeline.types import Prompt
from stages.data.tasks import load_task
from stages.rewards import tiny_reward_model
from stages.rewards.reward_model import RewardModel, resolve_reward_model_path
from stages.rewards.tiny_reward_model import (
    TinyRewardRecipe,
    build_reward_examples,
    compute_recipe_hash,
    ensure_tiny_reward_model,
)
from tests.unit.test_admission import make_batch

SHORT = TinyRewardRecipe(examples=500, steps=20)  # the code of a fit, not its accuracy


def test_examples_are_labelled_by_the_task():
    task = load_task("first_digit")
    examples = build_reward_examples(task, 4, seed=0)
    assert len(examples) == 20
    for prompt, completion, label in examples:
        assert label == (1.0 if completion[:1] == prompt[:1] else 0.0)
    assert {label for *_, label in examples} == {0.0, 1.0}


def right_and_wrong_rollouts():
    """New prompts, each with two completions: the right first digit, then a wrong one."""
    rows = load_task("first_digit").generate_rows(123, 40)
    batch = make_batch(num_groups=40, group_size=2)
    prompts = [Prompt(prompt_id=f"g{i}", text=r["prompt"]) for i, r in enumerate(rows)]
    wrong = {d: str((int(d) + 5) % 10) for d in "0123456789"}
    completions = [c for r in rows for c in (r["ground_truth"], wrong[r["ground_truth"]])]
    return msgspec.structs.replace(batch, prompts=prompts, completions=completions)


def test_a_short_recipe_is_built_once_found_by_its_name_and_scores_rollouts(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    path = ensure_tiny_reward_model("first_digit", tmp_path, SHORT)
    assert path == tmp_path / f"tiny-rm-{compute_recipe_hash('first_digit', SHORT)}"
    assert ensure_tiny_reward_model("first_digit", tmp_path, SHORT) == path  # built once
    assert path.name != f"tiny-rm-{compute_recipe_hash('first_digit', tiny_reward_model.DEFAULT_RECIPE)}"
    fit = json.loads((path / "fit.json").read_text())
    assert set(fit) == {"train_loss", "held_out_accuracy"} and np.isfinite(fit["train_loss"])
    assert 0.0 <= fit["held_out_accuracy"] <= 1.0
    # reward.sources.<name>.path: tiny builds the task's model under model.cache_dir (here: this recipe's).
    monkeypatch.setattr(tiny_reward_model, "ensure_tiny_reward_model",
                        functools.partial(ensure_tiny_reward_model, recipe=SHORT))
    cfg = load_config("configs/quickstart.yaml", [f"model.cache_dir={tmp_path}"])
    assert resolve_reward_model_path("tiny", cfg) == path
    scores = RewardModel(path).score(right_and_wrong_rollouts())
    assert scores.shape == (80,) and np.all(np.isfinite(scores))


@pytest.mark.slow  # about 45 s of fitting; the same code runs a short recipe in every run (above)
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
    scores = RewardModel(path).score(right_and_wrong_rollouts()).reshape(40, 2)
    assert np.mean(scores[:, 0] > scores[:, 1]) > 0.75
