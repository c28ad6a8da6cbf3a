"""Which devices each engine gets, and the few ways the GPU and CPU paths differ.

Every engine is an independent vLLM instance. On a GPU machine it gets its
own group of ``tp x pp`` GPUs (each its own sizes, with ``--engine-sizes``)
through ``CUDA_VISIBLE_DEVICES``; on a CPU machine it gets its own cores through
``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's default would bind every engine to the
same cores).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import re
from collections.abc import Callable

import attrs

from .engine_wire import CPU_WORKER_PATH, WORKER_SPIN_ENV
from .ranks import LayoutError


@attrs.frozen
class EngineDevices:
    kind: str  # "cuda" or "cpu"
    # GPUs as CUDA_VISIBLE_DEVICES names them in the parent (indices or UUIDs), or CPU core ids,
    # grouped by worker.
    worker_ids: tuple[tuple[int | str, ...], ...]
    env: dict[str, str]

    @property
    def ids(self) -> tuple[int | str, ...]:
        return tuple(i for group in self.worker_ids for i in group)

    @property
    def sleep_frees_memory(self) -> bool:
        # vLLM's sleep mode is GPU-only; on CPU sleep/wake_up only pause and resume.
        return self.kind == "cuda"

    def describe(self) -> dict:
        return {"kind": self.kind, "ids": list(self.ids), "sleep_frees_memory": self.sleep_frees_memory}


def detect_device_kind() -> str:
    try:
        import pynvml
    except ImportError:
        return "cpu"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return "cpu"
    try:
        return "cuda" if pynvml.nvmlDeviceGetCount() > 0 else "cpu"
    finally:
        pynvml.nvmlShutdown()


def gpu_free_bytes(ids: tuple[int | str, ...]) -> list[int]:
    """Each GPU's free memory (NVML's figure: every process on it counted), GPUs named as
    ``EngineDevices`` names them (indices or UUIDs)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handles = [
            pynvml.nvmlDeviceGetHandleByUUID(i) if isinstance(i, str) and not i.isdigit() else
            pynvml.nvmlDeviceGetHandleByIndex(int(i))
            for i in ids
        ]  # fmt: skip
        return [int(pynvml.nvmlDeviceGetMemoryInfo(h).free) for h in handles]
    finally:
        pynvml.nvmlShutdown()


# CUDA_VISIBLE_DEVICES names GPUs by index, by UUID (GPU-...) or, for MIG instances, by MIG UUID.
_GPU_UUID = re.compile(r"^GPU-[0-9a-fA-F-]{36}$")
_MIG_UUID = re.compile(r"^MIG-(?:GPU-)?[0-9a-fA-F-]+(?:/\d+/\d+)?$")


def parse_visible_devices(value: str | None, count: int, uuid_exists: Callable[[str], bool]) -> list[str]:
    """The GPUs a ``CUDA_VISIBLE_DEVICES`` value makes visible, as it names them: indices below
    ``count``, or UUIDs (GPU or MIG) that ``uuid_exists``; each engine gets its share by the same
    names. None (unset): every GPU."""
    if value is None:
        return [str(i) for i in range(count)]
    names = [v.strip() for v in value.split(",") if v.strip()]
    if all(n.isdigit() for n in names):
        missing = [n for n in names if int(n) >= count]
        if missing:
            raise LayoutError(f"CUDA_VISIBLE_DEVICES names GPUs {', '.join(missing)}, but only {count} exist")
        return names
    unknown = [n for n in names if not (_GPU_UUID.match(n) or _MIG_UUID.match(n))]
    if unknown:
        raise LayoutError(
            f"CUDA_VISIBLE_DEVICES={value!r}: {', '.join(unknown)} is neither a GPU index nor a GPU or MIG UUID"
            " (name every GPU one way: all indices, or all UUIDs)"
        )
    absent = [n for n in names if not uuid_exists(n)]
    if absent:
        raise LayoutError(f"CUDA_VISIBLE_DEVICES names {', '.join(absent)}, which NVML does not know on this machine")
    return names


def _visible_gpus() -> list[str]:
    import pynvml

    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()

        def uuid_exists(uuid: str) -> bool:
            try:
                pynvml.nvmlDeviceGetHandleByUUID(uuid)
            except pynvml.NVMLError:
                return False
            return True

        return parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), count, uuid_exists)
    finally:
        pynvml.nvmlShutdown()


def _id_list(ids: tuple[int | str, ...]) -> str:
    return ",".join(str(i) for i in ids)


def _need(workers_per_engine: tuple[int, ...], unit: str) -> str:
    """What the engines ask for, in words: "3 engine(s) x 2 GPU(s) each", or "3 engine(s) of 2, 2, 1 GPU(s)"."""
    engines = len(workers_per_engine)
    if len(set(workers_per_engine)) <= 1:
        return f"{engines} engine(s) x {workers_per_engine[0] if engines else 0} {unit}(s) each"
    return f"{engines} engine(s) of {', '.join(map(str, workers_per_engine))} {unit}(s)"


def split_gpus(gpus: list[str], workers_per_engine: tuple[int, ...]) -> list[EngineDevices]:
    """One group of consecutive visible GPUs per engine, as many as its workers (``tp x pp``)."""
    widest = max(workers_per_engine, default=1)
    if widest > 1 and any(str(g).startswith("MIG-") for g in gpus):
        raise LayoutError(
            "CUDA_VISIBLE_DEVICES names MIG instances: a process sees one MIG instance, so an engine cannot"
            f" span {widest} of them (tensor or pipeline parallelism); run one engine per instance"
        )
    needed = sum(workers_per_engine)
    if needed > len(gpus):
        raise LayoutError(
            f"{_need(workers_per_engine, 'GPU')} need {needed} GPUs, "
            f"but {len(gpus)} are visible ({_id_list(tuple(gpus)) or 'none'})"
        )
    plans, first = [], 0
    for workers in workers_per_engine:
        group = tuple(gpus[first : first + workers])
        first += workers
        env = {"CUDA_VISIBLE_DEVICES": _id_list(group), **gpu_sampler_env()}
        plans.append(EngineDevices("cuda", tuple((g,) for g in group), env))
    return plans


def gpu_sampler_env() -> dict[str, str]:
    """vLLM's GPU sampler imports FlashInfer unless told not to, and its EngineCore dies at start-up
    where FlashInfer is not installed (seen with vLLM 0.33 on an H200): fall back to vLLM's own sampler."""
    if "VLLM_USE_FLASHINFER_SAMPLER" in os.environ or importlib.util.find_spec("flashinfer") is not None:
        return {}
    return {"VLLM_USE_FLASHINFER_SAMPLER": "0"}


def split_cores(
    cores: list[int], workers_per_engine: tuple[int, ...], cpu_kvcache_gib: int | None
) -> list[EngineDevices]:
    """An equal share of cores per worker (of every engine's); each engine's workers are bound to their own cores.
    ``cpu_kvcache_gib`` None: the engine's own arguments size its KV cache (``--kv-cache-memory-bytes``)."""
    needed = sum(workers_per_engine)
    if needed > len(cores):
        raise LayoutError(
            f"{_need(workers_per_engine, 'worker')} need {needed} CPU cores, but this process may use {len(cores)}"
        )
    per_worker = len(cores) // needed if needed else 0
    plans, first = [], 0
    for count in workers_per_engine:
        workers = tuple(tuple(cores[(first + w) * per_worker : (first + w + 1) * per_worker]) for w in range(count))
        first += count
        env = {
            # One core list per worker rank, '|'-separated, as vLLM expects.
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(_id_list(w) for w in workers),
            # vLLM's CPU platform lets this variable override --kv-cache-memory-bytes.
            **({} if cpu_kvcache_gib is None else {"VLLM_CPU_KVCACHE_SPACE": str(cpu_kvcache_gib)}),
            **_omp_wait_policy(),
            **_worker_spin(),
            **_worker_in_engine_core(workers),
        }
        plans.append(EngineDevices("cpu", workers, env))
    return plans


def _omp_wait_policy() -> dict[str, str]:
    """A worker's OpenMP threads sleep as soon as they wait, unless the operator chose otherwise.

    GNU OpenMP's threads spin between two parallel regions before they sleep. The engine's
    EngineCore, its API process and the front are not bound to the workers' cores: a spinning
    thread takes the core they need, and the step waits for them. Measured on a 2-core machine, one
    engine on both cores, 40 short completions one after the other: 6.3 s and 10.1 CPU-s of worker
    spinning and computing by default, 4.2 s and 4.3 CPU-s with PASSIVE (docs: benchmarks-journal, "OpenMP
    threads that sleep"). ``OMP_WAIT_POLICY=ACTIVE`` in the environment keeps spinning, for cores
    nothing else runs on."""
    return {} if "OMP_WAIT_POLICY" in os.environ else {"OMP_WAIT_POLICY": "PASSIVE"}


# How long a CPU worker spins on its queue after a message: longer than the EngineCore takes between
# two steps of a running batch, far shorter than vLLM's 1 s.
CPU_WORKER_SPIN_S = 0.05


def _worker_spin() -> dict[str, str]:
    """A worker spins on its message queue 50 ms after each message, not vLLM's 1 s, unless the
    operator chose otherwise (``engine/cpu_setup.py`` says why; docs: benchmarks-journal, "Workers that wait
    asleep")."""
    return {} if WORKER_SPIN_ENV in os.environ else {WORKER_SPIN_ENV: str(CPU_WORKER_SPIN_S)}


# vLLM's switch between a worker inside the EngineCore (0) and a worker process of its own (1) on CPU.
WORKER_PROCESSES_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def _worker_in_engine_core(workers: tuple[tuple[int, ...], ...]) -> dict[str, str]:
    """An engine of one CPU worker runs it inside vLLM's EngineCore, as vLLM does on a GPU.

    vLLM's CPU platform otherwise gives every engine a worker process of its own
    (``platforms/cpu.py`` turns the ``uni`` executor into ``mp`` unless
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` is 0, for the OpenMP environment of an engine run in the
    caller's process; AsyncLLM always runs its EngineCore in a process of its own, which gets the
    engine's environment before it imports torch: forked from the engine process, see
    ``engine/cpu_platform.py``). That process imports torch and
    vLLM a third time and holds its own copy of them: measured on the demo model, one engine ready
    in 14.1 s and 14.4 CPU-s instead of 20.1 s and 19.6, 0.6 GiB less resident (docs: benchmarks-journal,
    "One worker inside the EngineCore"). ``OMP_NUM_THREADS`` is the worker's cores, as vLLM's
    worker process gets it: without it vLLM serves with one torch thread in the EngineCore.
    Engines of several workers keep vLLM's worker processes; the variables set in the front's
    environment are the operator's choice."""
    if len(workers) != 1 or WORKER_PROCESSES_ENV in os.environ:
        return {}
    threads = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(len(workers[0]))}
    return {WORKER_PROCESSES_ENV: "0", **threads}


def plan_engine_devices(
    kind: str, workers_per_engine: tuple[int, ...], cpu_kvcache_gib: int | None = 1
) -> list[EngineDevices]:
    """Split this machine's visible GPUs, or the cores this process may use, between the engines:
    ``workers_per_engine`` holds each engine's workers (``tp x pp``), in engine order."""
    if kind == "cuda":
        return split_gpus(_visible_gpus(), workers_per_engine)
    if kind == "cpu":
        return split_cores(sorted(os.sched_getaffinity(0)), workers_per_engine, cpu_kvcache_gib)
    raise LayoutError(f"unknown device kind {kind!r}; expected 'cuda' or 'cpu'")


def as_vllm_reads(arg: str) -> str:
    """An engine argument as vLLM's parser (``FlexibleArgumentParser``) reads its name: underscores in
    a ``--`` flag's name (up to its first ``.`` or ``=``) are dashes, so ``--weight_transfer_config``
    is ``--weight-transfer-config``."""
    if not arg.startswith("--"):
        return arg
    name, sep, rest = arg[2:].partition("=")
    head, dot, field = name.partition(".")
    return f"--{head.replace('_', '-')}{dot}{field}{sep}{rest}"


def given(flag: str, args: tuple[str, ...]) -> bool:
    """Whether ``args`` set ``flag`` as vLLM reads them: ``--flag value``, ``--flag=value``, a field of
    it (``--flag.field value``, for vLLM's JSON options), underscores for dashes."""
    return any(a == flag or a.startswith((flag + "=", flag + ".")) for a in map(as_vllm_reads, args))


def given_value(flags: tuple[str, ...], args: tuple[str, ...]) -> str | None:
    """The last value ``args`` give any of ``flags`` (``--flag value`` or ``--flag=value``, underscores
    for dashes), as vLLM's parser keeps it."""
    found = None
    args = tuple(map(as_vllm_reads, args))
    for i, arg in enumerate(args):
        for flag in flags:
            if arg == flag and i + 1 < len(args):
                found = args[i + 1]
            elif arg.startswith(flag + "="):
                found = arg.split("=", 1)[1]
    return found


def platform_engine_args(
    kind: str, user_args: tuple[str, ...], colocate: bool, gpu_memory_utilization: float, transfer_backend: str
) -> tuple[str, ...]:
    """vLLM arguments an engine needs on this kind of device, and colocated or not, unless the user gave them;
    ``transfer_backend``: the weight-transfer backend its transport receives with (``transfer.transport_for``)."""
    args: list[str] = []
    if kind == "cpu" and not given("--enforce-eager", user_args):
        # CPU has no graph capture worth its start-up cost for these engines.
        args.append("--enforce-eager")
    if kind == "cpu" and not given("--worker-cls", user_args):
        args += ["--worker-cls", CPU_WORKER_PATH]
    if kind == "cuda" and not given("--enable-sleep-mode", user_args):
        # /sleep frees GPU memory only with sleep mode on; vLLM rejects it on CPU.
        args.append("--enable-sleep-mode")
    if kind == "cuda" and colocate and not given("--gpu-memory-utilization", user_args):
        # The rest of each GPU is the trainer's while the engines are awake.
        args += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if not given("--enable-scale-out", user_args):
        # vLLM's app behind the engine serves its render and token routes only with it.
        args.append("--enable-scale-out")
    # Always skyinfer's own receiver (the configuration refuses the user's --weight-transfer-config).
    args += ["--weight-transfer-config", f'{{"backend": "{transfer_backend}"}}']
    return tuple(args)


# The host's memory as the kernel sees it: what a staging copy may take (the front sizes a staged
# push by it, a GPU worker places its copy by it), and giving back what a push freed.
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
