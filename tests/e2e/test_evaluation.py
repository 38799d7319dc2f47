"""End to end on CPU: ``configs/quickstart_eval.yaml`` (the quickstart with a held-out
evaluation) with real Ray and DeepSpeed, seeded, generating with the HF backend (the
evaluation is the rollout stage's, whatever its engine): over 120 steps the greedy
held-out reward rises (``slow``). Assertions on learning read the greedy completions only
(sampling need not repeat across runs). Its eval rows come at the versions due,
``summary.json`` and ``eval.png`` hold them and the training accounting is untouched
(``check_eval_rows``, ``check_eval_accounting``): in every run those checks read the same
four evaluations on the quickstart's six-step debug run (tests/e2e/test_pipeline.py),
where the quickstart also learns (``test_reward_rises``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.launch import launch_run
from pipeline.metrics import is_eval_row, read_metrics
from stages.evaluation.metrics import eval_metric_names

QUICKSTART_EVAL = Path(__file__).parents[2] / "configs" / "quickstart_eval.yaml"
STEPS, EVERY = 120, 40


@pytest.fixture(scope="module")
def eval_run(ray_cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("eval")
    cfg = load_config(QUICKSTART_EVAL, [f"run.dir={run_dir}", "run.progress=false", "run.tensorboard=false",
                                        f"run.steps={STEPS}", f"eval.every={EVERY}", "rollout.backend=hf"])
    return run_dir, launch_run(cfg)


def check_eval_rows(run_dir: Path, summary: dict, steps: int, every: int) -> None:
    """Eval rows at versions 0, ``every``, ``2 * every`` and ``3 * every == steps``,
    between the step rows; ``summary.json``'s ``eval`` and ``eval.png`` hold them."""
    rows = read_metrics(run_dir)
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


def check_eval_accounting(summary: dict, steps: int) -> None:
    """The evaluations stay out of the training accounting."""
    s = summary["samples"]
    assert s["reconciles"] and summary["accounting"]["reconciles"]
    assert s["trained"] == steps * 8 * 8 and s["in_flight"] == 0
    assert s["produced"] == s["trained"] + sum(s["dropped"].values())
    # The rollout counts the samples it sent down the queues: the evaluations' are not among them.
    assert summary["rollout"][0]["samples"] == s["produced"]
    calls = summary["controller_calls"]
    assert calls["report_eval"] == 4 and calls["finish_step"] == steps


@pytest.mark.slow  # a 120-step run; the evaluation's rows and accounting: the quickstart's debug run (test_pipeline)
def test_the_greedy_held_out_reward_rises(eval_run):
    run_dir, summary = eval_run
    check_eval_rows(run_dir, summary, STEPS, EVERY)
    check_eval_accounting(summary, STEPS)
    first, last = summary["eval"]["first"], summary["eval"]["last"]
    print(f"held-out greedy reward {first['eval/greedy_reward']:.3f} -> {last['eval/greedy_reward']:.3f}, "
          f"pass@4 {first['eval/pass@4']:.3f} -> {last['eval/pass@4']:.3f}")
    assert last["eval/greedy_reward"] > first["eval/greedy_reward"] + 0.3
