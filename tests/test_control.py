"""Control plane over two real engines: pause/resume in every mode, sleep/wake-up, ordering."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from support import (
    admit_while_paused,
    both_fronts,
    engine_of,
    restore_fleet,
    sse_lines,
    total_unfinished,
    wait_unfinished,
)

# Against one front process, then against front workers.
server = both_fronts("one_front_server", "_workers_process")


@pytest.fixture
async def http(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        yield client
        await restore_fleet(client)


async def admin(http: httpx.AsyncClient, path: str, expect: int = 200, **kw) -> dict:
    r = await http.post(path, **kw)
    assert r.status_code == expect, r.text
    return r.json()


async def complete(http, model: str, prompt: str, max_tokens: int, session: str | None = None) -> httpx.Response:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = await http.post("/v1/completions", json=body, headers={"X-Session-ID": session} if session else {})
    assert r.status_code == 200, r.text
    return r


async def sessions_on_each_engine(http, model: str) -> dict[int, str]:
    """A session id pinned to each engine."""
    found: dict[int, str] = {}
    for i in range(20):
        r = await complete(http, model, "x", 1, session=f"pin-{i}")
        found.setdefault(engine_of(r), f"pin-{i}")
        if len(found) == 2:
            return found
    raise AssertionError(f"sessions landed only on {found}")


async def run_through_pause_cycles(http, model: str, prompts: list[str], max_tokens: int) -> list[dict] | None:
    """Run the requests concurrently through three keep-pause cycles, the first while all are held.

    Returns their choices, or None when all requests finished before a later
    pause: on two cores the demo model decodes fast, and an admin call can
    take a second to reach a busy engine.
    """
    tasks = await admit_while_paused(http, [complete(http, model, p, max_tokens) for p in prompts])
    for cycle in range(3):
        if cycle:
            await asyncio.sleep(0.05)
            result = await admin(http, "/pause", params={"mode": "keep"})
            assert [e["status"] for e in result["engines"]] == [200, 200]
            if await total_unfinished(http) == 0:
                await admin(http, "/resume")
                await asyncio.gather(*tasks)
                return None
        assert (await http.get("/is_paused")).json()["is_paused"] is True
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in tasks), "a kept request finished while paused"
        await admin(http, "/resume")
    return [r.json()["choices"][0] for r in await asyncio.gather(*tasks)]


async def test_keep_pause_cycles_preserve_in_flight_requests(http, model_name):
    max_tokens = 1024
    prompts = [f"Rollout {i}: the policy answers" for i in range(16)]
    # Reference: the same requests, unpaused, all at once (the float32 server's greedy
    # tokens do not depend on the batch; one at a time took two minutes).
    baseline = [
        r.json()["choices"][0]["token_ids"]
        for r in await asyncio.gather(*(complete(http, model_name, p, max_tokens) for p in prompts))
    ]
    for _attempt in range(3):
        results = await run_through_pause_cycles(http, model_name, prompts, max_tokens)
        if results is not None:
            break
    else:
        pytest.fail("could not keep 16 requests in flight through three pause cycles in 3 attempts")
    assert [c["finish_reason"] for c in results] == ["length"] * 16
    assert [len(c["token_ids"]) for c in results] == [max_tokens] * 16
    assert [c["token_ids"] for c in results] == baseline
    assert (await http.get("/is_paused")).json()["is_paused"] is False


async def test_abort_pause_returns_partial_tokens(http, model_name):
    max_tokens = 3000
    tasks = [asyncio.create_task(complete(http, model_name, f"abort me {i}", max_tokens)) for i in range(4)]
    await wait_unfinished(http, 4)
    await asyncio.sleep(0.3)
    await admin(http, "/pause", params={"mode": "abort"})
    try:
        choices = [r.json()["choices"][0] for r in await asyncio.wait_for(asyncio.gather(*tasks), 30)]
    finally:
        await admin(http, "/resume")
    assert [c["finish_reason"] for c in choices] == ["abort"] * 4
    assert all(0 < len(c["token_ids"]) < max_tokens for c in choices), [len(c["token_ids"]) for c in choices]


async def test_wait_pause_returns_after_requests_finish(http, model_name):
    tasks = await admit_while_paused(http, [complete(http, model_name, f"drain {i}", 400) for i in range(4)])
    await admin(http, "/resume")
    await admin(http, "/pause", params={"mode": "wait"})
    try:
        # By the time the pause answers, the engines hold nothing in flight.
        assert await total_unfinished(http) == 0
        choices = [r.json()["choices"][0] for r in await asyncio.wait_for(asyncio.gather(*tasks), 10)]
    finally:
        await admin(http, "/resume")
    assert [(c["finish_reason"], len(c["token_ids"])) for c in choices] == [("length", 400)] * 4


async def test_abort_requests_cuts_a_wait_pause_short(http, model_name):
    """A wait-mode pause holds the fleet until 8 long requests drain: /abort_requests does not wait
    behind it, ends all 8 with finish reason abort, and the pause then answers; readiness and
    metrics answer meanwhile too."""
    tasks = await admit_while_paused(http, [complete(http, model_name, f"long {i}", 3000) for i in range(8)])
    await admin(http, "/resume")
    pausing = asyncio.create_task(http.post("/pause", params={"mode": "wait"}))
    await asyncio.sleep(1.0)
    assert not pausing.done(), "the requests drained before the abort: nothing was cut short"
    for path in ("/ready", "/health", "/metrics"):
        assert (await asyncio.wait_for(http.get(path), 5)).status_code in (200, 503)
    aborted = await asyncio.wait_for(admin(http, "/abort_requests"), 10)
    assert aborted["aborted"] >= 8
    try:
        assert (await asyncio.wait_for(pausing, 10)).status_code == 200
        choices = [r.json()["choices"][0] for r in await asyncio.wait_for(asyncio.gather(*tasks), 10)]
    finally:
        await admin(http, "/resume")
    assert [c["finish_reason"] for c in choices] == ["abort"] * 8
    assert all(len(c["token_ids"]) < 3000 for c in choices)


async def test_requests_sent_while_paused_are_held_on_every_engine(http, model_name):
    sessions = await sessions_on_each_engine(http, model_name)
    await admin(http, "/pause", params={"mode": "keep"})
    try:
        tasks = {e: asyncio.create_task(complete(http, model_name, "held", 8, session=s)) for e, s in sessions.items()}
        await asyncio.sleep(1.5)
        assert not any(t.done() for t in tasks.values()), "a request ran while the engines were paused"
    finally:
        await admin(http, "/resume")
    for engine, task in tasks.items():
        r = await asyncio.wait_for(task, 30)
        assert engine_of(r) == engine
        assert len(r.json()["choices"][0]["token_ids"]) == 8


async def engine_states(http) -> list[tuple[str, bool, bool]]:
    return [(e["state"], e["paused"], e["sleeping"]) for e in (await http.get("/engines")).json()["engines"]]


async def greedy_on_each_engine(http, model, sessions) -> dict[int, list[int]]:
    return {
        e: (await complete(http, model, "sleep test", 16, s)).json()["choices"][0]["token_ids"]
        for e, s in sessions.items()
    }


async def test_sleep_and_wake_up_round_trip(http, model_name):
    sessions = await sessions_on_each_engine(http, model_name)
    before = await greedy_on_each_engine(http, model_name, sessions)

    result = await admin(http, "/sleep", params={"level": "1"})
    assert result["level"] == 1
    assert (await http.get("/is_sleeping")).json()["is_sleeping"] is True
    assert await engine_states(http) == [("sleeping", True, True)] * 2
    woke = await admin(http, "/wake_up")
    assert woke["status"] == "awake"
    assert (await http.get("/is_sleeping")).json()["is_sleeping"] is False
    assert await engine_states(http) == [("ready", False, False)] * 2
    assert await greedy_on_each_engine(http, model_name, sessions) == before

    await admin(http, "/sleep", params={"level": "1"})
    partial = await admin(http, "/wake_up", params={"tags": "weights"})
    assert partial["status"] == "sleeping"
    assert (await http.get("/is_sleeping")).json()["is_sleeping"] is True
    assert await engine_states(http) == [("sleeping", True, True)] * 2
    full = await admin(http, "/wake_up", params={"tags": "kv_cache"})
    assert full["status"] == "awake"
    assert (await http.get("/is_sleeping")).json()["is_sleeping"] is False
    assert await greedy_on_each_engine(http, model_name, sessions) == before


async def test_engines_view_says_cpu_sleep_frees_no_memory_and_full_precision(http):
    engines = (await http.get("/engines")).json()["engines"]
    assert [e["devices"]["sleep_frees_memory"] for e in engines] == [False, False]
    # What an int8 fleet names there (test_quantized); a full-precision one, nothing.
    assert [e["quantization"] for e in engines] == [None, None]
    assert [e["quantized_layers"] for e in engines] == [0, 0]


async def test_ordering_mistakes_are_409(http):
    err = await admin(http, "/resume", expect=409)
    assert "not paused" in err["error"]["message"]
    err = await admin(http, "/wake_up", expect=409)
    assert "not sleeping" in err["error"]["message"]
    await admin(http, "/sleep", params={"level": "0"})
    try:
        assert "sleeping" in (await admin(http, "/resume", expect=409))["error"]["message"]
        assert "already sleeping" in (await admin(http, "/sleep", expect=409))["error"]["message"]
    finally:
        await admin(http, "/wake_up")
    assert await engine_states(http) == [("ready", False, False)] * 2


async def test_parameters_come_from_the_query_or_the_body_and_must_agree(http, model_name):
    # Given twice and differently: refused, naming the parameter, and nothing is paused.
    err = await admin(http, "/pause?mode=keep", expect=400, json={"mode": "abort"})
    assert err["error"]["param"] == "mode" and "query string" in err["error"]["message"]
    for params in ({"mode": "bogus"}, {"clear_cache": "maybe"}, {"mode": ["keep", "abort"]}):
        await admin(http, "/pause", expect=400, params=params)
    await admin(http, "/pause", expect=400, json={"mode": "bogus"})
    await admin(http, "/sleep", expect=400, params={"level": "7"})
    await admin(http, "/wake_up", expect=400, params={"tags": "everything"})
    await admin(http, "/wake_up", expect=400, json={"tags": ["weights", "everything"]})
    assert (await http.get("/is_paused")).json()["is_paused"] is False
    assert (await http.get("/is_sleeping")).json()["is_sleeping"] is False

    # The mode in a JSON body is honoured (vLLM would ignore it and abort): keep, so an
    # in-flight request survives; and said in both places alike, it is the same call.
    for query, body in (("", {"mode": "keep"}), ("?mode=keep", {"mode": "keep", "clear_cache": True})):
        (task,) = await admit_while_paused(http, [complete(http, model_name, "body says keep", 400)])
        await admin(http, "/resume")
        assert (await admin(http, f"/pause{query}", json=body))["mode"] == "keep"
        await admin(http, "/resume")
        choice = (await task).json()["choices"][0]
        assert (choice["finish_reason"], len(choice["token_ids"])) == ("length", 400)

    # SkyRL's reset_prefix_cache() sends its flag as a JSON body.
    result = await admin(http, "/reset_prefix_cache", json={"reset_running_requests": True})
    assert [e["result"]["reset"] for e in result["engines"]] == [True, True]
    await admin(
        http, "/reset_prefix_cache?reset_running_requests=false", expect=400, json={"reset_running_requests": True}
    )


async def test_reset_prefix_cache(http):
    result = await admin(http, "/reset_prefix_cache")
    assert [e["result"]["reset"] for e in result["engines"]] == [True, True]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_abort_requests_by_response_id(http, model_name, path):
    body = {"model": model_name, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    body.update(
        {"prompt": "abort by id"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "abort by id"}]}
    )
    async with http.stream("POST", path, json=body) as r:
        lines = sse_lines(r)
        async for line in lines:
            if line.startswith("data: {"):
                request_id = json.loads(line[len("data: ") :])["id"]
                break
        # Held (keep), the request cannot finish before the abort reaches it.
        await admin(http, "/pause", params={"mode": "keep"})
        result = await admin(http, "/abort_requests", json={"request_ids": [request_id]})
        assert result["aborted"] == 1
        await admin(http, "/resume")
        rest = [json.loads(line[len("data: ") :]) for line in [x async for x in lines] if line.startswith("data: {")]
    assert rest[-1]["choices"][0]["finish_reason"] == "abort"
    await wait_unfinished(http, 0, timeout_s=5)
    # Aborting everything when nothing runs is a no-op, not an error.
    assert (await admin(http, "/abort_requests"))["aborted"] == 0
