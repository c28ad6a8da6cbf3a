"""The host's memory as the kernel sees it: what a staging copy may take (the front sizes a staged
push by it, a GPU worker places its copy by it)."""

from __future__ import annotations

__all__ = ("DEVICE_HEADROOM_BYTES", "HOST_HEADROOM_BYTES", "host_memory_available")

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
