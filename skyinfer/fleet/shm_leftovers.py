"""The shared-memory segments vLLM's processes make in ``/dev/shm``, removed once those processes are gone.

vLLM's message queues between EngineCore and its workers (and its other caches between processes)
are ``multiprocessing.shared_memory`` segments, ``/dev/shm/psm_*``; on CPU its tensor-parallel
communicator makes ``/dev/shm/vllm_dist_*``. The process that made one unlinks it when it ends
cleanly, and Python's resource tracker (a process of the engine's) unlinks what a dead one
registered, once every process holding the tracker open has exited. Neither happens when an
engine ends:

- stopped: the engine shuts vLLM down with its ``shutdown_timeout`` (0), which force-kills
  EngineCore and its workers at once; the tracker is left to clean up after them, but the
  supervisor's SIGKILL of the engine's process group, right after the engine exits, often ends it
  mid-way (a two-engine server left two or three segments on most graceful stops);
- killed (its EngineCore, or the whole group): the same SIGKILL of the group, before its restart,
  finds the tracker still waiting on the processes that hold it (a worker stuck in a call, say),
  or takes it with them.

vLLM's ``--shutdown-timeout`` is no cure: each stop then waits up to it, and an EngineCore that
outlives it (one of two did, by 5 s) is force-killed all the same.

So the supervisor notes which of these segments an engine's processes map (``/proc/<pid>/maps`` of
every process in the engine's process group, which its stop kills as one) while they run, once the
engine is up and again as it stops, and after its stop (a graceful one, or the kill before a
restart) unlinks those of them still there. A spare's (``spares.py``), SIGKILLed with its group
whenever it goes, are noted once it stands by and as it is killed, and unlinked then. Only segments
those processes mapped, of vLLM's own prefixes, are ever removed: skyinfer's transfer segments
(``skyinfer-*``) have owners of their own.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["mapped_segments", "remove_segments"]

SHM_DIR = "/dev/shm/"
# multiprocessing.shared_memory's names (vLLM's message queues, object storage, tensor arena), and
# the CPU communicator's (vllm/distributed/device_communicators/cpu_communicator.py).
VLLM_PREFIXES = ("psm_", "vllm_dist_")


def _group(pgid: int) -> list[int]:
    """The processes of a process group, from ``/proc`` (none where there is no ``/proc``)."""
    members = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError):
                    if os.getpgid(int(name)) == pgid:
                        members.append(int(name))
    return members


def mapped_segments(pgid: int) -> set[str]:
    """The names of vLLM's segments in ``/dev/shm`` that the processes of group ``pgid`` map
    (a few milliseconds: one ``getpgid`` per process, then the maps of the group's few)."""
    names = set()
    for pid in _group(pgid):
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    # address perms offset dev inode path; an unlinked file's path ends " (deleted)".
                    fields = line.rstrip("\n").split(maxsplit=5)
                    path = fields[5] if len(fields) == 6 else ""
                    if path.startswith(SHM_DIR) and not path.endswith(" (deleted)"):
                        name = path[len(SHM_DIR) :]
                        if name.startswith(VLLM_PREFIXES) and "/" not in name:
                            names.add(name)
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return names


def remove_segments(names: set[str]) -> list[str]:
    """Unlink those of ``names`` still in ``/dev/shm``; the ones removed."""
    removed = []
    for name in sorted(names):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR + name)
            removed.append(name)
    return removed
