"""Placement: which GPU each stage actor uses, planned and checked before anything starts.

``plan_placement`` maps the config (``placement: auto``, ``colocate`` or an explicit plan
naming GPU indices per stage) onto the cluster's GPUs; ``pipeline.runner`` turns the plan
into one placement-group bundle per GPU index. The rules of each mode are in
docs/architecture.md, "Placement".

Guarantees:
- ``plan_placement`` is pure: the same config, GPU count and model size give the same
  plan; nothing here starts Ray or touches a GPU (``detect_gpus`` only counts them);
- every GPU-using actor gets exactly one GPU index and a share of it (1/k for k actors
  there), and sees that GPU alone; an actor with no GPU in the plan asks for none;
- a tensor-parallel rollout replica gets k GPUs of its own, never shared;
- rollout replicas sharing a GPU each get the planned KV cache and the same start-up ask;
- ``check_plan`` and ``check_resources`` refuse, naming the stage (and GPU), every plan
  that would hang or break at start (``PlacementError``).
"""

from __future__ import annotations

import math
import os
import subprocess
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from pipeline.config import ConfigError, ConveyorConfig
from pipeline.dtypes import DTYPE_BYTES
from pipeline.memory.admission import ModelShape, estimate_batch_bytes, estimate_kv_cache_bytes

GPU_STAGES = ("rollout", "reward_model", "reference", "critic", "trainer")
_GIB = 1 << 30
# Share of a GPU kept free beside the resident estimates: activations and logits of a
# training chunk, CUDA contexts, allocator slack.
RESERVE_FRACTION = 0.1
OWN_GPU_FRACTION = 0.9  # vLLM's share of a GPU it has to itself
MIN_ROLLOUT_FRACTION = 0.05
KV_HEADROOM = 1.25  # a colocated engine's KV cache over its sequences' tokens (vLLM's block slack)
REFERENCE_CHUNK = 16  # the reference stage's samples per forward pass (stages/models/reference.py)


class PlacementError(ConfigError):
    """A plan that cannot run; the message names the stage and the GPU."""


@dataclass(frozen=True)
class StagePlacement:
    """Where one stage's actors run: actor r (rollout replica r, trainer rank r) on
    ``gpus[r]`` with ``share`` of it (``gpus`` empty: no GPU index; ``num_gpus`` Ray GPUs
    per replica, as configured or as a tensor-parallel rollout needs)."""

    gpus: tuple[int, ...] = ()
    share: tuple[float, ...] = ()
    num_gpus: float = 0.0
    num_cpus: float = 0.0


@dataclass(frozen=True)
class PlacementPlan:
    available_gpus: int
    stages: dict[str, StagePlacement]
    rollout_memory_fraction: float | None = None  # vLLM's gpu_memory_utilization
    notes: list[str] = field(default_factory=list)
    split: str | None = None  # one GPU, placement auto: "streaming" or "colocate" (pipeline/gpu_split.py)
    mps: str | None = None  # "start" (a daemon of the run's own) or "existing" (pipeline/mps.py)

    @property
    def bundles(self) -> int:
        """GPU indices in use: the size of the run's placement group."""
        used = [g for s in self.stages.values() for g in s.gpus]
        return max(used) + 1 if used else 0

    def share_a_gpu(self, stage: str, other: str) -> bool:
        """``stage`` and ``other`` have a GPU index in common (at once, or colocated in turns)."""
        a, b = self.stages.get(stage), self.stages.get(other)
        return bool(a and b and set(a.gpus) & set(b.gpus))

    def describe(self) -> list[str]:
        """One line per stage (``rollout -> [0] (share 0.33)``), then the notes."""
        lines = []
        for name, s in self.stages.items():
            if s.gpus:
                shares = ", ".join(f"{x:.2g}" for x in s.share)
                lines.append(f"{name} -> {list(s.gpus)} (GPU share {shares})")
            elif s.num_gpus:
                lines.append(f"{name} -> {s.num_gpus:g} GPU per replica (Ray chooses)")
            else:
                lines.append(f"{name} -> CPU")
        return lines + self.notes


def is_manual(cfg: ConveyorConfig) -> bool:
    """True when any stage names GPU indices or a Ray GPU count."""
    return any(e.gpus is not None or e.num_gpus > 0 for e in _entries(cfg).values())


def _entries(cfg: ConveyorConfig) -> dict[str, Any]:
    p = cfg.placement
    return {"source": p.source, "rollout": p.rollout, "reward": p.reward, "reference": p.reference,
            "reward_model": p.reward_model, "critic": p.critic, "trainer": p.trainer}


def estimate_trainer_bytes_per_param(dtype: str, offload_optimizer: bool = False, fp32_accum: bool = True) -> int:
    """Bytes per parameter a DeepSpeed trainer holds on its GPU at its peak (the optimizer
    step).

    float32: weights 4 + gradients 4 + Adam's two moments 8 = 16. Mixed precision
    (bfloat16, float16): weights 2 + the backward's 16-bit gradients 2 + fp32 master
    weights 4 + fp32 gradients 4 + Adam 8 = 20, with either ``train.grad_accum_dtype``:
    fp32 (the default; DeepSpeed's BF16 optimizer) keeps fp32 accumulators across the
    step's micro-batches and frees the 16-bit gradients only once a backward's are added
    in; bf16 accumulates in the 16-bit gradients and makes the fp32 copy at the step.
    ``train.offload_optimizer``: the weights and the backward's gradients (the rest is
    in host memory, ``check_offload_host_memory``), and with mixed precision and
    ``fp32_accum`` (``train.grad_accum_dtype: fp32``) DeepSpeed's fp32 accumulators,
    which stay on the GPU: 2 + 2 + 4 = 8 (a 4B model's first step asked for their
    15 GiB at once on an 80 GB GPU); bf16 accumulation: 4.
    """
    low = DTYPE_BYTES[dtype]
    if offload_optimizer:
        return low + low + (4 if fp32_accum and dtype != "float32" else 0)
    if dtype == "float32":
        return low + 4 + 8
    return low + low + 4 + 4 + 8


def check_offload_host_memory(cfg: ConveyorConfig, shape: ModelShape, with_critic: bool, host_bytes: int) -> str:
    """``train.offload_optimizer``'s host memory against ``host_bytes`` (this machine's):
    a note for the plan, or ``PlacementError`` where it exceeds what the machine has less
    ``RESERVE_FRACTION``; "" without offload. It pins fp32 master weights 4 + fp32
    gradients 4 + Adam's two moments 8 = 16 bytes a trainable parameter, the critic's
    (which trains under the same settings) included."""
    if not cfg.train.offload_optimizer:
        return ""
    trainable = count_trainable_params(cfg, shape)
    need = 16 * ((shape.num_params if trainable is None else trainable) + (shape.num_params if with_critic else 0))
    what = (f"train.offload_optimizer: the optimizer's state in host memory, ~{need / _GIB:.1f} GiB pinned "
            f"(16 bytes a trainable parameter{', the critic included' if with_critic else ''})")
    if host_bytes and need > (1.0 - RESERVE_FRACTION) * host_bytes:
        raise PlacementError(f"{what}, does not fit this machine's {host_bytes / _GIB:.0f} GiB of memory; "
                             f"set train.offload_optimizer=false, use model.lora or a smaller model")
    return f"{what} of {host_bytes / _GIB:.0f} GiB" if host_bytes else what


def estimate_checkpoint_bytes(cfg: ConveyorConfig, shape: ModelShape, with_critic: bool | None = None) -> int:
    """Bytes of one resumable checkpoint (``<run dir>/checkpoints/step-N``): DeepSpeed's
    state of each trainable parameter (``model.lora``: the adapter's), its weights and
    Adam's two fp32 moments, with mixed precision its fp32 master weights too: 12 bytes
    in float32, 2 + 4 + 8 = 14 in bfloat16 (a 4B model's: 52 GiB); with a critic
    (``with_critic``, default: the algorithm's), its state as well (``RUN_DIR/critic``).
    Measured on the CPU's float32 trainer: 12.0."""
    dtype = cfg.model.dtype
    per_param = 12 if dtype == "float32" else DTYPE_BYTES[dtype] + 12
    trainable = count_trainable_params(cfg, shape)
    critic = cfg.critic_enabled if with_critic is None else with_critic
    return per_param * ((shape.num_params if trainable is None else trainable) + (shape.num_params if critic else 0))


def estimate_replay_states_bytes(cfg: ConveyorConfig, shape: ModelShape) -> tuple[int, str]:
    """(bytes, what they are) of the trainer's states a recording keeps for replay
    (``<record dir>/trainer/states``): where an edge into the trainer is recorded, its
    state at the start and every ``record.state_every`` versions, none removed, each a
    checkpoint's trainer state (``estimate_checkpoint_bytes``, no critic)."""
    if not any(e.endswith("->trainer") for e in cfg.record.edges):
        return 0, ""
    states = 1 + (cfg.run.steps // cfg.record.state_every if cfg.record.state_every else 0)
    one = estimate_checkpoint_bytes(cfg, shape, with_critic=False)
    return states * one, f"{states} trainer state{'s' if states > 1 else ''} of {one / _GIB:.1f} GiB for replay"


def estimate_run_disk_bytes(cfg: ConveyorConfig, shape: ModelShape, existing: int = 0) -> tuple[int, str]:
    """(bytes, what they are) that a run adds at most under ``run.dir`` at once: its
    resumable checkpoints (``estimate_checkpoint_bytes``; one every
    ``train.checkpoint_every`` steps and one at the end, the newest
    ``train.keep_checkpoints`` kept and one more while the next is written; none with
    ``train.resumable: false``), less the ``existing`` ones a resumed run finds there
    (already off the disk's free space, and removed as new ones come), and the exported
    model (``train.save_checkpoint``). Logs, metrics and recorded micro-batches are not
    counted (``estimate_replay_states_bytes`` counts a recording's trainer states)."""
    tr = cfg.train
    writes = (cfg.run.steps // tr.checkpoint_every if tr.checkpoint_every else 0) + 1 if tr.resumable else 0
    copies = max(0, min(tr.keep_checkpoints + 1, writes) - existing)
    one = estimate_checkpoint_bytes(cfg, shape)
    export = shape.num_params * DTYPE_BYTES[cfg.model.dtype] if tr.save_checkpoint else 0
    parts = []
    if copies:
        parts.append(f"{copies} resumable checkpoint{'s' if copies > 1 else ''} of {one / _GIB:.1f} GiB "
                     f"(weights and the optimizer's state)")
    if export:
        parts.append(f"the exported model, {export / _GIB:.1f} GiB")
    return copies * one + export, " and ".join(parts)


def check_run_disk(cfg: ConveyorConfig, shape: ModelShape, free_bytes: int, existing: int = 0,
                   recording_free_bytes: int | None = None) -> str:
    """What the run writes (``estimate_run_disk_bytes``, ``existing`` checkpoints found,
    and ``estimate_replay_states_bytes``) against ``free_bytes`` free where ``run.dir``
    is; ``recording_free_bytes``: free where the recording is, when that is another file
    system (None: the same). ``PlacementError`` naming the keys that write less where it
    does not fit, a note for the plan where it takes more than half of it, else ""."""
    run_need, run_what = estimate_run_disk_bytes(cfg, shape, existing)
    rec_need, rec_what = estimate_replay_states_bytes(cfg, shape)
    if recording_free_bytes is None:
        disks = [(run_need + rec_need, " and ".join(w for w in (run_what, rec_what) if w), free_bytes, "run.dir")]
    else:
        disks = [(run_need, run_what, free_bytes, "run.dir"), (rec_need, rec_what, recording_free_bytes, "record.dir")]
    notes = []
    for need, what, free, where in disks:
        if not need or not free:
            continue
        text = f"disk: the run writes up to {need / _GIB:.1f} GiB under {where} ({what}); {free / _GIB:.1f} GiB free"
        if need > free:
            keys = _disk_keys(cfg, shape, existing, where, run_need)
            raise PlacementError(f"{text}: it does not fit; set {', '.join(keys)}")
        if need > free / 2:
            notes.append(text)
    return "; ".join(notes)


def _disk_keys(cfg: ConveyorConfig, shape: ModelShape, existing: int, where: str, run_need: int) -> list[str]:
    """The keys that make a run write less on the disk of ``where`` (run.dir, record.dir);
    ``run_need``: what it writes under run.dir (``estimate_run_disk_bytes``)."""
    keys = [f"{where} (a larger disk)"]
    if where == "run.dir":
        keys.append("train.resumable=false (no resumable checkpoints)")
        keep_one = msgspec.structs.replace(cfg, train=msgspec.structs.replace(cfg.train, keep_checkpoints=1))
        if estimate_run_disk_bytes(keep_one, shape, existing)[0] < run_need:
            keys.insert(1, "train.keep_checkpoints=1")
        if cfg.train.save_checkpoint:
            keys.append("train.save_checkpoint=false (no exported model)")
    if estimate_replay_states_bytes(cfg, shape)[0]:
        keys.append("record.state_every (larger: fewer trainer states)")
    return keys


def count_sync_slots(cfg: ConveyorConfig, colocated: bool | None = None) -> int:
    """Slots of the trainer's ``cuda_ipc`` ring (``pipeline.transport.CudaIpcExporter``),
    each a whole set of the served weights on the trainer's GPU for the run. Two let a
    rollout engine still load version k while the trainer writes k+1 into the other.
    Colocated, one: the trainer writes k+1 only after every rollout worker went to sleep
    for its step; a worker sleeps only between updates, and once asleep skips every
    version not newer than the one it slept for, so no reader is left on the slot (an
    engine rebuilt after a death that finds it rewritten is refused by the fingerprint
    and takes the newest version). ``colocated``: as if ``placement`` were (not) colocate."""
    return 1 if (cfg.placement.mode == "colocate" if colocated is None else colocated) else 2


def estimate_sync_ring_bytes(cfg: ConveyorConfig, num_params: int, colocated: bool | None = None) -> int:
    """What ``count_sync_slots`` whole copies of the served weights hold on the
    trainer's GPU where the weights travel by ``cuda_ipc`` (with LoRA, the adapted
    layers' merged weights: at most the whole model)."""
    serve = cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype
    return count_sync_slots(cfg, colocated) * num_params * DTYPE_BYTES[serve]


def estimate_lora_params(shape: ModelShape, rank: int) -> int:
    """An upper bound on the adapter parameters of ``model.lora`` at ``rank``: every
    linear layer of a Llama-style block adapted (``all-linear``), ``rank x (in + out)``
    each: q and o (hidden, hidden), k and v (hidden, kv), gate and up (hidden,
    intermediate), down (intermediate, hidden): ``rank x (9 hidden + 2 kv + 3
    intermediate)`` per layer."""
    hidden, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    inter = shape.intermediate_size or 4 * hidden
    return rank * shape.num_layers * (9 * hidden + 2 * kv + 3 * inter)


def count_trainable_params(cfg: ConveyorConfig, shape: ModelShape | None) -> int | None:
    """With ``model.lora``, an upper bound on the adapter's parameters
    (``estimate_lora_params``); None where every parameter trains (or no shape is known)."""
    lora = cfg.model.lora
    return estimate_lora_params(shape, lora.rank) if lora.enabled and shape is not None else None


def estimate_colocated_fraction(num_params: int, dtype: str, gpu_bytes: int, *, with_reference: bool,
                                pass_bytes: int = 0, trainable_params: int | None = None,
                                with_critic: bool = False, offload_optimizer: bool = False,
                                fp32_accum: bool = True) -> float:
    """vLLM's share of one GPU that it shares with the trainer (and the reference, and the
    critic): ``1 - (trainer + reference + critic + pass_bytes) / total - RESERVE_FRACTION``,
    at most ``OWN_GPU_FRACTION``; ``pass_bytes``: the largest forward/backward pass of the
    stages beside vLLM (``estimate_pass_bytes``, ``estimate_critic_pass_bytes``).
    ``trainable_params``: fewer than all train (LoRA's adapters): the frozen rest holds its
    weights alone. The critic trains all its parameters, counted as the policy's
    (``critic.path`` None: the policy with a scalar head). ``offload_optimizer``: both
    keep only their 16-bit weights and gradients on the GPU (and, with ``fp32_accum``,
    fp32 accumulators: ``estimate_trainer_bytes_per_param``).

    Example: 0.5B params in bf16 on 80 GiB: trainer 0.5e9 x 20 B = 9.3 GiB, reference
    0.5e9 x 2 B = 0.93 GiB: 1 - 10.2 / 80 - 0.1 = 0.77.
    """
    resident = estimate_resident_bytes(num_params, dtype, with_reference=with_reference,
                                       trainable_params=trainable_params, with_critic=with_critic,
                                       offload_optimizer=offload_optimizer, fp32_accum=fp32_accum)
    return min(OWN_GPU_FRACTION, 1.0 - (resident + pass_bytes) / gpu_bytes - RESERVE_FRACTION)


def estimate_resident_bytes(num_params: int, dtype: str, *, with_reference: bool, trainable_params: int | None = None,
                            with_critic: bool = False, offload_optimizer: bool = False,
                            fp32_accum: bool = True) -> int:
    """What the trainer (and the reference, and the critic) hold on their GPU between
    passes: weights, gradients and optimizer state (``estimate_colocated_fraction``)."""
    trainable = num_params if trainable_params is None else min(trainable_params, num_params)
    per_param = estimate_trainer_bytes_per_param(dtype, offload_optimizer, fp32_accum)
    resident = trainable * per_param + (num_params - trainable) * DTYPE_BYTES[dtype]
    if with_reference:
        resident += num_params * DTYPE_BYTES[dtype]
    if with_critic:
        resident += num_params * per_param
    return resident


def check_colocated_turn(cfg: ConveyorConfig, shape: ModelShape, gpu_bytes: int, *, with_reference: bool,
                         with_critic: bool, ring: int, others: int = 0) -> str | None:
    """Colocated, the trainer steps while vLLM sleeps: its turn holds what the trainer,
    reference and critic keep resident, their largest passes and the weight sync's
    copies (``ring``), within the GPU less ``RESERVE_FRACTION`` (vLLM's sleeping
    context among it) and ``others`` (bytes other processes hold). None where it fits;
    else why not, with the keys that would make it fit."""
    trainer_pass, reference_pass = estimate_pass_bytes(cfg, shape, with_reference)
    critic_pass = estimate_critic_pass_bytes(cfg, shape) if with_critic else 0
    offload = cfg.train.offload_optimizer

    def resident_bytes(offloaded: bool) -> int:
        return estimate_resident_bytes(shape.num_params, cfg.model.dtype, with_reference=with_reference,
                                       trainable_params=count_trainable_params(cfg, shape), with_critic=with_critic,
                                       offload_optimizer=offloaded, fp32_accum=cfg.train.grad_accum_dtype == "fp32")

    resident = resident_bytes(offload)
    turn = resident + trainer_pass + reference_pass + critic_pass + ring
    room = (1.0 - RESERVE_FRACTION) * gpu_bytes - others
    if turn <= room:
        return None
    # Name a key where setting it alone makes the turn fit, both where only both do.
    lean = trainer_pass if cfg.train.gradient_checkpointing else estimate_pass_bytes(
        cfg, shape, with_reference, checkpointed=True)[0]
    light = resident_bytes(True)
    ways = []
    if lean < trainer_pass and turn - trainer_pass + lean <= room:
        ways.append(f"set train.gradient_checkpointing=true (the trainer's pass {trainer_pass / _GIB:.1f} -> "
                    f"{lean / _GIB:.1f} GiB)")
    if light < resident and turn - resident + light <= room:
        ways.append(f"set train.offload_optimizer=true (resident {resident / _GIB:.1f} -> {light / _GIB:.1f} GiB)")
    if not ways and lean < trainer_pass and light < resident and turn - trainer_pass + lean - resident + light <= room:
        ways.append("set train.gradient_checkpointing=true and train.offload_optimizer=true")
    ways.append("lower train.pass_tokens (or train.chunk_size with it 0) or train.logit_chunk_tokens, model.lora, "
                "more GPUs or a smaller model")
    return (f"the trainer's turn needs ~{turn / _GIB:.1f} GiB (resident {resident / _GIB:.1f} + trainer pass "
            f"{trainer_pass / _GIB:.1f}{f' + reference pass {reference_pass / _GIB:.1f}' if reference_pass else ''}"
            f"{f' + critic pass {critic_pass / _GIB:.1f}' if critic_pass else ''}"
            f"{f' + weight sync buffers {ring / _GIB:.1f}' if ring else ''} GiB), one GPU has "
            f"{max(room, 0) / _GIB:.1f} GiB with the {RESERVE_FRACTION:.0%} reserve"
            f"{f' and {others / _GIB:.1f} GiB held by other processes' if others else ''}; " + ", ".join(ways))


def estimate_pass_bytes(cfg: ConveyorConfig, shape: ModelShape, with_reference: bool,
                        checkpointed: bool | None = None) -> tuple[int, int]:
    """(trainer, reference) bytes of one forward pass at its largest: with
    ``train.pass_tokens`` that many tokens (rows of any length fill a pass up to it), or
    one row longer than it; with it 0, ``train.chunk_size`` samples (the reference's 16)
    of ``data.max_prompt_len + rollout.max_tokens`` tokens (the source refuses longer
    prompts); activations and the logits the head holds at once
    (``train.logit_chunk_tokens``, both stages; 0: all of them), with grad for the trainer
    (its blocks recomputed in backward with ``train.gradient_checkpointing``); the
    reference's 0 when it does not share the GPU. The trainer's pass and the reference's
    can run at once on a streaming GPU, so both are reserved. ``checkpointed``: as if
    ``train.gradient_checkpointing`` were that (None: as it is)."""
    seq = cfg.data.max_prompt_len + cfg.rollout.max_tokens
    checkpointed = cfg.train.gradient_checkpointing if checkpointed is None else checkpointed
    logit_tokens = cfg.train.logit_chunk_tokens or None

    def largest(kind: Literal["trainer", "reference"], chunk: int) -> int:
        # estimate_forward_bytes counts rows x width tokens: one row of the pass's tokens stands for its rows.
        lens = [max(seq, cfg.train.pass_tokens)] if cfg.train.pass_tokens else [seq] * chunk
        return estimate_batch_bytes(kind, shape, lens, chunk_size=chunk, logit_tokens=logit_tokens,
                                    checkpointed=kind == "trainer" and checkpointed)

    return largest("trainer", cfg.train.chunk_size), largest("reference", REFERENCE_CHUNK) if with_reference else 0


def estimate_critic_pass_bytes(cfg: ConveyorConfig, shape: ModelShape) -> int:
    """The critic's largest pass: ``critic.chunk_size`` samples of ``data.max_prompt_len +
    rollout.max_tokens`` tokens with grad (its blocks recomputed with
    ``train.gradient_checkpointing``); its head gives one value a token, no vocabulary."""
    seq = cfg.data.max_prompt_len + cfg.rollout.max_tokens
    chunk = cfg.critic.chunk_size
    scalar_head = msgspec.structs.replace(shape, vocab_size=1)
    return estimate_batch_bytes("trainer", scalar_head, [seq] * chunk, chunk_size=chunk,
                                checkpointed=cfg.train.gradient_checkpointing)


def engines_per_gpu(plan: PlacementPlan) -> int:
    """The most rollout replicas (vLLM engines) that share one GPU in ``plan``; 1 where
    none share (one replica a GPU, tensor parallelism, CPU)."""
    rollout = plan.stages.get("rollout")
    if rollout is None or not rollout.gpus:
        return 1
    return max(rollout.gpus.count(g) for g in set(rollout.gpus))


def job_sequences(cfg: ConveyorConfig, lockstep: bool) -> int:
    """The sequences one rollout worker can have generating at once for training:
    ``max_inflight`` micro-batches (lock-step: at most a step's) of
    ``prompts_per_micro_batch × n``."""
    ro = cfg.rollout
    inflight = min(ro.max_inflight, cfg.micro_batches_per_step) if lockstep else ro.max_inflight
    return inflight * cfg.dataflow.prompts_per_micro_batch * ro.n


def plan_max_num_seqs(cfg: ConveyorConfig) -> int:
    """vLLM's ``max_num_seqs`` for one rollout worker of this job: its training sequences
    (``job_sequences``) plus, with ``eval`` on, an evaluation's (``max_inflight``
    micro-batches of ``prompts_per_micro_batch`` prompts, one greedy completion each and
    ``eval.n`` samples with ``eval.temperature`` > 0), which worker 0 may generate beside
    them. More is never used: each extra size costs start-up (vLLM captures CUDA graphs
    for up to twice it, to 512) and memory (its sampler is profiled for that many rows of
    vocabulary-wide logits)."""
    sequences = job_sequences(cfg, not cfg.dataflow.async_execution)
    if cfg.eval.enabled:
        per_prompt = 1 + (cfg.eval.n if cfg.eval.temperature > 0 else 0)
        sequences += cfg.rollout.max_inflight * cfg.dataflow.prompts_per_micro_batch * per_prompt
    return sequences


def estimate_job_kv_bytes(cfg: ConveyorConfig, shape: ModelShape, lockstep: bool) -> tuple[int, int, int]:
    """(bytes, sequences, tokens each) of the KV cache one vLLM engine needs for the
    job: every sequence a worker can have generating at once (``job_sequences``) at its
    longest, × ``KV_HEADROOM`` (``size_job_kv_cache`` says why)."""
    ro = cfg.rollout
    sequences = job_sequences(cfg, lockstep)
    seq_tokens = cfg.data.max_prompt_len + ro.max_tokens
    return math.ceil(estimate_kv_cache_bytes(shape, sequences * seq_tokens) * KV_HEADROOM), sequences, seq_tokens


def size_job_kv_cache(cfg: ConveyorConfig, shape: ModelShape, engines_sharing: int = 1,
                      streaming_split: bool = False) -> tuple[int, int, str] | None:
    """(bytes of KV cache, longest sequence) for one vLLM engine, sized to the job, and
    a note for the plan; None where it is not planned: neither ``placement: colocate``,
    ``engines_sharing`` > 1 rollout replicas on one GPU nor ``streaming_split`` (one GPU
    shared with the trainer, ``pipeline/gpu_split.py``), the user chose
    (``rollout.kv_cache_gib``, ``rollout.gpu_memory_utilization`` or
    ``rollout.max_model_len`` set), or ``rollout.tools`` (multi-turn rollouts submit
    each turn as a new request, whose length this plan does not bound). ``shape``: the
    model in the rollout's dtype.

    Why it is planned there:
    - Streaming on one GPU, the cache beyond what the job can fill is memory the
      trainer's passes no longer have.
    - A colocated engine sleeps every step, freeing its KV cache, and maps it again on
      waking: the time both take grows with the cache, which vLLM otherwise makes as
      large as its share allows.
    - Engines that share a GPU start at once. vLLM (0.26 to 0.32) sizes a cache from its
      share by profiling the whole device's free memory after loading its weights, so
      whatever another engine allocates meanwhile (its cache: the rest of its share)
      is counted as this one's and leaves it a cache of nothing, or a start-up error.
      With a size given, vLLM makes a cache of that size, not one derived from the profile.

    A worker takes micro-batches from the queue all replicas share and generates at
    most ``max_inflight`` at once (lock-step: at most a step's micro-batches), each of
    ``prompts_per_micro_batch × n`` sequences of at most ``data.max_prompt_len +
    rollout.max_tokens`` tokens (the source refuses longer prompts), which becomes
    vLLM's ``max_model_len``; the cache holds them all, × ``KV_HEADROOM`` for vLLM's
    part-filled blocks. (Tensor parallelism shares no GPU and colocate refuses it: one
    GPU holds the cache.)
    """
    ro = cfg.rollout
    colocated = cfg.placement.mode == "colocate"
    if ((not colocated and engines_sharing < 2 and not streaming_split) or ro.tools is not None
            or any(v is not None for v in (ro.kv_cache_gib, ro.gpu_memory_utilization, ro.max_model_len))):
        return None
    kv, sequences, seq_tokens = estimate_job_kv_bytes(cfg, shape, not cfg.dataflow.async_execution)
    where = ("colocate" if colocated else f"{engines_sharing} vLLM engines on one GPU" if engines_sharing > 1
             else "streaming on one GPU")
    note = (f"{where}: vLLM's KV cache sized to the job, {kv / _GIB:.2f} GiB ({sequences} sequences x "
            f"{seq_tokens} tokens, x{KV_HEADROOM:g}; max_model_len {seq_tokens}); rollout.kv_cache_gib sets it")
    return kv, seq_tokens, note


def order_setups(cfg: ConveyorConfig, plan: PlacementPlan) -> tuple[dict[str, tuple[str, ...]], str | None]:
    """The stages whose set-up waits for the rollout's (``Node.setup_after``) and the
    plan's note saying why; none where vLLM is given its cache's size.

    A vLLM engine without ``kv_cache_memory_bytes`` (``rollout.kv_cache_gib`` unset after
    the plan: streaming on one GPU where the job's cache does not fit, or a share the
    user chose) sizes its cache from its share less what it measures itself using while
    it loads and profiles, and it measures that as the device's free memory falling (vLLM
    0.26 to 0.32): whatever a stage beside it on its GPU allocates meanwhile (the
    trainer's model, optimizer, compiled blocks) is counted as vLLM's and taken from its
    cache (docs/performance/longtail.md). The stages that share a
    rollout GPU (trainer, reference, critic, reward model) therefore set up once the
    rollout's engines are up: the cache is then what vLLM's share gives, every launch.
    It costs their set-up time at launch (they no longer overlap vLLM's start), so it
    applies only where vLLM profiles; a cache of a given size (``rollout.kv_cache_gib``)
    starts them together."""
    ro = plan.stages.get("rollout")
    if cfg.rollout.backend != "vllm" or cfg.rollout.kv_cache_gib is not None or ro is None or not ro.gpus:
        return {}, None
    mates = [name for name, placed in plan.stages.items() if name != "rollout" and set(placed.gpus) & set(ro.gpus)]
    if not mates:
        return {}, None
    return {name: ("rollout",) for name in mates}, (
        f"{', '.join(mates)} set up after the rollout: vLLM sizes its KV cache from the GPU's free memory while "
        f"it starts, which their allocations would take from it; rollout.kv_cache_gib gives it a size and "
        f"starts them together")


def colocated_startup_fraction(shape: ModelShape, kv_bytes: int, gpu_bytes: int) -> float:
    """The share of the GPU a colocated engine with a KV cache of ``kv_bytes`` needs
    awake: its weights, that cache and ``RESERVE_FRACTION`` of the GPU (the CUDA
    context, CUDA graphs, the activations of a step), rounded up to a thousandth.

    With ``kv_cache_memory_bytes`` set, vLLM (0.26 to 0.32) reads
    ``gpu_memory_utilization`` only in its start-up check (free memory >= utilization x
    total): the launch asks for this, not the whole share the trainer leaves, which would
    refuse to start where anything else holds more than the trainer. The reserve is
    vLLM's only margin then: on a small GPU with a large vocabulary its graphs and
    sampler may need more (``rollout.gpu_memory_utilization`` sets it). Example: 268.7M
    params in bf16 (0.50 GiB) and a 3.75 GiB cache on 139.8 GiB: 4.25 / 139.8 + 0.1 =
    0.131.
    """
    need = (shape.num_params * shape.dtype_bytes + kv_bytes) / gpu_bytes + RESERVE_FRACTION
    return math.ceil(need * 1000) / 1000


def plan_placement(
    cfg: ConveyorConfig, stages: list[str], available_gpus: int, *, num_params: int = 0, gpu_bytes: int = 0,
    shape: ModelShape | None = None,
) -> PlacementPlan:
    """The run's plan (see the module guarantees); ``check_plan`` it before use.

    ``stages``: the graph's stage names; ``num_params`` and ``gpu_bytes`` (memory of one
    GPU; 0 if unknown) size vLLM's share of a GPU it shares; ``shape`` (the model's,
    optional) adds the trainer's and the reference's largest pass to what is reserved.
    """
    entries = _entries(cfg)
    cpus = {name: (entries[name].num_cpus if name in entries else 0.0) for name in stages}
    replicas = {name: count_actors(cfg, name) for name in stages}
    gpus: dict[str, list[int]] = {}
    by_count: dict[str, float] = {}  # stage -> Ray GPUs per replica, without indices
    notes: list[str] = []
    if is_manual(cfg):
        for name in stages:
            entry = entries.get(name)
            if entry is not None and entry.gpus is not None:
                gpus[name] = list(entry.gpus)
    elif cfg.placement.mode == "colocate":
        gpus = _plan_colocate(cfg, [s for s in GPU_STAGES if s in stages], available_gpus, notes)
    elif available_gpus >= 1:
        gpus, by_count = _plan_auto(cfg, [s for s in GPU_STAGES if s in stages], available_gpus, notes)
    # Replica r of a stage sits on gpus[r % len(gpus)]: one index per actor.
    actor_gpu = {name: tuple(g[r % len(g)] for r in range(replicas[name])) for name, g in gpus.items() if g}
    load: dict[int, int] = defaultdict(int)
    for g in actor_gpu.values():
        for i in g:
            load[i] += 1
    placed: dict[str, StagePlacement] = {}
    for name in stages:
        if name in actor_gpu:
            placed[name] = StagePlacement(gpus=actor_gpu[name], share=tuple(1.0 / load[i] for i in actor_gpu[name]),
                                          num_cpus=cpus[name])
        else:
            entry = entries.get(name)
            count = by_count.get(name, entry.num_gpus if entry is not None else 0.0)
            placed[name] = StagePlacement(num_gpus=count, num_cpus=cpus[name])
    if shape is not None:
        num_params = num_params or shape.num_params
    # One GPU: the trainer's weights reach vLLM by cuda_ipc (``select_transport``).
    fraction = _rollout_fraction(cfg, placed, num_params, gpu_bytes, notes, shape, ipc_ring=available_gpus == 1)
    return PlacementPlan(available_gpus=available_gpus, stages=placed, rollout_memory_fraction=fraction, notes=notes)


def count_actors(cfg: ConveyorConfig, stage: str) -> int:
    """Actors of ``stage`` that take a GPU each: rollout replicas, trainer ranks, else 1."""
    return {"rollout": cfg.rollout.num_workers, "trainer": cfg.train.num_ranks}.get(stage, 1)


def _plan_auto(cfg: ConveyorConfig, on_gpu: list[str], available: int,
               notes: list[str]) -> tuple[dict[str, list[int]], dict[str, float]]:
    """``placement: auto`` on ``available`` GPUs: (GPU indices per stage, Ray GPU counts
    per replica of the stages placed by count). Trainer rank r gets a GPU of its own;
    reference, critic and reward model sit with rank 0. Disaggregated when the rollout
    can have GPUs besides the ranks', else rollout replicas share the ranks' GPUs. A
    tensor-parallel rollout replica gets ``tensor_parallel_size`` GPUs of its own by
    count (vLLM's workers run in its process tree), never shared."""
    ranks = cfg.train.num_ranks if "trainer" in on_gpu else 1
    if ranks > available:
        raise PlacementError(
            f"train.num_ranks: {ranks} ranks need {ranks} GPUs (one each: NCCL cannot put two ranks on one "
            f"GPU), the cluster has {available}")
    workers, tp = cfg.rollout.num_workers, cfg.rollout.tensor_parallel_size
    if "rollout" in on_gpu and tp > 1:
        if workers * tp + ranks > available:
            raise PlacementError(
                f"rollout.tensor_parallel_size: {workers} replica(s) x {tp} GPUs for the rollout plus {ranks} for "
                f"the trainer (train.num_ranks) make {workers * tp + ranks}, the cluster has {available}; "
                f"a tensor-parallel replica does not share its GPUs")
        rest = {s: [0] for s in on_gpu if s != "rollout"} | ({"trainer": list(range(ranks))} if ranks > 1 else {})
        return rest, {"rollout": float(tp)}
    if available == 1 or "rollout" not in on_gpu:
        return {s: (list(range(ranks)) if s == "trainer" else [0]) for s in on_gpu}, {}
    if ranks + 1 <= available:  # disaggregated: rollout GPUs first, then one per rank
        rollout = list(range(max(1, min(workers, available - ranks))))
        first = len(rollout)
        idle = available - first - ranks
        if idle:
            notes.append(f"{idle} GPU(s) idle: raise rollout.num_workers to use them for generation")
        return {s: (rollout if s == "rollout" else list(range(first, first + ranks)) if s == "trainer"
                    else [first]) for s in on_gpu}, {}
    notes.append(f"train.num_ranks {ranks} takes every GPU: rollout replicas share the trainer ranks' GPUs")
    return {s: (list(range(min(workers, available))) if s == "rollout" else list(range(ranks)) if s == "trainer"
                else [0]) for s in on_gpu}, {}


def _plan_colocate(cfg: ConveyorConfig, on_gpu: list[str], available: int, notes: list[str]) -> dict[str, list[int]]:
    """``placement: colocate``: trainer rank r on GPU r, rollout replica r on GPU
    r % ranks beside it, the other GPU stages with rank 0; vLLM sleeps while they train."""
    if not available:
        raise PlacementError("placement: colocate time-shares GPUs between vLLM and the trainer; the cluster has "
                             "none (use placement: auto on CPU)")
    ranks = cfg.train.num_ranks
    if ranks > available:
        raise PlacementError(f"train.num_ranks: {ranks} ranks need {ranks} GPUs (one each), the cluster has "
                             f"{available}")
    if available > ranks:
        notes.append(f"{available - ranks} GPU(s) idle: placement colocate uses the {ranks} trainer rank GPU(s)")
    notes.append("colocate: vLLM sleeps (weights and KV cache freed) while the trainer steps")
    rollout = list(range(min(cfg.rollout.num_workers, ranks)))
    return {s: rollout if s == "rollout" else list(range(ranks)) if s == "trainer" else [0] for s in on_gpu}


def _rollout_fraction(cfg: ConveyorConfig, placed: dict[str, StagePlacement], num_params: int, gpu_bytes: int,
                      notes: list[str], shape: ModelShape | None = None, ipc_ring: bool = False) -> float | None:
    rollout = placed.get("rollout")
    if rollout is not None and not rollout.gpus and rollout.num_gpus > 1:
        # Tensor parallel, GPUs of its own.
        return OWN_GPU_FRACTION if cfg.rollout.gpu_memory_utilization is None else cfg.rollout.gpu_memory_utilization
    if rollout is None or not rollout.gpus:
        return cfg.rollout.gpu_memory_utilization
    mates = [n for n in ("trainer", "reference", "critic") if n in placed and set(placed[n].gpus) & set(rollout.gpus)]
    chosen = cfg.rollout.gpu_memory_utilization
    # Engines sharing one GPU split vLLM's share: each asks for its part of the memory.
    engines = max(rollout.gpus.count(g) for g in set(rollout.gpus))
    if not mates:
        if chosen is not None and chosen * engines > OWN_GPU_FRACTION + 1e-9:
            raise PlacementError(
                f"placement.rollout: {engines} vLLM engines on one GPU with rollout.gpu_memory_utilization "
                f"{chosen:g} each would ask for {chosen * engines:.2f} of it; at most {OWN_GPU_FRACTION} in all")
        return round(OWN_GPU_FRACTION / engines, 3) if chosen is None else chosen
    if not (num_params and gpu_bytes):
        notes.append("GPU memory or model size unknown: vLLM keeps rollout.gpu_memory_utilization")
        return chosen
    dtype = cfg.model.dtype
    with_reference = "reference" in mates
    trainer_pass, reference_pass = estimate_pass_bytes(cfg, shape, with_reference) if shape else (0, 0)
    with_critic = "critic" in mates
    critic_pass = estimate_critic_pass_bytes(cfg, shape) if with_critic and shape else 0
    # Colocated, the trainer's passes run while vLLM sleeps: its share leaves room for the reference's only.
    beside = 0 if cfg.placement.mode == "colocate" else trainer_pass
    trainable = count_trainable_params(cfg, shape)
    # The weight sync's ring of copies on the trainer's GPU, held awake or asleep.
    ring = estimate_sync_ring_bytes(cfg, num_params) if ipc_ring and "trainer" in mates else 0
    offload = cfg.train.offload_optimizer
    planned = estimate_colocated_fraction(num_params, dtype, gpu_bytes, with_reference=with_reference,
                                          pass_bytes=beside + reference_pass + critic_pass + ring,
                                          trainable_params=trainable, with_critic=with_critic,
                                          offload_optimizer=offload, fp32_accum=cfg.train.grad_accum_dtype == "fp32")
    resident = (1.0 - RESERVE_FRACTION - planned) * gpu_bytes - beside - reference_pass - critic_pass - ring
    per_pass = (f"train.pass_tokens {cfg.train.pass_tokens}" if cfg.train.pass_tokens
                else f"train.chunk_size {cfg.train.chunk_size}")
    passes = (f" + trainer pass ~{trainer_pass / _GIB:.1f} GiB ({per_pass}, "
              f"train.logit_chunk_tokens {cfg.train.logit_chunk_tokens}"
              f"{', train.gradient_checkpointing' if cfg.train.gradient_checkpointing else ''}"
              f"{'; while vLLM sleeps' if beside != trainer_pass else ''})" if shape else "")
    passes += f" + reference pass ~{reference_pass / _GIB:.1f} GiB" if reference_pass else ""
    passes += f" + critic pass ~{critic_pass / _GIB:.1f} GiB (critic.chunk_size {cfg.critic.chunk_size})" if critic_pass else ""
    if ring:
        slots = count_sync_slots(cfg)
        passes += f" + weight sync buffers ~{ring / _GIB:.1f} GiB (cuda_ipc, {slots} cop{'y' if slots == 1 else 'ies'})"
    notes.append(
        f"{' + '.join(mates)} on rollout GPU {list(rollout.gpus)}: ~{resident / _GIB:.1f} GiB resident{passes} of "
        f"{gpu_bytes / _GIB:.0f} GiB ({num_params / 1e6:.0f}M params, {dtype}"
        f"{f', LoRA: at most {trainable / 1e6:.1f}M trainable' if trainable else ''}"
        f"{', optimizer offloaded to host memory' if offload else ''}), {RESERVE_FRACTION:.0%} reserve; "
        f"vLLM ~{max(planned, 0) * gpu_bytes / _GIB:.1f} GiB"
    )
    if shape is not None and beside == 0 and "trainer" in mates:
        short = check_colocated_turn(cfg, shape, gpu_bytes, with_reference=with_reference, with_critic=with_critic,
                                     ring=ring)
        if short:
            raise PlacementError(f"placement: colocate: {short}")
    planned = round(planned / engines, 3)
    if chosen is not None:
        if chosen > planned + 1e-9:
            raise PlacementError(
                f"placement: rollout.gpu_memory_utilization {chosen:g} does not fit beside {' and '.join(mates)} "
                f"on GPU {list(rollout.gpus)}: at most {planned:.2f} is left (~{resident / _GIB:.1f} GiB of "
                f"{gpu_bytes / _GIB:.0f} GiB resident); lower it or give the rollout its own GPU"
            )
        return chosen
    if planned < MIN_ROLLOUT_FRACTION:
        raise PlacementError(
            f"placement: the model ({num_params / 1e6:.0f}M params, {dtype}) does not fit {', '.join(mates)} and "
            f"vLLM on one GPU of {gpu_bytes / _GIB:.0f} GiB (vLLM would get {max(planned, 0):.2f} of it; "
            f"{notes[-1]}); lower train.pass_tokens (or train.chunk_size with it 0) or train.logit_chunk_tokens, "
            f"{'critic.chunk_size, ' if with_critic else ''}"
            f"{'' if cfg.train.gradient_checkpointing else 'set train.gradient_checkpointing=true, '}"
            f"{'' if offload else 'set train.offload_optimizer=true, '}use more GPUs, model.lora or a smaller model"
        )
    return planned


def check_plan(cfg: ConveyorConfig, plan: PlacementPlan) -> None:
    """Raise ``PlacementError`` for a plan that would hang or break (module guarantees)."""
    entries = _entries(cfg)
    users: dict[int, list[str]] = defaultdict(list)
    for name, s in plan.stages.items():
        for g in s.gpus:
            if g >= plan.available_gpus:
                raise PlacementError(
                    f"placement.{name}: GPU {g} does not exist: the cluster has {plan.available_gpus} GPU(s) "
                    f"(indices 0..{plan.available_gpus - 1}); Ray would wait for it forever"
                )
            if name not in users[g]:
                users[g].append(name)
    for name, entry in entries.items():
        if name in plan.stages and entry.exclusive and plan.stages[name].gpus:
            for g in plan.stages[name].gpus:
                others = [u for u in users[g] if u != name]
                if others:
                    raise PlacementError(
                        f"placement.{name}: GPU {g} is exclusive to {name} but {', '.join(others)} also use(s) it"
                    )
    tp = cfg.rollout.tensor_parallel_size
    rollout = plan.stages.get("rollout")
    if plan.available_gpus and rollout is not None and tp > 1 and (rollout.gpus or rollout.num_gpus != tp):
        raise PlacementError(
            f"placement.rollout: rollout.tensor_parallel_size {tp} needs {tp} GPUs in each rollout actor: leave "
            f"placement auto or set placement.rollout.num_gpus: {tp} without GPU indices (an index gives one GPU)")
    ranks, named = cfg.train.num_ranks, entries["trainer"].gpus
    if named and len(named) != ranks:
        raise PlacementError(
            f"placement.trainer: {len(named)} GPU(s) {list(named)} for train.num_ranks {ranks}: name one GPU per rank")
    if named and len(set(named)) < len(named):
        raise PlacementError(
            f"placement.trainer: GPUs {list(named)} put two trainer ranks on one GPU, which NCCL cannot "
            f"run; name {ranks} different GPUs")
    counted = sum(s.num_gpus * count_actors(cfg, n) for n, s in plan.stages.items() if not s.gpus)
    if counted and plan.bundles + math.ceil(counted - 1e-9) > plan.available_gpus:
        raise PlacementError(
            f"placement: stages ask Ray for {counted:g} GPU(s) by count besides {plan.bundles} by index, "
            f"but the cluster has {plan.available_gpus}; Ray would wait for them forever"
        )


def detect_nodes(address: str | None) -> list[dict[str, float]]:
    """The resources (``CPU``, custom ones) of each node the run's Ray cluster will have.

    A cluster this process has joined, or the one ``address`` / ``RAY_ADDRESS`` names,
    is asked; a local cluster still to start is this host with the CPUs Ray will count
    (its cgroup limit respected), and no custom resources.
    """
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if address or ray.is_initialized():
        from pipeline.runner import init_ray

        init_ray(address)
        return [{k: float(v) for k, v in n["Resources"].items()} for n in ray.nodes() if n.get("Alive")]
    try:
        from ray._private.utils import get_num_cpus

        cpus = float(get_num_cpus())
    except (ImportError, AttributeError):  # pragma: no cover - Ray moved it: the host's count
        cpus = float(os.cpu_count() or 1)
    return [{"CPU": cpus}]


def check_resources(cfg: ConveyorConfig, stages: list[str], nodes: list[dict[str, float]]) -> None:
    """Refuse, with ``PlacementError`` naming the stage and field, CPUs or custom resources
    the cluster (``nodes``: ``detect_nodes``) cannot grant: one actor's share beyond every
    node's, or all the stages' CPUs together beyond the cluster's. Ray would keep such an
    actor pending, and the run waiting for it, forever."""
    entries = _entries(cfg)
    largest = max((n.get("CPU", 0.0) for n in nodes), default=0.0)
    asked: dict[str, float] = {}
    for name in stages:
        entry = entries.get(name)
        if entry is None:
            continue
        if entry.num_cpus > largest:
            raise PlacementError(f"placement.{name}.num_cpus: {entry.num_cpus:g} CPUs for each {name} actor, but "
                                 f"the largest node of the cluster has {largest:g}; Ray would wait for it forever")
        for resource, amount in entry.resources.items():
            offered = max((n.get(resource, 0.0) for n in nodes), default=0.0)
            if amount > offered:
                has = f"at most {offered:g} on a node" if offered else "no node offers it"
                raise PlacementError(
                    f"placement.{name}.resources: {resource!r} {amount:g} for each {name} actor, but {has} "
                    f"(a node offers it with `ray start --resources '{{\"{resource}\": N}}'`); Ray would wait "
                    f"for it forever")
        if entry.num_cpus:
            asked[name] = entry.num_cpus * count_actors(cfg, name)
    total = sum(n.get("CPU", 0.0) for n in nodes)
    if sum(asked.values()) > total:
        parts = ", ".join(f"{name} {cpus:g}" for name, cpus in asked.items())
        raise PlacementError(f"placement: the stages ask for {sum(asked.values()):g} CPUs in all ({parts}), but the "
                             f"cluster has {total:g}; Ray would wait for the rest forever")


def detect_host_memory(address: str | None) -> int:
    """This host's memory in bytes for a local cluster; 0 (unknown) for an existing one
    (``address`` / ``RAY_ADDRESS``), whose trainer may run elsewhere."""
    if address or os.environ.get("RAY_ADDRESS"):
        return 0
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def detect_gpus(address: str | None) -> tuple[int, int]:
    """(GPUs the run's Ray cluster will have, memory of one in bytes; 0 if unknown).

    A local cluster sees this host's GPUs (``CUDA_VISIBLE_DEVICES`` respected, as Ray
    does); an existing cluster (``address`` / ``RAY_ADDRESS``) is asked.
    """
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        import ray

        from pipeline.runner import init_ray

        init_ray(address)
        return int(ray.cluster_resources().get("GPU", 0)), 0
    # nvidia-smi, like Ray's own detection, creates no CUDA context in this process.
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0, 0
    mib = [int(x) for x in out.split() if x.strip().isdigit()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        keep = [int(v) for v in visible.split(",") if v.strip().isdigit()]
        mib = [mib[i] for i in keep if i < len(mib)]
    return len(mib), (min(mib) << 20) if mib else 0
