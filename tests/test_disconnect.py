"""A client that goes away must not leave its request running in the engine."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from support import engine_of

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def unfinished(server, engine_id: int) -> int:
    return server.engines()[engine_id]["unfinished_requests"]


def wait_for(predicate, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def pause(server, paused: bool) -> None:
    r = httpx.post(
        f"{server.url}/{'pause' if paused else 'resume'}", params={"mode": "keep"} if paused else None, timeout=60
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_disconnect_aborts_in_engine(server, model_name, path):
    body = {"model": model_name, "stream": True, **LONG}
    body.update({"prompt": "go"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "go"}]})
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.url}{path}", json=body, headers={"X-Session-ID": f"disc-{path}"}) as r:
            assert r.status_code == 200
            engine = engine_of(r)
            chunks = r.iter_bytes()
            for _ in range(3):
                next(chunks)
            # Paused (keep), the request can only end by being aborted.
            pause(server, True)
            try:
                assert unfinished(server, engine) == 1, "the request should be held in the engine"
                # Leaving the block closes the connection mid-stream.
            except BaseException:
                pause(server, False)
                raise
        try:
            assert wait_for(lambda: unfinished(server, engine) == 0), server.engines()
            assert wait_for(lambda: server.engines()[engine]["in_flight"] == 0)
        finally:
            pause(server, False)


async def test_non_streaming_disconnect_aborts_in_engine(server, model_name):
    body = {"model": model_name, "prompt": "go", **LONG}
    async with httpx.AsyncClient(timeout=120) as client:

        async def total_unfinished() -> int:
            engines = (await client.get(f"{server.url}/engines")).json()["engines"]
            return sum(e["unfinished_requests"] for e in engines)

        assert await total_unfinished() == 0
        # Admitted while paused (keep): held, so it can only end by being aborted.
        assert (await client.post(f"{server.url}/pause", params={"mode": "keep"})).status_code == 200
        try:
            request = asyncio.create_task(client.post(f"{server.url}/v1/completions", json=body))
            deadline = time.monotonic() + 15
            while await total_unfinished() != 1:
                assert time.monotonic() < deadline and not request.done(), "request never reached an engine"
                await asyncio.sleep(0.1)
            request.cancel()  # closes the connection
            # Aborted, it is gone in well under a second; kept (the engine is paused), it never
            # ends. A 30 s deadline: generous on a busy machine.
            deadline = time.monotonic() + 30
            while await total_unfinished() != 0:
                assert time.monotonic() < deadline, "engine kept a request whose client left"
                await asyncio.sleep(0.1)
        finally:
            assert (await client.post(f"{server.url}/resume")).status_code == 200
