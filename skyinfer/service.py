"""The service's life: listen, start the engines, serve until told to stop, shut down within the grace."""

from __future__ import annotations

import asyncio
import logging
import resource
import signal

from aiohttp import web

from .app import create_app
from .config import ServeConfig
from .draining import IN_FLIGHT
from .errors import OpenAIErrorsAppRunner
from .supervisor import SUPERVISOR, EngineStartError

log = logging.getLogger("skyinfer")


async def run_service(config: ServeConfig) -> int:
    """Serve ``config`` until SIGTERM or Ctrl-C; the exit code (1: an engine could not start)."""
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
