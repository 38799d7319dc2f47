"""The trainer engine alone on a GPU: where a step's time goes, per ``train.chunk_size``.

On ``configs/gpu_small.yaml``'s model (268.7M-parameter Llama, bf16) and step shape (32
prompts x 8 samples, prompts of 12-23 tokens, completions of 64-128), in this process,
with a CUDA sync at each boundary, eager (``train.compile: off``), in fixed-row chunks
(``train.pass_tokens: 0``):

- ``train_s``: the step's four 64-sample micro-batches through ``train_micro_batch``
  (forward and backward, ``chunk_size`` samples per pass);
- ``update_s``: ``optimizer_step``; ``export_s``: ``export_weights_ipc`` (the weights
  packed for CUDA IPC, as every step publishes them on one GPU); ``release_s``:
  ``release_cached_memory`` (a colocated step's hand-back: a full garbage collection
  and ``torch.cuda.empty_cache``);
- ``peak_gib``: the allocator's peak during the step;
- per chunk size one warm-up step, then ``ROUNDS`` timed ones (the best is reported).

Also the process's garbage collector: a full collection and a young-generation one
(``gc.collect(1)``) timed with the engine built, and ``gpu_busy_share``: the kernels'
own time over the wall time of one micro-batch at the default chunk size (torch
profiler): well under 1 means the passes wait on the CPU launching them. Writes
``bench/results/trainer_gpu/`` (JSON and PNG); needs a CUDA GPU (status "skipped" without one).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import cuda_device_name, new_figure, note_config, publish_result, publish_skipped_without_gpu

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gpu_small.yaml"
ROUNDS = 3
CHUNK_SIZES = (16, 32, 64)


def build_step_batches(prompts_per_step: int, per_micro: int, n: int, max_tokens: int, vocab: int,
                       seed: int = 0, min_tokens: int | None = None,
                       groups: Sequence[tuple[int, int]] | None = None) -> list[Any]:
    """The step's micro-batches: random token ids, completions of ``min_tokens`` (None:
    half of ``max_tokens``) to ``max_tokens``, every second sample of a group rewarded,
    behaviour log-probs of a uniform sampler (ratios far from 1 are clipped, as they
    would be). ``groups``: each prompt's (prompt tokens, completion tokens), shared by
    its ``n`` samples (a long-tail job's schedule), instead of drawn lengths."""
    from pipeline.types import Prompt, RolloutBatch

    if groups is not None and len(groups) != prompts_per_step:
        raise ValueError(f"groups: expected one (prompt, completion) length per prompt ({prompts_per_step}), "
                         f"got {len(groups)}")
    rng = np.random.default_rng(seed)
    out = []
    for m in range(prompts_per_step // per_micro):
        num = per_micro * n
        if groups is None:
            plens = np.repeat(rng.integers(12, 24, per_micro), n).astype(np.int32)
            clens = rng.integers(max_tokens // 2 if min_tokens is None else min_tokens, max_tokens + 1,
                                 num).astype(np.int32)
        else:
            mine = np.asarray(groups[m * per_micro:(m + 1) * per_micro], dtype=np.int32)
            plens, clens = np.repeat(mine[:, 0], n), np.repeat(np.minimum(mine[:, 1], max_tokens), n)
        prompt_ids = rng.integers(4, vocab, (num, int(plens.max()))).astype(np.int32)
        prompt_ids[np.arange(prompt_ids.shape[1])[None, :] >= plens[:, None]] = 0
        width = int(clens.max()) if groups is not None else max_tokens  # a batch is as wide as its longest
        comp = rng.integers(4, vocab, (num, width)).astype(np.int32)
        comp[np.arange(width)[None, :] >= clens[:, None]] = 0
        out.append(RolloutBatch(
            batch_id=m, step=0, prompts=[Prompt(prompt_id=f"p{m}-{g}", text="") for g in range(per_micro)],
            group_size=n, sample_ids=[f"p{m}-{i // n}-{i % n}" for i in range(num)],
            prompt_ids=prompt_ids, prompt_lens=plens, completion_ids=comp, completion_lens=clens,
            completions=[""] * num, behaviour_logprobs=np.full((num, width), -np.log(vocab), np.float32),
            token_versions=np.zeros((num, width), np.int32), policy_version=0,
            rewards=(np.arange(num) % 2 == 0).astype(np.float32)))
    return out


def timed_seconds(fn: Any, torch: Any) -> float:
    """Seconds ``fn()`` takes, the device's queued work finished on both sides (on a GPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def time_train_and_update(engine: Any, batches: list[Any], torch: Any) -> tuple[float, float]:
    """(seconds of ``batches``' passes, seconds of the optimizer's update): one step."""
    scale = 1.0 / len(batches)
    return (sum(timed_seconds(lambda b=b: engine.train_micro_batch(b, scale), torch) for b in batches),
            timed_seconds(engine.optimizer_step, torch))


def _timed_step(engine: Any, batches: list[Any], torch: Any) -> dict[str, float]:
    torch.cuda.reset_peak_memory_stats()
    train, update = time_train_and_update(engine, batches, torch)
    peak = torch.cuda.max_memory_allocated() / (1 << 30)
    export = timed_seconds(engine.export_weights_ipc, torch)
    release = timed_seconds(engine.release_cached_memory, torch)
    return {"train_s": train, "update_s": update, "export_s": export, "release_s": release,
            "step_s": train + update + export + release, "peak_gib": peak}


def _gpu_busy_share(engine: Any, batch: Any, torch: Any) -> float:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.train_micro_batch(batch, 1.0)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    engine.discard_gradients()
    kernels_us = sum(e.self_device_time_total for e in prof.key_averages())
    return kernels_us / 1e6 / wall


def measure(quick: bool) -> dict[str, Any]:
    import torch

    from pipeline.config import load_config
    from stages.algorithms import assign_advantages
    from stages.trainer.engine import build_trainer_engine

    # Eager: these rows measure the passes as launched op by op (train.compile's fused
    # blocks are measured end to end by bench gpu_e2e, colocate[train.compile=off]).
    # Fixed-row chunks (train.pass_tokens=0): the rows compare chunk sizes.
    cfg = load_config(CONFIG, ["train.compile=off", "train.pass_tokens=0",
                               *(["train.prompts_per_step=8"] if quick else [])])
    note_config(cfg)
    engine = build_trainer_engine(cfg)
    vocab = int(engine.module.config.vocab_size)
    batches = [assign_advantages(b, cfg.algorithm) for b in build_step_batches(
        cfg.train.prompts_per_step, cfg.dataflow.prompts_per_micro_batch, cfg.rollout.n,
        16 if quick else cfg.rollout.max_tokens, vocab)]
    rows: dict[str, Any] = {}
    for chunk in CHUNK_SIZES:
        engine.chunk_size = chunk
        _timed_step(engine, batches, torch)  # warm-up (allocator, kernels' autotuning)
        laps = [_timed_step(engine, batches, torch) for _ in range(1 if quick else ROUNDS)]
        best = min(laps, key=lambda r: r["step_s"])
        rows[f"chunk_{chunk}"] = {**best, "chunk_size": chunk, "step_s_rounds": [r["step_s"] for r in laps]}
    engine.chunk_size = CHUNK_SIZES[0]
    busy = _gpu_busy_share(engine, batches[0], torch)
    t0 = time.perf_counter()
    gc.collect()
    full = time.perf_counter() - t0
    t0 = time.perf_counter()
    gc.collect(1)
    young = time.perf_counter() - t0
    return {"rows": rows, "gc": {"full_s": full, "young_s": young, "tracked_objects": len(gc.get_objects())},
            "gpu_busy_share": busy,
            "params": {"prompts_per_step": cfg.train.prompts_per_step, "n": cfg.rollout.n,
                       "prompts_per_micro_batch": cfg.dataflow.prompts_per_micro_batch, "rounds": ROUNDS,
                       "dtype": cfg.model.dtype, "chunk_sizes": list(CHUNK_SIZES)}}


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    device = cuda_device_name()
    if device is None:
        return publish_skipped_without_gpu(out_dir, "trainer_gpu", quick)
    result = measure(quick)
    rows = result["rows"]
    base = rows[f"chunk_{CHUNK_SIZES[0]}"]
    ratios = {
        "device": device,
        **{f"{k}_step_s": v["step_s"] for k, v in rows.items()},
        **{f"{k}_over_chunk_{CHUNK_SIZES[0]}_step_s": v["step_s"] / base["step_s"] for k, v in rows.items()},
        "release_share_of_step": base["release_s"] / base["step_s"],
        "gc_full_over_young": result["gc"]["full_s"] / max(result["gc"]["young_s"], 1e-9),
        "gpu_busy_share": result["gpu_busy_share"],
    }
    payload = {"quick": quick, "units": "seconds; GiB", **result, "ratios": ratios}
    return publish_result(out_dir, "trainer_gpu", payload, plot)


def plot(payload: dict[str, Any]) -> Any:
    rows = payload["rows"]
    names = list(rows)
    parts = ("train_s", "update_s", "export_s", "release_s")
    fig, axes = new_figure(1, 1, size=(8, 4.5))
    ax = axes[0][0]
    bottom = np.zeros(len(names))
    for part in parts:
        vals = np.array([rows[k][part] for k in names])
        ax.bar(range(len(names)), vals, bottom=bottom, label=part)
        bottom += vals
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("seconds per step (best round)")
    ax.set_title(f"trainer step on {payload['ratios']['device']} by chunk size")
    ax.legend()
    return fig
