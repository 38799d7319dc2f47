"""Data-parallel trainer: ``train.num_ranks`` DeepSpeed ranks behind one trainer stage.

With N > 1 the stage's engine is a ``DataParallelEngine``: rank 0 is the stage's own
``TrainerEngine``, ranks 1..N-1 are ``TrainerRankActor``s, one torch.distributed world
(gloo on CPU, nccl on GPU). With N = 1 nothing here is used.

Guarantees:
- every micro-batch is split into N balanced parts of whole GRPO groups, scaled so the
  step's gradient is the one-rank gradient up to float rounding, whatever the split;
- all ranks run the same number of backward passes (zero-weight padding), counted
  from each part's own plan of passes;
- optimizer steps, discards and state saves and loads run on every rank at once; rank 0
  alone exports, publishes and writes the Hugging Face checkpoint;
- a resume needs the same ``num_ranks``;
- an error on any rank (OOM included) stops the trainer promptly, never a hang:
  ``TrainerRankError`` names the rank; a hung peer is caught by
  ``RENDEZVOUS_TIMEOUT_S`` / ``COLLECTIVE_TIMEOUT_S``.
Mechanisms: docs/architecture.md, "Data-parallel trainer".
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray

from pipeline.memory.oom import freeze_setup_heap
from pipeline.memory.splitting import split_rollout_batch_at
from pipeline.types import RolloutBatch

RENDEZVOUS_TIMEOUT_S = 600.0
COLLECTIVE_TIMEOUT_S = 120.0
_POLL_S = 0.5  # how often rank 0's wait looks at the other ranks while its own work runs


class TrainerRankError(RuntimeError):
    """Trainer rank ``rank`` raised ``error``: the data-parallel trainer cannot go on."""

    def __init__(self, rank: int, error: str, ranks: int) -> None:
        super().__init__(f"trainer rank {rank} of {ranks} failed: {error}")
        self.rank, self.error, self.ranks = rank, error, ranks

    def __reduce__(self) -> tuple[Any, ...]:
        return (TrainerRankError, (self.rank, self.error, self.ranks))


def plan_rank_groups(num_groups: int, ranks: int) -> list[int]:
    """Groups each rank trains of a micro-batch of ``num_groups`` groups: contiguous,
    the first ``num_groups % ranks`` ranks one more; ranks beyond the groups get 0."""
    if ranks < 1:
        raise ValueError(f"ranks: expected >= 1, got {ranks}")
    base, extra = divmod(num_groups, ranks)
    return [base + (r < extra) for r in range(ranks)]


def count_rank_passes(passes: list[int]) -> list[int]:
    """Zero-weight passes each rank adds so that all make as many forward/backward
    passes as the busiest (``passes``: what each rank's part makes, ``len`` of its
    engine's ``plan_passes``: token-budget passes differ in number from rank to rank
    even for parts of equal sample counts)."""
    return [max(passes) - p for p in passes]


def split_for_ranks(batch: RolloutBatch, ranks: int) -> list[tuple[RolloutBatch, bool]]:
    """(part, real) per rank: ``real`` False marks a rank without a group of its own,
    which gets the first group as a zero-weight filler."""
    counts = plan_rank_groups(len(batch.prompts), ranks)
    parts = split_rollout_batch_at(batch, [c for c in counts if c])
    return [(p, True) for p in parts] + [(parts[0], False)] * (ranks - len(parts))


def init_rank_process_group(rank: int, world: int, address: str, port: int, backend: str) -> None:
    """Join the trainer's torch.distributed world as ``rank``. Each rank sees one GPU (its
    own, as Ray sets ``CUDA_VISIBLE_DEVICES``), so its local rank is 0; DeepSpeed reuses
    the group."""
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                       "MASTER_ADDR": address, "MASTER_PORT": str(port)})
    dist.init_process_group(backend=backend, init_method=f"tcp://{address}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_S))


def set_collective_timeout(seconds: float) -> None:
    """The timeout of every collective of this process's groups from now on (the world
    and any DeepSpeed created)."""
    import torch.distributed.distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timedelta(seconds=seconds), group)


def describe_rank_error(exc: BaseException, ranks: int) -> str:
    """``TrainerRankError``'s text for ``exc`` (a rank's own error, or Ray's wrapper of it)."""
    from pipeline.memory.oom import is_oom_error

    cause = getattr(exc, "cause", None) if isinstance(exc, ray.exceptions.RayTaskError) else None
    cause = cause if isinstance(cause, BaseException) else exc
    if isinstance(cause, ray.exceptions.RayActorError):
        text = "its actor died: " + (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    else:
        text = f"{type(cause).__name__}: " + (str(cause).strip().splitlines() or [""])[-1]
    if is_oom_error(cause):
        text += (f"; with train.num_ranks={ranks} an out-of-memory error stops the run (halving and retrying "
                 "cannot be coordinated across ranks yet): use smaller micro-batches "
                 "(dataflow.prompts_per_micro_batch, or train.memory.budget_bytes to split them before "
                 "training) or more ranks (train.num_ranks)")
    return text


class TrainerRank:
    """Trainer rank ``rank`` > 0: a ``TrainerEngine`` that mirrors rank 0's calls (Ray
    actor: ``TrainerRankActor``)."""

    def __init__(self, cfg: Any, rank: int, world: int, address: str, port: int, backend: str) -> None:
        from pipeline.log import configure_logging, redirect_process_output

        console = None
        if getattr(cfg, "run_dir", None) is not None and cfg.run.log_level != "debug":
            console = redirect_process_output(Path(cfg.run_dir) / "logs" / f"trainer-rank{rank}.log")
        configure_logging(cfg.run.log_level, console_fd=console)
        self.cfg, self.rank, self.world, self.rendezvous = cfg, rank, world, (address, port, backend)
        self.engine: Any = None

    def setup(self) -> str:
        """Join the world and build the engine; returns the GPUs this rank sees."""
        from stages.trainer.engine import build_trainer_engine

        address, port, backend = self.rendezvous
        init_rank_process_group(self.rank, self.world, address, port, backend)
        self.engine = build_trainer_engine(self.cfg)
        set_collective_timeout(COLLECTIVE_TIMEOUT_S)
        if self.cfg.placement.mode == "colocate":
            freeze_setup_heap()  # it collects garbage twice a step, as rank 0 does
        return os.environ.get("CUDA_VISIBLE_DEVICES", "")

    def train(self, part: RolloutBatch, scale: float, pad: int) -> dict[str, float]:
        metrics = self.engine.train_micro_batch(part, scale)
        self.engine.pad_backwards(part, pad)
        return metrics

    def optimizer_step(self, grad_scale: float, bump_version: bool) -> dict[str, float]:
        return self.engine.optimizer_step(grad_scale, bump_version)

    def discard_gradients(self) -> None:
        self.engine.discard_gradients()

    def warm_up_compile(self) -> float:
        return self.engine.warm_up_compile()

    def release_cached_memory(self) -> tuple[int, int]:
        return self.engine.release_cached_memory()

    def join_gather(self) -> None:
        """Take part in rank 0's gather of the whole weights (ZeRO 3)."""
        with self.engine.gathered_parameters():
            pass

    def save_state(self, path: str) -> None:
        self.engine.save_state(Path(path))

    def load_state(self, path: str) -> None:
        self.engine.load_state(Path(path))


TrainerRankActor = ray.remote(num_cpus=0)(TrainerRank)


def build_data_parallel_engine(cfg: Any, rank_gpus: list[tuple[int, float]],
                               rank_actor: Any = TrainerRankActor) -> DataParallelEngine:
    """Rank 0 here and ``cfg.train.num_ranks - 1`` rank actors, in one world (blocking:
    call from a thread). ``rank_gpus``: (placement-group bundle, GPU share) of ranks
    1..N-1 from the placement plan; empty: no GPU indices (CPU, or Ray GPU counts).
    ``rank_actor``: the ranks' actor class (tests pass a ``TrainerRank`` that fails)."""
    import torch

    from stages.trainer.engine import build_trainer_engine, find_free_port

    world = cfg.train.num_ranks
    address, port = ray.util.get_node_ip_address(), find_free_port()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    group = ray.util.get_current_placement_group()
    place = cfg.placement.trainer
    actors = []
    for rank in range(1, world):
        options: dict[str, Any] = {"num_cpus": place.num_cpus, "resources": place.resources or None,
                                   "num_gpus": place.num_gpus}
        if rank_gpus:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundle, share = rank_gpus[rank - 1]
            options.update(num_gpus=share, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=bundle))
        actors.append(rank_actor.options(**options).remote(cfg, rank, world, address, port, backend))
    ready = [a.setup.remote() for a in actors]  # they wait in the rendezvous for rank 0
    init_rank_process_group(0, world, address, port, backend)
    engine = DataParallelEngine(None, actors, [])
    local, devices = engine._on_all_ranks(lambda: build_trainer_engine(cfg), lambda: ready)
    set_collective_timeout(COLLECTIVE_TIMEOUT_S)
    engine.local = local
    engine.devices = [os.environ.get("CUDA_VISIBLE_DEVICES", ""), *devices]
    return engine


class DataParallelEngine:
    """The trainer stage's engine over N ranks (see the module guarantees): the
    ``TrainerEngine`` calls the stage makes, each run on every rank."""

    def __init__(self, local: Any, actors: list[Any], devices: list[str]) -> None:
        self.local = local
        self.actors = actors
        self.ranks = 1 + len(actors)
        self.devices = devices  # CUDA_VISIBLE_DEVICES of each rank ("" without GPUs)
        self.failed: TrainerRankError | None = None  # set by the first error: no call runs after it
        # Rank 0's own work runs here while the calling thread watches the other ranks.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-rank0")

    def _on_all_ranks(self, local: Callable[[], Any], submit: Callable[[], list[Any]]) -> tuple[Any, list[Any]]:
        """Rank 0's ``local()`` and the other ranks' calls (``submit()``'s refs, rank r's
        at r - 1), waited on together: (rank 0's result, the others' results), or
        ``TrainerRankError`` at the first error of any rank (see the module guarantees)."""
        if self.failed is not None:
            raise self.failed
        refs = submit()
        own = self._pool.submit(local)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:
                    self._fail(1 + refs.index(ref), exc)
            if own.done() and own.exception() is not None:
                self._fail(0, own.exception())
        try:
            out = own.result()  # the others are done: its collectives have met theirs
        except Exception as exc:
            self._fail(0, exc)
        return out, ray.get(refs)

    def _fail(self, rank: int, exc: BaseException) -> None:
        """Stop every rank and raise ``TrainerRankError`` for ``rank``'s ``exc``. The
        others may wait in a collective for the failed rank; killing them ends the
        wait of rank 0 too (its peers' connections close) or its collective times out."""
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.failed = TrainerRankError(rank, describe_rank_error(exc, self.ranks), self.ranks)
        raise self.failed from exc

    # Rank 0's state and weights stand for the stage's engine.
    def __getattr__(self, name: str) -> Any:
        if name in ("version", "module", "chunk_size", "pass_tokens", "unit_rows", "plan_passes", "logit_tokens",
                    "algo", "extra_state", "gradients_tainted", "weights_on_gpu", "sync_dtype", "get_rng_state",
                    "set_rng_state", "compiled_blocks", "compile_skipped"):
            return getattr(self.local, name)
        raise AttributeError(name)

    def _whole(self, method: str, *args: Any) -> Any:
        """Rank 0's ``method``, which reads the whole weights; under ZeRO 3 the other ranks
        join its gather of them."""
        return self._on_all_ranks(functools.partial(getattr(self.local, method), *args),
                                  lambda: [a.join_gather.remote() for a in self.actors] if self.local.partitioned
                                  else [])[0]

    def export_weights(self) -> tuple[bytes, str, tuple[float, float]]:
        return self._whole("export_weights")

    def export_weights_ipc(self) -> tuple[bytes, str, tuple[float, float]]:
        return self._whole("export_weights_ipc")

    def weights_sha256(self) -> str:
        return self._whole("weights_sha256")

    def state_dict_for_sync(self) -> dict[str, Any]:
        return self._whole("state_dict_for_sync")

    def save_pretrained(self, out_dir: Path) -> Path:
        return self._whole("save_pretrained", out_dir)

    def train_micro_batch(self, batch: RolloutBatch, scale: float) -> dict[str, float]:
        """Train ``batch`` split over the ranks; its metrics as one ``train_micro_batch``'s."""
        from stages.trainer.pieces import compute_piece_weight, merge_piece_metrics

        parts = split_for_ranks(batch, self.ranks)
        loss_agg = self.local.algo.loss_agg
        weights = [compute_piece_weight(p, batch, loss_agg) if real else 0.0 for p, real in parts]
        # Every part is planned here, by rank 0: each rank's engine plans its own part alike.
        pads = count_rank_passes([len(self.local.plan_passes(p)) for p, _ in parts])
        scales = [self.ranks * scale * w for w in weights]

        def train_own() -> dict[str, float]:
            out = self.local.train_micro_batch(parts[0][0], scales[0])
            self.local.pad_backwards(parts[0][0], pads[0])
            return out

        first, others = self._on_all_ranks(train_own, lambda: [
            a.train.remote(p, s, n) for a, (p, _), s, n in zip(self.actors, parts[1:], scales[1:], pads[1:],
                                                                strict=True)])
        metrics = [first, *others]
        real = [(m, w) for m, w, (_, is_real) in zip(metrics, weights, parts, strict=True) if is_real]
        merged = merge_piece_metrics([m for m, _ in real], [w for _, w in real])
        merged["scale"] = float(scale)
        return merged

    def optimizer_step(self, grad_scale: float = 1.0, bump_version: bool = True) -> dict[str, float]:
        return self._on_all_ranks(functools.partial(self.local.optimizer_step, grad_scale, bump_version),
                                  lambda: [a.optimizer_step.remote(grad_scale, bump_version) for a in self.actors])[0]

    def discard_gradients(self) -> None:
        self._on_all_ranks(self.local.discard_gradients, lambda: [a.discard_gradients.remote() for a in self.actors])

    def warm_up_compile(self) -> float:
        """Every rank builds its compiled graphs (their backward passes reduce together)."""
        return self._on_all_ranks(self.local.warm_up_compile,
                                  lambda: [a.warm_up_compile.remote() for a in self.actors])[0]

    def release_cached_memory(self) -> tuple[int, int]:
        """Every rank's cache back to its GPU; rank 0's GPU's (free, total) bytes."""
        return self._on_all_ranks(self.local.release_cached_memory,
                                  lambda: [a.release_cached_memory.remote() for a in self.actors])[0]

    def save_state(self, path: Path) -> None:
        self._on_all_ranks(functools.partial(self.local.save_state, path),
                           lambda: [a.save_state.remote(str(path)) for a in self.actors])

    def load_state(self, path: Path) -> None:
        self._on_all_ranks(functools.partial(self.local.load_state, path),
                           lambda: [a.load_state.remote(str(path)) for a in self.actors])
