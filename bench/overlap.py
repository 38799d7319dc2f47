"""Overlap: how close streaming gets to the bottleneck stage's pace, and what it costs.

Measures, on the real control plane (``pipeline.dataflow.DataFlow`` run by
``pipeline.runner.run_dataflow``: the real stage shells, bounded queues, the controller's
ledger and version board, weight-sync messages) with the fake cores of
``bench.fake_cores``, which sleep where real stages compute (source -> rollout -> reward
-> reference -> trainer, four stages that take time):

- async throughput (``async_execution=True``) in micro-batches/s, and its baseline measured
  in the same run: the lock-step synchronous loop (``async_execution=False``,
  ``max_staleness=0``) on the same cores;
- the ideal bound: the bottleneck stage's rate, 1 / its mean compute seconds per
  micro-batch (``pipeline.profiler.compute_ideal_throughput`` over the cores' own compute
  times); efficiency = achieved / ideal. "steady" throughput is taken over the middle 80%
  of the trainer's completions (no fill or drain), "overall" over the runner's wall time;
- throughput against ``max_staleness`` 0..4 (η = 0 allows overlap inside a step only);
- balanced chains (four stages of t = 10, 30, 100 ms each), where per-hop costs show
  most, with and without read-ahead (``concurrency=2`` plus a compute lock in the core:
  the next item is fetched and the last one put while one computes);
- where the bottleneck stage's time goes, per micro-batch: compute, queue ``get`` call and
  object fetch, ``put`` call, blocked on a full queue, waiting for an item, and time in no
  span at all (``ray.put`` of the output, the shell's own bookkeeping).

Writes ``bench/results/overlap/`` (JSON, and a PNG of throughput vs staleness, efficiency
vs micro-batch time and the time breakdown).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import SPEED_PROBE_ADDITIONS, CpuMeter, measure_cpu_speed, new_figure, publish_result
from bench.fake_cores import FakeRolloutCore, FakeScorerCore, FakeSourceCore, FakeTrainerCore, GenerationLengths
from pipeline.dataflow import DataFlow
from pipeline.profiler import aggregate_spans, compute_efficiency, compute_ideal_throughput
from pipeline.runner import RunResult, run_dataflow

STAGES = ("rollout", "reward", "reference", "trainer")


@dataclass(frozen=True)
class Scenario:
    """Mean seconds per micro-batch of each stage and the shape of the run."""

    name: str
    rollout_s: float
    reward_s: float
    reference_s: float
    trainer_s: float
    lengths: GenerationLengths = field(default_factory=GenerationLengths)
    micro_batches: int = 160
    prompts_per_micro_batch: int = 4
    prompts_per_step: int = 16
    queue_size: int = 4
    payload_bytes: int = 16 << 10  # the token arrays a micro-batch carries
    weight_bytes: int = 4 << 10  # a small stand-in: weight transfer is bench/weight_sync's subject
    apply_s: float = 0.002

    @property
    def stage_seconds(self) -> dict[str, float]:
        return {"rollout": self.rollout_s, "reward": self.reward_s,
                "reference": self.reference_s, "trainer": self.trainer_s}


def build_overlap_dataflow(sc: Scenario, max_staleness: int, read_ahead: bool = False) -> DataFlow:
    """The fake RL chain; parameters travel as node kwargs (``ctx.config`` is None)."""
    extra = {"concurrency": 2, "exclusive": True} if read_ahead else {}
    df = DataFlow()
    df.default_queue_size = sc.queue_size
    df.add_node("source", FakeSourceCore, None, prompts_per_micro_batch=sc.prompts_per_micro_batch)
    df.add_node("rollout", FakeRolloutCore, "source", mean_s=sc.rollout_s, lengths=sc.lengths,
                max_staleness=max_staleness, apply_s=sc.apply_s, payload_bytes=sc.payload_bytes, **extra)
    df.add_node("reward", FakeScorerCore, "rollout", mean_s=sc.reward_s, lengths=sc.lengths, **extra)
    df.add_node("reference", FakeScorerCore, "reward", mean_s=sc.reference_s, lengths=sc.lengths, **extra)
    df.add_node("trainer", FakeTrainerCore, "reference", mean_s=sc.trainer_s, lengths=sc.lengths,
                max_staleness=max_staleness, prompts_per_step=sc.prompts_per_step,
                weight_bytes=sc.weight_bytes, **extra)
    return df


def compute_steady_throughput(done_at: list[float], trim: float = 0.1) -> float:
    """Items/s between the completions at the ``trim`` and ``1 - trim`` quantiles of the
    terminal stage: the pipeline's pace once filled and before it drains."""
    t = sorted(done_at)
    if len(t) < 3:
        return float("nan")
    lo, hi = int(trim * len(t)), max(int(trim * len(t)) + 1, int(np.ceil((1 - trim) * len(t))) - 1)
    return (hi - lo) / (t[hi] - t[lo]) if t[hi] > t[lo] else float("nan")


def break_down_stage(result: RunResult, stage: str, inp: str | None, out: str | None) -> dict[str, float]:
    """Milliseconds per micro-batch of ``stage``'s time, from its spans, its queues' own
    wait counters and its core's compute time. With ``concurrency == 1`` the parts add up
    to its span window; with read-ahead the spans overlap and they do not."""
    spans = [s for s in result.spans if s.stage == stage]
    core = result.result(stage) or {}
    items = core.get("items") or result.reports[stage][0].get("processed") or 0
    if not spans or not items:
        return {}
    window = (min(s.start for s in spans), max(s.end for s in spans))
    sec = aggregate_spans(spans, window)[stage].seconds
    get_wait = result.queues[inp]["get_wait_s"] if inp else 0.0
    put_wait = result.queues[out]["put_wait_s"] if out else 0.0
    compute = core.get("compute_s", 0.0)
    version_wait = core.get("version_wait_s", 0.0)
    parts = {
        "compute": compute,
        "waiting_for_weights": version_wait,
        "core_overhead": sec["busy"] - compute - version_wait,
        "waiting_for_input": get_wait,
        "get_call_and_fetch": sec["wait_input"] - get_wait,
        "blocked_on_full_queue": put_wait,
        "put_call": sec["wait_output"] - put_wait,
        "untracked": (window[1] - window[0]) - sec["busy"] - sec["wait_input"] - sec["wait_output"],
    }
    return {k: 1e3 * v / items for k, v in parts.items()}


def run_case(sc: Scenario, *, async_execution: bool, max_staleness: int, read_ahead: bool = False) -> dict[str, Any]:
    """One run of the chain; figures in micro-batches/s."""
    df = build_overlap_dataflow(sc, max_staleness, read_ahead)
    per_step = sc.prompts_per_step // sc.prompts_per_micro_batch
    cpu = CpuMeter()
    result = run_dataflow(
        df, None, async_execution=async_execution, micro_batches_per_step=per_step,
        target_prompts=sc.micro_batches * sc.prompts_per_micro_batch, prompts_per_step=sc.prompts_per_step,
        on_tick=cpu, tick_s=0.25,
    )
    cores = {s: result.result(s) for s in STAGES}
    per_item = {s: c["compute_s_per_item"] for s, c in cores.items()}
    bottleneck, ideal = compute_ideal_throughput(per_item)
    trainer = cores["trainer"]
    trained = trainer["items"]
    steady = compute_steady_throughput(trainer["done_at"])
    overall = trained / result.wall_s
    edges = {"rollout": ("source->rollout", "rollout->reward"), "reward": ("rollout->reward", "reward->reference"),
             "reference": ("reward->reference", "reference->trainer"), "trainer": ("reference->trainer", None)}
    return {
        "scenario": sc.name,
        "mode": result.mode,
        "load_average_1m": os.getloadavg()[0],
        "max_staleness": max_staleness,
        "read_ahead": read_ahead,
        "wall_s": result.wall_s,
        "micro_batches_trained": trained,
        "micro_batches_dropped": trainer["dropped_batches"],
        "steps": trainer["steps"],
        "throughput_steady": steady,
        "throughput_overall": overall,
        "compute_s_per_item": per_item,
        "bottleneck": bottleneck,
        "ideal_throughput": ideal,
        "lockstep_bound": 1.0 / sum(per_item.values()),
        "efficiency_steady": compute_efficiency(steady, ideal),
        "efficiency_overall": compute_efficiency(overall, ideal),
        "staleness_hist": trainer["staleness_hist"],
        "cpu": _cpu_per_item(cpu.report(), trained, result.wall_s),
        "ledger": result.controller["ledger"],
        "weight_updates_applied": cores["rollout"]["weight_updates"],
        "breakdown_ms_per_item": {s: break_down_stage(result, s, *edges[s]) for s in STAGES},
        "queues": {k: {f: v[f] for f in ("max_depth", "mean_depth", "put_wait_s", "get_wait_s", "puts", "puts_with_lease")}
                   for k, v in result.queues.items()},
    }


def _cpu_per_item(report: dict[str, Any], items: int, wall_s: float) -> dict[str, Any]:
    """The CPU meter's figures plus CPU-milliseconds per micro-batch by process group
    (the window starts at the first tick, so start-up imports are not counted)."""
    if not report or not items:
        return report
    # Items completed inside the meter's window, assuming an even pace over the run.
    inside = items * min(1.0, report["window_s"] / wall_s)
    return {**report, "cpu_ms_per_item": {k: 1e3 * v / inside for k, v in report["cluster_cpu_s"].items()}}


def _summary(case: dict[str, Any]) -> str:
    return (f"{case['scenario']:<14} {case['mode']:<5} η={case['max_staleness']} ra={int(case['read_ahead'])} "
            f"steady {case['throughput_steady']:.2f}/s overall {case['throughput_overall']:.2f}/s "
            f"ideal {case['ideal_throughput']:.2f}/s eff {case['efficiency_steady']:.3f} "
            f"dropped {case['micro_batches_dropped']} machine busy {case['cpu'].get('machine_busy_fraction', float('nan')):.2f}")


def build_scenarios(quick: bool) -> tuple[Scenario, list[Scenario], list[int]]:
    """(the RL mix, the balanced chains, the staleness values to sweep)."""
    if quick:
        # Two runs only: starting a graph's ten actor processes costs far more than the run.
        mix = Scenario("rl_mix", 0.008, 0.002, 0.004, 0.006, micro_batches=16,
                       lengths=GenerationLengths(median_tokens=50, max_tokens=256))
        return mix, [], [1]
    # Generation is the long-tailed bottleneck; scoring and training take less per micro-batch.
    mix = Scenario("rl_mix", 0.080, 0.020, 0.040, 0.060, micro_batches=160)
    balanced = [
        Scenario(f"balanced_{int(t * 1e3)}ms", t, t, t, t, lengths=GenerationLengths(sigma=0.0), micro_batches=m)
        for t, m in ((0.010, 320), (0.030, 200), (0.100, 100))
    ]
    return mix, balanced, [0, 1, 2, 3, 4]


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    mix, balanced, staleness_values = build_scenarios(quick)
    main_eta = 1 if 1 in staleness_values else staleness_values[-1]
    probe_before = measure_cpu_speed()
    cases: list[dict[str, Any]] = []

    def go(sc: Scenario, **kw: Any) -> dict[str, Any]:
        case = run_case(sc, **kw)
        print(_summary(case), flush=True)
        cases.append(case)
        return case

    sync = go(mix, async_execution=False, max_staleness=0)
    sweep = {eta: go(mix, async_execution=True, max_staleness=eta) for eta in staleness_values}
    main = sweep[main_eta]
    balanced_rows = []
    for sc in balanced:
        plain = go(sc, async_execution=True, max_staleness=2)
        ahead = go(sc, async_execution=True, max_staleness=2, read_ahead=True)
        balanced_rows.append({"scenario": sc.name, "stage_s": sc.rollout_s,
                              "efficiency": plain["efficiency_steady"],
                              "efficiency_read_ahead": ahead["efficiency_steady"],
                              "bottleneck_breakdown_ms": plain["breakdown_ms_per_item"][plain["bottleneck"]],
                              "bottleneck_breakdown_ms_read_ahead": ahead["breakdown_ms_per_item"][ahead["bottleneck"]]})
    ratios = {
        "async_throughput_per_s": main["throughput_steady"],
        "sync_throughput_per_s": sync["throughput_steady"],
        "ideal_throughput_per_s": main["ideal_throughput"],
        "async_over_sync": main["throughput_steady"] / sync["throughput_steady"],
        "async_over_sync_overall": main["throughput_overall"] / sync["throughput_overall"],
        "efficiency": main["efficiency_steady"],
        "efficiency_overall": main["efficiency_overall"],
        "sync_efficiency_vs_lockstep_bound": sync["throughput_steady"] / sync["lockstep_bound"],
        **{f"efficiency_{r['scenario']}": r["efficiency"] for r in balanced_rows},
        **{f"efficiency_{r['scenario']}_read_ahead": r["efficiency_read_ahead"] for r in balanced_rows},
        **{f"throughput_max_staleness_{eta}": c["throughput_steady"] for eta, c in sweep.items()},
    }
    # The machine's speed before and after (``measure_cpu_speed``): the same calls cost
    # twice the CPU on a slow hour of a shared host, which the 10 ms stages feel first.
    speed = {"additions": SPEED_PROBE_ADDITIONS, "before_s": probe_before, "after_s": measure_cpu_speed()}
    print(f"machine speed: {SPEED_PROBE_ADDITIONS:,} additions in {speed['before_s']:.2f} s before, "
          f"{speed['after_s']:.2f} s after", flush=True)
    payload = {
        "quick": quick,
        "units": "micro-batches per second; breakdowns in milliseconds per micro-batch",
        "machine_speed": speed,
        "params": {"rl_mix": _scenario_dict(mix), "balanced": [_scenario_dict(s) for s in balanced],
                   "main_max_staleness": main_eta, "balanced_max_staleness": 2},
        "async": main,
        "sync": sync,
        "ideal": {"bottleneck": main["bottleneck"], "throughput": main["ideal_throughput"]},
        "efficiency": main["efficiency_steady"],
        "staleness_sweep": [{"max_staleness": eta, "throughput_steady": c["throughput_steady"],
                             "throughput_overall": c["throughput_overall"], "efficiency": c["efficiency_steady"],
                             "dropped": c["micro_batches_dropped"], "staleness_hist": c["staleness_hist"]}
                            for eta, c in sweep.items()],
        "balanced": balanced_rows,
        "ratios": ratios,
        "cases": cases,
    }
    return publish_result(out_dir, "overlap", payload, plot)


def _scenario_dict(sc: Scenario) -> dict[str, Any]:
    d = dataclasses.asdict(sc)
    d["lengths"] = {f: getattr(sc.lengths, f) for f in sc.lengths.__struct_fields__}
    return d


def plot(payload: dict[str, Any]) -> Any:
    fig, axes = new_figure(1, 3, size=(18, 4.8))
    ax = axes[0][0]
    sweep = payload["staleness_sweep"]
    etas = [r["max_staleness"] for r in sweep]
    ax.plot(etas, [r["throughput_steady"] for r in sweep], "o-", label="async (steady)")
    ax.plot(etas, [r["throughput_overall"] for r in sweep], "s--", label="async (overall)")
    ax.axhline(payload["ideal"]["throughput"], color="green", linestyle=":", label="ideal (bottleneck)")
    ax.axhline(payload["sync"]["throughput_steady"], color="red", linestyle="-.", label="sync lock-step")
    ax.set_xlabel("max_staleness η")
    ax.set_ylabel("micro-batches / s")
    ax.set_title("rl_mix: throughput vs staleness")
    ax.set_xticks(etas)
    ax.legend(fontsize=8)
    ax = axes[0][1]
    rows = payload["balanced"]
    if rows:
        xs = [1e3 * r["stage_s"] for r in rows]
        ax.plot(xs, [r["efficiency"] for r in rows], "o-", label="shell as is")
        ax.plot(xs, [r["efficiency_read_ahead"] for r in rows], "s-", label="read-ahead (conc. 2 + lock)")
        ax.axhline(0.95, color="grey", linestyle=":", label="target 0.95")
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.legend(fontsize=8)
    ax.set_xlabel("ms per micro-batch, each of 4 stages")
    ax.set_ylabel("efficiency (achieved / ideal)")
    ax.set_title("balanced chains: efficiency")
    ax = axes[0][2]
    parts = ["compute", "core_overhead", "get_call_and_fetch", "put_call", "untracked",
             "waiting_for_input", "blocked_on_full_queue", "waiting_for_weights"]
    # Shell as is only: with read-ahead the spans overlap and the parts do not add up.
    main = payload["async"]
    labels = [f"rl_mix {main['bottleneck']}"] + [r["scenario"].split("_")[1] for r in rows]
    stacks = [main["breakdown_ms_per_item"][main["bottleneck"]]] + [r["bottleneck_breakdown_ms"] for r in rows]
    bottom = np.zeros(len(stacks))
    for part in parts:
        vals = np.array([max(0.0, s.get(part, 0.0)) for s in stacks])
        # Share of the item's time, so 10 ms and 100 ms chains fit one axis.
        totals = np.array([max(sum(max(0.0, v) for v in s.values()), 1e-9) for s in stacks])
        ax.bar(range(len(stacks)), vals / totals, bottom=bottom, label=part)
        bottom += vals / totals
    ax.set_xticks(range(len(stacks)), labels, fontsize=8)
    ax.set_ylabel("share of the bottleneck's time per micro-batch")
    ax.set_title("where the bottleneck stage's time goes")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
