#!/usr/bin/env python
"""What engine templates save (``--engine-templates``): a server of two CPU engines of the demo
model started with templates (``auto``, the default: the engines fork from a process that imported
torch and vLLM once) and without (``off``: each engine imports them itself), in turn, ``--rounds``
times, one server at a time on the same two cores, without warm spares (a spare would take the
restart below).

Per server: the seconds from its start until ``/ready`` and the CPU-seconds its processes spent by
then; then engine 0's process SIGKILLed: the seconds until another process serves it, and the
CPU-seconds that process (and vLLM's beneath it) spent by then. Medians over the rounds, and the
ratio of templates to cold starts.

    .venv/bin/python tools/bench_templates.py --rounds 3
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from skyinfer.demo_model import build_demo_model

from benchlib import bench_parser, free_port, scratch_dir, start_skyinfer, stop, tree_cpu_s, wait_servers, write_json

ENGINE_ARGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(128 * 2**20), "--warm-spares", "0"]


def one_server(model: str, templates: str, cores: set[int]) -> tuple[float, float, float, float]:
    """Seconds to ready and CPU-s by then; seconds from engine 0's SIGKILL until another process
    serves it, and that process's CPU-s by then."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    proc = start_skyinfer(
        model,
        port,
        [*ENGINE_ARGS, "--engine-templates", templates],
        dict(os.environ),
        engines=2,
        log_name=f"bench-templates-{templates}.log",
        cores=cores,
    )
    try:
        asyncio.run(wait_servers([(url, proc)], path="/ready"))
        ready_s, cpu_s = time.monotonic() - started, tree_cpu_s(proc.pid)
        with httpx.Client(base_url=url, timeout=30) as http:
            victim = http.get("/engines").json()["engines"][0]["pid"]
            os.kill(victim, signal.SIGKILL)
            killed = time.monotonic()
            while True:
                engine = http.get("/engines").json()["engines"][0]
                if engine["state"] == "ready" and engine["pid"] != victim:
                    break
                time.sleep(0.05)
            back_s = time.monotonic() - killed
        return ready_s, cpu_s, back_s, tree_cpu_s(engine["pid"])
    finally:
        stop(proc)


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model = str(build_demo_model(scratch_dir("bench-templates-") / "demo"))
    cores = set(sorted(os.sched_getaffinity(0))[:2])
    results: dict[str, list[tuple[float, float, float, float]]] = {"auto": [], "off": []}
    for _ in range(args.rounds):
        for templates in results:
            results[templates].append(one_server(model, templates, cores))
            time.sleep(2)  # its processes gone before the next starts
    print(f"{args.rounds} alternating rounds, two engines of the demo model on cores {sorted(cores)}; medians")
    header = ("ready s", "CPU-s", "restart s", "CPU-s")
    print(f"{'--engine-templates':20s}" + " ".join(f"{h:>10s}" for h in header) + "   ready s, restart s each round")
    medians = {
        name: [statistics.median(column) for column in zip(*rounds, strict=True)] for name, rounds in results.items()
    }
    for name, rounds in results.items():
        each = " ".join(f"{r[0]:.1f}/{r[2]:.1f}" for r in rounds)
        print(f"{name:20s}" + " ".join(f"{value:10.2f}" for value in medians[name]) + "   " + each)
    ratios = [on / off for on, off in zip(medians["auto"], medians["off"], strict=True)]
    print(f"{'ratio auto/off':20s}" + " ".join(f"{value:10.2f}" for value in ratios))
    keys = ("ready_s", "ready_cpu_s", "restart_s", "restart_cpu_s")
    rows = [
        {"engine_templates": name, **dict(zip(keys, medians[name])), "rounds": [[r[0], r[2]] for r in results[name]]}
        for name in results
    ]
    write_json(args, [*rows, {"engine_templates": "ratio auto/off", **dict(zip(keys, ratios))}])


if __name__ == "__main__":
    main()
