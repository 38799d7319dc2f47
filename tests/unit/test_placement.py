"""Placement plans: auto rules for 0/1/2/8 GPUs, explicit GPU lists, and refusals."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.config import ConfigError, decode_config
from pipeline.memory.admission import ModelShape, layer_saved_bytes
from pipeline.placement import (
    OWN_GPU_FRACTION,
    PlacementError,
    check_offload_host_memory,
    check_plan,
    check_resources,
    colocated_startup_fraction,
    count_sync_slots,
    engines_per_gpu,
    estimate_colocated_fraction,
    estimate_critic_pass_bytes,
    estimate_pass_bytes,
    estimate_sync_ring_bytes,
    estimate_trainer_bytes_per_param,
    is_manual,
    plan_placement,
    size_job_kv_cache,
)

STAGES = ["source", "rollout", "reward", "reference", "trainer"]
GIB = 1 << 30


def config(**sections):
    return decode_config({"model": {"dtype": "bfloat16"}, **sections})


def plan(cfg, gpus, params=500_000_000, gpu_bytes=80 * GIB, stages=STAGES):
    p = plan_placement(cfg, stages, gpus, num_params=params, gpu_bytes=gpu_bytes)
    check_plan(cfg, p)
    return p


def test_no_gpu_keeps_every_stage_on_cpu():
    p = plan(config(), 0)
    assert all(not s.gpus and s.num_gpus == 0 for s in p.stages.values())
    assert p.bundles == 0 and p.rollout_memory_fraction is None


def test_one_gpu_is_shared_and_vllm_gets_what_trainer_and_reference_leave():
    p = plan(config(), 1)
    for name in ("rollout", "reference", "trainer"):
        assert p.stages[name].gpus == (0,) and p.stages[name].share == (pytest.approx(1 / 3),)
    assert p.stages["reward"].gpus == () and p.stages["source"].gpus == ()
    # trainer 0.5e9 x 20 B = 10e9, reference 0.5e9 x 2 B = 1e9, and the weight sync's two
    # cuda_ipc copies of the served weights 2 x 0.5e9 x 2 B = 2e9: 1 - 13e9 / (80 x 2^30) - 0.1 = 0.74868
    assert p.rollout_memory_fraction == 0.749
    assert estimate_colocated_fraction(500_000_000, "bfloat16", 80 * GIB, with_reference=False) == pytest.approx(
        1 - 10e9 / (80 * GIB) - 0.1)
    # 11e9 B / 2^30 = 10.24 GiB; 2e9 B = 1.86 GiB
    assert any("~10.2 GiB resident + weight sync buffers ~1.9 GiB (cuda_ipc, 2 copies) of 80 GiB" in n
               for n in p.notes), p.notes


def test_the_weight_sync_ring_is_planned_one_copy_colocated_and_none_across_gpus():
    """On one GPU the trainer's weights reach vLLM by cuda_ipc, through a ring of whole
    copies on the trainer's GPU that the plan reserves: two streaming (an engine may still
    load version k while the trainer writes k+1), one colocated (every worker has slept,
    and so stopped reading, before the trainer writes the next); with the rollout on a GPU
    of its own the weights travel by shm and the plan reserves none. The rollout's dtype
    sizes a copy."""
    streaming, colocated = config(), config(**COLOCATE)
    assert (count_sync_slots(streaming), count_sync_slots(colocated)) == (2, 1)
    assert estimate_sync_ring_bytes(streaming, 500_000_000) == 2 * 500_000_000 * 2
    assert estimate_sync_ring_bytes(colocated, 500_000_000) == 500_000_000 * 2
    assert estimate_sync_ring_bytes(config(rollout={"dtype": "float32"}), 500_000_000) == 2 * 500_000_000 * 4
    p = plan(colocated, 1)
    assert any("weight sync buffers ~0.9 GiB (cuda_ipc, 1 copy)" in n for n in p.notes), p.notes
    assert not any("weight sync" in n for n in plan(config(), 2).notes)


def test_trainer_bytes_per_param_count_fp32_accumulation():
    # bf16 / fp16: weights 2 + 16-bit gradients 2 + fp32 master 4 + fp32 gradients
    # (accumulators with train.grad_accum_dtype: fp32) 4 + Adam m and v 4 + 4 = 20.
    assert estimate_trainer_bytes_per_param("bfloat16") == 20
    assert estimate_trainer_bytes_per_param("float16") == 20
    # float32: weights 4 + gradients 4 + Adam 8 = 16 (no master copy).
    assert estimate_trainer_bytes_per_param("float32") == 16


def test_two_gpus_split_rollout_from_trainer_and_reference():
    p = plan(config(), 2)
    assert p.stages["rollout"].gpus == (0,) and p.stages["rollout"].share == (1.0,)
    assert p.stages["trainer"].gpus == (1,) and p.stages["reference"].gpus == (1,)
    assert p.stages["trainer"].share == (0.5,)
    assert p.rollout_memory_fraction == OWN_GPU_FRACTION
    assert p.bundles == 2 and not p.notes


def test_eight_gpus_give_rollout_replicas_their_own_gpus_and_report_idle_ones():
    p = plan(config(rollout={"num_workers": 2}), 8)
    assert p.stages["rollout"].gpus == (0, 1)
    assert p.stages["trainer"].gpus == (2,)
    assert p.notes == ["5 GPU(s) idle: raise rollout.num_workers to use them for generation"]


def test_explicit_gpu_lists_share_by_actor_count():
    cfg = config(rollout={"num_workers": 2}, placement={"rollout": [0, 1], "trainer": [1], "reference": [1]})
    p = plan(cfg, 2)
    assert p.stages["rollout"].gpus == (0, 1)
    # GPU 0: rollout replica 0 alone; GPU 1: rollout replica 1, trainer, reference.
    assert p.stages["rollout"].share == (1.0, pytest.approx(1 / 3))
    assert p.stages["trainer"].share == (pytest.approx(1 / 3),)
    # rollout shares GPU 1 with both: vLLM's share is planned as on one GPU.
    assert p.rollout_memory_fraction == 0.772


def test_a_stage_not_named_in_an_explicit_plan_gets_no_gpu():
    p = plan(config(placement={"rollout": [0], "trainer": [1]}), 2)
    assert p.stages["reference"].gpus == () and p.stages["reference"].num_gpus == 0


@pytest.mark.parametrize(
    ("sections", "gpus", "message"),
    [
        ({"placement": {"rollout": [2]}}, 2, "placement.rollout: GPU 2 does not exist: the cluster has 2"),
        ({"placement": {"rollout": {"gpus": [0], "exclusive": True}, "trainer": [0]}}, 1,
         "placement.rollout: GPU 0 is exclusive to rollout but trainer also use"),
        # TP 2 rollout (2 GPUs of its own) + 1 trainer rank = 3 GPUs
        ({"rollout": {"tensor_parallel_size": 2}}, 2, "rollout.tensor_parallel_size: 1 replica(s) x 2 GPUs"),
        ({"rollout": {"tensor_parallel_size": 2}, "placement": {"rollout": [0]}}, 2,
         "placement.rollout: rollout.tensor_parallel_size 2 needs 2 GPUs in each rollout actor"),
        ({"placement": {"trainer": [0, 1]}}, 2, "placement.trainer: 2 GPU(s) [0, 1] for train.num_ranks 1"),
        ({"train": {"num_ranks": 2}, "placement": {"trainer": [1, 1]}}, 2,
         "placement.trainer: GPUs [1, 1] put two trainer ranks on one GPU"),
        ({"train": {"num_ranks": 2}}, 1, "train.num_ranks: 2 ranks need 2 GPUs"),
        ({"train": {"num_ranks": 3}}, 2, "train.num_ranks: 3 ranks need 3 GPUs"),
        # 2 rollout replicas x TP 2 + 2 ranks = 6 GPUs > 4
        ({"train": {"num_ranks": 2}, "rollout": {"num_workers": 2, "tensor_parallel_size": 2}}, 4,
         "make 6, the cluster has 4"),
        ({"placement": {"rollout": {"num_gpus": 1}, "trainer": {"num_gpus": 1}}}, 1, "ask Ray for 2 GPU(s) by count"),
        ({"rollout": {"gpu_memory_utilization": 0.9}}, 1, "0.9 does not fit beside trainer and reference on GPU [0]"),
    ],
)
def test_impossible_plans_are_refused_naming_stage_and_gpu(sections, gpus, message):
    with pytest.raises(PlacementError, match=re.escape(message)):
        plan(config(**sections), gpus)


def test_a_model_too_large_for_one_shared_gpu_is_refused():
    # 7e9 x (20 + 2) B = 154e9 > 80 GiB: vLLM would get less than nothing.
    with pytest.raises(PlacementError, match="does not fit trainer, reference and vLLM on one GPU of 80 GiB"):
        plan(config(), 1, params=7_000_000_000)


def test_gradient_checkpointing_shrinks_the_trainer_pass_and_is_advised_when_a_plan_does_not_fit():
    # Qwen3-0.6B's shape: a 16k-token pass keeps ~1.1 MB a token for backward without it.
    shape = ModelShape(num_layers=28, num_kv_heads=8, head_dim=128, hidden_size=1024, vocab_size=151_936,
                       num_params=596_049_920, dtype_bytes=2, intermediate_size=3072)
    plain, _ = estimate_pass_bytes(config(train={"pass_tokens": 16384}), shape, with_reference=False)
    kept, _ = estimate_pass_bytes(config(train={"pass_tokens": 16384, "gradient_checkpointing": True}), shape,
                                  with_reference=False)
    assert kept < plain / 4
    with pytest.raises(PlacementError, match=re.escape("set train.gradient_checkpointing=true")):
        plan(config(), 1, params=7_000_000_000)
    with pytest.raises(PlacementError) as refused:
        plan(config(train={"gradient_checkpointing": True}), 1, params=7_000_000_000)
    assert "gradient_checkpointing" not in str(refused.value)


def test_ppos_critic_on_the_rollout_gpu_is_reserved_with_its_pass():
    # Qwen3-0.6B's shape in bf16; the critic trains a copy of the policy with a scalar head.
    shape = ModelShape(num_layers=28, num_kv_heads=8, head_dim=128, hidden_size=1024, vocab_size=151_936,
                       num_params=596_049_920, dtype_bytes=2, intermediate_size=3072, num_heads=16, qk_norm=True)
    ppo = config(algorithm={"name": "ppo"})
    # critic.chunk_size 16 samples of 512 + 512 tokens, every layer kept for backward, one
    # value a token (float32 logits, their log-softmax and gradient: 12 bytes).
    tokens = 16 * 1024
    assert estimate_critic_pass_bytes(ppo, shape) == tokens * (28 * layer_saved_bytes(shape) + 12)
    # At the default passes trainer (34.7 GiB), critic (32.4), reference and their states
    # leave vLLM nothing on 80 GiB: refused before launch, naming the critic's key.
    with pytest.raises(PlacementError, match="does not fit trainer, reference, critic and vLLM.*critic.chunk_size"):
        plan_placement(ppo, [*STAGES, "critic"], 1, num_params=shape.num_params, gpu_bytes=80 * GIB, shape=shape)
    # Recomputing blocks in backward shrinks both passes: it fits.
    ppo = config(algorithm={"name": "ppo"}, train={"gradient_checkpointing": True})
    without = plan_placement(ppo, STAGES, 1, num_params=shape.num_params, gpu_bytes=80 * GIB, shape=shape)
    with_critic = plan_placement(ppo, [*STAGES, "critic"], 1, num_params=shape.num_params, gpu_bytes=80 * GIB,
                                 shape=shape)
    assert tuple(with_critic.stages["critic"].gpus) == (0,)
    critic = shape.num_params * estimate_trainer_bytes_per_param("bfloat16") + estimate_critic_pass_bytes(ppo, shape)
    assert with_critic.rollout_memory_fraction == pytest.approx(
        without.rollout_memory_fraction - critic / (80 * GIB), abs=1e-3)
    assert any("trainer + reference + critic on rollout GPU [0]" in n and "critic pass ~" in n
               for n in with_critic.notes), with_critic.notes


def test_placement_config_forms():
    assert config(placement="auto").placement == config().placement
    cfg = config(placement={"rollout": [0, 1], "trainer": {"gpus": [1], "num_cpus": 2}})
    assert cfg.placement.rollout.gpus == [0, 1] and cfg.placement.trainer.num_cpus == 2
    with pytest.raises(ConfigError, match="placement: expected 'auto', 'colocate' or a mapping"):
        config(placement="manual")
    with pytest.raises(ConfigError, match=r"placement.rollout.gpus\[0\]: expected int >= 0"):
        config(placement={"rollout": [-1]})


def test_a_share_equal_to_the_planned_one_is_accepted():
    # A tiny model on 140 GiB: the plan gives vLLM its own-GPU cap, 0.9 (1 - ~0 - 0.1 in
    # floating point is 0.8999...); the same value asked for explicitly must pass.
    p = plan(config(rollout={"gpu_memory_utilization": 0.9}), 1, params=300_000, gpu_bytes=140 * GIB)
    assert p.rollout_memory_fraction == 0.9


def test_rollout_replicas_sharing_a_gpu_split_vllms_share():
    # 2 GPUs, 4 replicas: min(4, 2 - 1) = 1 rollout GPU holds all four engines: 0.9 / 4.
    p = plan(config(rollout={"num_workers": 4}), 2)
    assert p.stages["rollout"].gpus == (0, 0, 0, 0) and p.rollout_memory_fraction == 0.225
    # One GPU, two engines beside trainer, reference and the sync's copies: 0.74868 / 2 = 0.374.
    assert plan(config(rollout={"num_workers": 2}), 1).rollout_memory_fraction == 0.374
    with pytest.raises(PlacementError, match=r"2 vLLM engines on one GPU .* would ask for 1.20"):
        plan(config(rollout={"num_workers": 2, "gpu_memory_utilization": 0.6}), 2)


def test_trainer_ranks_get_a_gpu_each_beside_the_rollout_when_gpus_allow():
    # 3 GPUs, 2 ranks: rollout on GPU 0 alone, rank 0 (with the reference) on 1, rank 1 on 2.
    p = plan(config(train={"num_ranks": 2}), 3)
    assert p.stages["rollout"].gpus == (0,) and p.stages["rollout"].share == (1.0,)
    assert p.stages["trainer"].gpus == (1, 2) and p.stages["trainer"].share == (0.5, 1.0)
    assert p.stages["reference"].gpus == (1,)
    assert p.rollout_memory_fraction == OWN_GPU_FRACTION and p.bundles == 3 and not p.notes


def test_ranks_taking_every_gpu_share_them_with_the_rollout():
    # 2 GPUs, 2 ranks, 2 replicas: GPU 0 holds rollout 0, rank 0 and the reference (1/3 each),
    # GPU 1 rollout 1 and rank 1 (1/2 each); vLLM's share as on one GPU beside both.
    p = plan(config(train={"num_ranks": 2}, rollout={"num_workers": 2}), 2)
    assert p.stages["rollout"].gpus == (0, 1) and p.stages["trainer"].gpus == (0, 1)
    assert p.stages["trainer"].share == (pytest.approx(1 / 3), 0.5)
    assert p.rollout_memory_fraction == 0.772
    assert "train.num_ranks 2 takes every GPU: rollout replicas share the trainer ranks' GPUs" in p.notes


def test_tensor_parallel_rollout_takes_gpus_of_its_own_by_count():
    # 3 GPUs: the TP 2 replica asks Ray for 2 GPUs; trainer and reference use bundle 0.
    p = plan(config(rollout={"tensor_parallel_size": 2}), 3)
    assert p.stages["rollout"].gpus == () and p.stages["rollout"].num_gpus == 2
    assert p.stages["trainer"].gpus == (0,) and p.bundles == 1
    assert p.rollout_memory_fraction == OWN_GPU_FRACTION
    manual = plan(config(rollout={"tensor_parallel_size": 2}, placement={"rollout": {"num_gpus": 2}, "trainer": [0]}), 3)
    assert manual.stages["rollout"].num_gpus == 2
    # Without GPUs the replica's vLLM workers run on CPU cores: nothing to place.
    assert plan(config(rollout={"tensor_parallel_size": 2}), 0).stages["rollout"].num_gpus == 0


def test_custom_resources_reach_the_graph_nodes_and_reserved_names_are_refused():
    from pipeline.launch import build_dataflow

    cfg = config(placement={"rollout": {"resources": {"node_b": 0.01}}, "trainer": {"resources": {"node_a": 0.5}}})
    assert not is_manual(cfg)  # custom resources pick nodes, not GPUs: the planner still decides
    df = build_dataflow(cfg)
    assert df.nodes["rollout"].resources == {"node_b": 0.01} and df.nodes["trainer"].resources == {"node_a": 0.5}
    assert df.nodes["reward"].resources == {}
    with pytest.raises(ConfigError, match=r"placement.rollout: resources: \['GPU'\] are not custom resources"):
        config(placement={"rollout": {"resources": {"GPU": 1}}})
    with pytest.raises(ConfigError, match=r"placement.trainer.resources\[...\]: expected float > 0.0"):
        config(placement={"trainer": {"resources": {"node_a": 0}}})


def test_status_lists_trainer_ranks_and_replicas_per_gpu_and_the_stage_gets_its_ranks_gpus():
    from pipeline.launch import build_dataflow
    from pipeline.status import list_gpu_actors

    cfg = config(train={"num_ranks": 2}, rollout={"num_workers": 2})
    p = plan(cfg, 2)
    df = build_dataflow(cfg, p)
    # Rank 0 runs in the stage actor (bundle 0); rank 1 is started by it in bundle 1.
    assert df.nodes["trainer"].gpu_bundles == (0, 1) and df.nodes["trainer"].replicas == 1
    assert df.nodes["trainer"].kwargs["rank_gpus"] == [(1, 0.5)]
    assert list_gpu_actors(cfg, df) == [
        ("0", ["rollout:0 (0.33)", "reference (0.33)", "trainer rank 0 (0.33)"]),
        ("1", ["rollout:1 (0.5)", "trainer rank 1 (0.5)"]),
    ]
    tp = config(rollout={"tensor_parallel_size": 2})
    rows = list_gpu_actors(tp, build_dataflow(tp, plan(tp, 3)))
    assert rows[-1] == ("2 by count", ["rollout x 1, tensor parallel 2"])


COLOCATE = {"placement": "colocate", "dataflow": {"async_execution": False, "max_staleness": 0}}


def test_colocate_puts_every_gpu_stage_on_the_ranks_gpus_and_turns_on_vllm_sleep_mode():
    cfg = config(**COLOCATE)
    assert cfg.placement.mode == "colocate" and cfg.rollout.sleep_mode
    assert not config().rollout.sleep_mode
    p = plan(cfg, 2)  # one rank: GPU 1 idle, everything with rank 0
    assert p.stages["rollout"].gpus == p.stages["trainer"].gpus == p.stages["reference"].gpus == (0,)
    assert p.rollout_memory_fraction == 0.772  # sized as on a shared GPU
    assert any("1 GPU(s) idle" in n for n in p.notes) and any("vLLM sleeps" in n for n in p.notes)
    p = plan(config(**COLOCATE, train={"num_ranks": 2}, rollout={"num_workers": 2}), 2)
    assert p.stages["rollout"].gpus == (0, 1) and p.stages["trainer"].gpus == (0, 1)
    assert p.stages["reference"].gpus == (0,)
    with pytest.raises(PlacementError, match="placement: colocate time-shares GPUs .* the cluster has none"):
        plan(cfg, 0)
    with pytest.raises(PlacementError, match="train.num_ranks: 2 ranks need 2 GPUs"):
        plan(config(**COLOCATE, train={"num_ranks": 2}), 1)


@pytest.mark.parametrize(("sections", "message"), [
    ({"placement": "colocate"}, "dataflow.async_execution: expected false"),
    ({**COLOCATE, "dataflow": {"async_execution": False, "max_staleness": 1}}, "dataflow.max_staleness: expected 0"),
    ({**COLOCATE, "train": {"sync_interval": 2}}, "train.sync_interval: expected 1"),
    ({**COLOCATE, "rollout": {"backend": "hf"}}, "rollout.backend: expected 'vllm'"),
    ({**COLOCATE, "rollout": {"tensor_parallel_size": 2}}, "rollout.tensor_parallel_size: expected 1"),
    ({**COLOCATE, "placement": {"mode": "colocate", "rollout": [0]}},
     "placement.rollout: expected no gpus or num_gpus (colocate plans the GPUs itself)"),
    ({**COLOCATE, "train": {"ppo_mini_batches": 2, "prompts_per_step": 8}}, "train.ppo_mini_batches: expected 1"),
    ({**COLOCATE, "algorithm": {"name": "dpo"}}, "algorithm.name: expected an on-policy algorithm (with 'dpo'"),
    ({**COLOCATE, "algorithm": {"name": "ppo"}}, "algorithm.name: 'ppo' trains a critic"),
    ({**COLOCATE, "reward": {"sources": {"rm": {"kind": "model", "path": "rm"}, "rule": {}}}},
     "reward.sources: a reward model does not give the GPU back"),
])
def test_colocate_refuses_what_cannot_take_turns_on_a_gpu(sections, message):
    with pytest.raises(ConfigError, match=re.escape(message) + ".* with placement: colocate"):
        config(**sections)


ON_POLICY_NO_LOGPROBS = {"rollout": {"logprobs": False}, "dataflow": {"async_execution": False, "max_staleness": 0}}


@pytest.mark.parametrize(("sections", "message"), [
    ({"rollout": {"logprobs": False}}, "dataflow.max_staleness: expected 0"),
    ({**ON_POLICY_NO_LOGPROBS, "train": {"sync_interval": 2}}, "train.sync_interval: expected 1"),
    ({**ON_POLICY_NO_LOGPROBS, "train": {"ppo_epochs": 2}}, "train.ppo_epochs: expected 1"),
    ({**ON_POLICY_NO_LOGPROBS, "train": {"ppo_mini_batches": 2, "prompts_per_step": 8}},
     "train.ppo_mini_batches: expected 1"),
    ({**ON_POLICY_NO_LOGPROBS, "algorithm": {"off_policy": "truncate"}}, "algorithm.off_policy: expected 'off'"),
    ({**ON_POLICY_NO_LOGPROBS, "algorithm": {"use_kl_in_reward": True}}, "algorithm.use_kl_in_reward: expected false"),
])
def test_no_sampler_logprobs_is_refused_wherever_training_is_not_on_policy(sections, message):
    with pytest.raises(ConfigError, match=re.escape(message) + ".* with rollout.logprobs: false"):
        config(**sections)


def test_no_sampler_logprobs_is_taken_on_policy_colocated_or_not():
    assert not config(**ON_POLICY_NO_LOGPROBS).rollout.logprobs
    assert not config(**COLOCATE, rollout={"logprobs": False}).rollout.logprobs
    assert config().rollout.logprobs  # on by default, also where it could be off


def test_a_colocated_rollout_is_not_restarted_where_a_shared_one_is():
    from pipeline.launch import build_dataflow

    restarts = config().run.max_restarts
    assert restarts > 0 and build_dataflow(config()).nodes["rollout"].max_restarts == restarts
    colocated = build_dataflow(config(**COLOCATE)).nodes
    assert colocated["rollout"].max_restarts == 0 and colocated["reward"].max_restarts == restarts


def test_a_colocated_engine_gets_the_kv_cache_its_sequences_need():
    # gpu_small's shape: 16 layers x 16 KV heads x 64 dims x K and V x 2 bytes = 64 KiB a token.
    shape = ModelShape(num_layers=16, num_kv_heads=16, head_dim=64, hidden_size=1024, vocab_size=64,
                       num_params=268_700_000, dtype_bytes=2)
    job = {**COLOCATE, "train": {"prompts_per_step": 32},
           "dataflow": {**COLOCATE["dataflow"], "prompts_per_micro_batch": 8},
           "rollout": {"n": 8, "max_tokens": 128, "max_inflight": 4}, "data": {"max_prompt_len": 64}}
    kv, max_len, note = size_job_kv_cache(config(**job), shape)
    # 4 micro-batches in flight x 8 prompts x 8 samples = 256 sequences of 64 + 128 tokens,
    # 64 KiB each, x 1.25; no sequence longer than 192 tokens.
    assert kv == 256 * 192 * 65536 * 5 // 4 == int(3.75 * GIB) and max_len == 192
    assert "3.75 GiB (256 sequences x 192 tokens" in note and "rollout.kv_cache_gib" in note
    # Fewer micro-batches in flight than a step has: only those are generating at once.
    fewer = {**job, "rollout": {**job["rollout"], "max_inflight": 1}}
    assert size_job_kv_cache(config(**fewer), shape)[0] == kv // 4
    # Fewer micro-batches in a step than may be in flight: only the step's.
    step = {**job, "train": {"prompts_per_step": 16}}
    assert size_job_kv_cache(config(**step), shape)[0] == kv // 2
    # Replicas share one queue: any of them may hold max_inflight micro-batches at once.
    two = {**job, "rollout": {**job["rollout"], "num_workers": 2}, "train": {"prompts_per_step": 32, "num_ranks": 2}}
    assert size_job_kv_cache(config(**two), shape)[0] == kv
    # Not planned: shared placement, a size, share or length the user chose, tool turns of no bound.
    assert size_job_kv_cache(config(), shape) is None
    tools = {"functions": "builtin"}
    for rollout in ({"kv_cache_gib": 2.0}, {"gpu_memory_utilization": 0.3}, {"max_model_len": 512}, {"tools": tools}):
        assert size_job_kv_cache(config(**{**job, "rollout": {**job["rollout"], **rollout}}), shape) is None


def test_rollout_replicas_sharing_a_gpu_get_a_planned_cache_and_start_up_ask(monkeypatch):
    """Two vLLM engines on one GPU start together; sized from their shares, each would
    count the other's cache, allocated meanwhile, as its own memory (vLLM profiles the
    whole device) and be left none. Each gets the job's cache and asks at start-up for
    its weights, that cache and the reserve; one replica a GPU keeps vLLM's sizing."""
    import pipeline.launch as launch

    shape = ModelShape(num_layers=16, num_kv_heads=16, head_dim=64, hidden_size=1024, vocab_size=64,
                       num_params=268_700_000, dtype_bytes=2)
    gpu = 140 * GIB
    monkeypatch.setattr(launch, "read_model_shape", lambda cfg: shape)
    job = {"train": {"prompts_per_step": 32}, "dataflow": {"prompts_per_micro_batch": 8},
           "rollout": {"n": 8, "max_tokens": 128, "max_inflight": 4, "num_workers": 2},
           "data": {"max_prompt_len": 64}}
    # Two GPUs, one rank: both replicas on GPU 0 at 0.45 each, the trainer on GPU 1.
    monkeypatch.setattr(launch, "detect_gpus", lambda address: (2, gpu))
    cfg, p = launch.plan_run_placement(config(**job))
    assert p.stages["rollout"].gpus == (0, 0) and engines_per_gpu(p) == 2
    # Streaming: a worker may hold max_inflight micro-batches at once, across steps:
    # 4 x 8 x 8 = 256 sequences of 192 tokens, 64 KiB a token, x1.25 = 3.75 GiB.
    assert cfg.rollout.kv_cache_gib == 3.75 and cfg.rollout.max_model_len == 192
    assert cfg.rollout.gpu_memory_utilization == p.rollout_memory_fraction == 0.131
    assert any(n.startswith("2 vLLM engines on one GPU: vLLM's KV cache sized to the job, 3.75 GiB") for n in p.notes)
    assert any("2 vLLM engines on one GPU: vLLM asks for 0.131 of the GPU at start-up" in n for n in p.notes)
    # Lock-step: only a step's micro-batches generate at once (4 here, max_inflight 8).
    sync = {**job, "rollout": {**job["rollout"], "max_inflight": 8},
            "dataflow": {"prompts_per_micro_batch": 8, "async_execution": False, "max_staleness": 0}}
    assert launch.plan_run_placement(config(**sync))[0].rollout.kv_cache_gib == 3.75
    # The user's size or share stays theirs.
    cfg, _ = launch.plan_run_placement(config(**{**job, "rollout": {**job["rollout"], "kv_cache_gib": 2.0}}))
    assert cfg.rollout.kv_cache_gib == 2.0 and cfg.rollout.gpu_memory_utilization == 0.118
    cfg, _ = launch.plan_run_placement(config(**{**job, "rollout": {**job["rollout"],
                                                                     "gpu_memory_utilization": 0.3}}))
    assert cfg.rollout.kv_cache_gib is None and cfg.rollout.gpu_memory_utilization == 0.3
    # Three GPUs: a replica a GPU, vLLM sizes its cache from its share as before.
    monkeypatch.setattr(launch, "detect_gpus", lambda address: (3, gpu))
    cfg, p = launch.plan_run_placement(config(**job))
    assert engines_per_gpu(p) == 1 and cfg.rollout.kv_cache_gib is None
    assert cfg.rollout.gpu_memory_utilization == p.rollout_memory_fraction == 0.9


def test_a_colocated_engine_asks_vllm_at_start_up_only_for_its_weights_and_cache(monkeypatch):
    """vLLM reads gpu_memory_utilization, once the KV cache has a size, only to check the
    free memory at start-up: the launch asks for the weights, the cache (planned or the
    user's) and the reserve, not the whole share the trainer leaves, so a GPU that
    something else also holds can still start it. A share the user chose stays theirs; a
    cache too large for the share is reported."""
    import pipeline.launch as launch

    shape = ModelShape(num_layers=16, num_kv_heads=16, head_dim=64, hidden_size=1024, vocab_size=64,
                       num_params=268_700_000, dtype_bytes=2)
    gpu = 140 * GIB
    monkeypatch.setattr(launch, "detect_gpus", lambda address: (1, gpu))
    monkeypatch.setattr(launch, "detect_free_gpu_bytes", lambda address: 0)
    monkeypatch.setattr(launch, "read_model_shape", lambda cfg: shape)
    job = {**COLOCATE, "train": {"prompts_per_step": 32},
           "dataflow": {**COLOCATE["dataflow"], "prompts_per_micro_batch": 8},
           "rollout": {"n": 8, "max_tokens": 128, "max_inflight": 4}, "data": {"max_prompt_len": 64}}
    # What the trainer and the reference hold at rest, and the reference's largest pass
    # (16 samples of 64 + 128 tokens each, the 64-token vocabulary's logits a small part):
    # the trainer's runs while vLLM sleeps, so vLLM's share need not leave room for it; and
    # the weight sync's one cuda_ipc copy of the weights (0.50 GiB).
    trainer_pass, reference_pass = estimate_pass_bytes(config(**job), shape, with_reference=True)
    ring = estimate_sync_ring_bytes(config(**job), shape.num_params)
    share = estimate_colocated_fraction(shape.num_params, "bfloat16", gpu, with_reference=True,
                                        pass_bytes=reference_pass + ring)
    assert ring == shape.num_params * 2
    assert trainer_pass > 0 and share == pytest.approx(0.861 - (reference_pass + ring) / gpu, abs=1e-3)
    cfg, p = launch.plan_run_placement(config(**job))
    # 0.50 GiB of weights + the 3.75 GiB cache, over 140 GiB, + 0.1: 0.1304, rounded up.
    assert cfg.rollout.kv_cache_gib == 3.75 and p.rollout_memory_fraction == cfg.rollout.gpu_memory_utilization == 0.131
    assert any("vLLM asks for 0.131 of the GPU at start-up" in n and f"{round(share, 3):g}" in n for n in p.notes)
    assert colocated_startup_fraction(shape, int(3.75 * GIB), gpu) == 0.131
    # The user's cache size: (0.50 + 2) / 140 + 0.1 = 0.1179, rounded up.
    cfg, p = launch.plan_run_placement(config(**{**job, "rollout": {**job["rollout"], "kv_cache_gib": 2.0}}))
    assert cfg.rollout.gpu_memory_utilization == p.rollout_memory_fraction == 0.118
    # The user's share: kept as chosen.
    cfg, p = launch.plan_run_placement(config(**{**job, "rollout": {**job["rollout"], "gpu_memory_utilization": 0.5}}))
    assert cfg.rollout.gpu_memory_utilization == p.rollout_memory_fraction == 0.5
    assert not any("at start-up" in n for n in p.notes)
    # A cache larger than the trainer leaves: 120 GiB needs (0.50 + 120) / 140 + 0.1 =
    # 0.961 of the GPU, over the share left: the share stays, and the plan says vLLM may
    # run out of memory while awake.
    cfg, p = launch.plan_run_placement(config(**{**job, "rollout": {**job["rollout"], "kv_cache_gib": 120.0}}))
    assert cfg.rollout.gpu_memory_utilization == round(share, 3)
    assert any(f"more than its share {round(share, 3):g}" in n for n in p.notes), p.notes
    # Streaming on one GPU (placement auto): the share leaves room for the trainer's pass
    # too; the job's cache fits in it, so it is sized to the job as well (4 micro-batches
    # in flight: 3.75 GiB) and vLLM asks for 0.131 at start-up.
    streaming = estimate_colocated_fraction(shape.num_params, "bfloat16", gpu, with_reference=True,
                                            pass_bytes=trainer_pass + reference_pass + 2 * ring)
    cfg, p = launch.plan_run_placement(config(rollout=job["rollout"], train=job["train"], data=job["data"],
                                              dataflow={"prompts_per_micro_batch": 8}))
    assert p.split == "streaming" and cfg.rollout.kv_cache_gib == 3.75
    assert cfg.rollout.gpu_memory_utilization == 0.131 < round(streaming, 3)
    # With the share the user chose, vLLM sizes its cache from it.
    cfg, p = launch.plan_run_placement(config(rollout={**job["rollout"], "gpu_memory_utilization": 0.5}))
    assert p.split is None and cfg.rollout.gpu_memory_utilization == 0.5 and cfg.rollout.kv_cache_gib is None


def test_the_eight_gpu_config_plans_two_tp2_replicas_beside_four_zero3_ranks():
    """configs/gpu_8.yaml (issue 17's run) on 8 GPUs, and halved on 4 as its header says;
    unhalved on 4 it is refused before anything starts."""
    from pathlib import Path

    from pipeline.config import load_config

    path = Path(__file__).parents[2] / "configs" / "gpu_8.yaml"
    h, layers, inter = 2048, 28, 5632
    params = layers * (4 * h * h + 3 * h * inter)  # 1.44e9: the 1-3B the run asks for
    cfg = load_config(path)
    assert (cfg.rollout.num_workers, cfg.rollout.tensor_parallel_size, cfg.train.num_ranks,
            cfg.train.zero_stage) == (2, 2, 4, 3)
    assert cfg.rollout.max_tokens >= 512 and cfg.rollout.n == 8 and cfg.dataflow.max_staleness == 1
    p = plan(cfg, 8, params=params, gpu_bytes=141 * GIB)
    assert p.stages["trainer"].gpus == (0, 1, 2, 3) and p.stages["reference"].gpus == (0,)
    # Each replica takes 2 GPUs by count, outside the ranks' 4 bundles: 4 + 2 x 2 = 8.
    assert p.stages["rollout"].gpus == () and p.stages["rollout"].num_gpus == 2.0 and p.bundles == 4
    assert p.rollout_memory_fraction == OWN_GPU_FRACTION
    half = load_config(path, ["rollout.num_workers=1", "train.num_ranks=2"])
    p = plan(half, 4, params=params, gpu_bytes=141 * GIB)
    assert p.stages["trainer"].gpus == (0, 1) and p.stages["rollout"].num_gpus == 2.0 and p.bundles == 2
    with pytest.raises(PlacementError, match=r"rollout.tensor_parallel_size: 2 replica\(s\) x 2 GPUs .* make 8, "
                                             r"the cluster has 4"):
        plan(cfg, 4, params=params, gpu_bytes=141 * GIB)


@pytest.mark.parametrize(
    ("sections", "nodes", "message"),
    [
        ({"placement": {"rollout": {"num_cpus": 64}}}, [{"CPU": 2.0}],
         "placement.rollout.num_cpus: 64 CPUs for each rollout actor, but the largest node of the cluster has 2"),
        # 3 CPUs for one actor: the cluster has 4, but no node has 3.
        ({"placement": {"trainer": {"num_cpus": 3}}}, [{"CPU": 2.0}, {"CPU": 2.0}],
         "placement.trainer.num_cpus: 3 CPUs for each trainer actor, but the largest node of the cluster has 2"),
        # 2 rollout replicas and 2 trainer ranks of 1 CPU each: 4 on a 3-CPU cluster.
        ({"rollout": {"num_workers": 2}, "train": {"num_ranks": 2},
          "placement": {"rollout": {"num_cpus": 1}, "trainer": {"num_cpus": 1}}}, [{"CPU": 2.0}, {"CPU": 1.0}],
         "placement: the stages ask for 4 CPUs in all (rollout 2, trainer 2), but the cluster has 3"),
        ({"placement": {"rollout": {"resources": {"node_b": 0.01}}}}, [{"CPU": 2.0}],
         "placement.rollout.resources: 'node_b' 0.01 for each rollout actor, but no node offers it"),
        ({"placement": {"reference": {"resources": {"node_b": 0.5}}}}, [{"CPU": 2.0}, {"CPU": 2.0, "node_b": 0.25}],
         "placement.reference.resources: 'node_b' 0.5 for each reference actor, but at most 0.25 on a node"),
    ],
)
def test_cpus_and_custom_resources_the_cluster_cannot_grant_are_refused(sections, nodes, message):
    with pytest.raises(PlacementError, match=re.escape(message)):
        check_resources(config(**sections), STAGES, nodes)


def test_what_the_cluster_can_grant_is_accepted():
    check_resources(config(), STAGES, [{"CPU": 1.0}])  # the default asks for no CPUs
    two_nodes = [{"CPU": 2.0}, {"CPU": 2.0, "node_b": 1.0}]
    check_resources(config(placement={"rollout": {"num_cpus": 2, "resources": {"node_b": 0.01}},
                                      "trainer": {"num_cpus": 2}}), STAGES, two_nodes)


def test_launch_refuses_more_cpus_than_this_host_has_before_ray_starts(tmp_path, capsys):
    import os

    import ray

    from pipeline.cli import main

    quickstart = Path(__file__).parents[2] / "configs" / "quickstart.yaml"
    asked = 2 * (os.cpu_count() or 1)
    joined = ray.is_initialized()  # the whole suite in one process: the Ray tiers' cluster
    code = main(["launch", "--config", str(quickstart), f"run.dir={tmp_path / 'run'}",
                 f"placement.rollout.num_cpus={asked}"])
    assert code == 2
    assert f"placement.rollout.num_cpus: {asked} CPUs for each rollout actor" in capsys.readouterr().err
    assert ray.is_initialized() == joined and not (tmp_path / "run").exists()  # no Ray started, no run dir


QWEN3_4B = ModelShape(num_layers=36, num_kv_heads=8, head_dim=128, hidden_size=2560, vocab_size=151_936,
                      num_params=4_022_000_000, dtype_bytes=2, intermediate_size=9728)


def test_an_offloaded_optimizer_leaves_the_gpu_the_16_bit_weights_and_gradients():
    """A 4B full fine-tune on one 80 GiB GPU: refused with the optimizer on the GPU (20
    bytes a parameter, 75 GiB), with advice naming train.offload_optimizer; offloaded (8
    bytes a parameter with fp32 accumulators, 4 with bf16 ones) and its blocks
    recomputed, vLLM gets a share; the host memory it pins is counted and refused where
    the machine has less."""
    assert estimate_trainer_bytes_per_param("bfloat16", offload_optimizer=True) == 8  # fp32 accumulators stay
    assert estimate_trainer_bytes_per_param("bfloat16", offload_optimizer=True, fp32_accum=False) == 4
    assert estimate_trainer_bytes_per_param("float32", offload_optimizer=True) == 8
    job = {"train": {"gradient_checkpointing": True}, "rollout": {"max_tokens": 64}}
    with pytest.raises(PlacementError, match=r"set train\.offload_optimizer=true"):
        plan_placement(config(**job), STAGES, 1, gpu_bytes=80 * GIB, shape=QWEN3_4B)
    # fp32 accumulators (the default) stay on the GPU: 8 B x 4.02e9 = 30.0 GiB + the
    # reference's 7.5 leave vLLM 7.7 GiB; bf16 ones, 22.7.
    fp32_accum = plan_placement(config(train={**job["train"], "offload_optimizer": True}, rollout=job["rollout"]),
                                STAGES, 1, gpu_bytes=80 * GIB, shape=QWEN3_4B)
    assert any("~37.5 GiB resident" in n for n in fp32_accum.notes), fp32_accum.notes
    assert fp32_accum.rollout_memory_fraction < 0.1
    offloaded = config(train={**job["train"], "offload_optimizer": True, "grad_accum_dtype": "bf16"},
                       rollout=job["rollout"])
    p = plan_placement(offloaded, STAGES, 1, gpu_bytes=80 * GIB, shape=QWEN3_4B)
    assert p.rollout_memory_fraction > 0.25  # ~22.7 GiB for vLLM; 75 GiB of optimizer left none
    # resident: the trainer 4 B x 4.02e9 = 15.0 GiB + the reference 2 B x 4.02e9 = 7.5 GiB.
    assert any("~22.5 GiB resident" in n and "optimizer offloaded to host memory" in n for n in p.notes), p.notes
    # 16 bytes a parameter: 59.9 GiB of host memory, fits 128 GiB, not 64.
    note = check_offload_host_memory(offloaded, QWEN3_4B, with_critic=False, host_bytes=128 * GIB)
    assert "~59.9 GiB pinned" in note
    with pytest.raises(PlacementError, match=r"train\.offload_optimizer=false"):
        check_offload_host_memory(offloaded, QWEN3_4B, with_critic=False, host_bytes=64 * GIB)
    assert check_offload_host_memory(config(**job), QWEN3_4B, with_critic=False, host_bytes=64 * GIB) == ""
