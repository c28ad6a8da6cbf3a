"""Command line: ``skyinfer serve`` and ``skyinfer demo-model``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import signal
import sys
from pathlib import Path

DEFAULT_DEMO_DIR = Path(os.environ.get("SKYINFER_CACHE", Path.home() / ".cache" / "skyinfer")) / "demo-model"

log = logging.getLogger("skyinfer")


def _serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="start the service: N vLLM engines behind one OpenAI-compatible endpoint",
        description=(
            "Start N vLLM engine processes and serve them behind one HTTP endpoint. "
            "Any option not listed here is a vLLM engine argument and is passed to every "
            "engine as `vllm serve` takes it (e.g. --max-model-len 2048 --dtype float32)."
        ),
        allow_abbrev=False,
    )
    p.add_argument("--model", metavar="PATH", help=f"model directory or name (default: the built-in demo model, built in {DEFAULT_DEMO_DIR})")
    p.add_argument("--engines", type=int, metavar="N", default=1, help="number of engine processes (default: 1)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, metavar="TP", default=1, help="GPUs (or CPU workers) per engine for tensor parallelism")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, metavar="PP", default=1, help="pipeline stages per engine")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda if nvidia-ml-py sees GPUs, else cpu")
    p.add_argument("--cpu-kvcache-gib", type=int, metavar="GIB", default=1, help="KV cache per engine on CPU, GiB (default: 1)")
    p.add_argument("--engine-start-timeout", type=float, metavar="SECONDS", default=600.0, help="seconds an engine may take to start")
    p.add_argument("--control-timeout", type=float, metavar="SECONDS", default=300.0, help="seconds each engine gets for an admin call (default: 300)")
    p.add_argument("--weight-transfer-timeout", type=float, metavar="SECONDS", default=120.0, help="seconds a trainer gets to join, and each transfer step gets to finish (default: 120)")
    p.add_argument("--shutdown-grace", type=float, metavar="SECONDS", default=30.0,
                   help="on SIGTERM/Ctrl-C: seconds for in-flight requests to finish and engines to exit (default: 30)")
    p.add_argument("--health-interval", type=float, metavar="SECONDS", default=5.0, help="seconds between liveness probes of each engine (default: 5)")
    p.add_argument("--health-timeout", type=float, metavar="SECONDS", default=10.0,
                   help="a probe slower than this fails; 3 failures in a row restart the engine (default: 10)")
    p.add_argument("--engine-connections", type=int, metavar="N", default=4096,
                   help="requests sent to one engine at once; more wait in the front for a connection (default: 4096)")
    p.add_argument("--engine-queue-limit", type=int, metavar="N", default=0,
                   help="requests that may wait per engine before new ones get 503 with Retry-After (default: 0, no cap)")
    p.add_argument("--max-request-mb", type=float, metavar="MIB", default=32.0, help="largest request body accepted, MiB (default: 32)")
    security = p.add_argument_group("security")
    security.add_argument("--api-key", metavar="KEY", default=os.environ.get("SKYINFER_API_KEY"),
                          help="Bearer key for the OpenAI routes (default: $SKYINFER_API_KEY; none: open)")
    security.add_argument("--admin-key", metavar="KEY", default=os.environ.get("SKYINFER_ADMIN_KEY"),
                          help="Bearer key for control, weight and engine routes (default: $SKYINFER_ADMIN_KEY, "
                               "else the API key)")
    security.add_argument("--allow-unauthenticated-admin", action="store_true",
                          help="allow a non-loopback --host without an admin key (only on a network that is yours alone)")
    return p


def _config_from_args(ns: argparse.Namespace, engine_args: list[str]):
    from .config import ServeConfig
    from .demo_model import ensure_demo_model

    model = ns.model
    if model is None:
        log.info("no --model given: using the demo model in %s", DEFAULT_DEMO_DIR)
        model = str(ensure_demo_model(DEFAULT_DEMO_DIR))
    return ServeConfig(
        model=model,
        engines=ns.engines,
        tensor_parallel_size=ns.tensor_parallel_size,
        pipeline_parallel_size=ns.pipeline_parallel_size,
        host=ns.host,
        port=ns.port,
        engine_args=tuple(engine_args),
        device=ns.device,
        cpu_kvcache_gib=ns.cpu_kvcache_gib,
        engine_start_timeout_s=ns.engine_start_timeout,
        control_timeout_s=ns.control_timeout,
        weight_transfer_timeout_s=ns.weight_transfer_timeout,
        shutdown_grace_s=ns.shutdown_grace,
        health_interval_s=ns.health_interval,
        health_timeout_s=ns.health_timeout,
        max_request_bytes=int(ns.max_request_mb * 1024 * 1024),
        engine_connections=ns.engine_connections,
        engine_queue_limit=ns.engine_queue_limit,
        api_key=ns.api_key,
        admin_key=ns.admin_key,
        allow_unauthenticated_admin=ns.allow_unauthenticated_admin,
    )


async def run_service(config) -> int:
    from aiohttp import web

    from .app import SUPERVISOR, create_app
    from .draining import IN_FLIGHT
    from .errors import OpenAIErrorsAppRunner
    from .supervisor import EngineStartError

    _raise_open_files_limit()
    app = create_app(config)
    runner = OpenAIErrorsAppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        # Thousands of rollout clients may connect at once.
        await web.TCPSite(runner, config.host, config.port, backlog=4096).start()
        log.info("listening on http://%s:%d; starting %d engine(s)", config.host, config.port, config.engines)
        ready = asyncio.ensure_future(app[SUPERVISOR].wait_ready())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            try:
                ready.result()
            except EngineStartError as exc:
                log.error("%s", exc)
                return 1
            log.info("skyinfer ready on http://%s:%d", config.host, config.port)
            await stopped
        await _drain(runner, app[IN_FLIGHT], config.shutdown_budget_s[0])
        return 0
    finally:
        # Then the engines stop, within the rest of the grace (the app's cleanup).
        await runner.cleanup()


def _raise_open_files_limit() -> None:
    """Each request in flight holds two sockets (client and engine side): allow as many as the system does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _drain(runner, in_flight, drain_s: float) -> None:
    """Stop accepting, then give in-flight requests their share of the grace."""
    log.info("shutting down: no new connections; %d request(s) in flight get up to %.0fs", len(in_flight), drain_s)
    for site in list(runner.sites):
        await site.stop()
    # Keep-alive connections take no new request once the current one is answered.
    runner.server.pre_shutdown()
    await in_flight.drain(drain_s)


_EXAMPLES = """\
examples:
  skyinfer serve                                   the built-in demo model, 1 engine, on 127.0.0.1:8000
  skyinfer serve --model Qwen/Qwen3-8B --engines 4 -tp 2 --max-model-len 8192
  skyinfer status http://127.0.0.1:8000            a table of the engines
  skyinfer demo-model ./demo                       write the tiny demo checkpoint

Each command has its own --help (skyinfer serve --help).
"""


def _status_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "status",
        help="show a running server's engines: state, devices, weight version, load",
        description="Print one row per engine of the skyinfer server at URL (GET /engines).",
    )
    p.add_argument("url", nargs="?", default="http://127.0.0.1:8000", help="server address (default: http://127.0.0.1:8000)")
    p.add_argument("--admin-key", default=os.environ.get("SKYINFER_ADMIN_KEY"),
                   help="the server's admin key, if it has one (default: $SKYINFER_ADMIN_KEY)")
    p.add_argument("--json", action="store_true", help="print the raw JSON instead of a table")
    return p


def _status(args) -> int:
    import json

    from .client import Client, SkyinferError

    with Client(args.url, admin_key=args.admin_key, retries=0, timeout_s=30) as client:
        try:
            engines = client.engines()
            fleet = client.weight_info()["weight_version"]
        except SkyinferError as exc:
            print(f"skyinfer status: {args.url}: {exc.message}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"weight_version": fleet, "engines": engines}, indent=2))
        return 0
    print(format_engine_table(engines, fleet))
    return 0 if all(e["state"] == "ready" for e in engines) else 3


def format_engine_table(engines: list[dict], fleet_version: str | None) -> str:
    header = ("ENGINE", "STATE", "DEVICES", "WEIGHTS", "IN FLIGHT", "UNFINISHED", "RESTARTS", "PID")
    rows = [header]
    for e in engines:
        devices = e["devices"]
        rows.append((
            str(e["id"]), e["state"], f"{devices['kind']}:{','.join(map(str, devices['ids']))}",
            str(e["weight_version"]), str(e["load"]), str(e.get("unfinished_requests", "")),
            str(e.get("restarts", 0)), str(e["pid"]),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append(f"fleet weight version: {fleet_version or 'as loaded'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="skyinfer",
        description="Serve vLLM engines for RL post-training: one OpenAI-compatible endpoint, "
        "sticky sessions, pause/resume/sleep, and weight transfer from a trainer.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,status,demo-model}")
    _serve_parser(sub)
    _status_parser(sub)
    demo = sub.add_parser("demo-model", help="write the tiny built-in demo model (Qwen2, BPE tokenizer) to DIR")
    demo.add_argument("dir", help="output directory")

    args, extra = parser.parse_known_args(argv)
    if args.command != "serve" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "status":
        return _status(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "demo-model":
        from .demo_model import build_demo_model

        print(build_demo_model(args.dir))
        return 0
    import uvloop

    try:
        config = _config_from_args(args, extra)
    except ValueError as exc:  # attrs validators and the bind rule
        parser.error(str(exc))
    # uvloop's transports cut the front's per-chunk cost of relaying streams.
    return uvloop.run(run_service(config))


if __name__ == "__main__":
    sys.exit(main())
