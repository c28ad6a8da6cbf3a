"""Admin calls are safe to abandon.

Callers give up all the time: a trainer's HTTP client times out, an operator presses Ctrl-C on a
restart, a proxy drops a connection idle for a minute. aiohttp cancels a handler whose caller
went away (the service runs with ``handler_cancellation``, so that a data-plane request stops
generating), and a fleet operation cut off half-way leaves engines half-changed: paused with the
fleet recorded as running, "restarting" for ever. So once an admin call has been accepted, it runs
to its end (or its own rollback) whether or not its caller is still there; the fleet's records
change only with the engines' answers, and a caller that comes back reads where things stand in
``/engines`` and ``/weight_info``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")

# Accepted calls still running: the loop holds tasks only weakly.
_ACCEPTED: set[asyncio.Task] = set()


async def carried_through(work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result; if the caller is cancelled meanwhile, ``work`` goes on to its end."""
    task = asyncio.ensure_future(work)
    _ACCEPTED.add(task)
    task.add_done_callback(_finished)
    return await asyncio.shield(task)


def _finished(task: asyncio.Task) -> None:
    _ACCEPTED.discard(task)
    # Read, so that nothing is reported as never retrieved: the errors middleware inside the task
    # has answered (and logged) whatever the handler raised.
    if not task.cancelled():
        task.exception()


def middleware(data_plane: frozenset[str]):
    """Every call that can change the service (not a GET, not the data plane, whose requests
    must stop with their callers) runs to its end whatever its caller does."""

    @web.middleware
    async def carry_through(request: web.Request, handler):
        resource = request.match_info.route.resource
        if request.method == "GET" or resource is None or resource.canonical in data_plane:
            return await handler(request)
        return await carried_through(handler(request))

    return carry_through
