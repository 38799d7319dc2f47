"""Hand the heap memory a process has freed back to the operating system.

glibc keeps what a process frees inside its malloc arenas (up to 8 per core, one per
thread that allocates), and returns it only from the top of the main heap. A process
whose threads allocate and free large buffers over and over keeps a resident set that
grows while the memory it uses does not, as vLLM's engine does, which receives a weight
payload every step (``bench soak_memory``: its in-use heap flat, its resident set up).
``malloc_trim(0)`` gives the free pages of every arena back.

Guarantees:
- ``trim_host_memory`` never raises: where the C library has no ``malloc_trim`` (musl,
  macOS) it does nothing and returns None; else it returns the resident bytes the call
  gave back (a difference of two readings: other threads allocating meanwhile can make
  it small or negative).
- It only returns free pages; nothing in use moves, so it is safe in any thread, at any
  time. It walks every arena and returns pages one range at a time: measured here, 12 ms
  over a 3 GiB heap with nothing to give back, 0.3 s to give back 3 GiB. Callers space
  their calls out.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import psutil


@functools.cache
def _malloc_trim() -> Any:
    try:
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except OSError:
        return None


def trim_host_memory() -> int | None:
    """Resident bytes given back to the OS; None where the C library cannot trim."""
    trim = _malloc_trim()
    if trim is None:
        return None
    process = psutil.Process()
    before = process.memory_info().rss
    trim(0)
    return before - process.memory_info().rss
