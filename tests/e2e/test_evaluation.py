"""End to end on CPU: ``configs/quickstart_eval.yaml`` (the quickstart with a held-out
evaluation) with real Ray and DeepSpeed, seeded, generating with the HF backend (the
evaluation is the rollout stage's, whatever its engine). One run is shared: its eval rows
come at the versions due, ``summary.json`` and ``eval.png`` hold them, the training
accounting is untouched, and (``slow``: a 120-step run; the quickstart learns in every
run, test_pipeline) the greedy held-out reward rises. Assertions on learning read the
greedy completions only (sampling need not repeat across runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.launch import launch_run
from pipeline.metrics import is_eval_row, read_metrics
from stages.evaluation.metrics import eval_metric_names

QUICKSTART_EVAL = Path(__file__).parents[2] / "configs" / "quickstart_eval.yaml"
LEARNING = (120, 40)  # steps, eval.every: where the (slow) learning test is selected
SHORT = (12, 4)  # else: the same four evaluations, no learning curve


@pytest.fixture(scope="module")
def eval_run(ray_cluster, tmp_path_factory, request):
    learning = any(item.name == "test_the_greedy_held_out_reward_rises" for item in request.session.items)
    steps, every = LEARNING if learning else SHORT
    run_dir = tmp_path_factory.mktemp("eval")
    cfg = load_config(QUICKSTART_EVAL, [f"run.dir={run_dir}", "run.progress=false", "run.tensorboard=false",
                                        f"run.steps={steps}", f"eval.every={every}", "rollout.backend=hf"])
    summary = launch_run(cfg)
    return run_dir, summary, read_metrics(run_dir), steps, every


def test_eval_rows_come_at_the_versions_due(eval_run):
    run_dir, summary, rows, steps, every = eval_run
    evals = [r for r in rows if is_eval_row(r)]
    # before training, every `every` steps; the final version was due already: evaluated once
    assert [r["step"] for r in evals] == [0, every, 2 * every, 3 * every] and 3 * every == steps
    assert all(set(r) == {"step", "time", *eval_metric_names(4)} for r in evals)
    assert all(r["eval/prompts"] == 64 and r["eval/reward_errors"] == 0 for r in evals)
    assert [r["step"] for r in rows if not is_eval_row(r)] == list(range(steps))
    ev = summary["eval"]
    assert ev["evals"] == 4 and ev["skipped"] == []
    assert [(ev[k]["version"], ev[k]["kind"]) for k in ("first", "last")] == [(0, "before_train"), (steps, "periodic")]
    assert ev["best"]["eval/reward_mean"] == max(r["eval/reward_mean"] for r in evals)
    assert (run_dir / "eval.png").is_file()


def test_evaluation_stays_out_of_the_training_accounting(eval_run):
    _, summary, _, steps, _ = eval_run
    s = summary["samples"]
    assert s["reconciles"] and summary["accounting"]["reconciles"]
    assert s["trained"] == steps * 8 * 8 and s["in_flight"] == 0
    assert s["produced"] == s["trained"] + sum(s["dropped"].values())
    # The rollout counts the samples it sent down the queues: the evaluations' are not among them.
    assert summary["rollout"][0]["samples"] == s["produced"]
    calls = summary["controller_calls"]
    assert calls["report_eval"] == 4 and calls["finish_step"] == steps


@pytest.mark.slow  # a 120-step run; the evaluation's rows and accounting run in every run (above)
def test_the_greedy_held_out_reward_rises(eval_run):
    _, summary, _, steps, _ = eval_run
    assert steps == LEARNING[0]
    first, last = summary["eval"]["first"], summary["eval"]["last"]
    print(f"held-out greedy reward {first['eval/greedy_reward']:.3f} -> {last['eval/greedy_reward']:.3f}, "
          f"pass@4 {first['eval/pass@4']:.3f} -> {last['eval/pass@4']:.3f}")
    assert last["eval/greedy_reward"] > first["eval/greedy_reward"] + 0.3
