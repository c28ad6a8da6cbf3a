"""skyinfer serves the route surface of ``vllm serve`` (dev mode), read off vLLM's own app.

Every route vLLM registers is either served by the front or named in
``NOT_SERVED`` with its reason. Routes one engine answers are vLLM's own
handlers behind the engine; the front's answer is held to the engine's.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from skyinfer.admin.vllm_routes import NOT_SERVED

from support import COLLECTIVE_RPC_ALLOWED, app_routes, engine_of, engine_socket


def vllm_routes(model, monkeypatch) -> set[tuple[str, str]]:
    """(method, path) of every route `vllm serve` registers in dev mode, for a generative and a pooling model."""
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    from skyinfer.vllm_api import FlexibleArgumentParser, ModelConfig, build_app, make_arg_parser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", str(model)])
    pooling = ModelConfig(model=str(model), runner="pooling")
    routes = set()
    for app in (build_app(args, ("generate",)), build_app(args, ("embed", "classify"), pooling)):
        for route in app.routes:
            # /metrics is a mounted ASGI app (no methods): scraped with GET.
            for method in getattr(route, "methods", None) or {"GET"}:
                if method != "HEAD":
                    routes.add((method, route.path))
    return routes


def test_every_vllm_route_is_served_or_excluded_with_a_reason(demo_model, tmp_path, monkeypatch):
    theirs = vllm_routes(demo_model, monkeypatch)
    ours = app_routes(demo_model, tmp_path)
    assert len(theirs) > 60  # the whole surface was read, pooling routes included
    unserved = sorted((m, p) for m, p in theirs - ours if p not in NOT_SERVED)
    assert not unserved, f"routes of vllm serve neither served nor in NOT_SERVED: {unserved}"
    # Every exclusion is a route vLLM has and skyinfer does not serve.
    assert set(NOT_SERVED) <= {p for _, p in theirs} - {p for _, p in ours}
    assert all(len(reason) > 20 for reason in NOT_SERVED.values())


def test_an_engine_logs_failed_requests_stacks_only_when_asked(demo_model):
    """The engine's dev mode (for vLLM's dev routes) would turn on --log-error-stack; off as in
    `vllm serve`, the operator's flag among vLLM's arguments turns it on (the refusal that logs
    nothing: test_errors)."""
    from skyinfer.engine.__main__ import parse_engine_args

    assert parse_engine_args(["--model", str(demo_model)]).log_error_stack is False
    assert parse_engine_args(["--model", str(demo_model), "--log-error-stack"]).log_error_stack is True


def one_engine(server, engine: int) -> httpx.Client:
    transport = httpx.HTTPTransport(uds=engine_socket(server, engine))
    return httpx.Client(transport=transport, base_url="http://engine", timeout=120)


def data_plane_calls(model: str) -> list[tuple[str, str, dict | None]]:
    chat = [{"role": "user", "content": "Say hi."}]
    return [
        ("POST", "/v1/responses", {"model": model, "input": "Say hi.", "max_output_tokens": 4}),
        ("POST", "/v1/messages", {"model": model, "max_tokens": 4, "messages": chat}),
        ("POST", "/v1/messages/count_tokens", {"model": model, "messages": chat}),
        ("POST", "/v1/chat/completions/render", {"model": model, "messages": chat}),
        ("POST", "/v1/completions/render", {"model": model, "prompt": "Say hi."}),
        ("POST", "/v1/messages/render", {"model": model, "max_tokens": 4, "messages": chat}),
        ("POST", "/v1/responses/render", {"model": model, "input": "Say hi."}),
        ("POST", "/v1/chat/completions/batch", {"model": model, "messages": [chat, chat], "max_tokens": 2}),
        ("POST", "/v1/embeddings", {"model": model, "input": "Say hi."}),
        ("POST", "/pooling", {"model": model, "input": "Say hi."}),
        ("POST", "/v1/completions/derender", {"model": model, "token_ids": [1, 2, 3]}),
        ("GET", "/version", None),
        ("GET", "/tokenizer_info", None),
    ]


def shape(value):
    """The keys of a JSON answer, through lists (what two answers to one request share)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items() if isinstance(v, (dict, list))} | {"keys": sorted(value)}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None


@pytest.mark.parametrize("index", range(13))
def test_data_plane_route_answers_as_vllm_does(server, model_name, index):
    method, path, body = data_plane_calls(model_name)[index]
    ours = httpx.request(method, f"{server.url}{path}", json=body, timeout=120)
    with one_engine(server, engine_of(ours) if "X-Skyinfer-Engine" in ours.headers else 0) as engine:
        theirs = engine.request(method, path, json=body)
    assert ours.status_code == theirs.status_code, (path, ours.text, theirs.text)
    if ours.status_code == 200:
        assert shape(ours.json()) == shape(theirs.json())
    else:
        # vLLM's 404 for a route its model lacks is FastAPI's {"detail": ...}; the front's is the OpenAI shape.
        assert ours.json()["error"]["code"] == ours.status_code


def test_anthropic_and_responses_streams_relay(server, model_name):
    body = {"model": model_name, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert "event: message_stop" in r.text
    body = {"model": model_name, "input": "Hi", "max_output_tokens": 4, "stream": True}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=120)
    assert r.status_code == 200 and "response.completed" in r.text


def test_stored_response_is_found_on_the_engine_that_holds_it(server, model_name):
    created = []
    for i in range(4):  # over both engines (each input its own: no group affinity)
        r = httpx.post(
            f"{server.url}/v1/responses",
            json={"model": model_name, "input": f"{i}: count to three.", "max_output_tokens": 4, "store": True},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        created.append((r.json()["id"], engine_of(r)))
    assert {engine for _, engine in created} == {0, 1}
    for response_id, engine in created:
        r = httpx.get(f"{server.url}/v1/responses/{response_id}", timeout=30)
        assert r.status_code == 200 and r.json()["id"] == response_id and engine_of(r) == engine
    unknown = httpx.get(f"{server.url}/v1/responses/resp_unknown", timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == 404


def test_background_response_is_cancelled_on_its_engine(server, model_name):
    body = {
        "model": model_name,
        "input": "Go on for ever.",
        "max_output_tokens": 3000,
        "ignore_eos": True,
        "background": True,
        "store": True,
    }
    started = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert started.status_code == 200 and started.json()["status"] in ("queued", "in_progress"), started.text
    cancel = httpx.post(f"{server.url}/v1/responses/{started.json()['id']}/cancel", timeout=60)
    assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled", cancel.text
    assert engine_of(cancel) == engine_of(started)


def test_engine_views_are_answered_per_engine(server):
    info = httpx.get(f"{server.url}/server_info", timeout=30).json()
    assert [e["engine"] for e in info["engines"]] == [0, 1]
    assert all("vllm_config" in e["result"] for e in info["engines"])
    load = httpx.get(f"{server.url}/load", timeout=30).json()
    assert load["server_load"] == sum(e["result"]["server_load"] for e in load["engines"])
    assert httpx.get(f"{server.url}/ping", timeout=30).status_code == 200


@pytest.mark.parametrize("path", ["/reset_mm_cache", "/reset_encoder_cache"])
def test_cache_resets_fan_out(server, path):
    r = httpx.post(f"{server.url}{path}", timeout=60)
    assert r.status_code == 200 and [e["status"] for e in r.json()["engines"]] == [200, 200]


def test_collective_rpc_runs_only_allowed_methods(server):
    refused = httpx.post(f"{server.url}/collective_rpc", json={"method": "execute_model"}, timeout=30)
    assert refused.status_code == 403
    assert "--allow-collective-rpc execute_model" in refused.json()["error"]["message"]
    allowed = httpx.post(f"{server.url}/collective_rpc", json={"method": COLLECTIVE_RPC_ALLOWED}, timeout=60)
    assert allowed.status_code == 200, allowed.text
    # vLLM's answer per engine: one result per worker.
    assert all(len(e["result"]["results"]) == 1 for e in allowed.json()["engines"])


def test_vllm_app_disconnect_aborts_the_request(server, model_name):
    """A client gone mid-stream on a route served by vLLM's app frees the engine, as under uvicorn."""

    async def go():
        body = {
            "model": model_name,
            "input": "Tell a long story.",
            "max_output_tokens": 2000,
            "stream": True,
            "ignore_eos": True,
        }
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async with http.stream("POST", "/v1/responses", json=body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_bytes():
                    break
            for _ in range(100):
                engines = (await http.get("/engines")).json()["engines"]
                if sum(e["unfinished_requests"] or 0 for e in engines) == 0:
                    return
                await asyncio.sleep(0.2)
            raise AssertionError(f"the request still runs in an engine: {engines}")

    asyncio.run(go())
