"""conveyor init + a short launch of a template, as a user runs it (from the directory it
wrote, through the command line): the curriculum template promotes, reports its level in
the step metrics and resumes at the level it checkpointed. Real Ray and DeepSpeed; the
rollout is the HF backend (each template's alternative to vLLM), about 10 s less a launch."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from pipeline.checkpoint import STATE_FILE, ResumeState, find_latest_checkpoint
from pipeline.cli import main
from pipeline.metrics import read_metrics

# rollout.n 4 x prompts_per_step 4 = 16 samples a step = one window: a decision per step;
# promote_at 0 promotes on every full window, so the rules run in a few steps. Queues of
# one micro-batch keep the prompts admitted before a move (at the old level) few.
SHORT = ["run.progress=false", "run.tensorboard=false", "rollout.n=4", "train.prompts_per_step=4",
         "dataflow.queue_size=1", "data.curriculum.window=16", "data.curriculum.promote_at=0.0",
         "train.checkpoint_every=2", "rollout.backend=hf"]
FIRST, TOTAL = 8, 12


def _in(directory: Path, argv: list[str]) -> int:
    cwd = os.getcwd()
    os.chdir(directory)  # the config's relative data, reward and run paths, as its header says
    try:
        return main(argv)
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def curriculum_run(ray_cluster, tmp_path_factory):
    job = tmp_path_factory.mktemp("templates") / "curriculum"
    assert main(["init", "--template", "curriculum", str(job)]) == 0
    # Ray started here (the session's cluster) runs the stages in this directory: an
    # absolute run directory keeps the driver's and the stages' files in one place.
    run_dir = job / "runs" / "curriculum"
    assert _in(job, ["launch", "--config", "config.yaml", f"run.steps={FIRST}", f"run.dir={run_dir}", *SHORT]) == 0
    return job, run_dir


@pytest.mark.slow  # a curriculum run of its own; the templates' representative is the tool-RL one
def test_curriculum_template_promotes_and_reports_its_level(curriculum_run):
    _, run_dir = curriculum_run
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == FIRST
    levels = [r["curriculum/level"] for r in rows]
    # Step 0 trains only level-1 prompts: 16 rewards fill the window, promote_at 0 -> level 2.
    # (The prompts admitted before that, which fill the stages' queues, finish at level 1.)
    assert levels[0] == 2 and rows[0]["curriculum/promotions"] == 1
    assert levels == sorted(levels) and set(levels) <= {2, 3}
    assert all("curriculum/window_reward_mean" in r and "reward/mean" in r for r in rows)


@pytest.mark.slow  # a second curriculum run; its promotion test runs in every run
def test_curriculum_resumes_at_its_checkpointed_level(curriculum_run):
    job, run_dir = curriculum_run
    found = find_latest_checkpoint(run_dir)
    assert found is not None
    checkpoint, _, _ = found
    state = msgspec.msgpack.decode((checkpoint / STATE_FILE).read_bytes(), type=ResumeState)
    before = read_metrics(run_dir / "metrics.jsonl")
    assert state.curriculum is not None and state.curriculum["level"] == before[-1]["curriculum/level"]
    assert _in(job, ["launch", "--resume", str(run_dir), f"run.steps={TOTAL}", *SHORT]) == 0
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == TOTAL
    # The level continues: no step after the resume is below the saved level, the
    # promotions count on from the first part's, and by the end the source has drawn
    # level-2 prompts whose rewards moved the run to level 3.
    assert all(r["curriculum/level"] >= state.curriculum["level"] for r in rows[FIRST:])
    assert rows[-1]["curriculum/promotions"] >= state.curriculum["promotions"]
    assert rows[-1]["curriculum/level"] == 3 and rows[-1]["curriculum/promotions"] == 2


def _init_and_launch(name: str, tmp_path: Path, steps: int, extra: tuple[str, ...] = ()) -> list[dict]:
    """``conveyor init`` template ``name``, launch it for ``steps`` from its directory; its
    step metrics, after checking it completed them all."""
    job = tmp_path / name
    assert main(["init", "--template", name, str(job)]) == 0
    run_dir = job / "runs" / name
    assert _in(job, ["launch", "--config", "config.yaml", f"run.steps={steps}", f"run.dir={run_dir}",
                     "run.progress=false", "run.tensorboard=false", *extra]) == 0
    assert msgspec.json.decode((run_dir / "summary.json").read_bytes())["status"] == "completed"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert len(rows) == steps
    return rows


@pytest.mark.slow  # the templates' representative is the tool-RL one; DPO's loss is unit-tested
def test_dpo_template_trains_offline_pairs_and_reports_preferences(ray_cluster, tmp_path):
    rows = _init_and_launch("dpo", tmp_path, steps=12)
    keys = ("actor/preference_accuracy", "actor/reward_margin", "actor/chosen_reward", "actor/rejected_reward")
    assert all(k in r for r in rows for k in keys)
    # Step 0 trains the reference's own weights: every implicit reward is 0, no pair is
    # preferred. A few updates later the chosen answers are ahead on pairs not seen yet.
    assert rows[0]["actor/preference_accuracy"] == 0.0 and rows[0]["actor/reward_margin"] == 0.0
    last = rows[-4:]
    assert sum(r["actor/reward_margin"] for r in last) / 4 > 0
    assert sum(r["actor/preference_accuracy"] for r in last) / 4 > 0.5


def test_tool_rl_template_calls_tools_and_reports_them(ray_cluster, tmp_path):
    rows = _init_and_launch("tool_rl", tmp_path, steps=6, extra=("rollout.backend=hf",))
    keys = ("tool/used", "tool/calls", "tool/errors", "tool/turns", "tool/calc/calls", "tool/python/calls",
            "turn/1/tokens", "reward/answer_correct", "reward/mean")
    assert all(k in r for r in rows for k in keys)
    # The prompts open a call: some samples close it (the random model writes "]" now and
    # then), so tools ran and a second turn followed.
    assert sum(r["tool/calls"] for r in rows) > 0 and any("turn/2/tokens" in r for r in rows)
    assert all(1.0 <= r["tool/turns"] <= 2.0 for r in rows)
