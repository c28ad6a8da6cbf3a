"""The front's state machine over fake engines (tools/fake_engine.py): real engine processes,
sockets, probes, restarts and kills, with no model behind them, so that each case takes seconds.
The real-engine cases of the same failures are in test_supervision, test_faults, test_colocated and test_lora."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import re
import signal
from pathlib import Path

import pytest
from fakes import bodies, calls, fake_fleet, kill, script, states, until, whole_checkpoint

import skyinfer.fleet.supervisor
from skyinfer.fleet.registry import REGISTRY
from skyinfer.transfer.protocol import layout_id

from lora_support import make_adapter


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
    aiohttp_client, demo_model, tmp_path, group_init
):
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    pids = [r.pid for r in app[REGISTRY].records]
    await script(app, 1, {"fail": {"/start_weight_update": 500}})
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    meta = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[128]]}
    r = await client.post("/update_weights", json={"update_info": meta, "weight_version": "v1"})
    # Engine 0 may have been cut short by engine 1's failure before it answered (503): 502 then.
    statuses = [e["status"] for e in (await r.json())["engines"]]
    assert (r.status, statuses) in ((500, [200, 500]), (502, [503, 500])), (r.status, statuses)
    # Engine 1 failed by itself (its own start), engine 0 did not.
    assert [rec.push_failures for rec in app[REGISTRY].records] == [0, 1]
    info = await (await client.get("/weight_info")).json()
    assert info["update_phase"] == "idle" and not any(e["in_transfer_group"] for e in info["engines"])
    assert [e["stale_reason"].startswith("a weight update was aborted") for e in info["engines"]] == [True, True]
    assert [(r.pid, r.restarts) for r in app[REGISTRY].records] == [(pid, 0) for pid in pids]
    # The next push is refused with the code that tells a trainer to set its group up again.
    r = await client.post("/start_weight_update")
    assert r.status == 409 and (await r.json())["error"]["code"] == "transfer_group_gone"


async def test_a_one_call_push_is_one_call_per_engine_and_the_engines_run_again_once_all_took_it(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """A one-call push into running engines: each engine gets one ``/push`` (its pause, start,
    receive and finish inside it), then one ``/resume`` once every engine answered; none of the
    separate steps' routes is called."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    r = await client.post("/update_weights", json={"update_info": whole_checkpoint(demo_model), "weight_version": "v1"})
    assert r.status == 200, await r.text()
    for engine in (0, 1):
        weight_calls = {path: n for path, n in (await calls(app, engine)).items() if path not in ("/info", "/health")}
        assert weight_calls == {"/init_weight_transfer": 1, "/push": 1, "/resume": 1}, weight_calls
    assert await states(client) == ["ready", "ready"]
    info = await (await client.get("/weight_info")).json()
    assert [e["weight_version"] for e in info["engines"]] == ["v1", "v1"] and info["weight_version"] == "v1"


async def test_a_push_names_its_tensor_layout_alone_once_given_and_engines_get_it_until_each_took_it(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """A trainer gives its per-tensor fields once with their layout's id; its next pushes name the
    id alone (an id the server was never given is a 409 the trainer helpers answer by sending the
    fields again; a wrong id a 400). The engines are sent the id alone once each took a push of
    that layout; after an engine's process was replaced, every engine gets the fields again."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    tensors = whole_checkpoint(demo_model)
    layout = layout_id(tensors)

    async def push(update_info: dict, version: str):
        return await client.post("/update_weights", json={"update_info": update_info, "weight_version": version})

    async def sent_to_engines() -> list[dict]:
        return [(await bodies(app, engine))["/push"]["update_info"] for engine in (0, 1)]

    r = await push({"layout": layout}, "v0")
    assert r.status == 409 and (await r.json())["error"]["code"] == "unknown_layout", await r.text()
    r = await push({**tensors, "layout": "0" * 32}, "v0")
    assert r.status == 400 and "layout" in (await r.json())["error"]["message"]
    assert (await calls(app, 0)).get("/push") is None  # neither reached an engine
    r = await push({**tensors, "layout": layout}, "v1")
    assert r.status == 200, await r.text()
    assert [info["names"] for info in await sent_to_engines()] == [tensors["names"]] * 2
    info = await (await client.get("/weight_info")).json()
    assert info["last_push"]["layout"] == "given"
    r = await push({"layout": layout}, "v2")
    assert r.status == 200, await r.text()
    assert await sent_to_engines() == [{"layout": layout}] * 2
    info = await (await client.get("/weight_info")).json()
    assert info["weight_version"] == "v2" and info["last_push"]["layout"] == "named"

    old_pid = kill(app, 1)
    await until(
        lambda: asyncio.sleep(0, app[REGISTRY].records[1].pid not in (None, old_pid) and app[REGISTRY].records[1].up)
    )
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    r = await push({"layout": layout}, "v3")
    assert r.status == 200, await r.text()
    assert [info.get("names") for info in await sent_to_engines()] == [tensors["names"]] * 2
    r = await push({"layout": layout}, "v4")
    assert r.status == 200, await r.text()
    assert await sent_to_engines() == [{"layout": layout}] * 2


async def test_a_delta_push_is_refused_unless_every_engine_serves_its_base(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """A delta (``update_info.delta``) names the version it applies on: refused (409, before any
    engine is asked) while an engine serves another, taken once every engine serves it; a staged
    delta is refused (400); the push's bytes are counted as sent against the tensors' size."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    tensors = whole_checkpoint(demo_model)
    count = len(tensors["names"])

    async def push(version: str, base: str, **extra):
        delta = {"base_version": base, "changed": [0] * (count - 1) + [3]}
        body = {"update_info": {**tensors, "delta": delta}, "weight_version": version, **extra}
        return await client.post("/update_weights", json=body)

    r = await push("v1", "default-0")
    assert r.status == 409 and (await r.json())["error"]["code"] == "delta_base_mismatch", await r.text()
    assert "engine 0: default" in (await r.json())["error"]["message"]
    assert (await calls(app, 0)).get("/push") is None
    r = await client.post("/update_weights", json={"update_info": tensors, "weight_version": "v1"})
    assert r.status == 200, await r.text()
    r = await push("v2", "v1", staged=True)
    assert r.status == 400 and "staged" in (await r.json())["error"]["message"]
    r = await push("v2", "v1")
    assert r.status == 200, await r.text()
    info = await (await client.get("/weight_info")).json()
    dense = sum(4 * math.prod(shape) for shape in tensors["shapes"])
    # Three int32 positions and three float32 values, each part padded to 8 bytes.
    assert info["last_push"]["bytes"] == {"sent": 16 + 16, "dense": dense}, info["last_push"]
    metrics = await (await client.get("/metrics")).text()
    counted = re.findall(r'^skyinfer_weight_update_bytes_total\{carried="(\w+)"\} (\S+)$', metrics, re.M)
    assert {kind: float(n) for kind, n in counted} == {"sent": dense + 16 + 16, "dense": 2 * dense}, counted

    # A new process of engine 1, caught up with v2 from its peer, keeps no base for a delta: the
    # next delta is refused, a dense push accepted, and a delta on that one taken again.
    killed = kill(app, 1)
    await until(
        lambda: asyncio.sleep(
            0,
            app[REGISTRY].records[1].pid != killed
            and [(r.state.value, r.weight_version) for r in app[REGISTRY].records] == [("ready", "v2")] * 2,
        )
    )
    r = await client.post("/init_weight_transfer", json={"init_info": group_init})
    assert r.status == 200, await r.text()
    r = await push("v3", "v2")
    assert r.status == 409 and (await r.json())["error"]["code"] == "delta_base_mismatch", await r.text()
    assert "engine 1: v2, keeping no base" in (await r.json())["error"]["message"]
    r = await client.post("/update_weights", json={"update_info": tensors, "weight_version": "v3"})
    assert r.status == 200, await r.text()
    assert (await push("v4", "v3")).status == 200


@pytest.mark.parametrize("step", ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update"])
async def test_a_one_call_push_one_engine_fails_at_any_step_is_served_by_no_engine(
    aiohttp_client, demo_model, tmp_path, group_init, step
):
    """Engine 1 fails its one-call push at ``step`` (engine 0 took all of it, the last case its new
    label included): the push fails, the fleet's version stays, both engines are held out stale
    (the next push's to mend) and run again (no engine is left paused), without a restart."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    pids = [r.pid for r in app[REGISTRY].records]
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    await script(app, 1, {"fail": {step: 500}})
    r = await client.post("/update_weights", json={"update_info": whole_checkpoint(demo_model), "weight_version": "v1"})
    assert r.status in (500, 502), await r.text()
    info = await (await client.get("/weight_info")).json()
    assert info["update_phase"] == "idle" and info["weight_version"] != "v1" and info["last_push"] is None, info
    assert [e["stale_reason"].startswith("a weight update was aborted") for e in info["engines"]] == [True, True]
    assert await states(client) == ["stale", "stale"]
    assert [(await calls(app, e)).get("/resume") for e in (0, 1)] == [1, 1 if step != "/pause" else None]
    assert [(r.pid, r.restarts) for r in app[REGISTRY].records] == [(pid, 0) for pid in pids]


async def _a_push_engine_0_is_slow_to_end(aiohttp_client, demo_model, tmp_path, group_init, abort_s: float):
    """A fake fleet in the trainer's group; a push engine 1 fails, and whose abort takes engine 0
    ``abort_s``: it answers without waiting for engine 0, the update over, engine 0 receiving."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    await script(app, 0, {"delay_s": {"/abort_weight_update": abort_s}})
    await script(app, 1, {"fail": {"/update_weights": 500}})
    meta = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[128]]}
    r = await client.post("/update_weights", json={"update_info": meta, "weight_version": "v1"})
    assert r.status in (500, 502), await r.text()
    info = await (await client.get("/weight_info")).json()
    assert info["update_phase"] == "idle" and await states(client) == ["receiving", "stale"]
    return app, client


async def test_an_engine_slow_to_end_an_aborted_push_ends_it_beside_the_fleet(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """Engine 1 fails its part of a push while engine 0 takes 15 s to end the update (as an engine
    whose workers are inside the trainer's broken collective answers at the group's timeout): the
    push fails without waiting for it, the update over and engine 0 shown receiving (the front's
    lock is free: an engine that crashed meanwhile could come back). A reload is refused 409 naming
    it; a new trainer's init waits for it; it is then stale and resumed, as the push paused it; the
    next push covers both."""
    app, client = await _a_push_engine_0_is_slow_to_end(aiohttp_client, demo_model, tmp_path, group_init, 15)
    r = await client.post("/reload_weights")
    assert r.status == 409 and "engine 0: it is still ending an aborted weight update" in await r.text()
    await script(app, 1, {})
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    engines = (await (await client.get("/engines")).json())["engines"]
    assert [(e["state"], e["paused"]) for e in engines] == [("stale", False), ("stale", False)]
    r = await client.post("/update_weights", json={"update_info": whole_checkpoint(demo_model), "weight_version": "v2"})
    assert r.status == 200 and await states(client) == ["ready", "ready"], await r.text()


async def test_an_engine_killed_while_it_ends_an_aborted_push_comes_back_and_holds_nothing_up(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """As above, engine 0 still ending the aborted update, when its process is SIGKILLed: it comes
    back in a new process, not receiving; the next init does not wait for the dead process's call
    (the group's timeout plus 30 s, 150 s here), and the next push covers both."""
    app, client = await _a_push_engine_0_is_slow_to_end(aiohttp_client, demo_model, tmp_path, group_init, 600)
    pid = kill(app, 0)
    await until(lambda: asyncio.sleep(0, app[REGISTRY].records[0].pid != pid and app[REGISTRY].records[0].up))
    await script(app, 1, {})
    init = client.post("/init_weight_transfer", json={"init_info": group_init})
    assert (await asyncio.wait_for(init, 60)).status == 200
    assert (await states(client))[0] != "receiving"
    r = await client.post("/update_weights", json={"update_info": whole_checkpoint(demo_model), "weight_version": "v2"})
    assert r.status == 200 and await states(client) == ["ready", "ready"], await r.text()


async def _stream_past_first_token(client, body: dict):
    """A chat stream that has sent the caller a token: its engine, and a task reading the rest."""
    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    first = await r.content.readline()
    assert first.startswith(b"data: {"), first

    async def rest() -> bytes:
        return first + await r.content.read()

    return int(r.headers["X-Skyinfer-Engine"]), asyncio.create_task(rest())


@pytest.mark.parametrize("paused", [False, True], ids=["running", "paused"])
async def test_requests_on_a_killed_engine_are_answered_by_the_other(aiohttp_client, demo_model, tmp_path, paused):
    """Engine 1's process SIGKILLed while 16 requests and 4 streams that have sent tokens run, or
    while the fleet is paused (keep): every request is answered in full by engine 0, those engine 1
    held saying so; engine 1's streams end with an error event, engine 0's finish. Paused, engine 1's
    requests wait on engine 0, paused like any new request, and /resume says engine 1 is down.
    (The real-engine case, vLLM's EngineCore SIGKILLed while decoding, is in test_supervision.)"""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    for engine in (0, 1):
        await script(app, engine, {"tokens_per_s": 200})
    # Each prompt its own (no group affinity): the least-loaded engine takes every other request.
    chat = {"model": str(demo_model), "max_tokens": 400}
    streams = [
        await _stream_past_first_token(
            client, {**chat, "max_tokens": 2000, "messages": [{"role": "user", "content": f"Stream {i}."}]}
        )
        for i in range(4)
    ]
    assert {engine for engine, _ in streams} == {0, 1}
    assert (await client.post("/pause", params={"mode": "keep"})).status == 200
    requests = [
        client.post("/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": f"{i}. Go on."}]})
        for i in range(8)
    ]
    requests += [
        client.post("/inference/v1/generate", json={"token_ids": [i, 2], "sampling_params": {"max_tokens": 400}})
        for i in range(8)
    ]
    tasks = [asyncio.ensure_future(r) for r in requests]
    await until(lambda: asyncio.sleep(0, sum(r.in_flight_count for r in app[REGISTRY].records) == 20))
    if not paused:
        assert (await client.post("/resume")).status == 200
        await asyncio.sleep(0.3)  # generating on both engines
    kill(app, 1)
    if paused:
        await until(lambda: asyncio.sleep(0, app[REGISTRY].records[1].state.value != "paused"))
        r = await client.post("/resume")
        assert r.status == 503 and [(e["engine"], e["status"]) for e in (await r.json())["engines"]] == [
            (0, 200),
            (1, 503),
        ]
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    assert sum(r.headers.get("X-Skyinfer-Retried-From") == "1" for r in results) == 8
    for r in results:
        body = await r.json()
        assert r.status == 200 and r.headers["X-Skyinfer-Engine"] == "0", body
        choice = body["choices"][0]
        assert (len(choice["token_ids"]) if "token_ids" in choice else body["usage"]["completion_tokens"]) == 400
    for engine, stream in streams:
        events = (await asyncio.wait_for(stream, timeout=30)).decode()
        if engine == 1:
            assert '"error"' in events, events[-300:]
        else:
            assert '"error"' not in events and '"finish_reason":"length"' in events, events[-300:]


async def test_a_restart_that_fails_unexpectedly_is_retried_after_twice_the_backoff(
    aiohttp_client, demo_model, tmp_path, caplog
):
    """Engine 0 dies and its restart itself fails with an error nobody planned for (its socket path
    is a directory, so starting raises IsADirectoryError): it does not stay "restarting"; it is
    declared dead again, retried after twice the backoff, and comes back."""
    caplog.set_level(logging.INFO, logger="skyinfer")
    app, _ = await fake_fleet(aiohttp_client, demo_model, tmp_path, restart_backoff_s=1.0)
    record = app[REGISTRY].records[0]
    pid = kill(app, 0)
    await until(lambda: asyncio.sleep(0, record.state.value == "dead"))
    # Within the restart backoff.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record.socket_path)
    os.mkdir(record.socket_path)
    try:
        await until(lambda: asyncio.sleep(0, "IsADirectoryError" in caplog.text))
        assert record.state.value in ("dead", "restarting")
    finally:
        os.rmdir(record.socket_path)
    await until(lambda: asyncio.sleep(0, [r.state.value for r in app[REGISTRY].records] == ["ready", "ready"]))
    assert record.pid != pid and record.restarts >= 2
    delays = [float(d) for d in re.findall(r"engine 0: restarting in ([0-9.]+)s", caplog.text)]
    assert len(delays) >= 2 and all(b == 2 * a for a, b in itertools.pairwise(delays)), delays


async def test_an_engine_that_served_a_while_restarts_at_once_and_one_that_dies_again_soon_backs_off(
    aiohttp_client, demo_model, tmp_path, caplog, monkeypatch
):
    """The backoff slows a restart loop down, not a crash: engine 0, killed after serving longer
    than the threshold (shortened here to 1 s), restarts at once; killed again right after it is
    up, it waits out the backoff (the second crash in a row: twice ``--restart-backoff``)."""
    caplog.set_level(logging.INFO, logger="skyinfer")
    monkeypatch.setattr(skyinfer.fleet.supervisor, "SERVED_BEFORE_AN_IMMEDIATE_RESTART_S", 1.0)
    app, _ = await fake_fleet(aiohttp_client, demo_model, tmp_path, restart_backoff_s=0.5, warm_spares=0)
    record = app[REGISTRY].records[0]
    await asyncio.sleep(1.5)
    pid = kill(app, 0)
    await until(lambda: asyncio.sleep(0, record.up and record.pid != pid))
    pid = kill(app, 0)
    await until(lambda: asyncio.sleep(0, record.up and record.pid != pid))
    delays = [float(d) for d in re.findall(r"engine 0: restarting in ([0-9.]+)s", caplog.text)]
    assert delays == [0.0, 1.0], delays


async def test_an_unload_with_a_hung_engine_takes_the_name_out_at_once_and_restarts_that_engine(
    aiohttp_client, demo_model, tmp_path
):
    """Engine 1 does not answer an unload: the name is out of routing at once (404, no request
    reaches an engine that may still hold it), engine 0 unloads it, the call answers 504 per engine
    after the timeout, engine 1 is restarted and comes back holding exactly the fleet's other
    adapters, and the unloaded version's directory is gone from the store. (The real-engine case, a
    SIGSTOPped engine during a load, is in test_lora.)"""
    store = tmp_path / "store"
    app, client = await fake_fleet(
        aiohttp_client,
        demo_model,
        tmp_path,
        engine_args=("--enable-lora", "--max-lora-rank", "8"),
        adapter_dir=str(store),
        weight_transfer_timeout_s=2.0,
    )
    for name, seed in (("kept", 1), ("doomed", 2)):
        adapter = make_adapter(demo_model, tmp_path / name, seed)
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter)})
        assert r.status == 200, await r.text()
    kept = Path(app[REGISTRY].fleet_adapters["kept"].directory)
    records = app[REGISTRY].records
    pids = [r.pid for r in records]
    await script(app, 1, {"hang": ["/adapters/unload"]})
    unloading = asyncio.ensure_future(client.post("/v1/unload_lora_adapter", json={"lora_name": "doomed"}))
    await until(lambda: asyncio.sleep(0, "doomed" not in app[REGISTRY].fleet_adapters))
    during = await client.post("/v1/completions", json={"model": "doomed", "prompt": "x", "max_tokens": 2})
    assert during.status == 404 and not unloading.done()
    r = await unloading
    assert r.status == 504, await r.text()
    assert [(e["engine"], e["status"]) for e in (await r.json())["engines"]] == [(0, 200), (1, 504)]
    await until(lambda: asyncio.sleep(0, records[1].pid != pids[1] and records[1].state.value == "ready"))
    assert records[0].pid == pids[0] and set(store.iterdir()) == {kept}
    for record in records:
        async with record.client.get("/v1/models") as listed:
            assert {m["id"] for m in (await listed.json())["data"]} == {str(demo_model), "kept"}
    assert (await client.post("/v1/completions", json={"model": "doomed", "prompt": "x"})).status == 404
    # Loaded again, it serves again.
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "doomed", "lora_path": str(tmp_path / "doomed")})
    assert r.status == 200, await r.text()
    assert (await client.post("/v1/completions", json={"model": "doomed", "prompt": "x"})).status == 200
    assert (await client.post("/v1/completions", json={"model": "kept", "prompt": "x", "max_tokens": 2})).status == 200


async def test_a_hung_engine_is_declared_dead_its_requests_and_sessions_move_and_it_rejoins_outside_the_group(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """Engine 1's process stops (SIGSTOP) while 16 requests run: its probes declare it dead, its
    requests are answered in full by engine 0 and its sticky session moves there; admin calls
    meanwhile are reported per engine. It is restarted, and comes back outside the trainer's
    transfer group: a push is refused with the code that says so. (Real engines hung: SIGSTOP
    during a LoRA load in test_lora, an EngineCore stopped mid-push in test_colocated.)"""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    records = app[REGISTRY].records
    for engine in (0, 1):
        await script(app, engine, {"tokens_per_s": 200})
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    body = {"model": str(demo_model), "max_tokens": 400}
    sticky = {}
    for i in range(8):
        r = await client.post("/v1/completions", json={**body, "max_tokens": 2}, headers={"X-Session-ID": f"s{i}"})
        sticky.setdefault(int(r.headers["X-Skyinfer-Engine"]), f"s{i}")
    assert set(sticky) == {0, 1}
    # Each prompt its own (no group affinity): half of them on each engine.
    tasks = [asyncio.ensure_future(client.post("/v1/completions", json={**body, "prompt": f"p{i}"})) for i in range(16)]
    await until(lambda: asyncio.sleep(0, [r.in_flight_count for r in records] == [8, 8]))
    hung = records[1].pid
    os.kill(hung, signal.SIGSTOP)
    await until(lambda: asyncio.sleep(0, records[1].state.value != "ready"))
    # While it is down: an admin call is reported per engine, never hidden behind a 200.
    r = await client.post("/pause", params={"mode": "keep"})
    assert r.status == 503 and "engine 1" in (await r.json())["error"]["message"]
    assert [(e["engine"], e["status"]) for e in (await r.json())["engines"]] == [(0, 200), (1, 503)]
    r = await client.post("/resume")
    assert r.status == 503 and [(e["engine"], e["status"]) for e in (await r.json())["engines"]] == [(0, 200), (1, 503)]
    # Its sticky session moves to the live engine, and stays there.
    moved = {"json": {**body, "max_tokens": 2}, "headers": {"X-Session-ID": sticky[1]}}
    r = await client.post("/v1/completions", **moved)
    assert r.status == 200 and r.headers["X-Skyinfer-Engine"] == "0"
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    assert sum(r.headers.get("X-Skyinfer-Retried-From") == "1" for r in results) == 8
    for r in results:
        assert r.status == 200 and r.headers["X-Skyinfer-Engine"] == "0"
        assert (await r.json())["usage"]["completion_tokens"] == 400
    await until(lambda: asyncio.sleep(0, [r.state.value for r in records] == ["ready", "ready"]))
    assert records[1].pid != hung and records[1].restarts == 1
    assert (await client.post("/v1/completions", **moved)).headers["X-Skyinfer-Engine"] == "0"
    assert [r.in_transfer_group for r in records] == [True, False]
    r = await client.post("/start_weight_update")
    assert r.status == 409 and (await r.json())["error"]["code"] == "transfer_group_gone"


async def test_an_engine_whose_probes_fail_writes_its_threads_stacks_before_it_is_killed(
    aiohttp_client, demo_model, tmp_path, capfd
):
    """Engine 1's event loop is held by a request's handler (as a refusal logged whole held a real
    engine's): its probes fail, and before the front kills it, the engine writes every thread's
    stack to its output, the handler holding the loop among them. It is restarted, and the request
    is answered by engine 0."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    records = app[REGISTRY].records
    body = {"model": str(demo_model), "max_tokens": 2}
    session = None
    for i in range(32):
        r = await client.post("/v1/completions", json=body, headers={"X-Session-ID": f"s{i}"})
        if r.headers["X-Skyinfer-Engine"] == "1":
            session = f"s{i}"
            break
    assert session is not None
    await script(app, 1, {"block_s": {"/v1/completions": 120}})
    held = records[1].pid
    r = await client.post("/v1/completions", json=body, headers={"X-Session-ID": session})
    assert r.status == 200 and r.headers["X-Skyinfer-Engine"] == "0" and r.headers["X-Skyinfer-Retried-From"] == "1"
    await until(lambda: asyncio.sleep(0, [r.state.value for r in records] == ["ready", "ready"]))
    assert records[1].pid != held and records[1].restarts == 1
    output = capfd.readouterr().err
    assert "[engine 1] Current thread 0x" in output, "engine 1 wrote no stacks before it was killed"
    stacks = output[output.index("[engine 1] Current thread 0x") :]
    holding_frame = r"\[engine 1\]   File \".*tools/fake_engine\.py\", line \d+ in _hold_the_loop"
    assert re.search(holding_frame, stacks), stacks[:3000]


async def test_a_stream_whose_caller_expects_100_continue_is_relayed(aiohttp_client, demo_model, tmp_path):
    """``Expect: 100-continue`` (curl sends it for large bodies) is the front's to answer: an engine
    asked it too would answer an interim head the relay must not take for the stream's own."""
    _, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    body = {"model": str(demo_model), "prompt": "x", "max_tokens": 3, "stream": True}
    r = await client.post("/v1/completions", json=body, expect100=True)
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in (await r.read()).split(b"\n\n") if e]
    assert len(events) == 4 and events[-1] == b"data: [DONE]", events


async def test_a_weight_checker_reset_holds_every_engine_out_until_a_push_of_the_whole_checkpoint(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """vLLM's weight checker ``reset`` zeroes every engine's weights: each is held out (stale,
    saying why) and serves nothing; a push of the whole checkpoint brings both back."""
    _app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path, hold_requests_s=0)
    r = await client.post("/weight_checker", json={"action": "reset"})
    body = await r.json()
    assert r.status == 200 and body["status"] == "reset" and body["held_out"] == [0, 1], body
    engines = (await (await client.get("/engines")).json())["engines"]
    assert [e["state"] for e in engines] == ["stale", "stale"] and all("zeroed" in e["stale_reason"] for e in engines)
    assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status == 503
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    r = await client.post("/update_weights", json={"update_info": whole_checkpoint(demo_model), "weight_version": "v"})
    assert r.status == 200, await r.text()
    assert await states(client) == ["ready", "ready"]


async def test_weight_info_says_where_the_last_push_went_stage_by_stage(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """Engine 1 takes 0.6 s to receive and 0.3 s to finish: the last push's stages in
    ``/weight_info`` put those seconds where they went (each stage as its slowest engine took it),
    the other stages take next to nothing, and the whole is at least their sum. A push that fails
    leaves the last finished one's account as it was."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    assert (await (await client.get("/weight_info")).json())["last_push"] is None
    await script(app, 1, {"delay_s": {"/update_weights": 0.6, "/finish_weight_update": 0.3}})
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    r = await client.post("/update_weights", json={"update_info": whole_checkpoint(demo_model), "weight_version": "v1"})
    assert r.status == 200, await r.text()
    last = (await (await client.get("/weight_info")).json())["last_push"]
    stages = last["stages"]
    assert last["weight_version"] == "v1" and list(stages) == ["pause", "start", "receive", "finish", "resume"], last
    assert 0.6 <= stages["receive"] < 2.0 and 0.3 <= stages["finish"] < 0.6, last
    assert all(stages[s] < 0.3 for s in ("pause", "start", "resume")), last
    assert last["seconds"] >= sum(stages.values()), last
    await script(app, 1, {"fail": {"/update_weights": 500}})
    r = await client.post("/update_weights", json={"update_info": whole_checkpoint(demo_model), "weight_version": "v2"})
    # 500 as engine 1 answered, or 502 where engine 1 failed before engine 0 answered and engine 0's
    # call was cut short (503): the engines' statuses then differ.
    assert r.status in (500, 502), await r.text()
    assert (await (await client.get("/weight_info")).json())["last_push"] == last
