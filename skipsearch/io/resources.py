"""What a device has free, read before a large allocation: a KV cache sized by the model's context fits its config and
still not the machine, and the allocator's own error comes only after minutes of work, as a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .errors import ResourceExhausted


def free_memory(device: torch.device) -> int | None:
    """Bytes that an allocation on `device` can still take, or None where that cannot be read (MPS).

    CUDA: the driver's free memory plus what PyTorch's caching allocator holds unused (it hands that out first).
    CPU: the kernel's MemAvailable (what can be allocated without swapping), capped by the cgroup's limit in a
    container, where the host's figure would overstate it."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    figures = [figure for figure in (_mem_available(), _cgroup_room()) if figure is not None]
    return min(figures) if figures else None


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:  # other Unixes: free pages (a lower bound: the page cache is not counted)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_room() -> int | None:
    """The room left under this process's cgroup memory limit (v2, then v1), or None without a limit."""
    for limit, usage in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            cap = (Path("/sys/fs/cgroup") / limit).read_text().strip()
            used = int((Path("/sys/fs/cgroup") / usage).read_text())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 1 << 60:  # v1 writes "no limit" as a huge number, v2 as "max"
            return max(0, int(cap) - used)
    return None


def size_text(size: int) -> str:
    """A byte count as the one-line errors show it: 1.50 GiB, 12.0 MiB, 9.8 KiB, 100 bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}" if unit == "GiB" else f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def check_memory(needed: int, device: torch.device, what: str, advice: str) -> None:
    """A ResourceExhausted, naming both figures, when `needed` bytes (`what` they are for) exceed what `device` has
    free; nothing where the free memory cannot be read."""
    free = free_memory(device)
    if free is not None and needed > free:
        raise ResourceExhausted(f"out of memory: {what} needs {size_text(needed)} on {device}, and {size_text(free)} is free; "
                                f"{advice}")
