"""A request whose engine dies goes on on another engine, from where it was.

Real engines, a real EngineCore SIGKILLed while greedy requests generate on it: completions, chat
and the token route, streamed and not. Each must end whole, token for token what an uncrashed run
gives (float32 engines: greedy tokens do not flip across batch shapes), with no error event, usage
counting every token, and a field (streams) or header (the rest) saying where it went on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import orjson
import pytest
from fakes import calls, fake_fleet, script, serve_fakes

import skyinfer.app
from skyinfer.config import ServeConfig
from skyinfer.devices import split_cores
from skyinfer.registry import REGISTRY

from pushes import sessions_per_engine
from support import ServerProcess, module_servers, sse_lines, vllm_process

MAX_TOKENS = 300
PROMPT = "Reinforcement learning from verifiable rewards"
KINDS = [(route, stream) for route in ("completions", "chat", "tokens") for stream in (True, False)]


def _launch(demo_model: Path, logs: Path) -> ServerProcess:
    return ServerProcess(
        demo_model,
        engines=2,
        log_path=logs / "server.log",
        # Sessions stay on their engine however loaded (the requests that die must be on engine 1).
        extra_args=(
            "--dtype",
            "float32",
            "--health-interval",
            "1",
            "--hold-requests",
            "5",
            "--session-rebalance-factor",
            "0",
        ),
    )


pair = module_servers(__name__, _launch)


def request_for(route: str, stream: bool, model: str, prompt_ids: list[int]) -> tuple[str, dict]:
    common = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        common["stream_options"] = {"include_usage": True}
    if route == "completions":
        return "/v1/completions", {**common, "prompt": PROMPT, "return_token_ids": True, "logprobs": 1}
    if route == "chat":
        messages = [{"role": "user", "content": PROMPT}]
        return "/v1/chat/completions", {**common, "messages": messages, "return_token_ids": True, "logprobs": True}
    params = {k: common[k] for k in ("max_tokens", "temperature", "ignore_eos")}
    body = {"model": model, "token_ids": prompt_ids, "sampling_params": {**params, "logprobs": 0}, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return "/inference/v1/generate", body


class Outcome:
    """What a caller got: the token ids in order, the usage, and what it was told on the way."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.usage: dict | None = None
        self.errors: list[dict] = []
        self.continued: list[dict] = []
        self.headers: dict[str, str] = {}
        self.events = 0
        self.finish_reasons: list[str] = []

    def take(self, body: dict) -> None:
        if "error" in body:
            self.errors.append(body["error"])
            return
        if "skyinfer_continued" in body:
            self.continued.append(body["skyinfer_continued"])
        if body.get("usage"):
            self.usage = body["usage"]
        for choice in body.get("choices") or []:
            self.token_ids += choice.get("token_ids") or []
            logprobs = choice.get("logprobs") or {}
            if "token_logprobs" in logprobs:
                self.logprobs += logprobs["token_logprobs"]
            else:
                self.logprobs += [entry["logprob"] for entry in logprobs.get("content") or []]
            if choice.get("finish_reason"):
                self.finish_reasons.append(choice["finish_reason"])


async def run(http: httpx.AsyncClient, route: str, stream: bool, session: str, prompt_ids, model, started=None):
    path, body = request_for(route, stream, model, prompt_ids)
    outcome = Outcome()
    headers = {"X-Session-ID": session}
    if not stream:
        r = await http.post(path, json=body, headers=headers)
        outcome.headers = dict(r.headers)
        assert r.status_code == 200, r.text
        outcome.take(r.json())
        return outcome
    async with http.stream("POST", path, json=body, headers=headers) as r:
        outcome.headers = dict(r.headers)
        assert r.status_code == 200, await r.aread()
        async for line in sse_lines(r):
            if line.startswith("data: {"):
                outcome.events += 1
                outcome.take(orjson.loads(line[len("data: ") :]))
                if started is not None and outcome.events == 8:
                    started.release()
    return outcome


def test_every_request_whose_engine_core_dies_goes_on_elsewhere_token_for_token(pair, model_name):
    sessions = sessions_per_engine(pair, model_name)
    prompt_ids = httpx.post(f"{pair.url}/tokenize", json={"model": model_name, "prompt": PROMPT}, timeout=30).json()[
        "tokens"
    ]

    async def scenario():
        async with httpx.AsyncClient(base_url=pair.url, timeout=300) as http:
            # What an uncrashed run gives, on engine 0.
            reference = {}
            for kind in KINDS:
                reference[kind] = await run(http, *kind, sessions[0], prompt_ids, model_name)
            # The same on engine 1, which dies once the streams are under way.
            started = asyncio.Semaphore(0)
            tasks = {kind: asyncio.create_task(run(http, *kind, sessions[1], prompt_ids, model_name, started))
                     for kind in KINDS}  # fmt: skip
            streams = sum(1 for _, stream in KINDS if stream)
            for _ in range(streams):
                await asyncio.wait_for(started.acquire(), 60)
            core = vllm_process(pair.engines()[1]["pid"], "EngineCore")
            core.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            got = {kind: await task for kind, task in tasks.items()}
            print(f"every request done {time.monotonic() - killed_at:.1f}s after the kill")
            return reference, got

    reference, got = asyncio.run(scenario())
    for kind in KINDS:
        want, have = reference[kind], got[kind]
        stream = kind[1]
        assert not have.errors, (kind, have.errors)
        assert len(want.token_ids) == MAX_TOKENS and have.token_ids == want.token_ids, kind
        assert have.logprobs == pytest.approx(want.logprobs, abs=1e-3), kind
        assert have.finish_reasons == ["length"], (kind, have.finish_reasons)
        if stream:
            assert len(have.continued) == 1 and have.continued[0]["from_engine"] == 1, (kind, have.continued)
            assert 0 < have.continued[0]["tokens_kept"] < MAX_TOKENS, (kind, have.continued)
            assert have.headers["x-skyinfer-engine"] == "1"
        else:
            assert have.headers.get("x-skyinfer-continued-from") == "1", (kind, have.headers)
            assert have.headers["x-skyinfer-engine"] == "0"
        if have.usage is not None or want.usage is not None:
            assert have.usage["completion_tokens"] == MAX_TOKENS, (kind, have.usage)
            assert have.usage["prompt_tokens"] == want.usage["prompt_tokens"], (kind, have.usage)


def test_a_record_a_caller_forged_is_a_400(pair, model_name):
    """``skyinfer_continue`` is for the front to send; one a caller sends malformed is refused."""
    for record in ({"calls": 5}, {"calls": [{"n": 1}]}, "x"):
        body = {"model": model_name, "prompt": "x", "max_tokens": 2, "skyinfer_continue": record}
        r = httpx.post(f"{pair.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "skyinfer_continue" in r.json()["error"]["message"], r.text
    assert (
        httpx.post(f"{pair.url}/v1/completions", json={**body, "skyinfer_continue": None}, timeout=60).status_code
        == 200
    )


# -- the front's side, over fake engines (tools/fake_engine.py: die_after_events) -------------


async def _session_on(client, engine: int, skip: str | None = None) -> str:
    for i in range(50):
        if f"s{i}" == skip:
            continue
        r = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Session-ID": f"s{i}"}
        )
        if r.headers["X-Skyinfer-Engine"] == str(engine):
            return f"s{i}"
    raise AssertionError(f"no session landed on engine {engine}")


async def _events(r) -> list[bytes]:
    return [line for line in (await r.read()).split(b"\n") if line.startswith(b"data: ")]


async def _went_on(app, engine: int) -> list[dict]:
    async with app[REGISTRY].records[engine].client.get("/fake/went_on") as r:
        return await r.json()


async def test_the_front_splices_a_stream_onto_another_engine_and_goes_on_from_a_503(
    aiohttp_client, demo_model, tmp_path
):
    """Engine 1 dies after 5 events of a 20-token stream: the caller's stream goes on with engine
    0's events, one stream, no error, one [DONE]; engine 0 got the request with engine 1's record.
    A request that is not streamed gets engine 0's answer, saying where it went on from."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    session = await _session_on(client, 1)
    other_session = await _session_on(client, 1, skip=session)
    await script(app, 1, {"die_after_events": 5})
    body = {"prompt": "x", "max_tokens": 20, "stream": True}
    r = await client.post("/v1/completions", json=body, headers={"X-Session-ID": session})
    events = await _events(r)
    assert r.status == 200 and r.headers["X-Skyinfer-Engine"] == "1"
    assert len(events) == 21 and events[-1] == b"data: [DONE]" and not [e for e in events if b'"error"' in e]
    assert [(w["from_engine"], w["fake_tokens"]) for w in await _went_on(app, 0)] == [(1, 5)]
    # The session went on to engine 0 with its stream; the other is still on engine 1.
    r = await client.post(
        "/v1/chat/completions", json={"messages": [], "max_tokens": 8}, headers={"X-Session-ID": other_session}
    )
    assert r.status == 200, await r.text()
    assert (r.headers["X-Skyinfer-Engine"], r.headers.get("X-Skyinfer-Continued-From")) == ("0", "1"), r.headers
    assert len(await _went_on(app, 0)) == 2


async def test_a_stream_no_engine_can_go_on_with_ends_with_an_error_event(aiohttp_client, demo_model, tmp_path):
    """Engine 0 serves other weights than engine 1 did: engine 1's stream ends with the front's error
    event and [DONE]; a request that is not streamed starts over on engine 0 (no tokens of other
    weights mixed in). With one engine alone, the same error event."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path, hold_requests_s=0.5)
    session = await _session_on(client, 1)
    other_session = await _session_on(client, 1, skip=session)
    await script(app, 1, {"die_after_events": 5})
    app[REGISTRY].records[0].weight_version = "other"
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "stream": True},
                          headers={"X-Session-ID": session})  # fmt: skip
    events = await _events(r)
    assert len(events) == 7 and b"serves other weights" in events[5] and events[6] == b"data: [DONE]", events
    r = await client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 4}, headers={"X-Session-ID": other_session}
    )
    assert r.status == 200 and "X-Skyinfer-Continued-From" not in r.headers
    assert r.headers["X-Skyinfer-Retried-From"] == "1"
    assert await _went_on(app, 0) == []
    (tmp_path / "one").mkdir()
    _, alone = await serve_fakes(
        aiohttp_client, ServeConfig(model=str(demo_model), device="cpu", socket_dir=str(tmp_path / "one"))
    )
    await script(alone.app, 0, {"die_after_events": 3})
    r = await alone.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "stream": True})
    events = await _events(r)
    assert len(events) == 5 and b"no other engine serves" in events[3], events


async def test_a_request_in_flight_at_two_engine_deaths_is_not_sent_to_a_third(
    aiohttp_client, demo_model, tmp_path, monkeypatch, caplog
):
    """Four engines, every one of which dies under whatever it serves (a request that kills engines):
    a stream dies on its engine and again on the engine that went on with it, and ends with the
    front's error event saying so; a request that is not streamed, the same, with a 500 in the
    OpenAI shape. Neither reaches a third engine; both are counted, and logged with their body's hash."""
    # Four fake engines on this machine's two cores: two to a core, as no real engine may be.
    two_engines = split_cores(sorted(os.sched_getaffinity(0))[:2], (1, 1), 1)
    monkeypatch.setattr(skyinfer.app, "plan_engine_devices", lambda *_args: two_engines * 2)
    config = ServeConfig(model=str(demo_model), engines=4, device="cpu", socket_dir=str(tmp_path), hold_requests_s=0)
    app, client = await serve_fakes(aiohttp_client, config)
    for engine in range(4):
        await script(app, engine, {"die_after_events": 3})

    async def received(send) -> tuple:
        """What ``send()`` answered, and how many engines received its request."""
        before = [(await calls(app, engine)).get("/v1/completions", 0) for engine in range(4)]
        r = await send()
        after = [(await calls(app, engine)).get("/v1/completions", 0) for engine in range(4)]
        return r, [b - a for a, b in zip(before, after)]

    r, got = await received(
        lambda: client.post("/v1/completions", json={"prompt": "x", "max_tokens": 20, "stream": True})
    )
    events = await _events(r)
    error = orjson.loads(events[-2][6:])["error"]
    assert error["code"] == 500 and "not sent to a third engine" in error["message"], events
    assert events[-1] == b"data: [DONE]" and len(events) >= 3 + 2, events
    assert sorted(got) == [0, 0, 1, 1], got
    r, got = await received(lambda: client.post("/v1/completions", json={"prompt": "y", "max_tokens": 20}))
    assert r.status == 500 and "not sent to a third engine" in (await r.json())["error"]["message"]
    assert sorted(got) == [0, 0, 1, 1], got
    ended = [r.ended_at_second_death for r in app[REGISTRY].records]
    assert sum(ended) == 2, ended
    metrics = await (await client.get("/metrics")).text()
    assert "skyinfer_engine_requests_ended_at_second_death_total" in metrics
    logged = [m for m in caplog.messages if "in flight at two engine deaths" in m]
    assert len(logged) == 2 and all("body sha256" in m and "/v1/completions" in m for m in logged), logged
