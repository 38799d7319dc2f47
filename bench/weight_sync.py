"""Weight sync: publish-and-apply time into a real vLLM rollout worker, beside its bound.

On CPU it measures random-init Llama models of about 1M, 10M and 50M parameters; on a
machine with a GPU a larger bf16 Llama over both transports of ``pipeline.transport``
(``shm`` and ``cuda_ipc``). What each figure covers: docs/architecture.md, "Weight sync
benchmark".

Guarantees:
- publish is timed as the trainer does it (``TrainerEngine.export_weights``'s
  ``build_payload``), apply as the rollout does it (``VLLMBackend.update_weights``);
- the bound (the payload's bytes / ``np.copyto`` bandwidth) is measured in the same run;
- medians are the figures, the best repeat is kept too;
- the CPU target is ``copies_per_byte <= 3``; the GPU targets are publish + apply
  <= 100 ms and paused <= 50 ms;
- writes ``bench/results/weight_sync/`` (CPU) or ``bench/results/weight_sync_gpu/`` (GPU),
  JSON and PNG.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import fit_line, measure_memcpy_bandwidth, new_figure, publish_result, summarize
from pipeline.config import RolloutConfig, TinyModelConfig
from stages.rollout.vllm_worker_ext import WeightSyncExtension

# name -> (hidden, intermediate, layers); heads = hidden / 64, untied embeddings.
MODELS: dict[str, tuple[int, int, int]] = {"1M": (128, 512, 4), "10M": (256, 1024, 10), "50M": (512, 2048, 12)}
QUICK_MODELS: dict[str, tuple[int, int, int]] = {"0.2M": (64, 256, 2)}
# On a GPU: the 268.7M-parameter Llama of the GPU issue, in bf16.
GPU_MODEL = (1024, 4096, 16)


class TimedWeightSyncExtension(WeightSyncExtension):
    """The production worker extension plus two probes, for the breakdown only: the timed
    ``update_weights`` path still calls the inherited ``apply_weights`` unchanged."""

    def receive_path(self, path: str) -> float:
        """Arrival time of the payload file's path in the worker process."""
        return time.time()

    def timed_apply(self, path: str) -> dict[str, float]:
        """``apply_weights`` step by step, each timed, in the worker."""
        import torch

        from pipeline.weights import compute_fingerprint, load_weights_file

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        weights = load_weights_file(path)
        t1 = time.perf_counter()
        dtype: torch.dtype = runner.model_config.dtype
        compute_fingerprint(weights.values(), dtype=dtype)
        t2 = time.perf_counter()
        runner.reload_weights(weights_iterator=iter(weights.items()))
        t3 = time.perf_counter()
        self.fingerprint()
        t4 = time.perf_counter()
        return {"deserialize_s": t1 - t0, "payload_fingerprint_s": t2 - t1, "reload_s": t3 - t2,
                "live_fingerprint_s": t4 - t3}


def build_model_config(hidden: int, intermediate: int, layers: int) -> TinyModelConfig:
    heads = max(1, hidden // 64)
    return TinyModelConfig(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads,
                           head_dim=64, intermediate_size=intermediate, max_position_embeddings=256, seed=0)


def _time(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


async def measure_model(name: str, shape: tuple[int, int, int], root: Path, repeats: int) -> dict[str, Any]:
    import torch

    from pipeline.weights import build_payload, compute_fingerprint, compute_sha256, serialize_weights
    from stages.models.tiny import build_char_tokenizer, build_tiny_model, write_tiny_checkpoint
    from stages.rollout import build_backend

    cfg = build_model_config(*shape)
    path = root / name
    path.mkdir(parents=True)
    write_tiny_checkpoint(cfg, path)
    model = build_tiny_model(cfg, build_char_tokenizer(cfg.architecture))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params = sum(v.numel() for v in state.values())
    del model
    import stages.rollout.vllm_backend as vllm_backend

    # The engine loads its worker extension by name at start; the timed subclass adds
    # probes and changes nothing the timed path runs.
    vllm_backend.WORKER_EXTENSION = f"{__name__}.TimedWeightSyncExtension"
    backend = build_backend("vllm", path, RolloutConfig(backend="vllm", kv_cache_gib=0.25, seed=0,
                                                        engine_core="subprocess"), "float32")
    t0 = time.perf_counter()
    await backend.start()
    start_s = time.perf_counter() - t0
    rows: list[dict[str, float]] = []
    try:
        for _ in range(repeats + 1):  # the first update warms the engine's load path: reported apart
            with torch.no_grad():
                for v in state.values():
                    v.mul_(1.0 + 1e-3)  # a new version has new values (not timed)
            (data, sha, fp), publish_s = _time(lambda: build_payload(state))
            _, ser_s = _time(lambda: serialize_weights(state))
            _, sha_s = _time(lambda d=data: compute_sha256(d))
            _, fp_s = _time(lambda: compute_fingerprint(state.values()))
            t1 = time.perf_counter()
            live = await backend.update_weights(data, backend.version + 1)
            apply_s = time.perf_counter() - t1
            del sha
            if not np.allclose(live, fp, rtol=1e-5):
                raise RuntimeError(f"{name}: live fingerprint {live} != published {fp}")
            rows.append({"serialize_s": ser_s, "sha256_s": sha_s, "fingerprint_s": fp_s,
                         "publish_s": publish_s, "apply_s": apply_s, "total_s": publish_s + apply_s})
        num_bytes = len(data)
        probes = [await _probe(backend, data) for _ in range(max(2, repeats // 2))]
    finally:
        await backend.shutdown()
        shutil.rmtree(path, ignore_errors=True)
    copy = measure_memcpy_bandwidth(num_bytes, repeats=5)
    steady = rows[1:]
    med = {k: float(np.median([r[k] for r in steady])) for k in steady[0]}
    best = {k: float(np.min([r[k] for r in steady])) for k in steady[0]}
    bound = copy["median_s"]
    out = {
        "model": name, "params": params, "bytes": num_bytes, "shape": {"hidden": shape[0], "intermediate": shape[1],
                                                                       "layers": shape[2], "head_dim": 64},
        "engine_start_s": start_s, "first_update": rows[0], "median": med, "best": best,
        "samples": {k: summarize([r[k] for r in steady]) for k in steady[0]},
        "bound_s": bound, "memcpy_bytes_per_s": copy["bytes_per_s"],
        "total_over_bound": med["total_s"] / bound,
        "best_total_over_bound": best["total_s"] / bound,
        "apply_breakdown_s": {k: float(np.median([p[k] for p in probes])) for k in probes[0]},
    }
    print(f"{name:>5}: {params / 1e6:6.2f}M params {num_bytes / 2**20:7.1f} MiB  publish {1e3 * med['publish_s']:8.1f} ms"
          f"  apply {1e3 * med['apply_s']:8.1f} ms  bound {1e3 * bound:7.2f} ms  ratio {out['total_over_bound']:7.1f}",
          flush=True)
    return out


async def _probe(backend: Any, data: bytes) -> dict[str, float]:
    """Apply's parts, measured by the probe methods (the engine is idle: no pause needed)."""
    from pipeline.weights import write_weights_file

    engine = backend._engine  # the probes need the engine's RPC; the backend has no API for them
    path = backend._shm_dir / "probe.safetensors"  # the production transport (see vllm_backend)
    try:
        t0 = time.time()
        write_weights_file(data, path)
        arrived = (await engine.collective_rpc("receive_path", args=(str(path),)))[0]
        ship = arrived - t0
        parts = (await engine.collective_rpc("timed_apply", args=(str(path),)))[0]
    finally:
        path.unlink(missing_ok=True)
    return {"ship_to_worker_s": ship, **parts}


async def _run_models(models: dict[str, tuple[int, int, int]], repeats: int) -> list[dict[str, Any]]:
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-weights-"))
    try:
        return [await measure_model(name, shape, root, repeats) for name, shape in models.items()]
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def measure_gpu_transports(shape: tuple[int, int, int], root: Path, repeats: int) -> dict[str, Any]:
    """Publish + apply of one bf16 model on a GPU, over ``shm`` and ``cuda_ipc``, side by
    side on one started vLLM engine. publish: the trainer's export from a CUDA state dict
    (``build_payload``; ``CudaIpcExporter.export``); apply: ``update_weights`` verified;
    paused: generation paused inside ``update_weights`` (pause to resume)."""
    import torch

    from pipeline.transport import CudaIpcExporter
    from pipeline.weights import build_payload
    from stages.models.tiny import build_char_tokenizer, build_tiny_model, write_tiny_checkpoint
    from stages.rollout import build_backend

    cfg = build_model_config(*shape)
    path = root / "gpu-model"
    path.mkdir(parents=True)
    write_tiny_checkpoint(cfg, path)
    model = build_tiny_model(cfg, build_char_tokenizer(cfg.architecture))
    state = {k: v.detach().to("cuda", torch.bfloat16) for k, v in model.state_dict().items()}
    params = sum(v.numel() for v in model.parameters())
    del model
    backend = build_backend("vllm", path, RolloutConfig(backend="vllm", gpu_memory_utilization=0.3, seed=0,
                                                        engine_core="subprocess"),
                            "bfloat16")
    t0 = time.perf_counter()
    await backend.start()
    start_s = time.perf_counter() - t0
    exporter = CudaIpcExporter(torch.bfloat16)
    rows: dict[str, list[dict[str, float]]] = {"shm": [], "cuda_ipc": []}
    try:
        for _ in range(repeats + 1):  # the first round warms both paths: dropped
            for transport in ("shm", "cuda_ipc"):
                with torch.no_grad():
                    for v in state.values():
                        v.mul_(1.0 + 1e-3)
                torch.cuda.synchronize()
                version = backend.version + 1
                t1 = time.perf_counter()
                if transport == "shm":
                    data, _, fp = build_payload(state)
                else:
                    data, fp = exporter.export(state, version)
                t2 = time.perf_counter()
                live = await backend.update_weights(data, version)
                t3 = time.perf_counter()
                if not np.allclose(live, fp, rtol=1e-5):
                    raise RuntimeError(f"{transport}: live fingerprint {live} != published {fp}")
                rows[transport].append({"publish_s": t2 - t1, "apply_s": t3 - t2, "total_s": t3 - t1,
                                        "paused_s": backend.last_pause_s, "payload_bytes": float(len(data))})
    finally:
        await backend.shutdown()
        exporter.close()
    out: dict[str, Any] = {"params": params, "bytes_bf16": 2 * params, "engine_start_s": start_s,
                           "shape": {"hidden": shape[0], "intermediate": shape[1], "layers": shape[2]}}
    for transport, samples in rows.items():
        steady = samples[1:]
        out[transport] = {"median": {k: float(np.median([r[k] for r in steady])) for k in steady[0]},
                          "best": {k: float(np.min([r[k] for r in steady])) for k in steady[0]},
                          "samples": steady}
    return out


def run_gpu(quick: bool, out_dir: Path) -> dict[str, Any]:
    """``weight_sync`` on a GPU machine: the two transports side by side (see above)."""
    import torch

    shape = (256, 1024, 4) if quick else GPU_MODEL
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-weights-"))
    try:
        row = asyncio.run(measure_gpu_transports(shape, root, repeats=2 if quick else 8))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    shm, ipc = row["shm"]["median"], row["cuda_ipc"]["median"]
    ratios = {
        "device": torch.cuda.get_device_name(0),
        "params_m": row["params"] / 1e6,
        "shm_total_ms": 1e3 * shm["total_s"],
        "cuda_ipc_total_ms": 1e3 * ipc["total_s"],
        "cuda_ipc_publish_ms": 1e3 * ipc["publish_s"],
        "cuda_ipc_apply_ms": 1e3 * ipc["apply_s"],
        "cuda_ipc_paused_ms": 1e3 * ipc["paused_s"],
        "shm_paused_ms": 1e3 * shm["paused_s"],
        "speedup_cuda_ipc_over_shm": shm["total_s"] / ipc["total_s"],
        "target_total_ms": 100.0,
        "cuda_ipc_total_over_target": 1e3 * ipc["total_s"] / 100.0,
        "target_paused_ms": 50.0,
        "cuda_ipc_paused_over_target": 1e3 * ipc["paused_s"] / 50.0,
    }
    payload = {"quick": quick, "units": "seconds unless named _ms", "dtype": "bfloat16",
               "params": {"repeats": 2 if quick else 8}, "row": row, "ratios": ratios}
    return publish_result(out_dir, "weight_sync_gpu", payload, plot_gpu)


def plot_gpu(payload: dict[str, Any]) -> Any:
    row = payload["row"]
    fig, axes = new_figure(1, 1, size=(8, 4.5))
    ax = axes[0][0]
    names = ["shm", "cuda_ipc"]
    for k, (key, label) in enumerate((("publish_s", "publish"), ("apply_s", "apply"), ("paused_s", "paused"))):
        ax.bar(np.arange(2) + 0.27 * (k - 1), [1e3 * row[n]["median"][key] for n in names], width=0.27, label=label)
    ax.axhline(100.0, linestyle="--", color="grey", linewidth=0.8, label="target publish+apply 100 ms")
    ax.set_yscale("log")
    ax.set_xticks(range(2), names)
    ax.set_ylabel("ms (median)")
    ax.set_title(f"weight sync, {row['params'] / 1e6:.1f}M bf16, {payload['ratios']['device']}")
    ax.legend(fontsize=8)
    return fig


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    try:
        import torch

        if torch.cuda.is_available():
            return run_gpu(quick, out_dir)
    except ImportError:  # pragma: no cover
        pass
    models = QUICK_MODELS if quick else MODELS
    rows = asyncio.run(_run_models(models, repeats=2 if quick else 5))
    xs = [r["bytes"] for r in rows]
    fixed_s, per_byte_s = fit_line(xs, [r["median"]["total_s"] for r in rows])
    fixed_apply_s, per_byte_apply_s = fit_line(xs, [r["median"]["apply_s"] for r in rows])
    # The best of the repeats: what an unloaded machine gives (this one may be shared).
    best_fixed_s, best_per_byte_s = fit_line(xs, [r["best"]["total_s"] for r in rows])
    if len(rows) < 2:  # one model (quick): no line; the per-byte figures are unknown
        fixed_s = fixed_apply_s = per_byte_s = per_byte_apply_s = best_fixed_s = best_per_byte_s = float("nan")
    memcpy_bps = float(np.median([r["memcpy_bytes_per_s"] for r in rows]))
    big = rows[-1]
    ratios = {
        "fixed_cost_ms": 1e3 * fixed_s,
        "fixed_cost_apply_ms": 1e3 * fixed_apply_s,
        "copies_per_byte": per_byte_s * memcpy_bps,
        "copies_per_byte_apply": per_byte_apply_s * memcpy_bps,
        "copies_per_byte_publish": (per_byte_s - per_byte_apply_s) * memcpy_bps,
        "best_fixed_cost_ms": 1e3 * best_fixed_s,
        "best_copies_per_byte": best_per_byte_s * memcpy_bps,
        "largest_model": big["model"],
        "largest_total_ms": 1e3 * big["median"]["total_s"],
        "largest_bound_ms": 1e3 * big["bound_s"],
        "largest_total_over_bound": big["total_over_bound"],
        "largest_apply_breakdown_ms": {k: 1e3 * v for k, v in big["apply_breakdown_s"].items()},
        "largest_total_over_bound_plus_fixed": big["median"]["total_s"] / (big["bound_s"] + max(fixed_s, 0.0))
        if math.isfinite(fixed_s) else float("nan"),
    }
    payload = {
        "quick": quick,
        "units": "seconds, bytes; copies = multiples of one np.copyto of the payload",
        "params": {"models": {k: {"hidden": v[0], "intermediate": v[1], "layers": v[2]} for k, v in models.items()},
                   "dtype": "float32", "repeats": 2 if quick else 5},
        "rows": rows,
        "fit": {"fixed_s": fixed_s, "per_byte_s": per_byte_s, "fixed_apply_s": fixed_apply_s,
                "per_byte_apply_s": per_byte_apply_s, "best_fixed_s": best_fixed_s, "best_per_byte_s": best_per_byte_s,
                "memcpy_bytes_per_s": memcpy_bps},
        "ratios": ratios,
    }
    return publish_result(out_dir, "weight_sync", payload, plot)


def plot(payload: dict[str, Any]) -> Any:
    rows = payload["rows"]
    fig, axes = new_figure(1, 2, size=(14, 4.5))
    ax = axes[0][0]
    mib = np.array([r["bytes"] / 2**20 for r in rows])
    for key, style, label in (("publish_s", "o-", "publish (serialize+sha+fingerprint)"),
                              ("apply_s", "s-", "apply (update_weights)"), ("total_s", "D-", "publish + apply")):
        ax.plot(mib, [1e3 * r["median"][key] for r in rows], style, label=label)
    ax.plot(mib, [1e3 * r["bound_s"] for r in rows], "^:", label="bound: one memcpy")
    fit = payload["fit"]
    xs = np.linspace(0, mib.max() * 1.05, 50)
    if math.isfinite(fit["fixed_s"]):
        ax.plot(xs, 1e3 * (fit["fixed_s"] + fit["per_byte_s"] * xs * 2**20), "--", color="grey", linewidth=0.8,
                label=f"fit: {1e3 * fit['fixed_s']:.0f} ms + {payload['ratios']['copies_per_byte']:.1f} copies")
    ax.set_xlabel("payload MiB (float32)")
    ax.set_ylabel("ms")
    ax.set_title("weight sync into vLLM")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    names = [r["model"] for r in rows]
    bottom = np.zeros(len(rows))
    parts = [("publish: " + k.removesuffix("_s"), [r["median"][k] for r in rows])
             for k in ("serialize_s", "sha256_s", "fingerprint_s")]
    parts += [("apply: " + k.removesuffix("_s"), [r["apply_breakdown_s"][k] for r in rows])
              for k in rows[0]["apply_breakdown_s"]]
    parts.append(("apply: rest (pause, resume, calls)",
                  [max(0.0, r["median"]["apply_s"] - sum(r["apply_breakdown_s"].values())) for r in rows]))
    for label, secs in parts:
        # Share of each model's publish + apply, so a 4 MiB and a 192 MiB model fit one axis.
        vals = np.array([s / r["median"]["total_s"] for s, r in zip(secs, rows, strict=True)])
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom += vals
    ax.set_xticks(range(len(rows)), [f"{r['model']}\n{r['median']['total_s'] / r['bound_s']:.0f}x bound" for r in rows])
    ax.set_ylabel("share of publish + apply (median)")
    ax.set_title("where publish + apply go")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
