#!/usr/bin/env python
"""The CPU an engine of worker processes spends per request, and what it serves, by how long its
workers spin on their message queue after each message: skyinfer's CPU engines at each of
``--spins`` seconds, the same at vLLM's own 1 s, and ``vllm serve`` on the same model and arguments.

vLLM's CPU executor runs an engine's workers (tp, pp, dp: every engine of several workers) each in
a process of its own, reading the EngineCore's calls from a shared-memory queue; after each message
the reader spins on the queue (``sched_yield`` in a loop) before it sleeps on the queue's socket,
1 s in vLLM, ``SKYINFER_WORKER_SPIN_S`` in skyinfer (``skyinfer/engine/cpu_setup.py``). The servers
run side by side (an idle one's workers sleep), each on all the cores; in each round each server
in turn gets, on each of its data-parallel ranks:

- paced: ``--requests`` short greedy completions, one every ``--gap`` seconds, alternating ranks:
  the CPU-seconds its processes (front or API server, engine processes, EngineCores, workers)
  spent from the first request to ``--gap`` after the last, per request, and the median latency;
- back to back: one caller per rank, each sending its next completion as soon as the last is
  answered, for ``--seconds``: requests per second and CPU-seconds per request.

Medians over the rounds, and their ratios to ``vllm serve``'s.

    .venv/bin/python tools/bench_worker_spin.py --rounds 3
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from skyinfer.demo_model import build_demo_model
from skyinfer.engine_wire import WORKER_SPIN_ENV

from benchlib import (
    bench_parser,
    free_port,
    scratch_dir,
    start_reference,
    start_skyinfer,
    stop,
    tree_cpu_s,
    wait_servers,
    write_json,
)

DP = 2
ENGINE_ARGS = ["--data-parallel-size", str(DP), "--max-model-len", "512"]
KV_CACHE_BYTES = str(256 * 2**20)
RANK_HEADER = "X-data-parallel-rank"
VLLM_SPIN_S = "1"


def complete(http: httpx.Client, model: str, rank: int) -> None:
    """One short greedy completion, served by data-parallel rank ``rank``."""
    body = {"model": model, "prompt": f"Rank {rank} says the weather is", "max_tokens": 16, "temperature": 0}
    http.post("/v1/completions", json=body, headers={RANK_HEADER: str(rank)}).raise_for_status()


def paced(url: str, model: str, pid: int, requests: int, gap_s: float) -> tuple[float, float]:
    """CPU-seconds per request, median latency."""
    latencies = []
    before = tree_cpu_s(pid)
    with httpx.Client(base_url=url, timeout=120) as http:
        for i in range(requests):
            started = time.perf_counter()
            complete(http, model, i % DP)
            latencies.append(time.perf_counter() - started)
            time.sleep(gap_s)
    return (tree_cpu_s(pid) - before) / requests, statistics.median(latencies)


def back_to_back(url: str, model: str, pid: int, seconds: float) -> tuple[float, float]:
    """Requests per second, CPU-seconds per request."""
    answered = [0] * DP
    stop_at = time.monotonic() + seconds

    def caller(rank: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            while time.monotonic() < stop_at:
                complete(http, model, rank)
                answered[rank] += 1

    before, started = tree_cpu_s(pid), time.monotonic()
    callers = [threading.Thread(target=caller, args=(rank,)) for rank in range(DP)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    elapsed, cpu_s, done = time.monotonic() - started, tree_cpu_s(pid) - before, sum(answered)
    return done / elapsed, cpu_s / max(done, 1)


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--spins", type=float, nargs="+", default=[0.05, 0.005], help="skyinfer's spins to compare, s")
    p.add_argument("--requests", type=int, default=10, help="paced requests per server per round")
    p.add_argument("--gap", type=float, default=1.0, help="seconds between two paced requests")
    p.add_argument("--seconds", type=float, default=20, help="back-to-back load per server per round")
    args = p.parse_args()
    model = str(build_demo_model(scratch_dir("bench-spin-") / "demo"))
    env = {k: v for k, v in os.environ.items() if k != WORKER_SPIN_ENV}
    # The same arguments; skyinfer without spares (a spare would build an engine while it is measured).
    skyinfer_args = [*ENGINE_ARGS, "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--warm-spares", "0"]
    reference_args = [*ENGINE_ARGS, "--kv-cache-memory-bytes", KV_CACHE_BYTES]
    spins = [*(f"{spin:g}" for spin in args.spins), VLLM_SPIN_S]
    starts = {
        (f"skyinfer, spin {spin} s" if spin != VLLM_SPIN_S else "skyinfer, vLLM's 1 s spin"): (
            lambda port, spin=spin: start_skyinfer(
                model, port, skyinfer_args, {**env, WORKER_SPIN_ENV: spin}, log_name=f"bench-spin-{spin}.log"
            )
        )
        for spin in spins
    }
    starts["vllm serve"] = lambda port: start_reference(
        model, port, reference_args, env, log_name="bench-spin-vllm.log"
    )
    servers = {}
    for name, start in starts.items():
        port = free_port()
        servers[name] = (f"http://127.0.0.1:{port}", start(port))
    results = {name: {"paced": [], "latency": [], "rps": [], "loaded": []} for name in servers}
    try:
        asyncio.run(wait_servers([(url, proc) for url, proc in servers.values()]))
        time.sleep(5)  # every server idle before the first round
        for _ in range(args.rounds):
            for name, (url, proc) in servers.items():
                cpu_s, latency = paced(url, model, proc.pid, args.requests, args.gap)
                rps, loaded_cpu_s = back_to_back(url, model, proc.pid, args.seconds)
                time.sleep(2)  # the last spin over before the next server's turn
                for key, value in zip(results[name], (cpu_s, latency, rps, loaded_cpu_s), strict=True):
                    results[name][key].append(value)
    finally:
        for _, proc in servers.values():
            stop(proc)
    print(
        f"-dp {DP}, {args.rounds} alternating rounds; paced: {args.requests} requests, one every {args.gap} s; "
        f"back to back: one caller per rank for {args.seconds:g} s; medians, ratio to vllm serve's"
    )
    columns = (
        ("paced CPU-s/req", "paced", 3),
        ("latency s", "latency", 3),
        ("b2b req/s", "rps", 1),
        ("b2b CPU-s/req", "loaded", 3),
    )
    print(f"{'':26s}" + "".join(f" {title:>15s} {'ratio':>5s}" for title, _, _ in columns))
    reference = {key: statistics.median(values) for key, values in results["vllm serve"].items()}
    rows = []
    for name, measured in results.items():
        cells = ""
        row = {"server": name}
        for _, key, digits in columns:
            value = statistics.median(measured[key])
            cells += f" {value:15.{digits}f} {value / reference[key]:5.2f}"
            row |= {key: value, f"{key}_ratio": value / reference[key]}
        print(f"{name:26s}{cells}")
        rows.append(row | {"paced_rounds": measured["paced"], "rps_rounds": measured["rps"]})
    print("rounds (paced CPU-s/req; b2b req/s):")
    for name, measured in results.items():
        print(
            f"  {name:26s} "
            + " ".join(f"{c:.3f}" for c in measured["paced"])
            + "; "
            + " ".join(f"{r:.1f}" for r in measured["rps"])
        )
    write_json(args, rows)


if __name__ == "__main__":
    main()
