"""What bounded a run, from what it measured, and the key that moves that bound (pure).

After the first steps (``BoundWindow``: ``summary.json``'s ``bound_early``, one console
line, ``status.json``) and at the end of a run (``summary.json``'s ``bound``, one console
line) ``diagnose_bound``
reads the stages' busy shares and seconds by span kind, each rollout replica's vLLM
scheduler (KV cache use, preemptions beyond the weight updates' recomputes, requests in
flight), its KV admission and the trainer's allocator, and names:
- the bound: the busiest stage (a rollout counts as busy while any of its micro-batches
  is in flight, so it reads busy whenever the trainer waits for it);
- why, in the measured figures, and ``change``: the keys to try, in order.

On one GPU the split of memory between vLLM's KV cache and the trainer's passes is
chosen before launch (``pipeline/gpu_split.py``, ``pipeline/placement.py``): vLLM
cannot resize its cache while it runs. So where the measured steps show that split is
the bound (the cache full while the trainer had time to spare, or the cache mostly
unused while the trainer was the bound) this names the keys that move it for the next
launch or resume; it does not change a running job. Rules, first match wins (shares of
the stage's busy seconds; ``MIN_SHARE``, ``FULL``, ``SLACK``):
- rollout bound: admission deferred micro-batches for KV memory (``wait_memory``) ->
  ``rollout.kv_reserve=none`` (or a larger cache); the staleness limit held generation
  (``wait_version``) -> ``dataflow.max_staleness``; the cache full and preempting
  beyond the updates' recomputes or mostly in use -> on a GPU shared with the trainer, a smaller trainer
  pass (``train.pass_tokens``, ``train.gradient_checkpointing``) where the trainer had
  slack, else more GPUs; on its own GPU (or a CPU) a larger cache
  (``rollout.kv_cache_gib`` where set, else ``rollout.gpu_memory_utilization``) or
  ``rollout.num_workers``; the cache mostly unused -> streaming for a lock-step run,
  and more in flight (``rollout.max_inflight``) where the requests were at the job's
  limit (``AT_LIMIT`` of ``job_sequences``); else the engine's own rate
  (``rollout.num_workers``);
- trainer bound: its admission waited for memory, or its allocator retried -> smaller
  passes; on a GPU shared with vLLM whose cache stayed mostly unused -> a smaller
  ``rollout.kv_cache_gib`` leaves the trainer the rest; else its own rate
  (``train.num_ranks``, ``train.compile``, ``model.lora``);
- another stage bound (reward, reference): that stage (a batched reward function);
- no stage busy ``MIN_BUSY`` of the run: start-up and waits, not a stage, set the pace.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.placement import job_sequences
from pipeline.staleness import WARMUP_STEPS, WINDOW_STEPS

MIN_BUSY = 0.5  # below this busy share no stage sets the pace
MIN_SHARE = 0.1  # a wait under this share of a stage's busy time is not what bounds it
FULL = 0.95  # KV cache use at or above this share: the cache was full
SLACK = 0.8  # a stage busy under this share had time to spare
LOW_USE = 0.6  # KV cache use at most this share: the cache was mostly unused
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


def _share(seconds: dict[str, float], kind: str) -> float:
    busy = seconds.get("busy", 0.0)
    return seconds.get(kind, 0.0) / busy if busy > 0 else 0.0


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
    engine = _engine(rollouts)
    trainer_busy = busy.get("trainer", 0.0)
    if bound == "rollout":
        return _rollout_bound(share, seconds, engine, rollouts, cfg, shares_gpu, trainer_busy)
    if bound == "trainer":
        return _trainer_bound(share, seconds, engine, cfg, shares_gpu, allocator_retries)
    return Bound(bound, share, f"the {bound} stage was the busiest, the rollout {busy.get('rollout', 0.0):.0%} "
                               f"and the trainer {trainer_busy:.0%} busy",
                 ["reward.signature=batched"] if bound == "reward" else [])


def _more_staleness(cfg: Any) -> list[str]:
    if not cfg.dataflow.async_execution:
        return ["dataflow.async_execution=true"]
    if cfg.auto_staleness:
        return [f"dataflow.max_staleness_cap={cfg.dataflow.max_staleness_cap + 1}"]
    return ["dataflow.max_staleness=auto", f"dataflow.max_staleness={cfg.initial_max_staleness + 1}"]


def _rollout_bound(share: float, seconds: dict[str, float], engine: dict[str, float] | None,
                   rollouts: list[dict[str, Any]], cfg: Any, shares_gpu: bool, trainer_busy: float) -> Bound:
    deferred = sum(v for r in rollouts if r for k, v in r.items()
                   if k.startswith("admission/") and k.endswith("/deferred"))
    cache = (f"vLLM's KV cache {engine['kv_usage_mean']:.0%} used on average, {engine['kv_usage_max']:.0%} at most"
             if engine else "vLLM's cache not read")
    if _share(seconds, "wait_memory") >= MIN_SHARE and deferred:
        policy = next((r.get("kv_reserve") for r in rollouts if r and r.get("kv_reserve")), None)
        change = (["rollout.kv_reserve=none"] if policy == "cap" and cfg.rollout.backend == "vllm"
                  else ["rollout.kv_cache_gib"])
        return Bound("rollout", share, f"its KV admission deferred {deferred:.0f} micro-batches "
                                       f"({_share(seconds, 'wait_memory'):.0%} of its busy time waiting for "
                                       f"cache it reserved, {policy or 'cap'}) while {cache}", change)
    if _share(seconds, "wait_version") >= MIN_SHARE:
        return Bound("rollout", share, f"generation waited for newer weights {_share(seconds, 'wait_version'):.0%} "
                                       f"of its busy time (the staleness limit)",
                     _more_staleness(cfg))
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


def _trainer_bound(share: float, seconds: dict[str, float], engine: dict[str, float] | None, cfg: Any,
                   shares_gpu: bool, allocator_retries: float) -> Bound:
    lean = [_halved_pass(cfg), *([] if cfg.train.gradient_checkpointing else ["train.gradient_checkpointing=true"])]
    if _share(seconds, "wait_memory") >= MIN_SHARE:
        return Bound("trainer", share, f"its admission waited for GPU memory {_share(seconds, 'wait_memory'):.0%} "
                                       f"of its busy time", lean)
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
    """The stages' time over the run's first steps after its warm-up, summed from each
    step's aggregates (``pipeline.profiler.aggregate_spans``): the window the driver
    reads a bound from early, steps ``WARMUP_STEPS + 1`` to ``WARMUP_STEPS +
    WINDOW_STEPS`` (those of ``max_staleness: auto``), so a long run says what bounds it
    after a few steps rather than at its end."""

    def __init__(self, warmup: int = WARMUP_STEPS, steps: int = WINDOW_STEPS) -> None:
        self.first, self.last = warmup + 1, warmup + steps
        self._window_s = 0.0
        self._busy: dict[str, float] = {}
        self._seconds: dict[str, dict[str, float]] = {}

    def add(self, step: int, aggregates: Mapping[str, Any]) -> bool:
        """Step ``step`` (1 for the run's first) with its stages' ``StageTimes``; True at
        the window's last step."""
        if not self.first <= step <= self.last or not aggregates:
            return False
        self._window_s += next(iter(aggregates.values())).window_s
        for name, t in aggregates.items():
            self._busy[name] = self._busy.get(name, 0.0) + t.busy_ratio * t.window_s
            into = self._seconds.setdefault(name, {})
            for kind, secs in t.seconds.items():
                into[kind] = into.get(kind, 0.0) + secs
        return step == self.last

    def stages(self) -> dict[str, dict[str, Any]]:
        """``diagnose_bound``'s ``stages`` over the window: busy ratio and seconds by kind."""
        window = self._window_s or 1.0
        return {name: {"busy_ratio": busy / window, "seconds": dict(self._seconds[name])}
                for name, busy in self._busy.items()}
