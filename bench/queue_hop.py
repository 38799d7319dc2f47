"""Queue hop: latency and bandwidth of one edge of the DataFlow, beside a memory copy.

Measures one hop of ``pipeline.queue`` (``create_queue`` + ``QueueHandle.put``/``get``):
a producer puts a numpy array of 1 KB .. 64 MB while the consumer already waits in
``get``; latency runs from the producer's ``put`` call to the consumer holding the value
(both clocks are ``time.time()`` of one machine). Producers: another actor, as a stage
shell emits (``pipeline.queue.fits_inline`` values ride inline in the queue calls,
larger ones go by reference; each put carries the ``Origin`` of the producer's input
lease, whose release the queue forwards), the driver, and, up to 64 KB, an actor that always goes
by reference (what every hop cost before small items went inline). Split of a hop:
``ray.put`` (the copy into the object store; none inline), the ``put`` call to the queue
actor, and delivery (the queue wakes the waiting ``get``, which returns the entry, and
the consumer maps the object or takes the value).

Baselines measured in the same run:
- ``np.copyto`` of the same number of bytes between two pre-touched buffers: one copy;
- the round trip of an empty actor call, the floor of any hop (a hop is about three calls);
- what one actor-to-actor call carrying a 16 KB micro-batch costs, in latency and in CPU
  time of both processes, with Ray's task events (its per-call records for the dashboard)
  on and off, alternately: the control-plane actors run with them off.

``copies`` = (hop latency - the 1 KB hop latency) / memcpy time: about 1 when a payload is
copied once (into the object store) and mapped, not copied, by the consumer. ``zero_copy``
says whether the consumer received a read-only view of the store's memory.

Writes ``bench/results/queue_hop/`` (JSON and PNG). Target: <= 2 ms median for small payloads.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray

from bench.common import measure_memcpy_bandwidth, new_figure, publish_result, summarize
from pipeline.queue import INLINE_MAX_BYTES, Origin, QueueHandle, create_queue, fits_inline
from pipeline.runner import init_ray

KB = 1 << 10
MB = 1 << 20


@ray.remote(num_cpus=0)
class HopEndpoint:
    """One end of the hop; holds pre-touched payloads so allocation is never timed."""

    def __init__(self) -> None:
        self.payloads: dict[int, np.ndarray] = {}

    def prepare(self, size: int, out: QueueHandle | None = None, inp: QueueHandle | None = None) -> None:
        """Payloads of ``size`` bytes; a producer also keeps its queues, as a stage
        shell holds its edges for the whole run."""
        self.payloads = {size: np.ones(size, dtype=np.uint8)}
        self.out, self.inp = out, inp

    def ping(self) -> float:
        return time.time()

    async def send(self, seq: int, size: int, by_reference: bool = False) -> tuple[float, float, float]:
        """(start, after ray.put, after the put call): ``QueueHandle.put`` in two halves,
        as a stage shell emits (or always by reference), tagged with the origin of a
        lease ``seq`` on the producer's input queue as a stage's output is (the queue
        forwards its release there when the consumer takes it)."""
        t0 = time.time()
        value = self.payloads[size]
        entry = value if fits_inline(value) and not by_reference else ray.put(value)
        t1 = time.time()
        await self.out.put_entry(entry, Origin(self.inp.name, "hop_producer", seq, 1))
        return t0, t1, time.time()

    async def recv(self, q: QueueHandle) -> tuple[float, bool, int]:
        value = await q.get()
        t = time.time()
        zero_copy = isinstance(value, np.ndarray) and not value.flags.writeable
        n = int(value.nbytes)
        del value  # release the store's copy before the next hop
        return t, zero_copy, n


async def measure_hops(size: int, repeats: int, mode: str) -> dict[str, Any]:
    """``mode``: "actor" (actor -> actor, the stage edge), "driver" (driver -> actor) or
    "by_reference" (actor -> actor through the object store whatever the size)."""
    prod, cons = HopEndpoint.remote(), HopEndpoint.remote()
    q = create_queue("hop_producer", "hop_consumer", bound=4)
    up = create_queue("hop_source", "hop_producer", bound=4, actor=q.actor)  # the producer's input, for the origins
    await prod.prepare.remote(size, q, up)
    payload = np.ones(size, dtype=np.uint8)
    lat, put_copy, put_call, delivery, zero_copy = [], [], [], [], True
    try:
        for i in range(repeats + 1):  # the first hop warms up connections and is discarded
            pending = cons.recv.remote(q)
            # Let the consumer's get reach the queue actor first, so a hop never
            # includes the consumer's own call start-up.
            await asyncio.sleep(0.005)
            if mode == "driver":
                t0 = time.time()
                entry = payload if fits_inline(payload) else ray.put(payload)
                t1 = time.time()
                await q.put_entry(entry)
                t2 = time.time()
                del entry
            else:
                t0, t1, t2 = await prod.send.remote(i, size, by_reference=mode == "by_reference")
            t3, zc, n = await pending
            if n != size:
                raise RuntimeError(f"hop of {size} bytes delivered {n}")
            if i == 0:
                continue
            zero_copy = zero_copy and zc
            lat.append(t3 - t0)
            put_copy.append(t1 - t0)
            put_call.append(t2 - t1)
            delivery.append(t3 - t2)
    finally:
        for a in (prod, cons, q.actor):
            ray.kill(a, no_restart=True)
    return {"bytes": size, "mode": mode, "latency_s": summarize(lat),
            "put_copy_s": summarize(put_copy), "put_call_s": summarize(put_call),
            "delivery_s": summarize(delivery), "zero_copy": zero_copy}


async def measure_call_rtt(repeats: int) -> dict[str, float]:
    """Round trip of an empty actor call from the driver."""
    a = HopEndpoint.remote()
    await a.ping.remote()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await a.ping.remote()
        times.append(time.perf_counter() - t0)
    ray.kill(a, no_restart=True)
    return summarize(times)


class CallTarget:
    """The receiving end of ``measure_call_cost``."""

    def take(self, value: Any) -> None:
        return None

    def cpu_s(self) -> float:
        return time.process_time()


class CallSource:
    """Calls ``target.take`` ``n`` times in a row, as a stage shell calls its queues."""

    def __init__(self, target: Any) -> None:
        self.target = target

    async def call(self, n: int, size: int) -> float:
        """Mean seconds per call."""
        value = np.ones(size, dtype=np.uint8)
        t0 = time.perf_counter()
        for _ in range(n):
            await self.target.take.remote(value)
        return (time.perf_counter() - t0) / n

    def cpu_s(self) -> float:
        return time.process_time()


async def measure_call_cost(calls: int, size: int, task_events: bool) -> dict[str, Any]:
    """One actor calling an async actor ``calls`` times with ``size`` bytes inline: mean
    latency and CPU milliseconds of both processes per call."""
    opts = {"num_cpus": 0, "enable_task_events": task_events}
    target = ray.remote(max_concurrency=1000, **opts)(CallTarget).remote()
    source = ray.remote(**opts)(CallSource).remote(target)
    try:
        await source.call.remote(max(1, calls // 10), size)  # warm-up
        cpu0 = sum(await asyncio.gather(target.cpu_s.remote(), source.cpu_s.remote()))
        latency = await source.call.remote(calls, size)
        cpu1 = sum(await asyncio.gather(target.cpu_s.remote(), source.cpu_s.remote()))
    finally:
        for a in (source, target):
            ray.kill(a, no_restart=True)
    return {"task_events": task_events, "bytes": size, "calls": calls, "latency_ms": 1e3 * latency,
            "cpu_ms_per_call": 1e3 * (cpu1 - cpu0) / calls}


def _repeats(size: int, quick: bool) -> int:
    if quick:
        return 5
    return 40 if size <= MB else (12 if size <= 16 * MB else 6)


async def _run_async(sizes: list[int], quick: bool) -> dict[str, Any]:
    rtt = await measure_call_rtt(10 if quick else 100)
    # Alternately, so that a change of the machine's load falls on both settings.
    call_cost = [await measure_call_cost(50 if quick else 2000, 16 * KB, events)
                 for _ in range(1 if quick else 3) for events in (True, False)]
    for c in call_cost:
        print(f"16 KB call, task events {'on ' if c['task_events'] else 'off'}: {c['latency_ms']:.2f} ms, "
              f"{c['cpu_ms_per_call']:.3f} CPU-ms", flush=True)
    rows = []
    for size in sizes:
        reps = _repeats(size, quick)
        actor = await measure_hops(size, reps, "actor")
        driver = await measure_hops(size, reps, "driver")
        row = {"bytes": size, "actor": actor, "driver": driver}
        if size <= INLINE_MAX_BYTES:
            row["by_reference"] = await measure_hops(size, reps, "by_reference")
        row["memcpy"] = measure_memcpy_bandwidth(size, repeats=max(5, reps))
        rows.append(row)
        by_ref = (f"  by reference {1e3 * row['by_reference']['latency_s']['median']:8.2f} ms"
                  if "by_reference" in row else "")
        print(f"{size:>10} B  actor hop {1e3 * actor['latency_s']['median']:8.2f} ms  driver hop "
              f"{1e3 * driver['latency_s']['median']:8.2f} ms{by_ref}  memcpy {1e3 * row['memcpy']['median_s']:8.3f} ms"
              f"  zero-copy {actor['zero_copy']}", flush=True)
    return {"call_rtt_s": rtt, "call_cost": call_cost, "rows": rows}


def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    init_ray()
    sizes = [KB, MB] if quick else [KB, 16 * KB, 64 * KB, 256 * KB, MB, 4 * MB, 16 * MB, 64 * MB]
    load_before = os.getloadavg()[0]
    measured = asyncio.run(_run_async(sizes, quick))
    rows = measured["rows"]
    small = rows[0]["actor"]["latency_s"]["median"]
    for r in rows:
        for side in ("actor", "driver", "by_reference"):
            if side not in r:
                continue
            hop = r[side]["latency_s"]["median"]
            r[side]["bandwidth_bytes_per_s"] = r["bytes"] / hop
            r[side]["copies"] = max(0.0, hop - rows[0][side]["latency_s"]["median"]) / r["memcpy"]["median_s"]
    big = rows[-1]
    cost = {events: [c for c in measured["call_cost"] if c["task_events"] == events] for events in (True, False)}
    cpu = {events: float(np.median([c["cpu_ms_per_call"] for c in cs])) for events, cs in cost.items()}
    ratios = {
        "small_hop_median_ms": 1e3 * small,
        "small_hop_driver_median_ms": 1e3 * rows[0]["driver"]["latency_s"]["median"],
        "actor_call_rtt_median_ms": 1e3 * measured["call_rtt_s"]["median"],
        "small_hop_over_call_rtt": small / measured["call_rtt_s"]["median"],
        "small_hop_by_reference_median_ms": 1e3 * rows[0]["by_reference"]["latency_s"]["median"],
        "call_16kb_cpu_ms_task_events_on": cpu[True],
        "call_16kb_cpu_ms_task_events_off": cpu[False],
        "call_cpu_task_events_off_over_on": cpu[False] / cpu[True],
        "call_16kb_latency_ms_task_events_on": float(np.median([c["latency_ms"] for c in cost[True]])),
        "call_16kb_latency_ms_task_events_off": float(np.median([c["latency_ms"] for c in cost[False]])),
        "largest_bytes": big["bytes"],
        "largest_hop_bandwidth_gb_s": big["actor"]["bandwidth_bytes_per_s"] / 1e9,
        "memcpy_bandwidth_gb_s": big["memcpy"]["bytes_per_s"] / 1e9,
        "largest_hop_over_memcpy_time": big["actor"]["latency_s"]["median"] / big["memcpy"]["median_s"],
        "largest_hop_copies": big["actor"]["copies"],
        # Only values that went through the object store can be mapped (inline ones are copies).
        "consumer_zero_copy": all(r["actor"]["zero_copy"] and r["driver"]["zero_copy"] for r in rows
                                  if r["bytes"] > INLINE_MAX_BYTES),
    }
    payload = {
        "quick": quick,
        "units": "seconds and bytes per second unless a key says otherwise",
        "params": {"sizes": sizes, "queue_bound": 4, "inline_max_bytes": INLINE_MAX_BYTES},
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
        "call_rtt_s": measured["call_rtt_s"],
        "call_cost": measured["call_cost"],
        "rows": rows,
        "ratios": ratios,
    }
    return publish_result(out_dir, "queue_hop", payload, plot)


def plot(payload: dict[str, Any]) -> Any:
    rows = payload["rows"]
    xs = np.array([r["bytes"] for r in rows], dtype=float)
    fig, axes = new_figure(1, 2, size=(12, 4.5))
    ax = axes[0][0]
    for side, style in (("actor", "o-"), ("driver", "s--")):
        ax.plot(xs, [1e3 * r[side]["latency_s"]["median"] for r in rows], style, label=f"hop from {side} (median)")
    ref = [r for r in rows if "by_reference" in r]
    ax.plot([r["bytes"] for r in ref], [1e3 * r["by_reference"]["latency_s"]["median"] for r in ref], "x-",
            label="always by reference")
    ax.plot(xs, [1e3 * r["memcpy"]["median_s"] for r in rows], "^:", label="np.copyto (one copy)")
    ax.axhline(1e3 * payload["call_rtt_s"]["median"], color="grey", linestyle=":", label="empty actor call RTT")
    ax.axhline(2.0, color="red", linestyle="-.", linewidth=0.8, label="target 2 ms (small)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("payload bytes")
    ax.set_ylabel("ms")
    ax.set_title("one queue hop: latency")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    for side, style in (("actor", "o-"), ("driver", "s--")):
        ax.plot(xs, [r[side]["bandwidth_bytes_per_s"] / 1e9 for r in rows], style, label=f"hop from {side}")
    ax.plot(xs, [r["memcpy"]["bytes_per_s"] / 1e9 for r in rows], "^:", label="np.copyto")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("payload bytes")
    ax.set_ylabel("GB/s")
    ax.set_title("effective bandwidth (bytes / latency)")
    ax.legend(fontsize=8)
    return fig
