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

For a job whose prompts carry their own lengths (``bench longtail``: rows with
``data.max_tokens_field``), ``run_schedule_engines`` measures both engines on those
lengths instead (``measure_rollout_on_schedule``: a step at a time and every step at
once; ``measure_trainer_on_schedule``: the job's micro-batches and each step as one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

from bench.rollout_gpu import ROUNDS, _bare_in_process_step, _bare_step, _timed
from bench.trainer_gpu import _timed_step, build_step_batches, time_train_and_update

ENGINE_MEMORY = 0.85  # vLLM's share of the GPU when it runs alone


def build_prompt_ids(cfg: Any, tokenizer: Any, model_path: Path, count: int) -> list[list[int]]:
    """The first ``count`` usable prompts of the job as the run renders them
    (``stages.data.prompt_rows``): its data file's rows, chat rows through the tokenizer's
    template, or, without ``data.path``, its task's rows."""
    return [ids for ids, _ in build_prompt_requests(cfg, tokenizer, model_path, count)]


def build_prompt_requests(cfg: Any, tokenizer: Any, model_path: Path,
                          count: int) -> list[tuple[list[int], tuple[int, int]]]:
    """``build_prompt_ids`` with each prompt's (max, min) completion tokens: its row's
    budget (``data.max_tokens_field`` / ``min_tokens_field``) clamped to
    ``rollout.max_tokens`` as the rollout clamps it, else (``rollout.max_tokens``, 0)."""
    from stages.data.files import open_data
    from stages.data.prompt_rows import (
        PromptRenderer,
        RowError,
        budget_fields,
        read_budget,
        render_rows,
        resolve_columns,
    )
    from stages.data.tasks import load_task

    cap = cfg.rollout.max_tokens
    renderer = PromptRenderer(tokenizer, cfg.data.chat_template, model_path, cfg.data.max_prompt_len)
    if cfg.data.path is None:
        rows = load_task(cfg.data.task, **cfg.data.task_kwargs).generate_rows(cfg.run.seed, count)
        rendered = [(r, (None, None)) for r in renderer.render([(f"task row {i}", row) for i, row in enumerate(rows)])]
    else:
        data = open_data(cfg.data.path)
        cmap = resolve_columns(data.columns, cfg.data.prompt_key, cfg.data.answer_key, data.name, cfg.data.pairs,
                               budget=budget_fields(cfg.data))
        raw: dict[int, Any] = {}

        def items() -> Any:
            for n, row in data.scan(cmap.columns):
                raw[n] = row
                yield n, f"{data.name} row {n}", row

        rendered = []
        for n, where, res in render_rows(items(), cmap, renderer):
            try:
                rendered.append((res, read_budget(raw.pop(n), cmap, where)))
            except RowError as err:
                rendered.append((err, (None, None)))
    out = [(r["token_ids"], (min(high or cap, cap), min(low or 0, high or cap, cap)))
           for r, (high, low) in rendered if not isinstance(r, RowError)][:count]
    if len(out) < count:
        raise ValueError(f"data: {len(out)} usable prompts, the engines' step needs {count}")
    return out


@contextlib.asynccontextmanager
async def alone_engine(cfg: Any, model_path: Path) -> AsyncIterator[tuple[Any, Any, str]]:
    """(vLLM engine, its bare step function, engine core) configured as the rollout
    configures it, at ``ENGINE_MEMORY`` of the GPU; shut down on exit."""
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
        yield backend._engine, (_bare_in_process_step if rcfg.engine_core == "in_process" else _bare_step), \
            rcfg.engine_core
    finally:
        await backend.shutdown()


async def measure_rollout_alone(cfg: Any, model_path: Path, prompts: list[list[int]]) -> dict[str, Any]:
    async with alone_engine(cfg, model_path) as (engine, step, core):
        timed = await _timed(lambda s: step(engine, prompts, cfg.rollout.n, cfg.rollout.max_tokens, s,
                                            logprobs=None), ROUNDS)
        return {**timed, "engine_core": core}


async def measure_rollout_on_schedule(cfg: Any, model_path: Path, requests: list[tuple[list[int], tuple[int, int]]],
                                      per_step: int) -> dict[str, Any]:
    """vLLM alone on prompts that carry their own lengths (``build_prompt_requests``), after
    a warm-up step, two ways: ``by_step``, each step's requests together and the steps one
    after another (the most lock-step's rollout can do: a step waits for its longest);
    ``all_at_once``, every step's requests together (the engine kept full until the last
    tail: the most streaming can do). Completion tokens/s of each."""
    prompts, budgets = [ids for ids, _ in requests], [b for _, b in requests]
    cap, n = cfg.rollout.max_tokens, cfg.rollout.n

    async with alone_engine(cfg, model_path) as (engine, step, core):
        async def run(tag: str, lo: int, hi: int) -> int:
            return await step(engine, prompts[lo:hi], n, cap, tag, logprobs=None, budgets=budgets[lo:hi])

        await run("warm-up", 0, per_step)
        t0 = time.perf_counter()
        by_step = [await run(f"step-{k}", k, k + per_step) for k in range(0, len(prompts), per_step)]
        t1 = time.perf_counter()
        together = await run("all", 0, len(prompts))
        t2 = time.perf_counter()
        scheduler = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
    # vLLM's own max_num_seqs (a launch plans the rollout's to what it keeps in flight).
    return {"engine_core": core, "requests": len(prompts) * n, "max_num_seqs": getattr(scheduler, "max_num_seqs", None),
            "by_step": {"tokens": sum(by_step), "s": t1 - t0, "tokens_per_s": sum(by_step) / (t1 - t0)},
            "all_at_once": {"tokens": together, "s": t2 - t1, "tokens_per_s": together / (t2 - t1)}}


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


def measure_trainer_on_schedule(cfg: Any, groups: list[tuple[int, int]], per_step: int) -> dict[str, Any]:
    """The run's trainer engine alone on a schedule's steps (``groups``: each prompt's
    (prompt tokens, completion tokens), ``per_step`` prompts a step), each step after a
    warm-up, two ways: ``micro_batches``, as the job cuts them
    (``dataflow.prompts_per_micro_batch`` prompts), and ``one_per_step``, each step as one
    micro-batch whose passes ``train.pass_tokens`` packs over all its samples: what larger
    passes would give. Tokens/s over passes and updates, passes, and on a GPU the share of
    one micro-batch's time it ran kernels (step 0's median micro-batch; for
    ``one_per_step``, step 0 whole)."""
    import torch

    from bench.trainer_gpu import _gpu_busy_share
    from stages.algorithms import assign_advantages
    from stages.trainer.engine import build_trainer_engine

    engine = build_trainer_engine(cfg)
    vocab, n, cap = int(engine.module.config.vocab_size), cfg.rollout.n, cfg.rollout.max_tokens
    steps = [groups[k:k + per_step] for k in range(0, len(groups), per_step)]
    on_gpu = torch.cuda.is_available()
    out: dict[str, Any] = {}
    for name, per_micro in (("micro_batches", cfg.dataflow.prompts_per_micro_batch), ("one_per_step", per_step)):
        planned = [[assign_advantages(b, cfg.algorithm)
                    for b in build_step_batches(per_step, per_micro, n, cap, vocab, groups=g)] for g in steps]
        time_train_and_update(engine, planned[0], torch)  # warm-up
        laps = [time_train_and_update(engine, batches, torch) for batches in planned]
        tokens = sum(b.num_tokens for batches in planned for b in batches)
        train, update = sum(t for t, _ in laps), sum(u for _, u in laps)
        probe = sorted(planned[0], key=lambda b: b.num_tokens)[len(planned[0]) // 2]
        out[name] = {"tokens": tokens, "train_s": train, "update_s": update, "tokens_per_s": tokens / (train + update),
                     "micro_batches": sum(map(len, planned)),
                     "passes": sum(len(engine.plan_passes(b)) for batches in planned for b in batches),
                     "gpu_busy_share": _gpu_busy_share(engine, probe, torch) if on_gpu else None}
    return out



def measure_schedule_engine(which: str, config: Path, overrides: list[str], prompts: int) -> dict[str, Any]:
    """One engine alone (``rollout`` or ``trainer``) on the first ``prompts`` prompts of a
    job whose rows carry their lengths (``bench longtail``'s); in a process of its own."""
    from pipeline.config import load_config

    cfg = load_config(config, overrides)
    requests = _schedule_requests(cfg, prompts)
    if which == "trainer":
        return measure_trainer_on_schedule(cfg, [(len(ids), high) for ids, (high, _) in requests],
                                           cfg.train.prompts_per_step)
    if which != "rollout":
        raise ValueError(f"which: expected 'rollout' or 'trainer', got {which!r}")
    from stages.models.tiny import resolve_model_path

    return asyncio.run(measure_rollout_on_schedule(cfg, resolve_model_path(cfg.model), requests,
                                                   cfg.train.prompts_per_step))


def _schedule_requests(cfg: Any, prompts: int) -> list[tuple[list[int], tuple[int, int]]]:
    from transformers import AutoTokenizer

    from stages.models.tiny import resolve_model_path

    model_path = resolve_model_path(cfg.model)
    return build_prompt_requests(cfg, AutoTokenizer.from_pretrained(model_path), model_path, prompts)


def run_schedule_engines(config: Path, overrides: tuple[str, ...], prompts: int, root: Path) -> dict[str, Any]:
    """``measure_schedule_engine`` for vLLM and then the trainer, each in a process of its
    own (the GPU's memory goes back when it exits), as one row."""
    root.mkdir(parents=True, exist_ok=True)
    got = {}
    for which in ("rollout", "trainer"):
        out = root / f"engine-{which}.json"
        argv = [sys.executable, "-m", "bench.engine_alone", "schedule", which, str(config), str(out), str(prompts),
                *overrides]
        code = subprocess.run(argv, check=False).returncode
        if code != 0 or not out.is_file():
            raise RuntimeError(f"the {which} engine's process exited with status {code} (its output is above)")
        got[which] = json.loads(out.read_text())
    return schedule_engines_row(got["rollout"], got["trainer"])


def schedule_engines_row(rollout: dict[str, Any], trainer: dict[str, Any]) -> dict[str, Any]:
    """The ``engines`` row of ``bench longtail`` from the two engines' measurements."""
    return {"system": "engines-alone", "status": "ok", "rollout": rollout, "trainer": trainer,
            "engine_memory": ENGINE_MEMORY, "rollout_engine_core": rollout.get("engine_core"),
            "rollout_tokens_per_s_by_step": rollout["by_step"]["tokens_per_s"],
            "rollout_tokens_per_s_all_at_once": rollout["all_at_once"]["tokens_per_s"],
            "trainer_tokens_per_s_micro_batches": trainer["micro_batches"]["tokens_per_s"],
            "trainer_tokens_per_s_one_per_step": trainer["one_per_step"]["tokens_per_s"]}


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


if __name__ == "__main__":  # run_schedule_engines' children
    args = sys.argv[1:]
    if len(args) >= 5 and args[0] == "schedule":  # schedule WHICH CONFIG OUT_JSON PROMPTS [OVERRIDE...]
        Path(args[3]).write_text(json.dumps(measure_schedule_engine(args[1], Path(args[2]), args[5:], int(args[4]))))
    else:
        sys.exit("usage: python -m bench.engine_alone schedule rollout|trainer CONFIG OUT_JSON PROMPTS [OVERRIDE...]")
