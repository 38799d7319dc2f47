"""vLLM worker extension: load published weights in place and fingerprint the live model.

vLLM mixes ``WeightSyncExtension`` into each of its workers (engine arg
``worker_extension_cls="stages.rollout.vllm_worker_ext.WeightSyncExtension"``); the
frontend reaches the methods with ``collective_rpc``. This module must stay importable
without vLLM (it is imported by name inside vLLM's worker processes, and its pure
``combine_rank_fingerprints`` is unit-tested without an engine).

Guarantees:
- weights load through the model's own ``load_weights`` (fused, padded, sharded exactly as
  at start-up); the payload's and the live model's fingerprints are measured in the worker;
- an IPC descriptor's buckets are checked against the published fingerprint before loading;
- a worker that cannot see the payload file says so before loading anything;
- a partial payload (LoRA's merged modules, whole layers) reloads only the layers it
  names; vLLM's notes about the layers it left as they were are not logged;
- the live fingerprint is read from what the forward pass uses (on CPU, through the
  layer's own kernel); ``combine_rank_fingerprints`` counts replicated names once and adds
  shards. Details: docs/architecture.md, "vLLM worker extension".
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

RankFingerprint = dict[str, tuple[float, float]]


class WeightSyncExtension:
    """Methods injected into vLLM's worker class; ``self`` is the vLLM worker."""

    def apply_weights(self, data: bytes, verify: bool = True) -> dict[str, Any]:
        """Load the payload in place; return this rank's payload fingerprint and, with
        ``verify``, its live one (``None`` without)."""
        from pipeline.weights import REST_FINGERPRINT_KEY, deserialize_weights, read_payload_metadata

        partial = REST_FINGERPRINT_KEY in read_payload_metadata(data)
        return self._load(deserialize_weights(data), verify, partial=partial)

    def apply_weights_file(self, path: str, verify: bool = True) -> dict[str, Any]:
        """``apply_weights`` of the payload in file ``path``; ``{"missing": True}``, with
        nothing loaded, if this worker cannot see the file (another host)."""
        import os

        from pipeline.weights import REST_FINGERPRINT_KEY, load_weights_file, read_payload_metadata

        if not os.path.isfile(path):
            return {"missing": True}
        with open(path, "rb") as f:
            head = f.read(8)
            head += f.read(int.from_bytes(head, "little"))
        return self._load(load_weights_file(path), verify, partial=REST_FINGERPRINT_KEY in read_payload_metadata(head))

    def apply_weights_ipc(self, data: bytes, verify: bool = True) -> dict[str, Any]:
        """``apply_weights`` of a ``cuda_ipc`` descriptor: the trainer's buckets are mapped
        into this process, checked against the published fingerprint before anything is
        loaded (``{"refused": reason}`` if they differ), loaded from GPU memory, and
        unmapped."""
        from pipeline.transport import open_ipc_payload, verify_opened
        from pipeline.weights import WeightSyncError, compute_fingerprint

        payload, weights = open_ipc_payload(data)
        try:
            dtype = self.model_runner.model_config.dtype  # type: ignore[attr-defined]
            opened = compute_fingerprint(weights.values(), dtype=dtype)
            served = all(b.dtype == str(dtype).removeprefix("torch.") for b in payload.buckets)
            # Buckets already in the served dtype: one pass is both checks.
            verify_opened(payload, opened if served else compute_fingerprint(weights.values()))
        except WeightSyncError as err:
            return {"refused": str(err)}
        try:
            return self._load(weights, verify, opened, partial=payload.rest is not None)
        finally:
            del weights

    def _load(self, weights: dict[str, Any], verify: bool, payload: tuple[float, float] | None = None,
              partial: bool = False) -> dict[str, Any]:
        """Load ``weights``; ``payload``: their fingerprint in the served dtype, if known;
        ``partial``: they are some of the model's layers (the rest stays as it is)."""
        import torch

        from pipeline.weights import compute_fingerprint

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        dtype: torch.dtype = runner.model_config.dtype
        if payload is None:
            payload = compute_fingerprint(weights.values(), dtype=dtype)
        model = runner.get_model()
        on_gpu = next(model.parameters()).is_cuda
        fused = getattr(self, "_fused_experts", None)
        if fused is None:  # the architecture does not change between updates
            fused = self._fused_experts = has_fused_experts(model)
        if on_gpu and getattr(runner.model_config, "quantization", None) is None and not fused:
            # Unquantized dense weights on a GPU need no post-load processing: the model's
            # own load_weights (fusing, padding, sharding) is the whole reload, without the
            # layerwise bookkeeping of reload_weights (about 25x slower here). Fused
            # experts may be re-laid out for their kernel after loading: they reload.
            model.load_weights(weights=iter(weights.items()))
        elif hasattr(runner, "reload_weights"):  # re-runs post-load processing (CPU packing)
            with quiet_partial_reload(partial):
                runner.reload_weights(weights_iterator=iter(weights.items()))
        else:
            model.load_weights(weights=iter(weights.items()))
        del weights
        return {"payload": payload, "live": self.fingerprint() if verify else None}

    def trim_host_memory(self) -> int | None:
        """Give this worker process's freed heap back to the OS (``pipeline.memory.trim``);
        the bytes given back, None where the C library cannot."""
        from pipeline.memory.trim import trim_host_memory

        return trim_host_memory()

    def gpu_free_bytes(self) -> int | None:
        """Free memory of this worker's GPU, every process's use counted (None on CPU)."""
        import torch

        return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else None

    def fingerprint(self) -> RankFingerprint:
        """(sum, sum of squares) of every parameter this rank holds, by name; on a GPU
        summed there, read back once."""
        import torch

        from pipeline.weights import accumulate_fingerprint

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        names: list[str] = []
        sums: list[Any] = []
        # A tied parameter (``lm_head.weight`` is ``embed_tokens.weight``) is one
        # Parameter reachable from two modules; it counts once, under the first name,
        # which is the counting rule of pipeline.weights. Walking module by module,
        # ``named_parameters(recurse=False)`` cannot see that, so identity is tracked here.
        seen: set[int] = set()
        for prefix, module in model.named_modules():
            for name, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                names.append(f"{prefix}.{name}" if prefix else name)
                if name == "weight" and param.numel() == 0 and hasattr(module, "cpu_linear"):
                    sums.append(accumulate_fingerprint(read_packed_linear_weight(module)))
                else:
                    sums.append(accumulate_fingerprint([param]))
        if not sums:
            return {}
        values = torch.stack([t.to(sums[0].device) for t in sums]).tolist()
        return {name: (float(v[0]), float(v[1])) for name, v in zip(names, values, strict=True)}


# What vLLM's in-place reload logs about layers a payload did not name: expected of a
# partial payload (the fingerprint check, not these lines, says whether it loaded).
_PARTIAL_RELOAD_NOTES = ("Failed to load weights", "were not loaded from checkpoint")
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")


class _DropPartialReloadNotes:
    def filter(self, record: Any) -> bool:
        return not any(note in str(record.msg) for note in _PARTIAL_RELOAD_NOTES)


@contextlib.contextmanager
def quiet_partial_reload(partial: bool) -> Iterator[None]:
    """Within the block, vLLM's reload does not log the layers a ``partial`` payload
    leaves as they are; a whole payload's reload logs as usual."""
    if not partial:
        yield
        return
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    note_filter = _DropPartialReloadNotes()
    for logger in loggers:
        logger.addFilter(note_filter)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(note_filter)


def has_fused_experts(model: Any) -> bool:
    """True when the vLLM model has fused mixture-of-experts layers (their stacked
    ``w13_weight``), whose kernels may re-lay their weights out after loading."""
    return any(hasattr(module, "w13_weight") for module in model.modules())


def read_packed_linear_weight(module: Any, rows: int = 1024) -> Iterator[Any]:
    """Yield W^T of a CPU-packed vLLM linear layer, ``rows`` input features at a time,
    computed by its own kernel from identity rows (see module doc)."""
    import torch

    in_features = getattr(module, "input_size_per_partition", None) or module.input_size
    dtype = module.weight.dtype
    with torch.no_grad():
        for start in range(0, in_features, rows):
            stop = min(start + rows, in_features)
            eye = torch.zeros(stop - start, in_features, dtype=dtype)
            eye[:, start:stop] = torch.eye(stop - start, dtype=dtype)
            yield module.cpu_linear(eye, module.weight, None)


def combine_rank_fingerprints(ranks: list[RankFingerprint]) -> tuple[float, float]:
    """One model fingerprint from every rank's per-parameter numbers (see module doc)."""
    by_name: dict[str, list[tuple[float, float]]] = {}
    for rank in ranks:
        for name, stats in rank.items():
            by_name.setdefault(name, []).append((float(stats[0]), float(stats[1])))
    total = 0.0
    total_sq = 0.0
    for stats in by_name.values():
        if all(s == stats[0] for s in stats):
            stats = stats[:1]
        total += sum(s for s, _ in stats)
        total_sq += sum(q for _, q in stats)
    return (total, total_sq)
