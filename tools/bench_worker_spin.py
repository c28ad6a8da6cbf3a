#!/usr/bin/env python
"""The CPU an engine spends on requests that come one at a time, a pause between them: skyinfer's
CPU engine (its workers spin 50 ms on their message queue after each message), the same with
``SKYINFER_WORKER_SPIN_S=1`` (vLLM's own spin), and ``vllm serve`` on the same model and arguments.

vLLM's CPU executor runs each worker in a process of its own, reading the EngineCore's calls from a
shared-memory queue, and after each message it reads the worker spins on the queue for a second
before it sleeps (``skyinfer/engine/cpu_setup.py``). One engine of the demo model each, the three
servers up side by side; in each round each server in turn gets ``--requests`` short greedy
completions, one every ``--gap`` seconds. Per server: the CPU-seconds its processes (the front or
API server, the engine, its EngineCore and worker) spent from the first request to ``--gap`` after
the last, per request, and the median latency; the ratios to ``vllm serve``.

    .venv/bin/python tools/bench_worker_spin.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from skyinfer.demo_model import build_demo_model
from skyinfer.engine_wire import WORKER_SPIN_ENV

from benchlib import free_port, scratch_dir, start_reference, start_skyinfer, stop, tree_cpu_s, wait_servers

ENGINE_ARGS = ["--cpu-kvcache-gib", "1", "--max-model-len", "512"]


def one_server(url: str, model: str, pid: int, requests: int, gap_s: float) -> tuple[float, float]:
    """CPU-seconds per request, median latency."""
    body = {"model": model, "prompt": "The weather today is", "max_tokens": 16, "temperature": 0}
    latencies = []
    before = tree_cpu_s(pid)
    with httpx.Client(base_url=url, timeout=120) as http:
        for _ in range(requests):
            started = time.perf_counter()
            http.post("/v1/completions", json=body).raise_for_status()
            latencies.append(time.perf_counter() - started)
            time.sleep(gap_s)
    return (tree_cpu_s(pid) - before) / requests, statistics.median(latencies)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=10, help="requests per server per round")
    p.add_argument("--gap", type=float, default=1.5, help="seconds between two requests")
    args = p.parse_args()
    model = str(build_demo_model(scratch_dir("bench-spin-") / "demo"))
    env = {k: v for k, v in os.environ.items() if k != WORKER_SPIN_ENV}
    # The same arguments; skyinfer without spares (a spare would build an engine while it is measured).
    skyinfer_args = [*ENGINE_ARGS, "--warm-spares", "0"]
    reference_env = {**env, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    servers = {}
    for name, start in (
        ("skyinfer", lambda port: start_skyinfer(model, port, skyinfer_args, env, log_name="bench-spin-sky.log", cores={0})),
        ("skyinfer, vLLM's spin", lambda port: start_skyinfer(
            model, port, skyinfer_args, {**env, WORKER_SPIN_ENV: "1"}, log_name="bench-spin-sky1.log", cores={0})),
        ("vllm serve", lambda port: start_reference(
            model, port, ["--max-model-len", "512"], reference_env, log_name="bench-spin-vllm.log", cores={1})),
    ):  # fmt: skip
        port = free_port()
        servers[name] = (f"http://127.0.0.1:{port}", start(port))
    results = {name: ([], []) for name in servers}
    try:
        asyncio.run(wait_servers([(url, proc) for url, proc in servers.values()]))
        time.sleep(5)  # every server idle before the first round
        for _ in range(args.rounds):
            for name, (url, proc) in servers.items():
                cpu_s, latency = one_server(url, model, proc.pid, args.requests, args.gap)
                results[name][0].append(cpu_s)
                results[name][1].append(latency)
    finally:
        for _, proc in servers.values():
            stop(proc)
    print(f"{args.rounds} alternating rounds of {args.requests} requests, one every {args.gap} s; medians")
    print(f"{'':24s} {'CPU-s/request':>14s} {'ratio':>6s} {'latency s':>10s} {'ratio':>6s}   CPU-s/request each round")
    ref_cpu, ref_latency = (statistics.median(values) for values in results["vllm serve"])
    for name, (cpu, latency) in results.items():
        c, lat = statistics.median(cpu), statistics.median(latency)
        rounds = " ".join(f"{x:.3f}" for x in cpu)
        print(f"{name:24s} {c:14.3f} {c / ref_cpu:6.2f} {lat:10.3f} {lat / ref_latency:6.2f}   {rounds}")


if __name__ == "__main__":
    main()
