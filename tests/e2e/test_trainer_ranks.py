"""Data-parallel trainer on CPU: two DeepSpeed ranks (gloo) against one, real engines.

Each engine lives in a Ray actor of its own (rank 0 of the two-rank world starts the
other rank as the trainer stage does), so the test process never joins a
torch.distributed world.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import ray

from pipeline.config import load_config
from pipeline.memory.splitting import split_rollout_batch_at
from tests.e2e.test_trainer_engine import make_batch
from tests.toy import TOY


def _config(tmp_path, ranks: int, zero_stage: int, *overrides: str):
    return load_config(None, [*TOY, f"run.dir={tmp_path}", "run.progress=false", f"train.num_ranks={ranks}",
                              f"train.zero_stage={zero_stage}", "train.lr=1e-3", "train.threads=1", *overrides])


@ray.remote(num_cpus=0)
class EngineHost:
    """Rank 0 of a trainer (with its other ranks when ``num_ranks`` > 1), as the stage holds it."""

    def __init__(self, cfg, rank_class=None) -> None:
        from stages.trainer.engine import build_trainer_engine
        from stages.trainer.ranks import TrainerRankActor, build_data_parallel_engine

        actor = ray.remote(num_cpus=0)(rank_class) if rank_class is not None else TrainerRankActor
        self.engine = (build_data_parallel_engine(cfg, [], rank_actor=actor) if cfg.train.num_ranks > 1
                       else build_trainer_engine(cfg, threads=1))

    def step(self, batches, grad_scale: float) -> dict:
        """Each batch (assigned advantages) trained with its scale, then one optimizer step;
        returns the merged metrics, the step's output and the weights after it."""
        metrics = [self.engine.train_micro_batch(b, s) for b, s in batches]
        out = self.engine.optimizer_step(grad_scale)
        return {"metrics": metrics, "step": out, "version": self.engine.version,
                "weights": {k: v.numpy() for k, v in self.engine.state_dict_for_sync().items()}}

    def on_policy(self, batch):
        import torch

        from stages.algorithms import assign_advantages
        from stages.models.logprobs import compute_completion_logprobs

        with torch.no_grad():
            logprobs = compute_completion_logprobs(self.engine.module, batch).numpy()
        batch = msgspec.structs.replace(batch, behaviour_logprobs=logprobs, policy_version=self.engine.version)
        return assign_advantages(batch, self.engine.algo)

    def save(self, path: str) -> str:
        from pathlib import Path

        self.engine.save_state(Path(path))
        return self.engine.weights_sha256()

    def load(self, path: str) -> str:
        from pathlib import Path

        self.engine.load_state(Path(path))
        return self.engine.weights_sha256()


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


@pytest.fixture(scope="module")
def single(ray_cluster, tmp_path_factory):
    return EngineHost.remote(_config(tmp_path_factory.mktemp("one"), 1, 0))


@pytest.mark.parametrize("zero_stage", [pytest.param(0, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3])
def test_two_ranks_update_the_weights_as_one_rank(ray_cluster, single, tmp_path, zero_stage):
    """A step of three micro-batches of 3, 1 and 4 groups (the 1-group one leaves rank 1
    a zero-weight filler; 3 groups split 2 + 1; token counts differ per group) under
    token-mean gives the same weights, loss and grad norm on two ranks as on one, under
    ZeRO 0 (1 across ranks), 2 and 3 (weights gathered from the partitions to compare).
    The two ranks pack their parts into passes of 200 tokens (rows of 13 to 31 tokens:
    the 4-group micro-batch makes 3 passes on rank 0 and 2 on rank 1, which adds a
    zero-weight one) where the one rank runs each micro-batch in one pass."""
    pair = EngineHost.remote(_config(tmp_path, 2, zero_stage, "train.pass_tokens=200"))
    batch = ray.get(single.on_policy.remote(make_batch(seed=11)))
    parts = [msgspec.structs.replace(p, batch_id=i) for i, p in enumerate(split_rollout_batch_at(batch, [3, 1, 4]))]
    from stages.trainer.stage import compute_micro_batch_scale, compute_step_grad_scale

    n = batch.num_samples
    work = [(p, compute_micro_batch_scale(p, n, "token-mean")) for p in parts]
    grad_scale = compute_step_grad_scale(parts, n, "token-mean")
    sha_one = ray.get(single.save.remote(str(tmp_path / "one-start")))
    try:
        one, two = ray.get([single.step.remote(work, grad_scale), pair.step.remote(work, grad_scale)])
    finally:
        ray.get(single.load.remote(str(tmp_path / "one-start")))
    assert ray.get(single.save.remote(str(tmp_path / "one-again"))) == sha_one
    assert one["version"] == two["version"] == 1
    # Same float32 math summed in a different order: equal to rounding (updates are ~1e-3).
    # The gradients agree to float rounding (grad norms to ~3e-8 relative). Adam's first
    # step moves a weight by about lr (1e-3) times the sign of its gradient, by less where
    # the gradient is near Adam's eps (1e-8), and there rounding in the order of the sums
    # shows: seen at most 2e-6 under ZeRO 0 and 2, and under ZeRO 3 5.7e-6 on 2 of 65,536
    # weights with AVX-512 kernels, 1.4e-5 with AVX2 ones. So: every weight within a tenth
    # of a step (a wrong gradient moves one by up to 2 lr) and all but a few within rounding.
    assert _max_diff(one["weights"], two["weights"]) <= 1e-4
    off = sum(int((np.abs(one["weights"][k] - two["weights"][k]) > 1e-6).sum()) for k in one["weights"])
    assert off <= 1e-3 * sum(w.size for w in one["weights"].values()), off
    # Since that first step is ~lr * sign(grad), the weights would match under a wrong
    # gradient scale too: the grad norm is what guards the scale.
    assert two["step"]["grad_norm"] == pytest.approx(one["step"]["grad_norm"], rel=1e-6)
    for m1, m2 in zip(one["metrics"], two["metrics"], strict=True):
        assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5, abs=1e-7)
        assert m2["num_samples"] == m1["num_samples"] and m2["num_tokens"] == m1["num_tokens"]
        assert m2["scale"] == pytest.approx(m1["scale"])
        assert m2["passes"] > m1["passes"] == 1 and m2["pass_real_tokens"] == m1["pass_real_tokens"]
    ray.kill(pair)


@pytest.mark.slow  # two ranks step as one (above) and fail as one (below) in every run
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_two_ranks_save_and_load_their_state(ray_cluster, single, tmp_path, zero_stage):
    """A two-rank state (rank 0's model, each rank's optimizer partition; under ZeRO 3
    each rank's parameter partition too) restores the weights and the next step exactly."""
    pair = EngineHost.remote(_config(tmp_path, 2, zero_stage))
    batch = ray.get(single.on_policy.remote(make_batch(seed=12)))
    work = [(batch, 1.0)]
    ray.get(pair.step.remote(work, 1.0))
    sha = ray.get(pair.save.remote(str(tmp_path / "state")))
    files = sorted(p.name for p in (tmp_path / "state").rglob("*.pt"))
    assert any("zero_pp_rank_1" in f for f in files) and any("zero_pp_rank_0" in f for f in files), files
    after = ray.get(pair.step.remote(work, 1.0))
    assert ray.get(pair.load.remote(str(tmp_path / "state"))) == sha
    again = ray.get(pair.step.remote(work, 1.0))
    assert again["version"] == after["version"] == 2
    assert _max_diff(after["weights"], again["weights"]) == 0.0
    ray.kill(pair)


@pytest.mark.slow  # two DeepSpeed ranks again; a rank's error stopping the others runs in every run with fakes
# (tests/ray_local/test_trainer_rank_errors.py)
def test_an_error_on_rank_1_stops_the_step_naming_it(ray_cluster, single, tmp_path):
    """Rank 1 raises in its part of a micro-batch (``FakeFailingTrainerRank``) while rank 0
    trains its own part into ZeRO 2's gradient reduction, which waits for rank 1: the
    call ends with the error of rank 1, not after the collective's timeout with one of
    rank 0's own."""
    from tests.ray_local.fakes import FakeFailingTrainerRank

    pair = EngineHost.remote(_config(tmp_path, 2, 2), FakeFailingTrainerRank)
    batch = ray.get(single.on_policy.remote(make_batch(seed=13)))
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(pair.step.remote([(batch, 1.0)], 1.0))
    assert "TrainerRankError: trainer rank 1 of 2 failed: ValueError: fake failure in train on rank 1" in str(
        info.value), str(info.value)[-2000:]
    ray.kill(pair)


@pytest.mark.slow  # 100 steps; the whole quickstart with two ranks: test_ranks_and_replicas_... (slow too)
def test_quickstart_learns_and_reconciles_with_two_trainer_ranks(ray_cluster, tmp_path):
    """The quickstart with train.num_ranks=2 on CPU, in lock-step: the stage starts rank 1
    beside it, learns (the mean reward of the last 20 of 100 steps above the first 10's),
    accounts for every sample and checkpoints each rank's optimizer partition."""
    from pipeline.launch import launch_run
    from pipeline.metrics import read_metrics
    from tests.e2e.test_pipeline import QUICKSTART, reward_rise

    steps = 100
    cfg = load_config(QUICKSTART, [f"run.dir={tmp_path}", "run.progress=false", "run.tensorboard=false",
                                   f"run.steps={steps}", "train.num_ranks=2", "train.checkpoint_every=0",
                                   # Lock-step: what it learns does not depend on how the 2
                                   # cores are shared with the rest of the suite.
                                   "dataflow.async_execution=false", "dataflow.max_staleness=0"])
    summary = launch_run(cfg)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    rewards = np.array([r["reward/mean"] for r in rows])
    # As the one-rank runs (test_pipeline.reward_rise): the task takes off after about 60
    # steps. Over 60, lock-step runs rose 0.14, 0.11 and once 0.04 between 20-step means,
    # too close to their noise (~0.03); over 100 one rose 0.023 -> 0.396 (first 10 steps,
    # last 20).
    first, last = reward_rise(rows)
    assert last > first + 0.15, rewards
    s = summary["samples"]
    assert s["reconciles"] and s["trained"] == steps * 8 * 8 and s["in_flight"] == 0
    assert summary["accounting"]["reconciles"]
    assert (tmp_path / "logs" / "trainer-rank1.log").exists()
    final = sorted((tmp_path / "checkpoints").glob("step-*"))[-1]
    assert {p.name.split("_mp_")[0] for p in final.rglob("zero_pp_rank_*")} == {"zero_pp_rank_0", "zero_pp_rank_1"}


@pytest.mark.slow  # about 75 s; two ranks step, save and fail in every run
def test_ranks_and_replicas_take_their_planned_gpus_on_a_cluster_that_has_two(tmp_path):
    """A Ray node started with ``--num-gpus=2`` (this machine has none, so every engine
    still computes on CPU, but Ray places and assigns GPUs as on a GPU machine) runs the
    quickstart colocated (``placement: colocate``, lock-step) with 2 trainer ranks and 2
    rollout replicas: the plan's placement group puts one rank and one replica on each
    GPU (Ray gives each its own ``CUDA_VISIBLE_DEVICES``), every step hands the GPUs from
    both replicas to the trainer (vLLM's CPU workers ignore the sleep itself, the
    protocol around it runs), and both replicas serve every version."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    from tests.e2e.test_multinode import ROOT, _free_port, _start_node, _stop_nodes

    port, head_tmp = _free_port(), tempfile.mkdtemp(prefix="cvg")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    steps = 8
    try:
        _start_node(head_tmp, "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=4",
                    "--num-gpus=2", "--include-dashboard=false", env=env)
        run_dir = tmp_path / "run"
        args = ["--config", "configs/quickstart.yaml", "train.num_ranks=2", "rollout.num_workers=2",
                "placement=colocate", "dataflow.async_execution=false", "dataflow.max_staleness=0"]
        status = subprocess.run([sys.executable, "-m", "pipeline.cli", "status", *args], cwd=ROOT, text=True,
                                env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}", "COLUMNS": "200"},
                                capture_output=True, timeout=600)
        assert status.returncode == 0, status.stderr[-3000:]
        assert "trainer rank 0 (0.33)" in status.stdout and "trainer rank 1 (0.5)" in status.stdout, status.stdout
        proc = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "launch", *args, f"run.dir={run_dir}", f"run.steps={steps}",
             "run.progress=false", "run.tensorboard=false"],
            cwd=ROOT, env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}, capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, proc.stderr[-4000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["samples"]["reconciles"] and summary["accounting"]["reconciles"]
        assert sorted(summary["trainer"]["rank_devices"]) == ["0", "1"], summary["trainer"]
        assert set(summary["served"]) == {"rollout:0", "rollout:1"}
        calls = summary["controller_calls"]
        assert calls["hand_gpus_to_trainer"] == steps and calls["confirm_asleep"] == 2 * steps, calls
        assert [r["sleeps"] for r in summary["rollout"]] == [steps, steps]
        for worker, state in summary["served"].items():
            assert state["version"] == summary["policy_version"] == steps and state["verified"], (worker, state)
    finally:
        _stop_nodes([head_tmp, f":{port}"])
        shutil.rmtree(head_tmp, ignore_errors=True)
