"""Sticky sessions and load spreading over two real engines."""

from __future__ import annotations

import asyncio
import collections

import httpx

from support import both_fronts, engine_of

# Against one front process, then against front workers.
server = both_fronts("one_front_server", "_workers_process")


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
    # Different prompts: no group affinity between them.
    served = collections.Counter(engine_of(complete(server, model_name, prompt=f"{i} hi")) for i in range(10))
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


def test_finish_session_ends_the_binding_and_the_next_request_is_routed_as_new(server, model_name):
    """SkyRL's and prime-rl's clients call ``POST /finish_session?session_id=...`` when a trajectory ends."""
    first = engine_of(complete(server, model_name, {"X-Session-ID": "done-1"}))
    r = httpx.post(f"{server.url}/finish_session", params={"session_id": "done-1"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "finished", "session_id": "done-1", "engine": first}
    # Finished, it is unknown: a no-op 200, as for an id never seen.
    for session in ("done-1", "never-seen"):
        r = httpx.post(f"{server.url}/finish_session", params={"session_id": session}, timeout=30)
        assert r.status_code == 200 and r.json()["engine"] is None
    # Its next request binds it afresh (the body form of the call works too).
    again = engine_of(complete(server, model_name, {"X-Session-ID": "done-1"}))
    r = httpx.post(f"{server.url}/finish_session", json={"session_id": "done-1"}, timeout=30)
    assert r.status_code == 200 and r.json()["engine"] == again
    missing = httpx.post(f"{server.url}/finish_session", timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "session_id"


def test_a_session_id_that_cannot_be_a_header_is_a_400(server, model_name):
    for bad in ("line\r\nbreak", "nul\x00", "x" * 257, "", "tab\there"):
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": model_name, "prompt": "hi", "max_tokens": 2, "session_id": bad},
            timeout=30,
        )
        if bad == "":
            assert r.status_code == 200  # no session: routed as a request without one
            continue
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", (bad, r.text)
        assert "printable ASCII" in r.json()["error"]["message"]
    assert complete(server, model_name, session_id="fine-after").status_code == 200


async def test_the_samples_of_a_prompt_group_go_to_one_engine(server, model_name):
    """Two GRPO groups of 8 samples, sent at once as separate requests without a session (each
    sample its own seed): each group is served by one engine (its prompt's prefill is computed
    once there), and the two groups by different engines."""
    prompts = {g: f"group {g}: " + "a question every sample of the group shares " * 8 for g in "AB"}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        results = await asyncio.gather(
            *(
                http.post(
                    "/v1/completions",
                    json={"model": model_name, "prompt": prompts[g], "max_tokens": 4, "temperature": 1.0, "seed": i},
                )
                for i in range(8)
                for g in "AB"
            )
        )
    assert all(r.status_code == 200 for r in results)
    served = {g: collections.Counter(engine_of(r) for r in results[k::2]) for k, g in enumerate("AB")}
    assert [len(served[g]) for g in "AB"] == [1, 1], served
    assert set(served["A"]) != set(served["B"]), served
