"""Long-tail generation lengths: streaming vs lock-step vs colocate vs TRL on one workload.

Every row trains the same model on the same prompts, each prompt with its own completion
length from ``bench.longtail_lengths.LengthSchedule`` (median ~1k tokens, p99 8k, cap 16k,
times ``--scale``), held exactly in generation (per-row ``min_tokens`` = ``max_tokens``);
same group size, sampling, learning rate, loss and steps. Rows (``--systems``, in order):

- ``streaming``: ``configs/longtail.yaml`` as it is (asynchronous, default placement);
- ``lockstep``: ``dataflow.async_execution=false``, ``dataflow.max_staleness=0``;
- ``colocate``: lock-step and ``placement=colocate`` (a GPU only; skipped on a CPU);
- ``trl``: TRL's ``GRPOTrainer``, vLLM colocated, each prompt's length put on its own
  request (``bench.longtail_trl``); skipped, with the reason, without TRL or a GPU;
- ``verl``: verl's GRPO trainer (``bench.peers.verl_grpo``, its ``sync`` mode), each
  prompt's length on its own requests; skipped, with the reason, without verl or a GPU;
- ``engines``: vLLM and the trainer engine alone on the same prompts and lengths
  (``bench.engine_alone.run_schedule_engines``), what each row's stages are compared with.

A Conveyor row may carry overrides (``streaming[rollout.max_inflight=128]``). ``--reward``
runs the quickstart's task (the embedded tiny model learns it by RL alone) with long-tail
lengths instead and adds each row's wall time to reach a reward. Columns, the tail-wait
definition and how to run it: docs/performance/longtail.md.

Guarantees: the prompt file (and so every row's lengths) is written once per run; a
failing Conveyor row fails the bench, a skipped or failing TRL row does not; the result
JSON and PNG go through ``publish_result`` (commit, command line, machine).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    check_row_streamed,
    describe_startup_parts,
    new_figure,
    note_config,
    publish_result,
    stage_log_timings,
)
from bench.e2e import REWARD_THRESHOLDS, _attempt, _version, summarize_curve
from bench.gpu_e2e import (
    _mean,
    compute_stage_rates,
    compute_steady_rate,
    compute_wall_rates,
    summarize_trainer_timing,
)
from bench.longtail_lengths import MAX_FIELD, MIN_FIELD, LengthSchedule, write_prompt_file
from stages.rollout.occupancy import TAIL_THRESHOLD, compute_tail_wait

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "longtail.yaml"
REWARD_CONFIG = ROOT / "configs" / "quickstart.yaml"
SYSTEMS = ("streaming", "lockstep", "colocate", "trl", "verl", "engines")
PEERS = ("trl", "verl")
LOCKSTEP = ("dataflow.async_execution=false", "dataflow.max_staleness=0")
MODES: dict[str, tuple[str, ...]] = {"streaming": (), "lockstep": LOCKSTEP, "colocate": (*LOCKSTEP, "placement=colocate")}
# The quickstart job made to stream like configs/longtail.yaml: a prompt per micro-batch, many in flight.
REWARD_STREAMING = ("dataflow.prompts_per_micro_batch=1", "rollout.max_inflight=64", "dataflow.queue_size=64",
                    "dataflow.max_staleness=2", "data.shuffle=false")
REWARD_TARGET = 0.5  # the reward threshold of the time-to-reward ratio (one of REWARD_THRESHOLDS)
DEFAULT_MODEL = "qwen3_0.6b"
_ROW = re.compile(r"(?P<name>[a-z]+)(?:\[(?P<overrides>[^\[\]]*)\])?")


@dataclass
class Job:
    """What every row shares: the config, the overrides that put the prompt file (with its
    lengths) and the model in it, the steps and the schedule."""

    config: Path
    steps: int
    schedule: LengthSchedule
    model: str
    prompts: int
    prompts_path: Path
    overrides: tuple[str, ...] = ()
    reward: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    colocate_kv_gib: float | None = None  # the colocate row's KV cache (plan_colocate_kv_gib)


def parse_systems(text: str | None) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``--systems a,b[k=v;..]`` -> ((name, overrides), ...); ``ValueError`` naming a bad
    row (an unknown name, an override without ``key=``, overrides on a peer)."""
    if text is None:
        return tuple((s, ()) for s in SYSTEMS)
    rows = []
    for spec in (m.strip() for m in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text) if m.strip()):
        found = _ROW.fullmatch(spec)
        if found is None or found["name"] not in SYSTEMS:
            raise ValueError(f"--systems: expected names from {list(SYSTEMS)}, each with optional "
                             f"[key=value;...] overrides, got {spec!r}")
        overrides = tuple(o.strip() for o in (found["overrides"] or "").split(";") if o.strip())
        bad = [o for o in overrides if not re.fullmatch(r"[A-Za-z_][\w.]*=.*", o)]
        if bad or (overrides and found["name"] in PEERS):
            raise ValueError(f"--systems: {spec!r}: a Conveyor row's overrides are key=value, the peers' "
                             f"rows ({', '.join(PEERS)}) take none")
        rows.append((found["name"], overrides))
    if not rows:
        raise ValueError(f"--systems: expected names from {list(SYSTEMS)}, got {text!r}")
    return tuple(rows)


def check_rows(specs: tuple[tuple[str, tuple[str, ...]], ...], reward: bool = False) -> None:
    """Load the job as each Conveyor row runs it, so a bad override stops the bench before
    any row starts (``ConfigError``, a ``ValueError``, naming the row)."""
    from pipeline.config import ConfigError, load_config

    for name, extra in dict.fromkeys(specs):
        if extra:
            try:
                load_config(REWARD_CONFIG if reward else CONFIG,
                            [*(REWARD_STREAMING if reward else ()), *MODES.get(name, ()), *extra])
            except ConfigError as exc:
                raise ConfigError(f"--systems: row {name}[{';'.join(extra)}]: {exc}") from None


def build_rows(cfg: Any, count: int, chat: bool) -> list[dict[str, Any]]:
    """The config task's first ``count`` distinct prompts (a repeated prompt is skipped,
    so a prompt's text names its length for TRL's requests); ``chat``: as one user message."""
    from stages.data.tasks import load_task

    rows, seen = [], set()
    for row in load_task(cfg.data.task, **cfg.data.task_kwargs).iter_rows(cfg.run.seed):
        if row["prompt"] in seen:
            continue
        seen.add(row["prompt"])
        rows.append({**row, "prompt": [{"role": "user", "content": row["prompt"]}]} if chat else row)
        if len(rows) == count:
            return rows
    return rows


def prepare_job(model: str, steps: int, schedule: LengthSchedule, root: Path, reward: bool = False,
                on_gpu: bool = True) -> Job:
    """Write the prompt file (``steps`` steps of prompts, each with its length) and build
    the model (``tiny``: the config's embedded one; else a shape of
    ``stages.models.shapes``, built locally unless cached)."""
    from pipeline.config import load_config

    config = REWARD_CONFIG if reward else CONFIG
    cfg = load_config(config)
    count = steps * cfg.train.prompts_per_step
    path = write_prompt_file(build_rows(cfg, count, chat=model != "tiny"), schedule, root / "prompts.jsonl")
    _, cap = schedule.bounds
    overrides = [f"data.path={path}", f"data.max_tokens_field={MAX_FIELD}", f"data.min_tokens_field={MIN_FIELD}",
                 "data.shuffle=false", f"rollout.max_tokens={cap}", *(REWARD_STREAMING if reward else ())]
    if model == "tiny":
        need = cfg.data.max_prompt_len + cap
        if need > cfg.model.tiny.max_position_embeddings:
            overrides.append(f"model.tiny.max_position_embeddings={need}")
    else:
        from stages.models.shapes import build_in_subprocess

        overrides.append(f"model.path={build_in_subprocess(model)}")
    if not on_gpu:
        overrides.append("model.dtype=float32")  # bf16 matmuls on a CPU are slow or missing
    job = Job(config, steps, schedule, model, count, path, tuple(overrides), reward)
    job.colocate_kv_gib = plan_colocate_kv_gib(job) if on_gpu else None
    return job


def plan_colocate_kv_gib(job: Job) -> float:
    """The colocate row's ``rollout.kv_cache_gib``: its step with the most tokens (each
    sample at ``data.max_prompt_len`` + its length), x ``KV_HEADROOM``. Without it the
    plan sizes the cache for every sample at the cap (``size_job_kv_cache``), which a
    long tail makes several times what a step holds, more than a GPU has."""
    import json

    from pipeline.config import load_config
    from pipeline.memory.admission import ModelShape, estimate_kv_cache_bytes
    from pipeline.placement import KV_HEADROOM
    from stages.models.tiny import resolve_model_path

    cfg = load_config(job.config, list(job.overrides))
    hf = json.loads((resolve_model_path(cfg.model) / "config.json").read_text())
    dtype = cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype
    shape = ModelShape.from_hf_config({**hf, "torch_dtype": dtype})
    lens, per = job.schedule.lengths(job.prompts), cfg.train.prompts_per_step
    tokens = max(sum(cfg.data.max_prompt_len + n for n in lens[k:k + per]) for k in range(0, len(lens), per))
    return round(estimate_kv_cache_bytes(shape, tokens * cfg.rollout.n) * KV_HEADROOM / (1 << 30) + 0.01, 2)


def run_conveyor_row(name: str, job: Job, root: Path, extra: tuple[str, ...] = (),
                     warmup: int = 1) -> dict[str, Any]:
    """One Conveyor row: the job with ``name``'s mode and ``extra`` overrides."""
    from pipeline.config import load_config
    from pipeline.launch import launch_run
    from pipeline.metrics import read_metrics

    overrides = [f"run.dir={root / name}", f"run.steps={job.steps}", "run.progress=false", f"run.name=longtail-{name}",
                 "train.save_checkpoint=false", "train.resumable=false", "run.tensorboard=false", *job.overrides,
                 *MODES[name], *extra]
    cfg = load_config(job.config, overrides)
    note_config(cfg)
    per_step = cfg.train.prompts_per_step * cfg.rollout.n
    t0 = time.time()
    summary = launch_run(cfg)
    total = time.time() - t0
    rows = read_metrics(cfg.run_dir)
    times = [r["time"] for r in rows]
    steady = rows[warmup:]
    span = times[-1] - times[warmup - 1] if len(times) > warmup else 0.0
    tokens = sum(r.get("response_length/mean", 0.0) * per_step for r in steady)
    rollouts = [r for r in summary.get("rollout") or [] if r]
    tails = [compute_tail_wait(r["occupancy"]["seconds_at"]) for r in rollouts if r.get("occupancy")]
    if name == "streaming":
        check_row_streamed(name, summary)
    return {
        "system": f"conveyor-{name}", "overrides": overrides, "steps": summary["steps"], "mode": summary["mode"],
        "startup_s": times[0] - t0 if times else None, "startup": describe_startup_parts(summary),
        "startup_log": stage_log_timings(cfg.run_dir), "total_s": total, "warmup_steps": warmup,
        "mps": summary.get("mps"),  # the row's GPU stages ran through an MPS daemon (placement.mps)
        "samples_trained": summary["samples"]["trained"], "samples_dropped": summary["samples"]["dropped"],
        "samples_per_s": compute_steady_rate(times, per_step, warmup),
        "completion_tokens_per_s": tokens / span if span > 0 else None,
        "step_s": _mean([r.get("time/step_s") for r in steady]),
        **compute_stage_rates(steady, per_step),
        **compute_wall_rates(rows, per_step, warmup),
        "busy_share": {k: v["busy_ratio"] for k, v in summary["stages"].items()},
        "bound": summary.get("bound"),  # the run's own reading: its bound, why, the keys to try
        "bound_early": summary.get("bound_early"),  # the same over steps 3 to 6 (None in a shorter run)
        # The trainer stage's seconds by span kind (busy; inside it wait_memory: admission
        # waiting for GPU memory) and its step in parts: where a trainer-bound row's time goes.
        "trainer_seconds": summary["stages"].get("trainer", {}).get("seconds"),
        "trainer_timing_s": summarize_trainer_timing(steady),
        "padding_fraction": _mean([r.get("actor/padding_fraction") for r in steady]),
        # The trainer's allocator at the end: retries mean passes ran at the memory limit (slow).
        **{k.removeprefix("memory/"): rows[-1][k] for k in ("memory/trainer_alloc_retries", "memory/trainer_reserved_gib")
           if rows and k in rows[-1]},
        "weight_sync_share": _mean([r.get("perf/weight_sync_share") for r in steady]),
        "staleness_mean": _mean([r.get("staleness/mean") for r in steady]),
        "staleness_max": max((r.get("staleness/max", 0) for r in rows), default=None),
        # Trained beyond their η (dataflow.late_samples: train); dropped instead under "drop".
        "samples_late": sum(r.get("samples/late", 0) for r in rows),
        # vLLM's scheduler (in-process engine): preemptions beyond the weight updates' recomputes
        # mean the KV cache was short for what was in flight.
        "engine": [{k: r["engine"].get(k) for k in ("kv_usage_mean", "kv_usage_max", "preemptions",
                                                    "update_recomputes", "mean_requests")}
                   for r in rollouts if r.get("engine")],
        # The rollout's KV admission: micro-batches deferred or split for want of reserved KV
        # cache, and its seconds waiting (wait_memory, inside busy): whether admission, not
        # the engine, held generation back.
        "rollout_admission": [summarize_rollout_admission(r) for r in rollouts],
        "rollout_seconds": summary["stages"].get("rollout", {}).get("seconds"),
        "tail": tails[0] if len(tails) == 1 else {"replicas": tails},
        "tail_share": _mean([t.get("tail_share") for t in tails]),
        "lengths": rollouts[0].get("completion_lengths") if len(rollouts) == 1 else
        [r.get("completion_lengths") for r in rollouts],
        **summarize_curve([(row["time"] - t0, row.get("reward/mean")) for row in rows]),
    }


def summarize_rollout_admission(result: dict[str, Any]) -> dict[str, Any]:
    """One rollout replica's admission counters (``admission/<stage>/admitted``, ``deferred``,
    ``splits``), the KV cache its engine made (``kv_cache_gib``), its admission budget (a
    share of that cache) and reserved bytes at the end, in GiB, what a sample
    reserved (``kv_reserve``, ``rollout.kv_reserve`` resolved), and the most samples it
    admits at once at the cap (``kv_admission_seqs``) or the completion tokens it reserves
    a sample under ``observed`` (``kv_reserve_tokens``)."""
    out: dict[str, Any] = {k: result[k] for k in ("kv_reserve", "kv_cache_gib", "kv_admission_seqs",
                                                  "kv_reserve_tokens") if k in result}
    for key, value in result.items():
        kind, _, name = key.partition("/")
        field = name.rpartition("/")[2]
        if kind == "admission" and field in ("admitted", "deferred", "splits"):
            out[field] = value
        elif kind == "memory" and field in ("budget_bytes", "used_bytes"):
            out[field.replace("_bytes", "_gib")] = value / 2**30
    return out


def run_verl_row(job: Job, root: Path, warmup: int) -> dict[str, Any]:
    """verl's GRPO trainer on the job: the same prompts with their lengths, group size,
    learning rate, steps and sampling, and its passes as Conveyor's trainer makes them:
    packed to ``train.pass_tokens`` (verl's ``use_dynamic_bsz``; ``train.chunk_size``
    samples a pass when it is 0), checkpointed as ``train.gradient_checkpointing``
    (``bench.peers.verl_grpo``)."""
    import json

    from bench.peers.verl_grpo import VerlJob, run_verl
    from pipeline.config import load_config
    from stages.models.tiny import resolve_model_path

    cfg = load_config(job.config, list(job.overrides))
    rows = [json.loads(line) for line in Path(job.prompts_path).read_text().splitlines() if line.strip()]
    vjob = VerlJob(model_path=str(resolve_model_path(cfg.model)), task=cfg.data.task,
                   task_kwargs=dict(cfg.data.task_kwargs), steps=job.steps,
                   prompts_per_step=cfg.train.prompts_per_step, group_size=cfg.rollout.n, lr=cfg.train.lr,
                   max_prompt_tokens=cfg.data.max_prompt_len, max_completion_tokens=cfg.rollout.max_tokens,
                   micro_batch_samples=cfg.train.chunk_size, token_budget=cfg.train.pass_tokens or None,
                   gradient_checkpointing=cfg.train.gradient_checkpointing, temperature=cfg.rollout.temperature,
                   seed=cfg.run.seed, gpu_memory_utilization=0.45)
    root.mkdir(parents=True, exist_ok=True)
    return run_verl(vjob, rows, root, warmup)


def run_engines_row(job: Job, root: Path, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """vLLM and the trainer engine alone on the job's prompts and lengths (the streaming
    row's config with ``extra``), each in a process of its own."""
    from bench.engine_alone import run_schedule_engines

    return run_schedule_engines(job.config, (*job.overrides, *extra), job.prompts, root)


def _describe_engines(row: dict[str, Any]) -> str:
    return (f"vLLM alone {row['rollout_tokens_per_s_by_step']:.0f} completion tokens/s a step at a time, "
            f"{row['rollout_tokens_per_s_all_at_once']:.0f} all at once; trainer alone "
            f"{row['trainer_tokens_per_s_micro_batches']:.0f} tokens/s in the job's micro-batches, "
            f"{row['trainer_tokens_per_s_one_per_step']:.0f} a step as one")


# Overrides that change how one GPU is split between vLLM and the trainer, or what vLLM's
# own memory holds beside its cache: a row with one of them is measured with the cache its
# plan gives it, never with another row's (``pin_kv_cache``).
MEMORY_KEYS = ("rollout.kv_cache_gib", "rollout.gpu_memory_utilization", "rollout.max_model_len",
               "rollout.max_num_seqs", "rollout.num_workers", "rollout.tensor_parallel_size", "rollout.dtype",
               "train.pass_tokens", "train.chunk_size", "train.logit_chunk_tokens", "train.gradient_checkpointing",
               "train.offload_optimizer", "train.grad_accum_dtype", "placement.", "model.", "reference.", "critic.")


def pin_kv_cache(name: str, extra: tuple[str, ...], rows: dict[str, dict[str, Any]], pin: str | float,
                 on_gpu: bool) -> tuple[float, str] | None:
    """The KV cache (GiB, and whose it is) a Conveyor row is given with ``--kv-cache-gib``
    ``pin``: a number, that size; ``first`` (on a GPU), the cache the first finished
    Conveyor row of this result made (``rows``, earlier calls' included), so every row
    generates with one cache; ``off``, none. None for the colocate row (its cache is
    the job's largest step), a row whose overrides set one of ``MEMORY_KEYS`` (it
    measures another split of the GPU), and where there is nothing to pin to (the rows
    of a result made before the rollout reported its cache, ``kv_cache_gib``).

    Why: where the plan leaves vLLM's cache unsized (a long tail's cache at the cap
    would not fit), vLLM sizes it from its share by profiling the device's memory, and
    what the trainer allocates beside it meanwhile is counted as vLLM's: rows of one
    job have come out with different caches (docs/performance/longtail.md). A cache of
    a size the first row's vLLM made within the same share fits where that one did."""
    if name not in MODES or name == "colocate" or pin == "off":
        return None
    if any(e.split("=", 1)[0].startswith(MEMORY_KEYS) for e in extra):
        return None
    if isinstance(pin, float):
        return pin, "--kv-cache-gib"
    if not on_gpu:
        return None
    for label, row in rows.items():
        made = row.get("rollout_admission") or []
        if (row.get("spec") in MODES and row.get("spec") != "colocate" and row.get("status") == "ok"
                and len(made) == 1 and made[0].get("kv_cache_gib")):
            return math.floor(made[0]["kv_cache_gib"] * 100) / 100, label
    return None


def run_rows(job: Job, specs: tuple[tuple[str, tuple[str, ...]], ...], root: Path, on_gpu: bool,
             warmup: int, rows: dict[str, dict[str, Any]] | None = None,
             on_row: Callable[[dict[str, dict[str, Any]]], Any] | None = None,
             kv_cache_gib: str | float = "first") -> dict[str, dict[str, Any]]:
    """Each row in order (a repeat labelled ``name#2``), after ``rows`` (an earlier call's);
    a failure is a row with its error; ``on_row(rows)`` after each. ``kv_cache_gib``: the
    Conveyor rows' vLLM cache (``pin_kv_cache``)."""
    from bench.longtail_trl import run_trl_isolated
    from bench.peers.verl_grpo import verl_version

    rows = dict(rows or {})
    for i, (name, extra) in enumerate(specs):
        label = _next_label(name, rows)
        where = root / str(i)
        if name == "verl":
            why = None if verl_version() else "verl is not installed (docs/performance/peers.md)"
            why = why or (None if on_gpu else "verl's vLLM rollout and FSDP actor need a CUDA GPU")
            row = ({"system": "verl-grpo-sync", "status": "skipped", "error": why} if why else
                   _attempt("verl-grpo", run_verl_row, job, where, warmup, describe=_describe))
        elif name == "trl":
            why = None if _version("trl") else "trl is not installed (pip install -e '.[bench]')"
            why = why or (None if on_gpu else "TRL's vLLM colocate mode needs a CUDA GPU")
            row = ({"system": "trl-grpo-vllm-colocate", "status": "skipped", "error": why} if why else
                   _attempt("trl-grpo", run_trl_isolated, job, where, warmup, describe=_describe))
        elif name == "engines":
            row = _attempt("engines-alone", run_engines_row, job, where, extra, describe=_describe_engines)
        elif name == "colocate" and not on_gpu:
            row = {"system": "conveyor-colocate", "status": "skipped",
                   "error": "placement: colocate time-shares a GPU; this machine has none"}
        else:
            if name == "colocate" and job.colocate_kv_gib and not any(e.startswith("rollout.kv_cache_gib=")
                                                                        for e in extra):
                extra = (f"rollout.kv_cache_gib={job.colocate_kv_gib}", *extra)
            pinned = pin_kv_cache(name, extra, rows, kv_cache_gib, on_gpu)
            given = (f"rollout.kv_cache_gib={pinned[0]:g}",) if pinned else ()
            row = _attempt(f"conveyor-{name}", run_conveyor_row, name, job, where, (*extra, *given), warmup,
                           describe=_describe)
            if pinned:
                row["kv_cache_pinned"] = {"gib": pinned[0], "from": pinned[1]}
        row["label"], row["spec"] = label, name
        row["requested"] = f"{name}[{';'.join(extra)}]" if extra else name  # as --systems gave it
        rows[label] = row
        # Each row on the console as it ends: a bench stopped later keeps what it measured.
        print(f"longtail row {label}: {json.dumps(row, default=str)}", flush=True)
        if on_row is not None:
            on_row(rows)
    return rows


# What an earlier result must share with this call for its rows to join this one's.
SAME_JOB = ("config", "model", "steps", "warmup_steps", "reward_mode", "tail_threshold")


def load_earlier(path: Path, params: dict[str, Any], schedule: dict[str, Any], gpu: str | None,
                 check: bool = True) -> dict[str, Any]:
    """An earlier ``longtail`` result whose rows this call adds to (``--add-to``, ``--join``): the
    same job (``SAME_JOB``, the length schedule) on the same GPU model (unless not ``check``).
    ``ValueError`` naming the first field that differs and both values."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--add-to/--join: cannot read a result from {path}: {exc}") from None
    if doc.get("benchmark") != "longtail":
        raise ValueError(f"--add-to/--join: {path} is a {doc.get('benchmark')!r} result, expected 'longtail'")
    if not check:
        return doc
    mine = {**{k: params.get(k) for k in SAME_JOB}, "schedule": schedule, "gpu": gpu}
    theirs = {**{k: (doc.get("params") or {}).get(k) for k in SAME_JOB}, "schedule": doc.get("schedule"),
              "gpu": (doc.get("machine") or {}).get("gpu")}
    for key, value in mine.items():
        if theirs[key] != value:
            raise ValueError(f"--add-to/--join: {path} differs in {key}: {theirs[key]!r} there, {value!r} here; "
                             "its rows measure another job or machine")
    return doc


def _describe(row: dict[str, Any]) -> str:
    return (f"{row.get('samples_per_s') or 0:.2f} samples a second, tail share {row.get('tail_share')}, "
            f"lengths {row.get('lengths')}")


def _rate(row: dict[str, Any] | None) -> float | None:
    return row.get("samples_per_s") if row and row.get("status") == "ok" else None


def compute_ratios(rows: dict[str, dict[str, Any]], reward: bool) -> dict[str, Any]:
    """Streaming over lock-step and over the fastest peer, TRL or verl (samples a second; > 1 favours
    streaming); with ``reward``, streaming's time to ``REWARD_TARGET`` over lock-step's
    (< 1 favours streaming). A row that did not run gives None."""
    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    first = {}
    for row in rows.values():
        first.setdefault(row["spec"], row)
    s, lock = _rate(first.get("streaming")), _rate(first.get("lockstep"))
    peers = {spec: _rate(r) for spec, r in first.items() if spec in PEERS and _rate(r)}
    fastest = max(peers, key=lambda k: peers[k]) if peers else None
    out: dict[str, Any] = {
        "streaming_samples_per_s": s, "lockstep_samples_per_s": lock,
        "colocate_samples_per_s": _rate(first.get("colocate")), "trl_samples_per_s": _rate(first.get("trl")),
        "streaming_over_lockstep": ratio(s, lock), "fastest_peer": fastest,
        "streaming_over_fastest_peer": ratio(s, peers.get(fastest)) if fastest else None,
        "verl_samples_per_s": _rate(first.get("verl")),
        "streaming_over_trl": ratio(s, _rate(first.get("trl"))),
        "streaming_over_verl": ratio(s, _rate(first.get("verl"))),
        **{f"{spec}_tail_share": r.get("tail_share") for spec, r in first.items()
           if r.get("status") == "ok" and spec != "engines"},
        **compute_bounds(first),
        **compare_kv_budgets(first),
        "targets": {"streaming_over_lockstep": 2.5, "streaming_over_fastest_peer": 2.0},
    }
    if reward:
        key = str(REWARD_TARGET)
        times = {spec: (r.get("time_to_threshold_s") or {}).get(key) for spec, r in first.items()
                 if r.get("status") == "ok"}
        out.update({f"{spec}_time_to_reward_{key}_s": t for spec, t in times.items()})
        out["streaming_time_to_reward_over_lockstep"] = ratio(times.get("streaming"), times.get("lockstep"))
        out["targets"]["streaming_time_to_reward_over_lockstep"] = 0.5
    return out


KV_BUDGET_SPREAD = 0.9  # rows whose KV budgets differ more than this did not generate alike


def compare_kv_budgets(first: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each Conveyor row's rollout KV budget in GiB (``kv_budget_gib``, its replicas
    summed: a share of the cache vLLM made) and, where the smallest is under
    ``KV_BUDGET_SPREAD`` of the largest, ``kv_budget_warning``: vLLM sizes a cache the
    plan leaves unsized from the memory it finds free at start-up, while the trainer
    starts beside it, so rows of one job can get different caches, and a ratio between
    them then measures that too."""
    budgets = {spec: sum(a.get("budget_gib", 0.0) for a in row["rollout_admission"])
               for spec, row in first.items()
               if spec in MODES and row.get("status") == "ok" and row.get("rollout_admission")}
    budgets = {spec: gib for spec, gib in budgets.items() if gib > 0}
    if not budgets:
        return {}
    out: dict[str, Any] = {"kv_budget_gib": budgets}
    low, high = min(budgets, key=budgets.__getitem__), max(budgets, key=budgets.__getitem__)
    if budgets[low] < KV_BUDGET_SPREAD * budgets[high]:
        out["kv_budget_warning"] = (
            f"{low}'s rollout had a KV budget of {budgets[low]:.1f} GiB against {high}'s {budgets[high]:.1f} GiB: "
            "the rows did not generate with the same cache (a row that changes the GPU's split keeps its own; "
            "otherwise --kv-cache-gib, 'first' by default, gives every row one size)")
    return out


def compute_bounds(first: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What bounded each Conveyor row (``{spec}_bound``: its busiest stage and that stage's
    busy share) and, with an ``engines`` row, each row's rollout and trainer tokens per
    wall second as a share of that engine alone (``{spec}_rollout_of_alone``: of vLLM with
    every step's requests at once; ``{spec}_trainer_of_alone``: of the trainer in the job's
    micro-batches)."""
    out: dict[str, Any] = {}
    engines = first.get("engines")
    alone = engines if engines and engines.get("status") == "ok" else None
    if alone:
        out["engines_alone"] = {k: alone[k] for k in (
            "rollout_tokens_per_s_by_step", "rollout_tokens_per_s_all_at_once",
            "trainer_tokens_per_s_micro_batches", "trainer_tokens_per_s_one_per_step")}
    for spec, row in first.items():
        if spec not in MODES or row.get("status") != "ok":
            continue
        busy = row.get("busy_share") or {}
        if busy:
            stage = max(busy, key=busy.__getitem__)
            told = row.get("bound") or {}
            out[f"{spec}_bound"] = {"stage": stage, "busy_share": busy[stage],
                                    **{k: told[k] for k in ("why", "change") if k in told}}
        if alone:
            for part, key in (("rollout", "rollout_tokens_per_s_all_at_once"),
                              ("trainer", "trainer_tokens_per_s_micro_batches")):
                wall = row.get(f"{part}_tokens_per_wall_s")
                out[f"{spec}_{part}_of_alone"] = wall / alone[key] if wall and alone[key] else None
    return out


def run(quick: bool, out_dir: Path, systems: str | None = None, model: str | None = None, scale: float | None = None,
        steps: int | None = None, reward: bool = False, add_to: Path | None = None,
        kv_cache_gib: str | float = "first") -> dict[str, Any]:
    """``model``: a shape of ``stages.models.shapes`` or ``tiny`` (default ``qwen3_0.6b``;
    ``tiny`` with ``quick`` or ``reward``, or on a CPU); ``scale``: the lengths' factor (default 1 on a
    GPU, 1/64 on a CPU); ``steps``: per row (default the config's; 3 with ``quick``); ``add_to``: an
    earlier result of the same job on the same GPU model whose rows come first (``load_earlier``);
    ``kv_cache_gib``: the Conveyor rows' vLLM cache (``pin_kv_cache``: ``first``, ``off`` or GiB).
    The result is written after every row (``status: partial`` until the last), so a call
    stopped by its time limit keeps the rows it finished."""
    import torch

    from bench.common import describe_gpus, describe_source
    from pipeline.config import load_config

    on_gpu = torch.cuda.is_available()
    specs = parse_systems(systems)
    model = model or ("tiny" if quick or reward or not on_gpu else DEFAULT_MODEL)
    scale = scale or (1.0 if on_gpu else 1 / 64)
    config = REWARD_CONFIG if reward else CONFIG
    steps = steps or (3 if quick else load_config(config).run.steps)
    warmup = 1 if steps <= 4 else 2
    schedule = LengthSchedule(scale=scale, seed=load_config(config).run.seed)
    params = {"config": str(config.relative_to(ROOT)), "model": model, "steps": steps, "warmup_steps": warmup,
              "reward_mode": reward, "tail_threshold": TAIL_THRESHOLD, "reward_thresholds": list(REWARD_THRESHOLDS)}
    count = steps * load_config(config).train.prompts_per_step
    earlier = load_earlier(add_to, params, schedule.describe(count), describe_gpus()["gpu"]) if add_to else None
    prior = dict(earlier["runs"]) if earlier else {}
    parts = [*((earlier.get("parts") or [_part(earlier)]) if earlier else []),
             {"systems": [f"{n}[{';'.join(e)}]" if e else n for n, e in specs], "kv_cache_gib": kv_cache_gib,
              "commit": describe_source()["commit"],
              "utc": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())}]
    names = [r["spec"] for r in prior.values()] + [n for n, _ in specs]
    label = _result_label(model, reward, [] if systems is None else names, scale)
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-longtail-"))

    def publish(rows: dict[str, dict[str, Any]], done: bool) -> dict[str, Any]:
        pending = [] if done else [n for n, _ in specs][len(rows) - len(prior):]
        payload = _payload(rows, {**params, "overrides": list(job.overrides)}, job.schedule.describe(job.prompts),
                           parts, quick, pending)
        return publish_result(out_dir, "longtail", payload, plot, label)

    try:
        job = prepare_job(model, steps, schedule, root / "job", reward, on_gpu)
        rows = run_rows(job, specs, root, on_gpu, warmup, prior, on_row=lambda rows: publish(rows, done=False),
                        kv_cache_gib=kv_cache_gib)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return publish(rows, done=True)


def join(paths: list[Path], out_dir: Path) -> dict[str, Any]:
    """One result from the rows of several earlier ones (``--join``): the same job on the same
    GPU model (``load_earlier`` checks each against the first), rows in the order given (a
    repeated row labelled ``name#2``), each call named in ``parts``; the machine and, where the
    calls share one, the commit are theirs. For runs split over calls by a time limit."""
    first = load_earlier(paths[0], {}, {}, None, check=False)
    params, schedule = first.get("params") or {}, first.get("schedule") or {}
    docs = [first, *(load_earlier(p, params, schedule, (first.get("machine") or {}).get("gpu")) for p in paths[1:])]
    rows: dict[str, dict[str, Any]] = {}
    parts: list[dict[str, Any]] = []
    for path, doc in zip(paths, docs, strict=True):
        for row in doc["runs"].values():
            spec = row.get("spec") or row["label"].split("#")[0]
            label = _next_label(spec, rows)
            rows[label] = {**row, "label": label, "spec": spec}
        parts += [{**part, "result": Path(path).name} for part in doc.get("parts") or [_part(doc)]]
    payload = {**_payload(rows, params, schedule, parts, bool(first.get("quick")), []), "machine": first.get("machine")}
    commits = {part.get("commit") for part in parts}
    source = {"commit": commits.pop(), "dirty": None, "commit_from": "the joined results"} if len(commits) == 1 else None
    label = _result_label(str(params.get("model")), bool(params.get("reward_mode")), payload["params"]["systems"],
                          schedule.get("scale", 1))
    return publish_result(out_dir, "longtail", payload, plot, label, source=source)


def _next_label(name: str, rows: dict[str, Any]) -> str:
    """``name``, or ``name#k`` for its k-th row among ``rows``."""
    return name if name not in rows else f"{name}#{sum(k.split('#')[0] == name for k in rows) + 1}"


def _result_label(model: str, reward: bool, names: list[str], scale: float) -> str:
    return "-".join([model, *(["reward"] if reward else []), *names, f"x{scale:g}"])


def _payload(rows: dict[str, dict[str, Any]], params: dict[str, Any], schedule: dict[str, Any],
             parts: list[dict[str, Any]], quick: bool, pending: list[str]) -> dict[str, Any]:
    """The result of ``rows``: ``partial`` while rows are ``pending``, else ``error`` where a
    Conveyor row failed (a peer's failure is its row's alone)."""
    ok = all(r.get("status") in ("ok", "skipped") for r in rows.values() if r["spec"] not in PEERS)
    return {
        "status": "partial" if pending else ("ok" if ok else "error"), "quick": quick,
        "units": "samples = completions; tokens = completion tokens; seconds",
        "params": {**params, "systems": [r.get("requested", r["spec"]) for r in rows.values()]},
        "rows_pending": pending,
        "parts": parts, "schedule": schedule, "definitions": DEFINITIONS, "runs": rows,
        "ratios": compute_ratios(rows, bool(params.get("reward_mode"))),
    }


def _part(doc: dict[str, Any]) -> dict[str, Any]:
    """The call that made an earlier result's rows: its rows, commit and time."""
    provenance = doc.get("provenance") or {}
    return {"systems": (doc.get("params") or {}).get("systems"), "commit": provenance.get("commit"),
            "utc": provenance.get("utc")}


DEFINITIONS = {
    "samples_per_s": "completions trained per second from the end of the warm-up steps to the end of the last step",
    "completion_tokens_per_s": "completion tokens trained per second over the same window",
    "startup_s": "launch to the end of the first step (engines, compilation, the first step)",
    "startup": "a Conveyor row's start-up in parts (summary.json's startup) and its slowest set-up's phases",
    "vllm_compile_cache_entries_added": ("vLLM torch.compile cache entries the row created: 0 where its start-up "
                                         "found every compile cached (or compiled nothing)"),
    "busy_share": "per stage, the union of its busy spans over the run's window",
    "padding_fraction": "the trainer's padded share of its token slots (actor/padding_fraction), where reported",
    "trainer_seconds": "the trainer stage's seconds by span kind (busy, wait_input, wait_memory inside busy, ...)",
    "rollout_seconds": ("the rollout stage's seconds by span kind; its wait_memory is admission deferring micro-batches "
                        "for KV cache (summed over micro-batches generating at once, so it may exceed the wall)"),
    "rollout_admission": ("per rollout replica, admission's micro-batches admitted, deferred and split for want of "
                          "KV cache (each sample reserves its prompt + max_tokens), and its KV budget in GiB"),
    "trainer_timing_s": ("the trainer's mean step after the warm-up: train (passes), update (optimizer), "
                         "weight_publish, and other (the step less those); passes a step, pass_tokens (computed) and "
                         "pass_s a pass, pass_tokens_per_s while passes ran"),
    "tail_share": (f"of the time the rollout had a sample in flight, the share with fewer than {TAIL_THRESHOLD:g} x "
                   "the peak count in flight; in lock-step that is each step's time from its median sample's end "
                   "to its longest's"),
    "lengths": "the completion lengths generated (median, p90, p99, max), beside the schedule's",
    "rollout_tokens_per_wall_s": ("completion tokens trained per second of the steady window; trainer_tokens_per_wall_s: "
                                  "the trainer's prompt and completion tokens per second of it"),
    "engines": ("the engines row: vLLM alone on the job's requests a step at a time (by_step) and all at once "
                "(all_at_once); the trainer engine alone in the job's micro-batches and with each step as one "
                "micro-batch (one_per_step), with its passes and the GPU's kernel-busy share of a micro-batch"),
    "kv_budget": ("ratios' kv_budget_gib: each Conveyor row's rollout KV budget (a share of vLLM's cache); "
                  "kv_budget_warning where the rows' budgets differ by more than 10%"),
    "bound": ("ratios' {row}_bound: the row's busiest stage and its busy share; {row}_rollout_of_alone and "
              "{row}_trainer_of_alone: its tokens per wall second over the engine alone's"),
    "time_to_threshold_s": "launch to the first step where the 5-step mean reward reaches the threshold",
    "samples_late": ("samples trained staler than their step's bound η (dataflow.late_samples: train); "
                     "samples_dropped counts those dropped instead (drop)"),
}


def plot(payload: dict[str, Any]) -> Any:
    fig, axes = new_figure(1, 3, size=(15, 4.5))
    runs = [r for r in payload.get("runs", {}).values() if r.get("status") == "ok" and r.get("spec") != "engines"]
    ax = axes[0][0]
    ax.bar([r["label"] for r in runs], [r.get("samples_per_s") or 0.0 for r in runs])
    ax.set_ylabel("samples / s (after warm-up)")
    ax.set_title(f"longtail ({payload.get('params', {}).get('model')}, scale "
                 f"{payload.get('schedule', {}).get('scale', 1):g})")
    ax = axes[0][1]
    ax.bar([r["label"] for r in runs], [r.get("tail_share") or 0.0 for r in runs], color="tab:orange")
    ax.set_ylabel("share of generation time in the tail")
    ax.set_ylim(0, 1)
    ax = axes[0][2]
    for r in runs:
        pts = [(t, v) for t, v in r.get("curve") or [] if v is not None]
        if pts:
            ts, vs = zip(*pts, strict=True)
            ax.plot(ts, vs, label=r["label"], linewidth=1)
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("mean reward per step")
    ax.legend(fontsize=8)
    return fig
