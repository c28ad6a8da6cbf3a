#!/usr/bin/env python
"""How long a fleet takes to come back when every engine process is killed at rest, for the code of
a checkout (default: this one), so that a change is measured against the code before it on the
same machine.

Two engines serve the demo model (float32). Each round SIGKILLs both engine processes' groups at
rest, then sends one completion every 0.5 s, each allowed to wait up to 300 s, until one is
answered 200, and times from the kill: the fleet ready for a push (``GET /ready`` 200: every engine
up again), the first request answered 200, and how many were refused meanwhile (503).

``--warm-vs-cold`` compares restarts that a warm spare takes over (``--warm-spares 1``, the default)
with cold ones (``--warm-spares 0``): two one-engine servers, one of each, each round killing one
engine's EngineCore (the engine process exits when it sees it die) and then its whole process group,
on each server in turn (the order alternates by round, so that the machine's drift falls on both),
timing from the kill: the engine ready again (``GET /ready`` 200) and the first answer to a
completion sent at the kill (held meanwhile). The warm server's next kill waits until a new spare
stands by. Prints each restart, the medians, and what a spare's start costs (CPU seconds, memory).

    .venv/bin/python tools/bench_recovery.py --rounds 3
    git worktree add /tmp/before HEAD~1 && .venv/bin/python tools/bench_recovery.py --checkout /tmp/before
    .venv/bin/python tools/bench_recovery.py --warm-vs-cold --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from skyinfer.demo_model import build_demo_model

from benchlib import bench_parser, free_port, start_skyinfer, stop, wait_healthy, write_json


async def one_round(session: aiohttp.ClientSession, url: str, model: str) -> dict:
    async with session.get(f"{url}/engines") as r:
        pids = [e["pid"] for e in (await r.json())["engines"]]
    for pid in pids:
        os.killpg(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    # Down: the front has seen both deaths (their requests would find no engine).
    while True:
        async with session.get(f"{url}/engines") as r:
            if not any(e["state"] == "ready" for e in (await r.json())["engines"]):
                break
        await asyncio.sleep(0.02)
    refused = 0
    ready_at = None

    async def ready() -> None:
        nonlocal ready_at
        while True:
            async with session.get(f"{url}/ready") as r:
                if r.status == 200:
                    ready_at = time.monotonic()
                    return
            await asyncio.sleep(0.1)

    async def status() -> int:
        async with session.post(
            f"{url}/v1/completions", json={"model": model, "prompt": "back?", "max_tokens": 4}
        ) as r:
            return r.status

    readiness = asyncio.create_task(ready())
    pending: set[asyncio.Task] = set()
    served_at = None
    while served_at is None:
        pending.add(asyncio.create_task(status()))
        await asyncio.sleep(0.5)
        for task in [t for t in pending if t.done()]:
            pending.discard(task)
            if task.result() == 200:
                served_at = served_at or time.monotonic()
            else:
                refused += 1
    for task in pending:
        task.cancel()
    await readiness
    return {"ready": ready_at - killed_at, "served": served_at - killed_at, "refused": refused}


async def _engine(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/engines") as r:
        return (await r.json())["engines"][0]


async def _spare_waiting(session: aiohttp.ClientSession, url: str, front_pid: int, timeout_s: float = 600) -> int:
    """The pid of the engine's spare (a child of the front's) once it stands by."""
    deadline = time.monotonic() + timeout_s
    while (engine := await _engine(session, url))["spare"] != "waiting":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}: no spare stands by after {timeout_s:.0f}s")
        await asyncio.sleep(0.5)
    # An engine that was a spare keeps --standby in its command line.
    children = psutil.Process(front_pid).children()
    (spare,) = [p for p in children if "--standby" in p.cmdline() and p.pid != engine["pid"]]
    return spare.pid


async def restart_once(session: aiohttp.ClientSession, url: str, model: str, kind: str) -> dict:
    """Kill the one engine's EngineCore (``kind`` "enginecore") or its process group ("process");
    time it ready again, and the first answer to a completion sent at the kill."""
    engine = await _engine(session, url)
    pid = engine["pid"]
    if kind == "process":
        os.killpg(pid, signal.SIGKILL)
    else:
        (core,) = [p for p in psutil.Process(pid).children(recursive=True) if "EngineCore" in " ".join(p.cmdline())]
        core.kill()
    killed_at = time.monotonic()

    async def answered() -> float:
        body = {"model": model, "prompt": "back?", "max_tokens": 4}
        async with session.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
        return time.monotonic() - killed_at

    while (await _engine(session, url))["pid"] == pid:
        await asyncio.sleep(0.02)
    first_answer = asyncio.create_task(answered())
    while True:
        async with session.get(f"{url}/ready") as r:
            if r.status == 200:
                ready = time.monotonic() - killed_at
                break
        await asyncio.sleep(0.1)
    new_pid = (await _engine(session, url))["pid"]
    return {"ready": ready, "served": await first_answer, "pid": new_pid}


async def warm_vs_cold(model: str, rounds: int, env: dict, args: argparse.Namespace) -> None:
    # Held requests wait for a cold restart on a busy machine too; each kill is a first crash (the
    # engine stayed up over a second since the last), restarted after the same 1 s backoff.
    engine_args = ["--dtype", "float32", "--health-interval", "1", "--health-timeout", "4", "--hold-requests", "300"]
    engine_args += ["--restart-window", "1", "--max-restarts", "1000"]
    modes = {"warm": [], "cold": ["--warm-spares", "0"]}
    urls, servers = {}, {}
    for mode, more in modes.items():
        port = free_port()
        urls[mode] = f"http://127.0.0.1:{port}"
        servers[mode] = start_skyinfer(
            model, port, [*engine_args, *more], env, engines=1, log_name=f"bench-recovery-{mode}.log"
        )
    times: dict[tuple[str, str], list[dict]] = {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            for mode in modes:
                await wait_healthy(session, urls[mode], servers[mode], timeout_s=600, path="/ready")
            spare = psutil.Process(await _spare_waiting(session, urls["warm"], servers["warm"].pid))
            cpu, memory = spare.cpu_times(), spare.memory_full_info()
            spare_figures = {
                "start_cpu_s": cpu.user + cpu.system,
                "rss_mib": memory.rss / 2**20,
                "uss_mib": memory.uss / 2**20,
            }
            print(
                f"a spare's start: {cpu.user + cpu.system:.1f} CPU-s; standing by it holds {memory.rss / 2**20:.0f} "
                f"MiB resident, {memory.uss / 2**20:.0f} MiB of it its own (USS)",
                flush=True,
            )
            for i in range(rounds):
                order = ("warm", "cold") if i % 2 == 0 else ("cold", "warm")
                for kind in ("enginecore", "process"):
                    for mode in order:
                        spare_pid = None
                        if mode == "warm":
                            spare_pid = await _spare_waiting(session, urls[mode], servers[mode].pid)
                        result = await restart_once(session, urls[mode], model, kind)
                        if spare_pid is not None:
                            assert result["pid"] == spare_pid, f"the spare {spare_pid} did not take over"
                        times.setdefault((kind, mode), []).append(result)
                        print(
                            f"round {i + 1}, {kind} killed, {mode}: ready {result['ready']:.1f}s, "
                            f"first answer {result['served']:.1f}s",
                            flush=True,
                        )
    finally:
        for server in servers.values():
            stop(server)
    rows = []
    for kind in ("enginecore", "process"):
        warm = statistics.median(r["ready"] for r in times[(kind, "warm")])
        cold = statistics.median(r["ready"] for r in times[(kind, "cold")])
        print(
            f"{kind} SIGKILLed, kill -> ready, median of {rounds}: cold {cold:.1f}s, warm {warm:.1f}s "
            f"(cold/warm {cold / warm:.2f}, {cold - warm:.1f}s saved)"
        )
        ranges = {
            f"{mode}_range": [
                min(r["ready"] for r in times[(kind, mode)]),
                max(r["ready"] for r in times[(kind, mode)]),
            ]
            for mode in ("cold", "warm")
        }
        rows.append(
            {"kill": kind, "cold_s": cold, "warm_s": warm, **ranges, "saved_s": cold - warm, "cold_x_warm": cold / warm}
        )
    write_json(args, rows, spare=spare_figures)


async def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--checkout", default=str(Path(__file__).resolve().parent.parent), help="the code to run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--warm-vs-cold", action="store_true", help="restarts a warm spare takes over against cold ones (one engine)"
    )
    args = p.parse_args()
    model = str(build_demo_model(Path(tempfile.gettempdir()) / "skyinfer-bench-demo-model"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    checkout = str(Path(args.checkout).resolve())
    env = {**os.environ, "PYTHONPATH": checkout}
    # The checkout's skyinfer: the server is started in it, and its engines inherit the path.
    os.chdir(checkout)
    if args.warm_vs_cold:
        await warm_vs_cold(model, args.rounds, env, args)
        return
    engine_args = ["--dtype", "float32", "--health-interval", "1", "--health-timeout", "4"]
    server = start_skyinfer(model, port, engine_args, env, engines=2, log_name="bench-recovery.log")
    rounds = []
    try:
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await wait_healthy(session, url, server, timeout_s=600, path="/ready")
            for i in range(args.rounds):
                result = await one_round(session, url, model)
                rounds.append(result)
                print(
                    f"round {i + 1}: ready for a push {result['ready']:.1f}s, first answer {result['served']:.1f}s, "
                    f"{result['refused']} refused meanwhile",
                    flush=True,
                )
                await wait_healthy(session, url, server, timeout_s=600, path="/ready")
    finally:
        stop(server)
    print(
        f"{checkout}: both engine processes SIGKILLed at rest, median of {len(rounds)}: ready for a push "
        f"{statistics.median(r['ready'] for r in rounds):.1f}s, first answer "
        f"{statistics.median(r['served'] for r in rounds):.1f}s, refused {statistics.median(r['refused'] for r in rounds):g}"
    )
    medians = {
        f"{key}_s" if key != "refused" else key: statistics.median(r[key] for r in rounds)
        for key in ("ready", "served", "refused")
    }
    write_json(args, [{"checkout": checkout, **medians, "rounds": rounds}])


if __name__ == "__main__":
    asyncio.run(main())
