"""Users' own models on one GPU: real shapes (``stages/models/shapes.py``: published configs,
real vocabularies, tied embeddings, a tokenizer smaller than the vocabulary, sampling
defaults in the generation config) run ``configs/gpu_small.yaml`` with only the model,
the data (chat-format JSONL) and the reward (verl's signature) changed, as a new user
runs them.

``CONVEYOR_SHAPES`` (comma-separated, default ``qwen3_0.6b``) names the shapes and
``CONVEYOR_PLACEMENTS`` (default ``colocate,streaming``) the placements: ``colocate``
(lock-step, vLLM asleep while the trainer steps) and ``streaming`` (the config's own,
asynchronous); ``CONVEYOR_SHAPE_OVERRIDES`` (space-separated ``key=value``) what the
memory plan's advice asks of a shape on a smaller GPU (a 4B model on 80 GB:
``train.offload_optimizer=true train.gradient_checkpointing=true``). Each run: ``STEPS``
steps, every weight update read back and verified over CUDA IPC, and a checkpoint
exported that vLLM then loads, serving exactly the weights the run served last.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import stage_log_timings
from bench.gpu_e2e import mode_overrides
from bench.shape_job import write_chat_rows
from pipeline.config import load_config
from pipeline.launch import detect_free_disk
from pipeline.metrics import read_metrics
from pipeline.weights import fingerprints_match
from stages.models.shapes import REAL_SHAPES, build_in_subprocess
from tests.gpu.test_pipeline_gpu import LOG_DIR, ROOT, _conveyor

GPU_SMALL = ROOT / "configs" / "gpu_small.yaml"
STEPS = 10
SHAPES = [s.strip() for s in os.environ.get("CONVEYOR_SHAPES", "qwen3_0.6b").split(",") if s.strip()]
PLACEMENTS = [p.strip() for p in os.environ.get("CONVEYOR_PLACEMENTS", "colocate,streaming").split(",") if p.strip()]
# A short job: 8 prompts x 8 samples x up to 64 tokens a step.
JOB = ["rollout.max_tokens=64", "train.prompts_per_step=8", "dataflow.prompts_per_micro_batch=4",
       "reward.function=tests.e2e.test_architectures:score_digit_share", "run.progress=false",
       "run.tensorboard=false", f"run.steps={STEPS}",
       # No resumable checkpoint: a 4B model's is 52 GiB, beyond a 64 GB device disk with
       # the checkpoint and the export beside it; the export is what this test loads.
       "train.resumable=false", *os.environ.get("CONVEYOR_SHAPE_OVERRIDES", "").split()]


def append_stage_timings(run_dir: Path, log: Path, per_file: int = 60) -> None:
    """Append to ``log`` the timing lines of each stage log of the run
    (``bench.common.stage_log_timings``), each prefixed with its file: they leave the
    machine with it."""
    lines = [f"{name}: {line}" for name, found in stage_log_timings(run_dir, per_file).items() for line in found]
    with log.open("a") as out:
        out.write("\n----- stage logs: timing lines -----\n" + "\n".join(lines) + "\n")


def append_failure_evidence(run_dir: Path, log: Path, lines: int = 40) -> None:
    """After a failed launch, append to ``log`` what it leaves on the machine only: the
    last ``lines`` of each stage log and the disk's free space (``tests/gpu/device.sh``
    lists the disk's largest files after each command)."""
    logs = sorted((run_dir / "logs").glob("*")) if (run_dir / "logs").is_dir() else []
    with log.open("a") as out:
        for path in logs:
            tail = path.read_bytes().decode(errors="replace").split("\n")[-lines:]
            out.write(f"\n----- {path.name}: last {lines} lines -----\n" + "\n".join(t[-400:] for t in tail) + "\n")
        out.write(f"\n----- disk: {detect_free_disk(run_dir) / 2**30:.1f} GiB free -----\n")


@pytest.fixture(scope="module")
def shape_runs(tmp_path_factory):
    """``run(name, placement)``: (run dir, summary) of that launch, run on first use; a
    launch that failed fails every later use with its first error, not run again (its
    log would be overwritten, and the call's time spent twice)."""
    runs: dict[tuple[str, str], tuple[Path, dict]] = {}
    failed: dict[tuple[str, str], str] = {}
    ckpts: dict[str, Path] = {}

    def run(name: str, placement: str) -> tuple[Path, dict]:
        if (name, placement) in failed:
            pytest.fail(f"{name} {placement} failed before: {failed[name, placement]}")
        if (name, placement) not in runs:
            if name not in ckpts:
                ckpts[name] = build_in_subprocess(name)  # this process holds no CUDA context
            root = tmp_path_factory.mktemp(f"{name}-{placement}")
            data = write_chat_rows(load_config(GPU_SMALL, JOB), 64, root / "prompts.jsonl")
            run_dir = root / "run"
            mode = mode_overrides("colocate") if placement == "colocate" else []
            log = LOG_DIR / f"shape-{name}-{placement}.log"
            done = _conveyor("launch", "--config", str(GPU_SMALL), f"model.path={ckpts[name]}", f"data.path={data}",
                             f"run.dir={run_dir}", *JOB, *mode, log=log)
            append_stage_timings(run_dir, log)
            if done.returncode != 0:
                append_failure_evidence(run_dir, log)
                failed[name, placement] = done.stderr[-4000:]
                pytest.fail(f"{name} {placement}: " + failed[name, placement])
            runs[name, placement] = run_dir, json.loads((run_dir / "summary.json").read_text())
        return runs[name, placement]

    return run


@pytest.fixture(scope="module", params=SHAPES)
def name(request) -> str:
    """The shape under test. A module-scoped parameter: pytest runs every test of one
    shape (its placements, then vLLM loading their checkpoints) before the next shape,
    so a time-limited call leaves whole shapes behind, not trains without their loads."""
    return request.param


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_real_shape_trains_with_every_update_verified(shape_runs, name, placement):
    run_dir, summary = shape_runs(name, placement)
    rows = read_metrics(run_dir / "metrics.jsonl")
    print(f"{name} {placement}: steps {summary['steps']}, reward {summary['reward_first']} -> "
          f"{summary['reward_last']}, step s {[round(r['time/step_s'], 2) for r in rows]}")
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["samples"]["reconciles"] and [r["step"] for r in rows] == list(range(STEPS))
    assert summary["trainer"]["weight_transport"] == "cuda_ipc"  # one GPU
    # A random-init model over a vocabulary ~1,700x its tokenizer's rarely samples a
    # token that decodes, so most groups score 0 alike: the loss is finite, not nonzero.
    assert all(math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"]) for r in rows)
    for worker, state in summary["served"].items():
        assert state["version"] == STEPS and state["verified"], (worker, state)
    assert summary["trainer"]["checkpoint"] == str(run_dir / "checkpoint")


def test_vllm_serves_each_exported_checkpoint(shape_runs, name):
    """One process loads every placement's exported checkpoint in vLLM, one after the
    other (``tests/e2e/test_architectures.py``'s loader: its live fingerprint and a short
    generation), and serves exactly the weights its run served last; the checkpoint keeps
    the published vocabulary and tie."""
    runs = {p: shape_runs(name, p) for p in PLACEMENTS}
    ckpts = [str(run_dir / "checkpoint") for run_dir, _ in runs.values()]
    out = subprocess.run([sys.executable, "-m", "tests.e2e.test_architectures", *ckpts], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    (LOG_DIR / f"shape-{name}-vllm.log").write_text(out.stdout + "\n----- stderr -----\n" + out.stderr)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("served: ")]
    served_by = json.loads(line.removeprefix("served: "))
    for placement, (run_dir, summary) in runs.items():
        ckpt = run_dir / "checkpoint"
        (served,) = [tuple(s["fingerprint"]) for s in summary["served"].values()]
        live, _ = served_by[str(ckpt)]
        assert fingerprints_match(tuple(live), served), (name, placement, live, served)
        config = json.loads((ckpt / "config.json").read_text())
        published = REAL_SHAPES[name].config
        assert config["vocab_size"] == published["vocab_size"], (name, placement)
        assert config["tie_word_embeddings"] == published["tie_word_embeddings"], (name, placement)
