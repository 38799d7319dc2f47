"""Held-out evaluation without Ray: the ``eval`` config's rules, pass@k (the unbiased
estimator, derived by hand), the aggregation of one evaluation, the schedule, the
driver's log and rows, the held-out prompts and the evaluator against a fake engine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pipeline.checkpoint import SAFE_RESUME_KEYS, check_resume_config, restore_metrics, truncate_metrics
from pipeline.cli import main
from pipeline.config import ConfigError, load_config, to_dict
from pipeline.evaluation import EvalLog, EvalSchedule, build_eval_schedule, plot_evals
from pipeline.metrics import MetricsWriter, is_eval_row, read_metrics
from pipeline.preflight import run_preflight
from pipeline.types import EvalResult
from stages.evaluation.metrics import estimate_pass_at_k, eval_metric_names, pass_ks, summarise_eval

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART_EVAL = ROOT / "configs" / "quickstart_eval.yaml"
HELD_OUT = ROOT / "configs" / "data" / "first_digit_heldout.jsonl"


# ------------------------------------------------------------------ config


def test_eval_is_off_by_default():
    cfg = load_config(None)
    assert cfg.eval.path is None and not cfg.eval.enabled
    assert build_eval_schedule(cfg, 0) is None


def test_quickstart_eval_is_the_quickstart_with_an_eval_section():
    """The held-out evaluation's config differs from the quickstart's in its name and its
    ``eval`` section only (a setting the quickstart gains reaches it too)."""
    plain, scored = (to_dict(load_config(ROOT / "configs" / f"{n}.yaml")) for n in ("quickstart", "quickstart_eval"))
    assert scored["eval"]["path"] and not plain["eval"]["path"]
    for cfg in (plain, scored):
        cfg["run"].pop("name"), cfg.pop("eval")
    assert scored == plain


@pytest.mark.parametrize(("overrides", "message"), [
    (["eval.path=h.jsonl", "eval.every=3", "train.sync_interval=2"],
     "eval.every: expected a multiple of train.sync_interval (2): only published versions can be evaluated, got 3"),
    (["eval.path=h.jsonl", "eval.n=4"], "eval.n: expected 1 with eval.temperature 0"),
    (["eval.path=h.jsonl", "algorithm.name=dpo", "data.path=p.jsonl", "data.pairs={}", "rollout.n=1"],
     "eval.path: evaluation generates with the rollout, and algorithm.name 'dpo' runs none"),
    (["eval.every=-1"], "eval.every: expected int >= 0, got -1"),
    (["eval.path="], "eval.path: expected str of length >= 1"),
    (["eval.temperature=-0.5"], "eval.temperature: expected float >= 0"),
    (["eval.pass_at=1"], "eval.pass_at: unknown field"),
])
def test_bad_eval_values_name_their_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


def test_the_cli_refuses_a_bad_eval_key_with_exit_2(capsys):
    assert main(["status", "--config", str(QUICKSTART_EVAL), "eval.n=4", "eval.temperature=0"]) == 2
    assert "eval.n: expected 1 with eval.temperature 0" in capsys.readouterr().err


def test_eval_keys_may_change_on_resume():
    old = to_dict(load_config(QUICKSTART_EVAL))
    new = to_dict(load_config(QUICKSTART_EVAL, ["eval.every=50", "eval.num_prompts=8"]))
    assert "eval." in SAFE_RESUME_KEYS
    assert sorted(check_resume_config(old, new)) == ["eval.every", "eval.num_prompts"]


def test_preflight_reads_the_held_out_file_and_names_eval_keys(tmp_path):
    cfg, report = run_preflight(load_config(QUICKSTART_EVAL, [f"run.dir={tmp_path}"]))
    assert cfg.eval.path == str(HELD_OUT)  # made absolute for the actors
    assert (report.eval_data.rows_total, report.eval_data.rows_usable) == (64, 64)
    assert report.describe().splitlines()[1].startswith("eval: first_digit_heldout.jsonl (jsonl): 64 rows")
    with pytest.raises(ConfigError, match=r"^eval.path: .*missing.jsonl' does not exist"):
        run_preflight(load_config(QUICKSTART_EVAL, [f"eval.path={tmp_path / 'missing.jsonl'}"]))
    with pytest.raises(ConfigError, match=r"^eval.prompt_key: first_digit_heldout.jsonl has no column 'question'"):
        run_preflight(load_config(QUICKSTART_EVAL, ["eval.prompt_key=question"]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"prompt": "  ", "ground_truth": "1"}) + "\n")
    with pytest.raises(ConfigError, match=r"^eval.path: no usable row"):
        run_preflight(load_config(QUICKSTART_EVAL, [f"eval.path={empty}"]))


def test_the_held_out_file_is_the_task_at_another_seed_and_unseen_in_training():
    """configs/data/first_digit_heldout.jsonl: first_digit rows at seed 10,000, the first 64
    that are not among the first 20,000 prompts of the training stream (seed 0), over 16
    times what the 150-step quickstart_eval run draws (1,200 prompts and replacements)."""
    from stages.data.tasks import FirstDigitTask

    task = FirstDigitTask()
    seen = {r["prompt"] for r in task.generate_rows(0, 20_000)}
    expected = [{"prompt": r["prompt"], "ground_truth": r["ground_truth"]}
                for r in task.generate_rows(10_000, 200) if r["prompt"] not in seen][:64]
    rows = [json.loads(line) for line in HELD_OUT.read_text().splitlines()]
    assert rows == expected


# ------------------------------------------------------------------ pass@k and aggregation


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (4, 1, 1, 0.25),      # 1 - C(3,1)/C(4,1) = 1 - 3/4
    (4, 1, 2, 0.5),       # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 3, 0.9),       # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (4, 2, 2, 5 / 6),     # 1 - C(2,2)/C(4,2) = 1 - 1/6
    (4, 0, 4, 0.0),       # nothing passed
    (4, 1, 4, 1.0),       # n - c = 3 < k: every draw of 4 holds the passing one
    (1, 1, 1, 1.0),
])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert estimate_pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_the_binomial_formula_everywhere():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert estimate_pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError, match="pass@k"):
            estimate_pass_at_k(n, c, k)


def test_the_ks_reported():
    assert [pass_ks(n) for n in (1, 2, 4, 6, 8)] == [[1], [1, 2], [1, 2, 4], [1, 2, 4, 6], [1, 2, 4, 8]]


def test_an_evaluation_is_summarised_prompt_by_prompt():
    rewards = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=np.float32)
    greedy = np.array([1.0, 0.0, 0.5])
    lengths = np.array([[2, 2, 1, 1], [2, 2, 2, 2], [1, 1, 1, 1]])
    m = summarise_eval(rewards, greedy, lengths, threshold=1.0, reward_errors=2, wall_s=1.5)
    assert list(m) == eval_metric_names(4)
    assert m["eval/reward_mean"] == pytest.approx(3 / 12)
    assert m["eval/reward_std"] == pytest.approx(np.sqrt(3 / 12 * 9 / 12))  # a 0/1 variable: sqrt(p (1 - p))
    assert m["eval/pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    assert m["eval/pass@2"] == pytest.approx((1 / 2 + 5 / 6 + 0) / 3)  # c=1: 1 - 3/6; c=2: 1 - 1/6
    assert m["eval/pass@4"] == pytest.approx(2 / 3)  # two prompts of three passed at least once
    assert m["eval/greedy_reward"] == pytest.approx(0.5)
    assert m["eval/greedy_pass"] == pytest.approx(1 / 3)  # 0.5 is below the threshold
    assert m["eval/response_length"] == pytest.approx((6 + 8 + 4) / 12)
    assert (m["eval/prompts"], m["eval/reward_errors"], m["eval/wall_s"]) == (3.0, 2.0, 1.5)
    half = summarise_eval(rewards * 0.5, greedy, lengths, threshold=0.5, reward_errors=0, wall_s=0.0)
    assert half["eval/greedy_pass"] == pytest.approx(2 / 3) and half["eval/pass@4"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="expected rewards \\[P, n\\]"):
        summarise_eval(rewards, greedy[:2], lengths, 1.0, 0, 0.0)


# ------------------------------------------------------------------ schedule, log, rows


def test_the_schedule_names_the_versions_due():
    fresh = EvalSchedule(every=5, before_train=True, start_version=0)
    assert [fresh.kind(v) for v in (0, 3, 5, 10, 11)] == ["before_train", None, "periodic", "periodic", None]
    resumed = EvalSchedule(every=5, before_train=True, start_version=10)
    assert [resumed.kind(v) for v in (5, 10, 15)] == [None, "before_train", "periodic"]
    assert EvalSchedule(every=0, before_train=False).kind(0) is None
    cfg = load_config(QUICKSTART_EVAL)
    assert build_eval_schedule(cfg, 7) == EvalSchedule(every=25, before_train=True, start_version=7)


def result(version: int, reward: float, kind: str = "periodic") -> EvalResult:
    return EvalResult(version=version, kind=kind, worker="rollout:0", metrics={"eval/reward_mean": reward},
                      time=100.0 + version, wall_s=0.5)


def test_the_log_keeps_first_last_and_best_and_continues_after_a_resume():
    log = EvalLog()
    for r in (result(0, 0.1, "before_train"), result(5, 0.6), result(10, 0.4)):
        log.add(r)
    s = log.summary()
    assert s["evals"] == 3
    assert (s["first"]["version"], s["best"]["version"], s["last"]["version"]) == (0, 5, 10)
    assert s["best"] == {"version": 5, "kind": "periodic", "wall_s": 0.5, "eval/reward_mean": 0.6}
    resumed = EvalLog({"eval": s})  # the summary.json the first launch left
    resumed.add(result(15, 0.5))
    s2 = resumed.summary()
    assert (s2["evals"], s2["first"]["version"], s2["best"]["version"], s2["last"]["version"]) == (4, 0, 5, 15)


def test_eval_rows_are_rows_of_their_own_at_the_version(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.log(0, {"reward/mean": 0.1})
        writer.log(1, {"reward/mean": 0.2})
        writer.log_eval(1, {"eval/reward_mean": 0.3}, at=5.0)  # after the row of step 1 (version 2)
        with pytest.raises(ValueError, match="eval rows hold eval/\\* metrics only"):
            writer.log_eval(2, {"reward/mean": 0.3})
    rows = read_metrics(tmp_path)
    assert [is_eval_row(r) for r in rows] == [False, False, True]
    assert rows[2] == {"step": 1, "time": 5.0, "eval/reward_mean": 0.3}
    assert plot_evals(rows[:2], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
    assert plot_evals(rows, tmp_path / "eval.png") == tmp_path / "eval.png"
    assert (tmp_path / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resume_keeps_the_evaluations_of_the_checkpoints_weights(tmp_path):
    """Resumed from version 2: the rows of steps 0 and 1 stay (step 2's is logged again),
    and so do the evaluations of versions 0..2 (those weights are the checkpoint's or older)."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "reward/mean": 0.1}, {"step": 0, "eval/reward_mean": 0.0}, {"step": 1, "reward/mean": 0.2},
            {"step": 2, "reward/mean": 0.3}, {"step": 2, "eval/reward_mean": 0.5}, {"step": 3, "reward/mean": 0.4},
            {"step": 4, "eval/reward_mean": 0.6}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert truncate_metrics(path, 2) == 3
    kept = read_metrics(path)
    assert kept == [rows[0], rows[1], rows[2], rows[4]]
    # A lost step row is restored after the last *step*, whatever eval rows follow it.
    assert restore_metrics(path, [{"step": 1, "reward/mean": 0.2}, {"step": 2, "reward/mean": 0.3}]) == 1
    assert read_metrics(path)[-1] == {"step": 2, "reward/mean": 0.3}
