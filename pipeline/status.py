"""Terminal views for ``conveyor status``: the static plan of a config, or a live run.

Both render rich tables; the queue table has the same columns as the README's
(queue, producer, consumer, bound).
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table

from pipeline.config import ConveyorConfig
from pipeline.dataflow import DataFlow
from pipeline.placement import PlacementPlan


def render_plan(cfg: ConveyorConfig, df: DataFlow, plan: PlacementPlan | None = None) -> Group:
    desc = df.describe()
    stages = Table(title=f"stages ({'async' if cfg.dataflow.async_execution else 'sync'} mode, "
                   f"max_staleness {cfg.describe_staleness})")
    for col in ("stage", "class", "input", "replicas", "concurrency"):
        stages.add_column(col)
    for s in desc["stages"]:
        stages.add_row(s["name"], s["class"], s["input_from"] or "-", str(s["replicas"]), str(s["concurrency"]))
    queues = Table(title="queues (micro-batches)")
    for col in ("queue", "producer", "consumer", "bound"):
        queues.add_column(col)
    for q in desc["queues"]:
        queues.add_row(q["queue"], q["producer"], q["consumer"], str(q["bound"]))
    gpus = plan.available_gpus if plan is not None else 0
    place = Table(title=f"placement ({gpus} GPU(s) found; GPU indices are bundles of the run's placement group)")
    for col in ("stage", "num_cpus", "GPUs", "GPU share per replica"):
        place.add_column(col)
    for s in desc["stages"]:
        node = df.nodes[s["name"]]
        where = str(list(node.gpu_bundles)) if node.gpu_bundles else (f"{node.num_gpus:g} (by count)"
                                                                       if node.num_gpus else "-")
        shares = ", ".join(f"{x:.2g}" for x in node.gpu_shares) or "-"
        place.add_row(s["name"], f"{s['num_cpus']:g}", where, shares)
    parts: list[Any] = [stages, queues, place]
    per_gpu = list_gpu_actors(cfg, df)
    if per_gpu:
        gpus_table = Table(title="actors per GPU (trainer ranks, rollout replicas)")
        for col in ("GPU", "actors (share)"):
            gpus_table.add_column(col)
        for gpu, actors in per_gpu:
            gpus_table.add_row(gpu, ", ".join(actors))
        parts.append(gpus_table)
    if plan is not None:
        if cfg.rollout.gpu_memory_utilization is not None and any(n.gpu_bundles for n in df.nodes.values()):
            parts.append(f"vLLM gpu_memory_utilization: {cfg.rollout.gpu_memory_utilization:g}")
        parts.extend(plan.notes)
    return Group(*parts)


def list_gpu_actors(cfg: ConveyorConfig, df: DataFlow) -> list[tuple[str, list[str]]]:
    """(GPU, its actors with their shares) for the plan's GPU indices, then one row per
    stage placed by Ray GPU count (a tensor-parallel rollout replica's GPUs)."""
    rows: dict[int, list[str]] = {}
    counted: list[tuple[str, list[str]]] = []
    for name, node in df.nodes.items():
        for r, (gpu, share) in enumerate(zip(node.gpu_bundles, node.gpu_shares, strict=True)):
            label = (f"trainer rank {r}" if name == "trainer" and cfg.train.num_ranks > 1
                     else f"{name}:{r}" if node.replicas > 1 else name)
            rows.setdefault(gpu, []).append(f"{label} ({share:.2g})")
        if not node.gpu_bundles and node.num_gpus:
            tp = f", tensor parallel {cfg.rollout.tensor_parallel_size}" if name == "rollout" else ""
            counted.append((f"{node.num_gpus:g} by count", [f"{name} x {node.replicas}{tp}"]))
    return [(str(g), rows[g]) for g in sorted(rows)] + counted


def render_live(status: dict[str, Any]) -> Group:
    last = status.get("last_step") or {}
    head = Table(title=f"run {status['run']}: {status.get('state', 'running')}, {status['elapsed_s']:.0f}s")
    for col in ("step", "trainer version", "reward", "staleness mean/max", "tokens/s", "samples in flight"):
        head.add_column(col)
    head.add_row(
        f"{last.get('step', -1) + 1}/{status['steps_target']}",
        str(status["trainer_version"]),
        f"{last.get('reward/mean', float('nan')):.3f}",
        f"{last.get('staleness/mean', 0):.2f}/{last.get('staleness/max', 0)}",
        f"{last.get('throughput/tokens_per_s', 0):.0f}",
        str(status["ledger"]["in_flight"]),
    )
    if "curriculum/level" in last:  # data.curriculum: the level prompts are drawn from
        head.caption = (f"curriculum level {last['curriculum/level']} (window reward mean "
                        f"{last.get('curriculum/window_reward_mean', 0.0):.3f}, promotions "
                        f"{last.get('curriculum/promotions', 0)}, demotions {last.get('curriculum/demotions', 0)})")
    ev = status.get("last_eval")
    if ev:  # eval: the latest held-out result
        line = (f"last eval: version {ev['version']} ({ev['kind']}), reward {ev.get('eval/reward_mean', float('nan')):.3f}, "
                f"greedy {ev.get('eval/greedy_reward', float('nan')):.3f}")
        head.caption = f"{head.caption}\n{line}" if head.caption else line
    stages = Table(title="stages")
    for col in ("stage", "state", "busy ratio", "memory used / budget (MiB)"):
        stages.add_column(col)
    for name, st in sorted(status.get("stages", {}).items()):
        used, budget = st.get("memory_used_bytes"), st.get("memory_budget_bytes")
        mem = f"{used / 2**20:.0f} / {budget / 2**20:.0f}" if used and budget else "-"
        stages.add_row(name, str(st.get("state", "-")), f"{last.get(f'{name}/busy_ratio', 0):.2f}", mem)
    workers = Table(title="rollout workers")
    for col in ("worker", "serves version", "read back"):
        workers.add_column(col)
    for w, s in sorted(status.get("served", {}).items()):
        workers.add_row(w, str(s["version"]), "yes" if s["verified"] else "not yet")
    queues = Table(title="queues")
    for col in ("queue", "depth", "bound", "put wait s", "get wait s"):
        queues.add_column(col)
    for name, q in status.get("queues", {}).items():
        queues.add_row(name, str(q["depth"]), str(q["bound"]), f"{q['put_wait_s']:.1f}", f"{q['get_wait_s']:.1f}")
    return Group(head, *describe_live_staleness(status.get("max_staleness")), *describe_live_bound(status.get("bound")),
                 stages, workers, queues)


def describe_live_bound(bound: dict[str, Any] | None) -> list[str]:
    """What bounded the run's first steps after its warm-up (``pipeline/bound.py``)."""
    if not bound:
        return []
    first, last = bound["steps"]
    head = (f"bound over steps {first} to {last}: {bound['stage']} ({bound['busy_share']:.0%} busy)"
            if bound["stage"] else f"bound over steps {first} to {last}: no stage")
    return [f"{head}: {bound['why']}" + (f"; try {', '.join(bound['change'])}" if bound["change"] else "")]


def describe_live_staleness(board: dict[str, Any] | None) -> list[str]:
    """``max_staleness: auto``: η now and its latest decision with the reason."""
    if not board or not board.get("auto"):
        return []
    lines = [f"max_staleness auto: {board['current']} now (started at {board['start']})"]
    d = board.get("latest")
    if d:
        move = f"{d['before']} -> {d['after']}" if d["after"] != d["before"] else f"stays {d['before']}"
        lines.append(f"  after step {d['step']}: {move} ({d['reason']})")
    return lines
