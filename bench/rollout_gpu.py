"""Rollout on a GPU: the vLLM backend's generation throughput against vLLM driven bare.

On ``configs/gpu_small.yaml``'s model (268.7M-parameter Llama, bf16) and step shape (32
prompts x 8 samples x up to 128 tokens, 4 micro-batches of 8 prompts in flight), one
engine per ``enforce_eager`` setting, measured in this process:

- ``bare``: the same 256 requests submitted straight to ``AsyncLLM.generate`` (one
  output per request, no detokenization): the engine's own ceiling for this shape;
- ``final``: ``VLLMBackend.generate`` as the rollout stage calls it (one output per
  request, versions from labels or split points, text decoded once);
- ``final/in_process`` (CUDA graphs only): ``final`` with ``rollout.engine_core:
  in_process`` (the engine core in this process, stepped by a thread);
- ``bare/in_process`` (CUDA graphs only): ``bare`` into that in-process engine; both
  in-process rows carry the engine's step account (``engine``: steps, mean step);
- ``stream`` (CUDA graphs only): ``VLLMBackend(output_mode="stream")``: every token
  through the event loop with vLLM's incremental detokenization (the path before
  final-only outputs).

Each variant runs one warm-up step and then ``ROUNDS`` timed steps; the figure is
completion tokens/s of the best round (completion lengths are sampled, EOS can end one
early). Ratios: backend / bare per mode, and CUDA graphs / eager. Writes
``bench/results/rollout_gpu/`` (JSON and PNG); needs a CUDA GPU (status "skipped" without one).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from bench.common import cuda_device_name, new_figure, note_config, publish_result, publish_skipped_without_gpu

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gpu_small.yaml"
ROUNDS = 3


def _bare_params(max_tokens: int, logprobs: int | None = 0, min_tokens: int = 0) -> Any:
    """A bare request's sampling: one output when it finishes, no detokenization;
    ``logprobs`` as vLLM takes it (0: the sampled token's, None: none); ``min_tokens``:
    stop tokens held back until then (a row's exact length: ``min_tokens == max_tokens``)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(n=1, temperature=1.0, max_tokens=max_tokens, min_tokens=min_tokens, logprobs=logprobs,
                          output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)


def _budget(budgets: list[tuple[int, int]] | None, i: int, max_tokens: int) -> tuple[int, int]:
    """Prompt ``i``'s (max, min) tokens: its own where ``budgets`` are given, else (``max_tokens``, 0)."""
    return budgets[i] if budgets is not None else (max_tokens, 0)


async def _bare_step(engine: Any, prompts: list[list[int]], n: int, max_tokens: int, round_: int | str,
                     logprobs: int | None = 0, budgets: list[tuple[int, int]] | None = None) -> int:
    """``n`` requests per prompt, all at once, each up to ``max_tokens`` (or its prompt's
    (max, min) ``budgets``); the completion tokens made."""
    async def one(i: int, prompt: list[int], budget: tuple[int, int]) -> int:
        params = _bare_params(budget[0], logprobs, budget[1])
        tokens = 0
        async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id=f"bare-{round_}-{i}"):
            tokens = len(out.outputs[0].token_ids)
        return tokens

    counts = await asyncio.gather(*(one(i * n + j, p, _budget(budgets, i, max_tokens))
                                    for i, p in enumerate(prompts) for j in range(n)))
    return sum(counts)


async def _bare_in_process_step(engine: Any, prompts: list[list[int]], n: int, max_tokens: int, round_: int | str,
                                logprobs: int | None = 0, budgets: list[tuple[int, int]] | None = None) -> int:
    """``_bare_step`` against ``InProcessEngine`` (its ``add_request`` and collectors)."""

    async def one(i: int, prompt: list[int], budget: tuple[int, int]) -> int:
        collector = await engine.add_request(f"bare-{round_}-{i}", {"prompt_token_ids": prompt},
                                             _bare_params(budget[0], logprobs, budget[1]))
        out = await collector.get()
        return len(out.outputs[0].token_ids)

    counts = await asyncio.gather(*(one(i * n + j, p, _budget(budgets, i, max_tokens))
                                    for i, p in enumerate(prompts) for j in range(n)))
    return sum(counts)


async def _backend_step(backend: Any, prompts: list[list[int]], n: int, max_tokens: int, per_micro: int) -> int:
    from stages.rollout.base import SamplingSettings

    # No per-request seed, as in the pipeline (a seeded request takes vLLM's slower
    # per-request sampling path).
    sampling = SamplingSettings(n=n, temperature=1.0, max_tokens=max_tokens)
    parts = [prompts[k:k + per_micro] for k in range(0, len(prompts), per_micro)]
    results = await asyncio.gather(*(backend.generate(part, sampling) for part in parts))
    return sum(len(c.token_ids) for res in results for r in res for c in r.completions)


async def _timed(step: Any, rounds: int) -> dict[str, Any]:
    await step(0)  # warm-up
    times, tokens = [], []
    for r in range(1, rounds + 1):
        t0 = time.perf_counter()
        tokens.append(await step(r))
        times.append(time.perf_counter() - t0)
    rates = [t / s for t, s in zip(tokens, times, strict=True)]
    best = int(np.argmax(rates))
    return {"step_s": times, "tokens": tokens, "tokens_per_s": rates[best], "best_step_s": times[best],
            "mean_tokens_per_s": float(np.mean(rates))}


VARIANTS = ((True, None, "subprocess"), (False, None, "subprocess"), (False, "stream", "subprocess"),
            (False, None, "in_process"))  # (enforce_eager, output_mode, engine_core)


async def measure(quick: bool, variants: tuple[tuple[bool, str | None, str], ...] = VARIANTS) -> dict[str, Any]:
    from pipeline.config import load_config
    from stages.models.tiny import resolve_model_path
    from stages.rollout.vllm_backend import VLLMBackend

    # torch.cuda.is_available() has initialised the driver in this process: a forked
    # engine process could not use CUDA.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

    cfg = load_config(CONFIG, [])
    note_config(cfg)
    model_path = resolve_model_path(cfg.model)
    prompts_per_step = 8 if quick else cfg.train.prompts_per_step
    n, max_tokens = cfg.rollout.n, (16 if quick else cfg.rollout.max_tokens)
    per_micro = cfg.dataflow.prompts_per_micro_batch
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(4, 90) for _ in range(rng.randrange(12, 24))] for _ in range(prompts_per_step)]
    rows: dict[str, Any] = {}
    for eager, mode, core in variants:
        label = "eager" if eager else "graphs"
        rcfg = msgspec.structs.replace(cfg.rollout, enforce_eager=eager, gpu_memory_utilization=0.5,
                                       engine_core=core)
        backend = VLLMBackend(model_path, rcfg, cfg.model.dtype, output_mode=mode)
        t0 = time.perf_counter()
        await backend.start()
        startup = time.perf_counter() - t0
        try:
            name = f"{label}/{'final' if mode is None else 'stream'}" + ("/in_process" if core == "in_process" else "")
            rows[name] = await _timed(lambda s, b=backend: _backend_step(b, prompts, n, max_tokens, per_micro),
                                      ROUNDS)
            rows[name].update(startup_s=startup, output_mode=backend._output_mode)
            if mode is None and core == "subprocess":
                rows[f"{label}/bare"] = await _timed(
                    lambda s, e=backend._engine: _bare_step(e, prompts, n, max_tokens, s), ROUNDS)
            if core == "in_process":
                rows[name]["engine"] = backend.engine_stats()
                rows[f"{label}/bare/in_process"] = await _timed(
                    lambda s, e=backend._engine: _bare_in_process_step(e, prompts, n, max_tokens, s), ROUNDS)
                rows[f"{label}/bare/in_process"]["engine"] = backend.engine_stats()  # cumulative: both rows
        finally:
            await backend.shutdown()
    return {"rows": rows, "params": {"prompts_per_step": prompts_per_step, "n": n, "max_tokens": max_tokens,
                                     "prompts_per_micro_batch": per_micro, "rounds": ROUNDS,
                                     "model": str(model_path), "dtype": cfg.model.dtype}}


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    device = cuda_device_name()
    if device is None:
        return publish_skipped_without_gpu(out_dir, "rollout_gpu", quick)
    result = asyncio.run(measure(quick))
    rows = result["rows"]
    rate = {k: v["tokens_per_s"] for k, v in rows.items()}
    ratios = {
        "device": device,
        **{f"{k}_tokens_per_s": v for k, v in rate.items()},
        "graphs_final_over_bare": rate["graphs/final"] / rate["graphs/bare"],
        "graphs_stream_over_bare": rate["graphs/stream"] / rate["graphs/bare"],
        "eager_final_over_bare": rate["eager/final"] / rate["eager/bare"],
        "graphs_bare_step_s": rows["graphs/bare"]["best_step_s"],
        "graphs_over_eager_final": rate["graphs/final"] / rate["eager/final"],
        "final_over_stream_graphs": rate["graphs/final"] / rate["graphs/stream"],
        "graphs_final_step_s": rows["graphs/final"]["best_step_s"],
        "in_process_over_subprocess": rate["graphs/final/in_process"] / rate["graphs/final"],
        "graphs_in_process_step_s": rows["graphs/final/in_process"]["best_step_s"],
    }
    payload = {"quick": quick, "units": "completion tokens/s; seconds", **result, "ratios": ratios}
    return publish_result(out_dir, "rollout_gpu", payload, plot)


def plot(payload: dict[str, Any]) -> Any:
    rows = payload["rows"]
    names = list(rows)
    fig, axes = new_figure(1, 1, size=(8, 4.5))
    ax = axes[0][0]
    ax.bar(range(len(names)), [rows[k]["tokens_per_s"] for k in names], color="tab:blue")
    ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
    ax.set_ylabel("completion tokens/s (best round)")
    ax.set_title(f"rollout on {payload['ratios']['device']}: backend vs bare vLLM")
    return fig
