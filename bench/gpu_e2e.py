"""GPU end to end: ``configs/gpu_small.yaml`` streaming vs lock-step vs colocated vs TRL on the same GPU.

Runs Conveyor (``async``, ``sync``, ``colocate``, launched by
``pipeline.launch.launch_run``) and TRL's ``GRPOTrainer`` (vLLM colocated, in a process of
its own) one after the other on the same job; ``--systems`` names the rows and their
order, ``--model NAME`` runs the job at a real shape of ``stages.models.shapes``. Rows,
options and metrics in detail: docs/architecture.md, "GPU end to end".

Guarantees:
- every row trains the same locally built model, prompts, group size, completion
  length, temperature, learning rate, clip, grad clip, token-mean loss and steps;
- steady-state figures leave out the first ``WARMUP_STEPS`` steps and are per GPU used;
- a repeated system gives its ratio round by round as well, so drift shows;
- writes ``bench/results/gpu_e2e/`` (JSON and PNG); without a CUDA GPU the result's
  status is "skipped".
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    check_row_streamed,
    describe_startup_parts,
    hash_config,
    new_figure,
    note_config,
    publish_result,
    stage_log_timings,
)
from bench.e2e import _attempt, _version, build_trl_args, build_trl_dataset, summarize_curve
from bench.shape_job import build_job_rows, describe_shape, prepare_job

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "gpu_small.yaml"
WARMUP_STEPS = 5
ONE_GPU_BOUND = 246.0  # samples per second, engines alone in sequence (docs/performance/gpu-e2e.md)


def compute_steady_rate(times: list[float], samples_per_step: int, warmup: int) -> float | None:
    """Samples/s from the end of step ``warmup - 1`` to the end of the last step."""
    if len(times) <= warmup:
        return None
    span = times[-1] - times[warmup - 1]
    return (len(times) - warmup) * samples_per_step / span if span > 0 else None


def mode_overrides(mode: str) -> list[str]:
    """What a Conveyor row's mode changes in the config: ``sync`` and ``colocate`` train
    in lock-step on-policy, ``colocate`` also time-shares the GPU; ``_in_process`` /
    ``_subprocess`` choose ``rollout.engine_core``; any other name: nothing."""
    base = mode.removesuffix("_in_process").removesuffix("_subprocess")
    overrides = []
    if base in ("sync", "colocate"):
        overrides += ["dataflow.async_execution=false", "dataflow.max_staleness=0"]
    if base == "colocate":
        overrides += ["placement=colocate"]
    if base != mode:
        overrides += [f"rollout.engine_core={mode[len(base) + 1:]}"]
    return overrides


def compute_stage_rates(rows: list[dict[str, Any]], samples_per_step: int) -> dict[str, float | None]:
    """Tokens/s of the rollout and the trainer per second each was busy, the mean over
    ``rows`` (steps): the rollout's completion tokens (mean length x samples) over its
    busy seconds (``timing_s/rollout``), the trainer's prompt and completion tokens
    (``throughput/tokens_per_s`` x ``time/step_s``) over its passes and update
    (``timing_s/train`` + ``timing_s/update``). None where no step has the figures."""
    rollout, trainer = [], []
    for r in rows:
        if r.get("timing_s/rollout") and r.get("response_length/mean") is not None:
            rollout.append(r["response_length/mean"] * samples_per_step / r["timing_s/rollout"])
        busy = (r.get("timing_s/train") or 0.0) + (r.get("timing_s/update") or 0.0)
        if busy > 0 and r.get("throughput/tokens_per_s") and r.get("time/step_s"):
            trainer.append(r["throughput/tokens_per_s"] * r["time/step_s"] / busy)
    return {"rollout_tokens_per_busy_s": _mean(rollout), "trainer_tokens_per_busy_s": _mean(trainer)}


def compute_wall_rates(rows: list[dict[str, Any]], samples_per_step: int, warmup: int) -> dict[str, float | None]:
    """Tokens/s of the rollout and the trainer per second of the steady window (from the
    end of step ``warmup - 1`` to the end of the last step, as ``compute_steady_rate``):
    the completion tokens the steady steps trained (mean length x samples) and the
    trainer's prompt and completion tokens (``throughput/tokens_per_s`` x
    ``time/step_s``), each over the window's wall seconds. Unlike the busy-second rates
    these hold under streaming, where a step's samples were generated partly during the
    step before; None without a steady step."""
    steady = rows[warmup:]
    if warmup < 1 or not steady or any("time" not in r for r in (rows[warmup - 1], steady[-1])):
        return {"rollout_tokens_per_wall_s": None, "trainer_tokens_per_wall_s": None}
    span = steady[-1]["time"] - rows[warmup - 1]["time"]
    rollout = [r.get("response_length/mean") for r in steady]
    trainer = [(r.get("throughput/tokens_per_s") or 0.0) * (r.get("time/step_s") or 0.0) for r in steady]
    return {"rollout_tokens_per_wall_s": sum(rollout) * samples_per_step / span
            if span > 0 and None not in rollout else None,
            "trainer_tokens_per_wall_s": sum(trainer) / span if span > 0 and all(trainer) else None}


def run_conveyor(mode: str, steps: int, root: Path, extra: tuple[str, ...] = (),
                 gpus: int | None = None, config: Path = CONFIG) -> dict[str, Any]:
    """One Conveyor run of the config with ``mode``'s overrides (``sync``, ``colocate``,
    either or ``async`` with ``_in_process`` or ``_subprocess``: that ``rollout.engine_core``;
    any other name: the config as it is) and ``extra`` ones; ``gpus``: the GPUs it may use
    (default: every one this process sees); ``config``: the job (default ``CONFIG``)."""
    import torch

    from pipeline.config import load_config
    from pipeline.launch import launch_run
    from pipeline.metrics import read_metrics

    overrides = [f"run.dir={root / mode}", f"run.steps={steps}", "run.progress=false", f"run.name=gpu-e2e-{mode}",
                 "train.save_checkpoint=false", "train.resumable=false", "run.tensorboard=false", *mode_overrides(mode), *extra]
    cfg = load_config(config, overrides)
    note_config(cfg)
    per_step = cfg.train.prompts_per_step * cfg.rollout.n
    t0 = time.time()
    summary = launch_run(cfg)
    total = time.time() - t0
    if mode.startswith("async"):
        check_row_streamed(mode, summary)
    rows = read_metrics(cfg.run_dir)
    times = [r["time"] for r in rows]
    gpus = gpus or max(1, torch.cuda.device_count())
    rate = compute_steady_rate(times, per_step, WARMUP_STEPS) or 0.0
    tokens = [r.get("throughput/tokens_per_s") for r in rows[WARMUP_STEPS:]]
    return {
        "system": f"conveyor-{mode}", "overrides": overrides, "steps": summary["steps"], "gpus": gpus,
        "startup_s": times[0] - t0 if times else None, "startup": describe_startup_parts(summary),
        "startup_log": stage_log_timings(cfg.run_dir), "total_s": total,
        "samples_trained": summary["samples"]["trained"], "samples_dropped": summary["samples"]["dropped"],
        "samples_per_s": rate, "samples_per_s_per_gpu": rate / gpus if rate else None,
        "completion_tokens_per_s": _mean([r.get("response_length/mean", 0) * per_step / r["time/step_s"]
                                          for r in rows[WARMUP_STEPS:] if r.get("time/step_s")]),
        "trainer_tokens_per_s": _mean(tokens),
        **compute_stage_rates(rows[WARMUP_STEPS:], per_step),
        **compute_wall_rates(rows, per_step, WARMUP_STEPS),
        "weight_sync_share": _mean([r.get("perf/weight_sync_share") for r in rows[WARMUP_STEPS:]]),
        "gpu_util": _mean([r.get("perf/gpu_util") for r in rows[WARMUP_STEPS:]]),
        "busy_ratio": {k: v["busy_ratio"] for k, v in summary["stages"].items()},
        "bound": summary.get("bound"),  # the run's own reading: its bound, why, the keys to try
        "bound_early": summary.get("bound_early"),  # the same over steps 3 to 6 (None in a shorter run)
        "weight_transport": summary["trainer"].get("weight_transport"),
        "weight_publish_s": summary["trainer"].get("weight_publish_s"),
        "gpu_free_gib_while_training": _mean([r.get("colocate/gpu_free_gib") for r in rows[WARMUP_STEPS:]]),
        # Each rollout replica's in-process engine core: steps, mean step, requests per step.
        "rollout_engine": [r.get("engine") for r in summary.get("rollout") or [] if r],
        # Each replica's turns under colocate (sleeps, seconds asleep-going and waking) and
        # weight updates (count, seconds applying, waking included).
        "rollout_turns": [{**{k: r.get(k) for k in ("sleeps", "sleep_s_total", "wake_s_total")},
                           "updates": (r.get("weight_updates") or {}).get("count"),
                           "apply_s_total": (r.get("weight_updates") or {}).get("apply_s_total")}
                          for r in summary.get("rollout") or [] if r],
        "gpu_handoff_s": _mean([r.get("colocate/handoff_s") for r in rows[WARMUP_STEPS:]]),
        # The trainer's step, in its parts (the rest is waiting for micro-batches).
        "trainer_timing_s": summarize_trainer_timing(rows[WARMUP_STEPS:]),
        "trainer_seconds": summary["stages"].get("trainer", {}).get("seconds"),
        **summarize_curve([(row["time"] - t0, row.get("reward/mean")) for row in rows]),
    }


def summarize_trainer_timing(steady: list[dict[str, Any]]) -> dict[str, float | None]:
    """The trainer's mean step after the warm-up in parts (``timing_s/*``: passes, the
    optimizer's update, the weight publish) and ``other``: the step less those (waiting
    for micro-batches, advantages, the colocated handoff, the step's own bookkeeping); and
    the passes: ``passes`` a step, ``pass_tokens`` (computed, padding included) a pass,
    ``pass_s`` a pass and ``pass_tokens_per_s`` while passes run, so that a slow trainer
    can be read as many small passes or slow ones."""
    parts = {k: _mean([r.get(f"timing_s/{k}") for r in steady]) for k in ("train", "update", "weight_publish")}
    step = _mean([r.get("time/step_s") for r in steady])
    known = [v for v in parts.values() if v is not None]
    other = step - sum(known) if step is not None and len(known) == len(parts) else None
    passes, tokens, train = (_mean([r.get("actor/passes") for r in steady]),
                             _mean([r.get("actor/pass_tokens") for r in steady]), parts["train"])
    return {**parts, "step": step, "other": other, "passes": passes,
            "pass_tokens": tokens / passes if tokens is not None and passes else None,
            "pass_s": train / passes if train is not None and passes else None,
            "pass_tokens_per_s": tokens / train if tokens is not None and train else None}


def _mean(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if isinstance(v, int | float)]
    return float(np.mean(vals)) if vals else None


def trl_micro_batch(cfg: Any) -> int:
    """TRL's samples per forward/backward: as many as one of Conveyor's trainer passes
    holds at the job's longest row (``train.pass_tokens`` over prompt + completion
    tokens; ``train.chunk_size`` where ``pass_tokens`` is 0), lowered to a divisor of
    the step's samples so that one step is whole passes."""
    batch = cfg.train.prompts_per_step * cfg.rollout.n
    tokens, longest = cfg.train.pass_tokens, cfg.data.max_prompt_len + cfg.rollout.max_tokens
    rows = min(batch, max(1, tokens // longest) if tokens else cfg.train.chunk_size)
    return max(d for d in range(1, rows + 1) if batch % d == 0)


def run_trl(steps: int, root: Path, job: tuple[str, ...] = ()) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.config import load_config
    from stages.data.tasks import load_task
    from stages.models.tiny import resolve_model_path

    t0 = time.time()
    cfg = load_config(CONFIG, list(job))
    path = resolve_model_path(cfg.model)
    task = load_task(cfg.data.task, **cfg.data.task_kwargs)
    per_step, n = cfg.train.prompts_per_step, cfg.rollout.n
    # With a data file (prepare_job's), the same rows as chat messages: TRL renders them
    # with the checkpoint's chat template.
    data = build_trl_dataset(build_job_rows(cfg, steps * per_step, chat=cfg.data.path is not None))

    def reward(prompts: list[Any], completions: list[Any], ground_truth: list[str], data_source: list[str],
               **_: Any) -> list[float]:
        # A conversational dataset's completions are message lists: score the reply's text.
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(task.compute_score(ds, c, gt)) for c, gt, ds in zip(texts, ground_truth, data_source, strict=True)]

    times: list[float] = []
    curve: list[tuple[float, float | None]] = []

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            times.append(time.time())

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                curve.append((time.time() - t0, float(logs["reward"])))

    micro = trl_micro_batch(cfg)
    trl_args = {**build_trl_args(cfg, root, steps), "per_device_train_batch_size": micro,
                "gradient_accumulation_steps": per_step * n // micro}
    args = GRPOConfig(**trl_args, bf16=True, model_init_kwargs={"dtype": torch.bfloat16},
                      use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                      vllm_enable_sleep_mode=False)
    trainer = GRPOTrainer(model=str(path), reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(path), callbacks=[Record()])
    trainer.train()
    total = time.time() - t0
    rate = compute_steady_rate(times, per_step * n, WARMUP_STEPS) or 0.0
    return {
        "system": "trl-grpo-vllm-colocate", "trl_version": _version("trl"), "config_sha256": hash_config(cfg),
        "micro_batch": micro, "gradient_checkpointing": cfg.train.gradient_checkpointing,
        "steps": trainer.state.global_step,
        "gpus": 1, "startup_s": times[0] - t0 if times else None, "total_s": total,
        "samples_trained": trainer.state.global_step * per_step * n, "samples_dropped": {},
        "samples_per_s": rate, "samples_per_s_per_gpu": rate, **summarize_curve(curve),
    }


def run_trl_isolated(steps: int, root: Path, job: tuple[str, ...] = ()) -> dict[str, Any]:
    """``run_trl`` in a process of its own, its row read back: TRL's in-process vLLM
    engine keeps its GPU memory (tens of GiB) until its process exits, so a
    Conveyor row after it in this process found too little free memory to start vLLM."""
    return _run_child("trl-row", str(steps), root, job)


def run_engines_isolated(root: Path, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """``bench.engine_alone.measure_engine`` of the job, vLLM and then the trainer, each
    in a process of its own (the GPU's memory goes back when it exits), read back into
    one row."""
    from bench.engine_alone import engines_row

    return engines_row(_run_child("engines-rollout", None, root, overrides),
                       _run_child("engines-trainer", None, root, overrides))


def describe_engines(row: dict[str, Any]) -> str:
    """The console line of an ``engines`` row (``bench.engine_alone.engines_row``)."""
    return (f"rollout alone {row['rollout_tokens_per_s']:.0f} tokens per s, "
            f"trainer alone {row['trainer_tokens_per_s']:.0f} tokens per s")


def _run_child(kind: str, steps: str | None, root: Path, overrides: tuple[str, ...]) -> dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"{kind}.json"
    argv = [sys.executable, "-m", "bench.gpu_e2e", kind, *([steps] if steps else []), str(root), str(out), *overrides]
    code = subprocess.run(argv, check=False).returncode
    if code != 0 or not out.is_file():
        raise RuntimeError(f"the {kind} process exited with status {code} (its output is above)")
    return json.loads(out.read_text())


SYSTEMS = ("async", "sync", "colocate", "trl")  # the default rows
SHAPE_SYSTEMS = ("engines", "async", "colocate", "trl")  # the default rows with --model
KNOWN_SYSTEMS = (*SYSTEMS, "engines",
                 *(f"{m}_{core}" for core in ("in_process", "subprocess") for m in ("async", "sync", "colocate")))
_ROW = re.compile(r"(?P<name>[a-z_]+)(?:\[(?P<overrides>[^\[\]]*)\])?")


def split_row(spec: str) -> tuple[str, tuple[str, ...]]:
    """``name[key=value;key=value]`` -> (name, overrides); ``ValueError`` naming what is
    wrong: an unknown name, an override without ``key=``, or overrides on ``trl``."""
    found = _ROW.fullmatch(spec.strip())
    if found is None or found["name"] not in KNOWN_SYSTEMS:
        raise ValueError(f"--systems: expected names from {list(KNOWN_SYSTEMS)}, each with optional "
                         f"[key=value;...] overrides, got {spec.strip()!r}")
    overrides = tuple(o.strip() for o in (found["overrides"] or "").split(";") if o.strip())
    bad = [o for o in overrides if not re.fullmatch(r"[A-Za-z_][\w.]*=.*", o)]
    if bad:
        raise ValueError(f"--systems: {spec.strip()!r}: overrides are key=value, got {bad}")
    if overrides and found["name"] == "trl":
        raise ValueError(f"--systems: {spec.strip()!r}: the TRL row takes no overrides")
    return found["name"], overrides


def parse_systems(text: str | None, model: str | None = None) -> tuple[str, ...]:
    """``--systems a,b[k=v;..],a,..`` (None: ``SYSTEMS``, or ``SHAPE_SYSTEMS`` with a
    ``model``): the rows in order, repeats kept, each written back as ``name`` or
    ``name[k=v;..]``; a bad one raises ``ValueError``."""
    if text is None:
        return SYSTEMS if model is None else SHAPE_SYSTEMS
    if text.count("[") != text.count("]"):
        raise ValueError(f"--systems: unbalanced brackets in {text!r}")
    # Commas split rows, except inside brackets (an override's value may hold one).
    specs = [m.strip() for m in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text) if m.strip()]
    if not specs:
        raise ValueError(f"--systems: expected names from {list(KNOWN_SYSTEMS)}, got {text!r}")
    rows = []
    for spec in specs:
        name, overrides = split_row(spec)
        rows.append(f"{name}[{';'.join(overrides)}]" if overrides else name)
    return tuple(rows)


def check_rows(specs: tuple[str, ...], config: Path = CONFIG, job: tuple[str, ...] = ()) -> None:
    """Load the job as each row runs it (``job``'s overrides, its mode's, then its own), so
    a bad key or value, or a combination the config refuses, stops the bench before any
    row starts (``ConfigError``, a ``ValueError``, naming the row or ``--set``)."""
    from pipeline.config import ConfigError, load_config

    try:
        load_config(config, list(job))
    except ConfigError as exc:
        raise ConfigError(f"--set: {exc}") from None
    for spec in dict.fromkeys(specs):
        name, overrides = split_row(spec)
        if overrides:
            try:
                load_config(config, [*job, *mode_overrides(name), *overrides])
            except ConfigError as exc:
                raise ConfigError(f"--systems: row {spec!r}: {exc}") from None


def row_labels(specs: tuple[str, ...]) -> list[str]:
    """One label per row: its spec, with ``#2``, ``#3``.. on a repeat."""
    seen: Counter[str] = Counter()
    labels = []
    for spec in specs:
        seen[spec] += 1
        labels.append(spec if seen[spec] == 1 else f"{spec}#{seen[spec]}")
    return labels


def run_rows(specs: tuple[str, ...], steps: int, model: str | None = None,
             job: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """Each row in order, each in a fresh directory (the job at shape ``model`` when one
    is named, with the ``job`` overrides); a failing one is a row with its error."""
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-gpu-e2e-"))
    rows: dict[str, dict[str, Any]] = {}
    try:
        job = (*(prepare_job(model, steps, root / "job", CONFIG) if model else ()), *job)
        for i, (spec, label) in enumerate(zip(specs, row_labels(specs), strict=True)):
            name, overrides = split_row(spec)
            where = root / str(i)
            if name == "trl":
                rows[label] = (_attempt("trl-grpo", run_trl_isolated, steps, where, job) if _version("trl")
                               else {"system": "trl-grpo", "status": "skipped", "error": "trl is not installed"})
            elif name == "engines":
                rows[label] = _attempt("engines-alone", run_engines_isolated, where, (*job, *overrides),
                                       describe=describe_engines)
            else:
                rows[label] = _attempt(f"conveyor-{spec}", run_conveyor, name, steps, where, (*job, *overrides))
            rows[label]["label"], rows[label]["spec"] = label, spec
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def compute_engine_fractions(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each Conveyor row's rollout and trainer tokens/s per second of its steady window
    (``compute_wall_rates``) over the first ``engines`` row's engine alone, by label;
    empty without an ``engines`` row that ran. Colocated, the two take turns, so their
    sum is at most about 1; streaming, a sum above 1 is what sharing the GPU gained."""
    engines = next((r for r in rows.values() if r["spec"].startswith("engines") and r.get("status") == "ok"), None)
    if engines is None:
        return {}

    def frac(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    return {label: {"rollout": frac(r.get("rollout_tokens_per_wall_s"), engines.get("rollout_tokens_per_s")),
                    "trainer": frac(r.get("trainer_tokens_per_wall_s"), engines.get("trainer_tokens_per_s"))}
            for label, r in rows.items() if r.get("system", "").startswith("conveyor") and r.get("status") == "ok"}


def _row_rate(row: dict[str, Any]) -> float | None:
    """A row's samples per second per GPU; None for a row that failed or was skipped."""
    return row.get("samples_per_s_per_gpu") if row.get("status") == "ok" else None


def rates_by_spec(rows: dict[str, dict[str, Any]]) -> dict[str, list[float | None]]:
    """Samples/s per GPU of each spec's rows, in order (None for a row that failed)."""
    rates: dict[str, list[float | None]] = {}
    for row in rows.values():
        rates.setdefault(row["spec"], []).append(_row_rate(row))
    return rates


def over_trl_by_round(rows: dict[str, dict[str, Any]]) -> dict[str, list[float | None]]:
    """Each Conveyor row's samples per second over its round's TRL row, by spec in order: the first
    TRL row after it, else (a row after the last TRL row) the last one; None where either
    failed. Empty without a TRL row."""
    ordered = list(rows.values())
    trl = [i for i, row in enumerate(ordered) if row["spec"] == "trl"]
    ratios: dict[str, list[float | None]] = {}
    if not trl:
        return ratios
    for i, row in enumerate(ordered):
        if row["spec"] == "trl" or row["spec"].startswith("engines"):
            continue
        paired = ordered[next((t for t in trl if t > i), trl[-1])]
        a, b = _row_rate(row), _row_rate(paired)
        ratios.setdefault(row["spec"], []).append(a / b if a and b else None)
    return ratios


def result_label(specs: tuple[str, ...], model: str | None = None, job: tuple[str, ...] = ()) -> str:
    """``default`` for the default rows (``SYSTEMS``; ``SHAPE_SYSTEMS`` at a shape), else
    every row in order, repeats too, joined by ``-``; at a shape, ``<model>-`` first; the
    ``job`` overrides last (``publish_result`` makes it safe for a file name and short):
    another choice is never taken for the full comparison."""
    rows = "default" if specs == (SYSTEMS if model is None else SHAPE_SYSTEMS) else "-".join(specs)
    return "-".join([*([model] if model else []), rows, *job])


def run(quick: bool, out_dir: Path, systems: str | None = None, model: str | None = None,
        job: tuple[str, ...] = ()) -> dict[str, Any]:
    """``systems``: the rows to run, in order (``--systems``, see ``parse_systems``;
    default ``SYSTEMS``, ``SHAPE_SYSTEMS`` with a ``model``); a call limit of ten minutes
    holds about four. ``model``: a name of ``stages.models.shapes.REAL_SHAPES`` (``--model``).
    ``job``: overrides for every row, TRL's included (``--set``).
    Where a spec repeats, its figure is the mean of its rows, and the ratios'
    ``over_trl_by_round`` gives each row's ratio to its round's TRL row."""
    import torch

    chosen = parse_systems(systems, model)
    shape = describe_shape(model, CONFIG)
    if not torch.cuda.is_available():
        return publish_result(out_dir, "gpu_e2e", {"status": "skipped", "error": "no CUDA GPU", "ratios": {},
                                                   "params": {"model": shape["name"], "job_overrides": list(job)}},
                              plot, result_label(chosen, model, job))
    from pipeline.config import load_config

    steps = WARMUP_STEPS + 2 if quick else load_config(CONFIG).run.steps
    rows = run_rows(chosen, steps, model, job)
    rates = rates_by_spec(rows)

    def per_gpu(spec: str) -> float | None:
        return _mean(rates.get(spec, []))

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    a, s, t, c = per_gpu("async"), per_gpu("sync"), per_gpu("trl"), per_gpu("colocate")
    in_process = {m: per_gpu(f"{m}_in_process") for m in ("async", "sync", "colocate")}
    sub = {m: per_gpu(f"{m}_subprocess") for m in ("async", "sync", "colocate")}
    ratios = {
        "device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
        "async_samples_per_s_per_gpu": a, "sync_samples_per_s_per_gpu": s, "trl_samples_per_s_per_gpu": t,
        "colocate_samples_per_s_per_gpu": c,
        "async_over_sync": ratio(a, s), "async_over_trl": ratio(a, t),
        "colocate_over_trl": ratio(c, t), "colocate_over_sync": ratio(c, s), "colocate_over_async": ratio(c, a),
        # The bound was measured for the config's own model, not for another shape.
        "async_over_one_gpu_bound": ratio(a, ONE_GPU_BOUND) if model is None else None,
        "trl_over_one_gpu_bound": ratio(t, ONE_GPU_BOUND) if model is None else None,
        **{f"{m}_in_process_samples_per_s_per_gpu": v for m, v in in_process.items() if v},
        **{f"{m}_in_process_over_subprocess": ratio(v, sub[m] or per_gpu(m)) for m, v in in_process.items() if v},
        **{f"{m}_subprocess_samples_per_s_per_gpu": v for m, v in sub.items() if v},
        "colocate_in_process_over_trl": ratio(in_process["colocate"], t),
        # Every row's spec: its mean, and row by row against its round's TRL row.
        "samples_per_s_per_gpu": {spec: per_gpu(spec) for spec in rates if not spec.startswith("engines")},
        "over_trl": {spec: ratio(per_gpu(spec), t) for spec in rates if spec != "trl" and not spec.startswith("engines")},
        "over_trl_by_round": over_trl_by_round(rows),
        "async_rollout_busy": (rows.get("async", {}).get("busy_ratio") or {}).get("rollout"),
        "async_weight_sync_share": rows.get("async", {}).get("weight_sync_share"),
        "colocate_gpu_free_gib_while_training": rows.get("colocate", {}).get("gpu_free_gib_while_training"),
        # Rollout and trainer tokens/s per second of the steady window over the engine alone.
        "engine_fraction": compute_engine_fractions(rows),
        "targets": {"async_over_sync": 1.8, "async_rollout_busy": 0.7, "async_over_trl": 1.5,
                    "colocate_over_trl": 1.5},
    }
    # A failing Conveyor row fails the bench; TRL's (a third party's, on this machine) does not.
    status = "ok" if all(r.get("status") == "ok" for r in rows.values() if r["spec"] != "trl") else "error"
    payload = {"status": status, "quick": quick, "units": "samples = completions; seconds",
               "params": {"config": str(CONFIG), "model": shape["name"], "shape": shape, "steps": steps,
                          "warmup_steps": WARMUP_STEPS, "systems": list(chosen),
                          "job_overrides": list(job), "one_gpu_bound_samples_per_s": ONE_GPU_BOUND},
               "runs": rows, "ratios": ratios}
    return publish_result(out_dir, "gpu_e2e", payload, plot, result_label(chosen, model, job))


def plot(payload: dict[str, Any]) -> Any:
    fig, axes = new_figure(1, 2, size=(12, 4.5))
    runs = payload.get("runs", {})
    ax = axes[0][0]
    names = [r.get("label", r["system"]) for r in runs.values()]
    ax.bar(names, [r.get("samples_per_s_per_gpu") or 0.0 for r in runs.values()])
    model = payload.get("params", {}).get("model", "tiny")
    if model == "tiny":
        ax.axhline(ONE_GPU_BOUND, linestyle="--", color="grey", linewidth=0.8, label="one-GPU bound")
        ax.legend(fontsize=8)
    ax.set_ylabel("samples / s / GPU (steady state)")
    ax.set_title(f"gpu_e2e ({model}) on {payload.get('ratios', {}).get('device', '?')}")
    ax = axes[0][1]
    for row in runs.values():
        if row.get("status") == "ok" and row.get("curve"):
            pts = [(t, r) for t, r in row["curve"] if r is not None]
            if pts:
                ts, rs = zip(*pts, strict=True)
                ax.plot(ts, rs, label=row["system"], linewidth=1)
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("mean reward per step")
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":  # the isolated rows' children (``_run_child``)
    args = sys.argv[1:]
    if len(args) >= 4 and args[0] == "trl-row":  # trl-row STEPS ROOT OUT_JSON [OVERRIDE...]
        Path(args[3]).write_text(json.dumps(run_trl(int(args[1]), Path(args[2]), tuple(args[4:]))))
    elif len(args) >= 3 and args[0] in ("engines-rollout", "engines-trainer"):  # KIND ROOT OUT_JSON [OVERRIDE...]
        from bench.engine_alone import measure_engine

        Path(args[2]).write_text(json.dumps(measure_engine(args[0].removeprefix("engines-"), CONFIG, args[3:])))
    else:
        sys.exit("usage: python -m bench.gpu_e2e trl-row STEPS ROOT OUT_JSON [OVERRIDE...] | "
                 "engines-rollout|engines-trainer ROOT OUT_JSON [OVERRIDE...]")
