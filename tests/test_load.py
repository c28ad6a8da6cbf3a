"""Load queues, it never fails: thousands of concurrent requests from clients that do not retry.

One engine takes everything, as in a newcomer's first benchmark: 2,000
non-streaming and 500 streaming requests at once through a plain aiohttp
client, and half as many through the ``openai`` SDK with retries off (as many
took 48 s to the plain client's 15 s, the SDK's own cost in the test process).
Every one must come back 200 with its full token count.
"""

from __future__ import annotations

import asyncio
import resource

import aiohttp
import httpx
import openai
import orjson
import pytest

from support import API_KEY, bearer, both_fronts, scrape, total

# Against one front process, then against front workers.
keyed_server = both_fronts("_keyed_process", "_keyed_workers_process")


MAX_TOKENS = 4
N_PLAIN, N_STREAM = 2000, 500


@pytest.fixture(autouse=True)
def enough_open_files():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _failed_503s(srv) -> float:
    return sum(
        s.value
        for s in scrape(srv).get("skyinfer_requests", [])
        if s.name == "skyinfer_requests_total" and s.labels["status"] == "503"
    )


async def test_plain_client_without_retries(keyed_server):
    model = keyed_server.model
    refused_before = _failed_503s(keyed_server)

    async def plain(session: aiohttp.ClientSession, i: int) -> int:
        body = {"model": model, "prompt": f"load {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True}
        async with session.post(
            "/v1/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["usage"]["completion_tokens"]

    async def streamed(session: aiohttp.ClientSession, i: int) -> int:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"stream {i}"}],
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with session.post(
            "/v1/chat/completions", data=orjson.dumps(body), headers={"Content-Type": "application/json"}
        ) as r:
            assert r.status == 200, await r.text()
            events = [line[6:] for line in (await r.text()).split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return orjson.loads(events[-2])["usage"]["completion_tokens"]

    # No connection cap on the client side: every request is on the wire at once.
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    headers = bearer(API_KEY)
    async with aiohttp.ClientSession(
        keyed_server.url, connector=connector, timeout=timeout, headers=headers
    ) as session:
        counts = await asyncio.gather(
            *(plain(session, i) for i in range(N_PLAIN)), *(streamed(session, i) for i in range(N_STREAM))
        )
    assert counts == [MAX_TOKENS] * (N_PLAIN + N_STREAM)
    assert _failed_503s(keyed_server) == refused_before
    # Nothing is left waiting in the front.
    assert total(scrape(keyed_server), "skyinfer_engine_queued", "skyinfer_engine_queued", engine="0") == 0


async def test_openai_sdk_without_retries(keyed_server):
    model = keyed_server.model
    http_client = openai.DefaultAsyncHttpxClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None), timeout=600
    )
    client = openai.AsyncOpenAI(
        base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0, http_client=http_client
    )

    async def plain(i: int) -> int:
        r = await client.completions.create(
            model=model, prompt=f"sdk {i}", max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
        )
        return r.usage.completion_tokens

    async def streamed(i: int) -> int:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"sdk stream {i}"}],
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    try:
        counts = await asyncio.gather(
            *(plain(i) for i in range(N_PLAIN // 2)), *(streamed(i) for i in range(N_STREAM // 2))
        )
    finally:
        await client.close()
    assert counts == [MAX_TOKENS] * ((N_PLAIN + N_STREAM) // 2)
