"""The platform of a CPU engine: vLLM's CPU platform, with the engine's vLLM processes (its
EngineCores, their workers, a data-parallel coordinator) forked instead of spawned.

AsyncLLM runs its EngineCore in a process of its own, and vLLM's CPU platform starts every such
process, and every worker process, by ``spawn`` (``check_and_update_config`` sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn``, whatever the environment says), so that a worker's OpenMP
runtime starts with the environment the executor sets for it just before it starts it (its thread
count and cores). Spawned, each process imports torch and vLLM again: 7 to 10 CPU-seconds each,
most of an engine's start (an engine of ``-dp 2`` spawns five: two EngineCores, two workers and
the coordinator). Forked, as vLLM starts them on a GPU, they start from the engine process's
imports (docs: benchmarks-journal, "The EngineCore forked", "Every vLLM process of a CPU engine forked").

Forking is safe for OpenMP because nothing forks after an OpenMP region ran: the engine process and
an EngineCore that runs no worker itself compute nothing before they fork. What a forked worker
misses is only the environment, read by OpenMP when torch loaded it in the template: the worker
takes it when it starts (``start_worker_process``, called by skyinfer's worker class), its
thread count and its cores, so each worker computes on its own cores with as many threads as a
spawned one (the suite checks each worker's cores and the served tokens against transformers).
An EngineCore that runs its one worker itself (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``devices.py``) has the engine process's environment, which is already the worker's.

The platform is vLLM's extension point for this choice (vLLM's own CLI sets
``vllm.platforms.current_platform`` the same way); it is set before anything in the process
resolves the platform. ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` in the environment keeps vLLM's."""

from __future__ import annotations

import ctypes
import importlib
import logging
import multiprocessing
import os
import re
import signal

import torch

from ..vllm_api import CpuPlatform, resolve_current_platform_cls_qualname

__all__ = ["START_METHOD_ENV", "CpuPlatformForking", "fork_engine_processes_on_cpu", "start_worker_process"]

log = logging.getLogger("skyinfer.engine.cpu_platform")

_VLLM_CPU_PLATFORM = f"{CpuPlatform.__module__}.{CpuPlatform.__qualname__}"
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
_CORE_LIST = re.compile(r"\{?[\d, ]+\}?")


class CpuPlatformForking(CpuPlatform):
    """vLLM's CPU platform; an engine forks its EngineCores, which fork their workers."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)
        os.environ[START_METHOD_ENV] = "fork"


def fork_engine_processes_on_cpu() -> None:
    """Make this process's vLLM platform ``CpuPlatformForking`` where vLLM would choose its plain
    CPU platform (not on a GPU, nor vLLM's AMD Zen platform), unless the operator set
    ``VLLM_WORKER_MULTIPROC_METHOD=spawn``. Call it before anything resolves
    ``vllm.platforms.current_platform``; a second call changes nothing."""
    if os.environ.get(START_METHOD_ENV) == "spawn":
        return
    platforms = importlib.import_module(resolve_current_platform_cls_qualname.__module__)
    chosen = getattr(platforms, "_current_platform", None)
    if chosen is None:
        if resolve_current_platform_cls_qualname() == _VLLM_CPU_PLATFORM:
            # vLLM's module-level __setattr__ is not one Python calls: the attribute and vLLM's
            # own record of it (what its lazy __getattr__ and this check read) are set alike.
            platforms._current_platform = platforms.current_platform = CpuPlatformForking()
    elif type(chosen) is CpuPlatform:
        # Something resolved it before this call: the engine still serves, its start is slower.
        log.warning("vLLM's CPU platform was chosen before skyinfer's: vLLM's processes are spawned, not forked")


def start_worker_process() -> None:
    """What a worker process of vLLM's does first on CPU: it takes the OpenMP threads and cores its
    environment names, and dies with its EngineCore.

    The environment: ``OMP_NUM_THREADS``, and the cores of ``GOMP_CPU_AFFINITY`` (``0 1 2``) or
    ``OMP_PLACES`` (``{0,1,2}``), which vLLM's executor sets for each worker before it starts it. A
    spawned worker's OpenMP read them already (nothing changes); a forked one's read its
    template's. Taken before the worker's first OpenMP region, the threads OpenMP starts then
    inherit the cores.

    Its EngineCore: the engine process learns that its EngineCore died when the pipe that
    multiprocessing gave the EngineCore closes, and a forked worker holds a copy of it. vLLM's
    worker ends when its EngineCore's end of its death pipe closes, but only between two calls: a
    worker blocked in a receive from a trainer would keep its dead EngineCore's pipe open until
    the group's timeout, and the engine would not know its EngineCore was gone. The kernel ends it
    at once instead (``PR_SET_PDEATHSIG``): a worker computes nothing without its EngineCore."""
    _die_with_parent()
    places = os.environ.get("GOMP_CPU_AFFINITY") or os.environ.get("OMP_PLACES") or ""
    # Only the explicit lists vLLM writes; a range or an abstract name ("cores") is left to OpenMP.
    cores = {int(core) for core in re.findall(r"\d+", places)} if _CORE_LIST.fullmatch(places) else set()
    if cores and cores != os.sched_getaffinity(0):
        os.sched_setaffinity(0, cores)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) != torch.get_num_threads():
        torch.set_num_threads(int(threads))


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    parent = multiprocessing.parent_process()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        log.warning(
            "the kernel refused PR_SET_PDEATHSIG (errno %d): this worker may outlive its EngineCore", ctypes.get_errno()
        )
    elif parent is not None and os.getppid() != parent.pid:
        # The EngineCore died before the call: no signal will come.
        os._exit(1)
