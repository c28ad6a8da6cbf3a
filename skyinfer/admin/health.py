"""Health, readiness and the engine table.

``/health`` is for a load balancer: 200 while at least one engine can serve.
``/ready`` is for whoever waits on the whole fleet (a training script after
start-up or a restart): 200 only when every engine of the fleet is ``ready``
(a retired engine is out of the fleet).
``/engines`` adds what each engine reports live.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from aiohttp import web

from ..errors import json_response
from ..fleet.registry import REGISTRY
from ..fleet.state import EngineRecord, EngineState


async def health(request: web.Request) -> web.Response:
    """200 while at least one engine can serve (for a load balancer); every engine's state."""
    registry = request.app[REGISTRY]
    serving = len(registry.serving())
    body = {
        "status": "ok" if serving else "unavailable",
        "serving_engines": serving,
        "engines": [r.describe() for r in registry.records],
    }
    return json_response(body, status=200 if serving else 503)


async def ready(request: web.Request) -> web.Response:
    """200 when every engine of the fleet is ready (a retired engine is out of it)."""
    registry = request.app[REGISTRY]
    members = registry.members()
    waiting = [r for r in members if r.state is not EngineState.READY]
    body = {
        "ready": bool(members) and not waiting,
        "not_ready": [{"engine": r.engine_id, "state": r.state.value} for r in waiting],
        "retired": [r.engine_id for r in registry.records if r.retired],
        "engines": len(registry.records),
    }
    return json_response(body, status=200 if body["ready"] else 503)


async def _engine_status(record: EngineRecord, timeout_s: float) -> dict:
    """The front's view of one engine plus what the engine itself reports."""
    view = record.describe()
    view["unfinished_requests"] = None
    if record.client is not None:
        try:
            async with record.client.get("/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status == 200:
                    view["unfinished_requests"] = (await resp.json())["unfinished_requests"]
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
    return view


def engines_view(probe_timeout_s: float, quantization: Callable[[], dict | None]):
    """``quantization``: what the engines serve quantized (``/weight_info`` has the whole story)."""

    async def view(request: web.Request) -> web.Response:
        """Every engine: state, process, devices, weights, quantization, load, and what it reports itself."""
        records = request.app[REGISTRY].records
        engines = await asyncio.gather(*(_engine_status(r, probe_timeout_s) for r in records))
        served = quantization()
        for engine in engines:  # every engine serves the same checkpoint, with the same arguments
            engine["quantization"] = None if served is None else served["method"]
        return json_response({"engines": engines})

    return view
