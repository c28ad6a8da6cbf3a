"""The platform of a CPU engine of one worker: vLLM's CPU platform, with the EngineCore forked from
the engine process instead of spawned.

AsyncLLM runs its EngineCore in a process of its own, and vLLM's CPU platform starts every such
process by ``spawn`` (``check_and_update_config`` sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``,
whatever the environment says), so that a worker process's OpenMP runtime starts with the
environment the executor gives it. An EngineCore that runs its one worker itself
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``devices.py``) gets no environment of its own: the engine
process's is already the worker's (its cores, ``OMP_NUM_THREADS``). Spawned, it imports torch and
vLLM a second time, 5 CPU-seconds of an engine start of 14 on the demo model; forked, as
vLLM starts its EngineCore on a GPU, it starts from the engine process's imports (docs:
benchmarks, "The EngineCore forked"). The engine process has run no OpenMP region by then
(it computes nothing before its EngineCore starts), so the fork inherits no OpenMP threads:
the suite's checks of served tokens against transformers pass on forked EngineCores, and a
completion takes as long (``tools/bench_engine_start.py``).

Engines of several workers (tp, pp, dp) keep vLLM's spawned processes: their workers need the
environment their executor sets. The platform is vLLM's extension point for this choice (vLLM's own
CLI sets ``vllm.platforms.current_platform`` the same way); it is set before anything in the
process resolves the platform."""

from __future__ import annotations

import importlib
import logging
import os

from ..vllm_api import CpuPlatform, resolve_current_platform_cls_qualname

__all__ = ["START_METHOD_ENV", "CpuPlatformForkingEngineCore", "fork_engine_core_on_cpu"]

log = logging.getLogger("skyinfer.engine.cpu_platform")

_VLLM_CPU_PLATFORM = f"{CpuPlatform.__module__}.{CpuPlatform.__qualname__}"
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


class CpuPlatformForkingEngineCore(CpuPlatform):
    """vLLM's CPU platform; an engine whose worker runs inside its EngineCore forks that EngineCore."""

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)
        if vllm_config.parallel_config.distributed_executor_backend == "uni":
            os.environ[START_METHOD_ENV] = "fork"


def fork_engine_core_on_cpu() -> None:
    """Make this process's vLLM platform ``CpuPlatformForkingEngineCore`` where vLLM would choose
    its plain CPU platform (not on a GPU, nor vLLM's AMD Zen platform), unless the operator set
    ``VLLM_WORKER_MULTIPROC_METHOD=spawn``. Call it before anything resolves
    ``vllm.platforms.current_platform``; a second call changes nothing."""
    if os.environ.get(START_METHOD_ENV) == "spawn":
        return
    platforms = importlib.import_module(resolve_current_platform_cls_qualname.__module__)
    chosen = getattr(platforms, "_current_platform", None)
    if chosen is None:
        if resolve_current_platform_cls_qualname() == _VLLM_CPU_PLATFORM:
            platforms.current_platform = CpuPlatformForkingEngineCore()
    elif type(chosen) is CpuPlatform:
        # Something resolved it before this call: the engine still serves, its start is slower.
        log.warning("vLLM's CPU platform was chosen before skyinfer's: the EngineCore is spawned, not forked")
