"""Fake fleets for the front's own tests: the real service over fake engines (tools/fake_engine.py),
real processes and sockets, no model behind them."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import attrs
from aiohttp import web

from skyinfer.config import ServeConfig
from skyinfer.fleet.registry import REGISTRY
from skyinfer.fleet.supervisor import SUPERVISOR
from skyinfer.front.app import create_app
from skyinfer.weights.checkpoint import safetensors_shapes

FAKE_ENGINE = str(Path(__file__).resolve().parent.parent / "tools" / "fake_engine.py")


async def fake_fleet(aiohttp_client, demo_model, tmp_path, **options):
    """Two fake engines on CPU, with probes and restarts fast enough for a test."""
    options = {"restart_backoff_s": 0.1, "health_interval_s": 0.5, "health_timeout_s": 1.0, **options}
    config = ServeConfig(model=str(demo_model), engines=2, device="cpu", socket_dir=str(tmp_path), **options)
    return await serve_fakes(aiohttp_client, config)


async def serve_fakes(aiohttp_client, config: ServeConfig):
    """The service ``config`` describes, its engines fake ones: the app and a client, once they are ready."""
    app = create_app(attrs.evolve(config, engine_command=(sys.executable, FAKE_ENGINE)))
    client = await aiohttp_client(app)
    await app[SUPERVISOR].wait_ready()
    return app, client


async def states(client) -> list[str]:
    return [e["state"] for e in (await (await client.get("/engines")).json())["engines"]]


async def until(predicate, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while not (value := await predicate()):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    return value


def kill(app: web.Application, engine: int) -> int:
    pid = app[REGISTRY].records[engine].pid
    os.killpg(pid, signal.SIGKILL)
    return pid


async def script(app: web.Application, engine: int, behaviour: dict) -> None:
    async with app[REGISTRY].records[engine].client.post("/fake/script", json=behaviour) as r:
        assert r.status == 200


async def calls(app: web.Application, engine: int) -> dict[str, int]:
    """How many times each route of an engine's process was called."""
    async with app[REGISTRY].records[engine].client.get("/fake/calls") as r:
        return await r.json()


async def bodies(app: web.Application, engine: int) -> dict[str, dict]:
    """The last JSON body each weight route of an engine's process got."""
    async with app[REGISTRY].records[engine].client.get("/fake/bodies") as r:
        return await r.json()


def whole_checkpoint(demo_model) -> dict:
    """update_info naming every tensor the demo checkpoint stores."""
    shapes = safetensors_shapes(demo_model / "model.safetensors")
    names = sorted(shapes)
    return {"names": names, "dtype_names": ["float32"] * len(names), "shapes": [list(shapes[n]) for n in names]}
