"""Sticky sessions and load spreading over two real engines."""

from __future__ import annotations

import collections

import httpx

from support import engine_of


def complete(server, model: str, headers=None, **body) -> httpx.Response:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": model, "prompt": "hi", "max_tokens": 2, **body},
        headers=headers or {},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r


def test_engines_have_disjoint_cores(server):
    engines = server.engines()
    assert len(engines) == 2
    ids = [set(e["devices"]["ids"]) for e in engines]
    assert ids[0] and ids[1] and not ids[0] & ids[1]
    assert len({e["pid"] for e in engines}) == 2


def test_one_session_stays_on_one_engine(server, model_name):
    served = {engine_of(complete(server, model_name, {"X-Session-ID": "sticky-1"})) for _ in range(20)}
    assert len(served) == 1


def test_new_sessions_spread_over_both_engines(server, model_name):
    counts = collections.Counter(
        engine_of(complete(server, model_name, {"X-Session-ID": f"spread-{i}"})) for i in range(20)
    )
    assert set(counts) == {0, 1}
    assert min(counts.values()) >= 5, counts
    # ...and each of those sessions is still where it started.
    for i in range(0, 20, 4):
        first = engine_of(complete(server, model_name, {"X-Session-ID": f"spread-{i}"}))
        assert engine_of(complete(server, model_name, {"X-Session-ID": f"spread-{i}"})) == first


def test_requests_without_session_use_both_engines(server, model_name):
    served = collections.Counter(engine_of(complete(server, model_name)) for _ in range(10))
    assert set(served) == {0, 1}


def test_body_session_id_behaves_like_header(server, model_name):
    by_body = {engine_of(complete(server, model_name, session_id="body-session")) for _ in range(10)}
    assert len(by_body) == 1
    by_header = engine_of(complete(server, model_name, {"X-Session-ID": "body-session"}))
    assert by_body == {by_header}


def test_body_session_id_is_stripped_on_token_route(server, model_name):
    first = None
    for _ in range(5):
        r = httpx.post(
            f"{server.url}/inference/v1/generate",
            json={"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}, "session_id": "token-session"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        first = engine_of(r) if first is None else first
        assert engine_of(r) == first
