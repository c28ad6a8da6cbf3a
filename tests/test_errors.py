"""Bad input: a 4xx in the OpenAI error shape, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"] and err["type"]
    return err


def test_wrong_model_is_404(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert "no-such-model" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "params, param_name",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -2}, "temperature"),
        ({"top_p": 7}, "top_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 99}, "logprobs"),
    ],
)
def test_invalid_parameters_are_400(server, model_name, params, param_name):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="hi", **params)
    assert info.value.status_code == 400
    assert param_name in str(info.value.body)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", b'{"model": "x", "prompt": '),
        ("/v1/chat/completions", b"not json at all"),
        ("/v1/completions", b"[1, 2, 3]"),
        ("/v1/completions", b""),
        ("/inference/v1/generate", b'{"token_ids": [1, 2'),
        ("/tokenize", b"\xff\xfe\x00garbage"),
        # The session field makes the front parse the body itself.
        ("/v1/completions", b'{"session_id": "s", "prompt": '),
    ],
)
def test_malformed_json_is_400(server, path, body):
    r = httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert_openai_error(r, 400)


def test_wrong_types_are_400(server, model_name):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": model_name, "messages": "hello"}, timeout=30)
    assert_openai_error(r, 400)
    r = httpx.post(f"{server.url}/v1/completions", json={"model": model_name, "prompt": "x", "max_tokens": "many"}, timeout=30)
    err = assert_openai_error(r, 400)
    assert "max_tokens" in err["message"]


def test_unknown_route_and_method(server):
    assert_openai_error(httpx.get(f"{server.url}/v1/nothing-here", timeout=10), 404)
    assert_openai_error(httpx.get(f"{server.url}/v1/completions", timeout=10), 405)


def test_server_keeps_serving_after_bad_input(server, model_name):
    for body in (b"{", b"[]", b'{"model": 1}'):
        httpx.post(f"{server.url}/v1/completions", content=body, timeout=30)
    assert all(e["state"] == "ready" for e in server.engines())
    for session in ("after-errors-a", "after-errors-b"):
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": model_name, "prompt": "still alive?", "max_tokens": 4, "ignore_eos": True},
            headers={"X-Session-ID": session},
            timeout=60,
        )
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 4
