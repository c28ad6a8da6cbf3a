"""Nothing a caller abandons can wedge the fleet, over fake engines (real front, real engine
processes, sockets and probes; scripted delays and failures): every admin call whose caller gives
up half-way runs to its end, an update the server abandoned is never revived by its trainer's next
chunk, a failed pause, resume or sleep is read back from the engine, only a push of the whole
checkpoint brings a stale engine back, an engine that fails every push is retired, the probes leave
an engine alone while it answers the front, and bringing an engine up holds no other call back.
The real-engine case (restart, sleep, wait-pause and init abandoned, then a real trainer's push) is
test_weight_sync's."""

from __future__ import annotations

import asyncio
import json
import math
import socket

import pytest
from fakes import calls, fake_fleet, kill, script, states, until, whole_checkpoint

from skyinfer.devices import EngineDevices
from skyinfer.fleet.registry import REGISTRY
from skyinfer.weights import staged
from skyinfer.weights.checkpoint import safetensors_shapes

from lora_support import make_adapter

# A fake engine's admin routes answer at once; scripted, they take this long, and their caller
# gives up a fraction of it in.
SLOW_S = 1.5
GIVE_UP_S = 0.3


async def abandon(client, method: str, path: str, after_s: float = GIVE_UP_S, **kwargs) -> None:
    """A caller that gives up ``after_s`` into its call: its connection closes, as an HTTP
    client's timeout or an operator's Ctrl-C closes it."""
    try:
        r = await asyncio.wait_for(client.request(method, path, **kwargs), after_s)
    except asyncio.TimeoutError:
        return
    raise AssertionError(f"{path} answered {r.status} before its caller gave up: {await r.text()}")


def pushed_adapter(demo_model) -> dict:
    """An adapter of rank 8 on layer 0's q_proj, as a trainer pushes it over its group."""
    q_proj = safetensors_shapes(demo_model / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    return {
        "lora_name": "pushed",
        "peft_config": {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]},
        "update_info": {
            "names": [f"{module}.lora_A.weight", f"{module}.lora_B.weight"],
            "dtype_names": ["float32", "float32"],
            "shapes": [[8, q_proj[1]], [q_proj[0], 8]],
        },
    }


ONE_TENSOR = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[128]]}


async def weight_info(client) -> dict:
    return await (await client.get("/weight_info")).json()


async def serves_on_every_engine(client, demo_model, requests: int = 16) -> None:
    """Requests with sessions of their own all answer in full, on both engines."""
    body = {"model": str(demo_model), "prompt": "x", "max_tokens": 2}
    answers = await asyncio.wait_for(
        asyncio.gather(
            *(client.post("/v1/completions", json=body, headers={"X-Session-ID": f"s{i}"}) for i in range(requests))
        ),
        timeout=15,
    )
    assert [r.status for r in answers] == [200] * requests
    assert {r.headers["X-Skyinfer-Engine"] for r in answers} == {"0", "1"}


async def pushes_and_serves(client, demo_model, group_init, version: str) -> None:
    """The fleet takes a push of the whole checkpoint from a new transfer, then serves it on both engines."""
    r = await client.post("/init_weight_transfer", json={"init_info": group_init})
    assert r.status == 200, await r.text()
    update = {"update_info": whole_checkpoint(demo_model), "weight_version": version}
    r = await client.post("/update_weights", json=update)
    assert r.status == 200, await r.text()
    assert await states(client) == ["ready", "ready"]
    await serves_on_every_engine(client, demo_model)
    assert (await weight_info(client))["weight_version"] == version


async def slow(app, path: str) -> None:
    for engine in (0, 1):
        await script(app, engine, {"delay_s": {path: SLOW_S}})


async def fleet_has(predicate, client) -> None:
    async def check():
        return predicate(await states(client), await weight_info(client))

    await until(check, timeout_s=15)


# Each admin route: what precedes it, the engine route it waits on, what the fleet shows once the
# abandoned call has run to its end, and what a caller does next to run again.
ADMIN_CALLS = {
    "pause-keep": ([], ("POST", "/pause", {"params": {"mode": "keep"}}), "/pause", lambda s, w: s == ["paused"] * 2, ["/resume"]),
    "pause-wait": ([], ("POST", "/pause", {"params": {"mode": "wait"}}), "/pause", lambda s, w: s == ["paused"] * 2, ["/resume"]),
    "resume": (["/pause"], ("POST", "/resume", {}), "/resume", lambda s, w: s == ["ready"] * 2, []),
    "sleep": ([], ("POST", "/sleep", {"params": {"level": "1"}}), "/sleep", lambda s, w: s == ["sleeping"] * 2, ["/wake_up"]),
    "wake_up": (["/sleep"], ("POST", "/wake_up", {}), "/wake_up", lambda s, w: s == ["ready"] * 2, []),
    "reset_prefix_cache": ([], ("POST", "/reset_prefix_cache", {}), "/reset_prefix_cache", lambda s, w: True, []),
    "reset_mm_cache": ([], ("POST", "/reset_mm_cache", {}), "/reset_mm_cache", lambda s, w: True, []),
    "reset_encoder_cache": ([], ("POST", "/reset_encoder_cache", {}), "/reset_encoder_cache", lambda s, w: True, []),
    "weight_checker": ([], ("POST", "/weight_checker", {"json": {"action": "checksum"}}), "/weight_checker",
                       lambda s, w: s == ["ready"] * 2, []),
    "abort_requests": ([], ("POST", "/abort_requests", {}), "/abort_requests", lambda s, w: True, []),
    "init_weight_transfer": ([], ("POST", "/init_weight_transfer", "group"), "/init_weight_transfer",
                             lambda s, w: all(e["in_transfer_group"] for e in w["engines"]), []),
    "update_weights": (["init"], ("POST", "/update_weights", "push"), "/update_weights",
                       lambda s, w: w["weight_version"] == "abandoned" and s == ["ready"] * 2, []),
    "finish_weight_update": (["init", "/start_weight_update", "chunk"], ("POST", "/finish_weight_update", {"json": {"weight_version": "abandoned"}}),
                             "/finish_weight_update", lambda s, w: w["weight_version"] == "abandoned" and w["update_phase"] == "idle", []),
    "shutdown_weight_transfer_engine": (["init"], ("POST", "/shutdown_weight_transfer_engine", {}), "/shutdown_weight_transfer_engine",
                                        lambda s, w: not any(e["in_transfer_group"] for e in w["engines"]), []),
    "update_weight_version": ([], ("POST", "/update_weight_version", {"json": {"new_version": "abandoned"}}), "/update_weight_version",
                              lambda s, w: w["weight_version"] == "abandoned", []),
    "reload_weights": ([], ("POST", "/reload_weights", {}), "/load_checkpoint", lambda s, w: w["weight_version"] == "default" and s == ["ready"] * 2, []),
    "restart": ([], ("POST", "/engines/1/restart", {}), None, lambda s, w: s == ["ready"] * 2, []),
    "load_lora_adapter": ([], ("POST", "/v1/load_lora_adapter", "adapter"), "/adapters/load", lambda s, w: "abandoned" in w["adapters"], []),
    "update_lora_adapter": (["init"], ("POST", "/update_lora_adapter", "pushed adapter"), "/adapters/receive",
                            lambda s, w: "pushed" in w["adapters"], []),
    "unload_lora_adapter": (["adapter"], ("POST", "/v1/unload_lora_adapter", {"json": {"lora_name": "abandoned"}}), "/adapters/unload",
                            lambda s, w: "abandoned" not in w["adapters"], []),
}  # fmt: skip


@pytest.mark.parametrize("call", list(ADMIN_CALLS))
async def test_an_admin_call_its_caller_abandons_runs_to_its_end_and_the_fleet_pushes_and_serves(
    aiohttp_client, demo_model, tmp_path, group_init, call
):
    """Each admin route, its caller gone a fraction into the engines' work: the call still lands
    (or rolls back) as a whole, the fleet says so, and afterwards it takes a push and serves on
    every engine."""
    before, (method, path, how), engine_route, landed, then = ADMIN_CALLS[call]
    app, client = await fake_fleet(
        aiohttp_client, demo_model, tmp_path, engine_args=("--enable-lora", "--max-lora-rank", "8")
    )
    pids = [r.pid for r in app[REGISTRY].records]
    adapter = {"lora_name": "abandoned", "lora_path": str(make_adapter(demo_model, tmp_path / "adapter", seed=1))}
    bodies = {
        "group": {"json": {"init_info": group_init}},
        "push": {"json": {"update_info": whole_checkpoint(demo_model), "weight_version": "abandoned"}},
        "adapter": {"json": adapter},
        "pushed adapter": {"json": pushed_adapter(demo_model)},
    }
    for step in before:
        if step == "init":
            r = await client.post("/init_weight_transfer", json={"init_info": group_init})
        elif step == "chunk":
            r = await client.post("/update_weights", json={"update_info": whole_checkpoint(demo_model)})
        elif step == "adapter":
            r = await client.post("/v1/load_lora_adapter", json=adapter)
        else:
            r = await client.post(step)
        assert r.status == 200, await r.text()
    if engine_route is not None:
        await slow(app, engine_route)
    await abandon(client, method, path, **(bodies[how] if isinstance(how, str) else how))
    await fleet_has(landed, client)
    for engine in (0, 1):
        await script(app, engine, {})
    for step in then:
        assert (await client.post(step)).status == 200
    await pushes_and_serves(client, demo_model, group_init, "after")
    if call != "restart":
        assert [r.pid for r in app[REGISTRY].records] == pids  # no engine was lost to it


async def test_a_wait_pause_its_caller_abandons_lands_and_a_resume_sent_meanwhile_follows_it(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """The order from the field: a wait-mode pause behind long requests, its caller gone after
    0.5 s, a resume a second later. The resume waits for the pause and undoes it; a push after
    it leaves the fleet serving (every request after it used to hang on engines left paused)."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    for engine in (0, 1):
        await script(app, engine, {"delay_s": {"/pause": 3}})
    await abandon(client, "POST", "/pause", params={"mode": "wait"})
    await asyncio.sleep(1)
    r = await asyncio.wait_for(client.post("/resume"), timeout=15)
    assert r.status == 200, await r.text()
    assert await states(client) == ["ready", "ready"]
    await pushes_and_serves(client, demo_model, group_init, "v1")


@pytest.mark.parametrize("point", ["stopping", "starting", "bringing-up"])
async def test_a_restart_abandoned_at_any_point_brings_the_engine_up(
    aiohttp_client, demo_model, tmp_path, group_init, monkeypatch, point
):
    """An operator's restart given up while the old process stops, while the new one starts, or
    while it is brought to a paused fleet (its pause takes 2 s): the engine comes up all the same
    (it used to stay "restarting" for ever, every push a 409)."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    record = app[REGISTRY].records[1]
    pid = record.pid
    if point == "bringing-up":
        assert (await client.post("/pause", params={"mode": "keep"})).status == 200
        monkeypatch.setenv("FAKE_ENGINE_SCRIPT", json.dumps({"delay_s": {"/pause": 2}}))
    give_up = {"stopping": 0.02, "starting": 0.4, "bringing-up": 1.5}[point]
    await abandon(client, "POST", "/engines/1/restart", give_up)
    assert record.state.value == "restarting"
    await until(lambda: asyncio.sleep(0, record.up and record.pid != pid), timeout_s=15)
    if point == "bringing-up":
        assert await states(client) == ["paused", "paused"]
        assert (await client.post("/resume")).status == 200
    await pushes_and_serves(client, demo_model, group_init, "after")


@pytest.mark.parametrize("call", ["pause", "sleep"])
async def test_a_pause_or_sleep_abandoned_between_the_engines_answers_lands_on_both(
    aiohttp_client, demo_model, tmp_path, group_init, call
):
    """Engine 0 has answered, engine 1 has not yet, when the caller leaves: both end paused (or
    asleep) as vLLM holds them, and the call that undoes it works on both."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    await script(app, 1, {"delay_s": {f"/{call}": SLOW_S}})
    await abandon(client, "POST", f"/{call}", params={"mode": "keep"} if call == "pause" else {"level": "1"})
    state = {"pause": "paused", "sleep": "sleeping"}[call]
    await fleet_has(lambda s, w: s == [state] * 2, client)
    await script(app, 1, {})
    undo = await client.post({"pause": "/resume", "sleep": "/wake_up"}[call])
    assert undo.status == 200 and [e["status"] for e in (await undo.json())["engines"]] == [200, 200]
    await pushes_and_serves(client, demo_model, group_init, "after")


@pytest.mark.parametrize("receiving", [False, True], ids=["started", "receiving"])
async def test_an_update_abandoned_for_silence_is_never_revived_by_its_next_chunk(
    aiohttp_client, demo_model, tmp_path, group_init, receiving
):
    """A trainer silent past its group's timeout after /start_weight_update (or after its first
    chunk): the server abandons the update, and every later chunk or finish of it is refused with
    the code that tells a trainer to start over, never taken as a push of its own. Starting over works."""
    _app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    r = await client.post("/init_weight_transfer", json={"init_info": {**group_init, "timeout_s": 1}})
    assert r.status == 200
    assert (await client.post("/start_weight_update")).status == 200
    if receiving:
        assert (await client.post("/update_weights", json={"update_info": ONE_TENSOR})).status == 200
    await fleet_has(lambda s, w: w["update_phase"] == "idle", client)
    info = await weight_info(client)
    assert "sent nothing" in info["update_abandoned"] and info["weight_version"] is None
    for path, body in (
        ("/update_weights", {"update_info": whole_checkpoint(demo_model)}),
        ("/update_weights", {"update_info": ONE_TENSOR, "weight_version": "revived"}),
        ("/finish_weight_update", {"weight_version": "revived"}),
    ):
        r = await client.post(path, json=body)
        assert r.status == 409 and (await r.json())["error"]["code"] == "update_abandoned", await r.text()
    assert (await weight_info(client))["weight_version"] is None
    # Starting over: a new update (and, where the abort broke the group, a new group).
    if receiving:
        assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    assert (await client.post("/start_weight_update")).status == 200
    assert (await client.post("/update_weights", json={"update_info": whole_checkpoint(demo_model)})).status == 200
    r = await client.post("/finish_weight_update", json={"weight_version": "v2"})
    assert r.status == 200, await r.text()
    assert await states(client) == ["ready", "ready"]
    await serves_on_every_engine(client, demo_model)


async def test_a_pause_that_failed_around_a_push_is_read_back_and_undone(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """Engine 1 pauses for a push but answers an error: the push is aborted, and engine 1, which
    vLLM holds paused, is resumed with the other (it used to stay paused while requests were
    routed to it)."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    await script(app, 1, {"fail_after": {"/pause": 500}})
    r = await client.post("/update_weights", json={"update_info": whole_checkpoint(demo_model), "weight_version": "v1"})
    # Engine 0 may have been cut short by engine 1's failure before it answered (503): 502 then.
    assert r.status in (500, 502), await r.text()
    await script(app, 1, {})
    for engine in (0, 1):
        async with app[REGISTRY].records[engine].client.get("/conditions") as conditions:
            assert (await conditions.json())["paused"] is False
    await pushes_and_serves(client, demo_model, group_init, "v2")


async def test_an_engine_that_cannot_be_resumed_after_a_push_is_replaced(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """Engine 1 refuses the resume after a push and stays paused in vLLM: it is restarted (its
    requests would wait there for ever), and every request is answered meanwhile."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path, hold_requests_s=30)
    records = app[REGISTRY].records
    pid = records[1].pid
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    await script(app, 1, {"fail": {"/resume": 500}})
    r = await client.post("/update_weights", json={"update_info": whole_checkpoint(demo_model), "weight_version": "v1"})
    assert r.status == 200, await r.text()
    body = {"model": str(demo_model), "prompt": "x", "max_tokens": 2}
    answers = await asyncio.wait_for(asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(8))), 15)
    assert [a.status for a in answers] == [200] * 8
    await until(lambda: asyncio.sleep(0, records[1].pid != pid and records[1].up))
    # It came back with the checkpoint on disk, behind the fleet's push, and copies it from engine 0.
    await until(lambda: asyncio.sleep(0, records[1].stale is None and records[1].weight_version == "v1"))


async def test_a_sleep_that_failed_counts_as_asleep_not_paused(aiohttp_client, demo_model, tmp_path):
    """Engine 1 falls asleep but answers an error: it is recorded asleep (its memory may be
    released), so /resume and pushes wait for a wake-up rather than run on released memory; at
    level 2 its weights are unknown (stale) too."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    await script(app, 1, {"fail_after": {"/sleep": 500}})
    assert (await client.post("/sleep", params={"level": "1"})).status == 500
    engines = (await (await client.get("/engines")).json())["engines"]
    assert [(e["state"], e["sleep_level"]) for e in engines] == [("sleeping", 1), ("sleeping", 1)]
    r = await client.post("/resume")
    assert r.status == 409 and "engine 1: it is sleeping" in (await r.json())["error"]["message"]
    assert (await client.post("/wake_up")).status == 200
    assert await states(client) == ["ready", "ready"]
    assert (await client.post("/sleep", params={"level": "2"})).status == 500
    assert (await client.post("/wake_up")).status == 200
    stale = [e["stale_reason"] for e in (await (await client.get("/engines")).json())["engines"]]
    assert all("level-2 sleep" in reason for reason in stale), stale


async def a_partial_push_leaves_discarded_weights_stale(client, group_init, why: str) -> None:
    """A level-2 sleep discards both engines' weights; a push of one tensor finishes, and both
    engines stay stale, their reason saying ``why``."""
    assert (await client.post("/sleep", params={"level": "2"})).status == 200
    assert (await client.post("/wake_up")).status == 200
    assert await states(client) == ["stale", "stale"]
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    r = await client.post("/update_weights", json={"update_info": ONE_TENSOR, "weight_version": "part"})
    assert r.status == 200, await r.text()
    engines = (await (await client.get("/engines")).json())["engines"]
    assert [e["state"] for e in engines] == ["stale", "stale"]
    assert all(why in e["stale_reason"] for e in engines), engines


async def test_only_a_push_of_the_whole_checkpoint_brings_stale_engines_back(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """After a level-2 sleep discarded the weights, a push of one tensor finishes but serves
    nothing: the engines stay stale, saying what was left out; a push of every tensor brings them back."""
    _app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path, hold_requests_s=0)
    await a_partial_push_leaves_discarded_weights_stale(client, group_init, "carried only part of the checkpoint")
    assert (await client.post("/v1/completions", json={"model": str(demo_model), "prompt": "x"})).status == 503
    await pushes_and_serves(client, demo_model, group_init, "whole")


async def test_an_engine_that_fails_every_push_by_itself_is_retired_and_the_fleet_trains_on(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """Engine 1 stays up but fails every push's start: after --max-push-failures pushes it is
    retired (the fleet's world shrinks), the next push succeeds on engine 0, and an operator's
    restart brings engine 1 back. Pushes that fail on every engine at once (a trainer that died
    mid-broadcast) retire no one."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path, max_push_failures=2)
    push = {"update_info": whole_checkpoint(demo_model), "weight_version": "v"}
    for engine in (0, 1):
        await script(app, engine, {"fail": {"/update_weights": 500}})
    for _ in range(3):
        assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
        assert (await client.post("/update_weights", json=push)).status in (
            500,
            502,
        )  # 502: an engine cut short beside the failure
    assert await states(client) == ["stale", "stale"]
    await script(app, 0, {})
    await script(app, 1, {"fail": {"/start_weight_update": 500}})
    for _ in range(2):
        assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
        # 502 where engine 0's one call was cut short by engine 1's failed start before it answered.
        assert (await client.post("/update_weights", json=push)).status in (500, 502)
    assert (await states(client))[1] == "retired"
    assert (await (await client.get("/get_world_size")).json())["world_size"] == 1
    r = await client.post("/init_weight_transfer", json={"init_info": {**group_init, "world_size": 2}})
    assert r.status == 200, await r.text()
    assert (await client.post("/update_weights", json=push)).status == 200
    assert await states(client) == ["ready", "retired"]
    r = await client.post("/engines/1/restart")
    assert r.status == 200 and (await r.json())["engine"]["state"] == "stale"
    await pushes_and_serves(client, demo_model, group_init, "back")


async def test_a_staged_push_fails_as_a_live_one_does_and_counts_against_the_engine_that_failed_it(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """Engine 1 fails to stage a push by itself (engine 0 staged it): every copy is dropped, no
    engine is held out (no live weight was touched), the group is gone, and the failure counts
    against engine 1; at --max-push-failures it is retired, and a staged push lands on engine 0.
    Then engine 0's process is SIGKILLed while it stages: the push fails, the engine comes back, and
    the next staged push lands."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path, max_push_failures=2)
    push = {"update_info": whole_checkpoint(demo_model), "weight_version": "staged-v", "staged": True}
    # Engine 1 answers after engine 0 has: a failure of its own, not one a peer's cut short.
    await script(app, 1, {"fail": {"/stage_weights": 500}, "delay_s": {"/stage_weights": 0.5}})
    for attempt in (1, 2):
        assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
        r = await client.post("/update_weights", json=push)
        assert r.status == 500 and "staging the push failed on 1 of 2" in (await r.json())["error"]["message"]
        info = await weight_info(client)
        assert info["update_phase"] == "idle" and info["weight_version"] is None, info
        assert [(e["stale_reason"], e["in_transfer_group"]) for e in info["engines"]] == [(None, False)] * 2
        for engine in (0, 1) if attempt == 1 else (0,):  # engine 1 is retired after the second
            assert (await calls(app, engine)).get("/drop_staged") == attempt
            assert (await calls(app, engine)).get("/swap_staged") is None
        if attempt == 1:
            assert await states(client) == ["ready", "ready"]
            assert [e["push_failures"] for e in info["engines"]] == [0, 1]
    assert await states(client) == ["ready", "retired"]
    assert (
        await client.post("/init_weight_transfer", json={"init_info": {**group_init, "world_size": 2}})
    ).status == 200
    r = await client.post("/update_weights", json=push)
    assert r.status == 200 and (await r.json())["weight_version"] == "staged-v", await r.text()
    assert (await calls(app, 0)).get("/swap_staged") == 1

    await script(app, 0, {"hang": ["/stage_weights"]})
    assert (
        await client.post("/init_weight_transfer", json={"init_info": {**group_init, "world_size": 2}})
    ).status == 200
    staging = asyncio.ensure_future(client.post("/update_weights", json={**push, "weight_version": "lost"}))
    await until(lambda: _staging_shown(client), timeout_s=15)
    pid = kill(app, 0)
    r = await staging
    assert r.status >= 500, await r.text()
    await until(lambda: _serving_again(client, pid), timeout_s=30)
    info = await weight_info(client)
    assert info["update_phase"] == "idle" and info["weight_version"] == "staged-v", info
    assert (
        await client.post("/init_weight_transfer", json={"init_info": {**group_init, "world_size": 2}})
    ).status == 200
    r = await client.post("/update_weights", json={**push, "weight_version": "after-kill"})
    assert r.status == 200, await r.text()
    assert (await weight_info(client))["weight_version"] == "after-kill"


async def _staging_shown(client) -> bool:
    engines = (await (await client.get("/engines")).json())["engines"]
    return engines[0]["staging"] is not None and engines[0]["staging"]["state"] == "receiving"


async def _serving_again(client, old_pid: int) -> bool:
    engine = (await (await client.get("/engines")).json())["engines"][0]
    return engine["pid"] != old_pid and engine["state"] in ("ready", "stale")


async def test_a_new_transfer_after_an_aborted_push_shuts_the_old_transfer_engine_down(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """An aborted push breaks the group but leaves each engine's transfer engine (NCCL's
    communicator) in place: the next init shuts it down first on every engine."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    await script(app, 1, {"fail": {"/update_weights": 500}})
    push = {"update_info": whole_checkpoint(demo_model), "weight_version": "v"}
    assert (await client.post("/update_weights", json=push)).status in (
        500,
        502,
    )  # 502: an engine cut short beside the failure
    await script(app, 1, {})
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    for engine in (0, 1):
        assert (await calls(app, engine)).get("/shutdown_weight_transfer_engine") == 1


async def test_an_engine_busy_with_the_fronts_call_is_not_killed_by_its_probes(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """Both engines take 6 s to join the trainer's group and answer no probe meanwhile (their
    EngineCore is in the rendezvous): the init's own deadline judges them, not three failed probes."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    pids = [r.pid for r in app[REGISTRY].records]
    for engine in (0, 1):
        await script(app, engine, {"delay_s": {"/init_weight_transfer": 6}, "hang": ["/health"]})
    r = await client.post("/init_weight_transfer", json={"init_info": group_init})
    for engine in (0, 1):
        await script(app, engine, {})
    assert r.status == 200, await r.text()
    assert [(r.pid, r.restarts) for r in app[REGISTRY].records] == [(pid, 0) for pid in pids]


async def test_an_init_whose_trainer_never_listens_asks_no_engine_and_a_newer_init_supersedes_it(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """An init naming an address where nobody listens (a typo, a trainer still loading its model)
    asks the engines nothing: it ends in a 504 after the group's timeout. One whose caller gave up
    is superseded at once by the next init (it used to hold every push for the group's timeout)."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    nobody = {**group_init, "master_port": 1, "timeout_s": 2}
    r = await client.post("/init_weight_transfer", json={"init_info": nobody})
    assert r.status == 504 and "did not join" in (await r.json())["error"]["message"]
    await abandon(client, "POST", "/init_weight_transfer", json={"init_info": {**nobody, "timeout_s": 60}})
    # Superseded, the abandoned init holds nothing up and the push takes seconds; held by it, the
    # push would first wait out its 60 s group timeout: a 30 s deadline tells the two apart.
    await asyncio.wait_for(pushes_and_serves(client, demo_model, group_init, "v1"), timeout=30)
    for engine in (0, 1):
        assert (await calls(app, engine)).get("/init_weight_transfer") == 1


async def test_a_trainer_that_listens_late_is_met_and_the_engines_say_they_wait_for_it(
    aiohttp_client, demo_model, tmp_path
):
    """A trainer that loads its model after its init was sent listens 3 s late: meanwhile
    /engines and /weight_info say where the engines wait for it, no engine is asked to join, and
    once the trainer listens the init succeeds, well before its group's timeout; afterwards the
    engines show no rendezvous."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    trainer = socket.socket()
    trainer.bind(("127.0.0.1", 0))
    port = trainer.getsockname()[1]
    init_info = {"master_address": "127.0.0.1", "master_port": port, "world_size": 3, "timeout_s": 30}
    init = asyncio.ensure_future(client.post("/init_weight_transfer", json={"init_info": init_info}))
    waiting = f"waiting for the trainer at 127.0.0.1:{port}"
    await until(lambda: _rendezvous(client, "/engines", "engines"), timeout_s=10)
    await asyncio.sleep(3)
    assert await _rendezvous(client, "/engines", "engines") == [waiting, waiting]
    assert await _rendezvous(client, "/weight_info", "engines") == [waiting, waiting]
    assert [(await calls(app, e)).get("/init_weight_transfer") for e in (0, 1)] == [None, None]
    trainer.listen()
    # Met within a second or so (the front looks for the trainer at least once a second); missed,
    # the init would end in a 504 at its 30 s group timeout, some 26 s on. A 15 s deadline.
    r = await asyncio.wait_for(init, timeout=15)
    assert r.status == 200, await r.text()
    trainer.close()
    assert await _rendezvous(client, "/engines", "engines") is None


async def _rendezvous(client, path: str, key: str) -> list[str | None] | None:
    """Each engine's rendezvous as ``path`` shows it; None while no engine shows one."""
    shown = [e["rendezvous"] for e in (await (await client.get(path)).json())[key]]
    return shown if any(shown) else None


async def test_bringing_an_engine_up_holds_no_admin_call_of_the_others_back(
    aiohttp_client, demo_model, tmp_path, monkeypatch
):
    """Engine 1 restarts into a paused fleet and takes 4 s to pause: meanwhile an admin call of the
    fleet answers at once (engine 1 reported down), and a resume sent during its bring-up is
    taken by it too: it comes up running like the rest."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    records = app[REGISTRY].records
    assert (await client.post("/pause", params={"mode": "keep"})).status == 200
    monkeypatch.setenv("FAKE_ENGINE_SCRIPT", json.dumps({"delay_s": {"/pause": 4}}))
    restart = asyncio.ensure_future(client.post("/engines/1/restart"))
    await until(lambda: asyncio.sleep(0, records[1].client is not None and records[1].state.value == "restarting"))
    await asyncio.sleep(0.5)  # in its pause
    r = await asyncio.wait_for(client.post("/reset_prefix_cache"), timeout=2)
    assert [(e["engine"], e["status"]) for e in (await r.json())["engines"]] == [(0, 200), (1, 503)]
    assert records[1].state.value == "restarting"
    r = await asyncio.wait_for(client.post("/resume"), timeout=2)
    assert [(e["engine"], e["status"]) for e in (await r.json())["engines"]] == [(0, 200), (1, 503)]
    assert (await asyncio.wait_for(restart, timeout=30)).status == 200
    assert await states(client) == ["ready", "ready"]


async def test_a_refused_call_keeps_no_silent_trainers_update_open(aiohttp_client, demo_model, tmp_path, group_init):
    """A trainer starts an update and falls silent. An operator retries a call the open update
    refuses (``/reload_weights``, 409) every half second: the refusals do not count as the trainer's
    calls, and the update is abandoned at the group's timeout all the same."""
    _app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    r = await client.post("/init_weight_transfer", json={"init_info": {**group_init, "timeout_s": 2}})
    assert r.status == 200
    assert (await client.post("/start_weight_update")).status == 200
    refused = 0
    for _ in range(20):  # 10 s at most: five times the trainer's timeout
        if (await weight_info(client))["update_phase"] == "idle":
            break
        r = await client.post("/reload_weights")
        if r.status == 409:
            refused += 1
        await asyncio.sleep(0.5)
    info = await weight_info(client)
    assert info["update_phase"] == "idle" and "sent nothing" in info["update_abandoned"], (refused, info)
    assert 2 <= refused <= 8, refused
    r = await client.post("/reload_weights")  # no update open now: the operator's call runs
    assert r.status == 200, await r.text()


async def test_a_staged_push_is_sized_by_both_copies_it_takes_with_or_without_metadata(
    aiohttp_client, demo_model, tmp_path, group_init, monkeypatch
):
    """The host has room for one copy of the checkpoint per engine, not the two a staged push takes
    on CPU (a shadow and its packed kernels): a one-call staged push, a staged start with the
    push's metadata and one without any are each refused with a 409 that gives the figures, before
    any engine is asked; a push that is not staged lands."""
    checkpoint = whole_checkpoint(demo_model)
    one_copy = sum(math.prod(shape) * 4 for shape in checkpoint["shapes"])
    headroom = 1 << 30
    monkeypatch.setattr(staged, "host_memory_available", lambda: headroom + 3 * one_copy)  # 2 engines
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    for path, body in (
        ("/update_weights", {"update_info": checkpoint, "staged": True, "weight_version": "too-big"}),
        ("/start_weight_update", {"update_info": checkpoint, "staged": True}),
        ("/start_weight_update", {"staged": True}),
    ):
        r = await client.post(path, json=body)
        error = (await r.json())["error"]
        assert r.status == 409 and error["code"] == "staging_does_not_fit", (path, body, error)
        assert "2 copies per engine" in error["message"] and "GiB available" in error["message"], error
    for engine in (0, 1):
        assert (await calls(app, engine)).get("/stage_weights") is None
    info = await weight_info(client)
    assert info["update_phase"] == "idle" and info["weight_version"] is None, info
    r = await client.post("/update_weights", json={"update_info": checkpoint, "weight_version": "live"})
    assert r.status == 200, await r.text()


async def test_a_staged_push_on_gpus_takes_their_memory_unquantized_and_pinned_host_memory_quantized(
    aiohttp_client, demo_model, tmp_path, group_init, monkeypatch
):
    """Engines on GPUs (as NVML counts their free memory): an unquantized model is staged on its
    GPUs, in its own layout (its layers processed there): where a GPU has no room for the whole
    model, the staged push is refused with a 409 that gives the figures, before any engine is asked.
    A quantized model's copy may go to pinned host memory instead, where the host has room."""
    checkpoint = whole_checkpoint(demo_model)
    one_copy = sum(math.prod(shape) * 4 for shape in checkpoint["shapes"])
    free = {"gpu": staged.DEVICE_HEADROOM_BYTES + one_copy // 2, "host": 1 << 40}
    monkeypatch.setattr(staged, "gpu_free_bytes", lambda ids: [free["gpu"]] * len(ids))
    monkeypatch.setattr(staged, "host_memory_available", lambda: free["host"])
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    for record in app[REGISTRY].records:
        record.devices = EngineDevices("cuda", ((f"{record.engine_id}",),), {})
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    staged_push = {"update_info": checkpoint, "staged": True, "weight_version": "staged"}
    r = await client.post("/update_weights", json=staged_push)
    error = (await r.json())["error"]
    assert r.status == 409 and error["code"] == "staging_does_not_fit", error
    assert "of GPU memory per worker" in error["message"] and "2 worker(s) have no room" in error["message"], error
    for record in app[REGISTRY].records:
        record.quantized_layers = ("model.layers.0.self_attn.qkv_proj",)  # as an int8 engine reports
    r = await client.post("/update_weights", json=staged_push)
    assert r.status == 200, await r.text()
    free["host"] = staged.HOST_HEADROOM_BYTES
    r = await client.post("/update_weights", json={**staged_push, "weight_version": "staged-2"})
    error = (await r.json())["error"]
    assert r.status == 409 and "pinned, for 2 worker(s) whose GPU has no room" in error["message"], error
    free["gpu"] = staged.DEVICE_HEADROOM_BYTES + 4 * one_copy
    for record in app[REGISTRY].records:
        record.quantized_layers = ()
    r = await client.post("/update_weights", json={**staged_push, "weight_version": "staged-3"})
    assert r.status == 200, await r.text()


async def test_a_push_brings_no_stale_engine_back_while_the_checkpoints_names_are_unknown(
    aiohttp_client, demo_model, tmp_path, group_init
):
    """``--model`` a hub id that is not in the local cache: which tensors the checkpoint has is
    unknown, so no push can show it covered them all. Engines whose weights a level-2 sleep
    discarded stay stale after a push, saying why; ``/reload_weights`` brings them back."""
    hub_id = "skyinfer-tests/not-in-any-cache"
    _app, client = await fake_fleet(aiohttp_client, hub_id, tmp_path, hold_requests_s=0)
    await a_partial_push_leaves_discarded_weights_stale(client, group_init, "tensor names are unknown")
    assert (await client.post("/reload_weights")).status == 200
    assert await states(client) == ["ready", "ready"]
    assert (await client.post("/v1/completions", json={"model": hub_id, "prompt": "x", "max_tokens": 2})).status == 200
