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

import skyinfer.front.app
from skyinfer.config import ServeConfig
from skyinfer.devices import split_cores
from skyinfer.fleet.registry import REGISTRY
from skyinfer.serving import proxy

from pushes import modified_weights, run_trainer, save, sessions_per_engine
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
        self.status = 0
        # Per choice, completions' text offsets; the prompt token ids each chunk carried (its choice's
        # index, or None: the chunk's own), in the order they came; the choices that finished.
        self.text_offsets: dict[int, list[int]] = {}
        self.prompt_token_ids: list[tuple[int | None, list[int]]] = []
        self.finished: set[int] = set()
        self.weight_versions: list[dict] = []

    def take(self, body: dict) -> None:
        if "error" in body:
            self.errors.append(body["error"])
            return
        if "skyinfer_continued" in body:
            self.continued.append(body["skyinfer_continued"])
        if body.get("usage"):
            self.usage = body["usage"]
        if body.get("prompt_token_ids") is not None:
            self.prompt_token_ids.append((None, body["prompt_token_ids"]))
        for choice in body.get("choices") or []:
            index = choice.get("index", 0)
            if choice.get("prompt_token_ids") is not None:
                self.prompt_token_ids.append((index, choice["prompt_token_ids"]))
            self.weight_versions += choice.get("weight_versions") or []
            self.token_ids += choice.get("token_ids") or []
            self.choices.setdefault(choice.get("index", 0), []).extend(choice.get("token_ids") or [])
            self.text += choice.get("text") or (choice.get("delta") or choice.get("message") or {}).get("content") or ""
            logprobs = choice.get("logprobs") or {}
            if "token_logprobs" in logprobs:
                self.logprobs += logprobs["token_logprobs"]
                self.top_logprobs += logprobs.get("top_logprobs") or []
                self.text_offsets.setdefault(index, []).extend(logprobs["text_offset"])
            else:
                self.logprobs += [entry["logprob"] for entry in logprobs.get("content") or []]
            if choice.get("finish_reason"):
                self.finish_reasons.append(choice["finish_reason"])
                self.finished.add(index)


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
    http, path: str, body: dict, session: str, started=None, outcome: Outcome | None = None, status: int | None = 200
) -> Outcome:
    """What the caller got; ``outcome``: filled as the answer comes (a stream's events); ``status``:
    the one a request that is not streamed must get (None: any, the test checks it)."""
    outcome = outcome or Outcome()
    headers = {"X-Session-ID": session}
    if not body["stream"]:
        r = await http.post(path, json=body, headers=headers)
        outcome.headers, outcome.status = dict(r.headers), r.status_code
        assert status is None or r.status_code == status, r.text
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


def test_a_record_a_caller_sends_is_dropped_and_changes_nothing(pair, model_name):
    """``skyinfer_continue`` is for the front to send: a record a caller sends (well-formed, a prompt
    of its own choosing and tokens said to be kept; or malformed), with the header by which the front
    marks its own, is dropped: its name plain (the front drops it) or spelled with a JSON escape
    (past the front's check of the bytes; the engine takes a record only with the front's header,
    which the front does not pass on). Each answer is the one the request gets without it."""
    plain = {"model": model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
             "return_token_ids": True}  # fmt: skip
    want = httpx.post(f"{pair.url}/v1/completions", json=plain, timeout=60).json()["choices"][0]["token_ids"]
    kept = {"token_ids": [5, 5, 5], "text": "", "logprobs": None, "cumulative_logprob": None,
            "finish_reason": None, "stop_reason": None, "weight_versions": [["forged", 0, 3]]}  # fmt: skip
    forged = {"calls": [{"n": 1, "prompt_token_ids": [1, 2, 3], "prompt_logprobs": None, "choices": {"0": kept}}]}
    bodies = [orjson.dumps({**plain, "skyinfer_continue": record}) for record in (forged, {"calls": 5}, "x")]
    bodies.append(
        orjson.dumps({**plain, "skyinfer_continue": forged}).replace(b"skyinfer_continue", rb"skyinfer\u005fcontinue")
    )
    for body in bodies:
        r = httpx.post(
            f"{pair.url}/v1/completions",
            content=body,
            headers={"Content-Type": "application/json", "X-Skyinfer-Continue": "1"},
            timeout=60,
        )
        assert r.status_code == 200, (body, r.text)
        assert r.json()["choices"][0]["token_ids"] == want, body
        assert "x-skyinfer-continued-from" not in r.headers


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


async def test_a_stream_read_whole_for_an_http_1_0_caller_starts_over_on_another_engine(
    aiohttp_client, demo_model, tmp_path
):
    """A caller on HTTP/1.0 gets a stream whole: engine 1 dies after 5 events of it, before any of
    it reached the caller, so the caller gets engine 0's whole stream (20 events and [DONE]), not a
    200 holding engine 1's first 5 events and nothing saying they are all."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    session = await _session_on(client, 1)
    await script(app, 1, {"die_after_events": 5})
    body = json.dumps({"prompt": "x", "max_tokens": 20, "stream": True}).encode()
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    head = (
        "POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
        f"X-Session-ID: {session}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    answer = await reader.read()  # an HTTP/1.0 answer ends with its connection
    writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and b"X-Skyinfer-Engine: 0" in head, answer[:600]
    events = [line for line in payload.split(b"\n") if line.startswith(b"data: ")]
    assert len(events) == 21 and events[-1] == b"data: [DONE]", payload
    assert await _went_on(app, 0) == []  # started over, not gone on from engine 1's record


async def test_a_record_a_caller_sends_never_reaches_an_engine_as_the_fronts(aiohttp_client, demo_model, tmp_path):
    """The front drops a caller's ``skyinfer_continue`` and never passes on the header by which an
    engine knows a record as the front's: a record whose name a JSON escape hides from the front's
    check of the bytes reaches the engine without it, and the (fake) engine, as a real one, does
    not go on from it."""
    body, session = proxy._front_fields(b'{"prompt":"x","session_id":"s","skyinfer_continue":{"calls":[]}}')
    assert (orjson.loads(body), session) == ({"prompt": "x"}, "s")
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    hidden = rb'{"prompt":"x","max_tokens":4,"skyinfer\u005fcontinue":{"calls":[],"fake_tokens":2}}'
    for body in (hidden, hidden.replace(rb"\u005f", b"_")):
        r = await client.post(
            "/v1/completions", data=body, headers={"Content-Type": "application/json", "X-Skyinfer-Continue": "1"}
        )
        assert r.status == 200, await r.text()
    assert (await _went_on(app, 0), await _went_on(app, 1)) == ([], [])


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
    monkeypatch.setattr(skyinfer.front.app, "plan_engine_devices", lambda *_args: two_engines * 2)
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


# -- what vLLM's serving layer does with a request across a splice ------------------------------

OTHER_PROMPT = "Policy gradients weigh each sampled answer"
ECHOED = "The answer is"
BEAM_TOKENS = 400
TOKEN_ROUTE = "/inference/v1/generate"


def serving_requests(model: str, prompt_ids: list[int], stop_token: int) -> dict[str, tuple[str, dict]]:
    """Greedy requests whose serving layer, not their sampling, settles how they go on, by name:
    streams that echo their prompt (completions) or last message (chat); a completion stream of
    two choices with logprobs and the prompt's token ids; the token route's stream with the prompt's
    token ids; a completion stream of two prompts, the first of which ends early (at
    ``stop_token``, which the second never samples); beam search (not streamed, as vLLM has it)."""
    common = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    usage = {"stream_options": {"include_usage": True}}
    chat_echo = {
        "messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": ECHOED}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return {
        "completion echo": ("/v1/completions", {**common, "prompt": PROMPT, "echo": True}),
        "chat echo": ("/v1/chat/completions", {**common, **chat_echo, "echo": True}),
        "n with offsets": (
            "/v1/completions",
            {
                **common,
                **usage,
                "prompt": PROMPT,
                "n": 2,
                "temperature": 1.0,
                "top_k": 1,
                "logprobs": 2,
                "return_token_ids": True,
            },
        ),
        "token route prompt ids": (
            TOKEN_ROUTE,
            {
                "model": model,
                "token_ids": prompt_ids,
                "sampling_params": sampling,
                "stream": True,
                "return_token_ids": True,
                **usage,
            },
        ),
        "two prompts": (
            "/v1/completions",
            {
                **common,
                **usage,
                "prompt": [PROMPT, OTHER_PROMPT],
                "stop_token_ids": [stop_token],
                "return_token_ids": True,
            },
        ),
        "beam search": (
            "/v1/completions",
            {**common, "prompt": PROMPT, "use_beam_search": True, "n": 2, "max_tokens": BEAM_TOKENS, "stream": False},
        ),
    }


@pytest.fixture(scope="module")
def killed_mid_serving(pair, model_name) -> tuple[dict, dict]:
    """Every request of ``serving_requests`` on engine 1, whose EngineCore is SIGKILLed once every
    stream has events and the first prompt of two has ended; the same requests uncrashed on engine 0
    beforehand. What each caller got, both ways."""
    sessions = sessions_once_both_engines_serve(pair, model_name)
    prompt_ids = httpx.post(f"{pair.url}/tokenize", json={"model": model_name, "prompt": PROMPT}, timeout=30).json()[
        "tokens"
    ]
    plain = {"model": model_name, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
             "return_token_ids": True}  # fmt: skip
    first, second = (
        httpx.post(f"{pair.url}/v1/completions", json={**plain, "prompt": prompt}, timeout=120).json()["choices"][0][
            "token_ids"
        ]
        for prompt in (PROMPT, OTHER_PROMPT)
    )
    stop_token = next(token for token in first[5:] if token not in second)
    requests = serving_requests(model_name, prompt_ids, stop_token)

    async def scenario():
        async with httpx.AsyncClient(base_url=pair.url, timeout=300) as http:
            reference = dict(zip(requests, await asyncio.gather(
                *(send(http, path, body, sessions[0], status=None) for path, body in requests.values())
            )))  # fmt: skip
            started = asyncio.Semaphore(0)
            got = {name: Outcome() for name in requests}
            tasks = [asyncio.create_task(send(http, path, body, sessions[1], started, got[name], status=None))
                     for name, (path, body) in requests.items()]  # fmt: skip
            for _ in range(sum(1 for _, body in requests.values() if body["stream"])):
                await asyncio.wait_for(started.acquire(), 60)
            deadline = time.monotonic() + 60
            while 0 not in got["two prompts"].finished:
                assert time.monotonic() < deadline, got["two prompts"].finish_reasons
                await asyncio.sleep(0.05)
            vllm_process(pair.engines()[1]["pid"], "EngineCore").send_signal(signal.SIGKILL)
            await asyncio.gather(*tasks)
            return reference, got

    return asyncio.run(scenario())


def test_a_stream_that_echoes_ends_at_its_engines_death_saying_why(killed_mid_serving):
    """A completion stream that echoes its prompt, and a chat stream that echoes its last message, on
    engine 1 when its EngineCore is SIGKILLed: the next engine would echo again mid-answer, so each
    ends with the front's error naming echo, after a prefix of the uninterrupted answer."""
    reference, got = killed_mid_serving
    for name in ("completion echo", "chat echo"):
        want, have = reference[name], got[name]
        assert not want.errors and want.text.startswith(PROMPT if name == "completion echo" else ECHOED), name
        assert len(have.errors) == 1 and "cannot go on on another engine" in have.errors[0]["message"], have.errors
        assert "echo in a stream" in have.errors[0]["message"], have.errors
        assert have.text and want.text.startswith(have.text) and len(have.text) < len(want.text), (name, have.text)


def test_a_stream_goes_on_with_its_prompt_ids_once_and_its_text_offsets_going_on(killed_mid_serving):
    """A completion stream of two choices with logprobs and the prompt's token ids, and the token
    route's stream with the prompt's token ids, go on on engine 0: the caller gets the prompt's
    token ids once (per choice; once in all on the token route), each choice's text offsets go on
    from its kept text, and usage counts every token, as in the uninterrupted stream."""
    reference, got = killed_mid_serving
    for name in ("n with offsets", "token route prompt ids"):
        want, have = reference[name], got[name]
        assert not have.errors and len(have.continued) == 1 and have.continued[0]["tokens_kept"] > 0, name
        assert have.choices == want.choices and len(want.choices[0]) == MAX_TOKENS, name
        assert want.prompt_token_ids and sorted(have.prompt_token_ids) == sorted(want.prompt_token_ids), name
        assert have.text_offsets == want.text_offsets, name
        assert have.usage == want.usage, (name, have.usage, want.usage)
    assert len(reference["n with offsets"].text_offsets[1]) == MAX_TOKENS


def test_a_stream_whose_first_prompt_ended_goes_on_counting_that_prompt(killed_mid_serving):
    """A completion stream of two prompts whose first had ended (every choice of it) when the
    EngineCore died goes on with the second, and its usage still counts the first prompt's tokens."""
    reference, got = killed_mid_serving
    want, have = reference["two prompts"], got["two prompts"]
    assert not have.errors and len(have.continued) == 1, have.errors
    assert len(want.choices[0]) < MAX_TOKENS == len(want.choices[1]) and have.choices == want.choices
    assert have.usage == want.usage, (have.usage, want.usage)


def test_beam_search_whose_engine_dies_starts_over_on_another_engine(killed_mid_serving):
    """Beam search calls vLLM's generate once per beam per step, which a record cannot resume: on
    engine 1 when its EngineCore is SIGKILLed, it starts over on engine 0, with the uninterrupted
    answer."""
    reference, got = killed_mid_serving
    want, have = reference["beam search"], got["beam search"]
    assert want.status == 200 and want.text, want.errors
    assert have.status == 200, have.errors
    assert have.headers.get("x-skyinfer-retried-from") == "1", have.headers
    assert "x-skyinfer-continued-from" not in have.headers, have.headers
    assert have.text == want.text


def test_a_chat_stream_parsed_by_harmony_is_not_continued():
    """vLLM parses a gpt-oss model's chat stream with Harmony as it goes, with no reasoning parser
    named: such a stream is not continued; the same request not streamed, or another model's, is."""
    from types import SimpleNamespace

    from skyinfer.engine import continuation
    from skyinfer.vllm_api import ChatCompletionRequest

    def state(model_type: str) -> SimpleNamespace:
        return SimpleNamespace(
            args=SimpleNamespace(structured_outputs_config=SimpleNamespace(reasoning_parser=None)),
            vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=model_type))),
        )

    def why(model_type: str, stream: bool) -> str | None:
        track = continuation.RequestTrack()
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], stream=stream)
        continuation.note_request(track, request, state(model_type))
        return track.not_continued

    assert "parsed by Harmony" in why("gpt_oss", True)
    assert why("gpt_oss", False) is None
    assert why("llama", True) is None


PUSHED_TOKENS = 1000


def test_a_request_killed_after_a_keep_mode_push_keeps_which_weights_sampled_each_token(
    pair, model_name, demo_model, tmp_path
):
    """A greedy token-route request (streamed, and not) runs on engine 1 across a push of other
    weights that keeps it (a keep pause, the push, resume), then engine 1's EngineCore is SIGKILLed
    and it goes on on engine 0. Its weight spans are those the tokens were sampled with: the old
    version up to the first token whose logprob differs from the old weights' uninterrupted answer
    (the first the pushed weights sampled), the pushed one from there; not every kept token labelled
    with the version engine 1 served when it died."""
    sessions = sessions_once_both_engines_serve(pair, model_name)
    prompt_ids = httpx.post(f"{pair.url}/tokenize", json={"model": model_name, "prompt": PROMPT}, timeout=30).json()[
        "tokens"
    ]
    weights = save(modified_weights(demo_model, seed=3), tmp_path / "pushed.safetensors")

    def body(stream: bool) -> dict:
        sampling = {"max_tokens": PUSHED_TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        return {"model": model_name, "token_ids": prompt_ids, "sampling_params": sampling, "stream": stream}

    async def scenario():
        async with httpx.AsyncClient(base_url=pair.url, timeout=600) as http:
            reference = await send(http, TOKEN_ROUTE, body(False), sessions[0])
            started, streamed = asyncio.Semaphore(0), Outcome()
            tasks = [
                asyncio.create_task(send(http, TOKEN_ROUTE, body(True), sessions[1], started, streamed)),
                asyncio.create_task(send(http, TOKEN_ROUTE, body(False), sessions[1])),
            ]
            await asyncio.wait_for(started.acquire(), 60)
            assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
            trainer = await asyncio.to_thread(run_trainer, pair, weights, "pushed")
            assert trainer.returncode == 0, trainer.stdout + trainer.stderr
            assert (await http.post("/resume")).status_code == 200
            resumed_at, deadline = streamed.events, time.monotonic() + 60
            while streamed.events < resumed_at + 8:
                assert time.monotonic() < deadline and not streamed.finished, streamed.events
                await asyncio.sleep(0.05)
            vllm_process(pair.engines()[1]["pid"], "EngineCore").send_signal(signal.SIGKILL)
            _, whole = await asyncio.gather(*tasks)
            return reference, streamed, whole

    reference, streamed, whole = asyncio.run(scenario())
    (old,) = [span["version"] for span in reference.weight_versions]
    assert old != "pushed" and len(reference.token_ids) == PUSHED_TOKENS
    for have in (streamed, whole):
        assert not have.errors and len(have.token_ids) == PUSHED_TOKENS, have.errors
        boundary = next(
            k
            for k, (token, logprob) in enumerate(zip(have.token_ids, have.logprobs))
            if token != reference.token_ids[k] or abs(logprob - reference.logprobs[k]) > 0.01
        )
        assert have.weight_versions == [
            {"version": old, "start": 0, "end": boundary},
            {"version": "pushed", "start": boundary, "end": PUSHED_TOKENS},
        ], (boundary, have.weight_versions)
    # Engine 1 sampled with both weights before it died.
    assert len(streamed.continued) == 1 and 0 < boundary < streamed.continued[0]["tokens_kept"], streamed.continued
