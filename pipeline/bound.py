"""What bounded a run, from what it measured, and the keys that move that bound (pure).

``diagnose_bound`` reads the stages' busy shares and seconds by span kind, each rollout
replica's engine (the time it had nothing in flight; vLLM's scheduler: KV cache use,
preemptions beyond the weight updates' recomputes, requests in flight), its KV
admission and the trainer's allocator, and names the bound (the busiest stage), why in
those figures, and ``change``: the keys to try, in order. The driver reads it over the
first steps after the warm-up (``BoundWindow``: ``summary.json``'s ``bound_early``,
``status.json``, a console line) and over the whole run at its end (``bound``).

On one GPU the split of memory between vLLM's KV cache and the trainer's passes is
chosen before launch (``pipeline/gpu_split.py``, ``pipeline/placement.py``): vLLM
cannot resize its cache while it runs. Where the measured steps show that split is the
bound (the cache full while the trainer had time to spare, or mostly unused while the
trainer was the bound), this names the keys that move it for the next launch or
resume; it changes nothing in a running job.

Rules, first match wins (shares of the run's measured time; ``MIN_SHARE``, ``FULL``,
``SLACK``, ``LOW_USE``, ``AT_LIMIT``):
- rollout bound (it reads busy while any micro-batch of it is in flight, waiting
  included): admission deferred micro-batches for KV memory (``wait_memory``) ->
  ``rollout.kv_reserve=none`` (or a larger cache); its engine empty ``MIN_SHARE`` of the
  time while micro-batches waited for newer weights (``wait_version``) ->
  ``dataflow.max_staleness``, or for prompts (``wait_input``) -> more in flight
  (streaming for a lock-step run); the cache full (preempting beyond the updates'
  recomputes, or mostly in use) -> on a GPU shared with a trainer that had slack, a
  smaller trainer pass (``train.pass_tokens``, ``train.gradient_checkpointing``), with a
  busy one another GPU, on a GPU of its own (or a CPU) a larger cache or
  ``rollout.num_workers``; the cache mostly unused -> streaming for a lock-step run, more
  in flight (``rollout.max_inflight``) where the requests were at the job's limit
  (``job_sequences``); else the engine's own rate (``rollout.num_workers``);
- trainer bound: its admission waited for memory, or its allocator retried -> smaller
  passes; on a GPU shared with vLLM whose cache stayed mostly unused -> a smaller
  ``rollout.kv_cache_gib`` leaves the trainer the rest; else its own rate
  (``train.num_ranks``, ``train.compile``, ``model.lora``);
- another stage bound (reward, reference): that stage (a batched reward function);
- no stage busy ``MIN_BUSY`` of the run: start-up and waits, not a stage, set the pace.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.placement import job_sequences
from pipeline.profiler import aggregate_spans
from pipeline.staleness import WARMUP_STEPS, WINDOW_STEPS

MIN_BUSY = 0.5  # below this busy share no stage sets the pace
MIN_SHARE = 0.1  # a wait under this share of a stage's busy time is not what bounds it
FULL = 0.95  # KV cache use at or above this share: the cache was full
SLACK = 0.8  # a stage busy under this share had time to spare
LOW_USE = 0.6  # KV cache use at most this share: the cache was mostly unused
LAG_STEPS = 2  # steps after the early window closes before it is read
AT_LIMIT = 0.75  # requests in flight on average, of the most the job lets a worker have: at its limit
PIPELINE_STAGES = ("rollout", "reward", "reference", "critic", "trainer")
# A rollout's vLLM scheduler figures it reads (``engine`` of a rollout's status and result).
SCHEDULER_FIGURES = ("kv_usage_mean", "kv_usage_max", "preemptions", "update_recomputes", "mean_requests")


@dataclass(frozen=True)
class Bound:
    """The busiest stage, its busy share, why it bounded the run and what to change."""

    stage: str | None
    busy_share: float
    why: str
    change: list[str] = field(default_factory=list)

    def describe(self) -> str:
        head = f"bound: {self.stage} ({self.busy_share:.0%} busy)" if self.stage else "bound: no stage"
        return f"{head}: {self.why}" + (f"; try {', '.join(self.change)}" if self.change else "")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _engine(rollouts: list[dict[str, Any]]) -> dict[str, float] | None:
    """The replicas' vLLM scheduler figures, the fullest replica's use and the sums of counts."""
    engines = [r["engine"] for r in rollouts if r and r.get("engine") and not r["engine"].get("unavailable")]
    if not engines:
        return None
    return {"kv_usage_max": max(float(e.get("kv_usage_max", 0.0)) for e in engines),
            "kv_usage_mean": max(float(e.get("kv_usage_mean", 0.0)) for e in engines),
            "short": sum(float(e.get("preemptions", 0)) - float(e.get("update_recomputes", 0)) for e in engines),
            "mean_requests": sum(float(e.get("mean_requests", 0.0)) for e in engines), "replicas": len(engines)}


def _share(seconds: dict[str, float], kind: str, window: float) -> float:
    return seconds.get(kind, 0.0) / window if window > 0 else 0.0


def _engine_idle(rollouts: list[dict[str, Any]]) -> float | None:
    """The share of time the rollouts' engines had nothing in flight (their
    ``engine_seconds``, else their occupancy's seconds at 0), averaged; None unknown."""
    shares = []
    for r in rollouts:
        if r.get("engine_seconds", {}).get("total"):
            shares.append(r["engine_seconds"]["idle"] / r["engine_seconds"]["total"])
        elif (r.get("occupancy") or {}).get("seconds_at"):
            levels = {int(k): float(v) for k, v in r["occupancy"]["seconds_at"].items()}
            total = sum(levels.values())
            if total > 0:
                shares.append(levels.get(0, 0.0) / total)
    return sum(shares) / len(shares) if shares else None


def _halved_pass(cfg: Any) -> str:
    tokens = cfg.train.pass_tokens
    return f"train.pass_tokens={max(1, tokens // 2)}" if tokens else f"train.chunk_size={max(1, cfg.train.chunk_size // 2)}"


def diagnose_bound(stages: dict[str, dict[str, Any]], rollouts: list[dict[str, Any]], cfg: Any,
                   shares_gpu: bool, allocator_retries: float = 0.0) -> Bound:
    """The run's ``Bound`` (rules in the module doc). ``stages``: ``summary.json``'s
    (``busy_ratio`` and ``seconds`` by span kind per stage); ``rollouts``: each replica's
    result (``engine``: vLLM's scheduler; ``kv_reserve``; ``admission/*`` counters);
    ``shares_gpu``: the trainer streams on a GPU of vLLM's (not colocated: there the two
    take turns); ``allocator_retries``: the trainer's (``memory/trainer_alloc_retries``)."""
    busy = {s: float(stages[s].get("busy_ratio", 0.0)) for s in PIPELINE_STAGES if s in stages}
    if not busy or max(busy.values()) < MIN_BUSY:
        top = max(busy, key=busy.__getitem__) if busy else None
        return Bound(None, busy.get(top, 0.0) if top else 0.0,
                     f"no stage was busy {MIN_BUSY:.0%} of the run: start-up and waits set its pace "
                     "(a longer run measures the steady state)")
    # Ties go to the rollout: it reads busy whenever anything waits for it.
    bound = max(busy, key=lambda s: (busy[s], s == "rollout"))
    share = busy[bound]
    seconds = stages[bound].get("seconds") or {}
    window = seconds.get("busy", 0.0) / share  # the run's measured time (busy share > 0 here)
    engine = _engine(rollouts)
    trainer_busy = busy.get("trainer", 0.0)
    if bound == "rollout":
        return _rollout_bound(share, seconds, window, engine, rollouts, cfg, shares_gpu, trainer_busy)
    if bound == "trainer":
        return _trainer_bound(share, seconds, window, engine, cfg, shares_gpu, allocator_retries)
    return Bound(bound, share, f"the {bound} stage was the busiest, the rollout {busy.get('rollout', 0.0):.0%} "
                               f"and the trainer {trainer_busy:.0%} busy",
                 ["reward.signature=batched"] if bound == "reward" else [])


def _more_staleness(cfg: Any) -> list[str]:
    if not cfg.dataflow.async_execution:
        return ["dataflow.async_execution=true"]
    if cfg.auto_staleness:
        return [f"dataflow.max_staleness_cap={cfg.dataflow.max_staleness_cap + 1}"]
    return ["dataflow.max_staleness=auto", f"dataflow.max_staleness={cfg.initial_max_staleness + 1}"]


def _rollout_bound(share: float, seconds: dict[str, float], window: float, engine: dict[str, float] | None,
                   rollouts: list[dict[str, Any]], cfg: Any, shares_gpu: bool, trainer_busy: float) -> Bound:
    """The rollout reads busy while any micro-batch of it is in flight, waiting included:
    what it waited for, while its engine had nothing to generate, comes first."""
    deferred = sum(v for r in rollouts if r for k, v in r.items()
                   if k.startswith("admission/") and k.endswith("/deferred"))
    cache = (f"vLLM's KV cache {engine['kv_usage_mean']:.0%} used on average, {engine['kv_usage_max']:.0%} at most"
             if engine else "vLLM's cache not read")
    memory, version, prompts = (_share(seconds, k, window) for k in ("wait_memory", "wait_version", "wait_input"))
    idle = _engine_idle(rollouts)
    empty = f"vLLM had nothing in flight {idle:.0%} of the time; " if idle is not None else ""
    if memory >= MIN_SHARE and deferred:
        policy = next((r.get("kv_reserve") for r in rollouts if r and r.get("kv_reserve")), None)
        change = (["rollout.kv_reserve=none"] if policy == "cap" and cfg.rollout.backend == "vllm"
                  else ["rollout.kv_cache_gib"])
        return Bound("rollout", share, f"{empty}its KV admission deferred {deferred:.0f} micro-batches (one "
                                       f"waited for cache it reserved, {policy or 'cap'}, {memory:.0%} of the "
                                       f"time) while {cache}", change)
    if idle is None or idle >= MIN_SHARE:
        if version >= MIN_SHARE:
            return Bound("rollout", share, f"{empty}micro-batches waited for newer weights (the staleness limit) "
                                           f"{version:.0%} of the time", _more_staleness(cfg))
        if idle is not None and prompts >= MIN_SHARE:
            return Bound("rollout", share, f"{empty}it waited for prompts {prompts:.0%} of the time",
                         ["dataflow.async_execution=true"] if not cfg.dataflow.async_execution
                         else [f"rollout.max_inflight={2 * cfg.rollout.max_inflight}", "dataflow.queue_size"])
    if engine is None:
        return Bound("rollout", share, "generation set the pace (vLLM's scheduler was not read)",
                     ["rollout.num_workers"])
    if engine["kv_usage_max"] >= FULL and (engine["short"] > 0 or engine["kv_usage_mean"] >= LOW_USE):
        why = f"{cache}, {engine['short']:.0f} preemptions beyond the weight updates' recomputes"
        if shares_gpu and trainer_busy < SLACK:
            return Bound("rollout", share, f"{why}: the cache was short, while the trainer beside it on the GPU "
                                           f"was busy {trainer_busy:.0%}; the plan gives vLLM what the trainer's "
                                           f"largest pass leaves, so a smaller pass gives it more cache",
                         [_halved_pass(cfg), *([] if cfg.train.gradient_checkpointing
                                               else ["train.gradient_checkpointing=true"])])
        if shares_gpu:
            return Bound("rollout", share, f"{why}, and the trainer beside it busy {trainer_busy:.0%}: both engines "
                                           f"are near what one GPU gives them (a smaller trainer pass would slow "
                                           f"the trainer as much)", ["a GPU more (the rollout on its own)"])
        size = "rollout.kv_cache_gib" if cfg.rollout.kv_cache_gib is not None else "rollout.gpu_memory_utilization"
        return Bound("rollout", share, f"{why}: the cache was short", [size, "rollout.num_workers"])
    lockstep = not cfg.dataflow.async_execution
    limit = job_sequences(cfg, lockstep) * engine["replicas"]
    requests = f"{engine['mean_requests']:.0f} requests in flight on average of the {limit} it may have"
    if engine["kv_usage_max"] < LOW_USE and lockstep:
        return Bound("rollout", share, f"{cache} with {requests}: lock-step gives it one step's samples, each "
                                       f"step waiting for its longest", ["dataflow.async_execution=true"])
    if engine["kv_usage_max"] < LOW_USE and engine["mean_requests"] >= AT_LIMIT * limit:
        return Bound("rollout", share, f"{cache} with {requests}: it had cache for more",
                     [f"rollout.max_inflight={2 * cfg.rollout.max_inflight}"])
    return Bound("rollout", share, f"{cache} with {requests}: vLLM ran at its own rate", ["rollout.num_workers"])


def _trainer_bound(share: float, seconds: dict[str, float], window: float, engine: dict[str, float] | None,
                   cfg: Any, shares_gpu: bool, allocator_retries: float) -> Bound:
    lean = [_halved_pass(cfg), *([] if cfg.train.gradient_checkpointing else ["train.gradient_checkpointing=true"])]
    memory = _share(seconds, "wait_memory", window)
    if memory >= MIN_SHARE:
        return Bound("trainer", share, f"its admission waited for GPU memory {memory:.0%} of the time", lean)
    if allocator_retries > 0:
        return Bound("trainer", share, f"its passes ran at the memory limit ({allocator_retries:.0f} allocations "
                                       f"freed PyTorch's cache and retried)", lean)
    if shares_gpu and engine is not None and engine["kv_usage_max"] < LOW_USE:
        return Bound("trainer", share, f"vLLM beside it used at most {engine['kv_usage_max']:.0%} of its KV cache: "
                                       f"a smaller cache leaves the trainer memory for larger passes",
                     ["rollout.kv_cache_gib", "train.pass_tokens"])
    return Bound("trainer", share, "the trainer ran at its rate",
                 ["train.num_ranks", "train.compile=on", "model.lora.enabled=true"])


class BoundWindow:
    """The run's first steps after its warm-up, read a little later: what the driver
    diagnoses early, so a long run says what bounds it after a few steps rather than at
    its end. The window runs from the end of step ``WARMUP_STEPS`` to the end of step
    ``WARMUP_STEPS + WINDOW_STEPS`` (those of ``max_staleness: auto``); its spans are
    aggregated ``LAG_STEPS`` steps after it closes, once the spans still open at its end
    (a rollout's micro-batch is one span from hand-over to completion, reported when it
    ends) have arrived. The rollouts' engine seconds are their difference over the window."""

    def __init__(self, warmup: int = WARMUP_STEPS, steps: int = WINDOW_STEPS, lag: int = LAG_STEPS) -> None:
        if warmup < 1:
            raise ValueError(f"BoundWindow: warmup must be >= 1 (the window opens at a step's end), got {warmup}")
        self.first, self.last, self.read_at = warmup + 1, warmup + steps, warmup + steps + lag
        self.window: list[float | None] = [None, None]
        self.spans: list[Any] = []
        self.closed = False
        self._engine_at: list[dict[int, dict[str, float]]] = []  # the rollouts' engine_seconds at each end
        self._rollouts: list[dict[str, Any]] = []

    def add_spans(self, spans: Iterable[Any]) -> None:
        """Spans as the driver collects them; those that overlap the window are kept."""
        start, end = self.window
        if start is None or self.closed:
            return
        self.spans.extend(sp for sp in spans if sp.end > start and (end is None or sp.start < end))

    def step_ended(self, step: int, end: float, rollouts: list[dict[str, Any]]) -> bool:
        """Step ``step`` (1 for the run's first) ended at ``end``; ``rollouts``: their
        statuses now. True once, when the window is to be read (``stages``, ``rollouts``)."""
        if step in (self.first - 1, self.last):
            self.window[0 if step < self.first else 1] = end
            self._engine_at.append({i: dict(r.get("engine_seconds") or {}) for i, r in enumerate(rollouts)})
            self._rollouts = rollouts
        elif step == self.read_at and self.window[1] is not None:
            self.closed = True
            return True
        return False

    def stages(self) -> dict[str, dict[str, Any]]:
        """``diagnose_bound``'s ``stages`` over the window: busy ratio and seconds by kind."""
        window = (float(self.window[0] or 0.0), float(self.window[1] or 0.0))
        return {name: {"busy_ratio": t.busy_ratio, "seconds": t.seconds}
                for name, t in aggregate_spans(self.spans, window).items()}

    def rollouts(self) -> list[dict[str, Any]]:
        """The rollouts' statuses at the window's end, their engine seconds over it."""
        before, after = self._engine_at
        return [{**status, "engine_seconds": {k: after.get(i, {}).get(k, 0.0) - before.get(i, {}).get(k, 0.0)
                                              for k in ("idle", "total")}}
                for i, status in enumerate(self._rollouts)]
