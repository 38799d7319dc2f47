"""``conveyor launch``: build the RL DataFlow from a config and drive it to the end.

The built-in graph is a chain ``source -> rollout -> reward [-> reward_model]
[-> reference] [-> critic] -> trainer``; ``run.script`` takes the graph from a Python
file's ``build_dataflow(cfg)``, ``dataflow.nodes`` replaces it with a custom graph. The
run directory's contents: docs/architecture.md, "Launch".

Guarantees:
- stage classes are named by import path, so this module imports no model code;
- before Ray starts, ``pipeline/preflight.py`` checks every path and import and the data
  file whole: the first bad one is a ``ConfigError``, exit 2;
- a rollout, reward or reference actor that dies is restarted up to
  ``run.max_restarts`` times, its micro-batches delivered again; any other death stops
  the run with the resume command (``run.auto_resume``: at most
  ``AUTO_RESUME_ATTEMPTS`` resumes by itself);
- each step's metrics carry every stage's latest ``memory/``, ``admission/`` and
  ``oom/`` metrics, ``summary.json`` their final values under ``admission``;
- with ``eval`` the rollout node evaluates (``rollout_eval``; a custom graph without an
  evaluating rollout is refused, exit 2); each result is an ``eval/*`` row, ``summary.json``
  holds ``eval`` (first, last, best) and ``eval.png`` draws them (``pipeline/evaluation.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec
import yaml

from pipeline.bound import BoundWindow, diagnose_bound
from pipeline.checkpoint import CHECKPOINTS_DIR, find_latest_checkpoint, prepare_run_dir, reconcile_prompt_ids
from pipeline.config import ConfigError, ConveyorConfig, to_dict
from pipeline.dataflow import DataFlow
from pipeline.dtypes import DTYPE_BYTES
from pipeline.evaluation import EVAL_PICTURE, EvalLog, check_eval_node, plot_evals
from pipeline.gpu_split import choose_gpu_split, detect_free_gpu_bytes, to_colocate
from pipeline.log import configure_logging, get_logger
from pipeline.memory.admission import ModelShape
from pipeline.memory.guard import merge_guard_metrics
from pipeline.metrics import (
    SUMMARY_FILE,
    MetricsWriter,
    accumulate_totals,
    launch_totals,
    read_metrics,
    read_summary,
    write_summary,
)
from pipeline.mps import MPS_LOG_DIR, decide_mps, gpu_sharing
from pipeline.placement import (
    RESERVE_FRACTION,
    PlacementPlan,
    check_offload_host_memory,
    check_plan,
    check_resources,
    check_run_disk,
    colocated_startup_fraction,
    detect_gpus,
    detect_host_memory,
    detect_nodes,
    engines_per_gpu,
    order_setups,
    plan_max_num_seqs,
    plan_placement,
    size_job_kv_cache,
)
from pipeline.plugins import load_builtin, stage_class
from pipeline.preflight import PreflightReport, run_preflight
from pipeline.profiler import (
    GpuSampler,
    aggregate_spans,
    compute_overhead_metrics,
    compute_stage_metrics,
    format_summary_table,
    plot_timeline,
    write_chrome_trace,
)
from pipeline.runner import STOP_SIGNALS, Graph, RunInterrupted, RunResult, run_dataflow
from pipeline.stage import StageError
from pipeline.staleness import AutoStaleness

log = get_logger(stage="driver")
RESTARTABLE_STAGES = ("rollout", "reward", "reward_model", "reference")
MAX_SYNC_MARKERS = 10_000
AUTO_RESUME_ATTEMPTS = 3  # resumes of one launch after deaths it could not restart
NOTHING_TO_RESUME = "stopped before its first checkpoint: nothing to resume; launch the run again"
NOT_RESUMABLE = "train.resumable: false wrote no checkpoint: nothing to resume; launch the run again"


def build_dataflow(cfg: ConveyorConfig, plan: PlacementPlan | None = None) -> DataFlow:
    """The run's graph, validated (raises ``GraphError`` naming the node); with a
    ``plan``, nodes carry its GPU indices (``plan_run_placement``)."""
    if cfg.run.script:
        df = load_script_dataflow(cfg)
    else:
        df = DataFlow()
        df.default_queue_size = cfg.dataflow.queue_size
    df.debug = cfg.run.debug
    if cfg.dataflow.nodes:
        for spec in cfg.dataflow.nodes:
            place = getattr(cfg.placement, spec.name, None)
            df.add_node(spec.name, spec.node_class, spec.input_from,
                        num_cpus=place.num_cpus if place else 0.0,
                        resources=place.resources if place else None,
                        num_gpus=place.num_gpus if place else 0.0, **spec.kwargs)
    elif not cfg.run.script:  # the built-in chain (a script built its own nodes)
        chain = (["source", "rollout", "reward"] + (["reward_model"] if cfg.reward_model_enabled else [])
                 + (["reference"] if cfg.reference_enabled else [])
                 + (["critic"] if cfg.critic_enabled else []) + ["trainer"])
        if cfg.algorithm.offline:  # responses come with the data: nothing to generate or score
            chain = ["source", "reference", "trainer"]
        prev = None
        for name in chain:
            place = getattr(cfg.placement, name)
            extra: dict[str, Any] = {}
            if name == "rollout":
                extra = {"replicas": cfg.rollout.num_workers, "concurrency": cfg.rollout.max_inflight}
            if name in RESTARTABLE_STAGES and not (
                    # Regrouping, the stage that shapes the reward holds groups across micro-batches:
                    # a restart would lose them.
                    name == ("reward_model" if cfg.reward_model_enabled else "reward")
                    and getattr(cfg.algorithm, "drop_zero_variance_groups", False)) and not (
                    # Running normalisation: the statistics live in the actor.
                    name == "reward_model" and any(s.normalize == "running" for s in cfg.reward.sources.values())
            ) and not (
                    # Colocated, a restarted engine would take its GPU share while the trainer may hold it.
                    name == "rollout" and cfg.placement.mode == "colocate"):
                extra["max_restarts"] = cfg.run.max_restarts
            several_updates = cfg.train.ppo_epochs > 1 or cfg.train.ppo_mini_batches > 1
            cls = stage_class("ppo_trainer" if name == "trainer" and several_updates
                              else "pairs" if name == "source" and cfg.algorithm.offline
                              else "rollout_eval" if name == "rollout" and cfg.eval.enabled else name)
            df.add_node(name, cls, prev, num_cpus=place.num_cpus, num_gpus=place.num_gpus,
                        resources=place.resources, **extra)
            prev = name
    df.queue_sizes.update(cfg.dataflow.queue_sizes)
    df.validate()
    check_eval_node(cfg, df)
    if plan is not None:
        after, _ = order_setups(cfg, plan)
        for name, node in df.nodes.items():
            node.setup_after = after.get(name, ())
            placed = plan.stages.get(name)
            if placed is not None:
                node.num_gpus = placed.num_gpus
                node.gpu_bundles, node.gpu_shares = placed.gpus, placed.share
                if name == "trainer" and cfg.train.num_ranks > 1 and placed.gpus:
                    # The stage actor is rank 0 (bundle 0); it starts ranks 1.. in the others.
                    node.kwargs["rank_gpus"] = list(zip(placed.gpus[1:], placed.share[1:], strict=True))
    return df


def load_script_dataflow(cfg: ConveyorConfig) -> DataFlow:
    """The graph of ``run.script``: its ``build_dataflow(cfg)`` called with the resolved
    config. Classes the script defines travel to the actors by value (the workers cannot
    import the script by name); nodes left at 0 CPUs and GPUs take ``placement.<name>``."""
    import sys

    import ray.cloudpickle

    from pipeline.plugins import load_file_object

    try:
        build = load_file_object(cfg.run.script, "build_dataflow", "run.script", prefix="conveyor_flow")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    ray.cloudpickle.register_pickle_by_value(sys.modules[build.__module__])
    df = build(cfg)
    if not isinstance(df, DataFlow):
        raise ConfigError(f"run.script: build_dataflow in {cfg.run.script!r} returned {type(df).__name__}, "
                          f"expected a pipeline.dataflow.DataFlow")
    for name, node in df.nodes.items():
        place = getattr(cfg.placement, name, None)
        if place is not None and node.num_cpus == 0 and node.num_gpus == 0:
            node.num_cpus, node.num_gpus = place.num_cpus, place.num_gpus
    return df


def plan_run_placement(cfg: ConveyorConfig) -> tuple[ConveyorConfig, PlacementPlan]:
    """Detect the cluster's GPUs, plan and check the placement (``PlacementError``, a
    ``ConfigError``, for an impossible plan) and return the config with vLLM's memory
    share the plan chose (on one GPU, colocated where ``pipeline/gpu_split.py`` says so)."""
    import msgspec

    stages = build_dataflow(cfg).topological_order()
    check_resources(cfg, stages, detect_nodes(cfg.run.address))
    available, gpu_bytes = detect_gpus(cfg.run.address)
    shape = read_model_shape(cfg) if available else None
    split = choose_gpu_split(cfg, stages, available, shape, gpu_bytes,
                             detect_free_gpu_bytes(cfg.run.address) if available == 1 else 0)
    if split is not None and split.mode == "colocate":
        cfg = to_colocate(cfg)
    plan = plan_placement(cfg, stages, available, gpu_bytes=gpu_bytes, shape=shape)
    if split is not None:
        plan = dataclasses.replace(plan, split=split.mode, notes=[split.reason, *plan.notes])
    check_plan(cfg, plan)
    mps, note = decide_mps(cfg.placement.mps, plan, cfg.placement.mode == "colocate", cfg.run.address)
    plan = dataclasses.replace(plan, mps=mps, notes=[*plan.notes, *([note] if note else [])])
    if shape is not None and cfg.train.offload_optimizer:
        plan.notes.append(check_offload_host_memory(cfg, shape, "critic" in stages, detect_host_memory(cfg.run.address)))
    existing = len(list((cfg.run_dir / CHECKPOINTS_DIR).glob("step-*"))) if cfg.run.resume_from else 0
    recording = recording_root(cfg)
    other_disk = detect_disk(recording) != detect_disk(cfg.run_dir)
    disk = check_run_disk(cfg, shape if shape is not None else read_model_shape(cfg), detect_free_disk(cfg.run_dir),
                          existing, detect_free_disk(recording) if other_disk else None)
    if disk:
        plan.notes.append(disk)
    rollout = cfg.rollout
    if plan.rollout_memory_fraction != rollout.gpu_memory_utilization:
        rollout = msgspec.structs.replace(rollout, gpu_memory_utilization=plan.rollout_memory_fraction)
    engines = engines_per_gpu(plan)
    streamed = split is not None and split.mode == "streaming" and split.sized
    kv = size_job_kv_cache(cfg, shape, engines, streamed) if shape is not None else None
    if kv is not None:
        rollout = msgspec.structs.replace(rollout, kv_cache_gib=kv[0] / (1 << 30), max_model_len=kv[1])
        plan.notes.append(kv[2])
    if cfg.rollout.backend == "vllm" and rollout.max_num_seqs is None:
        rollout = msgspec.structs.replace(rollout, max_num_seqs=plan_max_num_seqs(cfg))
    share = rollout.gpu_memory_utilization
    where = ("colocate" if cfg.placement.mode == "colocate" else f"{engines} vLLM engines on one GPU" if engines > 1
             else "streaming on one GPU")
    if ((cfg.placement.mode == "colocate" or engines > 1 or streamed) and shape is not None and gpu_bytes
            and share is not None
            and rollout.kv_cache_gib is not None and cfg.rollout.gpu_memory_utilization is None):
        # The KV cache has a size (planned or the user's) and the share is the plan's.
        startup = colocated_startup_fraction(shape, int(rollout.kv_cache_gib * (1 << 30)), gpu_bytes)
        if startup < share:
            plan.notes.append(f"{where}: vLLM asks for {startup:g} of the GPU at start-up (weights, KV cache "
                              f"and {RESERVE_FRACTION:.0%} reserve), not its share {share:g}")
            rollout = msgspec.structs.replace(rollout, gpu_memory_utilization=startup)
            plan = dataclasses.replace(plan, rollout_memory_fraction=startup)
        elif startup > share:
            plan.notes.append(f"{where}: vLLM's weights, KV cache and {RESERVE_FRACTION:.0%} reserve need "
                              f"{startup:g} of the GPU, more than its share {share:g}: it may run "
                              f"out of memory; lower rollout.kv_cache_gib or rollout.max_inflight")
    run_cfg = msgspec.structs.replace(cfg, rollout=rollout)
    _, why = order_setups(run_cfg, plan)
    if why:
        plan.notes.append(why)
    return run_cfg, plan


def _nearest_existing(path: Path) -> Path:
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def detect_free_disk(path: Path) -> int:
    """Bytes free on the file system that will hold ``path`` (its nearest existing
    folder's; the driver's: a run's files are written by the stage that makes them, on
    its node)."""
    return shutil.disk_usage(_nearest_existing(path)).free


def detect_disk(path: Path) -> int:
    """The device of the file system that will hold ``path`` (``detect_free_disk``)."""
    return os.stat(_nearest_existing(path)).st_dev


def read_model_shape(cfg: ConveyorConfig) -> ModelShape:
    """``model.path``'s shape in the rollout's dtype (``rollout.dtype``, else
    ``model.dtype``; ``auto``: its ``config.json``'s), from its ``config.json`` (no
    weights are read)."""
    config = json.loads((load_builtin("resolve_model_path")(cfg.model) / "config.json").read_text())
    dtype = cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype
    return ModelShape.from_hf_config(config, dtype_bytes=DTYPE_BYTES.get(dtype))


def collect_stage_metrics(statuses: dict[str, dict[str, Any]], prefixes: tuple[str, ...]) -> dict[str, float]:
    """The numbers under ``prefixes`` (``critic/``) in the stages' latest ``status()``,
    for the step's metrics."""
    return {k: float(v) for status in statuses.values() for k, v in status.items()
            if k.startswith(prefixes) and _is_number(v)}


def count_engine_restarts(statuses: dict[str, dict[str, Any]]) -> dict[str, float]:
    """``rollout/engine_restarts``: the rollout workers' engine rebuilds so far, added up
    (statuses under ``rollout`` and ``rollout:<r>``); nothing without a rollout stage."""
    counts = [s["engine_restarts"] for name, s in statuses.items()
              if name.split(":")[0] == "rollout" and _is_number(s.get("engine_restarts"))]
    return {"rollout/engine_restarts": float(sum(counts))} if counts else {}


def recording_root(cfg: ConveyorConfig) -> Path:
    """Where the run's recording goes: ``record.dir``, else ``<run dir>/recording``. A
    resumed run records apart (recording-from-step-N): its batch ids and sequence
    numbers start again, and must not replace the first session's files."""
    default = f"recording-from-{Path(cfg.run.resume_from).name}" if cfg.run.resume_from else "recording"
    return Path(cfg.record.dir).expanduser() if cfg.record.dir else cfg.run_dir / default


def record_taps(cfg: ConveyorConfig, df: DataFlow) -> dict[str, str]:
    """Edge name -> recording dir (``<record.dir>/<consumer>``: one writer per directory)."""
    root = recording_root(cfg)
    for edge in cfg.record.edges:
        if edge not in df.edge_names:
            raise ConfigError(f"record.edges: {edge!r} is not an edge of the graph (edges: {df.edge_names})")
        consumer = edge.split("->")[1]
        if df.nodes[consumer].max_restarts > 0:
            # The consumer writes the tap. Restarted, its new writer would number the
            # edge's items from 0 again over the dead one's files and record the
            # redelivered items a second time: a recording replay cannot trust.
            raise ConfigError(
                f"record.edges: {edge!r} is recorded by {consumer!r}, which run.max_restarts="
                f"{cfg.run.max_restarts} restarts after a death, and a restarted stage cannot continue a "
                f"recording; record an edge into the trainer (e.g. reference->trainer) or set run.max_restarts=0"
            )
    return {edge: str(root / edge.split("->")[1]) for edge in cfg.record.edges}


class Reporter:
    """The driver's tick: per-step metrics, the progress bar and ``status.json``."""

    def __init__(self, cfg: ConveyorConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.writer = MetricsWriter(run_dir, tensorboard=cfg.run.tensorboard and "tensorboard" in cfg.run.trackers,
                                    trackers=cfg.run.trackers, run_name=cfg.run.name)
        self.writer.log_config(to_dict(cfg))
        # A long run's driver keeps no per-step history (every step is in metrics.jsonl):
        # a count, the first and the last step's metrics, and the latest weight syncs
        # (the trace's markers; the trace holds the latest spans only).
        self.step_count = 0
        self.first_step: dict[str, Any] | None = None
        self.startup: dict[str, Any] = {}  # where the time to the first step went
        self.mps = False  # the GPU stages run through an MPS daemon (set by the launch)
        self.last_step: dict[str, Any] | None = None
        self.syncs: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_SYNC_MARKERS)
        self.last_drain: dict[str, Any] = {}
        self._last_step_end: float | None = None  # the first window opens at the first span
        self._progress = _Progress(cfg.run.steps) if cfg.run.progress else None
        self._recent: list[Any] = []
        self._gpu = GpuSampler()
        self.started = time.time()
        self.launched = self.started  # the launch's start (pre-flight's), set by the launch
        self.previous_summary: dict[str, Any] | None = None  # the summary a resumed run's last launch left
        self.evals = EvalLog()  # continued from previous_summary by the launch of a resumed run
        self.processes: dict[str, list[Any]] = {}
        self.restarts: dict[str, int] = {}
        self._object_store = _ObjectStoreGauge()
        self.staleness = AutoStaleness(cfg.dataflow.max_staleness_cap) if cfg.auto_staleness else None
        # What bounds the run, read after its first steps (pipeline/bound.py).
        self.trainer_beside_rollout = False  # set by the launch from its plan
        self._bound_window = BoundWindow()
        self.bound_early: dict[str, Any] | None = None
        # Visible to ``conveyor status`` while actors are still starting.
        self._write_status({"trainer_version": 0, "served": {}, "status": {},
                            "ledger": {"in_flight": 0}}, {}, state="starting")

    async def __call__(self, graph: Graph) -> None:
        self.processes = {f"{n}:{r}": list(hp) for (n, r), hp in graph.processes.items()}
        self.restarts = dict(graph.restarts)
        drain = await graph.controller.drain()
        self.last_drain = drain
        self.syncs.extend(drain["syncs"])
        # Only spans that can still overlap a future step window are kept here (the graph
        # keeps a bounded history for the trace), so a tick costs O(new spans).
        spans = await graph.collect_telemetry()
        self._recent.extend(spans)
        self._bound_window.add_spans(spans)
        queues = await graph.queue_stats() if drain["steps"] else {}
        if self._last_step_end is None and self._recent:
            self._last_step_end = min(s.start for s in self._recent)
        for step in drain["steps"]:
            end = step.get("time", time.time())
            self._last_step_end = self._last_step_end or end
            agg = aggregate_spans(self._recent, (self._last_step_end, end))
            metrics = dict(step)
            metrics.update(compute_stage_metrics(agg))
            metrics.update(compute_overhead_metrics(agg))
            step_s = float(step.get("time/step_s") or 0.0)
            if step_s > 0:
                metrics["throughput/samples_per_s"] = self.cfg.train.prompts_per_step * self.cfg.rollout.n / step_s
            gpu = self._gpu.sample()
            if gpu is not None:
                metrics["perf/gpu_util"] = gpu
            for name, q in queues.items():
                metrics[f"queue/{name}/depth"] = q["depth"]
                metrics[f"queue/{name}/mean_depth"] = q["mean_depth"]
            metrics["samples/in_flight"] = drain["ledger"]["in_flight"] * self.cfg.rollout.n
            metrics.update(merge_guard_metrics(graph.stage_status))
            metrics.update(collect_stage_metrics(graph.stage_status, ("critic/", "ref/")))
            metrics.update(count_engine_restarts(graph.stage_status))
            if self.staleness is not None:
                await self.staleness.after_step(graph.controller, int(step["step"]),
                                                self.staleness.measure(step, self._recent, (self._last_step_end, end)),
                                                int(drain["max_staleness"]["current"]))
            rollouts = [st for name, st in graph.stage_status.items() if name.split(":")[0] == "rollout"]
            if self._bound_window.step_ended(self.step_count + 1, end, rollouts):
                self._read_bound_early(metrics)
            self._last_step_end = end
            self._recent = [sp for sp in self._recent if sp.end > end]
            # The row's time is the step's end (the trainer's clock), not this tick's.
            self.writer.log(int(step["step"]), {k: v for k, v in metrics.items()
                                                if _is_number(v) and k not in ("step", "time")}, at=end)
            self.step_count += 1
            if self.first_step is None:
                self.startup = describe_startup(graph.startup, self.started - self.launched, end - self.launched)
                log.info("startup", **{k: v for k, v in self.startup.items() if k != "stages"},
                         slowest=slowest_setup(self.startup))
            self.first_step = self.first_step or metrics
            self.last_step = metrics
            if self._progress:
                self._progress.update(metrics)
        for result in drain.get("eval_results", []):
            self.writer.log_eval(result.version, result.metrics, at=result.time)
            self.evals.add(result)
        self._write_status({**drain, "status": graph.stage_status}, queues)

    def _read_bound_early(self, metrics: dict[str, Any]) -> None:
        """The bound over the first steps after the warm-up (``BoundWindow``), logged once."""
        window = self._bound_window
        bound = diagnose_bound(window.stages(), window.rollouts(), self.cfg, self.trainer_beside_rollout,
                               metrics.get("memory/trainer_alloc_retries", 0.0))
        self.bound_early = {"steps": [window.first, window.last], **bound.to_dict()}
        log.info(f"{bound.describe()} (steps {window.first} to {window.last})")

    def _write_status(self, drain: dict[str, Any], queues: dict[str, Any], state: str = "running") -> None:
        self._last_status = (drain, queues)
        status = {
            "state": state,
            "pid": os.getpid(),
            "time": time.time(),
            "elapsed_s": time.time() - self.started,
            "run": self.cfg.run.name,
            "steps_target": self.cfg.run.steps,
            "trainer_version": drain["trainer_version"],
            "served": drain["served"],
            "ledger": drain["ledger"],
            "stages": drain["status"],
            "queues": queues,
            "last_step": self.last_step,
            "last_eval": self.evals.last,
            # Where each stage runs now (a restarted one moves): for benches and operators.
            "processes": self.processes,
            "restarts": self.restarts,
            "object_store_used_bytes": self._object_store.read(),
            "max_staleness": self.describe_staleness(drain),
            "bound": self.bound_early,
        }
        tmp = self.run_dir / "status.json.tmp"
        tmp.write_text(json.dumps(status, default=str))
        tmp.replace(self.run_dir / "status.json")

    def describe_staleness(self, drain: dict[str, Any]) -> dict[str, Any] | None:
        """η now and, with ``auto``, the first verdict and every raise with its reason,
        and the latest verdict (status and summary)."""
        board = drain.get("max_staleness")
        if board is None:
            return None
        auto = self.staleness
        return {**board, "decisions": list(auto.log) if auto else [], "latest": auto.latest if auto else None}

    def close(self, state: str = "completed") -> None:
        """Flush the metrics and leave ``status.json`` saying how the run ended
        (``completed``, ``interrupted`` or ``failed``), not ``running``."""
        self.writer.close()
        if self._progress:
            self._progress.close()
        self._write_status(*self._last_status, state=state)


class _ObjectStoreGauge:
    """Bytes in Ray's object store (all nodes), asked of a raylet at most every
    ``EVERY_S`` seconds (a gRPC call, ~70 ms); None when Ray cannot say."""

    EVERY_S = 10.0

    def __init__(self) -> None:
        self._state: Any = None
        self._at = 0.0
        self._value: int | None = None

    def read(self) -> int | None:
        import ray

        if time.time() - self._at < self.EVERY_S or not ray.is_initialized():
            return self._value
        self._at = time.time()
        try:
            from ray._private.internal_api import get_memory_info_reply, get_state_from_address

            if self._state is None:
                self._state = get_state_from_address(ray.get_runtime_context().gcs_address)
            reply = get_memory_info_reply(self._state, timeout_seconds=5.0)
            self._value = int(reply.store_stats.object_store_bytes_used)
        except Exception:  # a private API: its absence costs this figure, never the run
            self._value = None
        return self._value


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class _Progress:
    """A one-line console progress bar: step, reward, staleness."""

    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"), transient=False,
        )
        self.task = self.bar.add_task("train", total=total, info="")
        self.bar.start()

    def update(self, m: dict[str, Any]) -> None:
        info = (f"reward {m.get('reward/mean', float('nan')):.3f}  staleness {m.get('staleness/mean', 0):.2f}"
                f"  {m.get('throughput/tokens_per_s', 0):.0f} tok/s")
        self.bar.update(self.task, completed=int(m["step"]) + 1, info=info)

    def close(self) -> None:
        self.bar.stop()


def launch_run(cfg: ConveyorConfig) -> dict[str, Any]:
    """Run the configured job; returns the summary (also written to ``summary.json``).
    With ``run.auto_resume`` a stage death the runner could not restart (the trainer's)
    resumes the run from its newest checkpoint, at most ``AUTO_RESUME_ATTEMPTS`` times."""
    configure_logging(cfg.run.log_level)
    STOP_SIGNALS.install()  # from here on a stop leaves a summary (see pipeline/runner.py)
    try:
        return _launch_with_resumes(cfg)
    finally:
        STOP_SIGNALS.uninstall()


def _launch_with_resumes(cfg: ConveyorConfig) -> dict[str, Any]:
    resumes: list[dict[str, Any]] = []
    while True:
        try:
            summary = _launch_once(cfg, resumes)
        except StageError as exc:
            found = find_latest_checkpoint(cfg.run_dir) if exc.died else None
            if not (cfg.run.auto_resume and found is not None and len(resumes) < AUTO_RESUME_ATTEMPTS):
                raise
            for message in found[2]:  # damaged checkpoints passed over for an older one
                log.warning("checkpoint_skipped", detail=message)
            resumes.append({"stage": exc.stage, "error": exc.message, "from": str(found[0]),
                            "restarts": getattr(exc, "restarts", {})})
            log.warning("auto_resume", stage=exc.stage, attempt=len(resumes), max_attempts=AUTO_RESUME_ATTEMPTS,
                        checkpoint=str(found[0]))
            cfg = msgspec.structs.replace(cfg, run=msgspec.structs.replace(cfg.run, resume_from=str(found[0])))
            continue
        return summary


def _launch_once(cfg: ConveyorConfig, resumes: list[dict[str, Any]]) -> dict[str, Any]:
    launched = time.time()
    try:
        cfg, checks = run_preflight(cfg)  # a bad path, import or data file: ConfigError, before Ray
        print(checks.describe(), flush=True)
        STOP_SIGNALS.check()
        run_cfg, plan = plan_run_placement(cfg)
        STOP_SIGNALS.check()
    except RunInterrupted as exc:
        return write_early_stop_summary(cfg, exc.signal_name, launched)
    df = build_dataflow(run_cfg, plan)
    run_dir = cfg.run_dir
    prepare_run_dir(run_dir, cfg.run.resume_from, cfg.run.overwrite)  # refuses to clobber a run
    # Before the run writes anything: an MPS daemon that will not start under
    # placement.mps: true stops the launch (exit 2) with no run in its directory (only
    # logs/mps/, the daemon's log).
    with gpu_sharing(plan.mps, cfg.placement.mps is True, run_dir / MPS_LOG_DIR) as gpu_env:
        df.set_gpu_env(gpu_env)
        run_dir.mkdir(parents=True, exist_ok=True)
        # The config as asked, not as planned: a resumed run plans its placement again (the
        # cluster may differ) and must not take a planned value for the user's own.
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        # And as it runs: Hub names resolved to paths, the plan's vLLM share and KV cache.
        (run_dir / "resolved_config.yaml").write_text(yaml.safe_dump(to_dict(run_cfg), sort_keys=False))
        cfg = run_cfg
        taps = record_taps(cfg, df)
        reporter = Reporter(cfg, run_dir)
        reporter.launched = launched
        reporter.trainer_beside_rollout = plan.share_a_gpu("rollout", "trainer") and cfg.placement.mode != "colocate"
        reporter.mps = bool(gpu_env)
        # Read before this launch writes its own: the run's totals so far (a resume continues them).
        reporter.previous_summary = read_summary(run_dir) if cfg.run.resume_from else None
        reporter.evals = EvalLog(reporter.previous_summary)
        try:
            return _drive(cfg, df, plan, run_dir, taps, reporter, checks, resumes)
        finally:
            reporter.writer.finish()  # trackers closed on every exit (a no-op after a summary)


def _drive(cfg: ConveyorConfig, df: DataFlow, plan: PlacementPlan, run_dir: Path, taps: dict[str, str],
           reporter: Reporter, checks: PreflightReport, resumes: list[dict[str, Any]]) -> dict[str, Any]:
    log.info("launch", run_dir=str(run_dir), mode="async" if cfg.dataflow.async_execution else "sync",
             max_staleness=cfg.describe_staleness, stages=df.topological_order(),
             placement=plan.describe() if plan.available_gpus else "cpu", split=plan.split)
    ended = "failed"
    try:
        result = run_dataflow(
            df, cfg,
            target_prompts=cfg.run.steps * cfg.train.prompts_per_step,
            prompts_per_step=cfg.train.prompts_per_step,
            taps=taps,
            on_tick=reporter,
        )
        ended = "interrupted" if result.interrupted else "completed"
    except RunInterrupted as exc:
        ended = "interrupted"
        return write_stopped_summary(cfg, run_dir, reporter, "interrupted", signal=exc.signal_name, forced=True,
                                     **checks.to_summary())
    except StageError as exc:
        exc.restarts = dict(reporter.restarts)  # the restarts of this attempt, for an auto-resume's record
        failure = write_failure_traceback(run_dir, exc)
        write_stopped_summary(cfg, run_dir, reporter, "failed", stage=exc.stage, error=exc.message,
                              **({"where": exc.where} if exc.where else {}),
                              **({"traceback": str(failure)} if failure else {}),
                              **({"auto_resumes": resumes} if resumes else {}), **checks.to_summary())
        raise
    finally:
        reporter.close(ended)
    return finish_run(cfg, run_dir, result, reporter, checks, resumes)


def describe_startup(runner: dict[str, Any], preflight_s: float, first_step_s: float) -> dict[str, Any]:
    """Where the time from launch to the end of the first step went, in seconds:
    pre-flight and planning, Ray, Ray starting the stage processes, their set-ups
    (concurrent; each replica's own timings under ``stages``) and the first step after
    them (generation, scoring and training of step 1)."""
    parts = {"preflight_s": round(preflight_s, 2), "ray_s": runner.get("ray_s", 0.0),
             "actors_s": runner.get("actors_s", 0.0), "setup_s": runner.get("setup_s", 0.0)}
    return {"first_step_s": round(first_step_s, 2), **parts,
            "first_step_after_setup_s": round(first_step_s - sum(parts.values()), 2),
            "stages": runner.get("stages", {})}


def slowest_setup(startup: dict[str, Any]) -> str | None:
    """``rollout:0 61.2 s (engine 48.0, warm_up 9.1)``: the set-up the run waited for."""
    stages = startup.get("stages") or {}
    if not stages:
        return None
    name, t = max(stages.items(), key=lambda kv: kv[1].get("setup_s", 0.0))
    phases = ", ".join(f"{k.removesuffix('_s')} {v:g}" for k, v in t.items()
                       if k not in ("setup_s", "process_age_s", "constructed_s"))
    return f"{name} {t.get('setup_s', 0.0):g} s" + (f" ({phases})" if phases else "")


def write_failure_traceback(run_dir: Path, exc: StageError) -> Path | None:
    """The failed stage's whole traceback in ``run_dir/logs/<stage>-failure.txt`` (also
    named by the summary and the console), so that what the driver saw of the failure
    outlives it; None where the stage's process died without one."""
    if not exc.remote_traceback:
        return None
    path = run_dir / "logs" / f"{exc.stage}-failure.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{exc}\n\n{exc.remote_traceback}")
    exc.traceback_path = path
    return path


def write_stopped_summary(cfg: ConveyorConfig, run_dir: Path, reporter: Reporter, status: str,
                          **detail: Any) -> dict[str, Any]:
    """``summary.json`` of a run that did not drain: what the driver saw until then."""
    found = find_latest_checkpoint(run_dir)
    summary = {"run": cfg.run.name, "status": status, **detail, "steps": reporter.step_count,
               # Only where there is something to resume from.
               "resume": f"conveyor launch --resume {run_dir}" if found is not None else None,
               **({} if found is not None else {"resume_why": NOTHING_TO_RESUME}),
               "checkpoint": str(found[0]) if found is not None else None,  # the last good one
               "wall_s": time.time() - reporter.started,
               "startup": reporter.startup,
               "reward_last": reporter.last_step.get("reward/mean") if reporter.last_step else None,
               "samples_trained": int((reporter.last_step or {}).get("samples/trained", 0)),
               **({"eval": reporter.evals.summary()} if cfg.eval.enabled else {})}
    write_summary(run_dir, add_run_totals(summary, reporter))
    reporter.writer.finish(summary, [run_dir / SUMMARY_FILE])
    log.warning("run_stopped", **{k: v for k, v in summary.items() if k != "run"})
    return summary


def add_run_totals(summary: dict[str, Any], reporter: Reporter) -> dict[str, Any]:
    """``summary`` with this launch's wall time (``launch_wall_s``: from the launch's
    start, pre-flight included) and the run's ``totals`` across its launches
    (``pipeline.metrics.accumulate_totals``)."""
    summary["launch_wall_s"] = time.time() - reporter.launched
    summary["totals"] = accumulate_totals(reporter.previous_summary, launch_totals(summary))
    return summary


def write_early_stop_summary(cfg: ConveyorConfig, signal_name: str, launched: float) -> dict[str, Any]:
    """``summary.json`` of a launch stopped before its run directory was prepared (in
    pre-flight or placement): written only where it replaces nothing of another run
    (a resumed run's own directory, or one that holds no run)."""
    from pipeline.checkpoint import RUN_FILES

    run_dir = cfg.run_dir
    found = find_latest_checkpoint(run_dir) if cfg.run.resume_from else None
    summary: dict[str, Any] = {
        "run": cfg.run.name, "status": "interrupted", "signal": signal_name, "forced": True, "steps": 0,
        "resume": f"conveyor launch --resume {run_dir}" if found is not None else None,
        **({} if found is not None else {"resume_why": NOTHING_TO_RESUME}),
        "wall_s": 0.0, "launch_wall_s": time.time() - launched}
    previous = read_summary(run_dir) if cfg.run.resume_from else None
    summary["totals"] = accumulate_totals(previous, launch_totals(summary))
    if cfg.run.resume_from or not any((Path(run_dir) / name).exists() for name in RUN_FILES):
        write_summary(run_dir, summary)
    log.warning("run_stopped", **{k: v for k, v in summary.items() if k != "run"})
    return summary


def summarise_admission(reports: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Final admission metrics per stage, from the stages' last status (replicas added
    up), named without the stage: ``{"trainer": {"admission/splits": 3.0, ...}}``."""
    out: dict[str, dict[str, float]] = {}
    for stage, reps in reports.items():
        merged = merge_guard_metrics({f"{stage}:{i}": r.get("core") or {} for i, r in enumerate(reps)})
        if merged:
            out[stage] = {k.replace(f"/{stage}/", "/", 1): v for k, v in sorted(merged.items())}
    return out


def summarise_faults(result: RunResult, resumes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Restarts after deaths (of stage actors; of rollout engines, ``engine_restarts``,
    per worker), items delivered again and what consumers dropped as duplicates or
    skipped as lost with their producer (``summary.json``'s ``faults``)."""
    delivery = {f"{stage}:{i}": r["delivery"] for stage, reps in result.reports.items()
                for i, r in enumerate(reps) if r.get("delivery")}
    engines = {f"rollout:{i}": r["result"]["engine_restarts"] for i, r in enumerate(result.reports.get("rollout", []))
               if "engine_restarts" in (r.get("result") or {})}
    return {
        "restarts": dict(result.restarts),
        "engine_restarts": engines,
        "redelivered": {name: q.get("redelivered", 0) for name, q in result.queues.items()},
        "duplicate_groups_dropped": {k: v["duplicate_groups_dropped"] for k, v in delivery.items()},
        "lost_inputs_skipped": {k: v["lost_inputs_skipped"] for k, v in delivery.items()},
        "auto_resumes": list(resumes or []),
    }


def finish_run(cfg: ConveyorConfig, run_dir: Path, result: RunResult, reporter: Reporter,
               checks: PreflightReport | None = None, resumes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    df = build_dataflow(cfg)
    # Timeline rows in pipeline order; replica r > 0 of a node records as "<node>:<r>".
    order = [n if r == 0 else f"{n}:{r}" for n in df.topological_order() for r in range(df.nodes[n].replicas)]
    agg = result.stage_times  # the whole run; the trace and timeline show its latest spans
    shown_from = min((s.start for s in result.spans), default=0.0)
    markers = [(s["time"], f"sync v{s['version']}") for s in reporter.syncs if s.get("time", -1.0) >= shown_from]
    if result.spans:
        write_chrome_trace(result.spans, run_dir / "trace.json", markers)
        plot_timeline(result.spans, run_dir / "timeline.png", markers, stages=order)
    ledger = result.controller["ledger"]
    n = cfg.rollout.n
    trainer = result.result("trainer") or {}
    source = result.result("source") or {}
    accounting = (reconcile_prompt_ids(source["issued"], source["issued_count"], trainer["done"], trainer["done_count"])
                  if "issued" in source and "done" in trainer else {})
    reward = (result.result("reward") if "reward" in result.reports else None) or {}
    summary = {
        "run": cfg.run.name,
        "status": "interrupted" if result.interrupted else "completed",
        **({"signal": result.interrupted,
            **({"resume": f"conveyor launch --resume {run_dir}"} if cfg.train.resumable
               else {"resume": None, "resume_why": NOT_RESUMABLE})}
           if result.interrupted else {}),
        "mode": result.mode,
        "wall_s": result.wall_s,
        "steps": reporter.step_count,
        "policy_version": result.controller["trainer_version"],
        "prompts": ledger,
        "samples": {
            "produced": ledger["admitted"] * n,
            "trained": ledger["trained"] * n,
            "dropped": {k: v * n for k, v in ledger["dropped"].items()},
            "in_flight": ledger["in_flight"] * n,
            # The ledger's counters, and two independent accounts of the prompt ids.
            "reconciles": ledger["reconciles"] and accounting.get("reconciles", True),
        },
        "accounting": accounting,
        "faults": summarise_faults(result, resumes),
        "source_rows_skipped": source.get("skipped", {}),
        **(checks.to_summary() if checks else {}),
        "reward/errors": reward.get("failed", 0),
        "reward/first_error": reward.get("first_error"),
        "trainer": trainer,
        # Each rollout replica's own account (weight updates; sleeps under colocate), as it
        # stood before its shutdown, which applies the final version.
        "rollout": [report.get("result") for report in result.reports.get("rollout", [])],
        "served": result.controller["served"],
        # The stages' controller calls by method (its budget: pipeline/controller.py).
        "controller_calls": result.controller["calls"],
        "queues": result.queues,
        # Each stage's busy share and its seconds by span kind (pipeline.profiler.SPAN_KINDS:
        # wait_input, wait_memory inside busy, sync, transfer, ...), the console table's.
        "stages": {name: {"busy_s": t.seconds.get("busy", 0.0), "busy_ratio": t.busy_ratio,
                          "seconds": {k: round(v, 3) for k, v in t.seconds.items()}} for name, t in agg.items()},
        "startup": reporter.startup,
        "reward_first": reporter.first_step.get("reward/mean") if reporter.first_step else None,
        "reward_last": reporter.last_step.get("reward/mean") if reporter.last_step else None,
        "admission": summarise_admission(result.reports),
        "mps": reporter.mps,  # the GPU stages ran through an MPS daemon (placement.mps)
        "max_staleness": reporter.describe_staleness(result.controller),
        # Versions whose weights the controller gave up before worker 0 evaluated them.
        **({"eval": {**reporter.evals.summary(), "skipped": result.controller.get("evals", {}).get("skipped", [])}}
           if cfg.eval.enabled else {}),
    }
    # What bounded the run and the key that moves it (pipeline/bound.py), from what it measured.
    bound = diagnose_bound(summary["stages"], [r or {} for r in summary["rollout"]], cfg, reporter.trainer_beside_rollout,
                           (reporter.last_step or {}).get("memory/trainer_alloc_retries", 0.0))
    summary["bound"] = bound.to_dict()
    summary["bound_early"] = reporter.bound_early  # the same read after the first steps (None in a short run)
    write_summary(run_dir, add_run_totals(summary, reporter))
    if cfg.eval.enabled:
        plot_evals(read_metrics(run_dir), run_dir / EVAL_PICTURE)
    reporter.writer.finish(summary, [run_dir / SUMMARY_FILE, run_dir / "timeline.png", run_dir / EVAL_PICTURE])
    if agg:
        print(format_summary_table(agg))
        log.info(bound.describe())
    log.info("done", wall_s=round(result.wall_s, 1), steps=summary["steps"],
             reward_first=summary["reward_first"], reward_last=summary["reward_last"],
             **({"eval_last": (reporter.evals.last or {}).get("eval/reward_mean")} if cfg.eval.enabled else {}),
             dropped=summary["samples"]["dropped"], run_dir=str(run_dir))
    return summary
