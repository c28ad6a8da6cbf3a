"""A request whose engine dies goes on on another engine, from where it was.

Real engines, a real EngineCore SIGKILLed while greedy requests generate on it: completions, chat
and the token route, streamed and not. Each must end whole, token for token what an uncrashed run
gives (float32 engines: greedy tokens do not flip across batch shapes), with no error event, usage
counting every token, and a field (streams) or header (the rest) saying where it went on.
"""

from __future__ import annotations

import asyncio
import json
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
from support import ServerProcess, engine_of, module_servers, scrape, sse_lines, total, vllm_process

MAX_TOKENS = 300
SECOND_DEATHS = "skyinfer_engine_requests_ended_at_second_death"
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
            # A request whose engine died waits for one to go on on, while both restart (the last test).
            "--hold-requests",
            "60",
            "--session-rebalance-factor",
            "0",
            # A tool-call parser, as agent harnesses run: a chat stream with tools is parsed as it goes.
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "pythonic",
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
        self.choices: dict[int, list[int]] = {}
        self.top_logprobs: list[dict] = []
        self.text = ""

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
            self.choices.setdefault(choice.get("index", 0), []).extend(choice.get("token_ids") or [])
            self.text += choice.get("text") or (choice.get("delta") or choice.get("message") or {}).get("content") or ""
            logprobs = choice.get("logprobs") or {}
            if "token_logprobs" in logprobs:
                self.logprobs += logprobs["token_logprobs"]
                self.top_logprobs += logprobs.get("top_logprobs") or []
            else:
                self.logprobs += [entry["logprob"] for entry in logprobs.get("content") or []]
            if choice.get("finish_reason"):
                self.finish_reasons.append(choice["finish_reason"])


# Requests whose every feature carries over a splice (engine/continuation.py, why_not_continued):
# a continued answer must equal the uninterrupted one token for token.
CARRIED = {
    "logprobs and top logprobs": {"logprobs": 3},
    "n, each choice sampled from the top token": {"n": 2, "temperature": 1.0, "top_k": 1},
    "seed, greedy": {"seed": 7},
    "min_tokens": {"min_tokens": 150, "ignore_eos": False},
    "logit_bias": {"logit_bias": {"5": 4.0, "17": -100.0}},
    "repetition_penalty": {"repetition_penalty": 1.3},
    "allowed and stop token ids": {"allowed_token_ids": list(range(40, 240)), "stop_token_ids": [241]},
}
# Requests whose state would be lost at a splice: a stream ends with the reason, a request that is
# not streamed starts over (its caller had nothing yet) and gets the uninterrupted answer.
NOT_CARRIED = {
    "regex": ({"structured_outputs": {"regex": "[a-z ]{20,400}"}}, "structured output"),
    "stop strings": ({"stop": ["never said"]}, "stop strings"),
    "frequency penalty": ({"frequency_penalty": 0.5}, "frequency or presence penalties"),
    "presence penalty": ({"presence_penalty": 0.5}, "frequency or presence penalties"),
    "seeded sample": ({"temperature": 1.0, "seed": 7}, "a seeded sample"),
    "bad words": ({"bad_words": ["the"]}, "bad words"),
    "json schema": (None, "structured output"),
    "tool calls": (None, "parsed for tool calls"),
}
JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "verdict",
        "schema": {
            "type": "object",
            "properties": {"verdict": {"enum": ["yes", "no"]}, "why": {"type": "string", "maxLength": 200}},
            "required": ["verdict", "why"],
            "additionalProperties": False,
        },
    },
}
FEATURE_TOKENS = 200


def feature_request(model: str, more: dict, stream: bool) -> tuple[str, dict]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": FEATURE_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream, **more}  # fmt: skip
    return "/v1/completions", body


TOOL = {
    "type": "function",
    "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}},
}


def chat_request(model: str, name: str, stream: bool) -> tuple[str, dict]:
    """A chat request whose answer is JSON of a schema, or one offered a tool (``name``)."""
    messages = [{"role": "user", "content": "Answer in JSON: " + PROMPT}]
    body = {"model": model, "messages": messages, "max_tokens": 400, "temperature": 0, "return_token_ids": True,
            "stream": stream}  # fmt: skip
    if name == "json schema":
        body["response_format"] = JSON_SCHEMA
    else:
        body.update(tools=[TOOL], tool_choice="auto", max_tokens=FEATURE_TOKENS, ignore_eos=True)
    return "/v1/chat/completions", body


async def send(
    http, path: str, body: dict, session: str, started=None, outcome: Outcome | None = None, status: int = 200
) -> Outcome:
    """What the caller got; ``outcome``: filled as the answer comes (a stream's events)."""
    outcome = outcome or Outcome()
    headers = {"X-Session-ID": session}
    if not body["stream"]:
        r = await http.post(path, json=body, headers=headers)
        outcome.headers = dict(r.headers)
        assert r.status_code == status, r.text
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


@pytest.fixture(scope="module")
def killed_mid_answer(pair, model_name) -> tuple[dict, dict]:
    """Every request of both tests below on engine 1, whose EngineCore is SIGKILLed once every
    stream has events (one restart for all); the same requests uncrashed on engine 0 beforehand
    (float32: greedy tokens do not flip across batch shapes). What each caller got, both ways."""
    sessions = sessions_per_engine(pair, model_name)
    prompt_ids = httpx.post(f"{pair.url}/tokenize", json={"model": model_name, "prompt": PROMPT}, timeout=30).json()[
        "tokens"
    ]
    requests = {kind: request_for(*kind, model_name, prompt_ids) for kind in KINDS}
    for name, more in CARRIED.items():
        requests[name, True] = feature_request(model_name, more, True)
    for name, (more, _) in NOT_CARRIED.items():
        for stream in (True, False):
            requests[name, stream] = (
                chat_request(model_name, name, stream) if more is None else feature_request(model_name, more, stream)
            )

    async def scenario():
        async with httpx.AsyncClient(base_url=pair.url, timeout=300) as http:
            reference = dict(zip(requests, await asyncio.gather(
                *(send(http, path, body, sessions[0]) for path, body in requests.values())
            )))  # fmt: skip
            started = asyncio.Semaphore(0)
            tasks = {key: asyncio.create_task(send(http, path, body, sessions[1], started))
                     for key, (path, body) in requests.items()}  # fmt: skip
            for _ in range(sum(1 for _, stream in requests if stream)):
                await asyncio.wait_for(started.acquire(), 60)
            vllm_process(pair.engines()[1]["pid"], "EngineCore").send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            got = {key: await task for key, task in tasks.items()}
            print(f"every request done {time.monotonic() - killed_at:.1f}s after the kill")
            return reference, got

    return asyncio.run(scenario())


def test_every_request_whose_engine_core_dies_goes_on_elsewhere_token_for_token(killed_mid_answer):
    reference, got = killed_mid_answer
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


def test_a_request_goes_on_after_its_engine_dies_only_where_every_feature_carries_over(killed_mid_answer):
    """Per request feature, a greedy request on engine 1 when its EngineCore is SIGKILLed mid-answer:
    one whose every feature carries over a splice goes on on engine 0 and equals the uninterrupted
    answer token for token (each choice of ``n``, the top logprobs too); a stream whose state would
    be lost (a grammar, text held back for stop strings, penalties that count the answer's tokens, a
    seed's random stream, bad words) ends with an error event naming it, after a prefix of the
    uninterrupted answer; the same requests not streamed start over on engine 0 and get the
    uninterrupted answer, a JSON-schema one valid JSON."""
    reference, got = killed_mid_answer
    for (name, stream), have in got.items():
        if (name, stream) in KINDS:
            continue  # the test above's
        want = reference[name, stream]
        assert not want.errors and want.token_ids, (name, want.errors)
        # A chat answer that is not streamed is parsed for tool calls whole, at its end: it goes on.
        carried = name in CARRIED or (name == "tool calls" and not stream)
        if carried or not stream:
            assert not have.errors, (name, stream, have.errors)
            assert have.choices == want.choices and have.finish_reasons == want.finish_reasons, (name, stream)
            assert [sorted(at) for at in have.top_logprobs] == [sorted(at) for at in want.top_logprobs], name
            for at_have, at_want in zip(have.top_logprobs, want.top_logprobs):
                assert at_have == pytest.approx(at_want, abs=1e-3), name
            assert have.logprobs == pytest.approx(want.logprobs, abs=1e-3), (name, stream)
        if carried and stream:
            assert len(have.continued) == 1 and have.continued[0]["tokens_kept"] > 0, (name, have.continued)
        elif carried:
            assert have.headers.get("x-skyinfer-continued-from") == "1", (name, have.headers)
        elif stream:
            assert len(have.errors) == 1 and "cannot go on on another engine" in have.errors[0]["message"], name
            assert NOT_CARRIED[name][1] in have.errors[0]["message"], (name, have.errors)
            assert have.token_ids and have.token_ids == want.token_ids[: len(have.token_ids)], name
            assert len(have.token_ids) < len(want.token_ids), name
        else:
            assert have.headers.get("x-skyinfer-retried-from") == "1", (name, have.headers)
            assert "x-skyinfer-continued-from" not in have.headers, (name, have.headers)
    answer = got["json schema", False]
    assert answer.finish_reasons == ["stop"], answer.finish_reasons
    assert json.loads(answer.text)["verdict"] in ("yes", "no"), answer.text


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


def sessions_once_both_engines_serve(server, model_name) -> dict[int, str]:
    """A session per engine, once both serve (an engine killed by an earlier test restarts: until it
    is back, every new session goes to the other, and stays there)."""
    deadline = time.monotonic() + 240
    for attempt in range(1000):
        if [e["state"] for e in server.engines()] == ["ready", "ready"]:
            found = {}
            for i in range(8):
                session = f"deaths-{attempt}-{i}"
                body = {"model": model_name, "prompt": "x", "max_tokens": 1}
                r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Session-ID": session}, timeout=60)
                found.setdefault(engine_of(r), session)
            if len(found) == 2:
                return found
        assert time.monotonic() < deadline, server.engines()
        time.sleep(1)
    raise AssertionError("unreachable")


def test_a_request_in_flight_at_two_real_engine_deaths_ends_and_the_others_complete(pair, model_name):
    """Real engines: a stream and a request that is not streamed, on engine 1 when its EngineCore is
    SIGKILLed, go on on engine 0, whose EngineCore is SIGKILLed in turn while it holds them: both
    end with the front's error (an error event; a 500 in the OpenAI shape) saying they were in
    flight at two engine deaths, and are counted; neither is sent on. A stream that was on engine 0
    alone goes on on engine 1 once it is back, and completes whole."""
    sessions = sessions_once_both_engines_serve(pair, model_name)
    ended_before = total(scrape(pair), SECOND_DEATHS, f"{SECOND_DEATHS}_total")
    tokens = 2000

    def body(stream: bool) -> dict:
        return {"model": model_name, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                "stream": stream, "return_token_ids": True}  # fmt: skip

    async def scenario():
        async with httpx.AsyncClient(base_url=pair.url, timeout=600) as http:
            started = asyncio.Semaphore(0)
            stream, other = Outcome(), Outcome()
            tasks = [
                asyncio.create_task(send(http, "/v1/completions", body(True), sessions[1], started, stream)),
                asyncio.create_task(send(http, "/v1/completions", body(False), sessions[1], status=500)),
                asyncio.create_task(send(http, "/v1/completions", body(True), sessions[0], started, other)),
            ]
            for _ in range(2):
                await asyncio.wait_for(started.acquire(), 60)
            engines = pair.engines()
            vllm_process(engines[1]["pid"], "EngineCore").send_signal(signal.SIGKILL)
            # Engine 0 holds the stream once events come from it after the splice; engine 1 is known
            # dead (the stream on engine 0 then waits for it to come back, not for its dead socket).
            deadline = time.monotonic() + 60
            while not stream.continued or (await asyncio.to_thread(pair.engines))[1]["state"] == "ready":
                assert time.monotonic() < deadline and not stream.errors, (stream.events, stream.errors)
                await asyncio.sleep(0.05)
            spliced_at = stream.events
            while stream.events < spliced_at + 8:
                await asyncio.sleep(0.05)
            vllm_process(engines[0]["pid"], "EngineCore").send_signal(signal.SIGKILL)
            _, plain, _ = await asyncio.gather(*tasks)
            return stream, plain, other

    stream, plain, other = asyncio.run(scenario())
    assert len(stream.errors) == 1 and stream.errors[0]["code"] == 500, stream.errors
    assert "not sent to a third engine" in stream.errors[0]["message"], stream.errors
    assert 0 < len(stream.token_ids) < tokens and len(stream.continued) == 1, (len(stream.token_ids), stream.continued)
    assert len(plain.errors) == 1 and "not sent to a third engine" in plain.errors[0]["message"], plain.errors
    assert not other.errors and len(other.token_ids) == tokens, (other.errors, len(other.token_ids))
    assert len(other.continued) == 1 and other.continued[0]["from_engine"] == 0, other.continued
    assert total(scrape(pair), SECOND_DEATHS, f"{SECOND_DEATHS}_total") - ended_before == 2
