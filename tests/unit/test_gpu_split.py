"""One GPU under ``placement: auto``: streaming or colocate, from the memory plan and the
device's measured free memory, faked here (``FakeGpu``). Figures derived in comments.

The job: gpu_small's shape (268.7M parameters, bf16, 16 layers x 16 KV heads x 64 dims
x K and V x 2 bytes = 64 KiB of KV cache a token), 32 prompts a step in micro-batches of
8, n = 8, 64 + 128 tokens a sequence. In GiB: trainer 268.7e6 x 20 B = 5.005 resident,
reference 0.500, vLLM's weights 0.500; the largest passes (``estimate_pass_bytes``:
16,384 tokens of the trainer's and of the reference's) 14.501 and 0.907; the
job's KV cache 4 micro-batches x 8 x 8 = 256 sequences x 192 tokens x 64 KiB x 1.25 =
3.75 (lock-step too: a step has 4 micro-batches). On a GPU of T GiB with O GiB held by
others, with the 10% reserve on each side:
- streaming: vLLM has 0.9 T - (5.005 + 0.500 + 14.501 + 0.907) - O = 0.9 T - 20.913 - O
  and needs 0.500 + 3.75 + 0.1 T = 4.250 + 0.1 T;
- colocate: the trainer's pass runs while vLLM sleeps: 0.9 T - 6.412 - O for the same need.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import pipeline.launch as launch
from pipeline.config import ConfigError, decode_config
from pipeline.gpu_split import choose_gpu_split, to_colocate
from pipeline.memory.admission import ModelShape

GIB = 1 << 30
SHAPE = ModelShape(num_layers=16, num_kv_heads=16, head_dim=64, hidden_size=1024, vocab_size=64,
                   num_params=268_700_000, dtype_bytes=2)
JOB = {"model": {"dtype": "bfloat16"}, "train": {"prompts_per_step": 32}, "dataflow": {"prompts_per_micro_batch": 8},
       "rollout": {"n": 8, "max_tokens": 128, "max_inflight": 4}, "data": {"max_prompt_len": 64}}
STAGES = ["source", "rollout", "reward", "reference", "trainer"]


def job(**sections):
    return decode_config({**JOB, **{k: {**JOB.get(k, {}), **v} for k, v in sections.items()}})


class FakeGpu:
    """One GPU of ``total_gib``, ``free_gib`` of it free (None: ``nvidia-smi`` says nothing),
    and ``disk_free_gib`` free where run.dir is, in place of the launch's detection; the
    model's shape read as ``SHAPE``."""

    def __init__(self, monkeypatch, total_gib: float, free_gib: float | None = None, disk_free_gib: float = 1024) -> None:
        monkeypatch.setattr(launch, "detect_gpus", lambda address: (1, int(total_gib * GIB)))
        monkeypatch.setattr(launch, "detect_free_disk", lambda run_dir: int(disk_free_gib * GIB))
        monkeypatch.setattr(launch, "detect_free_gpu_bytes",
                            lambda address: 0 if free_gib is None else int(free_gib * GIB))
        monkeypatch.setattr(launch, "read_model_shape", lambda cfg: SHAPE)


def test_streaming_when_the_jobs_cache_fits_beside_the_trainer_and_its_cache_is_sized_to_the_job(monkeypatch):
    FakeGpu(monkeypatch, 40)
    cfg, plan = launch.plan_run_placement(job())
    # The trainer and reference hold 20.913 GiB at their largest passes, and the weight
    # sync's two cuda_ipc copies of the weights 2 x 0.5005 = 1.001 GiB: 21.914 GiB. Taking
    # turns 6.412 GiB, and one copy: 6.912 GiB.
    # 0.9 x 40 - 21.914 = 14.1 GiB left; needed 4.250 + 4.0 = 8.25.
    assert plan.split == "streaming" and cfg.dataflow.async_execution
    assert plan.notes[0] == (
        "placement auto: streaming on one GPU: vLLM's weights 0.50 GiB + KV cache 3.75 GiB (256 sequences x 192 "
        "tokens) + 10% reserve = 8.3 GiB fit in the 14.1 GiB the trainer and reference leave beside their largest "
        "passes")
    # The cache is the job's, not the 15.1 GiB left: vLLM asks at start-up for (0.500 +
    # 3.75) / 40 + 0.1 = 0.2063 -> 0.207 of the GPU, not the share 1 - 21.914 / 40 - 0.1 = 0.352.
    assert cfg.rollout.kv_cache_gib == 3.75 and cfg.rollout.max_model_len == 192
    assert cfg.rollout.gpu_memory_utilization == plan.rollout_memory_fraction == 0.207
    assert any(n.startswith("streaming on one GPU: vLLM asks for 0.207 of the GPU at start-up") and "0.352" in n
               for n in plan.notes), plan.notes


def test_colocate_when_only_taking_turns_leaves_the_cache_room(monkeypatch):
    FakeGpu(monkeypatch, 24)
    cfg, plan = launch.plan_run_placement(job(dataflow={"max_staleness": "auto"}))
    # Streaming: 0.9 x 24 - 21.914 < 0 GiB for 4.250 + 2.4 = 6.65; taking turns:
    # 0.9 x 24 - 6.912 = 14.7 GiB for the same 6.65. With gradient checkpointing the
    # trainer's pass would be 16,384 x (1.5 x 59,392 + 16 x 1024 x 2) B = 1.86 GiB, and
    # streaming would have 21.6 - 9.27 = 12.3 GiB: the note says which key gets it.
    assert plan.split == "colocate"
    assert plan.notes[0] == (
        "placement auto: colocate on one GPU: streaming does not fit (the job needs 6.7 GiB (weights 0.50 GiB + KV "
        "cache 3.75 GiB (256 sequences x 192 tokens) + 10% reserve), the trainer and reference leave 0.0 GiB beside "
        "their largest passes; set train.gradient_checkpointing=true to stream: the trainer's pass 14.5 -> 1.9 GiB); "
        "taking turns vLLM has 14.7 GiB for 6.7 GiB (weights 0.50 GiB + KV cache 3.75 GiB "
        "(256 sequences x 192 tokens) + 10% reserve); lock-step and on-policy (dataflow.async_execution true -> "
        "false, dataflow.max_staleness auto -> 0)")
    assert cfg.placement.mode == "colocate" and cfg.rollout.sleep_mode and not cfg.dataflow.async_execution
    assert cfg.dataflow.max_staleness == 0 and not cfg.auto_staleness
    # Colocated, vLLM's share leaves room for the reference's pass (and the one copy) only:
    # 1 - 6.912 / 24 - 0.1 = 0.612; it asks at start-up for (0.500 + 3.75) / 24 + 0.1 = 0.2771 -> 0.278.
    assert cfg.rollout.kv_cache_gib == 3.75 and cfg.rollout.gpu_memory_utilization == 0.278
    assert any("vLLM asks for 0.278 of the GPU at start-up" in n and "0.612" in n for n in plan.notes), plan.notes


def test_memory_other_processes_hold_counts(monkeypatch):
    # 40 GiB with 14 held by others: streaming has 14.086 - 14 = 0.1 GiB for 8.25; taking
    # turns 36 - 6.912 - 14 = 15.1 GiB, and the trainer's turn (5.005 + 0.500 resident,
    # passes 14.501 + 0.907, one copy 0.500: 21.413 GiB) fits the 36 - 14 = 22 GiB.
    FakeGpu(monkeypatch, 40, free_gib=26)
    cfg, plan = launch.plan_run_placement(job())
    assert plan.split == "colocate" and cfg.placement.mode == "colocate"
    assert "leave 0.1 GiB beside their largest passes; 14.0 GiB held by other processes" in plan.notes[0]
    assert "taking turns vLLM has 15.1 GiB for 8.3 GiB" in plan.notes[0]
    # Already lock-step and on-policy: nothing else changes.
    _, plan = launch.plan_run_placement(job(dataflow={"async_execution": False, "max_staleness": 0}))
    assert plan.split == "colocate" and plan.notes[0].endswith("lock-step and on-policy")


def test_a_colocated_trainer_turn_that_does_not_fit_is_refused_before_launch(monkeypatch):
    """Taking turns, the trainer steps while vLLM sleeps: what it holds then (resident,
    passes, the weight sync's copy) must fit the GPU, not only vLLM's share beside it."""
    from pipeline.placement import PlacementError

    # 21 GiB: vLLM's turn fits (18.9 - 6.912 = 12.0 GiB for 4.25 + 2.1), the trainer's
    # (21.413 GiB, above) does not fit 18.9 GiB; checkpointing alone makes it
    # 21.413 - 14.501 + 1.86 = 8.8 GiB, offloading alone (8 B a parameter with fp32
    # accumulators) 21.413 - 5.005 + 2.002 = 18.4.
    FakeGpu(monkeypatch, 21)
    choice = choose_gpu_split(job(), STAGES, 1, SHAPE, 21 * GIB)
    assert choice.mode == "streaming" and not choice.sized
    turn = ("colocate does not fit either: the trainer's turn needs ~21.4 GiB (resident 5.5 + trainer pass 14.5 "
            "+ reference pass 0.9 + weight sync buffers 0.5 GiB), one GPU has 18.9 GiB with the 10% reserve; "
            "set train.gradient_checkpointing=true (the trainer's pass 14.5 -> 1.9 GiB), set "
            "train.offload_optimizer=true (resident 5.5 -> 2.5 GiB), lower train.pass_tokens")
    assert turn in choice.reason
    # Nothing fits then: refused before any actor starts, naming the keys.
    with pytest.raises(PlacementError, match="set train.gradient_checkpointing=true"):
        launch.plan_run_placement(job())
    # Chosen by the user, colocate is refused for the trainer's turn itself.
    with pytest.raises(PlacementError, match=r"placement: colocate: the trainer's turn needs ~21.4 GiB"):
        launch.plan_run_placement(job(placement={"mode": "colocate"},
                                      dataflow={"async_execution": False, "max_staleness": 0}))
    # Offloading alone: the turn fits (18.4 GiB) and the plan colocates.
    cfg, plan = launch.plan_run_placement(job(train={"offload_optimizer": True}))
    assert plan.split == "colocate" and cfg.placement.mode == "colocate"


def test_an_offloaded_trainer_is_told_bf16_accumulation_would_stream():
    # Offloaded, fp32 accumulators: 8 B x 268.7e6 = 2.002 GiB + the reference's 0.500; bf16
    # ones: 1.001 + 0.500. On 28 GiB streaming has 25.2 - (2.502 + 14.501 + 0.907 + 1.001) =
    # 6.29 GiB for 4.250 + 2.8 = 7.05 with fp32 accumulators, 7.29 with bf16 ones.
    offloaded = {"offload_optimizer": True}
    choice = choose_gpu_split(job(train=offloaded), STAGES, 1, SHAPE, 28 * GIB)
    assert choice.mode == "colocate"
    assert ("set train.grad_accum_dtype=bf16 to stream: the offloaded trainer keeps 1.0 GiB less of fp32 "
            "accumulators on the GPU") in choice.reason
    choice = choose_gpu_split(job(train={**offloaded, "grad_accum_dtype": "bf16"}), STAGES, 1, SHAPE, 28 * GIB)
    assert choice.mode == "streaming" and choice.sized
    # Not offloaded, the accumulators are a fifth of the optimizer's bytes: not named.
    assert "grad_accum_dtype" not in choose_gpu_split(job(), STAGES, 1, SHAPE, 28 * GIB).reason


def test_streaming_with_what_is_left_where_colocate_cannot_run_or_fit():
    # PPO trains a critic, which does not give the GPU back while vLLM generates.
    ppo = job(algorithm={"name": "ppo"})
    choice = choose_gpu_split(ppo, [*STAGES, "critic"], 1, SHAPE, 24 * GIB)
    assert choice.mode == "streaming" and not choice.sized
    assert choice.reason.startswith("placement auto: streaming on one GPU with the memory left, KV cache from "
                                    "vLLM's share (fewer sequences at once): the job needs 6.7 GiB")
    assert "; colocate is not possible: algorithm.name: 'ppo' trains a critic" in choice.reason
    # 12 GiB: streaming has 10.8 - 21.914 < 0, taking turns 10.8 - 6.912 = 3.9 GiB for 4.250 + 1.2 = 5.45.
    choice = choose_gpu_split(job(), STAGES, 1, SHAPE, 12 * GIB)
    assert choice.mode == "streaming" and choice.reason.endswith("colocate does not fit either: 5.5 GiB for 3.9 GiB")
    assert "the trainer and reference leave 0.0 GiB" in choice.reason
    # Checkpointing would leave 10.8 - 9.27 = 1.5 GiB for 5.45: not named.
    assert "gradient_checkpointing" not in choice.reason


def test_with_gradient_checkpointing_set_the_same_job_streams(monkeypatch):
    # The 24 GiB GPU that colocates above: 21.6 - 9.27 = 12.3 GiB for 6.65.
    FakeGpu(monkeypatch, 24)
    cfg, plan = launch.plan_run_placement(job(train={"gradient_checkpointing": True}))
    assert plan.split == "streaming" and cfg.dataflow.async_execution
    assert "fit in the 12.3 GiB the trainer and reference leave" in plan.notes[0], plan.notes[0]


@pytest.mark.parametrize(("sections", "stages", "gpus"), [
    ({}, STAGES, 0),  # CPU
    ({}, STAGES, 2),  # disaggregated
    ({"placement": "colocate", "dataflow": {"async_execution": False, "max_staleness": 0}}, STAGES, 1),
    ({"placement": {"rollout": [0], "trainer": [0]}}, STAGES, 1),  # placed by hand
    ({"rollout": {"kv_cache_gib": 2.0}}, STAGES, 1),  # the user sized vLLM
    ({"rollout": {"gpu_memory_utilization": 0.3}}, STAGES, 1),
    ({"rollout": {"max_model_len": 512}}, STAGES, 1),
    ({"rollout": {"backend": "hf"}}, STAGES, 1),
    ({}, ["source", "reference", "trainer"], 1),  # nothing generates
])
def test_no_split_is_chosen_where_the_user_chose_it_or_there_is_no_one_gpu(sections, stages, gpus):
    raw = {**JOB, **sections}
    if "rollout" in sections:
        raw["rollout"] = {**JOB["rollout"], **sections["rollout"]}
    assert choose_gpu_split(decode_config(raw), stages, gpus, SHAPE, 24 * GIB) is None
    assert choose_gpu_split(job(), STAGES, 1, None, 24 * GIB) is None  # shape unknown
    assert choose_gpu_split(job(), STAGES, 1, SHAPE, 0) is None  # memory unknown


def test_to_colocate_changes_only_what_taking_turns_needs():
    cfg = to_colocate(job(train={"sync_interval": 2}, dataflow={"max_staleness": 1}))
    assert (cfg.placement.mode, cfg.dataflow.async_execution, cfg.dataflow.max_staleness, cfg.train.sync_interval,
            cfg.rollout.sleep_mode) == ("colocate", False, 0, 1, True)
    assert (cfg.rollout.n, cfg.train.prompts_per_step, cfg.data.max_prompt_len) == (8, 32, 64)


def test_status_prints_the_choice_and_its_reason(monkeypatch):
    from rich.console import Console

    from pipeline.status import render_plan

    FakeGpu(monkeypatch, 24)
    cfg, plan = launch.plan_run_placement(job())
    console = Console(width=400, record=True)
    console.print(render_plan(cfg, launch.build_dataflow(cfg, plan), plan))
    text = console.export_text()
    assert "sync mode, max_staleness 0" in text and "placement auto: colocate on one GPU: streaming does not fit" in text


def test_vllm_batches_at_most_what_the_job_has_in_flight(monkeypatch):
    FakeGpu(monkeypatch, 140)
    # Streaming: 4 micro-batches in flight x 8 prompts x n 8 = 256 (vLLM's own default on
    # a GPU of 70 GiB or more is 1,024).
    cfg, _ = launch.plan_run_placement(job())
    assert cfg.dataflow.async_execution and cfg.rollout.max_num_seqs == 256
    # Lock-step with 2 micro-batches a step: at most those 2 generate at once.
    cfg, _ = launch.plan_run_placement(job(train={"prompts_per_step": 16},
                                           dataflow={"async_execution": False, "max_staleness": 0}))
    assert cfg.rollout.max_num_seqs == 2 * 8 * 8
    # An evaluation generates beside training: 4 micro-batches x 8 prompts x (1 greedy + 4 samples).
    cfg, _ = launch.plan_run_placement(job(eval={"path": "eval.jsonl", "n": 4, "temperature": 1.0}))
    assert cfg.rollout.max_num_seqs == 256 + 4 * 8 * 5
    # The user's value stands; the HF backend has no such setting.
    cfg, _ = launch.plan_run_placement(job(rollout={"max_num_seqs": 512}))
    assert cfg.rollout.max_num_seqs == 512
    cfg, _ = launch.plan_run_placement(job(rollout={"backend": "hf"}))
    assert cfg.rollout.max_num_seqs is None


def test_a_run_whose_checkpoints_do_not_fit_the_disk_stops_before_launch(monkeypatch):
    from pipeline.config import ConfigError

    # 268.7M parameters in bf16: a resumable checkpoint holds 2 + 12 bytes each (3.503
    # GiB), the exported model 2 (0.500 GiB). 100 steps, one every 50 and one at the
    # end: 3 written, the newest 2 kept and a third while it is written.
    FakeGpu(monkeypatch, 140, disk_free_gib=8)
    with pytest.raises(ConfigError) as info:
        launch.plan_run_placement(job(run={"steps": 100}))
    assert str(info.value) == (
        "disk: the run writes up to 11.0 GiB under run.dir (3 resumable checkpoints of 3.5 GiB (weights and the "
        "optimizer's state) and the exported model, 0.5 GiB); 8.0 GiB free: it does not fit; set run.dir (a larger "
        "disk), train.keep_checkpoints=1, train.resumable=false (no resumable checkpoints), train.save_checkpoint=false "
        "(no exported model)")
    # Keeping one: 2 x 3.503 + 0.500 = 7.5 GiB fit, with a note (more than half the disk).
    _, plan = launch.plan_run_placement(job(run={"steps": 100}, train={"keep_checkpoints": 1}))
    (disk,) = [n for n in plan.notes if n.startswith("disk:")]
    assert disk.startswith("disk: the run writes up to 7.5 GiB under run.dir (2 resumable checkpoints") and \
        disk.endswith("; 8.0 GiB free")
    # No resumable checkpoints: the exported model alone, no note; a run of 10 steps writes one.
    _, plan = launch.plan_run_placement(job(run={"steps": 100}, train={"resumable": False}))
    assert not any(n.startswith("disk:") for n in plan.notes)
    FakeGpu(monkeypatch, 140, disk_free_gib=3.9)
    with pytest.raises(ConfigError, match=r"1 resumable checkpoint of 3.5 GiB .* set run.dir \(a larger disk\), "
                                          r"train.resumable=false"):
        launch.plan_run_placement(job(run={"steps": 10}))


def test_a_resumed_run_counts_the_checkpoints_it_finds_as_already_written(monkeypatch, tmp_path):
    from pipeline.config import ConfigError

    # Two checkpoints of 3.503 GiB are already off the 5 GiB free; a third while the
    # next is written and the export: 4.0 GiB more, which fit. A fresh run would need 11.0.
    FakeGpu(monkeypatch, 140, disk_free_gib=5)
    for name in ("step-00000050", "step-00000060"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    with pytest.raises(ConfigError, match="up to 11.0 GiB"):
        launch.plan_run_placement(job(run={"steps": 100, "dir": str(tmp_path)}))
    _, plan = launch.plan_run_placement(job(run={"steps": 100, "dir": str(tmp_path), "resume_from": str(tmp_path)}))
    (disk,) = [n for n in plan.notes if n.startswith("disk:")]
    assert disk.startswith("disk: the run writes up to 4.0 GiB under run.dir (1 resumable checkpoint of 3.5 GiB")


def test_a_recordings_trainer_states_count_on_their_disk(monkeypatch):
    from pipeline.config import ConfigError

    # Recording the trainer's input keeps its state at the start and every 10 versions
    # for replay, none removed: 11 of 3.503 GiB over 100 steps.
    FakeGpu(monkeypatch, 140, disk_free_gib=30)
    recorded = {"run": {"steps": 100}, "train": {"resumable": False, "save_checkpoint": False},
                "record": {"edges": ["reference->trainer"], "state_every": 10}}
    with pytest.raises(ConfigError) as info:
        launch.plan_run_placement(job(**recorded))
    assert str(info.value) == (
        "disk: the run writes up to 38.5 GiB under run.dir (11 trainer states of 3.5 GiB for replay); 30.0 GiB free: "
        "it does not fit; set run.dir (a larger disk), train.resumable=false (no resumable checkpoints), "
        "record.state_every (larger: fewer trainer states)")
    FakeGpu(monkeypatch, 140, disk_free_gib=18)  # 3 states fit, in more than half of it
    _, plan = launch.plan_run_placement(job(**{**recorded, "record": {**recorded["record"], "state_every": 50}}))
    (disk,) = [n for n in plan.notes if n.startswith("disk:")]
    assert disk.startswith("disk: the run writes up to 10.5 GiB under run.dir (3 trainer states")


def test_a_recording_on_another_disk_is_checked_against_that_disk():
    from pipeline.config import ConfigError
    from pipeline.placement import check_run_disk

    cfg = job(run={"steps": 10}, record={"edges": ["reference->trainer"], "state_every": 10, "dir": "/elsewhere"})
    # run.dir: one checkpoint and the export, 4.0 GiB of 100 free; record.dir: 2 states, 7.0 GiB of 5 free.
    with pytest.raises(ConfigError, match=r"up to 7.0 GiB under record.dir \(2 trainer states of 3.5 GiB for "
                                          r"replay\); 5.0 GiB free: it does not fit; set record.dir \(a larger disk\), "
                                          r"record.state_every"):
        check_run_disk(cfg, SHAPE, 100 * GIB, recording_free_bytes=5 * GIB)
    assert check_run_disk(cfg, SHAPE, 100 * GIB, recording_free_bytes=100 * GIB) == ""
    # On one disk the two add up: 11.0 GiB of 20 free, more than half.
    assert check_run_disk(cfg, SHAPE, 20 * GIB).startswith("disk: the run writes up to 11.0 GiB under run.dir")


def test_auto_resume_needs_resumable_checkpoints():
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="run.auto_resume: resumes from the newest checkpoint, and "
                                          "train.resumable: false writes none"):
        job(run={"auto_resume": True}, train={"resumable": False})


def test_placement_mps_is_decided_from_the_one_gpu_plan_before_any_actor_starts(monkeypatch):
    """Streaming shares the GPU, so ``auto`` starts MPS where the driver's tool is found;
    colocate takes turns and does not; ``true`` without the tool stops the launch (exit 2)
    naming the key. (The decision's other cases: tests/unit/test_mps.py.)"""
    from pipeline import mps

    FakeGpu(monkeypatch, 40)
    monkeypatch.delenv(mps.PIPE_ENV, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(mps, "DEFAULT_PIPE_DIR", Path("/nonexistent/nvidia-mps"))
    monkeypatch.setattr(mps.shutil, "which", lambda name: f"/usr/bin/{name}")
    _, plan = launch.plan_run_placement(job())  # the default, auto
    assert plan.split == "streaming" and plan.mps == "start"
    assert "placement.mps: stages that share a GPU run their kernels side by side (NVIDIA MPS)" in plan.notes
    assert launch.plan_run_placement(job(placement={"mps": False}))[1].mps is None
    FakeGpu(monkeypatch, 24)  # the plan colocates (test_colocate_when_only_taking_turns_leaves_the_cache_room)
    _, plan = launch.plan_run_placement(job(dataflow={"max_staleness": "auto"}, placement={"mps": "auto"}))
    assert plan.split == "colocate" and plan.mps is None
    assert any(n.startswith("placement.mps: not used: colocated stages take turns") for n in plan.notes), plan.notes
    FakeGpu(monkeypatch, 40)
    monkeypatch.setattr(mps.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="placement.mps: true, but nvidia-cuda-mps-control is not on PATH"):
        launch.plan_run_placement(job(placement={"mps": True}))


def test_stages_beside_a_vllm_that_profiles_its_cache_set_up_after_it(monkeypatch):
    """Where the plan gives vLLM no cache size (the job's cache at 16,384 tokens a sample,
    256 x 16,448 x 64 KiB x 1.25 = 321 GiB, fits no GPU), vLLM measures its cache from the
    device's free memory while it starts: the trainer and the reference beside it set up
    once the rollout is up. Where it is sized (the plan's or the user's), all start at once."""
    FakeGpu(monkeypatch, 80)
    cfg, plan = launch.plan_run_placement(job(rollout={"max_tokens": 16384}))
    assert plan.split == "streaming" and cfg.rollout.kv_cache_gib is None
    df = launch.build_dataflow(cfg, plan)
    assert {n: node.setup_after for n, node in df.nodes.items() if node.setup_after} == {
        "reference": ("rollout",), "trainer": ("rollout",)}
    assert df.setup_waves() == [["source", "rollout", "reward"], ["reference", "trainer"]]
    assert ("reference, trainer set up after the rollout: vLLM sizes its KV cache from the GPU's free memory while "
            "it starts") in plan.notes[-1] and "rollout.kv_cache_gib" in plan.notes[-1]
    for sized in (job(), job(rollout={"max_tokens": 16384, "kv_cache_gib": 20.0})):
        cfg, plan = launch.plan_run_placement(sized)
        df = launch.build_dataflow(cfg, plan)
        assert cfg.rollout.kv_cache_gib is not None and len(df.setup_waves()) == 1
        assert not any("set up after the rollout" in n for n in plan.notes)
