#!/usr/bin/env python
"""Pause (keep) and resume latency with 64 requests in flight over two engines.

skyinfer runs two engines (one per core) and is paused with one call. The
reference is what a user does without it: two `vllm serve` processes (same
model, engine arguments and cores, ``VLLM_SERVER_DEV_MODE=1`` for their
``/pause``), each called concurrently by the client. Each cycle: pause
(keep), hold 0.2 s, resume, run 0.2 s. The requests are long enough
(``ignore_eos``) to stay in flight through every cycle; that is checked.

    .venv/bin/python tools/bench_pause.py --cycles 20

prints median and p90 latency of each call for both, and skyinfer / vLLM ratios.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from skyinfer.demo_model import build_demo_model

from benchlib import (
    bench_parser,
    free_port,
    scratch_dir,
    start_reference,
    start_skyinfer,
    stop,
    wait_healthy,
    write_json,
)


async def call_all(session: aiohttp.ClientSession, urls: list[str], path: str, body: dict | None = None) -> float:
    started = time.perf_counter()

    async def one(url: str) -> None:
        async with session.post(f"{url}{path}", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"{url}{path}: {r.status} {await r.text()}")

    await asyncio.gather(*(one(u) for u in urls))
    return time.perf_counter() - started


async def measure(session, urls: list[str], model: str, args) -> dict[str, list[float]]:
    """Cycle pause/resume while ``args.in_flight`` requests run, spread over ``urls``."""

    async def request(url: str, i: int) -> str:
        body = {"model": model, "prompt": f"in flight {i}", "max_tokens": args.max_tokens, "ignore_eos": True}
        async with session.post(f"{url}/v1/completions", json=body) as r:
            return (await r.json())["choices"][0]["finish_reason"]

    # Admitted while paused, so that all are in flight before the first cycle.
    await call_all(session, urls, "/pause?mode=keep")
    tasks = [asyncio.create_task(request(urls[i % len(urls)], i)) for i in range(args.in_flight)]
    await asyncio.sleep(1.0)
    await call_all(session, urls, "/resume")
    pauses, resumes = [], []
    for _ in range(args.cycles):
        await asyncio.sleep(0.2)
        pauses.append(await call_all(session, urls, "/pause?mode=keep"))
        await asyncio.sleep(0.2)
        resumes.append(await call_all(session, urls, "/resume"))
    finished_early = sum(t.done() for t in tasks)
    await call_all(session, urls, "/abort_requests", {"request_ids": []})  # vLLM's wants a body
    await asyncio.gather(*tasks, return_exceptions=True)
    if finished_early:
        raise RuntimeError(f"{finished_early} requests finished before the last cycle; raise --max-tokens")
    return {"pause": pauses, "resume": resumes}


def summary(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return 1000 * statistics.median(ordered), 1000 * ordered[int(0.9 * (len(ordered) - 1))]


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--model", help="model directory (default: a freshly built demo model)")
    p.add_argument("--in-flight", type=int, default=64)
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=4000)
    args = p.parse_args()
    model = args.model or str(build_demo_model(scratch_dir("bench-model-")))
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("needs two cores: one engine on each")

    procs = []
    sky_url = f"http://127.0.0.1:{free_port()}"
    procs.append(start_skyinfer(model, int(sky_url.rsplit(":", 1)[1]), [], dict(os.environ), engines=2))
    ref_urls = []
    for i, core in enumerate(cores[:2]):
        port = free_port()
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "VLLM_CPU_KVCACHE_SPACE": "1",
        }
        procs.append(start_reference(model, port, [], env, log_name=f"bench-vllm-serve-{i}.log"))
        ref_urls.append(f"http://127.0.0.1:{port}")

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            for url, proc in zip([sky_url, *ref_urls], procs):
                await wait_healthy(session, url, proc)
            ref = await measure(session, ref_urls, model, args)
            sky = await measure(session, [sky_url], model, args)
            return ref, sky

    try:
        ref, sky = asyncio.run(run())
    finally:
        for proc in procs:
            stop(proc)
    print(f"{args.in_flight} requests in flight over 2 engines, {args.cycles} cycles")
    print(f"{'call':8s} {'':4s} {'2x vllm serve':>14s} {'skyinfer':>10s} {'ratio':>7s}")
    rows = []
    for call in ("pause", "resume"):
        (ref_p50, ref_p90), (sky_p50, sky_p90) = summary(ref[call]), summary(sky[call])
        print(f"{call:8s} p50  {ref_p50:11.1f} ms {sky_p50:7.1f} ms {sky_p50 / ref_p50:7.2f}")
        print(f"{call:8s} p90  {ref_p90:11.1f} ms {sky_p90:7.1f} ms {sky_p90 / ref_p90:7.2f}")
        rows.append({"call": call, "vllm_p50_ms": ref_p50, "vllm_p90_ms": ref_p90,
                     "skyinfer_p50_ms": sky_p50, "skyinfer_p90_ms": sky_p90})  # fmt: skip
    write_json(args, rows)


if __name__ == "__main__":
    main()
