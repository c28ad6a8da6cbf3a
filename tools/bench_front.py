#!/usr/bin/env python
"""The front's own cost, with no model behind it: skyinfer over fake engines (tools/fake_engine.py)
that answer as fast as they can, beside vllm-router over the same fake engines on TCP, beside the
load generator talking to the fake engines directly, and (``--floor``) beside the floor of an aiohttp
front: aiohttp's server and skyinfer's engine connection (``stream_relay``), round robin over the
same TCP fake engines, with none of skyinfer's routing, middlewares or headers (plain phase only).

Per round and target (targets in alternating order), a load generator in its own process sends:

* ``plain``: non-streamed completions of 16 tokens, ``--concurrency`` at once, as fast as they
  are answered: the highest requests/s, and the middle's CPU per 1,000 requests;
* ``stream``: streamed chat completions of ``--max-tokens`` tokens, one SSE event per token,
  each stream at ``--tokens-per-s`` (a GPU decodes one token per step and request; the events of
  one stream are spaced as a GPU spaces them): the middle's CPU per relayed event;
* ``flood``: the same streams with no spacing at ``--flood-concurrency``: the highest events/s.

The middle's CPU is read from its processes (psutil: user + system, all threads; a front's workers, not its engines);
latency added is the target's median (p99) latency less the direct one's in the same round.

    .venv/bin/python tools/bench_front.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psutil

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS.parent))
sys.path.insert(0, str(TOOLS))
from benchlib import bench_parser, free_port, spawn_logged, start_vllm_router, stop, wait_servers, write_json  # noqa: E402

MODEL = "bench-front-model"
PROMPT = "tell me something about the weather in a few words " * 4


# -- the load generator (its own process) ---------------------------------------------------


async def _one(session: aiohttp.ClientSession, url: str, phase: str, max_tokens: int) -> tuple[float, int]:
    """One request: its latency and the SSE events it received (0 when not streamed)."""
    stream = phase != "plain"
    if stream:
        path = "/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True}
    else:
        path = "/v1/completions"
        body = {"model": MODEL, "prompt": PROMPT}
    body["max_tokens"] = max_tokens
    started = time.perf_counter()
    async with session.post(url + path, json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}{path}: {response.status} {await response.text()}")
        if not stream:
            await response.read()
            return time.perf_counter() - started, 0
        events = 0
        async for chunk in response.content.iter_any():
            events += chunk.count(b"data: ")
    return time.perf_counter() - started, events


async def _load(urls: list[str], phase: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    latencies: list[float] = []
    events = 0
    left = requests
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def worker(i: int) -> None:
            nonlocal left, events
            url = urls[i % len(urls)]  # direct: the fake engines round-robin, as a router would
            while left > 0:
                left -= 1
                latency, got = await _one(session, url, phase, max_tokens)
                latencies.append(latency)
                events += got

        # A first request per worker opens its connection; not timed.
        await asyncio.gather(*(_one(session, urls[i % len(urls)], "plain", 1) for i in range(concurrency)))
        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {
        "elapsed_s": elapsed,
        "requests": len(latencies),
        "events": events,
        "p50_s": latencies[len(latencies) // 2],
        "p99_s": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }


def load_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_front.py load")
    parser.add_argument("--url", action="append", required=True)
    parser.add_argument("--phase", choices=("plain", "stream", "flood"), required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    args = parser.parse_args(argv)
    import uvloop

    result = uvloop.run(_load(args.url, args.phase, args.concurrency, args.requests, args.max_tokens))
    print(json.dumps(result))


# -- the servers under test -------------------------------------------------------------------


def fake_engine_main(argv: list[str]) -> None:
    """A fake engine on TCP, for vllm-router and the direct client."""
    parser = argparse.ArgumentParser(prog="bench_front.py fake-engine")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    import uvloop
    from aiohttp import web
    from fake_engine import create_fake_engine_app

    script = json.loads(os.environ.get("FAKE_ENGINE_SCRIPT", "{}"))
    app = create_fake_engine_app(script, MODEL, None)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


def floor_main(argv: list[str]) -> None:
    """What any front built on aiohttp's server pays per plain request: the body read, one answer
    read whole over a kept engine connection (skyinfer's own, ``stream_relay``), the answer written."""
    parser = argparse.ArgumentParser(prog="bench_front.py floor")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", action="append", required=True, help="host:port of a fake engine")
    args = parser.parse_args(argv)
    import itertools

    import uvloop
    from aiohttp import web

    from skyinfer.serving import stream_relay

    async def tcp_send(address, method, path, body, headers, kept=None):
        # skyinfer's engines listen on Unix sockets; these fake engines, shared with vllm-router, on TCP.
        loop = asyncio.get_running_loop()
        host, port = address.rsplit(":", 1)
        _, answer = await loop.create_connection(
            lambda: stream_relay.EngineAnswer(loop, kept, address), host, int(port)
        )
        answer.send_request(method, path, body, headers)
        return answer

    stream_relay.send = tcp_send
    connections = stream_relay.EngineConnections()
    engines = itertools.cycle(args.engine)

    async def relay(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        answer = await connections.send(next(engines), request.method, request.raw_path, body, headers)
        try:
            head = await answer.head()
            payload = await answer.body()
            return web.Response(
                status=head.status, body=payload, headers={"Content-Type": head.headers["Content-Type"]}
            )
        finally:
            answer.finish()

    async def health(_request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", relay)
    app.router.add_get("/health", health)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


def front_main(argv: list[str]) -> None:
    """``skyinfer serve`` with fake engines in place of vLLM's."""
    parser = argparse.ArgumentParser(prog="bench_front.py front")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engines", type=int, required=True)
    parser.add_argument("--front-workers", type=int, default=1)
    args, extra = parser.parse_known_args(argv)
    import logging

    import uvloop

    from skyinfer.config import ServeConfig
    from skyinfer.front.service import run_service

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServeConfig(
        model=MODEL,
        engines=args.engines,
        port=args.port,
        front_workers=args.front_workers,
        device="cpu",
        engine_command=(sys.executable, str(TOOLS / "fake_engine.py")),
        engine_args=tuple(extra),
    )
    sys.exit(uvloop.run(run_service(config)))


def _self(*argv: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *argv]


class Targets:
    """The fake engines on TCP, vllm-router over them, and skyinfer over its own fake engines."""

    def __init__(self, engines: int, front_workers: list[int], floor: bool = False) -> None:
        env = dict(os.environ)
        self.engine_urls, self.procs = [], []
        for i in range(engines):
            port = free_port()
            self.procs.append(spawn_logged(_self("fake-engine", "--port", str(port)), env, f"bench-front-fake-{i}.log"))
            self.engine_urls.append(f"http://127.0.0.1:{port}")
        asyncio.run(wait_servers([(url, proc) for url, proc in zip(self.engine_urls, self.procs)]))
        self.router, self.router_url = start_vllm_router(self.engine_urls, "bench-front-router.log", "round_robin")
        # skyinfer with each number of front workers asked for: name -> (url, process).
        self.fronts: dict[str, tuple[str, subprocess.Popen]] = {}
        for workers in front_workers:
            name = "skyinfer" if workers == 1 else f"skyinfer-w{workers}"
            port = free_port()
            argv = _self("front", "--port", str(port), "--engines", str(engines), "--front-workers", str(workers))
            self.fronts[name] = (f"http://127.0.0.1:{port}", spawn_logged(argv, env, f"bench-front-{name}.log"))
        servers = [(self.router_url, self.router), *self.fronts.values()]
        asyncio.run(wait_servers(servers, path="/v1/models"))
        self.floor = None
        if floor:
            port = free_port()
            engines_arg = [f"--engine={url.removeprefix('http://')}" for url in self.engine_urls]
            floor_proc = spawn_logged(_self("floor", "--port", str(port), *engines_arg), env, "bench-front-floor.log")
            self.floor = (f"http://127.0.0.1:{port}", floor_proc)
            asyncio.run(wait_servers([self.floor]))
            self.procs.append(floor_proc)
        asyncio.run(wait_servers(list(self.fronts.values()), path="/ready"))
        self.procs += [self.router, *(proc for _, proc in self.fronts.values())]

    def by_name(self) -> dict[str, tuple[list[str], list[psutil.Process]]]:
        """Each target's URLs and its middle's processes (a front's: itself and its front workers)."""
        targets = {
            "direct": (self.engine_urls, []),
            "vllm-router": ([self.router_url], [psutil.Process(self.router.pid)]),
        }
        for name, (url, proc) in self.fronts.items():
            front = psutil.Process(proc.pid)
            workers = [c for c in front.children() if "skyinfer.front_workers.worker" in c.cmdline()]
            targets[name] = ([url], [front, *workers])
        if self.floor is not None:
            targets["aiohttp floor"] = ([self.floor[0]], [psutil.Process(self.floor[1].pid)])
        return targets

    def stop(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


def _cpu_s(processes: list[psutil.Process]) -> float:
    return sum(times.user + times.system for times in (p.cpu_times() for p in processes))


def run_phase(urls: list[str], middle: list[psutil.Process], phase: str, concurrency: int, requests: int,
              max_tokens: int) -> dict:  # fmt: skip
    before = _cpu_s(middle)
    cmd = _self("load", "--phase", phase, "--concurrency", str(concurrency), "--requests", str(requests),
                "--max-tokens", str(max_tokens), *(f"--url={u}" for u in urls))  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["cpu_s"] = _cpu_s(middle) - before
    return result


def _median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def report(results: dict[str, dict[str, list[dict]]], phases: list[str], at_rest: dict[str, dict]) -> list[dict]:
    """The medians printed; as rows (``--json``), one per target: ``PHASE_FIGURE`` keys, and what the
    middle took to start and holds at rest."""
    rows = {name: {"target": name, **at_rest.get(name, {})} for name in results}
    print("\nmedians over rounds; CPU is the middle's own (front or router); added latency is over direct\n")
    header = f"{'target':<12} {'phase':<7} {'req/s':>9} {'events/s':>10} {'CPU/req':>9} {'CPU/event':>10} "
    print(header + f"{'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8}")
    for phase in phases:
        direct = results["direct"][phase]
        for target, by_phase in results.items():
            if phase not in by_phase:
                continue  # the floor runs the plain phase alone
            rounds = by_phase[phase]
            per = [
                {
                    "rps": r["requests"] / r["elapsed_s"],
                    "eps": r["events"] / r["elapsed_s"],
                    "cpu_req_us": 1e6 * r["cpu_s"] / r["requests"],
                    "cpu_event_us": 1e6 * r["cpu_s"] / max(1, r["events"]),
                    "p50": 1e3 * r["p50_s"],
                    "p99": 1e3 * r["p99_s"],
                    "add50": 1e3 * (r["p50_s"] - d["p50_s"]),
                    "add99": 1e3 * (r["p99_s"] - d["p99_s"]),
                }
                for r, d in zip(rounds, direct)
            ]
            cpu = target != "direct"
            streamed = phase != "plain"
            print(
                f"{target:<12} {phase:<7} {_median(per, 'rps'):>9.0f} "
                f"{_median(per, 'eps') if streamed else 0:>10.0f} "
                f"{_median(per, 'cpu_req_us') if cpu else 0:>7.0f}us "
                f"{_median(per, 'cpu_event_us') if cpu and streamed else 0:>8.1f}us "
                f"{_median(per, 'p50'):>8.1f} {_median(per, 'p99'):>8.1f} "
                f"{_median(per, 'add50'):>8.1f} {_median(per, 'add99'):>8.1f}"
            )
            figures = {
                "req_per_s": _median(per, "rps"),
                "events_per_s": _median(per, "eps") if streamed else None,
                "cpu_per_request_us": _median(per, "cpu_req_us") if cpu else None,
                "cpu_per_event_us": _median(per, "cpu_event_us") if cpu and streamed else None,
                "p50_ms": _median(per, "p50"),
                "p99_ms": _median(per, "p99"),
                "added_p50_ms": _median(per, "add50") if target != "direct" else None,
                "added_p99_ms": _median(per, "add99") if target != "direct" else None,
            }
            rows[target] |= {f"{phase}_{key}": value for key, value in figures.items() if value is not None}
    return list(rows.values())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in {"load", "fake-engine", "front", "floor"}:
        subcommands = {"load": load_main, "fake-engine": fake_engine_main, "front": front_main, "floor": floor_main}
        subcommands[sys.argv[1]](sys.argv[2:])
        return
    parser = bench_parser(__doc__)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=4000, help="non-streamed requests per round")
    parser.add_argument("--streams", type=int, default=500, help="streamed requests per round (stream phase)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens (events) per stream")
    parser.add_argument("--tokens-per-s", type=float, default=100, help="each stream's pace in the stream phase")
    parser.add_argument("--flood-concurrency", type=int, default=256)
    parser.add_argument(
        "--flood-streams", type=int, default=4000, help="streamed requests per round (flood phase: seconds of load)"
    )
    parser.add_argument("--only", choices=("plain", "stream", "flood"), action="append")
    parser.add_argument(
        "--front-workers", type=int, action="append", help="skyinfer with N front workers (repeatable; default 1)"
    )
    parser.add_argument(
        "--floor", action="store_true", help="add the floor of an aiohttp front (plain phase only; see above)"
    )
    args = parser.parse_args()
    phases = args.only or ["plain", "stream", "flood"]
    # Per phase: clients at once, requests per round, tokens per request.
    loads = {
        "plain": (args.concurrency, args.requests, 16),
        "stream": (args.concurrency, args.streams, args.max_tokens),
        "flood": (args.flood_concurrency, args.flood_streams, args.max_tokens),
    }
    results: dict[str, dict[str, list[dict]]] = {}
    at_rest: dict[str, dict] = {}
    # Each phase needs its own pace in the fake engines: one set of servers per pace.
    for phase in phases:
        pace = args.tokens_per_s if phase == "stream" else 0
        os.environ["FAKE_ENGINE_SCRIPT"] = json.dumps({"tokens_per_s": pace})
        targets = Targets(args.engines, args.front_workers or [1], floor=args.floor and phase == "plain")
        try:
            names = list(targets.by_name().items())
            for name, (_, middle) in names:
                if middle:  # what each middle took to start, and holds at rest
                    rss = sum(p.memory_info().rss for p in middle) >> 20
                    print(f"{name}: ready, {_cpu_s(middle):.2f} CPU-s so far, {rss} MiB resident", file=sys.stderr)
                    at_rest.setdefault(name, {"start_cpu_s": _cpu_s(middle), "resident_mib": rss})
            for round_no in range(args.rounds):
                order = names if round_no % 2 == 0 else names[::-1]
                for name, (urls, middle) in order:
                    r = run_phase(urls, middle, phase, *loads[phase])
                    results.setdefault(name, {}).setdefault(phase, []).append(r)
                    print(f"round {round_no} {phase:<6} {name:<12} {json.dumps(r)}", file=sys.stderr)
        finally:
            targets.stop()
    write_json(args, report(results, phases, at_rest))


if __name__ == "__main__":
    main()
