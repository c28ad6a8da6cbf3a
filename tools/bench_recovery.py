#!/usr/bin/env python
"""How long a fleet takes to come back when every engine process is killed at rest, for the code of
a checkout (default: this one), so that a change is measured against the code before it on the
same machine.

Two engines serve the demo model (float32). Each round SIGKILLs both engine processes' groups at
rest, then sends one completion every 0.5 s, each allowed to wait up to 300 s, until one is
answered 200, and times from the kill: the fleet ready for a push (``GET /ready`` 200: every engine
up again), the first request answered 200, and how many were refused meanwhile (503).

    .venv/bin/python tools/bench_recovery.py --rounds 3
    git worktree add /tmp/before HEAD~1 && .venv/bin/python tools/bench_recovery.py --checkout /tmp/before
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from skyinfer.demo_model import build_demo_model

from benchlib import free_port, start_skyinfer, stop, wait_healthy


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


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkout", default=str(Path(__file__).resolve().parent.parent), help="the code to run")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model = str(build_demo_model(Path(tempfile.gettempdir()) / "skyinfer-bench-demo-model"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    checkout = str(Path(args.checkout).resolve())
    env = {**os.environ, "PYTHONPATH": checkout}
    # The checkout's skyinfer: the server is started in it, and its engines inherit the path.
    os.chdir(checkout)
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


if __name__ == "__main__":
    asyncio.run(main())
