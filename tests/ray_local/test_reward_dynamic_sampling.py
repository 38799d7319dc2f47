"""The reward stage with dynamic sampling and the soft overlong penalty, against the real
controller actor: a constant group is dropped and counted in the ledger at once, the
kept group leaves in a whole micro-batch carrying the dropped prompt to the trainer."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import ray

from pipeline.config import decode_config
from pipeline.controller import ControllerActor, ControllerClient
from pipeline.types import Prompt, RolloutBatch
from stages.rewards.reward import RewardStage
from stages.rewards.shaping import ZERO_VARIANCE

SCORE = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
        "    return float(solution_str == ground_truth)\n"


def _batch(completions: list[str], lens: list[int]) -> RolloutBatch:
    n = len(completions)
    ids = np.ones((n, 2), np.int32)
    return RolloutBatch(
        batch_id=4, step=0, prompts=[Prompt(prompt_id=f"p{k}", text="1=", ground_truth="1", index=k) for k in range(2)],
        group_size=2, sample_ids=[f"s{i}" for i in range(n)], prompt_ids=ids, prompt_lens=np.ones(n, np.int32),
        completion_ids=ids, completion_lens=np.array(lens, np.int32), completions=completions,
        behaviour_logprobs=np.zeros((n, 2), np.float32), token_versions=np.zeros((n, 2), np.int32), policy_version=0,
        finish_reasons=["stop" if k == 1 else "length" for k in lens],
    )


def test_reward_stage_drops_constant_groups_and_penalises_overlong(ray_cluster, tmp_path):
    path = tmp_path / "score.py"
    path.write_text(SCORE)
    cfg = decode_config({"reward": {"function": f"{path}:compute_score"}, "rollout": {"n": 2, "max_tokens": 2},
                         "train": {"prompts_per_step": 2}, "dataflow": {"prompts_per_micro_batch": 2},
                         "algorithm": {"drop_zero_variance_groups": True, "overlong_buffer_len": 1}})
    controller = ControllerActor.remote(target_prompts=4, prompts_per_step=2)
    log = SimpleNamespace(warning=lambda *a, **k: None, debug=lambda *a, **k: None)
    stage = RewardStage()

    client = ControllerClient(controller)

    async def go():
        await controller.admit_prompts.remote(2)
        await stage.setup(SimpleNamespace(config=cfg, log=log, controller=client))
        # group 0: "1", "1" in 1 token -> rewards 1, 1: constant, dropped.
        # group 1: "1" in 1 token -> 1; "2" in 2 tokens -> 0 - (2 - (2 - 1)) / 1 = -1: kept.
        out = await stage.process(_batch(["1", "1", "1", "2"], [1, 1, 1, 2]))
        rest = await stage.finish()
        await client.settle()  # the drop is posted; the stage shell settles before its run returns
        return out, rest

    out, rest = asyncio.run(go())
    assert out == []  # one kept group of the two a micro-batch holds
    summary = ray.get(controller.summary.remote())["ledger"]
    assert summary["dropped"] == {ZERO_VARIANCE: 1} and summary["in_flight"] == 1 and summary["reconciles"]
    (batch,) = rest
    assert [p.index for p in batch.prompts] == [1] and batch.dropped_prompts == {ZERO_VARIANCE: [0]}
    assert batch.rewards.tolist() == [1.0, -1.0]
    assert batch.reward_extras["overlong_penalty"] == [0.0, -1.0]
    assert stage.status()["groups_dropped_zero_variance"] == 1
