"""The front: ``create_app(config)`` builds the aiohttp application."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import aiohttp
from aiohttp import web

from .config import ServeConfig
from .control import CONTROL, ControlPlane, add_control_routes
from .devices import detect_device_kind, plan_engine_devices
from .errors import json_response, openai_errors_middleware
from .proxy import DATA_PLANE_GET, DATA_PLANE_POST, REGISTRY, forward
from .state import EngineRecord, EngineRegistry
from .supervisor import Supervisor
from .weights.sync import WEIGHT_SYNC, WeightSync, add_weight_routes

SUPERVISOR = web.AppKey("supervisor", Supervisor)


def build_registry(config: ServeConfig, socket_dir: str) -> EngineRegistry:
    kind = detect_device_kind() if config.device == "auto" else config.device
    plans = plan_engine_devices(kind, config.engines, config.workers_per_engine, config.cpu_kvcache_gib)
    records = [
        EngineRecord(engine_id=i, devices=plan, socket_path=os.path.join(socket_dir, f"engine-{i}.sock"))
        for i, plan in enumerate(plans)
    ]
    return EngineRegistry(records, config.max_sessions)


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


async def engines_view(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    timeout_s = request.app[SUPERVISOR].config.engine_probe_timeout_s
    engines = await asyncio.gather(*(_engine_status(r, timeout_s) for r in registry.records))
    return json_response({"engines": engines})


async def health(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY]
    engines = [r.describe() for r in registry.records]
    serving = len(registry.serving())
    body = {"status": "ok" if serving else "unavailable", "serving_engines": serving, "engines": engines}
    return json_response(body, status=200 if serving else 503)


def create_app(config: ServeConfig) -> web.Application:
    app = web.Application(middlewares=[openai_errors_middleware], client_max_size=config.max_request_bytes)
    own_socket_dir = config.socket_dir is None
    socket_dir = tempfile.mkdtemp(prefix="skyinfer-") if own_socket_dir else config.socket_dir
    registry = build_registry(config, socket_dir)
    supervisor = Supervisor(registry, config)
    app[REGISTRY] = registry
    app[SUPERVISOR] = supervisor
    app[CONTROL] = ControlPlane(registry, config.control_timeout_s)
    app[WEIGHT_SYNC] = WeightSync(
        registry, config.workers_per_engine, config.model, config.weight_transfer_timeout_s, supervisor.restart_in_background
    )

    async def engines_ctx(_app: web.Application):
        supervisor.start()
        yield
        await supervisor.stop()
        if own_socket_dir:
            shutil.rmtree(socket_dir, ignore_errors=True)

    app.cleanup_ctx.append(engines_ctx)
    for path in DATA_PLANE_POST:
        app.router.add_post(path, forward)
    for path in DATA_PLANE_GET:
        app.router.add_get(path, forward)
    add_control_routes(app)
    add_weight_routes(app)
    app.router.add_get("/health", health)
    app.router.add_get("/engines", engines_view)
    return app
