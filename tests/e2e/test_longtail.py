"""``bench longtail`` on CPU at tiny scale: per-row budgets through the whole pipeline,
and the bench's Conveyor rows end to end with their JSON.

The first test reads the micro-batches the trainer received (a recording of the
reward->trainer edge) and checks each sample's length against its prompt's scheduled
length; the second runs the bench itself (slow: two launches); the third measures the
engines alone on the schedule, each in a process of its own (about 25 s, no Ray).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench.longtail import prepare_job, run_conveyor_row
from bench.longtail_lengths import LengthSchedule
from pipeline.recorder import RecordingReader
from stages.rollout.occupancy import summarize_length_counts

SCALE = 1 / 64  # median 16 tokens, p99 128, cap 256


@pytest.mark.slow  # a bench's job, as the other bench smokes; its schedule is unit-tested
def test_every_sample_generates_exactly_its_prompts_scheduled_length(ray_cluster, tmp_path):
    schedule = LengthSchedule(scale=SCALE)
    job = prepare_job("tiny", 2, schedule, tmp_path / "job", on_gpu=False)
    # 4 prompts x 2 samples a step, 2 steps: every prompt of the file once.
    small = ("train.prompts_per_step=4", "rollout.n=2", "rollout.max_inflight=4", "dataflow.queue_size=4")
    job.overrides = (*job.overrides, *small)
    job.prompts = 8
    job.prompts_path.write_text("".join(job.prompts_path.read_text().splitlines(keepends=True)[:8]))
    row = run_conveyor_row("lockstep", job, tmp_path, ('record.edges=["reward->trainer"]', "rollout.kv_reserve=cap"))
    batches = [item.value for item in RecordingReader(tmp_path / "lockstep" / "recording" / "trainer").items("reward->trainer")]
    assert sum(b.num_samples for b in batches) == 16
    seen = {}
    for batch in batches:
        for i, n in enumerate(batch.completion_lens):
            prompt = batch.prompts[i // batch.group_size]
            assert int(n) == prompt.max_tokens == schedule.length(prompt.index), (prompt.index, int(n))
            seen[prompt.index] = int(n)
    assert sorted(seen) == list(range(8))
    assert len(set(seen.values())) > 1  # the lengths differ from prompt to prompt
    assert row["lengths"] == summarize_length_counts(Counter(n for n in schedule.lengths(8) for _ in range(2)))
    assert row["tail"]["generating_s"] > 0 and 0 <= row["tail_share"] <= 1
    # The rollout's admission account, from the replica's own counters.
    [admission] = row["rollout_admission"]
    assert admission["admitted"] >= 4 and admission["budget_gib"] > 0, admission
    assert admission["kv_reserve"] == "cap" and admission["kv_admission_seqs"] >= 8, admission  # a step fits
    assert row["rollout_seconds"]["busy"] > 0


@pytest.mark.slow
def test_the_bench_runs_its_conveyor_rows_and_writes_its_json(ray_cluster, tmp_path):
    from bench.longtail import run

    out = run(quick=True, out_dir=tmp_path, systems="streaming,lockstep,trl", steps=2)
    doc = json.loads(out["result_path"].read_text())
    assert doc["benchmark"] == "longtail" and doc["status"] == "ok"
    assert out["result_path"].with_suffix(".png").is_file()
    runs = doc["runs"]
    assert runs["streaming"]["status"] == runs["lockstep"]["status"] == "ok"
    assert runs["trl"]["status"] == "skipped" and runs["trl"]["error"]  # no GPU (or no TRL) here
    schedule = LengthSchedule(scale=SCALE)
    expected = summarize_length_counts(Counter(n for n in schedule.lengths(doc["schedule"]["prompts"])
                                               for _ in range(8)))
    # Lock-step trains the file's prompts once each, in order: the lengths it generated
    # are the schedule's, sample for sample.
    assert runs["lockstep"]["lengths"] == expected
    for name in ("streaming", "lockstep"):
        r = runs[name]
        assert r["steps"] == 2 and r["samples_per_s"] > 0 and r["completion_tokens_per_s"] > 0
        assert set(r["busy_share"]) >= {"rollout", "trainer"} and 0 <= r["tail_share"] <= 1
        # Where its start-up went, and whether vLLM compiled (never on a CPU: eager).
        assert r["startup"]["first_step_s"] > 0 and r["startup"]["slowest_setup"]["setup_s"] > 0, r["startup"]
        assert r["vllm_compile_cache_entries_added"] == 0
    assert doc["ratios"]["streaming_over_lockstep"] > 0
    assert doc["provenance"]["commit"] and doc["definitions"]["tail_share"]


def test_reserving_no_kv_leaves_an_overfull_cache_to_vllm_and_every_sample_keeps_its_length(ray_cluster, tmp_path):
    """``rollout.kv_reserve: auto`` (the default) on vLLM reserves nothing: on a KV cache of
    about 2k tokens (a step wants some 14k) admission defers nothing, vLLM's scheduler fills
    the cache and holds the rest waiting (or preempts), and every sample still comes out at
    exactly its prompt's length."""
    schedule = LengthSchedule(scale=SCALE)
    job = prepare_job("tiny", 1, schedule, tmp_path / "job", on_gpu=False)
    row = run_conveyor_row("lockstep", job, tmp_path, ("rollout.kv_cache_gib=0.004", "run.steps=1"))
    [admission], [engine] = row["rollout_admission"], row["engine"]
    assert admission["kv_reserve"] == "none", admission
    assert admission["deferred"] == 0 and admission["admitted"] >= 32, admission
    # The cache the engine made, as the rollout reports it (what `--kv-cache-gib first` pins).
    assert admission["kv_cache_gib"] == pytest.approx(0.004, rel=0.25), admission
    assert admission["kv_cache_gib"] > admission["budget_gib"], admission  # the budget is a share of it
    assert engine["kv_usage_max"] >= 0.99, engine  # the cache was full: vLLM held requests back
    # The run's own reading of it (pipeline/bound.py): generation bound by the cache it was given.
    assert row["bound"]["stage"] == "rollout" and row["bound"]["change"][0] == "rollout.kv_cache_gib", row["bound"]
    per_prompt = 8  # configs/longtail.yaml's rollout.n
    assert row["lengths"] == summarize_length_counts(Counter(n for n in schedule.lengths(job.prompts)
                                                             for _ in range(per_prompt)))


def test_observed_kv_reserve_reserves_the_p90_of_what_the_worker_generated(ray_cluster, tmp_path):
    """``rollout.kv_reserve: observed``: after a step (256 samples, past the 64 it waits
    for) a sample reserves the p90 of the completions generated, which are the schedule's."""
    schedule = LengthSchedule(scale=SCALE)
    job = prepare_job("tiny", 1, schedule, tmp_path / "job", on_gpu=False)
    row = run_conveyor_row("lockstep", job, tmp_path, ("rollout.kv_reserve=observed", "run.steps=1"))
    [admission] = row["rollout_admission"]
    assert admission["kv_reserve_tokens"] == row["lengths"]["p90"] < max(schedule.lengths(job.prompts)), admission
    assert "kv_admission_seqs" not in admission  # the cap's account only under "cap"


def test_the_engines_alone_generate_and_train_each_prompts_length(tmp_path):
    from bench.longtail import run_engines_row

    schedule = LengthSchedule(scale=SCALE)
    job = prepare_job("tiny", 2, schedule, tmp_path / "job", on_gpu=False)
    job.overrides = (*job.overrides, "train.prompts_per_step=4", "rollout.n=2")
    job.prompts = 8  # 2 steps of 4 prompts
    row = run_engines_row(job, tmp_path / "engines")
    made = sum(n for n in schedule.lengths(8)) * 2  # every sample exactly its prompt's length
    rollout, trainer = row["rollout"], row["trainer"]
    assert rollout["by_step"]["tokens"] == rollout["all_at_once"]["tokens"] == made
    assert rollout["requests"] == 16 and row["rollout_tokens_per_s_all_at_once"] > 0 and rollout["max_num_seqs"] >= 1
    # A prompt per micro-batch (configs/longtail.yaml), or each step as one micro-batch:
    # the same tokens, 8 micro-batches against 2.
    steps, whole = trainer["micro_batches"], trainer["one_per_step"]
    assert steps["tokens"] == whole["tokens"] > made and (steps["micro_batches"], whole["micro_batches"]) == (8, 2)
    assert whole["passes"] <= steps["passes"] and steps["tokens_per_s"] > 0 and whole["tokens_per_s"] > 0
    assert steps["gpu_busy_share"] is None  # no GPU here
