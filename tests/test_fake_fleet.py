"""The front's state machine over fake engines (tools/fake_engine.py): real engine processes,
sockets, probes, restarts and kills, with no model behind them, so that each case takes seconds.
The real-engine cases of the same failures are in test_recovery, test_supervision and test_faults."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

from aiohttp import web

from skyinfer.app import create_app
from skyinfer.config import ServeConfig
from skyinfer.proxy import REGISTRY
from skyinfer.supervisor import SUPERVISOR

FAKE_ENGINE = str(Path(__file__).resolve().parent.parent / "tools" / "fake_engine.py")


async def fake_fleet(aiohttp_client, demo_model, tmp_path, **options):
    config = ServeConfig(
        model=str(demo_model),
        engines=2,
        device="cpu",
        socket_dir=str(tmp_path),
        restart_backoff_s=0.1,
        health_interval_s=0.5,
        health_timeout_s=1.0,
        engine_command=(sys.executable, FAKE_ENGINE),
        **options,
    )
    app = create_app(config)
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


async def test_requests_are_held_while_every_engine_restarts_and_answered_after(aiohttp_client, demo_model, tmp_path):
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path, hold_requests_s=30)
    for engine in (0, 1):
        kill(app, engine)
    await until(lambda: asyncio.sleep(0, not any(r.serves for r in app[REGISTRY].records)))
    answers = await asyncio.gather(
        *(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}) for _ in range(16))
    )
    assert [r.status for r in answers] == [200] * 16
    await until(lambda: asyncio.sleep(0, [r.state.value for r in app[REGISTRY].records] == ["ready", "ready"]))


async def test_a_request_held_past_the_limit_is_a_503_with_retry_after(aiohttp_client, demo_model, tmp_path):
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path, hold_requests_s=0.5, max_restarts=0)
    for engine in (0, 1):
        kill(app, engine)
    await until(lambda: asyncio.sleep(0, [r.state.value for r in app[REGISTRY].records] == ["retired", "retired"]))
    r = await client.post("/v1/completions", json={"prompt": "x"})
    assert r.status == 503 and int(r.headers["Retry-After"]) > 0
    assert "engine 1 retired" in (await r.json())["error"]["message"]
    assert (await client.get("/ready")).status == 503  # no engine left in the fleet


async def test_an_engine_that_keeps_dying_is_retired_then_rejoins_on_request(aiohttp_client, demo_model, tmp_path):
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path, max_restarts=2)
    records = app[REGISTRY].records
    killed = set()
    while records[1].state.value != "retired":
        if records[1].up and records[1].pid not in killed:
            killed.add(kill(app, 1))
        await asyncio.sleep(0.02)
    assert len(killed) == 3  # two restarts in a row allowed; the third death retires it
    assert (await client.get("/ready")).status == 200
    assert (await (await client.get("/get_world_size")).json())["world_size"] == 1
    # Fleet calls leave it out: whole on the engine that serves.
    r = await client.post("/pause", params={"mode": "keep"})
    assert r.status == 200 and [e["engine"] for e in (await r.json())["engines"]] == [0]
    assert (await client.post("/resume")).status == 200
    assert (await client.post("/engines/7/restart")).status == 404
    r = await client.post("/engines/1/restart")
    assert r.status == 200 and (await r.json())["engine"]["state"] == "ready"
    assert await states(client) == ["ready", "ready"]
    assert (await (await client.get("/get_world_size")).json())["world_size"] == 2
    # Its failures were forgotten: one more death is a restart, not a retirement.
    kill(app, 1)
    await until(lambda: asyncio.sleep(0, records[1].state.value == "dead"))
    await until(lambda: asyncio.sleep(0, records[1].state.value == "ready"))


async def test_a_restart_the_operator_asks_for_while_one_runs_is_a_409(aiohttp_client, demo_model, tmp_path):
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    first = asyncio.ensure_future(client.post("/engines/0/restart"))
    await until(lambda: asyncio.sleep(0, app[REGISTRY].records[0].state.value == "restarting"))
    second = await client.post("/engines/0/restart")
    assert second.status == 409 and "restarting" in (await second.json())["error"]["message"]
    assert (await first).status == 200


async def test_an_admin_call_one_engine_fails_is_reported_per_engine_and_not_hidden(
    aiohttp_client, demo_model, tmp_path
):
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    await script(app, 1, {"fail": {"/pause": 500}})
    r = await client.post("/pause", params={"mode": "keep"})
    assert r.status == 500 and [(e["engine"], e["status"]) for e in (await r.json())["engines"]] == [(0, 200), (1, 500)]
    # The engine that failed is asked what it is rather than guessed at.
    assert await states(client) == ["paused", "ready"]


async def test_a_push_step_one_engine_fails_ends_the_update_everywhere_without_a_restart(
    aiohttp_client, demo_model, tmp_path
):
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    pids = [r.pid for r in app[REGISTRY].records]
    await script(app, 1, {"fail": {"/start_weight_update": 500}})
    init = {"master_address": "127.0.0.1", "master_port": 29999, "world_size": 3}
    assert (await client.post("/init_weight_transfer", json={"init_info": init})).status == 200
    meta = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[128]]}
    r = await client.post("/update_weights", json={"update_info": meta, "weight_version": "v1"})
    assert r.status == 500 and [e["status"] for e in (await r.json())["engines"]] == [200, 500]
    info = await (await client.get("/weight_info")).json()
    assert info["update_phase"] == "idle" and not any(e["in_transfer_group"] for e in info["engines"])
    assert [e["stale_reason"].startswith("a weight update was aborted") for e in info["engines"]] == [True, True]
    assert [(r.pid, r.restarts) for r in app[REGISTRY].records] == [(pid, 0) for pid in pids]
    # The next push is refused with the code that tells a trainer to set its group up again.
    r = await client.post("/start_weight_update")
    assert r.status == 409 and (await r.json())["error"]["code"] == "transfer_group_gone"


async def script(app: web.Application, engine: int, behaviour: dict) -> None:
    async with app[REGISTRY].records[engine].client.post("/fake/script", json=behaviour) as r:
        assert r.status == 200
