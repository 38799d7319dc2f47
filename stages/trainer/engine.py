"""The trainer's compute core: a DeepSpeed engine that accumulates GRPO gradients over a
variable number of micro-batch pieces and takes one optimizer step when told to.

Guarantees:
- ``train_micro_batch`` only accumulates gradients; ``optimizer_step`` is the single place
  weights change, exactly once per call, and ``version`` counts those calls (with
  ``bump_version``) from 0;
- a step's gradient is ``grad_scale`` times that of ``sum(scale_k * loss_k)`` over its
  pieces: neither chunking inside a piece nor the split into pieces changes the update
  beyond float rounding;
- after a ``train_micro_batch`` that raised mid-backward, ``optimizer_step`` refuses until
  ``discard_gradients``;
- a non-finite step is not applied: weights, moments, schedule and ``version`` stay as
  they were, on every rank alike;
- weights leave under their Hugging Face names, in the rollout dtype, tied parameters
  once, whole (safetensors bytes or a ``cuda_ipc`` descriptor); with ``model.lora`` only
  the adapters train, and the layers holding them leave merged, with the fingerprint of
  the rest (``stages/models/lora.py``); its state saves the adapters and their
  optimizer alone;
- on CPU the same state and inputs give bitwise-identical results; ``save_state`` /
  ``load_state`` round-trip exactly; a ``save_state`` that cannot write (a full disk)
  raises the ``OSError`` that stopped it. Details: docs/architecture.md, "Trainer engine".
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from pipeline.config import AlgorithmFields, LoraConfig, TrainConfig
from pipeline.dtypes import resolve_dtype
from pipeline.memory.packing import count_pass_tokens, plan_passes
from pipeline.placement import count_sync_slots
from pipeline.transport import CudaIpcExporter
from pipeline.types import RolloutBatch
from pipeline.weights import build_payload, compute_sha256, drop_tied_duplicates, serialize_weights
from stages.algorithms import build_policy_loss
from stages.algorithms.aggregation import get_loss_aggregation
from stages.models.checkpoint_names import checkpoint_state_dict, drop_tied_aliases, find_split_ties
from stages.models.logprobs import (
    accepts_logits_to_keep,
    build_model_inputs,
    find_chunkable_head,
    forward_completion_logprobs,
    select_pass_inputs,
)
from stages.models.tiny import resolve_model_path
from stages.trainer.lr_schedule import build_lr_scheduler

_STATE_TAG = "conveyor"
# Files a checkpoint directory holds besides weights and config: tokenizer, chat
# template, custom code. Weight files are never copied (we write our own).
# Weights and the index of a sharded checkpoint's files (``model.safetensors.index.json``):
# an exported checkpoint has its own, and a source's index names shards it lacks.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".index.json")


def copy_model_files(model_path: Path, out: Path, config: bool = True) -> None:
    """Tokenizer, chat template and custom code from ``model_path`` (``config``: and the
    model's config files too) into ``out``, never weights, their index, a source's
    adapter config (a full export has no adapter; peft writes an adapter's own), nor
    what ``out`` already holds."""
    for src in sorted(Path(model_path).iterdir()):
        if (not src.is_file() or src.name.endswith(_WEIGHT_SUFFIXES) or src.name == "adapter_config.json"
                or (out / src.name).exists()):
            continue
        if config or src.name not in ("config.json", "generation_config.json"):
            shutil.copy2(src, out / src.name)


def find_free_port() -> int:
    """A TCP port free right now on every interface of this host (the rendezvous of the
    trainer's ranks, one or several)."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def ensure_single_process_env() -> bool:
    """Set the torch.distributed rendezvous variables for a world of one, unless set;
    True when it chose ``MASTER_PORT`` itself.

    The trainer is one process inside a Ray actor, not a ``deepspeed`` launcher child,
    so nothing else provides them.
    """
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" in os.environ:
        return False
    os.environ["MASTER_PORT"] = str(find_free_port())
    return True


PORT_ATTEMPTS = 3


def init_on_a_free_port(init: Any, chose_port: bool) -> Any:
    """``init()``; when it fails because the port this process chose was taken between
    the choice and the bind (another trainer starting on this host at the same moment
    was given the same free port), again on a new one, ``PORT_ATTEMPTS`` times at most.
    A port set by the user is never changed."""
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return init()
        except Exception as exc:
            if not chose_port or "EADDRINUSE" not in str(exc):
                raise
            os.environ["MASTER_PORT"] = str(find_free_port())
    return init()  # the last attempt: its error is the caller's


def build_deepspeed_config(train: TrainConfig, dtype: str, has_gpu: bool) -> dict[str, Any]:
    """The DeepSpeed config dict for ``train`` (see the module guarantees).

    Mixed precision only on a GPU: on CPU the master weights and the math stay float32
    and weights are cast to ``dtype`` when they leave the engine. A bf16 run with
    ``train.grad_accum_dtype: fp32`` (the default) sets DeepSpeed's
    ``data_types.grad_accum_dtype: fp32``: its BF16 optimizer then holds fp32 master
    weights and adds every piece's gradients into fp32 accumulators. DeepSpeed reaches
    that optimizer through ZeRO 1 only (ZeRO 0 with fp32 accumulation is not
    implemented), so stage 0 becomes 1, which partitions nothing in a single process;
    ZeRO 2 accumulates its partitions in fp32 itself. With ``train.num_ranks`` > 1 stage
    0 becomes 1 too: ZeRO's optimizer reports the norm of the ranks' averaged gradients
    (torch AdamW's would be read before DeepSpeed averages them, inside ``step()``).
    ``train.offload_optimizer`` needs ZeRO as well (stage 0 becomes 1): DeepSpeed's
    ZeRO-Offload, its host buffers pinned on a GPU.
    """
    bf16 = has_gpu and dtype == "bfloat16"
    fp32_accum = bf16 and train.grad_accum_dtype == "fp32"
    several_ranks = train.num_ranks > 1
    offload = train.offload_optimizer
    stage = max(int(train.zero_stage), 1) if fp32_accum or several_ranks or offload else int(train.zero_stage)
    adam = {"lr": float(train.lr), "weight_decay": float(train.weight_decay), "torch_adam": True}
    return {
        # One sample per "micro-batch" and no managed accumulation: DeepSpeed's counters
        # are bypassed, the boundary is each optimizer_step call.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(train.grad_clip),
        # Offloaded, torch's fused AdamW steps the host copies (one vectorised kernel a
        # tensor) instead of DeepSpeed's CPU Adam, which is compiled on first use.
        "optimizer": {"type": "AdamW", "params": {**adam, "fused": True} if offload else adam},
        "zero_optimization": {"stage": stage, **({"offload_optimizer": {"device": "cpu", "pin_memory": has_gpu}}
                                                 if offload else {})},
        "zero_allow_untested_optimizer": True,
        **({"zero_force_ds_cpu_optimizer": False} if offload else {}),
        # A non-finite gradient norm skips the step inside the optimizer (see the module guarantees).
        "bf16": {"enabled": bf16, "check_grad_overflow": True},
        **({"data_types": {"grad_accum_dtype": "fp32"}} if fp32_accum else {}),
        "fp16": {"enabled": has_gpu and dtype == "float16"},
        "steps_per_print": 1 << 62,
        "wall_clock_breakdown": False,
    }


def compute_chunk_weights(completion_mask: torch.Tensor, groups: Sequence[Sequence[int] | np.ndarray],
                          loss_agg: str) -> list[float]:
    """Weight of each pass (a group of row indices, any order, each row in at most one)
    so that ``sum(w_k * loss(rows of group k)) == loss(all rows)``.

    ``completion_mask`` [S, C]. token-mean: the group's share of valid tokens;
    seq-mean-token-sum-norm: its share of rows (the constant normaliser counts every row);
    other seq-mean-*: its share of sequences with at least one valid token (the sequences
    ``aggregate_loss`` averages over). A group with no such tokens or sequences weighs 0.
    """
    units = get_loss_aggregation(loss_agg).row_units(completion_mask)
    counts = [float(units[torch.as_tensor(np.asarray(rows, dtype=np.int64))].sum()) for rows in groups]
    total = sum(counts)
    return [c / total if total > 0 else 0.0 for c in counts]


def align_chunk_size(chunk_size: int, algo: AlgorithmFields) -> int:
    """Samples per forward/backward pass for ``algo``: ``chunk_size``, except that an
    offline algorithm's loss (``dpo``) compares rows in (chosen, rejected) pairs, so its
    chunks hold whole pairs: an odd size is rounded down to even (2 at least)."""
    if not algo.offline:
        return chunk_size
    return max(2, chunk_size - chunk_size % 2)


def count_unit_rows(algo: AlgorithmFields) -> int:
    """Rows a pass never splits: an offline algorithm's (chosen, rejected) pair, else one."""
    return 2 if algo.offline else 1


def encode_rng_state() -> bytes:
    """torch (CPU and CUDA), numpy and python RNG states as msgpack (no pickle)."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state().numpy().tobytes(),
        "cuda": [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "numpy": [np_state[0], np_state[1].astype(np.uint32).tobytes(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_version, list(py_internal), py_gauss],
    }
    return msgspec.msgpack.encode(state)


def decode_rng_state(data: bytes) -> None:
    """Inverse of ``encode_rng_state``: restore every RNG it captured."""
    state = msgspec.msgpack.decode(data)
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in state["cuda"]])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.frombuffer(keys, dtype=np.uint32).copy(), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def load_state_file(path: str, map_location: Any = None) -> Any:
    """``torch.load`` with the weights-only unpickler: tensors, containers, numbers and
    the few plain DeepSpeed records its optimizer states hold, nothing that runs code."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
        return torch.load(path, map_location=map_location, weights_only=True)


class _WriteErrorKeeper:
    """The file ``torch.save`` writes to, keeping the ``OSError`` a write raised: torch's
    zip writer reports a failed write (a full disk) as a RuntimeError of its own."""

    def __init__(self, file: Any) -> None:
        self.file, self.error = file, None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.file.flush()


def save_state_file(state_dict: Any, path: str) -> None:
    """``torch.save`` of one DeepSpeed state file (the checkpoint engine's ``save``,
    whose argument names it keeps); a write that fails raises the
    ``OSError`` that failed it (ENOSPC for a full disk), which a checkpoint's writer
    answers by ``train.on_checkpoint_error``, instead of torch's RuntimeError."""
    with open(path, "wb") as f:
        keeper = _WriteErrorKeeper(f)
        try:
            torch.save(state_dict, keeper)
        except RuntimeError as exc:
            if keeper.error is None:
                raise
            raise keeper.error from exc


def skip_shm_comm_build() -> None:
    """Keep DeepSpeed from building its shared-memory all-reduce op in this process.

    On the CPU, every ``deepspeed.initialize`` compiles ``deepspeed_shm_comm`` with ninja
    (or finds it built), holding a lock file in the torch extensions folder
    (``~/.cache/torch_extensions``) meanwhile. A process killed while it held the lock,
    a stopped run or CI job, leaves the file behind, and every later trainer on that
    machine waits for it forever, in torch's ``FileBaton.wait``. The op serves
    DeepSpeed's ``inference_all_reduce`` only; the trainer's collectives go through
    torch.distributed. So it is marked incompatible in the probe DeepSpeed keeps for
    the process (``deepspeed.ops.__compatible_ops__``) and never built or loaded.
    On a GPU its accelerator has no such op and the mark changes nothing."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def build_deepspeed_engine(model: Any, train: TrainConfig, dtype: str, total_steps: int = 0) -> Any:
    """``model`` (float32, train mode) wrapped in a single-process DeepSpeed engine with
    ``build_deepspeed_config(train, ...)`` and ``train``'s lr schedule over
    ``total_steps`` optimizer steps. The trainer and the critic both build theirs here."""
    import deepspeed  # heavy import; only the training processes pay for it

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    skip_shm_comm_build()
    chose_port = ensure_single_process_env()
    ds_config = build_deepspeed_config(train, dtype, torch.cuda.is_available())
    params = [p for p in model.parameters() if p.requires_grad]
    scheduler = build_lr_scheduler(train.lr_scheduler, train.warmup_steps, total_steps, train.min_lr_ratio)
    engine, _, _, _ = init_on_a_free_port(lambda: deepspeed.initialize(
        model=model, model_parameters=params, config=ds_config, lr_scheduler=scheduler), chose_port)
    return engine


def enable_gradient_checkpointing(model: Any) -> None:
    """``train.gradient_checkpointing``: transformers recomputes each block in backward
    (non-reentrant ``torch.utils.checkpoint``, so frozen inputs need no grad hook and a
    compiled block is recomputed compiled); ``ValueError`` for a model class without it."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"train.gradient_checkpointing: {type(model).__name__} does not support gradient "
                         f"checkpointing; set it false")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def find_blocks(model: Any) -> list[torch.nn.Module]:
    """The model's transformer blocks: the modules of the classes its Hugging Face
    class lists in ``_no_split_modules`` (``LlamaDecoderLayer``, ``Qwen2DecoderLayer``,
    ...), in model order; none for a model that lists none."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def plan_compile(mode: str, on_gpu: bool, zero_stage: int, compiler: str | None, experts: bool = False) -> str:
    """Why the blocks stay eager under ``train.compile: mode``; "" to compile them.
    ``compiler``: the one the kernels would be built with (``find_compiler``), None if
    there is none: ``auto`` then stays eager, ``on`` raises ``ValueError``. ``experts``:
    the blocks are a mixture of experts."""
    if mode == "off":
        return "train.compile is off"
    if mode == "auto" and not on_gpu:
        return "no GPU (train.compile: auto compiles on a GPU)"
    if mode == "auto" and zero_stage >= 3:
        return "ZeRO 3 gathers parameters module by module (train.compile: auto leaves it eager)"
    if mode == "auto" and experts:
        return "mixture-of-experts blocks route tokens data-dependently (train.compile: auto leaves them eager)"
    if compiler is None:
        need = "a C compiler for Triton ($CC, gcc or clang)" if on_gpu else "a C++ compiler for inductor ($CXX or g++)"
        if mode == "on":
            raise ValueError(f"train.compile: on needs {need} on PATH; none found (auto or off runs eager)")
        return f"no {need} on PATH"
    return ""


def compile_blocks(model: Any, mode: str, on_gpu: bool, zero_stage: int) -> tuple[int, str]:
    """Compile ``model``'s blocks in place (``nn.Module.compile``: parameter names, the
    state dict and DeepSpeed's hooks stay as they are; shapes dynamic, so the batch and
    the sequence length vary without recompiling). Every block shares one compiled
    graph; it is built by the first forward and backward. Returns (blocks compiled, why
    none were: "" when some were)."""
    from pipeline.preflight import find_compiler

    experts = any(p.dim() == 3 for p in model.parameters())  # transformers stacks a layer's experts
    why = plan_compile(mode, on_gpu, zero_stage, find_compiler(on_gpu), experts)
    if why:
        return 0, why
    blocks = find_blocks(model)
    if not blocks:
        return 0, f"{type(model).__name__} names no transformer block class (_no_split_modules)"
    for block in blocks:
        block.compile(dynamic=True)
    return len(blocks), ""


def optimizer_reports_grad_norm(optimizer: Any) -> bool:
    """Whether DeepSpeed's ``optimizer`` computes the gradient norm itself during
    ``step()`` (ZeRO, the bf16/fp16 wrappers); torch AdamW under ZeRO 0 does not."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    # The BF16 optimizer sets its norm (of its fp32 accumulators) only inside step().
    return isinstance(optimizer, BF16_Optimizer) or hasattr(optimizer, "_global_grad_norm")


def compute_grad_norm(module: Any) -> float:
    """Global L2 norm of ``module``'s accumulated gradients (float64 sum of squares)."""
    total = 0.0
    for param in module.parameters():
        if param.grad is not None:
            total += float(param.grad.detach().double().square().sum())
    return math.sqrt(total)


def save_engine_state(engine: Any, path: Path, client_state: dict[str, Any], trainable_only: bool = False) -> None:
    """Model, optimizer and lr schedule of a DeepSpeed ``engine`` under directory ``path``,
    with ``client_state`` (plain numbers and bytes) beside them; ``trainable_only``: the
    model's trainable parameters alone (LoRA: the adapters, not the frozen base)."""
    engine.checkpoint_engine.save = save_state_file
    engine.save_checkpoint(str(path), tag=_STATE_TAG, client_state=client_state, save_latest=False,
                           exclude_frozen_parameters=trainable_only)


def load_trainable_state(src: Mapping[str, torch.Tensor], dst: torch.nn.Module) -> None:
    """Load a module state saved without its frozen parameters (``save_engine_state``'s
    ``trainable_only``) into ``dst``: every trainable parameter must be in ``src``, and
    ``src`` may name nothing ``dst`` lacks."""
    own = dict(dst.named_parameters())
    trainable = {name for name, param in own.items() if param.requires_grad}
    missing, unknown = sorted(trainable - set(src)), sorted(set(src) - set(dst.state_dict(keep_vars=True)))
    if missing or unknown:
        raise ValueError(f"engine state does not fit the model: trainable parameters missing {missing[:5]}, "
                         f"unknown names {unknown[:5]} (was it saved with the same model.lora?)")
    dst.load_state_dict(dict(src), strict=False)


def load_engine_state(engine: Any, path: Path, trainable_only: bool = False) -> dict[str, Any]:
    """Inverse of ``save_engine_state``; returns the ``client_state``. Files are read with
    the weights-only unpickler (``load_state_file``): a tampered file is refused.
    ``trainable_only``: the state holds the trainable parameters alone (LoRA's adapters)."""
    engine.checkpoint_engine.load = load_state_file
    load_path, client_state = engine.load_checkpoint(
        str(path), tag=_STATE_TAG, load_optimizer_states=True, load_lr_scheduler_states=True,
        custom_load_fn=load_trainable_state if trainable_only else None,
    )
    if load_path is None:
        raise FileNotFoundError(f"no engine state under {path}")
    return dict(client_state)


class TrainerEngine:
    """DeepSpeed-backed GRPO learner on one process (see the module guarantees).

    ``dtype`` is the model's (and rollout's) dtype: weights are exported in it and the
    engine trains in it with mixed precision where a GPU exists; on CPU it trains in
    float32. A micro-batch runs in the passes ``plan_passes`` makes of it:
    ``pass_tokens`` (default ``train.pass_tokens``) padded tokens per forward/backward
    pass, rows grouped by length; 0: ``chunk_size`` (default ``train.chunk_size``)
    consecutive samples per pass.
    """

    def __init__(
        self,
        model_path: Path,
        train: TrainConfig,
        algo: AlgorithmFields,
        temperature: float,
        dtype: str,
        seed: int,
        threads: int | None = None,
        chunk_size: int | None = None,
        total_steps: int = 0,
        lora: LoraConfig | None = None,
        serve_dtype: str | None = None,
        pass_tokens: int | None = None,
        whole_syncs: bool = False,
        sync_slots: int = 2,
    ) -> None:
        threads = train.threads if threads is None else threads
        if threads > 0:
            torch.set_num_threads(threads)
        sync_dtype = resolve_dtype(dtype)
        # The dtype the rollout serves: a partial (LoRA) payload's rest is measured in it.
        self.serve_dtype = sync_dtype if serve_dtype is None else resolve_dtype(serve_dtype, "rollout.dtype")
        # With LoRA, every sync carries the whole merged model rather than the adapted layers
        # alone: a rollout engine that sleeps (rollout.sleep_mode) discards its weights, so
        # the layers a partial payload leaves out would be undefined after it wakes.
        self.whole_syncs = whole_syncs
        self.sync_slots = sync_slots  # cuda_ipc ring slots (pipeline.placement.count_sync_slots)
        chunk_size = train.chunk_size if chunk_size is None else chunk_size
        if chunk_size < 1:
            raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
        chunk_size = align_chunk_size(chunk_size, algo)
        pass_tokens = train.pass_tokens if pass_tokens is None else pass_tokens
        if pass_tokens < 0:
            raise ValueError(f"train.pass_tokens: expected >= 0 (0: chunks of chunk_size samples), got {pass_tokens}")
        if temperature <= 0:
            # Log-probs at temperature 0 (greedy rollouts) are undefined: no ratio exists.
            raise ValueError(f"temperature: expected > 0 (the rollout sampling temperature), got {temperature}")
        self.model_path = Path(model_path)
        self.train_cfg = train
        self.algo = algo
        self.temperature = float(temperature)
        self.sync_dtype = sync_dtype
        self.chunk_size = chunk_size
        self.pass_tokens = pass_tokens
        self.unit_rows = count_unit_rows(algo)
        self.version = 0
        self._pieces = 0  # backward passes since the last optimizer step
        # Small numbers the trainer stage keeps with the engine's state (the KL
        # controller's coefficient): saved and restored by save_state / load_state.
        self.extra_state: dict[str, float] = {}
        self.gradients_tainted = False  # a failed call accumulated part of its piece
        # PPO's later epochs with a decoupled objective (algorithm.off_policy truncate or
        # reject): sample id -> the log-probs of its completion tokens when this step first
        # trained it, the ratio's anchor in every later pass (see ``_proximal``).
        self.keeps_anchor = algo.off_policy != "off" and train.ppo_epochs > 1
        self._anchors: dict[str, np.ndarray] = {}
        self._nonfinite_loss = False  # a piece of the current step had a NaN or infinite loss

        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        self.router_aux_loss_coef = float(train.router_aux_loss_coef)
        if self.router_aux_loss_coef and not hasattr(model.config, "output_router_logits"):
            raise ValueError(f"train.router_aux_loss_coef: {self.router_aux_loss_coef:g} needs a mixture of experts; "
                             f"{type(model).__name__} at {self.model_path} has no router")
        # model.lora: adapters injected in place; the model keeps its class and DeepSpeed
        # trains it as usual, its frozen base outside the optimizer.
        self.lora = lora if lora is not None and lora.enabled else None
        self.peft_model: Any = None
        if self.lora is not None:
            from stages.models.lora import apply_lora

            self.peft_model = apply_lora(model, self.lora)
        self.gradient_checkpointing = bool(train.gradient_checkpointing)
        if self.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        model.train()
        # total_steps: the run's optimizer steps, where a decaying lr schedule ends.
        self.engine = build_deepspeed_engine(model, train, dtype, total_steps)
        self.module = self.engine.module
        # (blocks compiled, why none were): see compile_blocks.
        self.compiled_blocks, self.compile_skipped = compile_blocks(
            self.module, train.compile, self.weights_on_gpu, int(train.zero_stage))
        self._keep = accepts_logits_to_keep(self.module)
        split = find_split_ties(self.module)
        if split:
            # The served model holds one tensor for both names; training two would serve
            # a model other than the one trained.
            raise RuntimeError(f"tied parameters are separate tensors in the trainer: {split}")
        # Rows of logits alive at once (stages.models.logprobs); None: the dense head.
        self.logit_tokens = train.logit_chunk_tokens if find_chunkable_head(self.module) is not None else None
        self._ipc: CudaIpcExporter | None = None  # made on the first cuda_ipc export
        self._loss = build_policy_loss(algo)
        self._lora_weights: Any = None
        if self.lora is not None:
            from stages.models.lora import LoraWeights

            self._lora_weights = LoraWeights(self.module)

    # ------------------------------------------------------------------ training

    def plan_passes(self, batch: RolloutBatch) -> list[np.ndarray]:
        """The row indices of each forward/backward pass ``train_micro_batch`` makes over
        ``batch`` (``pipeline.memory.packing.plan_passes``; pairs stay whole)."""
        lens = np.asarray(batch.prompt_lens) + np.asarray(batch.completion_lens)
        return plan_passes(lens, self.pass_tokens, self.chunk_size, self.unit_rows)

    def train_micro_batch(self, batch: RolloutBatch, scale: float) -> dict[str, float]:
        """Accumulate ``scale * loss(batch)`` gradients; never steps the optimizer.

        ``batch.advantages`` and ``batch.loss_mask`` [S, C] were assigned by the algorithm
        (``stages.algorithms.assign_advantages``) before; the old policy is
        ``batch.behaviour_logprobs`` [S, C]; ``batch.ref_logprobs`` [S, C] adds the KL
        penalty when present and ``kl_coef > 0``. Returns the piece's metrics (``loss``
        unscaled) and its pass counts: ``passes``, ``pass_real_tokens`` (prompt +
        completion tokens), ``pass_tokens`` (what the passes computed, padding included)
        and ``pass_tokens_unpacked`` (what chunks of ``chunk_size`` consecutive samples
        would have).
        """
        if batch.advantages is None or batch.loss_mask is None:
            raise ValueError(f"batch {batch.batch_id}: no advantages; assign_advantages must run first")
        if batch.num_samples == 0:
            raise ValueError(f"batch {batch.batch_id}: no samples")
        rewards = torch.as_tensor(np.asarray(batch.rewards if batch.rewards is not None else [0.0], dtype=np.float32))
        advantages = torch.as_tensor(np.asarray(batch.advantages, dtype=np.float32))
        input_ids, attention_mask, completion_mask, positions = build_model_inputs(batch)
        completion_mask = completion_mask * torch.as_tensor(np.asarray(batch.loss_mask), dtype=completion_mask.dtype)
        inputs = (input_ids, attention_mask, completion_mask, positions)
        old = torch.as_tensor(np.asarray(batch.behaviour_logprobs, dtype=np.float32))
        # Tokens sampled by the weights being trained: their |logp - old| is sampler numerics.
        fresh = torch.as_tensor(np.asarray(batch.token_versions) == self.version)
        ref = None if batch.ref_logprobs is None else torch.as_tensor(np.asarray(batch.ref_logprobs, dtype=np.float32))
        kl_coef = self.algo.kl_coef if ref is not None else 0.0

        passes = self.plan_passes(batch)
        weights = compute_chunk_weights(completion_mask, passes, self.algo.loss_agg)
        totals: dict[str, float] = {**self._count_pass_tokens(batch, passes)}
        loss_total = 0.0
        fresh_tokens, mismatch_sum = 0.0, 0.0
        began = False  # set before a backward: one that fails midway has already written part
        try:
            for rows, weight in zip(passes, weights, strict=True):
                entropy: list[torch.Tensor] = []
                router: list[torch.Tensor] | None = [] if self.router_aux_loss_coef else None
                ids, att, chunk_mask, pos = select_pass_inputs(inputs, rows, batch.completion_lens)
                logprobs = forward_completion_logprobs(
                    self.engine, ids, att, chunk_mask, pos, temperature=self.temperature,
                    use_logits_to_keep=self._keep, entropy_out=entropy, router_loss_out=router,
                    chunk_tokens=self.logit_tokens or 0,
                )
                device = logprobs.device
                chunk_mask = chunk_mask.to(device)
                index, width = torch.from_numpy(rows), chunk_mask.shape[1]

                def take(t: torch.Tensor, index: torch.Tensor = index, width: int = width,
                         device: torch.device = device) -> torch.Tensor:
                    """The pass's rows (and completion columns) of a per-sample [S] or [S, C] tensor."""
                    t = t.index_select(0, index)
                    return (t[:, :width] if t.dim() == 2 else t).to(device)

                prox = self._proximal(batch, rows, logprobs) if self.keeps_anchor else None
                loss, metrics = self._loss(
                    logprobs, take(old), take(advantages), chunk_mask,
                    ref_logprobs=None if ref is None else take(ref), kl_coef=kl_coef,
                    fresh_mask=take(fresh), **({} if prox is None else {"prox_logprobs": prox}),
                )
                mismatch = (metrics.pop("logp_mismatch", 0.0), metrics.pop("logp_mismatch_tokens", 0.0))
                fresh_tokens += mismatch[1]
                mismatch_sum += mismatch[0] * mismatch[1]
                # Mean entropy of the loss tokens' distributions (from the logits in hand).
                metrics["entropy"] = float((entropy[0] * chunk_mask).sum() / chunk_mask.sum().clamp(min=1.0))
                if router:
                    loss = loss + self.router_aux_loss_coef * router[0].to(loss.device, loss.dtype)
                    metrics["router_aux_loss"] = float(router[0].detach())
                # Backward per chunk frees its activations before the next forward: memory
                # is bounded by one chunk. A zero-weight chunk (no valid token) adds zeros.
                began = True
                self.engine.backward(loss * (weight * scale), scale_wrt_gas=False)
                loss_total += weight * float(loss.detach())
                for key, value in metrics.items():
                    value = float(value)
                    if key.endswith("_max"):
                        totals[key] = max(totals.get(key, -math.inf), value)
                    else:
                        totals[key] = totals.get(key, 0.0) + weight * value
        except BaseException:
            self.gradients_tainted = self.gradients_tainted or began
            raise
        self._pieces += 1
        if fresh_tokens:  # absent, not 0, when no token came from these weights
            totals.update(logp_mismatch=mismatch_sum / fresh_tokens, logp_mismatch_tokens=fresh_tokens)
        self._nonfinite_loss = self._nonfinite_loss or not math.isfinite(loss_total)
        return {
            "loss": loss_total,
            **totals,
            "num_samples": float(batch.num_samples),
            "num_tokens": float(batch.completion_tokens),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "adv_abs_mean": float((advantages.abs() * completion_mask).sum() / completion_mask.sum().clamp(min=1.0)),
            "scale": float(scale),
        }

    def _count_pass_tokens(self, batch: RolloutBatch, passes: list[np.ndarray]) -> dict[str, float]:
        """The pass counts ``train_micro_batch`` reports (see there)."""
        lens = np.asarray(batch.prompt_lens) + np.asarray(batch.completion_lens)
        real, computed = count_pass_tokens(lens, passes)
        unpacked = passes if self.pass_tokens == 0 else plan_passes(lens, 0, self.chunk_size, self.unit_rows)
        return {"passes": float(len(passes)), "pass_real_tokens": float(real), "pass_tokens": float(computed),
                "pass_tokens_unpacked": float(count_pass_tokens(lens, unpacked)[1])}

    def _proximal(self, batch: RolloutBatch, rows: np.ndarray, logprobs: torch.Tensor) -> torch.Tensor:
        """The anchor [rows, width] of the pass over ``batch``'s rows ``rows`` whose current
        log-probs are ``logprobs``: per sample, the log-probs its step's first pass
        computed (kept here by sample id until the step's last update); a sample seen for
        the first time keeps its own, detached. Positions past a completion keep the
        current values (the loss masks them). A pass's width covers each of its rows'
        completion, whatever rows share it."""
        out = logprobs.detach().clone()
        for k, row in enumerate(rows):
            sid, length = batch.sample_ids[row], int(batch.completion_lens[row])
            kept = self._anchors.get(sid)
            if kept is None:
                self._anchors[sid] = out[k, :length].float().cpu().numpy()
            else:
                out[k, :length] = torch.as_tensor(kept, dtype=out.dtype, device=out.device)
        return out

    def warm_up_compile(self) -> float:
        """Build the compiled blocks' graphs now, at set-up (beside vLLM's start), rather
        than in the first step (``warm_up_passes``). Returns its seconds; 0 where no
        block compiled."""
        if not self.compiled_blocks:
            return 0.0
        began = time.monotonic()
        self.warm_up_passes()
        return time.monotonic() - began

    def warm_up_passes(self) -> None:
        """Forward and backward passes, at zero loss, of synthetic rows in the three forms
        passes take (rows of different lengths, so padded; rows of one length, unpadded;
        one row alone, whose batch of 1 dynamo specializes), through the trainer's own
        forward. Gradients are discarded and the random state restored, so training is as
        without them."""
        rng = self.get_rng_state()
        vocab = int(self.module.get_input_embeddings().weight.shape[0])
        prompt = 4
        for lens in ((prompt + 13, prompt + 7), (prompt + 9, prompt + 9), (prompt + 11,)):
            rows, longest, width = len(lens), max(lens), max(lens) - prompt
            ids = torch.arange(rows * longest).reshape(rows, longest) % max(vocab - 1, 1) + 1
            mask = (torch.arange(longest)[None, :] < torch.tensor(lens)[:, None]).long()
            completion = (torch.arange(width)[None, :] < torch.tensor(lens)[:, None] - prompt).float()
            positions = (prompt + torch.arange(width)[None, :]).clamp(max=longest - 1).repeat(rows, 1)
            logprobs = forward_completion_logprobs(
                self.engine, ids * mask, mask, completion, positions, temperature=self.temperature,
                use_logits_to_keep=self._keep, entropy_out=[],
                router_loss_out=[] if self.router_aux_loss_coef else None, chunk_tokens=self.logit_tokens or 0)
            self.engine.backward(logprobs.sum() * 0.0, scale_wrt_gas=False)
        self._discard_gradients()
        self.set_rng_state(rng)

    def pad_backwards(self, batch: RolloutBatch, count: int) -> None:
        """``count`` forward/backward passes of ``batch``'s first sample with weight 0:
        they add nothing to the gradients, and give this data-parallel rank as many
        backward passes as the others (ZeRO 2 reduces inside every backward)."""
        if count <= 0:
            return
        input_ids, attention_mask, completion_mask, positions = build_model_inputs(batch)
        for _ in range(count):
            logprobs = forward_completion_logprobs(
                self.engine, input_ids[:1], attention_mask[:1], completion_mask[:1], positions[:1],
                temperature=self.temperature, use_logits_to_keep=self._keep, chunk_tokens=self.logit_tokens or 0)
            self.engine.backward(logprobs.sum() * 0.0, scale_wrt_gas=False)

    def optimizer_step(self, grad_scale: float = 1.0, bump_version: bool = True) -> dict[str, float]:
        """Multiply the accumulated gradients by ``grad_scale``, clip, step, zero them;
        bump ``version`` (``bump_version=False``: an update inside a policy step, PPO's
        mini-batches and epochs). Returns the pre-clip ``grad_norm`` (of the scaled
        gradients), the ``lr`` used and the number of pieces accumulated."""
        if self.gradients_tainted:
            raise RuntimeError(
                "optimizer_step: the gradients hold part of a piece whose training failed; "
                "discard_gradients() and train the step's pieces again first"
            )
        if self._pieces == 0:
            raise RuntimeError("optimizer_step: no micro-batch was trained since the last step")
        # torch AdamW under ZeRO 0 does not record the norm; ZeRO and the bf16/fp16
        # optimizers compute it themselves during step().
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        zero_scaled = grad_scale != 1.0 and isinstance(self.engine.optimizer,
                                                         DeepSpeedZeroOptimizer | DeepSpeedZeroOptimizer_Stage3)
        if grad_scale != 1.0 and not zero_scaled:
            self._scale_gradients(grad_scale)
        own_norm = None if optimizer_reports_grad_norm(self.engine.optimizer) else compute_grad_norm(self.module)
        lr = float(self.engine.get_lr()[0])
        if self._any_rank(self._nonfinite_loss or (own_norm is not None and not math.isfinite(own_norm))):
            return self._skip_nonfinite(own_norm, lr)
        skipped_before = self.engine.skipped_steps
        if zero_scaled:
            # ZeRO reduces gradients into its own partitions inside step() (stage 2: per
            # backward, unreachable before it) and divides them by its loss scale before
            # clipping there: dividing that scale by grad_scale for this one step is the
            # same multiplication at the same point. Measured equal to scaling the loss for
            # every DeepSpeed optimizer wrapper this engine can get (ZeRO 0-2, fp32, bf16).
            opt = self.engine.optimizer
            before = opt.loss_scale
            opt.loss_scale = before / grad_scale
            try:
                self.engine.step()
            finally:
                after = opt.loss_scale  # a dynamic (fp16) scaler may have moved it
                opt.loss_scale = before if after == before / grad_scale else after * grad_scale
        else:
            self.engine.step()
        grad_norm = own_norm if own_norm is not None else self.engine.get_global_grad_norm()
        pieces, self._pieces = self._pieces, 0
        skipped = self.engine.skipped_steps - skipped_before
        # DeepSpeed's optimizer found the norm invalid and left everything as it was
        # (under fp16 that is the loss scaler's routine, not a bad step).
        nonfinite = bool(skipped) and not self.engine.fp16_enabled()
        self.version += int(bump_version and not nonfinite)
        if bump_version:
            self._anchors.clear()  # a new step: its samples are first trained by new weights
        return {
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "lr": lr,
            "num_pieces": float(pieces),
            "skipped": float(skipped),
            "skipped_nonfinite": float(nonfinite),
        }

    def _skip_nonfinite(self, grad_norm: float | None, lr: float) -> dict[str, float]:
        """The step not taken: its gradients dropped, nothing else touched."""
        pieces = self._pieces
        self._discard_gradients()
        return {"grad_norm": math.nan if grad_norm is None else float(grad_norm), "lr": lr,
                "num_pieces": float(pieces), "skipped": 0.0, "skipped_nonfinite": 1.0}

    def _any_rank(self, flag: bool) -> bool:
        """``flag`` or-ed over the data-parallel ranks (one collective when there are
        several), so that they all skip a step or all take it."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return flag
        t = torch.tensor([float(flag)], device=next(self.module.parameters()).device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def release_cached_memory(self) -> tuple[int, int]:
        """Hand the CUDA allocator's cached blocks back (another process on this GPU
        needs them: ``placement: colocate``); (free, total) bytes of the GPU after it,
        (0, 0) without one."""
        from pipeline.memory.oom import free_cached_memory

        free_cached_memory()
        return torch.cuda.mem_get_info() if torch.cuda.is_available() else (0, 0)

    def discard_gradients(self) -> None:
        """Drop every gradient accumulated since the last optimizer step (the caller
        re-accumulates the step's pieces); clears ``gradients_tainted``."""
        self._discard_gradients()

    def _discard_gradients(self) -> None:
        # ZeRO keeps gradients in its own buffers; its zero_grad clears those too.
        if self.engine.zero_optimization():
            self.engine.optimizer.zero_grad()
        else:
            self.engine.zero_grad()
        self._pieces = 0
        self.gradients_tainted = False
        self._nonfinite_loss = False

    def _scale_gradients(self, factor: float) -> None:
        """Multiply the accumulated gradients where ``step()`` will read them: the fp32
        accumulators of DeepSpeed's BF16 optimizer, else each parameter's ``.grad``."""
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.utils import safe_update_full_grad_vectorized

        if isinstance(self.engine.optimizer, BF16_Optimizer):
            for flat in self.engine.optimizer.fp32_groups_gradients_flat:
                flat.mul_(factor)
            return
        params = [p for p in self.module.parameters() if p.requires_grad]
        safe_update_full_grad_vectorized(params, lambda grad, _param: grad.mul_(factor))

    # ------------------------------------------------------------------ weights out

    @property
    def partitioned(self) -> bool:
        """ZeRO 3: each rank holds a partition of every parameter."""
        return bool(self.engine.zero_optimization_partition_weights())

    def gathered_parameters(self) -> Any:
        """A context in which every parameter is whole on this rank: under ZeRO 3 a gather
        of the partitions (a collective: every rank enters it, with the same parameters in
        the same order; ``DataParallelEngine`` has the other ranks join), else nothing."""
        if not self.partitioned:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None)

    def _live_state(self, whole: bool) -> dict[str, torch.Tensor]:
        """The served model's names -> live tensor, tied parameters once: the module's
        state; with LoRA the base model's names, adapters merged, and unless ``whole``
        only the layers holding them (``LoraWeights.sync_state``). Call inside
        ``gathered_parameters``."""
        if self._lora_weights is not None:
            return self._lora_weights.merged_state() if whole else self._lora_weights.sync_state()
        return drop_tied_aliases(self.module, drop_tied_duplicates(self.module.state_dict()))

    def _rest_fingerprint(self) -> tuple[float, float] | None:
        """With LoRA's partial syncs, the fingerprint (in the served dtype) of what a sync
        leaves out; None for a whole payload."""
        if self._lora_weights is None or self.whole_syncs:
            return None
        with self.gathered_parameters():
            return self._lora_weights.rest_fingerprint(self.serve_dtype)

    def _module_state_for_sync(self, whole: bool = False) -> dict[str, torch.Tensor]:
        """The served names -> CPU copy in the rollout dtype; tied parameters once."""
        with self.gathered_parameters():
            live = self._live_state(whole)
            return {name: t.detach().to("cpu", self.sync_dtype, copy=True) for name, t in live.items()}

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> CPU copy in the rollout dtype; tied parameters once (with
        LoRA, the merged layers that hold adapters only). The names are the checkpoint's
        (``stages.models.checkpoint_names``): a mixture of experts' 3D expert tensors go
        one expert at a time, as vLLM loads them."""
        return checkpoint_state_dict(self.module, self._module_state_for_sync(whole=self.whole_syncs))

    @property
    def weights_on_gpu(self) -> bool:
        return next(self.module.parameters()).is_cuda

    def export_weights(self) -> tuple[bytes, str, tuple[float, float]]:
        """(safetensors bytes, their sha256, fingerprint) of the current weights (with
        LoRA a partial payload; the fingerprint is still the whole served model's)."""
        rest = self._rest_fingerprint()
        return build_payload(self.state_dict_for_sync(), rest)

    def export_weights_ipc(self) -> tuple[bytes, str, tuple[float, float]]:
        """(``cuda_ipc`` descriptor, its sha256, fingerprint) of the current weights, packed
        in the rollout dtype into buckets on this GPU (``pipeline.transport``); the
        descriptor's sha guards the descriptor, the fingerprint guards the weights."""
        if self._ipc is None:
            self._ipc = CudaIpcExporter(self.sync_dtype, slots=self.sync_slots)
        rest = self._rest_fingerprint()
        with self.gathered_parameters():
            state = self._live_state(whole=self.whole_syncs)
            data, fingerprint = self._ipc.export(checkpoint_state_dict(self.module, state), self.version, rest)
        return data, compute_sha256(data), fingerprint

    def weights_sha256(self) -> str:
        """sha256 of the bytes ``export_weights`` would ship now."""
        return compute_sha256(serialize_weights(self.state_dict_for_sync()))

    def save_pretrained(self, out_dir: Path, merged: bool | None = None) -> Path:
        """A Hugging Face checkpoint directory (weights in the rollout dtype, config,
        generation config, tokenizer files copied from ``model_path``). With LoRA it holds
        the adapter (peft's files, and the tokenizer's), and ``merged`` (default
        ``model.lora.export_merged``) adds the merged model under ``out_dir/merged``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.lora is not None:
            from stages.models.lora import save_adapter

            with self.gathered_parameters():
                save_adapter(self.peft_model, out)
            copy_model_files(self.model_path, out, config=False)
            if self.lora.export_merged if merged is None else merged:
                self._save_full(out / "merged")
            return out
        return self._save_full(out)

    def _save_full(self, out_dir: Path) -> Path:
        """The served model (LoRA: merged) as a Hugging Face checkpoint in ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # The served names: save_pretrained writes them as the checkpoint names them.
        self.module.save_pretrained(out, state_dict=self._module_state_for_sync(whole=True))
        # save_pretrained records the dtype of the live (float32) parameters; the
        # files hold the rollout dtype, and loaders with dtype="auto" read this field.
        config = self.module.config.__class__.from_dict(self.module.config.to_dict())
        config.dtype = self.sync_dtype
        config.save_pretrained(out)
        copy_model_files(self.model_path, out)
        return out

    # ------------------------------------------------------------------ replay state

    def save_state(self, path: Path) -> None:
        """Write model, optimizer state, version and RNG states under directory ``path``."""
        client_state = {"conveyor_version": self.version, "conveyor_rng": self.get_rng_state(),
                        "conveyor_extra": {k: float(v) for k, v in self.extra_state.items()}}
        save_engine_state(self.engine, path, client_state, trainable_only=self.lora is not None)

    def load_state(self, path: Path) -> None:
        """Restore what ``save_state`` wrote; pending (unstepped) gradients are dropped.

        DeepSpeed's state files are pickles; they are read with torch's weights-only
        unpickler (``load_state_file``), so a tampered file is refused, never executed.
        """
        client_state = load_engine_state(self.engine, path, trainable_only=self.lora is not None)
        self._discard_gradients()
        self._anchors.clear()
        self.version = int(client_state["conveyor_version"])
        self.extra_state = {k: float(v) for k, v in client_state.get("conveyor_extra", {}).items()}
        self.set_rng_state(client_state["conveyor_rng"])

    def get_rng_state(self) -> bytes:
        """All RNG states of this process as bytes (for ``StepRecord.rng_state``)."""
        return encode_rng_state()

    def set_rng_state(self, state: bytes) -> None:
        decode_rng_state(state)


def build_trainer_engine(cfg: Any, threads: int | None = None) -> Any:
    """The ``TrainerEngine`` of a run (the trainer stage and ``conveyor replay`` share it)."""
    return TrainerEngine(resolve_model_path(cfg.model), cfg.train, cfg.algorithm, temperature=cfg.scoring_temperature,
                         dtype=cfg.model.dtype, seed=cfg.run.seed, threads=threads, lora=cfg.model.lora,
                         serve_dtype=cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype,
                         whole_syncs=cfg.rollout.sleep_mode, sync_slots=count_sync_slots(cfg),
                         # The lr schedule counts optimizer updates: several per step with PPO epochs.
                         total_steps=cfg.run.steps * cfg.train.ppo_epochs * cfg.train.ppo_mini_batches)
