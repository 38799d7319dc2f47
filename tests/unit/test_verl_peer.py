"""verl as a peer (``bench/peers/verl_grpo.py``) without verl: the job checks, the files and
Hydra overrides it writes, the per-prompt lengths of a request, and the reading of verl's
console log (``data/verl_log_excerpt.txt``: lines made by verl 0.9.1's own ``concat_dict_to_str``,
with Ray's actor prefix and the other lines a run prints around them). Composing the overrides
with verl's real config needs verl: tests/gpu/test_verl_peer_gpu.py, where its wheels are installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import msgspec
import pyarrow.parquet as pq
import pytest

from bench.peers.verl_grpo import (
    AGENT_LOOP_NAME,
    PLAIN_CHAT_TEMPLATE,
    VerlJob,
    apply_prompt_lengths,
    build_verl_overrides,
    check_job,
    parse_verl_line,
    parse_verl_log,
    run_verl,
    summarize_verl_steps,
    verl_version,
    write_verl_files,
)
from stages.data.tasks import load_task

EXCERPT = Path(__file__).parent / "data" / "verl_log_excerpt.txt"
JOB = VerlJob(model_path="/models/qwen3_0.6b", task="copy", steps=3, prompts_per_step=4, group_size=8, lr=2e-6,
              max_prompt_tokens=64, max_completion_tokens=256, micro_batch_samples=16, gpu_memory_utilization=0.35)


def _rows(n: int, chat: bool = False, **lengths: int) -> list[dict]:
    rows = load_task("copy").generate_rows(0, n)
    if chat:
        rows = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows]
    return [{**r, **lengths} for r in rows]


def _as_dict(overrides: list[str]) -> dict[str, str]:
    keys = [o.split("=", 1)[0] for o in overrides]
    assert len(keys) == len(set(keys))  # no key is set twice
    return dict(o.split("=", 1) for o in overrides)


def test_the_overrides_carry_the_job(tmp_path: Path) -> None:
    files = write_verl_files(JOB, _rows(12), tmp_path)
    o = _as_dict(build_verl_overrides(JOB, files, tmp_path))
    assert o["algorithm.adv_estimator"] == "grpo" and o["algorithm.use_kl_in_reward"] == "false"
    assert o["data.train_batch_size"] == "4" and o["actor_rollout_ref.actor.ppo_mini_batch_size"] == "4"  # 1 step, 1 update
    assert o["actor_rollout_ref.rollout.n"] == "8" and o["actor_rollout_ref.actor.optim.lr"] == "2e-06"
    assert o["trainer.total_training_steps"] == "3" and o["data.max_response_length"] == "256"
    assert o["actor_rollout_ref.rollout.max_model_len"] == "320"  # 64 prompt + 256 completion tokens
    assert o["actor_rollout_ref.rollout.gpu_memory_utilization"] == "0.35"
    assert o["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == "16"
    assert "actor_rollout_ref.actor.use_dynamic_bsz" not in o
    assert o["actor_rollout_ref.model.enable_gradient_checkpointing"] == "true"  # verl's default unless told
    plain = _as_dict(build_verl_overrides(msgspec.structs.replace(JOB, gradient_checkpointing=False), files, tmp_path))
    assert plain["actor_rollout_ref.model.enable_gradient_checkpointing"] == "false"
    assert o["actor_rollout_ref.rollout.agent.default_agent_loop"] == AGENT_LOOP_NAME
    assert o["reward.custom_reward_function.path"] == str(files.reward)
    assert o["data.train_files"] == str(files.train) and o["trainer.n_gpus_per_node"] == "1"
    # Text prompts are rendered as they are, so verl's prompt tokens are Conveyor's.
    assert o["actor_rollout_ref.model.custom_chat_template"] == f"'{PLAIN_CHAT_TEMPLATE}'"


def test_chat_rows_keep_the_checkpoint_template_and_a_token_budget_replaces_micro_batches(tmp_path: Path) -> None:
    job = msgspec.structs.replace(JOB, token_budget=4096, trainer_mode="colocate_async")
    o = _as_dict(build_verl_overrides(job, write_verl_files(job, _rows(12, chat=True), tmp_path), tmp_path))
    assert "actor_rollout_ref.model.custom_chat_template" not in o
    assert o["actor_rollout_ref.actor.use_dynamic_bsz"] == "true"
    assert o["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == "4096"
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu" not in o
    assert o["trainer.v1.trainer_mode"] == "colocate_async"


def test_the_parquet_holds_verl_columns_for_the_rows_of_the_run(tmp_path: Path) -> None:
    rows = _rows(15)
    rows[1] |= {"min_tokens": 40, "max_tokens": 200}
    files = write_verl_files(JOB, rows, tmp_path)
    table = pq.read_table(files.train).to_pylist()
    assert len(table) == 12  # 3 steps x 4 prompts: the rows beyond are not written
    assert table[0]["prompt"] == [{"role": "user", "content": rows[0]["prompt"]}]
    assert table[0]["reward_model"] == {"style": "rule", "ground_truth": str(rows[0]["ground_truth"])}
    assert table[1]["extra_info"] == {"index": 1, "min_tokens": 40, "max_tokens": 200}
    assert table[2]["extra_info"] == {"index": 2, "min_tokens": None, "max_tokens": None}


def test_the_reward_file_scores_like_the_task(tmp_path: Path) -> None:
    files = write_verl_files(JOB, _rows(12), tmp_path)
    spec = importlib.util.spec_from_file_location("conveyor_reward_probe", files.reward)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    task = load_task("copy")
    for answer in ("4821", "4800", "9"):
        assert module.compute_score("copy", answer, "4821", extra_info={"num_turns": 2}) == task.compute_score(
            "copy", answer, "4821")
    assert module.compute_score("copy", "4821", "4821") == 1.0 > module.compute_score("copy", "4800", "4821")


@pytest.mark.parametrize(("change", "field"), [
    ({"steps": 0}, "steps"),
    ({"group_size": 1}, "group_size"),
    ({"gpu_memory_utilization": 1.0}, "gpu_memory_utilization"),
    ({"micro_batch_samples": 5}, "micro_batch_samples"),  # 5 does not divide 4 x 8 = 32 samples
    ({"token_budget": 100}, "token_budget"),  # under 64 + 256 tokens
    ({"trainer_mode": "separate_async"}, "trainer_mode"),
    ({"attn_implementation": "flash"}, "attn_implementation"),
])
def test_a_job_verl_cannot_run_names_its_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        check_job(msgspec.structs.replace(JOB, **change))


@pytest.mark.parametrize(("edit", "match"), [
    (lambda rows: rows.pop(), "need 12 rows, got 11"),
    (lambda rows: rows[3].pop("ground_truth"), "row 3: missing 'ground_truth'"),
    (lambda rows: rows[2].update(max_tokens=300), "row 2: 'max_tokens'"),  # above 256
    (lambda rows: rows[5].update(min_tokens=90, max_tokens=80), r"row 5: 'min_tokens' \(90\)"),
    (lambda rows: rows[4].update(prompt=[{"role": "user"}]), "row 4: 'prompt' must be text"),
])
def test_a_bad_row_is_refused_before_anything_is_written(tmp_path: Path, edit, match: str) -> None:
    rows = _rows(12)
    edit(rows)
    with pytest.raises(ValueError, match=match):
        write_verl_files(JOB, rows, tmp_path)
    assert not (tmp_path / "train.parquet").exists()


def test_each_prompt_gets_its_own_request_lengths() -> None:
    base = {"temperature": 1.0, "logprobs": True}
    assert apply_prompt_lengths(base, {"min_tokens": 30, "max_tokens": 900}, 1024) == {
        **base, "min_tokens": 30, "max_tokens": 900}
    # Equal bounds: an exact length that survives verl's partial-rollout resume (no min_tokens).
    assert apply_prompt_lengths(base, {"min_tokens": 700, "max_tokens": 700}, 1024) == {
        **base, "max_tokens": 700, "ignore_eos": True}
    # Above verl's response_length: capped there (a min above the cap falls to it, so exact).
    assert apply_prompt_lengths(base, {"min_tokens": 2000, "max_tokens": 4000}, 1024) == {
        **base, "max_tokens": 1024, "ignore_eos": True}
    assert apply_prompt_lengths(base, {"index": 3, "min_tokens": None, "max_tokens": None}, 1024) == base
    assert apply_prompt_lengths(base, None, 1024) == base
    assert base == {"temperature": 1.0, "logprobs": True}  # the shared defaults are not changed


def test_the_log_parser_reads_verl_step_lines_and_nothing_else() -> None:
    lines = EXCERPT.read_text().splitlines()
    steps = parse_verl_log(lines)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]  # the validation line (step:0) and the rest left out
    first = steps[0]
    assert first["timing_s/step"] == 14.5423 and first["timing_s/gen"] == 9.82
    assert first["actor/pg_loss"] == -0.0123  # printed as np.float64(-0.0123)
    assert first["training/off_policy/trajectory_spans/max"] == 1  # np.int64(1)
    assert first["perf/total_num_tokens"] == 39040 and first["critic/score/mean"] == 0.0625
    assert parse_verl_line("(WorkerDict pid=2430) [rank0]: global step: 3") is None
    assert parse_verl_line("step:x - a:1") is None
    assert parse_verl_line("step:7 - a:1 - b:not-a-number - c:True") == {"step": 7, "a": 1.0, "c": 1.0}


def test_the_row_rates_come_from_the_arrival_times() -> None:
    lines = [line for line in EXCERPT.read_text().splitlines() if "timing_s/step" in line]
    t0 = 1000.0
    arrivals = [t0 + 60.0, t0 + 67.5, t0 + 75.0, t0 + 82.5]  # start-up 60 s, then a step every 7.5 s
    row = summarize_verl_steps(parse_verl_log(zip(arrivals, lines, strict=True)), t0, samples_per_step=32, gpus=1,
                               warmup=1)
    assert row["startup_s"] == 60.0 and row["steps"] == 4 and row["samples_trained"] == 128
    assert row["samples_per_s"] == pytest.approx(3 * 32 / 22.5)  # steps 2-4 after the end of step 1: 4.267
    # verl's step timer over steps 2-4: (7.5523 + 7.4923 + 7.6523) / 3 = 7.5656 s -> 32 / 7.5656
    assert row["samples_per_s_step_timer"] == pytest.approx(32 / 7.565633, rel=1e-5)
    assert row["verl_timing_s"]["gen"] == pytest.approx((4.41 + 4.38 + 4.52) / 3)
    assert row["generation_share"] == pytest.approx(4.436667 / 7.565633, rel=1e-5)
    # completion tokens: mean response 98.25, 99.25, 100.25 x 32 samples over each step's time
    want = sum(m * 32 / s for m, s in ((98.25, 7.5523), (99.25, 7.4923), (100.25, 7.6523))) / 3
    assert row["completion_tokens_per_s"] == pytest.approx(want)
    assert row["reward_first"] == 0.0625 and row["curve"][0] == [60.0, 0.0625]


def _fake_verl(tmp_path: Path, lines: list[str]) -> str:
    """A stand-in for ``python -m verl.trainer.main_ppo ...``: prints ``lines``, exits 0."""
    script = tmp_path / "fake_verl_python"
    script.write_text("#!/bin/sh\n" + "".join(f"printf '%s\\n' '{line}'\n" for line in lines))
    script.chmod(0o755)
    return str(script)


def test_ray_colour_codes_around_the_actor_prefix_do_not_hide_a_step(tmp_path: Path) -> None:
    # Ray writes the prefix as ESC[36m(TaskRunnerV1 pid=..)ESC[0m even into a pipe.
    step = "\x1b[36m(TaskRunnerV1 pid=7)\x1b[0m step:{} - timing_s/step:{} - critic/score/mean:0.5"
    assert parse_verl_line(step.format(1, 2.5)) == {"step": 1, "timing_s/step": 2.5, "critic/score/mean": 0.5}
    lines = ["ray init", *(step.format(i, 2.0).replace("\x1b", "\033") for i in (1, 2, 3))]
    row = run_verl(JOB, _rows(12), tmp_path, warmup=1, python=_fake_verl(tmp_path, lines))
    assert row["steps"] == 3 and row["reward_first"] == 0.5


def test_a_verl_run_that_trains_no_step_is_an_error_with_its_last_lines(tmp_path: Path) -> None:
    lines = ["ray init", "(TaskRunnerV1 pid=7) Training Progress: 0it", "(TaskRunnerV1 pid=7) the last word"]
    with pytest.raises(RuntimeError, match="logged no training step(.|\n)*the last word"):
        run_verl(JOB, _rows(12), tmp_path, warmup=1, python=_fake_verl(tmp_path, lines))


def test_a_verl_site_replaces_the_inherited_path_for_verl_alone(tmp_path: Path, monkeypatch) -> None:
    # On the GPU the shared site holds TRL, which verl 0.9.1 cannot sit beside; its own site
    # lets one bench call run both rows.
    site = tmp_path / "verl-site"
    (site / "verl-0.9.1.dist-info").mkdir(parents=True)
    (site / "verl-0.9.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: verl\nVersion: 0.9.1\n")
    monkeypatch.setenv("PYTHONPATH", "/shared/site-with-trl")
    assert verl_version() is None  # not installed here, and no site named
    monkeypatch.setenv("CONVEYOR_VERL_SITE", f"{tmp_path / 'no-trl'}:{site}")
    assert verl_version() == "0.9.1"
    script = tmp_path / "fake_verl_python"
    script.write_text("#!/bin/sh\necho \"$PYTHONPATH\" > \"$(dirname \"$0\")/seen_path\"\n"
                      "printf '%s\\n' 'step:1 - timing_s/step:2.0' 'step:2 - timing_s/step:2.0'\n")
    script.chmod(0o755)
    row = run_verl(JOB, _rows(12), tmp_path / "run", warmup=1, python=str(script))
    seen = (tmp_path / "seen_path").read_text().strip().split(":")
    assert seen[1:] == [str(tmp_path / "no-trl"), str(site)] and "/shared/site-with-trl" not in seen
    assert row["verl_site"] == seen[1:] and row["verl_version"] == "0.9.1" and row["steps"] == 2
