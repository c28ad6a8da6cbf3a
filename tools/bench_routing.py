#!/usr/bin/env python
"""Routing policies under an agentic RL workload on two engines: skyinfer's, plain
least-loaded, and vllm-router's consistent hashing in front of two `vllm serve`.

Three set-ups, one after another, each on the same model, one core and the same
KV cache per engine:

- skyinfer: its defaults (sticky sessions by X-Session-ID with load-aware moves,
  group affinity for session-less requests with a common prompt start);
- least-loaded: skyinfer with ``--group-prefix-chars 0`` and no session ids sent;
- vllm-router: ``vllm-router --policy consistent_hash`` (session id in
  X-Session-ID) in front of two ``vllm serve``, one per core.

The workload is the same seeded list of trajectories for each: multi-turn chat
sessions (an agent's trajectory: each turn sends the conversation so far, a long
system prompt that every trajectory shares, the earlier turns, a new user message
of ``--turn-words``, about 350 tokens, as a tool's output is) with long-tailed
turn counts (most 2-3 turns, a few 12-16), and GRPO groups (8 samples of one
prompt, a problem of ``--group-words``, sent at once as separate requests, no
session, each with its own ``seed`` as TRL's async GRPO client sends;
vllm-router's consistent hashing, finding no session key, hashes an empty key:
every session-less request goes to one engine).
``--concurrency`` trajectories run at a time. Each engine gets ``--kv-blocks``
KV-cache blocks (128 tokens each on CPU; about what the running trajectories
need), so that cached prefixes compete for room as they do on a GPU under RL
load: with the CPU default (millions of tokens) every prefix stays cached on
every engine and no policy can miss. The model is built like the demo model but
``--model-width`` wide and ``--model-layers`` deep (default 512 x 8, 19M
parameters): on the 2-layer, 128-wide demo model a prompt token costs next to
nothing beside a decode step, so prefix hits could not show in throughput.
Measured per set-up: output tokens per second over the whole run, p50/p99
trajectory latency (a session: first send to last answer; a group: send to its
last sample), the prefix-cache hit rate over the run from vLLM's own counters
(``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``, summed over both
engines), the busiest engine's share of the requests, and skyinfer's session moves.

    .venv/bin/python tools/bench_routing.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from skyinfer.demo_model import build_demo_model

from benchlib import (
    bench_parser,
    free_port,
    scratch_dir,
    start_reference,
    start_skyinfer,
    start_vllm_router,
    stop,
    wait_servers,
    write_json,
)

GROUP_SIZE = 8
WORDS = ["tool", "call", "result", "file", "test", "patch", "error", "plan", "step", "search", "read", "write"]


def text(rng: random.Random, words: int) -> str:
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(words))


def workload(args) -> list[dict]:
    """Trajectories, shuffled: sessions with long-tailed turn counts, and GRPO groups."""
    rng = random.Random(args.seed)
    system = {"role": "system", "content": text(rng, args.system_words)}
    trajectories = []
    for i in range(args.sessions):
        kind = rng.random()
        turns = rng.randint(2, 3) if kind < 0.7 else rng.randint(4, 8) if kind < 0.9 else rng.randint(12, 16)
        users = [text(rng, args.turn_words) for _ in range(turns)]
        # The environment's step (a tool run, a test suite) between one answer and the next turn.
        tools = [rng.expovariate(1 / args.tool_seconds) if args.tool_seconds else 0.0 for _ in range(turns - 1)]
        trajectories.append({"kind": "session", "id": f"traj-{i}", "system": system, "users": users, "tools": tools})
    for i in range(args.groups):
        question = f"Problem {i}: " + text(rng, args.group_words)
        trajectories.append({"kind": "group", "id": f"group-{i}", "system": system, "question": question})
    rng.shuffle(trajectories)
    return trajectories


class Client:
    def __init__(self, http: aiohttp.ClientSession, url: str, model: str, args, send_sessions: bool):
        self.http, self.url, self.model, self.args = http, url, model, args
        self.send_sessions = send_sessions
        self.tokens = 0

    async def chat(self, messages: list[dict], session: str | None, seed: int | None = None) -> str:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.args.max_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
            **({} if seed is None else {"seed": seed}),
        }
        headers = {"Content-Type": "application/json"}
        if session and self.send_sessions:
            headers["X-Session-ID"] = session
        async with self.http.post(f"{self.url}/v1/chat/completions", data=orjson.dumps(body), headers=headers) as r:
            answer = await r.read()
            if r.status != 200:
                raise RuntimeError(f"{r.status}: {answer[:300]!r}")
        payload = orjson.loads(answer)
        self.tokens += payload["usage"]["completion_tokens"]
        return payload["choices"][0]["message"]["content"]

    async def run(self, trajectory: dict) -> float:
        started = time.perf_counter()
        if trajectory["kind"] == "group":
            messages = [trajectory["system"], {"role": "user", "content": trajectory["question"]}]
            await asyncio.gather(*(self.chat(messages, None, seed=k) for k in range(GROUP_SIZE)))
        else:
            messages = [trajectory["system"]]
            for turn, user in enumerate(trajectory["users"]):
                if turn:
                    await asyncio.sleep(trajectory["tools"][turn - 1])
                messages.append({"role": "user", "content": user})
                messages.append({"role": "assistant", "content": await self.chat(messages, trajectory["id"])})
        return time.perf_counter() - started


COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:request_success_total",
            "skyinfer_session_moves_total")  # fmt: skip


async def counters(http: aiohttp.ClientSession, metrics_urls: list[str]) -> dict[str, list[float]]:
    """``COUNTERS``, one value per engine (in the order of ``metrics_urls``, then of the engine label)."""
    found: dict[str, dict[tuple[int, str], float]] = {name: {} for name in COUNTERS}
    for k, url in enumerate(metrics_urls):
        async with http.get(url) as r:
            text = await r.text()
        for sample in (s for family in text_string_to_metric_families(text) for s in family.samples):
            if sample.name in found:
                key = (k, sample.labels.get("engine", ""))
                found[sample.name][key] = found[sample.name].get(key, 0.0) + sample.value
    return {name: [v for _, v in sorted(values.items())] for name, values in found.items()}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(url: str, metrics_urls: list[str], model: str, args, send_sessions: bool) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        client = Client(http, url, model, args, send_sessions)
        # One short request per engine-ish, so that start-up effects are not in the run.
        await asyncio.gather(*(client.chat([{"role": "user", "content": f"warm {i}"}], None) for i in range(4)))
        client.tokens = 0
        before = await counters(http, metrics_urls)
        gate = asyncio.Semaphore(args.concurrency)

        async def one(trajectory: dict) -> float:
            async with gate:
                return await client.run(trajectory)

        started = time.perf_counter()
        latencies = await asyncio.gather(*(one(t) for t in workload(args)))
        elapsed = time.perf_counter() - started
        after = await counters(http, metrics_urls)
    delta = {name: [a - b for a, b in zip(after[name], before[name])] for name in COUNTERS}
    hits, queries = sum(delta["vllm:prefix_cache_hits_total"]), sum(delta["vllm:prefix_cache_queries_total"])
    return {
        "tokens_per_s": client.tokens / elapsed,
        "seconds": elapsed,
        "p50": percentile(latencies, 0.5),
        "p99": percentile(latencies, 0.99),
        "hit_rate": hits / max(1.0, queries),
        # How the requests split over the engines, and how many sessions skyinfer moved.
        "busiest_share": max(finished := delta["vllm:request_success_total"]) / max(1.0, sum(finished)),
        "moves": sum(delta["skyinfer_session_moves_total"]),
    }


def run_skyinfer(model: str, args, env: dict, extra: list[str], send_sessions: bool, name: str) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_skyinfer(
        model,
        port,
        ["--cpu-kvcache-gib", str(args.kvcache_gib), *extra, *args.engine_args],
        env,
        engines=2,
        log_name=f"bench-routing-{name}.log",
    )
    try:
        asyncio.run(wait_servers([(url, proc)], path="/ready"))
        return asyncio.run(measure(url, [f"{url}/metrics"], model, args, send_sessions))
    finally:
        stop(proc)


def run_vllm_router(model: str, args, env: dict) -> dict:
    cores = sorted(os.sched_getaffinity(0))
    ports = [free_port() for _ in range(2)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    servers = [
        start_reference(
            model,
            port,
            args.engine_args,
            {**env, "VLLM_CPU_OMP_THREADS_BIND": str(cores[k % len(cores)])},
            log_name=f"bench-routing-vllm{k}.log",
            cores={cores[k % len(cores)]},
        )
        for k, port in enumerate(ports)
    ]
    router, router_url = start_vllm_router(urls, "bench-routing-router.log")
    try:
        asyncio.run(wait_servers(list(zip(urls, servers))))
        asyncio.run(wait_servers([(router_url, router)], path="/v1/models"))
        return asyncio.run(measure(router_url, [f"{u}/metrics" for u in urls], model, args, send_sessions=True))
    finally:
        for proc in [router, *servers]:
            stop(proc)


def build_model(args) -> str:
    """The demo model, ``--model-width`` wide and ``--model-layers`` deep.

    The demo model itself (2 layers, 128 wide) makes prefill almost free; a wider,
    deeper one costs per prompt token what a real model costs beside a decode step.
    """
    size = {
        "hidden_size": args.model_width,
        "intermediate_size": 2 * args.model_width,
        "num_hidden_layers": args.model_layers,
        "num_attention_heads": args.model_width // 64,
        "num_key_value_heads": max(1, args.model_width // 256),
        "max_position_embeddings": 8192,
    }
    return str(build_demo_model(scratch_dir("bench-routing-"), **size))


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--model", help="model directory (default: one built like the demo model, see --model-width)")
    p.add_argument("--model-width", type=int, default=512, help="hidden size of the built model (a multiple of 64)")
    p.add_argument("--model-layers", type=int, default=8, help="layers of the built model")
    p.add_argument("--sessions", type=int, default=64, help="multi-turn trajectories")
    p.add_argument("--groups", type=int, default=24, help=f"GRPO groups of {GROUP_SIZE} samples")
    p.add_argument("--concurrency", type=int, default=16, help="trajectories at a time")
    p.add_argument("--system-words", type=int, default=100, help="the shared system prompt's length")
    p.add_argument("--turn-words", type=int, default=80, help="each user message's length")
    p.add_argument("--group-words", type=int, default=30, help="each GRPO group's problem's length")
    p.add_argument(
        "--tool-seconds",
        type=float,
        default=0.0,
        help="mean time (exponential) the environment takes between a session's answer and its next turn",
    )
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    p.add_argument("--kvcache-gib", type=int, default=2, help="KV cache memory per engine")
    p.add_argument("--kv-blocks", type=int, default=128, help="KV-cache blocks per engine (0: all that fit)")
    p.add_argument("--seed", type=int, default=20261122)
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of the three set-ups (medians reported)")
    p.add_argument(
        "--skyinfer-args", default="", help="skyinfer serve options for its own set-up, e.g. '--group-slack 2'"
    )
    p.add_argument(
        "--setups", default="skyinfer,least-loaded,vllm-router", help="which set-ups to run, comma-separated"
    )
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help="after --: vLLM engine arguments for every engine")
    args = p.parse_args()
    args.engine_args = [a for a in args.engine_args if a != "--"]
    args.skyinfer_args = args.skyinfer_args.split()
    if args.kv_blocks:
        args.engine_args += ["--num-gpu-blocks-override", str(args.kv_blocks)]
    model = args.model or build_model(args)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.kvcache_gib)}
    setups = {
        "skyinfer": lambda: run_skyinfer(model, args, env, args.skyinfer_args, send_sessions=True, name="skyinfer"),
        "least-loaded": lambda: run_skyinfer(
            model, args, env, ["--group-prefix-chars", "0"], send_sessions=False, name="least-loaded"
        ),
        "vllm-router": lambda: run_vllm_router(model, args, env),
    }
    unknown = set(args.setups.split(",")) - set(setups)
    if unknown:
        p.error(f"--setups: unknown {', '.join(sorted(unknown))} (known: {', '.join(setups)})")
    setups = {name: setups[name] for name in args.setups.split(",")}
    # Interleaved: each round runs every set-up once, so that the machine's drifts hit all of them.
    rounds = [{name: run() for name, run in setups.items()} for _ in range(args.rounds)]
    for k, one in enumerate(rounds):
        print(
            f"round {k}: "
            + ", ".join(
                f"{n} {m['tokens_per_s']:.0f} tok/s {m['hit_rate']:.1%} {m['moves']:.0f} moves" for n, m in one.items()
            )
        )
    results = {
        name: {key: statistics.median(r[name][key] for r in rounds) for key in rounds[0][name]} for name in setups
    }
    print(
        f"{args.sessions} sessions (long-tailed turns of {args.turn_words} words) + {args.groups} GRPO groups x "
        f"{GROUP_SIZE} ({args.group_words}-word problems, a seed per sample), {args.concurrency} trajectories at "
        f"a time, {args.max_tokens} tokens per answer; 2 engines, 1 core and {args.kv_blocks or 'all'} KV blocks "
        f"each; model {args.model or f'{args.model_width} wide, {args.model_layers} layers'}"
    )
    print(f"median of {args.rounds} interleaved round(s)")
    print(
        f"{'':14s} {'tok/s':>8s} {'run s':>8s} {'p50 s':>8s} {'p99 s':>8s} {'prefix hits':>12s} "
        f"{'busiest engine':>15s} {'moves':>6s}"
    )
    for name, m in results.items():
        print(
            f"{name:14s} {m['tokens_per_s']:8.1f} {m['seconds']:8.1f} {m['p50']:8.2f} {m['p99']:8.2f} "
            f"{m['hit_rate']:12.1%} {m['busiest_share']:15.1%} {m['moves']:6.0f}"
        )
    sky = results.get("skyinfer")
    for name in [n for n in ("least-loaded", "vllm-router") if sky and n in results]:
        m = results[name]
        print(
            f"skyinfer / {name}: throughput {sky['tokens_per_s'] / m['tokens_per_s']:.2f}, "
            f"p99 {sky['p99'] / m['p99']:.2f}"
        )
    write_json(args, [{"setup": name, **m} for name, m in results.items()], rounds=rounds)


if __name__ == "__main__":
    main()
