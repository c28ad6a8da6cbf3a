"""The service's life: listen, start the engines, serve until told to stop, shut down within the grace."""

from __future__ import annotations

import asyncio
import logging
import resource
import signal

from aiohttp import web

from ..config import ServeConfig
from ..errors import OpenAIErrorsAppRunner
from ..fleet.engine_process import EngineStartError
from ..fleet.supervisor import SUPERVISOR
from ..front_workers.pool import FRONT_WORKERS, listening_socket
from ..serving.draining import IN_FLIGHT, drain
from .app import create_app

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
    workers = app.get(FRONT_WORKERS)
    try:
        if workers is None:
            # Thousands of rollout clients may connect at once.
            await web.TCPSite(runner, config.host, config.port, backlog=4096).start()
        else:
            # The workers accept on the port; what they pass on comes to this process's socket.
            await web.UnixSite(runner, workers.control_socket).start()
            await workers.start(listening_socket(config.host, config.port))
        log.info(
            "listening on http://%s:%d (%s); starting %d engine(s)",
            config.host,
            config.port,
            "one front process" if workers is None else f"{config.front_workers} front workers beside this one",
            config.engines,
        )
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
        if workers is not None:
            await workers.stop(config.shutdown_budget_s[0])
        await drain(runner, app[IN_FLIGHT], config.shutdown_budget_s[0])
        return 0
    finally:
        if workers is not None:
            await workers.stop(0)
        # Then the engines stop, within the rest of the grace (the app's cleanup).
        await runner.cleanup()


def _raise_open_files_limit() -> None:
    """Each request in flight holds two sockets (client and engine side): allow as many as the system does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
