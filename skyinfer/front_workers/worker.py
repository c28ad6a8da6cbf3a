"""A front worker: one of ``--front-workers N`` processes accepting on the service's port.

It answers the data plane itself (the same ``proxy.forward`` as a single front, its engine leased
from the control process, the bytes relayed by this process) and passes every other request on to
the control process's Unix socket as it came: admin, weights, sessions' end, engine views,
metrics. The control process checks the admin key of what it is passed; a worker checks the API
key of what it answers.

Started by the control process (``pool.py``) with the listening socket inherited and its settings
on stdin; it exits when the control process's channel closes, and drains on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys

import aiohttp
import attrs
import orjson
from aiohttp import web

from ..admin.metrics import RequestMetrics
from ..admin.security import AccessPolicy
from ..errors import OpenAIErrorsAppRunner, error_response, openai_errors_middleware
from ..fleet.engine_calls import unix_client
from ..serving.draining import IN_FLIGHT, InFlight, drain
from ..serving.proxy import GROUP_PREFIX_CHARS, LEASES, add_data_plane_routes
from .leases import RemoteLeases

log = logging.getLogger("skyinfer.front_workers")

# The route of everything a worker passes on to the control process, and its name as middlewares see it.
PASSED_ON = "/{path:.*}"
_PASSED_ON_CANONICAL = web.DynamicResource(PASSED_ON).canonical
CONTROL = web.AppKey("control", aiohttp.ClientSession)
# Hop-by-hop headers, what aiohttp sets again on the answer it writes, and Expect (the worker answered it).
# Host is passed on as it came: the control process checks a browser's Origin against it (security.py).
_NOT_PASSED = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "expect"})


@attrs.frozen
class WorkerSettings:
    """What of the service's configuration a worker needs (sent on its stdin, keys included)."""

    api_key: str | None
    admin_key: str | None
    group_prefix_chars: int
    hold_requests_s: float
    max_request_bytes: int
    drain_s: float


async def pass_on(request: web.Request) -> web.Response:
    """The control process's answer to the request, as it came (its key checked there)."""
    body = await request.read()
    # Content-Type included, as it came: the control process reads an admin body only when it is
    # application/json. None sent, none passed on (aiohttp would make a body application/octet-stream).
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_PASSED}
    try:
        async with request.app[CONTROL].request(
            request.method, request.rel_url, data=body or None, headers=headers, skip_auto_headers=("Content-Type",)
        ) as upstream:
            payload = await upstream.read()
    except aiohttp.ClientError as exc:
        return error_response(503, f"the front's control process could not be reached: {exc!r}")
    answered = {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_PASSED}
    return web.Response(status=upstream.status, body=payload, headers=answered)


def create_worker_app(
    settings: WorkerSettings, leases: RemoteLeases, metrics: RequestMetrics, control_socket: str
) -> web.Application:
    in_flight = InFlight()

    def counted(request: web.Request) -> bool:
        resource = request.match_info.route.resource
        return resource is None or resource.canonical != _PASSED_ON_CANONICAL

    access = AccessPolicy(settings.api_key, settings.admin_key)
    app = web.Application(
        middlewares=[
            metrics.middleware(counted),
            in_flight.middleware(),
            openai_errors_middleware,
            access.middleware(checked_elsewhere=frozenset({_PASSED_ON_CANONICAL})),
        ],
        client_max_size=settings.max_request_bytes,
    )
    app[IN_FLIGHT] = in_flight
    app[LEASES] = leases
    app[GROUP_PREFIX_CHARS] = settings.group_prefix_chars

    async def control_client(app: web.Application):
        app[CONTROL] = unix_client(control_socket)
        yield
        await app[CONTROL].close()

    app.cleanup_ctx.append(control_client)
    add_data_plane_routes(app)
    app.router.add_route("*", PASSED_ON, pass_on)
    return app


async def serve(index: int, listen_fd: int, control_socket: str, leases_socket: str, settings: WorkerSettings) -> int:
    metrics = RequestMetrics()
    try:
        leases = await RemoteLeases.connect(leases_socket, settings.hold_requests_s, metrics.text)
    except OSError as exc:
        log.error("front worker %d: no channel to the control process (%r); exiting", index, exc)
        return 1
    app = create_worker_app(settings, leases, metrics, control_socket)
    runner = OpenAIErrorsAppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # Ctrl-C reaches the whole process group: the control process decides when workers stop.
    loop.add_signal_handler(signal.SIGINT, lambda: None)
    try:
        await web.SockSite(runner, socket.socket(fileno=listen_fd)).start()
        log.info("front worker %d accepting", index)
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({stopped, leases.closed}, return_when=asyncio.FIRST_COMPLETED)
        if leases.closed.done():
            log.error("front worker %d: the control process is gone; exiting", index)
            return 1
        await drain(runner, app[IN_FLIGHT], settings.drain_s)
        return 0
    finally:
        await runner.cleanup()
        await leases.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m skyinfer.front_workers.worker")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--control-socket", required=True)
    parser.add_argument("--leases-socket", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = WorkerSettings(**orjson.loads(sys.stdin.buffer.read()))
    import uvloop

    return uvloop.run(serve(args.index, args.listen_fd, args.control_socket, args.leases_socket, settings))


if __name__ == "__main__":
    sys.exit(main())
