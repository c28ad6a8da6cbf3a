#!/usr/bin/env python
"""What one CPU engine costs to start, and to serve a few requests: skyinfer's engine of one worker
(the worker inside vLLM's EngineCore, which is forked), the same with its EngineCore spawned
(``VLLM_WORKER_MULTIPROC_METHOD=spawn``), the same with vLLM's worker process
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``), and ``vllm serve`` on the same model and arguments.
With ``--parallel tp`` or ``dp``, an engine of two workers (``-tp 2``, ``-dp 2``) on two cores:
skyinfer's (every vLLM process forked), the same with them spawned, and ``vllm serve``.

One server at a time on the same cores (each alone on the machine), in turn, ``--rounds`` times.
Per server: the seconds from its start until it answers (skyinfer's ``/ready``, ``vllm serve``'s
``/health``), the CPU-seconds its processes spent by then (the front or API server, the engine, its
EngineCore, its worker), their resident memory then, and the median latency of ``--requests`` short
greedy completions after; medians over the rounds and the ratios to ``vllm serve``.

    .venv/bin/python tools/bench_engine_start.py --rounds 3
    .venv/bin/python tools/bench_engine_start.py --rounds 3 --parallel dp
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from skyinfer.demo_model import build_demo_model
from skyinfer.devices import WORKER_PROCESSES_ENV, split_cores
from skyinfer.engine.cpu_platform import START_METHOD_ENV

from benchlib import (
    bench_parser,
    free_port,
    scratch_dir,
    start_reference,
    start_skyinfer,
    stop,
    tree_cpu_s,
    tree_processes,
    wait_servers,
    write_json,
)

ENGINE_ARGS = ["--cpu-kvcache-gib", "1", "--max-model-len", "512"]


def latency_s(url: str, model: str, requests: int) -> float:
    body = {"model": model, "prompt": "The weather today is", "max_tokens": 16, "temperature": 0}
    latencies = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for _ in range(requests):
            started = time.perf_counter()
            http.post("/v1/completions", json=body).raise_for_status()
            latencies.append(time.perf_counter() - started)
    return statistics.median(latencies)


def one_start(start, ready_path: str, model: str, requests: int) -> tuple[float, float, float, float]:
    """Seconds to ready, CPU-seconds by then, resident MiB then, median latency after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    proc = start(port)
    try:
        asyncio.run(wait_servers([(url, proc)], path=ready_path))
        ready_s = time.monotonic() - started
        cpu_s = tree_cpu_s(proc.pid)
        rss_mib = sum(rss for _, rss in tree_processes(proc.pid).values())
        return ready_s, cpu_s, rss_mib, latency_s(url, model, requests)
    finally:
        stop(proc)


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=10, help="completions per server per round, after it is ready")
    p.add_argument("--parallel", choices=("tp", "dp"), help="an engine of two workers: -tp 2 or -dp 2")
    args = p.parse_args()
    model = str(build_demo_model(scratch_dir("bench-start-") / "demo"))
    cores = set(sorted(os.sched_getaffinity(0))[:2])
    env = {k: v for k, v in os.environ.items() if k not in (WORKER_PROCESSES_ENV, START_METHOD_ENV)}
    # vLLM's server gets the cores and CPU settings skyinfer gives its engine, and vLLM's own layout.
    parallel = [f"-{args.parallel}", "2"] if args.parallel else []
    engine_env = split_cores(sorted(cores), (2 if parallel else 1,), cpu_kvcache_gib=1)[0].env
    reference_env = {**env, **{k: v for k, v in engine_env.items() if k != WORKER_PROCESSES_ENV}}
    sky_args = [*ENGINE_ARGS, *parallel, "--warm-spares", "0"]  # a spare would start while the engine is measured

    def skyinfer(more_env: dict[str, str], log_name: str):
        return (
            lambda port: start_skyinfer(model, port, sky_args, {**env, **more_env}, log_name=log_name, cores=cores),
            "/ready",
        )

    servers = {"skyinfer": skyinfer({}, "bench-start-sky.log")}
    if parallel:
        servers["skyinfer, processes spawned"] = skyinfer({START_METHOD_ENV: "spawn"}, "bench-start-sky-spawn.log")
    else:
        servers["skyinfer, EngineCore spawn"] = skyinfer({START_METHOD_ENV: "spawn"}, "bench-start-sky-spawn.log")
        servers["skyinfer, worker process"] = skyinfer({WORKER_PROCESSES_ENV: "1"}, "bench-start-sky-mp.log")
    servers["vllm serve"] = (
        lambda port: start_reference(
            model,
            port,
            ["--max-model-len", "512", *parallel],
            reference_env,
            log_name="bench-start-vllm.log",
            cores=cores,
        ),
        "/health",
    )
    results: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in servers}
    for _ in range(args.rounds):
        for name, (start, ready_path) in servers.items():
            results[name].append(one_start(start, ready_path, model, args.requests))
            time.sleep(2)  # its processes gone before the next starts
    print(f"{args.rounds} alternating rounds, one server at a time on cores {sorted(cores)}; medians")
    header = ("ready s", "ratio", "CPU-s", "ratio", "RSS MiB", "ratio", "latency s", "ratio")
    print(f"{'':26s}" + " ".join(f"{h:>9s}" for h in header) + "   ready s each round")
    reference = [statistics.median(column) for column in zip(*results["vllm serve"], strict=True)]
    rows = []
    for name, rounds in results.items():
        medians = [statistics.median(column) for column in zip(*rounds, strict=True)]
        cells = [f"{value:9.3f} {value / ref:9.2f}" for value, ref in zip(medians, reference, strict=True)]
        print(f"{name:26s}" + " ".join(cells) + "   " + " ".join(f"{r[0]:.1f}" for r in rounds))
        row = {"server": name}
        for key, value, ref in zip(("ready_s", "cpu_s", "rss_mib", "latency_s"), medians, reference, strict=True):
            row |= {key: value, f"{key}_ratio": value / ref}
        rows.append(row | {"ready_s_rounds": [r[0] for r in rounds]})
    write_json(args, rows)


if __name__ == "__main__":
    main()
