"""Graceful shutdown: the requests being handled, waited for and then cut off.

aiohttp's own shutdown timeout cannot bound a handler that is waiting on an
engine (it cancels only the request body read, then waits again), so the
front tracks its handler tasks and cancels what is left itself.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

log = logging.getLogger("skyinfer.draining")


class InFlight:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._tasks)

    def middleware(self):
        @web.middleware
        async def track(request: web.Request, handler):
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            self._idle.clear()
            try:
                return await handler(request)
            finally:
                self._tasks.discard(task)
                if not self._tasks:
                    self._idle.set()

        return track

    async def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every request to finish; cancel the rest. Returns how many were cut off."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return 0
        except asyncio.TimeoutError:
            left = list(self._tasks)
            log.warning("%d request(s) still running after %.0fs; cutting them off", len(left), timeout_s)
            for task in left:
                task.cancel()
            await asyncio.wait(left, timeout=1.0)
            return len(left)


IN_FLIGHT = web.AppKey("in_flight", InFlight)


async def drain(runner: web.AppRunner, in_flight: InFlight, drain_s: float) -> None:
    """Stop accepting, then give in-flight requests their share of the grace."""
    log.info("shutting down: no new connections; %d request(s) in flight get up to %.0fs", len(in_flight), drain_s)
    for site in list(runner.sites):
        await site.stop()
    # Keep-alive connections take no new request once the current one is answered.
    runner.server.pre_shutdown()
    await in_flight.drain(drain_s)
