"""What users reach for on day one, on one GPU (issue: Hub names, LoRA, trackers, evaluation).

- ``configs/gpu_small.yaml`` with a held-out evaluation (``eval``: before training, every
  4 steps and at the end; greedy and 4 samples a prompt) and the experiment trackers
  TensorBoard, MLflow (its local store under the run dir, no server) and W&B (offline),
  the real packages: each tracker's own reader finds the run's metric rows by step, the
  evaluations by version and the summary's files.
- LoRA on a 7-8B real shape (``CONVEYOR_LORA_SHAPE``, default ``qwen3_8b``: 8.2B
  parameters, random init, built here), colocated: 10 steps, only the adapters train,
  every merged sync verified by the rollout, the adapter exported. The log reports the
  sync time and the trainer's memory.

Needs ``peft``, ``mlflow`` (or ``mlflow-skinny``) and ``wandb`` beside vLLM, Ray and
DeepSpeed (``tests/gpu/prepare_extra_wheels.sh`` brings them to the lent machine).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from bench.gpu_e2e import mode_overrides
from bench.shape_job import write_chat_rows
from pipeline.config import load_config
from pipeline.metrics import is_eval_row, read_metrics
from stages.data.tasks import load_task
from stages.models.shapes import build_in_subprocess
from tests.gpu.test_pipeline_gpu import LOG_DIR, ROOT, _conveyor
from tests.gpu.test_real_shapes import JOB
from tests.gpu.test_real_shapes import STEPS as JOB_STEPS

GPU_SMALL = ROOT / "configs" / "gpu_small.yaml"
STEPS, EVERY, EVAL_PROMPTS = 12, 4, 32
LORA_SHAPE = os.environ.get("CONVEYOR_LORA_SHAPE", "qwen3_8b")


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("day-one")
    held_out = root / "held_out.jsonl"
    rows = load_task("copy").generate_rows(seed=10_000, n=EVAL_PROMPTS)
    held_out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = root / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        done = _conveyor("launch", "--config", str(GPU_SMALL), f"run.dir={run_dir}", f"run.steps={STEPS}",
                         "run.progress=false", f"eval.path={held_out}", f"eval.every={EVERY}", "eval.before_train=true",
                         "eval.n=4", "eval.temperature=1.0", "eval.seed=0", "run.trackers=[tensorboard,mlflow,wandb]",
                         log=LOG_DIR / "day-one-trackers.log")
    assert done.returncode == 0, done.stderr[-4000:]
    return run_dir, json.loads((run_dir / "summary.json").read_text()), read_metrics(run_dir / "metrics.jsonl")


def test_evaluations_come_at_the_versions_due_on_the_gpu(tracked_run):
    run_dir, summary, rows = tracked_run
    evals = [r for r in rows if is_eval_row(r)]
    for r in evals:
        print("eval", {k: round(v, 4) for k, v in r.items() if k.startswith("eval/")} | {"step": r["step"]})
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert [r["step"] for r in evals] == list(range(0, STEPS + 1, EVERY))
    assert all(r["eval/prompts"] == EVAL_PROMPTS and r["eval/reward_errors"] == 0 for r in evals)
    assert all(0.0 <= r["eval/pass@4"] <= 1.0 and r["eval/pass@1"] <= r["eval/pass@4"] for r in evals)
    assert summary["eval"]["evals"] == len(evals) and (run_dir / "eval.png").is_file()
    assert summary["samples"]["reconciles"] and summary["samples"]["trained"] == STEPS * 32 * 8


def test_tensorboard_holds_every_step_and_evaluation(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, _ = tracked_run
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == list(range(STEPS))
    assert [e.step for e in acc.Scalars("eval/greedy_reward")] == list(range(0, STEPS + 1, EVERY))


def test_mlflow_local_store_holds_params_metrics_and_files(tracked_run, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 opens a file store only so, as the run did

    run_dir, _, rows = tracked_run
    client = mlflow.MlflowClient((run_dir / "mlruns").absolute().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("conveyor").experiment_id])
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    train_rows = [r for r in rows if not is_eval_row(r)]
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["reward/mean"])) for r in train_rows]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/greedy_reward")] == \
        list(range(0, STEPS + 1, EVERY))
    assert run.data.params["train.lr"] == "1e-06" and run.data.params["run.name"] == "gpu_small"
    assert {"summary.json", "timeline.png", "eval.png"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    print("mlflow:", run.info.run_id, len(run.data.params), "params,", len(run.data.metrics), "metrics")


def test_wandb_offline_run_is_written(tracked_run):
    run_dir, _, _ = tracked_run
    (offline,) = sorted((run_dir / "wandb").glob("offline-run-*"))
    (records,) = offline.glob("run-*.wandb")
    print("wandb:", records, records.stat().st_size, "bytes")
    assert records.stat().st_size > 10_000  # the config, 12 rows and 4 evaluations, not an empty header


def test_lora_on_a_7_8b_shape_trains_colocated_with_every_merged_sync_verified(tmp_path):
    ckpt = build_in_subprocess(LORA_SHAPE)
    data = write_chat_rows(load_config(GPU_SMALL, JOB), 64, tmp_path / "prompts.jsonl")
    run_dir = tmp_path / "run"
    done = _conveyor("launch", "--config", str(GPU_SMALL), f"model.path={ckpt}", f"data.path={data}",
                     f"run.dir={run_dir}", *JOB, *mode_overrides("colocate"), "model.lora.rank=16",
                     "model.lora.alpha=32", "train.lr=1e-5", log=LOG_DIR / f"lora-{LORA_SHAPE}.log")
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = len(rows)
    syncs = [r["timing_s/weight_sync"] for r in rows if "timing_s/weight_sync" in r]
    reserved = [r["memory/trainer_reserved_gib"] for r in rows if "memory/trainer_reserved_gib" in r]
    print(f"lora {LORA_SHAPE}: steps {steps}, step s {[round(r['time/step_s'], 2) for r in rows]}, "
          f"weight sync s {[round(s, 2) for s in syncs]}, trainer reserved GiB {[round(g, 1) for g in reserved]}, "
          f"startup {summary.get('startup')}")
    assert summary["status"] == "completed" and summary["steps"] == steps == JOB_STEPS
    assert all(math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"]) for r in rows)
    for worker, state in summary["served"].items():
        assert state["version"] == steps and state["verified"], (worker, state)
    ckpt_dir = Path(summary["trainer"]["checkpoint"])
    assert (ckpt_dir / "adapter_model.safetensors").is_file() and (ckpt_dir / "adapter_config.json").is_file()
    adapter_gb = (ckpt_dir / "adapter_model.safetensors").stat().st_size / 1e9
    assert adapter_gb < 1.0, adapter_gb  # the adapters alone, not the 16 GB base
