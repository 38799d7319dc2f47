"""``placement: colocate`` on one GPU: ``configs/gpu_small.yaml`` lock-step with vLLM
asleep while the trainer steps. vLLM's KV cache is the size the plan gave it (the job's
sequences, not its share of the GPU) and it asks for no more than weights, cache and
reserve at start-up, every sleep gives that cache and the weights back
to the GPU, every step hands the GPU over once, and the rollout ends awake on the
trainer's final, verified weights."""

from __future__ import annotations

import json

from pipeline.config import load_config
from pipeline.launch import plan_run_placement
from pipeline.metrics import read_metrics
from tests.gpu.test_pipeline_gpu import LOG_DIR, ROOT, _conveyor

STEPS = 6


def test_colocated_run_frees_vllms_memory_for_every_training_step(tmp_path):
    run_dir = tmp_path / "colocate"
    config = ROOT / "configs" / "gpu_small.yaml"
    overrides = ["placement=colocate", "dataflow.async_execution=false", "dataflow.max_staleness=0",
                 f"run.dir={run_dir}", f"run.steps={STEPS}", "run.progress=false", "train.save_checkpoint=false",
                 "rollout.host_memory_trim_s=60"]
    # vLLM's share of the GPU and its KV cache as the launch plans them (nvidia-smi: no
    # CUDA context here).
    planned, plan = plan_run_placement(load_config(config, overrides))
    share, kv_gib = plan.rollout_memory_fraction, planned.rollout.kv_cache_gib
    assert kv_gib is not None and any("KV cache sized to the job" in n for n in plan.notes), plan.notes
    done = _conveyor("launch", "--config", str(config), *overrides, log=LOG_DIR / "colocate.log")
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert summary["samples"]["reconciles"] and [r["step"] for r in rows] == list(range(STEPS))
    free = [r["colocate/gpu_free_fraction"] for r in rows]
    print(f"vLLM share {share}, KV cache {kv_gib:.2f} GiB, free while training {free}, "
          f"handoff s {[r['colocate/handoff_s'] for r in rows]}, rollout {summary['rollout']}")
    (rollout,) = summary["rollout"]  # its account before shutdown, where the final version wakes it
    # vLLM started asking only for its weights (0.5 GiB), that cache and the 10% reserve,
    # not the ~0.86 of the GPU the trainer leaves it. Each sleep gave back at least the
    # planned KV cache, and not the >100 GiB a cache filling that share would be.
    freed = rollout["sleep_freed_gib"]
    assert share < 0.2 and any("at start-up" in n for n in plan.notes), (share, plan.notes)
    assert kv_gib <= freed["min"] and freed["max"] < kv_gib + 8, (kv_gib, freed)
    calls = summary["controller_calls"]
    assert calls["hand_gpus_to_trainer"] == calls["confirm_asleep"] == STEPS
    assert rollout["sleeps"] == STEPS and rollout["weight_updates"]["count"] == STEPS - 1
    assert rollout["host_memory_trims"] >= 1  # the first update gave the engine's freed heap back
    # The sampled tokens' log-probs came from the sampler tap (rollout.sampler_tap: auto),
    # and they are the trainer's own to bf16 precision: a value filed one token off would
    # differ by nats.
    mismatch = [r["actor/logp_mismatch"] for r in rows]
    print(f"sampler tap {rollout['engine']}, |trainer - sampler| log-prob per step {mismatch}")
    assert rollout["engine"]["tap_records"] > 0
    assert max(mismatch) < 0.1, mismatch
    for worker, state in summary["served"].items():
        assert state["version"] == STEPS and state["verified"], (worker, state)
