"""Ray tier: the benchmarks that run in seconds, in ``--quick`` mode, into a tmp dir.

They must write valid JSON with the keys their readers use, and a PNG. Nothing here
checks a time or a ratio (benchmarks are not tests); what is checked are properties the
runs must have whatever the machine: exact accounting, the staleness bound, zero-copy
delivery of arrays. weight_sync, rollout_overhead and e2e start vLLM engines or whole
training jobs (a minute or more each on a 2-core CPU) and are left out; staleness runs
its two quick jobs on the HF rollout backend (about a minute).

overlap and queue_hop run in every run; staleness and the two soaks (minutes, their own
Ray clusters) are ``slow`` (``pytest -m slow``): what they check of a run, the staleness
bound and exact accounting across kills, the e2e tier checks in every run too.
"""

from __future__ import annotations

import json

import pytest

from bench.__main__ import main
from bench.common import result_files


def _load(out_dir, bench: str) -> dict:
    """The one result ``bench`` wrote under ``out_dir`` (``<bench>/<date>_<sha7>_quick``),
    with its PNG beside it and its provenance."""
    [path] = result_files(out_dir, bench)
    assert path.name.endswith("_quick.json") and path.with_suffix(".png").stat().st_size > 0
    doc = json.loads(path.read_text())
    assert {"benchmark", "label", "provenance", "machine", "quick", "params", "ratios"} <= doc.keys()
    machine = doc["machine"]
    assert machine["cpu_count"] >= 1 and machine["cpu_model"] and machine["hostname"]
    assert {"torch", "vllm", "ray"} <= machine["versions"].keys()
    assert len(doc["provenance"]["commit"]) == 40 and path.name[11:18] == doc["provenance"]["commit"][:7]
    assert doc["quick"] is True
    return doc


def test_overlap_quick_writes_result(ray_cluster, tmp_path):
    assert main(["overlap", "--quick", "--out", str(tmp_path)]) == 0
    doc = _load(tmp_path, "overlap")
    assert {"async", "sync", "ideal", "efficiency", "staleness_sweep", "balanced", "cases"} <= doc.keys()
    # The machine's speed, read before and after, for the reader of a 10 ms figure.
    assert doc["machine_speed"].keys() == {"additions", "before_s", "after_s"}
    assert {"async_throughput_per_s", "sync_throughput_per_s", "ideal_throughput_per_s", "async_over_sync",
            "efficiency"} <= doc["ratios"].keys()
    assert doc["async"]["mode"] == "async" and doc["sync"]["mode"] == "sync"
    mix = doc["params"]["rl_mix"]
    target = mix["micro_batches"] * mix["prompts_per_micro_batch"]
    for case in doc["cases"]:
        ledger = case["ledger"]
        # Exact accounting: every admitted prompt was trained or dropped, and the target was met.
        assert ledger["reconciles"] and ledger["in_flight"] == 0
        assert ledger["trained"] == target
        # The trainer's gate: nothing staler than max_staleness was trained on.
        assert max(int(k) for k in case["staleness_hist"]) <= case["max_staleness"]
        # Weight updates reached the rollout; the watcher may skip a version that was
        # superseded while it applied the previous one, so at most one per step.
        assert 1 <= case["weight_updates_applied"] <= case["steps"]


@pytest.mark.slow  # about 30 s; the bench smokes' representative is overlap's, above
def test_queue_hop_quick_writes_result(ray_cluster, tmp_path):
    assert main(["queue_hop", "--quick", "--out", str(tmp_path)]) == 0
    doc = _load(tmp_path, "queue_hop")
    assert {"call_rtt_s", "rows"} <= doc.keys()
    assert {"small_hop_median_ms", "actor_call_rtt_median_ms", "largest_hop_bandwidth_gb_s",
            "memcpy_bandwidth_gb_s", "consumer_zero_copy"} <= doc["ratios"].keys()
    for row in doc["rows"]:
        assert {"actor", "driver", "memcpy"} <= row.keys()
        assert row["actor"]["latency_s"]["n"] >= 1
    # numpy payloads reach the consumer as read-only views of the object store: no copy.
    assert doc["ratios"]["consumer_zero_copy"] is True


@pytest.mark.slow
def test_staleness_quick_writes_result(ray_cluster, tmp_path):
    """Three 3-step quickstart runs (lock-step, η 2 with truncated importance weights,
    and the same with two PPO epochs) on the HF rollout backend, which starts in seconds."""
    assert main(["staleness", "--quick", "--out", str(tmp_path)]) == 0
    doc = _load(tmp_path, "staleness")
    assert set(doc["runs"]) == {"sync", "eta2-truncate", "eta2-truncate-epochs2"}
    assert len(doc["table"]) == 2 + len(doc["runs"])
    # The second epoch is anchored on the first pass: its ratio has moved off 1.
    epochs2 = doc["runs"]["eta2-truncate-epochs2"]
    assert epochs2["later_epochs_ratio_mean"] != 1.0 and doc["runs"]["sync"]["later_epochs_ratio_mean"] is None
    for row in doc["runs"].values():
        assert row["status"] == "ok", row.get("error")
        assert row["steps"] == 3 and len(row["curve_samples"]) == 3
        assert [s for s, _ in row["curve_samples"]] == [64, 128, 192]  # 8 prompts x 8 samples a step
        assert row["staleness_max"] <= row["eta"]
        assert row["samples_trained"] == 3 * 64 and row["samples_dropped"] == {}
    assert doc["runs"]["sync"]["staleness_max"] == 0
    assert {"sync_reward_final", "eta2-truncate_reward_final", "eta2-truncate_minus_sync_reward_final"} <= \
        doc["ratios"].keys()


@pytest.mark.slow
def test_soak_quick_writes_result(tmp_path):
    """The soak on the HF rollout backend: 15 s of memory samples, then a reward actor
    killed (restarted by Ray) and the driver killed with its cluster (then resumed);
    its own Ray cluster, in a subprocess (~90 s)."""
    assert main(["soak", "--quick", "--out", str(tmp_path)]) == 0
    doc = _load(tmp_path, "soak")
    assert doc["status"] == "ok", doc["error"]
    growth = doc["phase1"]["growth"]
    for stage in ("source:0", "rollout:0", "reward:0", "reference:0", "trainer:0", "driver"):
        assert stage in growth["rss_mib_per_hour"] and stage in growth["uss_mib_per_hour"]
    for q in doc["phase1"]["queues"].values():
        assert q["max_depth"] <= q["bound"]  # no failure yet: the bound holds
    kinds = [(f["kind"], f["details"].get("stage")) for f in doc["faults"]]
    assert kinds == [("stage", "reward:0"), ("driver", None)]
    assert all(f["recovered"] and f["recovery_s"] > 0 for f in doc["faults"])
    # Stopped by SIGINT after the resume; every prompt issued was trained or dropped
    # once, by the two independent accounts, across the stage kill and the resume.
    phase2 = doc["phase2"]
    assert phase2["exit_code"] == 130 and phase2["run_status"] == "interrupted"
    assert phase2["accounting"]["reconciles"] and phase2["prompts"]["in_flight"] == 0
    assert doc["ratios"]["samples_lost"] == 0 and doc["ratios"]["samples_duplicated"] == 0


@pytest.mark.slow
def test_soak_quick_recovers_from_each_new_fault(tmp_path):
    """The soak's new faults on the HF rollout backend, one each after 15 s of memory
    samples: a NaN reward, a full checkpoint disk, a truncated newest checkpoint (with the
    driver's kill and a resume); exact accounting across all of them (~3 min)."""
    faults = "nan,disk_full,ckpt_truncate"
    assert main(["soak", "--quick", "--faults", faults, "--out", str(tmp_path)]) == 0
    [path] = result_files(tmp_path, "soak")
    doc = json.loads(path.read_text())
    assert doc["status"] == "ok", doc["error"]
    assert doc["label"] == "quick-faults" and doc["params"]["faults"] == faults.split(",")
    assert [f["kind"] for f in doc["faults"]] == faults.split(",")
    for f in doc["faults"]:
        assert f["recovered"] and f["recovery_s"] >= 0, f
    nan, disk, cut = (f["details"] for f in doc["faults"])
    assert nan["skipped_nonfinite"] == 1  # the poisoned step was not applied; the next one was
    assert disk["partial_checkpoints"] == [] and disk["next_checkpoint"] > disk["last_good_while_full"]
    assert cut["skip_named_in_log"] and cut["resumed_version"] < cut["damaged_version"]
    assert cut["damaged_prompts_in_final_account"] and cut["regenerated_prompts"] > 0
    phase2 = doc["phase2"]
    assert phase2["dropped_prompts"]["nonfinite"] == 8  # the skipped step's prompts, dropped with their reason
    assert phase2["accounting"]["reconciles"] and phase2["metrics_steps_contiguous"]
    assert doc["ratios"]["samples_lost"] == 0 and doc["ratios"]["samples_duplicated"] == 0


@pytest.mark.slow
def test_soak_quick_recovers_from_an_engine_kill(tmp_path):
    """The engine fault: vLLM's engine core (a process of its own) killed after 15 s of
    memory samples; the rollout rebuilds it in place (a vLLM start on CPU: minutes)."""
    assert main(["soak", "--quick", "--faults", "engine", "--out", str(tmp_path)]) == 0
    [path] = result_files(tmp_path, "soak")
    doc = json.loads(path.read_text())
    assert doc["status"] == "ok", doc["error"]
    [fault] = doc["faults"]
    assert fault["kind"] == "engine" and fault["recovered"], fault
    assert 0 < fault["details"]["death_seen_after_s"] <= fault["recovery_s"] <= fault["details"]["next_step_after_s"]
    run_faults = doc["phase2"]["run_faults"]
    assert run_faults["engine_restarts"] == {"rollout:0": 1} and run_faults["restarts"] == {}  # the actor lived
    assert doc["phase2"]["accounting"]["reconciles"] and doc["phase2"]["metrics_steps_contiguous"]
    assert doc["ratios"]["samples_lost"] == 0 and doc["ratios"]["samples_duplicated"] == 0


@pytest.mark.slow
def test_soak_memory_quick_writes_result(tmp_path):
    """The memory soak's allocator settings side by side on the HF rollout backend (the
    first two of three in quick mode): 15 s of memory samples each, their own Ray
    clusters, in subprocesses."""
    assert main(["soak_memory", "--quick", "--out", str(tmp_path)]) == 0
    doc = _load(tmp_path, "soak_memory")
    assert doc["status"] == "ok", doc["error"]
    assert doc["params"]["variants"]["arena_max_2"] == {"env": {"MALLOC_ARENA_MAX": "2"},
                                                        "overrides": ["rollout.host_memory_trim_s=0"]}
    assert set(doc["variants"]) == {"glibc_default", "arena_max_2"}
    assert doc["ratios"]["arena_max_2_over_glibc_default_steps"] > 0
    for variant in doc["variants"].values():
        assert variant["steps"] > 0
        for stage in ("source:0", "rollout:0", "reward:0", "reference:0", "trainer:0", "driver"):
            assert stage in variant["growth"]["rss_mib_per_hour"]
        for q in variant["queues"].values():
            assert q["max_depth"] <= q["bound"]
