"""The host's memory as the kernel sees it: what a staging copy may take (the front sizes a staged
push by it, a GPU worker places its copy by it), and giving back what a push freed."""

from __future__ import annotations

import ctypes
import functools

__all__ = ("DEVICE_HEADROOM_BYTES", "HOST_HEADROOM_BYTES", "give_back_freed_memory", "host_memory_available")

# Host memory a staged push leaves free beside its staging copies (pinned pages cannot be swapped).
HOST_HEADROOM_BYTES = 1 << 30
# Device memory a staging copy leaves a GPU for the engine's own needs (activations, graphs).
DEVICE_HEADROOM_BYTES = 2 << 30


def host_memory_available() -> int:
    """The kernel's estimate of the memory new allocations can take without swapping (MemAvailable)."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator keeps its own counsel
        return None


def give_back_freed_memory() -> None:
    """After a push freed a model's worth of tensors: glibc keeps freed memory in its arenas (its
    mmap threshold rises past every large block freed, so a model's tensors come from the heap by
    the next push) and an engine's resident memory creeps up push after push; ``malloc_trim`` hands
    the free pages back to the kernel. A GPU's blocks go back from torch's caching allocator."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if (trim := _malloc_trim()) is not None:
        trim(0)
