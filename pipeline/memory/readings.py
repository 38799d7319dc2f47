"""Memory readings of this process: what it holds, what it may still allocate, its peak.

Guarantees:
- ``read_memory`` is cheap (a few syscalls, no allocation on the device) and never
  imports torch unless a CUDA device is asked for by name: a process that has not
  imported torch holds no CUDA tensors, so it is read as a CPU process.
- Under a container's memory limit (cgroup v1 or v2) the limit wins over the machine's
  numbers: the container is killed at its limit long before the machine runs dry.
- A peak window (``reset_peak_memory`` .. ``read_peak_memory``) is per process (CPU) or
  per process and device (CUDA).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import msgspec
import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 reports "no limit" as a page-aligned number close to 2**63.
_CGROUP_V1_UNLIMITED = 1 << 60


class MemoryReading(msgspec.Struct, frozen=True, kw_only=True):
    """One reading. ``used_bytes``: held by this process (CUDA: allocated tensors; CPU:
    resident set). ``free_bytes``: what this process could still allocate (CUDA: free on
    the device plus the allocator's cached blocks; CPU: available memory, within the
    container's limit when one is set). ``source``: ``cuda:N``, ``cpu`` or ``cgroup``."""

    used_bytes: int
    free_bytes: int
    total_bytes: int
    source: str


def read_memory(device: str | None = None) -> MemoryReading:
    """Read memory for ``device`` (``None``: CUDA if torch is loaded and sees a GPU,
    else CPU; ``"cpu"``; ``"cuda"``; ``"cuda:N"``)."""
    if device is None:
        torch = sys.modules.get("torch")
        device = "cuda" if torch is not None and torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return _read_cpu_memory()
    if device == "cuda" or device.startswith("cuda:"):
        return _read_cuda_memory(device)
    raise ValueError(f"device: expected None, 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def _cuda_index(torch: Any, device: str) -> int:
    return torch.cuda.current_device() if device == "cuda" else int(device.split(":", 1)[1])


def _read_cuda_memory(device: str) -> MemoryReading:
    import torch

    index = _cuda_index(torch, device)
    free_on_device, total = torch.cuda.mem_get_info(index)
    allocated = torch.cuda.memory_allocated(index)
    reserved = torch.cuda.memory_reserved(index)
    # Blocks the caching allocator reserved but no tensor uses are free to this process
    # even though the driver counts them as taken.
    free = free_on_device + max(0, reserved - allocated)
    return MemoryReading(used_bytes=allocated, free_bytes=free, total_bytes=total, source=f"cuda:{index}")


def _read_cpu_memory() -> MemoryReading:
    vm = psutil.virtual_memory()
    rss = psutil.Process(os.getpid()).memory_info().rss
    return combine_cpu_reading(rss, vm.available, vm.total, read_cgroup_memory())


def combine_cpu_reading(
    rss: int, available: int, total: int, cgroup: tuple[int, int] | None
) -> MemoryReading:
    """A CPU reading from the process RSS, the machine's available and total memory and,
    when the process runs under a cgroup limit, ``(limit, working_set)``: the container
    is killed at its limit long before the machine runs dry, so the limit wins."""
    if cgroup is None:
        return MemoryReading(used_bytes=rss, free_bytes=available, total_bytes=total, source="cpu")
    limit, working_set = cgroup
    return MemoryReading(
        used_bytes=rss,
        free_bytes=max(0, min(available, limit - working_set)),
        total_bytes=min(total, limit),
        source="cgroup",
    )


def read_cgroup_memory(root: Path = CGROUP_ROOT) -> tuple[int, int] | None:
    """``(limit, working_set)`` of this container's memory cgroup, or ``None`` without a
    limit. The working set leaves out inactive file cache, which the kernel reclaims
    before it kills anything (the same measure kubelet and docker use)."""
    v2, v1 = root / "memory.max", root / "memory" / "memory.limit_in_bytes"
    try:
        if v2.is_file():
            raw = v2.read_text().strip()
            if raw == "max":
                return None
            usage = int((root / "memory.current").read_text())
            stat_file, inactive_key = root / "memory.stat", "inactive_file"
        elif v1.is_file():
            raw = v1.read_text().strip()
            if int(raw) >= _CGROUP_V1_UNLIMITED:
                return None
            usage = int((root / "memory" / "memory.usage_in_bytes").read_text())
            stat_file, inactive_key = root / "memory" / "memory.stat", "total_inactive_file"
        else:
            return None
        inactive = 0
        if stat_file.is_file():
            for line in stat_file.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == inactive_key:
                    inactive = int(value)
        return int(raw), max(0, usage - inactive)
    except (OSError, ValueError):
        return None  # unreadable or malformed: fall back to the machine's numbers


def reset_peak_memory(device: str | None = None) -> int:
    """Start a peak window and return the bytes used now (the window's baseline).

    The window is per process (CPU) or per process and device (CUDA): measure one micro-batch
    at a time, or the peaks of concurrent micro-batches mix."""
    reading = read_memory(device)
    if reading.source.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats(int(reading.source.split(":")[1]))
    else:
        try:
            # "5" resets only the peak RSS (VmHWM); it touches no page state.
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass  # not Linux, or not permitted: read_peak_memory answers None
    return reading.used_bytes


def read_peak_memory(device: str | None = None) -> int | None:
    """Peak bytes used since ``reset_peak_memory`` (``None`` where it cannot be known)."""
    reading = read_memory(device)
    if reading.source.startswith("cuda"):
        import torch

        return int(torch.cuda.max_memory_allocated(int(reading.source.split(":")[1])))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def read_allocator_counters() -> dict[str, float]:
    """The CUDA caching allocator's counters of this process's current device since it
    started: ``alloc_retries`` (allocations that had to free the cache and try again,
    each a synchronising ``cudaFree`` of cached blocks: a pass running near the memory
    limit), ``ooms`` and ``reserved_gib`` (held by the allocator now). Empty where this
    process has not initialised CUDA (a CPU run, or a trainer whose ranks hold the GPU)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    stats = torch.cuda.memory_stats()
    return {"alloc_retries": float(stats.get("num_alloc_retries", 0)), "ooms": float(stats.get("num_ooms", 0)),
            "reserved_gib": stats.get("reserved_bytes.all.current", 0) / (1 << 30)}
