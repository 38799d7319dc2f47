"""The runner: turns a validated DataFlow into Ray actors and drives it to the end.

Streaming (every stage loops on its bounded input queue) and lock-step (the same data
path with a barrier per step, the synchronous baseline) run the same actors, cores and
queues; the runner only supervises, never carries data.

Guarantees:
- ``ray.init`` starts a local cluster, or joins ``RAY_ADDRESS`` / ``run.address``, with
  stop signals held meanwhile (``pipeline/signals.py``): one that came then stops the
  launch right after, through the same path as any stop before the stages run;
- a stage that raises stops the run: every actor is killed and ``StageError`` carries the
  stage name and its remote traceback;
- GPU-indexed nodes run in one placement group the runner creates and removes; one Ray
  cannot place within ``PLACEMENT_TIMEOUT_S`` stops the run before any stage starts;
- at a clean end-of-stream every stage has drained, closed its outputs and reported;
  then (unless a signal stopped the run) every core's ``finalize()`` runs (the final
  evaluation, ``eval``) before the driver's last tick and the cores' shutdown;
- a first SIGINT/SIGTERM drains what is in flight (``RunResult.interrupted``), a second
  (or one before the stages run) tears down at once and raises ``RunInterrupted``;
- on every exit path the engine processes the actors spawned on this host are gone;
- a node with ``max_restarts`` survives its process dying: Ray restarts the actor and the
  runner requeues its leases, sets it up again and reruns it (docs/architecture.md, "Runner").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from pipeline.controller import ControllerActor, ControllerClient
from pipeline.delivery import DEDUP_WINDOW, dedup_window
from pipeline.evaluation import build_eval_schedule
from pipeline.log import get_logger
from pipeline.profiler import SpanTotals, StageTimes
from pipeline.queue import QueueHandle, create_queue, start_queue_actor
from pipeline.signals import STOP_SIGNALS, WORKER_SETUP_HOOK, RunInterrupted, StopSignals, hold_stop_signals
from pipeline.stage import StageActor, StageError, lease_id
from pipeline.types import Span

if TYPE_CHECKING:  # a type only: DataFlow.run imports this module, so not at run time
    from pipeline.dataflow import DataFlow

log = get_logger(stage="driver")
# The trace and timeline show the latest spans of a long run (about the last minutes of
# the quickstart); the summary's stage figures cover the whole run (``SpanTotals``).
MAX_TRACE_SPANS = 50_000
PLACEMENT_TIMEOUT_S = 120.0
RESTART_TIMEOUT_S = 300.0  # for Ray to bring a dead stage actor's process back
SETUP_REPORT_S = 15.0  # how often the stages still starting or setting up are logged
SETUP_PROBE_S = 2.0  # how long a setting_up line waits for the stages to say what they are doing
QUIET_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",  # its per-update warnings (e.g. layerwise reload) are noise here
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' and the hub's tqdm bars
    "TRANSFORMERS_VERBOSITY": "error",
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
}


@dataclass
class RunResult:
    mode: str
    wall_s: float
    reports: dict[str, list[dict[str, Any]]]
    queues: dict[str, dict[str, Any]]
    controller: dict[str, Any]
    spans: list[Span] = field(default_factory=list)  # the latest MAX_TRACE_SPANS
    stage_times: dict[str, StageTimes] = field(default_factory=dict)  # every span of the run
    interrupted: str | None = None  # "SIGINT" / "SIGTERM" when a signal ended the run early
    restarts: dict[str, int] = field(default_factory=dict)  # "<node>:<replica>" -> restarts after a death

    def result(self, stage: str, replica: int = 0) -> Any:
        return self.reports[stage][replica].get("result")


@dataclass
class Graph:
    """The live actors of a run, handed to tick callbacks."""

    dataflow: DataFlow
    controller: ControllerClient
    actors: dict[str, list[Any]]
    queues: dict[str, QueueHandle]
    placement_group: Any = None
    # (node, replica) -> (host, pid) of its actor's current process
    processes: dict[tuple[str, int], tuple[str, int]] = field(default_factory=dict)
    # (node, replica) -> the processes it had spawned when set up (its engine's), which a
    # death of the actor leaves orphaned
    spawned: dict[tuple[str, int], list[Any]] = field(default_factory=dict)
    restarts: collections.Counter[str] = field(default_factory=collections.Counter)
    # The trace keeps the latest spans only, so a long run's driver memory stays bounded.
    spans: collections.deque[Span] = field(default_factory=lambda: collections.deque(maxlen=MAX_TRACE_SPANS))
    totals: SpanTotals = field(default_factory=SpanTotals)  # the whole run's time per stage and kind
    # The latest status of each stage replica, under the name its spans carry
    # ("rollout" for replica 0, "rollout:1" ...), as the last telemetry pull found it.
    stage_status: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Where the start-up went, in seconds: ``ray_s``, ``actors_s`` (Ray starting the stage
    # processes), ``setup_s`` (their set-ups, concurrent) and ``stages`` (each replica's
    # own timings, ``StageActor.setup``).
    startup: dict[str, Any] = field(default_factory=dict)

    async def collect_telemetry(self) -> list[Span]:
        """One ``telemetry`` call per stage replica: keeps their statuses, returns (and
        keeps) the new spans."""
        keys = [(name, r) for name, reps in self.actors.items() for r in range(len(reps))]
        # A replica that died has lost its spans; its restart is the runner's business.
        got = await asyncio.gather(*(self.actors[n][r].telemetry.remote() for n, r in keys), return_exceptions=True)
        new: list[Span] = []
        for (name, r), tel in zip(keys, got, strict=True):
            if isinstance(tel, BaseException):
                continue
            new.extend(tel["spans"])
            if tel["status"] is not None:
                self.stage_status[name if r == 0 else f"{name}:{r}"] = tel["status"]
        self.spans.extend(new)
        self.totals.add(new)
        return new

    async def queue_stats(self) -> dict[str, dict[str, Any]]:
        names = list(self.queues)
        stats = await asyncio.gather(*(self.queues[n].stats() for n in names))
        return dict(zip(names, stats, strict=True))


def init_ray(address: str | None = None) -> None:
    """Join ``address`` / ``RAY_ADDRESS`` if given, else start a local cluster (once).
    SIGINT and SIGTERM are held while Ray starts (``pipeline.signals``); under the
    launch's ``STOP_SIGNALS`` one that came meanwhile raises ``RunInterrupted`` here."""
    if ray.is_initialized():
        return
    with hold_stop_signals(on_release=STOP_SIGNALS.reinstall):  # ray.init replaces the SIGTERM handler
        try:
            _start_ray(address)
        except SystemExit as exc:
            # Ray's own SIGTERM handler (ray.init installs it) exits: a thread started
            # before, whose mask is not held, took the signal. A stop like any other.
            if exc.code != signal.SIGTERM or not STOP_SIGNALS.installed:
                raise
            STOP_SIGNALS.record(signal.SIGTERM)
    STOP_SIGNALS.check()


def _start_ray(address: str | None) -> None:
    address = address or os.environ.get("RAY_ADDRESS")
    # Workers import ``pipeline``/``stages`` from the installed package; the driver's
    # cwd is shipped too so graphs defined in user scripts and tests resolve.
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    # A quiet console: the engines' per-request INFO lines and progress bars stay out of
    # the driver's output unless the user's environment asks for them.
    env.update({k: os.environ.get(k, v) for k, v in QUIET_ENV.items()})
    # Workers start with the signal mask of the raylet, which ``hold_stop_signals`` blocked.
    runtime_env = {"env_vars": env, "worker_process_setup_hook": WORKER_SETUP_HOOK}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    else:
        # "local": a cluster of this run's own. Without it Ray would join whatever
        # `ray start` cluster this machine last started (its /tmp/ray/ray_current_cluster),
        # another user's or another job's, silently.
        ray.init(address="local", runtime_env=runtime_env, include_dashboard=False, log_to_driver=True)
        skip_graceful_kill()


def skip_graceful_kill() -> None:
    """The local cluster's processes were born with SIGTERM blocked (``hold_stop_signals``):
    ``ray.shutdown`` would send each a SIGTERM it cannot see and wait a second for it
    before its SIGKILL (about 4 s at every exit). They get the SIGKILL at once instead,
    the end Ray comes to anyway, and so do the processes they started (the raylet's
    agents and workers, which would otherwise notice their parent's death a moment
    later), so that nothing outlives the shutdown."""
    import psutil

    node = getattr(ray._private.worker, "_global_node", None)
    kill = getattr(node, "kill_all_processes", None)
    if kill is None:
        return

    def kill_all_processes(*args: Any, **kwargs: Any) -> Any:
        heads = [info.process.pid for infos in node.all_processes.values() for info in infos]
        below = []
        for pid in heads:
            with contextlib.suppress(psutil.Error):
                below.extend(psutil.Process(pid).children(recursive=True))
        result = kill(*args, **{**kwargs, "allow_graceful": False})
        for proc in below:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(below, timeout=5)
        return result

    node.kill_all_processes = kill_all_processes


def run_dataflow(
    df: DataFlow,
    config: Any = None,
    *,
    async_execution: bool | None = None,
    micro_batches_per_step: int | None = None,
    target_prompts: int = 10**12,
    prompts_per_step: int = 1,
    taps: dict[str, str] | None = None,  # edge -> recording dir, written by the consumer
    on_tick: Callable[[Graph], Any] | None = None,
    tick_s: float = 0.5,
) -> RunResult:
    """Run ``df`` to the end; see the module docstring for the two modes."""
    df.validate()
    began = time.monotonic()
    if config is not None:
        async_execution = config.dataflow.async_execution if async_execution is None else async_execution
        micro_batches_per_step = micro_batches_per_step or config.micro_batches_per_step
        init_ray(config.run.address)
    else:
        init_ray()
    ray_s = round(time.monotonic() - began, 2)
    async_mode = True if async_execution is None else bool(async_execution)
    if not async_mode and len(df.sources) != 1:
        raise ValueError(f"lock-step mode needs one source node (its steps are the barrier), not {sorted(df.sources)}")
    owner = not STOP_SIGNALS.installed  # called outside a launch (a test, a bench): restore the handlers after
    STOP_SIGNALS.install()  # a Ray started earlier replaced the SIGTERM handler with its own
    try:
        STOP_SIGNALS.check()
        coro = _run(
            df, config, async_mode, micro_batches_per_step or 1,
            target_prompts, prompts_per_step, taps or {}, on_tick, tick_s, ray_s,
        )
        try:
            import uvloop

            return uvloop.run(coro)
        except ImportError:  # pragma: no cover - uvloop is a dependency; keep plain asyncio working
            return asyncio.run(coro)
    finally:
        if owner:
            STOP_SIGNALS.uninstall()


async def _start(df: DataFlow, config: Any, controller: ControllerClient, taps: dict[str, str]) -> Graph:
    queues: dict[str, QueueHandle] = {}
    edges = start_queue_actor()  # every edge in one actor: releases travel upstream locally
    for producer, consumer in df.edges:
        q = create_queue(producer, consumer, df.queue_bound(producer, consumer), df.nodes[producer].replicas, edges)
        queues[q.name] = q
    level = config.run.log_level if config is not None else os.environ.get("CONVEYOR_LOG_LEVEL", "info")
    began = time.monotonic()
    pg = await _create_placement_group(df)
    actors: dict[str, list[Any]] = {}
    window = (dedup_window(df, config.dataflow.prompts_per_micro_batch, config.train.prompts_per_step)
              if config is not None else DEDUP_WINDOW)
    for name in df.topological_order():
        node = df.nodes[name]
        edge = f"{node.input_from}->{name}"
        tap = (edge, taps[edge]) if edge in taps else None
        actors[name] = [
            StageActor.options(
                num_cpus=node.num_cpus,
                resources=node.resources or None,
                max_concurrency=max(64, 4 * node.concurrency),
                max_restarts=node.max_restarts,
                max_task_retries=0,
                **_gpu_options(node, r, pg),
                **({"runtime_env": {"env_vars": node.env}} if node.env else {}),
            ).remote(name, r, node.node_class, node.kwargs, config, node.concurrency, tap, level,
                     df.downstream_of_restartable(name), window, df.debug)
            for r in range(node.replicas)
        ]
    graph = Graph(df, controller, actors, queues, pg)
    keys = [(name, r) for name, reps in actors.items() for r in range(len(reps))]
    pids = await _await_stages(graph, [(actors[n][r].process_id.remote(), n) for n, r in keys], "starting")
    graph.processes = dict(zip(keys, pids, strict=True))
    started = time.monotonic()
    timings: dict[tuple[str, int], Any] = {}
    waves = df.setup_waves()  # one wave unless a node sets up after others (Node.setup_after)
    for i, wave in enumerate(waves):
        if i + 1 < len(waves):
            log.info("setting_up_first", stages=wave, then=[n for later in waves[i + 1:] for n in later])
        now = [(n, r) for n, r in keys if n in wave]
        done = await _await_stages(graph, [(actors[n][r].setup.remote(controller), n) for n, r in now], "setting_up",
                                   probes=[(f"{n}:{r}", actors[n][r]) for n, r in now])
        timings.update(zip(now, done, strict=True))
    graph.startup = {"actors_s": round(started - began, 2), "setup_s": round(time.monotonic() - started, 2),
                     "stages": {f"{n}:{r}": timings[(n, r)] for n, r in keys}}
    for key, (host, pid) in graph.processes.items():
        graph.spawned[key] = _children(host, pid)
    return graph


async def _await_stages(graph: Graph, calls: list[tuple[Any, str]], event: str,
                        probes: list[tuple[str, Any]] | None = None) -> list[Any]:
    """The results of ``calls`` (a stage actor's call ref, its stage's name), in order.
    While some are still running, their stages are logged as ``event`` every
    ``SETUP_REPORT_S``: an actor Ray has not started yet (``starting``) or a set-up that
    waits on something (``setting_up``: a lock, a slow disk, vLLM compiling) shows which
    stage it is rather than a silent hang; ``probes`` (each call's replica name and
    actor) add what each of those set-ups says it is doing (``StageActor.setup_doing``).
    The first to fail, or a forced stop meanwhile, tears the graph down and raises (the
    failure as its stage's ``StageError``)."""
    futures = [asyncio.ensure_future(ref) for ref, _ in calls]
    pending = {fut: name for fut, (_, name) in zip(futures, calls, strict=True)}
    actors = dict(zip(futures, probes, strict=True)) if probes is not None else {}
    started = time.monotonic()
    name = ""
    try:
        while pending:
            done, _ = await asyncio.wait(pending, timeout=SETUP_REPORT_S, return_when=asyncio.FIRST_EXCEPTION)
            for fut in done:
                name = pending.pop(fut)
                fut.result()
            if pending and not done:
                doing = await _ask_setup_doing([actors[f] for f in pending if f in actors])
                log.info(event, stages=sorted(set(pending.values())), waited_s=round(time.monotonic() - started),
                         **({"doing": doing} if doing else {}))
    except BaseException as exc:  # a failed call, or a forced stop while engines start
        for fut in pending:
            fut.cancel()
        await _teardown(graph)
        if isinstance(exc, Exception):
            raise _stage_error(name, exc) from None
        raise
    return [fut.result() for fut in futures]


async def _ask_setup_doing(probes: list[tuple[str, Any]]) -> dict[str, str]:
    """Replica name -> what its set-up says it is doing, from those that answer within
    ``SETUP_PROBE_S`` (a set-up that holds its actor's loop, importing, cannot)."""
    asks = {asyncio.ensure_future(actor.setup_doing.remote()): key for key, actor in probes}
    if not asks:
        return {}
    done, late = await asyncio.wait(asks, timeout=SETUP_PROBE_S)
    for fut in late:
        fut.cancel()
    return {asks[f]: f.result() for f in done if f.exception() is None and f.result()}


async def _create_placement_group(df: DataFlow) -> Any:
    """One bundle per GPU index any node uses ({GPU: 1} plus the CPUs of its actors)."""
    from ray.util.placement_group import placement_group

    cpus: dict[int, float] = collections.defaultdict(float)
    for node in df.nodes.values():
        for b in node.gpu_bundles:
            cpus[b] += node.num_cpus
    if not cpus:
        return None
    bundles = [{"GPU": 1.0, **({"CPU": cpus[i]} if cpus[i] else {})} for i in range(max(cpus) + 1)]
    pg = placement_group(bundles, strategy="PACK", name=f"conveyor-{os.getpid()}")
    try:
        await asyncio.wait_for(pg.ready(), PLACEMENT_TIMEOUT_S)
    except TimeoutError:
        ray.util.remove_placement_group(pg)
        raise StageError("placement", f"Ray could not place {len(bundles)} GPU bundle(s) within "
                         f"{PLACEMENT_TIMEOUT_S:.0f}s (cluster resources: {ray.cluster_resources()})") from None
    return pg


def _gpu_options(node: Any, replica: int, pg: Any) -> dict[str, Any]:
    """Ray options putting replica ``replica`` of ``node`` on its planned GPU."""
    if not node.gpu_bundles:
        return {"num_gpus": node.num_gpus}
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"num_gpus": node.gpu_shares[replica], "scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=node.gpu_bundles[replica])}


def _stage_error(name: str, exc: BaseException) -> StageError:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, StageError):
        return cause
    if isinstance(exc, StageError):
        return exc
    if isinstance(exc, ray.exceptions.RayActorError):
        text = str(exc).strip().splitlines()
        if text and "error raised in its creation task" in text[0]:
            # The stage's constructor raised: its own error is the last line. Not a
            # death a restart or a resume would get past.
            return StageError(name, f"could not be constructed: {text[-1].strip()}", str(exc))
        return StageError(name, f"actor died: {text[0] if text else type(exc).__name__}", str(exc), died=True)
    text = str(exc)
    return StageError(name, text.strip().splitlines()[-1] if text.strip() else type(exc).__name__, text)


async def _finalize_cores(graph: Graph) -> None:
    """Every core's ``finalize()`` (if it has one), all at once, the stages still busy
    logged every ``SETUP_REPORT_S``; the first failure raises its stage's ``StageError``
    (the caller tears the graph down)."""
    calls = {asyncio.ensure_future(a.finalize.remote()): name for name, reps in graph.actors.items() for a in reps}
    pending = set(calls)
    started = time.monotonic()
    try:
        while pending:
            done, pending = await asyncio.wait(pending, timeout=SETUP_REPORT_S, return_when=asyncio.FIRST_EXCEPTION)
            for fut in done:
                try:
                    fut.result()
                except Exception as exc:
                    raise _stage_error(calls[fut], exc) from None
            if pending and not done:
                log.info("finalizing", stages=sorted({calls[f] for f in pending}),
                         waited_s=round(time.monotonic() - started))
    finally:
        for fut in pending:
            fut.cancel()


async def _shutdown_cores(graph: Graph) -> None:
    """Let every core release its engine (and rollout workers take the final weights)."""
    calls = [a.shutdown.remote() for reps in graph.actors.values() for a in reps]
    try:
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 120)
    except TimeoutError:
        log.warning("shutdown_timeout")
        return
    for r in results:
        if isinstance(r, BaseException):
            log.warning("shutdown_failed", error=str(r).strip().splitlines()[-1] if str(r).strip() else repr(r))


def _children(host: str, pid: int) -> list[Any]:
    """The live descendants of process ``pid`` if it runs on this host."""
    import psutil

    if host != socket.gethostname():
        return []  # another node's pid means nothing here
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _spawned_processes(graph: Graph) -> list[Any]:
    """Every live descendant of this host's stage actors (engine cores, their workers),
    and what earlier, dead processes of restarted actors had spawned."""
    found = [p for host, pid in graph.processes.values() for p in _children(host, pid)]
    seen = {p.pid for p in found}
    return found + [p for procs in graph.spawned.values() for p in procs if p.pid not in seen and p.is_running()]


def reap_processes(processes: list[Any]) -> None:
    """SIGKILL ``processes`` (psutil handles) and wait for them; ones already gone are skipped."""
    import psutil

    for p in processes:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(processes, timeout=10)


async def _teardown(graph: Graph) -> None:
    spawned = _spawned_processes(graph)
    for reps in graph.actors.values():
        for a in reps:
            ray.kill(a, no_restart=True)
    # A killed actor cannot stop its children; whatever survives it is killed here.
    reap_processes(spawned)
    for actor in {q.actor for q in graph.queues.values()}:  # the edges share one
        ray.kill(actor, no_restart=True)
    ray.kill(graph.controller.actor, no_restart=True)
    if graph.placement_group is not None:
        ray.util.remove_placement_group(graph.placement_group)


async def _run(
    df: DataFlow, config: Any, async_mode: bool, mb_per_step: int, target_prompts: int,
    prompts_per_step: int, taps: dict[str, str],
    on_tick: Callable[[Graph], Any] | None, tick_s: float, ray_s: float = 0.0,
) -> RunResult:
    resumed = _resumed_counts(config)
    evals = build_eval_schedule(config, resumed["version"] if resumed else 0)
    controller = ControllerClient(ControllerActor.remote(target_prompts, prompts_per_step, resumed,
                                                         barrier=not async_mode, evals=evals,
                                                         **_staleness_start(config, resumed)))
    interrupts = _Interrupts(controller)
    try:
        try:
            STOP_SIGNALS.check()
            graph = await _start(df, config, controller, taps)  # tears down what it made if it fails
            graph.startup["ray_s"] = ray_s
            interrupts.running = True
        except BaseException as exc:
            if isinstance(exc, RunInterrupted):
                ray.kill(controller.actor, no_restart=True)
                raise
            ray.kill(controller.actor, no_restart=True)
            if interrupts.forced:
                raise RunInterrupted(interrupts.received or "signal") from exc
            raise
        t0 = time.time()
        try:
            reports = await _run_streaming(graph, on_tick, tick_s, 0 if async_mode else mb_per_step)
            wall = time.time() - t0
            if interrupts.received is None:
                await _finalize_cores(graph)
        except BaseException as exc:
            try:
                await controller.stop("interrupted" if interrupts.forced else "stage failed")
            finally:
                await _teardown(graph)
            if interrupts.forced:
                raise RunInterrupted(interrupts.received or "signal") from exc
            raise
    finally:
        interrupts.remove()
    if on_tick is not None:
        await _maybe_await(on_tick(graph))
    await graph.collect_telemetry()
    queues = await graph.queue_stats()
    await _shutdown_cores(graph)  # rollout workers take the final weights here
    result = RunResult(
        mode="async" if async_mode else "sync",
        wall_s=wall,
        reports=reports,
        queues=queues,
        controller=await graph.controller.summary(),
        spans=list(graph.spans),
        stage_times=graph.totals.aggregates(),
        interrupted=interrupts.received,
        restarts=dict(graph.restarts),
    )
    await _teardown(graph)
    return result


def _resumed_counts(config: Any) -> dict[str, Any] | None:
    """The ledger's counters at the checkpoint ``run.resume_from`` names (None: a fresh run)."""
    path = getattr(getattr(config, "run", None), "resume_from", None)
    if not path:
        return None
    from pipeline.checkpoint import load_resume_state

    state = load_resume_state(path)
    return {"version": state.version, "trained_prompts": state.trained_prompts, "dropped": dict(state.dropped),
            "max_staleness": state.max_staleness}


def _staleness_start(config: Any, resumed: dict[str, Any] | None) -> dict[str, Any]:
    """The controller's staleness arguments: η at the start (with ``max_staleness: auto``
    a resumed run's is the one its checkpoint's last step trained under) and whether the
    driver may raise it; none without a config (the stages then use their own)."""
    if config is None or not hasattr(config, "initial_max_staleness"):
        return {}
    auto = bool(config.auto_staleness)
    eta = config.initial_max_staleness
    if auto and resumed and resumed.get("max_staleness") is not None:
        eta = min(max(eta, int(resumed["max_staleness"])), config.dataflow.max_staleness_cap)
    return {"max_staleness": eta, "auto_staleness": auto}


class _Interrupts:
    """SIGINT/SIGTERM handlers of the driver's loop (see the module guarantees)."""

    SIGNALS = StopSignals.SIGNALS

    def __init__(self, controller: ControllerClient) -> None:
        self.controller = controller
        self.received: str | None = None
        self.forced = False
        self.running = False  # the stages are set up and run: a first signal drains them
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        for sig in self.SIGNALS:
            self._loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if not self.running:  # the stages still start: nothing to drain, stop now
            STOP_SIGNALS.record(sig)
            self.received, self.forced = sig.name, True
            if self._task is not None:
                self._task.cancel()
            return
        if self.received is None:
            self.received = sig.name
            log.warning("stopping", signal=sig.name,
                        detail="no new prompts; what is in flight drains; send it again to force")
            self._stopping = self._loop.create_task(self._stop())  # held: a bare task may be collected
            return
        self.forced = True
        log.warning("forced_stop", signal=sig.name)
        if self._task is not None:
            self._task.cancel()

    async def _stop(self) -> None:
        await self.controller.stop(f"interrupted by {self.received}")

    def remove(self) -> None:
        for sig in self.SIGNALS:
            self._loop.remove_signal_handler(sig)
        STOP_SIGNALS.install()  # not the default handlers: the summary is still to be written


async def _maybe_await(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


async def _run_streaming(graph: Graph, on_tick: Callable[[Graph], Any] | None, tick_s: float,
                         step_items: int = 0) -> dict[str, list[dict[str, Any]]]:
    """Every replica runs to end-of-stream (``step_items`` > 0: lock-step)."""
    df = graph.dataflow
    running: dict[asyncio.Task[Any], tuple[str, int]] = {}
    for name, reps in graph.actors.items():
        node = df.nodes[name]
        inp = graph.queues[f"{node.input_from}->{name}"] if node.input_from else None
        outs = [graph.queues[f"{name}->{c}"] for c in df.consumers(name)]
        for r in range(len(reps)):
            task = asyncio.create_task(_supervise(graph, name, r, inp, outs, step_items))
            # Killed actors fail their tasks after a stop; mark them read, not "never retrieved".
            task.add_done_callback(lambda f: f.cancelled() or f.exception())
            running[task] = (name, r)
    reports: dict[str, list[dict[str, Any]]] = {n: [{}] * len(reps) for n, reps in graph.actors.items()}
    pending = set(running)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, timeout=tick_s, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                name, r = running[fut]
                try:
                    reports[name][r] = fut.result()
                except Exception as exc:
                    err = _stage_error(name, exc)
                    log.error("stage_failed", failed=name, error=str(err), **({"where": err.where} if err.where else {}))
                    raise err from None
            if on_tick is not None:
                await _maybe_await(on_tick(graph))
    finally:
        for other in pending:
            other.cancel()
    return reports


async def _supervise(graph: Graph, name: str, r: int, inp: QueueHandle | None,
                     outs: list[QueueHandle], step_items: int = 0) -> dict[str, Any]:
    """Run replica ``r`` of ``name`` to the end, restarting it after a death while its
    node's ``max_restarts`` allow (see the module guarantees)."""
    actor = graph.actors[name][r]
    limit = graph.dataflow.nodes[name].max_restarts
    attempts = 0
    while True:
        try:
            return await actor.run.remote(inp, outs, step_items)
        except ray.exceptions.RayActorError as exc:
            if attempts >= limit:
                raise
            attempts += 1
            await _restart(graph, name, r, inp, exc)


async def _call_when_up(actor: Any, method: str, *args: Any) -> Any:
    """``actor.<method>()`` once Ray has restarted it: while it restarts, calls fail
    with ``ActorUnavailableError`` and are tried again (for at most RESTART_TIMEOUT_S);
    a death beyond its ``max_restarts`` raises ``ActorDiedError``."""
    deadline = time.time() + RESTART_TIMEOUT_S
    while True:
        try:
            return await getattr(actor, method).remote(*args)
        except ray.exceptions.ActorUnavailableError:
            if time.time() > deadline:
                raise
            await asyncio.sleep(0.5)


async def _restart(graph: Graph, name: str, r: int, inp: QueueHandle | None, exc: BaseException) -> None:
    worker = f"{name}:{r}"
    limit = graph.dataflow.nodes[name].max_restarts
    old = graph.processes[(name, r)]
    log.warning("stage_died", failed=worker, pid=old[1], restart=graph.restarts[worker] + 1, max_restarts=limit,
                error=(str(exc).strip().splitlines() or [type(exc).__name__])[0])
    actor = graph.actors[name][r]
    reap_processes(graph.spawned.pop((name, r), []))  # its engine processes, orphaned
    new = await _call_when_up(actor, "process_id")
    if new == old:
        # Unreachable rather than dead: a second run() beside the first must never
        # happen, so the process is killed and Ray starts another.
        ray.kill(actor, no_restart=False)
        while new == old:
            await asyncio.sleep(0.5)
            new = await _call_when_up(actor, "process_id")
    requeued = await inp.requeue(lease_id(worker, old[1])) if inp is not None else 0
    graph.processes[(name, r)] = new
    t0 = time.time()
    try:
        await _call_when_up(actor, "setup", graph.controller)
    except Exception as err:
        raise _stage_error(name, err) from None
    graph.spawned[(name, r)] = _children(*new)
    graph.restarts[worker] += 1  # counted once it serves again
    log.warning("stage_restarted", stage=worker, pid=new[1], requeued=requeued, setup_s=round(time.time() - t0, 1))

