#!/usr/bin/env python
"""Router overhead: two skyinfer nodes reached through vllm-router, against the client picking the node itself.

Two ``skyinfer serve`` processes (one engine each, each on its own core, as
separate machines would be) serve the demo model. The same
``MultiNodeClient`` load runs twice per round, in alternating order: once
with ``router_url`` (every request goes through ``vllm-router --policy
consistent_hash``), once without (the client hashes ``X-Session-ID`` over the
nodes itself). Same sessions, prompts and token counts; the figure is the
throughput ratio router / direct and the latency percentiles.

    .venv/bin/python tools/bench_router.py --rounds 3
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from skyinfer.client import MultiNodeClient
from skyinfer.demo_model import build_demo_model

from benchlib import (
    bench_parser,
    free_port,
    scratch_dir,
    start_skyinfer,
    start_vllm_router,
    stop,
    wait_servers,
    write_json,
)


async def run_load(client: MultiNodeClient, args) -> dict:
    latencies: list[float] = []
    queue = list(range(args.requests))

    async def worker():
        while queue:
            i = queue.pop()
            started = time.perf_counter()
            out = await client.chat(
                [{"role": "user", "content": f"request {i}: tell me something"}],
                max_tokens=args.max_tokens,
                ignore_eos=True,
                session_id=f"session-{i % args.sessions}",
            )
            assert out["usage"]["completion_tokens"] == args.max_tokens
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "tokens_per_s": args.requests * args.max_tokens / elapsed,
        "p50": latencies[len(latencies) // 2],
        "p99": latencies[int(len(latencies) * 0.99) - 1],
    }


async def bench(node_urls: list[str], router_url: str, args) -> dict[str, list[dict]]:
    clients = {
        "direct": MultiNodeClient(node_urls, retries=0),
        "router": MultiNodeClient(node_urls, router_url=router_url, retries=0),
    }
    results: dict[str, list[dict]] = {name: [] for name in clients}
    for r in range(args.rounds):
        order = list(clients) if r % 2 == 0 else list(reversed(clients))
        for name in order:
            results[name].append(await run_load(clients[name], args))
            print(f"round {r} {name}: {results[name][-1]['tokens_per_s']:.0f} tok/s", file=sys.stderr)
    for client in clients.values():
        await client.aclose()
    return results


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model = str(build_demo_model(scratch_dir("bench-router-")))
    cores = sorted(os.sched_getaffinity(0))
    ports = [free_port() for _ in range(2)]
    node_urls = [f"http://127.0.0.1:{port}" for port in ports]
    nodes = [
        start_skyinfer(
            model,
            port,
            ["--max-model-len", "1024"],
            dict(os.environ),
            log_name=f"bench-router-node{k}.log",
            cores={cores[k % len(cores)]},
        )
        for k, port in enumerate(ports)
    ]
    router, router_url = start_vllm_router(node_urls, "bench-router.log")
    try:
        asyncio.run(wait_servers(list(zip(node_urls, nodes))))
        asyncio.run(wait_servers([(router_url, router)], path="/v1/models"))
        results = asyncio.run(bench(node_urls, router_url, args))
    finally:
        for proc in [router, *nodes]:
            stop(proc)

    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    print(
        f"{args.requests} chat requests x {args.max_tokens} tokens, {args.concurrency} concurrent, "
        f"{args.sessions} sessions, 2 nodes; median of {args.rounds} rounds"
    )
    print(f"{'':10s} {'tok/s':>8s} {'p50 s':>8s} {'p99 s':>8s}")
    for name, m in med.items():
        print(f"{name:10s} {m['tokens_per_s']:8.0f} {m['p50']:8.3f} {m['p99']:8.3f}")
    ratio = med["router"]["tokens_per_s"] / med["direct"]["tokens_per_s"]
    print(f"throughput ratio router / direct: {ratio:.3f}")
    write_json(args, [{"target": name, **m} for name, m in med.items()], ratio=ratio)


if __name__ == "__main__":
    main()
