"""``train`` and ``critic``: the DeepSpeed trainer (optimizer, passes, checkpoints,
guards) and the value model PPO trains beside it; ``algorithm.kl_ctl``."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from pipeline.config.base import NonNegFloat, NonNegInt, PosFloat, PosInt, _section
from pipeline.config.memory import MemoryConfig


class CriticConfig(msgspec.Struct, **_section()):
    """The value model (``stages/trainer/critic.py``), a stage of its own that runs when the
    algorithm needs values (``algorithm.name: ppo``). ``path``: a local
    ``AutoModelForTokenClassification`` checkpoint with one label; None: the policy
    (``model.path``) with a fresh scalar head. It trains with DeepSpeed (``train``'s ZeRO
    stage and dtype) at its own ``lr`` on each micro-batch as it passes: ``epochs``
    passes of the clipped value loss (``value_clip``, None: unclipped) over the
    micro-batch's returns, one optimizer step each. ``chunk_size``: samples per forward."""

    path: str | None = None
    lr: PosFloat = 1e-5
    weight_decay: NonNegFloat = 0.0
    grad_clip: NonNegFloat = 1.0
    value_clip: PosFloat | None = 0.5
    epochs: PosInt = 1
    chunk_size: PosInt = 16
    threads: NonNegInt = 0  # torch threads in the critic; 0 = leave default


class TrainConfig(msgspec.Struct, **_section()):
    # The order verl and TRL use for a pretrained checkpoint; the embedded tiny model
    # learns at a far higher rate, which its configs (configs/quickstart.yaml) set.
    lr: PosFloat = 1e-6
    weight_decay: NonNegFloat = 0.0
    grad_clip: NonNegFloat = 1.0
    zero_stage: Annotated[int, Meta(ge=0, le=3)] = 0
    # DeepSpeed ZeRO-Offload: the fp32 master weights, gradients and AdamW's moments live
    # in host memory (pinned, 16 bytes a parameter) and the optimizer steps there (torch's
    # fused AdamW on the CPU); the GPU keeps the 16-bit weights and gradients and, with
    # grad_accum_dtype fp32, DeepSpeed's fp32 accumulators: 8 bytes a parameter instead
    # of 20 (4 with grad_accum_dtype bf16). For a model whose optimizer does not fit
    # beside vLLM on its GPUs (a 4B full fine-tune on one 80 GB GPU); a step then waits on
    # the copies and the CPU step. ZeRO stage 0 becomes 1.
    offload_optimizer: bool = False
    # Data-parallel DeepSpeed ranks of the one trainer stage (stages/trainer/ranks.py):
    # each on its own GPU where there are GPUs; a step's groups are split across them.
    num_ranks: PosInt = 1
    prompts_per_step: PosInt = 8  # GRPO groups per optimizer step
    sync_interval: PosInt = 1
    # Read the engine's weights back after every update (a mismatch stops the run);
    # off: once, at the end of the run. The payload's sha256 is checked either way.
    weight_sync_monitor: bool = True
    weight_sync_timeout_s: PosFloat = 300.0
    save_checkpoint: bool = True  # a Hugging Face checkpoint in <run dir>/checkpoint at the end
    # Resumable checkpoints (<run dir>/checkpoints/step-N: trainer state, ledger, prompts
    # done) every k steps (0: none) and at the end of every run, interrupted ones included.
    checkpoint_every: NonNegInt = 50
    keep_checkpoints: PosInt = 2
    # false: no resumable checkpoint at all, not even at the end (verl's save_freq -1,
    # TRL's save_strategy "no"): the run cannot be resumed. Each holds the weights and
    # the optimizer's state, 14 bytes a parameter in bf16: 52 GiB for a 4B model.
    resumable: bool = True
    # A checkpoint that cannot be written (a full disk): stop the run, status failed and
    # the last good checkpoint named (at most checkpoint_every steps to redo), or
    # continue and try again at the next interval.
    on_checkpoint_error: Literal["stop", "continue"] = "stop"
    # A step whose loss or gradient norm is NaN or infinite is not applied nor published
    # (its samples are dropped as nonfinite and replaced); this many in a row stop the
    # run, status failed, with the last good checkpoint named.
    max_bad_steps: PosInt = 3
    threads: NonNegInt = 0  # torch threads in the trainer; 0 = leave default
    # Samples per forward/backward pass when pass_tokens is 0 (verl's
    # ppo_micro_batch_size_per_gpu): activation memory is bounded by one chunk; larger
    # chunks launch fewer kernels per sample (the GPU's win on a small model). Admission
    # (train.memory) estimates with the passes the engine will run.
    chunk_size: PosInt = 16
    # Tokens per forward/backward pass of the trainer and the reference, prompt and
    # completion of each row counted at the length of the pass's longest row
    # (pipeline/memory/packing.py): rows are sorted by length, longest first, and grouped
    # while rows x longest <= pass_tokens (a longer row runs alone), so a pass costs about
    # its real tokens, not the micro-batch's longest sample per row. 0: fixed chunks of
    # chunk_size samples in batch order.
    pass_tokens: NonNegInt = 16384
    # Micro-batches already waiting in the trainer's queue when it is free are trained
    # as one, up to this many: their samples share passes of pass_tokens, so a trainer
    # that falls behind catches up in fuller passes (fewer, larger kernels) instead of
    # one short micro-batch at a time. Never across the end of a step (or of a PPO
    # mini-batch); a held step (colocate) is trained in units of this many. 1: each
    # micro-batch alone. The gradient is the same either way.
    gather_micro_batches: PosInt = 8
    # Rows of [tokens, vocabulary] logits alive at once when the trainer and the
    # reference compute log-probs (stages/models/logprobs.py: the output head runs on completion
    # tokens only, this many at a time, recomputed in backward): memory does not grow
    # with the vocabulary.
    # 0: the dense head (all of a pass's logits at once).
    logit_chunk_tokens: NonNegInt = 1024
    # Recompute each transformer block in backward instead of keeping its activations
    # (transformers' gradient checkpointing, non-reentrant): a pass keeps one hidden
    # state per block and token plus one block's activations, about a tenth of what a
    # 28-layer model keeps otherwise, for one more forward of the blocks per pass
    # (``python -m bench trainer_memory`` measures both at real shapes on a GPU). The
    # memory plan and admission count it, and name it when a pass does not fit. verl and
    # TRL turn it on by default; here a pass that fits keeps the speed.
    gradient_checkpointing: bool = False
    # Learning-rate schedule (stages/trainer/lr_schedule.py), counted in optimizer updates
    # (run.steps * ppo_epochs * ppo_mini_batches): update k < warmup_steps uses
    # lr * (k + 1) / warmup_steps, then constant, or linear / cosine decay towards
    # lr * min_lr_ratio at the run's last update.
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: NonNegInt = 0
    min_lr_ratio: Annotated[float, Meta(ge=0, le=1)] = 0.0
    # bf16 runs (a GPU): gradients accumulate across a step's pieces in fp32 next to
    # fp32 master weights (DeepSpeed's BF16 optimizer); bf16 accumulates in the model
    # dtype (less memory, rounding grows with the pieces of a step).
    grad_accum_dtype: Literal["fp32", "bf16"] = "fp32"
    # torch.compile the model's transformer blocks (stages/trainer/engine.py,
    # compile_blocks): each block's elementwise ops (norms, rotary, SiLU gating) fused
    # into few kernels, forward and backward. auto: on a GPU below ZeRO 3 with a C
    # compiler for Triton on PATH; on: wherever (CPU needs a C++ compiler); off: eager.
    # The first step compiles (docs/performance/gpu-engines.md has the gain and cost).
    compile: Literal["auto", "on", "off"] = "auto"
    # Mixtures of experts: the routers' load-balancing loss (transformers'
    # load_balancing_loss_func, Switch Transformer's: the experts a token picks when
    # routing is even, more when it is not) times this coefficient is added to the
    # policy loss of every forward pass. 0: the policy loss alone. A model without a
    # router refuses any other value at launch.
    router_aux_loss_coef: NonNegFloat = 0.0
    # PPO's updates over a step's data (stages/trainer/ppo.py): the step is cut into
    # ppo_mini_batches mini-batches of whole micro-batches, each one optimizer update
    # (the first epoch's as soon as its micro-batches are in), and passed over
    # ppo_epochs times; the policy version still moves once per step.
    ppo_epochs: PosInt = 1
    ppo_mini_batches: PosInt = 1
    memory: MemoryConfig = MemoryConfig()


class KLControlConfig(msgspec.Struct, **_section()):
    """The coefficient of the KL penalty subtracted from the reward
    (``algorithm.use_kl_in_reward``), verl's ``algorithm.kl_ctrl``: ``fixed`` keeps
    ``kl_coef``; ``adaptive`` (Ziegler et al. 2019) multiplies it after every optimizer
    step by ``1 + clip(kl / target_kl - 1, -0.2, 0.2) * samples / horizon``."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: NonNegFloat = 0.001
    target_kl: PosFloat = 0.1
    horizon: PosInt = 10000
