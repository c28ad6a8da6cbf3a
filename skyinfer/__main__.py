"""Command line: ``skyinfer serve`` and ``skyinfer demo-model``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
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
    p.add_argument("--model", help=f"model directory or name (default: the built-in demo model, built in {DEFAULT_DEMO_DIR})")
    p.add_argument("--engines", type=int, default=1, help="number of engine processes (default: 1)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs (or CPU workers) per engine for tensor parallelism")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages per engine")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda if nvidia-ml-py sees GPUs, else cpu")
    p.add_argument("--cpu-kvcache-gib", type=int, default=1, help="KV cache per engine on CPU, GiB (default: 1)")
    p.add_argument("--engine-start-timeout", type=float, default=600.0, help="seconds an engine may take to start")
    p.add_argument("--control-timeout", type=float, default=300.0, help="seconds each engine gets for an admin call (default: 300)")
    p.add_argument("--weight-transfer-timeout", type=float, default=120.0, help="seconds a trainer gets to join, and each transfer step gets to finish (default: 120)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on SIGTERM/Ctrl-C: seconds for in-flight requests to finish and engines to exit (default: 30)")
    p.add_argument("--health-interval", type=float, default=5.0, help="seconds between liveness probes of each engine (default: 5)")
    p.add_argument("--health-timeout", type=float, default=10.0,
                   help="a probe slower than this fails; 3 failures in a row restart the engine (default: 10)")
    p.add_argument("--max-request-mb", type=float, default=32.0, help="largest request body accepted, MiB (default: 32)")
    security = p.add_argument_group("security")
    security.add_argument("--api-key", default=os.environ.get("SKYINFER_API_KEY"),
                          help="Bearer key for the OpenAI routes (default: $SKYINFER_API_KEY; none: open)")
    security.add_argument("--admin-key", default=os.environ.get("SKYINFER_ADMIN_KEY"),
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
        api_key=ns.api_key,
        admin_key=ns.admin_key,
        allow_unauthenticated_admin=ns.allow_unauthenticated_admin,
    )


async def run_service(config) -> int:
    from aiohttp import web

    from .app import SUPERVISOR, create_app
    from .draining import IN_FLIGHT
    from .supervisor import EngineStartError

    app = create_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, config.host, config.port).start()
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


async def _drain(runner, in_flight, drain_s: float) -> None:
    """Stop accepting, then give in-flight requests their share of the grace."""
    log.info("shutting down: no new connections; %d request(s) in flight get up to %.0fs", len(in_flight), drain_s)
    for site in list(runner.sites):
        await site.stop()
    # Keep-alive connections take no new request once the current one is answered.
    runner.server.pre_shutdown()
    await in_flight.drain(drain_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="skyinfer", description="vLLM inference service for RL post-training")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    demo = sub.add_parser("demo-model", help="write the tiny built-in demo model (Qwen2, BPE tokenizer) to DIR")
    demo.add_argument("dir", help="output directory")

    args, extra = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "demo-model":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        from .demo_model import build_demo_model

        print(build_demo_model(args.dir))
        return 0
    import uvloop

    # uvloop's transports cut the front's per-chunk cost of relaying streams.
    try:
        config = _config_from_args(args, extra)
    except ValueError as exc:  # attrs validators and the bind rule
        parser.error(str(exc))
    return uvloop.run(run_service(config))


if __name__ == "__main__":
    sys.exit(main())
