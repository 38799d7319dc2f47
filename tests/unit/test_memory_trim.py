"""``pipeline.memory.trim``: freed heap in a thread's arena goes back to the OS."""

from __future__ import annotations

import threading

import psutil

from pipeline.memory.trim import trim_host_memory


def test_a_threads_freed_heap_is_given_back():
    """A thread allocates ~160 MiB in 2 KiB blocks (glibc serves them from that thread's
    arena) and frees all but one block in 64: the free space lies between blocks still in
    use, so glibc keeps it resident; the trim gives most of it back."""
    kept: list[bytes] = []

    def churn() -> None:
        blocks = [bytes(2048) for _ in range(80_000)]
        kept.extend(blocks[::64])

    worker = threading.Thread(target=churn)
    worker.start()
    worker.join()
    rss = psutil.Process().memory_info().rss
    freed = trim_host_memory()
    assert freed is not None, "glibc has malloc_trim"  # the machines here run glibc
    assert freed > 64 * 2**20, (freed, rss)
    assert psutil.Process().memory_info().rss < rss - 64 * 2**20
    assert len(kept) == 1250
