"""The engines alone at a job's shape: what vLLM and the DeepSpeed trainer do on this GPU
with nothing else on it, the ceiling ``bench gpu_e2e`` reports its rows against.

For the job a ``gpu_e2e`` row runs (its config and overrides: model, data, step shape),
each engine in a process of its own (``bench.gpu_e2e`` runs one child per engine, so
each starts on an empty GPU and gives its memory back when it exits):

- ``rollout_tokens_per_s``: completion tokens/s of one step's requests (``prompts_per_step``
  prompts of the job's data, rendered as the run renders them, ``n`` samples each, up
  to ``max_tokens``) submitted straight to vLLM configured as the rollout configures
  it (its engine core where ``rollout.engine_core: auto`` puts it: in this process on
  one GPU; ``bench.rollout_gpu``'s bare step), with no log-probs computed (no sampler
  tap either), vLLM's own ``max_num_seqs`` (the rows get the launch's plan) and
  ``ENGINE_MEMORY`` of the GPU; the best of ``ROUNDS`` after a warm-up step. What the
  rows add (Conveyor's requests, the sampler's log-probs, sharing the GPU) is what
  their fraction of it shows;
- ``trainer_tokens_per_s``: prompt and completion tokens/s of one step's micro-batches
  through ``train_micro_batch`` and ``optimizer_step`` of the run's own trainer engine
  (``bench.trainer_gpu``'s step and batches: prompts of 12-23 tokens, every completion
  ``max_tokens`` long; the run's chunk size and compile setting), the best of
  ``ROUNDS`` after a warm-up step.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import msgspec

from bench.rollout_gpu import ROUNDS, _bare_in_process_step, _bare_step, _timed
from bench.trainer_gpu import _timed_step, build_step_batches

ENGINE_MEMORY = 0.85  # vLLM's share of the GPU when it runs alone


def build_prompt_ids(cfg: Any, tokenizer: Any, model_path: Path, count: int) -> list[list[int]]:
    """The first ``count`` usable prompts of the job as the run renders them
    (``stages.data.prompt_rows``): its data file's rows, chat rows through the tokenizer's
    template, or, without ``data.path``, its task's rows."""
    from stages.data.files import open_data
    from stages.data.prompt_rows import PromptRenderer, RowError, render_rows, resolve_columns
    from stages.data.tasks import load_task

    renderer = PromptRenderer(tokenizer, cfg.data.chat_template, model_path, cfg.data.max_prompt_len)
    if cfg.data.path is None:
        rows = load_task(cfg.data.task, **cfg.data.task_kwargs).generate_rows(cfg.run.seed, count)
        rendered = renderer.render([(f"task row {i}", row) for i, row in enumerate(rows)])
    else:
        data = open_data(cfg.data.path)
        cmap = resolve_columns(data.columns, cfg.data.prompt_key, cfg.data.answer_key, data.name, cfg.data.pairs)
        items = ((n, f"{data.name} row {n}", row) for n, row in data.scan(cmap.columns))
        rendered = [res for _, _, res in render_rows(items, cmap, renderer)]
    ids = [r["token_ids"] for r in rendered if not isinstance(r, RowError)][:count]
    if len(ids) < count:
        raise ValueError(f"data: {len(ids)} usable prompts, the engines' step needs {count}")
    return ids


async def measure_rollout_alone(cfg: Any, model_path: Path, prompts: list[list[int]]) -> dict[str, Any]:
    from stages.rollout.vllm_backend import VLLMBackend, resolve_engine_core

    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # No log-probs at all: with them on, the in-process engine would install the sampler
    # tap, which computes one for every sampled token whatever a request asks.
    rcfg = msgspec.structs.replace(cfg.rollout, gpu_memory_utilization=ENGINE_MEMORY, kv_cache_gib=None,
                                   engine_core=resolve_engine_core("auto", cfg.rollout.tensor_parallel_size),
                                   logprobs=False, sampler_tap="never")
    backend = VLLMBackend(model_path, rcfg, cfg.model.dtype)
    await backend.start()
    try:
        step = _bare_in_process_step if rcfg.engine_core == "in_process" else _bare_step
        timed = await _timed(lambda s: step(backend._engine, prompts, cfg.rollout.n, cfg.rollout.max_tokens, s,
                                            logprobs=None), ROUNDS)
        return {**timed, "engine_core": rcfg.engine_core}
    finally:
        await backend.shutdown()


def measure_trainer_alone(cfg: Any) -> dict[str, Any]:
    import torch

    from stages.algorithms import assign_advantages
    from stages.trainer.engine import build_trainer_engine

    engine = build_trainer_engine(cfg)
    vocab = int(engine.module.config.vocab_size)
    # Every completion at the cap: the trainer's most tokens a step at this job's shape
    # (its best rate), as a random-init checkpoint's completions run in the rows.
    batches = [assign_advantages(b, cfg.algorithm) for b in build_step_batches(
        cfg.train.prompts_per_step, cfg.dataflow.prompts_per_micro_batch, cfg.rollout.n, cfg.rollout.max_tokens,
        vocab, min_tokens=cfg.rollout.max_tokens)]
    tokens = sum(b.num_tokens for b in batches)
    _timed_step(engine, batches, torch)  # warm-up
    laps = [_timed_step(engine, batches, torch) for _ in range(ROUNDS)]
    best = min(laps, key=lambda r: r["train_s"] + r["update_s"])
    return {**best, "tokens": tokens, "tokens_per_s": tokens / (best["train_s"] + best["update_s"]),
            "step_s_rounds": [r["train_s"] + r["update_s"] for r in laps]}


def measure_engine(which: str, config: Path, overrides: list[str]) -> dict[str, Any]:
    """One engine alone (``which``: ``rollout`` or ``trainer``) on the job ``config`` with
    ``overrides`` (see the module docstring); in a process of its own."""
    from pipeline.config import load_config

    cfg = load_config(config, overrides)
    if which == "trainer":
        return measure_trainer_alone(cfg)
    if which != "rollout":
        raise ValueError(f"which: expected 'rollout' or 'trainer', got {which!r}")
    from transformers import AutoTokenizer

    from stages.models.tiny import resolve_model_path

    model_path = resolve_model_path(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = build_prompt_ids(cfg, tokenizer, model_path, cfg.train.prompts_per_step)
    return {**asyncio.run(measure_rollout_alone(cfg, model_path, prompts)),
            "prompt_len_mean": sum(map(len, prompts)) / len(prompts)}


def engines_row(rollout: dict[str, Any], trainer: dict[str, Any]) -> dict[str, Any]:
    """The ``engines`` row of ``bench gpu_e2e`` from the two engines' measurements."""
    return {"system": "engines-alone", "status": "ok", "rollout": rollout, "trainer": trainer,
            "prompt_len_mean": rollout.get("prompt_len_mean"),
            "rollout_tokens_per_s": rollout["tokens_per_s"], "trainer_tokens_per_s": trainer["tokens_per_s"],
            "engine_memory": ENGINE_MEMORY, "rollout_engine_core": rollout.get("engine_core"),
            "rollout_logprobs": False}
