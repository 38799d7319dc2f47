"""Memory readings, OOM recognition, cache freeing and the generic OOM recovery loop."""

from __future__ import annotations

import asyncio
import gc
import sys
import threading
import types
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.memory.oom import (
    OomEvent,
    OomRecovery,
    OomUnrecoverable,
    free_cached_memory,
    is_oom_error,
    run_with_oom_recovery,
)
from pipeline.memory.readings import (
    MemoryReading,
    combine_cpu_reading,
    read_cgroup_memory,
    read_memory,
    read_peak_memory,
    reset_peak_memory,
)

MiB = 1 << 20


# ------------------------------------------------------------------------ readings

def test_cpu_reading_without_and_with_cgroup_limit() -> None:
    # No cgroup: RSS 100 used, available 700 free, machine total 1000.
    assert combine_cpu_reading(100, 700, 1000, None) == MemoryReading(
        used_bytes=100, free_bytes=700, total_bytes=1000, source="cpu"
    )
    # Limit 500 with 350 in the working set: free min(700, 500 - 350) = 150, total 500.
    assert combine_cpu_reading(100, 700, 1000, (500, 350)) == MemoryReading(
        used_bytes=100, free_bytes=150, total_bytes=500, source="cgroup"
    )


def test_read_cgroup_memory_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("1000000\n")
    (v2 / "memory.current").write_text("600000\n")
    (v2 / "memory.stat").write_text("anon 400000\ninactive_file 100000\nactive_file 5\n")
    assert read_cgroup_memory(v2) == (1_000_000, 500_000)  # working set 600_000 - 100_000
    (v2 / "memory.max").write_text("max\n")
    assert read_cgroup_memory(v2) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory.usage_in_bytes").write_text("300\n")
    assert read_cgroup_memory(tmp_path / "v1") is None
    (v1 / "memory.limit_in_bytes").write_text("2000\n")
    (v1 / "memory.stat").write_text("total_inactive_file 100\n")
    assert read_cgroup_memory(tmp_path / "v1") == (2000, 200)
    assert read_cgroup_memory(tmp_path / "absent") is None


def test_read_memory_on_this_machine_is_cpu() -> None:
    r = read_memory()  # torch is loaded here but sees no GPU
    assert r.source in ("cpu", "cgroup")
    assert 0 < r.used_bytes < r.total_bytes and 0 < r.free_bytes <= r.total_bytes
    assert read_memory("cpu").source == r.source
    with pytest.raises(ValueError, match="device"):
        read_memory("tpu")


def test_read_memory_cuda_counts_allocator_cache_as_free(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        current_device=lambda: 0,
        mem_get_info=lambda i: (1000 + i, 8000),
        memory_allocated=lambda i: 3000,
        memory_reserved=lambda i: 3500,
    )
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    # used = allocated 3000; free = driver free 1001 + (reserved 3500 - allocated 3000).
    assert read_memory("cuda:1") == MemoryReading(used_bytes=3000, free_bytes=1501, total_bytes=8000, source="cuda:1")
    assert read_memory().source == "cuda:0"  # auto: torch loaded and a GPU visible


def test_peak_window_sees_a_transient_allocation() -> None:
    base = reset_peak_memory("cpu")
    block = np.ones(64 * MiB, dtype=np.uint8)  # ones() writes every page: resident
    del block
    peak = read_peak_memory("cpu")
    assert peak is not None and peak - base >= 60 * MiB


# ------------------------------------------------------------------ OOM recognition

def test_is_oom_error_recognises_allocator_failures() -> None:
    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom_error(torch.cuda.OutOfMemoryError("x"))
    assert is_oom_error(MemoryError())
    assert is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_oom_error(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried"))
    wrapped = ValueError("forward failed")
    wrapped.__cause__ = MemoryError()
    assert is_oom_error(wrapped)
    assert not is_oom_error(RuntimeError("shape mismatch"))
    assert not is_oom_error(ValueError("out of memory"))  # not an allocator error type
    assert not is_oom_error(OomUnrecoverable("trainer", "out of memory on a single group"))


def test_is_oom_error_on_a_real_failed_allocation() -> None:
    with pytest.raises(RuntimeError) as err:
        torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: no machine has it
    assert is_oom_error(err.value)


def test_free_cached_memory_collects_cycles() -> None:
    class Node:
        pass

    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection may free the cycle before we ask
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a
        ref = weakref.ref(a)
        del a, b
        assert ref() is not None  # a cycle survives reference counting
        free_cached_memory()
        assert ref() is None
    finally:
        if was_enabled:
            gc.enable()


# --------------------------------------------------------------------- OOM recovery

def halve(xs: list[int], parts: int) -> list[list[int]]:
    if len(xs) <= 1:
        raise ValueError(f"{len(xs)} item(s) cannot be split")
    mid = (len(xs) + 1) // 2
    return [xs[:mid], xs[mid:]]


def test_recovery_state_machine_retries_only_the_failed_piece() -> None:
    rec: OomRecovery[list[int], list[int]] = OomRecovery(list(range(6)), halve, stage="reward")
    assert rec.next_piece() == [0, 1, 2, 3, 4, 5]
    event = rec.failed(MemoryError())
    assert (event.kind, event.pieces, event.error) == ("oom", 2, "MemoryError")
    assert rec.next_piece() == [0, 1, 2]
    rec.succeeded([0, 10, 20])
    assert rec.next_piece() == [3, 4, 5]
    rec.failed(RuntimeError("CUDA out of memory"))
    assert rec.next_piece() == [3, 4]
    rec.succeeded([30, 40])
    assert rec.next_piece() == [5]
    rec.succeeded([50])
    assert rec.next_piece() is None
    assert rec.results == [[0, 10, 20], [30, 40], [50]]
    assert rec.recovered_event() == OomEvent(stage="reward", kind="recovered", count=2)
    with pytest.raises(RuntimeError, match="no piece is running"):
        rec.succeeded([])


def run_inline(fn, batch, **kw):
    """The recovery driver with ``fn`` called on the loop's own thread."""
    return asyncio.run(run_with_oom_recovery(fn, batch, in_thread=False, **kw))


def test_recovery_frees_memory_once_per_oom_and_merges() -> None:
    freed: list[int] = []
    events: list[OomEvent] = []

    def square(xs: list[int]) -> list[int]:  # fails on more than 2 items
        if len(xs) > 2:
            raise MemoryError()
        return [x * x for x in xs]

    out = run_inline(
        square, [1, 2, 3, 4, 5], split=halve, stage="reward", size=len,
        merge=lambda parts: [y for p in parts for y in p], on_event=events.append,
        free_memory=lambda: freed.append(1),
    )
    # 5 fails -> [1,2,3] + [4,5]; [1,2,3] fails -> [1,2] + [3]; then [4,5] runs: 2 OOMs.
    assert out == [1, 4, 9, 16, 25]
    assert len(freed) == 2
    assert [e.kind for e in events] == ["oom", "oom", "recovered"]


def test_other_errors_propagate_without_retry() -> None:
    calls: list[list[int]] = []

    def broken(xs: list[int]) -> list[int]:
        calls.append(xs)
        raise KeyError("bug")

    with pytest.raises(KeyError):
        run_inline(broken, [1, 2, 3, 4], split=halve, stage="reward", free_memory=lambda: None)
    assert calls == [[1, 2, 3, 4]]


def test_async_recovery_runs_sync_fn_in_a_thread_and_awaits_async_fn() -> None:
    loop_thread = threading.get_ident()
    threads: list[int] = []

    def sync_fn(xs: list[int]) -> int:
        threads.append(threading.get_ident())
        if len(xs) > 1:
            raise RuntimeError("CUDA out of memory")
        return xs[0]

    async def async_fn(xs: list[int]) -> int:
        await asyncio.sleep(0)
        if len(xs) > 1:
            raise torch.OutOfMemoryError("out of memory")
        return xs[0] * 10

    kw = dict(split=halve, stage="rollout", free_memory=lambda: None)
    assert asyncio.run(run_with_oom_recovery(sync_fn, [1, 2, 3], **kw)) == [1, 2, 3]
    assert loop_thread not in threads  # every call ran off the event loop's thread
    assert asyncio.run(run_with_oom_recovery(async_fn, [1, 2, 3], **kw)) == [10, 20, 30]


def test_recovery_gives_up_naming_the_stage() -> None:
    def always_oom(xs: list[int]) -> int:
        raise MemoryError()

    with pytest.raises(OomUnrecoverable, match=r"stage 'trainer'.*1 item\(s\) cannot be split.*after 1 halving"):
        run_inline(always_oom, [1, 2], split=halve, stage="trainer", free_memory=lambda: None)


FREEZE_PROBE = """
import gc, weakref
from pipeline.memory.oom import freeze_setup_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

gc.disable()  # only explicit collections below
dead_before = cycle()
kept = [Node() for _ in range(1000)]
freeze_setup_heap()
assert dead_before() is None, "the set-up's garbage is collected before the freeze"
frozen = gc.get_freeze_count()
assert frozen >= 1000, frozen
assert all(o not in gc.get_objects(generation=2) for o in kept[:10]), "frozen objects left the generations"
dead_after = cycle()
gc.collect()
assert dead_after() is None, "a cycle made after the freeze is still collected"
print("ok", frozen)
"""


def test_the_setup_heap_is_frozen_and_later_cycles_still_collected():
    """``freeze_setup_heap`` (run by a colocated trainer after its set-up) collects, then
    takes what is alive out of the collector's walk; cycles made later still go."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FREEZE_PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]


def test_allocator_counters_read_the_current_devices_stats_and_nothing_without_cuda(monkeypatch):
    """On a fake ``torch`` (named as such): the counters come from ``torch.cuda.memory_stats``;
    a process that has not initialised CUDA reports none."""
    import sys
    import types

    from pipeline.memory.readings import read_allocator_counters

    stats = {"num_alloc_retries": 7, "num_ooms": 1, "reserved_bytes.all.current": 3 << 30}
    cuda = types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True, memory_stats=lambda: stats)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    assert read_allocator_counters() == {"alloc_retries": 7.0, "ooms": 1.0, "reserved_gib": 3.0}
    cuda.is_initialized = lambda: False
    assert read_allocator_counters() == {}
