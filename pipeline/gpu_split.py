"""One GPU under ``placement: auto``: stream beside the trainer or take turns, chosen before launch.

Streaming keeps vLLM awake beside the trainer and overlaps generation with training;
colocated, vLLM sleeps while the trainer steps (lock-step, on-policy). ``choose_gpu_split``
reads the memory plan (``pipeline/placement.py``'s estimates, the device's free memory):
- streaming, when vLLM's weights, the KV cache the job's concurrency needs (every
  sequence a worker can have generating at once, ``estimate_job_kv_bytes``) and the
  reserve fit in what the trainer and the reference leave beside their largest passes
  and the weight sync's ``cuda_ipc`` copies (``estimate_sync_ring_bytes``);
  vLLM's cache is then sized to that need, not to everything they leave;
- else colocate, where vLLM needs room beside their resident state and the reference's
  pass only (the trainer's passes run while it sleeps), if that fits and the config can
  run colocated (``to_colocate``: the colocate rules of ``pipeline.config``);
- else streaming with what is left, as without this choice, saying why.
Guarantees: pure (the same config, shape and memory figures give the same choice;
``detect_free_gpu_bytes`` only asks ``nvidia-smi``); a choice always carries its reason;
where the user chose the split (an explicit plan, ``colocate``, vLLM's share, cache or
length, tensor parallelism, tool turns) or the cluster has no single GPU, none is made.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Literal

from pipeline.config import ConfigError, ConveyorConfig, apply_overrides, decode_config, to_dict
from pipeline.memory.admission import ModelShape
from pipeline.placement import (
    RESERVE_FRACTION,
    check_colocated_turn,
    count_trainable_params,
    estimate_colocated_fraction,
    estimate_critic_pass_bytes,
    estimate_job_kv_bytes,
    estimate_pass_bytes,
    estimate_sync_ring_bytes,
    is_manual,
)

_GIB = 1 << 30


@dataclass(frozen=True)
class SplitChoice:
    """``mode`` and why; ``sized``: vLLM's KV cache is sized to the job (streaming that
    fits; colocate always sizes it, ``size_job_kv_cache``)."""

    mode: Literal["streaming", "colocate"]
    reason: str
    sized: bool = False


def detect_free_gpu_bytes(address: str | None) -> int:
    """Free memory of the emptiest visible GPU in bytes, as ``nvidia-smi`` measures it
    (what other processes hold is gone); 0 when unknown (no ``nvidia-smi``, a remote
    cluster). Not ``torch.cuda.mem_get_info``: a CUDA context in the driver would hold
    part of the GPU for the whole run."""
    if address or os.environ.get("RAY_ADDRESS"):
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    mib = [int(x) for x in out.split() if x.strip().isdigit()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        keep = [int(v) for v in visible.split(",") if v.strip().isdigit()]
        mib = [mib[i] for i in keep if i < len(mib)]
    return (min(mib) << 20) if mib else 0


def leaves_split_open(cfg: ConveyorConfig, stages: list[str], available: int) -> bool:
    """The user left the split to the plan: one GPU, ``placement: auto`` with no stage
    placed by hand, a vLLM rollout of one GPU a replica, no share, cache or length of
    vLLM's chosen, no tool turns (their length has no bound to size a cache by)."""
    ro = cfg.rollout
    return (available == 1 and "rollout" in stages and "trainer" in stages and cfg.placement.mode == "auto"
            and not is_manual(cfg) and ro.backend == "vllm" and ro.tensor_parallel_size == 1 and ro.tools is None
            and all(v is None for v in (ro.kv_cache_gib, ro.gpu_memory_utilization, ro.max_model_len)))


def to_colocate(cfg: ConveyorConfig) -> ConveyorConfig:
    """``cfg`` colocated: lock-step, on-policy, weights every step, vLLM's sleep mode;
    ``ConfigError`` (naming the field) where the config cannot run so."""
    changes = ["placement.mode=colocate", "dataflow.async_execution=false", "dataflow.max_staleness=0",
               "train.sync_interval=1"]
    return decode_config(apply_overrides(to_dict(cfg), changes))


def _changed_by_colocate(cfg: ConveyorConfig) -> str:
    df = cfg.dataflow
    moved = [f"{key} {old} -> {new}" for key, old, new in (
        ("dataflow.async_execution", str(df.async_execution).lower(), "false"),
        ("dataflow.max_staleness", df.max_staleness, 0),
        ("train.sync_interval", cfg.train.sync_interval, 1)) if str(old) != str(new)]
    return f" ({', '.join(moved)})" if moved else ""


def choose_gpu_split(cfg: ConveyorConfig, stages: list[str], available: int, shape: ModelShape | None,
                     gpu_bytes: int, free_bytes: int = 0) -> SplitChoice | None:
    """The split of one GPU (see the module doc); None where none is made. ``free_bytes``:
    the device's measured free memory (0: unknown, taken as all of ``gpu_bytes``)."""
    if shape is None or not gpu_bytes or not leaves_split_open(cfg, stages, available):
        return None
    with_reference, with_critic = "reference" in stages, "critic" in stages
    trainer_pass, reference_pass = estimate_pass_bytes(cfg, shape, with_reference)
    critic_pass = estimate_critic_pass_bytes(cfg, shape) if with_critic else 0
    trainable = count_trainable_params(cfg, shape)
    others = max(0, gpu_bytes - free_bytes) if free_bytes else 0

    fp32_accum = cfg.train.grad_accum_dtype == "fp32"

    def room(pass_bytes: int, colocated: bool = False, fp32_accum: bool = fp32_accum) -> float:
        """What vLLM may have beside the others. One GPU: the trainer's weights reach
        vLLM through cuda_ipc copies on it."""
        ring = estimate_sync_ring_bytes(cfg, shape.num_params, colocated)
        share = estimate_colocated_fraction(shape.num_params, cfg.model.dtype, gpu_bytes, with_reference=with_reference,
                                            pass_bytes=pass_bytes + critic_pass + ring, trainable_params=trainable,
                                            with_critic=with_critic, offload_optimizer=cfg.train.offload_optimizer,
                                            fp32_accum=fp32_accum)
        return share * gpu_bytes - others

    def need(lockstep: bool) -> tuple[float, str]:  # vLLM's engines awake, their own reserve included
        kv, sequences, tokens = estimate_job_kv_bytes(cfg, shape, lockstep)
        engines = cfg.rollout.num_workers
        total = engines * (shape.num_params * shape.dtype_bytes + kv) + RESERVE_FRACTION * gpu_bytes
        what = (f"{'' if engines == 1 else f'{engines} engines x '}weights {shape.num_params * shape.dtype_bytes / _GIB:.2f}"
                f" GiB + KV cache {kv / _GIB:.2f} GiB ({sequences} sequences x {tokens} tokens) + "
                f"{RESERVE_FRACTION:.0%} reserve")
        return total, what

    held = f"; {others / _GIB:.1f} GiB held by other processes" if others else ""
    beside = "the trainer, reference and critic" if with_critic else "the trainer and reference"
    stream_room, (stream_need, stream_what) = room(trainer_pass + reference_pass), need(not cfg.dataflow.async_execution)
    if stream_need <= stream_room:
        return SplitChoice("streaming", f"placement auto: streaming on one GPU: vLLM's {stream_what} = "
                                        f"{stream_need / _GIB:.1f} GiB fit in the {stream_room / _GIB:.1f} GiB "
                                        f"{beside} leave beside their largest passes{held}", sized=True)
    short = (f"the job needs {stream_need / _GIB:.1f} GiB ({stream_what}), {beside} leave "
             f"{max(stream_room, 0) / _GIB:.1f} GiB beside their largest passes{held}")
    if not cfg.train.gradient_checkpointing:  # would recomputing the trainer's blocks make streaming fit?
        lean_pass = estimate_pass_bytes(cfg, shape, with_reference, checkpointed=True)[0]
        if stream_need <= room(lean_pass + reference_pass):
            short += (f"; set train.gradient_checkpointing=true to stream: the trainer's pass "
                      f"{trainer_pass / _GIB:.1f} -> {lean_pass / _GIB:.1f} GiB")
    offloaded_accum = cfg.train.offload_optimizer and fp32_accum and cfg.model.dtype != "float32"
    if offloaded_accum and stream_need <= room(trainer_pass + reference_pass, fp32_accum=False):
        # Offloaded, the fp32 accumulators are most of what stays on the GPU (4 of 8 bytes a parameter).
        short += (f"; set train.grad_accum_dtype=bf16 to stream: the offloaded trainer keeps "
                  f"{shape.num_params * 4 / _GIB:.1f} GiB less of fp32 accumulators on the GPU")
    colo_room, (colo_need, colo_what) = room(reference_pass, colocated=True), need(True)
    try:
        to_colocate(cfg)
    except ConfigError as exc:
        why = f"colocate is not possible: {exc}"
    else:
        turn = check_colocated_turn(cfg, shape, gpu_bytes, with_reference=with_reference, with_critic=with_critic,
                                    ring=estimate_sync_ring_bytes(cfg, shape.num_params, True), others=others)
        if colo_need <= colo_room and turn is None:
            return SplitChoice("colocate", f"placement auto: colocate on one GPU: streaming does not fit ({short}); "
                                           f"taking turns vLLM has {colo_room / _GIB:.1f} GiB for {colo_need / _GIB:.1f} "
                                           f"GiB ({colo_what}); lock-step and on-policy{_changed_by_colocate(cfg)}",
                               sized=True)
        why = (f"colocate does not fit either: {colo_need / _GIB:.1f} GiB for {colo_room / _GIB:.1f} GiB"
               if colo_need > colo_room else f"colocate does not fit either: {turn}")
    return SplitChoice("streaming", f"placement auto: streaming on one GPU with the memory left, KV cache from "
                                    f"vLLM's share (fewer sequences at once): {short}; {why}")
