"""``skyinfer.client`` against a real server: every method, pickled into another process, 2,000 at once."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import resource
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from skyinfer.client import AsyncClient, Client, SkyinferError

from support import scrape, total


async def test_data_plane_methods(server, model_name):
    async with AsyncClient(server.url) as client:
        assert [m["id"] for m in await client.models()] == [model_name]
        assert await client.model() == model_name
        text = "Héllo wörld 🚀"
        ids = await client.tokenize(text)
        assert await client.detokenize(ids) == text
        chat = [{"role": "user", "content": "hi there"}]
        chat_ids = await client.tokenize(messages=chat, add_generation_prompt=True)
        assert len(chat_ids) > len(await client.tokenize("hi there"))

        out = await client.generate(
            ids, {"max_tokens": 6, "temperature": 0, "logprobs": 1, "ignore_eos": True}, session_id="client-generate"
        )
        choice = out["choices"][0]
        assert len(choice["token_ids"]) == 6 and len(choice["logprobs"]["content"]) == 6
        # The same greedy request through the text route gives the same tokens.
        done = await client.complete(
            ids, max_tokens=6, temperature=0, ignore_eos=True, return_token_ids=True, session_id="client-generate"
        )
        assert done["choices"][0]["token_ids"] == choice["token_ids"]
        reply = await client.chat(chat, max_tokens=5, ignore_eos=True, return_token_ids=True, session_id="client-chat")
        assert len(reply["choices"][0]["token_ids"]) == reply["usage"]["completion_tokens"] == 5
        assert reply["prompt_token_ids"] == chat_ids

        with pytest.raises(SkyinferError) as missing:
            await client.complete("x", model="no-such-model", max_tokens=1)
        assert missing.value.status == 404 and "no-such-model" in missing.value.message
        with pytest.raises(ValueError, match="openai SDK"):
            await client.chat([{"role": "user", "content": "hi"}], stream=True)
        with pytest.raises(SkyinferError) as bad:
            await client.generate([1], {"max_tokens": -3})
        assert bad.value.status == 400 and "max_tokens" in bad.value.message


async def test_control_and_status_methods(server, model_name):
    async with AsyncClient(server.url) as client:
        assert await client.ready() and not await client.is_paused()
        assert (await client.pause(mode="keep"))["status"] == "paused"
        assert await client.is_paused() and not await client.ready()
        # A request sent while paused is held; abort ends it.
        held = asyncio.create_task(client.complete("held", max_tokens=50, session_id="client-held"))
        deadline = time.monotonic() + 30
        while sum(e["unfinished_requests"] or 0 for e in await client.engines()) != 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert (await client.abort(["cmpl-no-such-request"]))["aborted"] == 0
        # An empty list aborts nothing; "all" must be said.
        assert (await client.abort([]))["aborted"] == 0
        with pytest.raises(ValueError):
            await client.abort()
        assert not held.done()
        assert (await client.abort(all_requests=True))["aborted"] == 1
        assert (await held)["choices"][0]["finish_reason"] == "abort"
        assert (await client.resume())["status"] == "resumed"
        with pytest.raises(SkyinferError) as wrong_order:
            await client.resume()
        assert wrong_order.value.status == 409 and "not paused" in wrong_order.value.message

        assert (await client.sleep(level=1))["status"] == "sleeping"
        assert await client.is_sleeping()
        assert (await client.wake_up(tags=["weights"]))["status"] == "sleeping"  # kv cache still asleep
        assert (await client.wake_up(tags=["kv_cache", "scheduling"]))["status"] == "awake"
        assert not await client.is_sleeping()
        await client.wait_ready(timeout_s=60)
        assert (await client.reset_prefix_cache())["status"] == "reset"

        engines = await client.engines()
        assert [e["state"] for e in engines] == ["ready", "ready"]
        health = await client.health()
        assert health["serving_engines"] == 2 and len(health["engines"]) == 2
        assert "skyinfer_requests_total" in await client.metrics()
        assert await client.get_world_size() == 2
        assert len((await client.weight_info())["engines"]) == 2
        # Metadata that the checkpoint does not have: refused before any transfer.
        with pytest.raises(SkyinferError) as refused:
            await client.update_weights({"names": ["no.such.weight"], "dtype_names": ["float32"], "shapes": [[1]]})
        assert refused.value.status == 400 and "no.such.weight" in refused.value.message


def _rollout_in_child(client: AsyncClient, prompt_ids: list[int]) -> dict:
    """Runs in a worker process: the unpickled client makes its own connections there."""

    async def rollout() -> dict:
        out = await client.generate(
            prompt_ids, {"max_tokens": 5, "temperature": 0, "ignore_eos": True}, session_id="child-session"
        )
        states = [e["state"] for e in await client.engines()]
        await client.aclose()
        return {"pid": os.getpid(), "tokens": out["choices"][0]["token_ids"], "states": states}

    return asyncio.run(rollout())


async def test_client_pickles_into_another_process(server):
    client = AsyncClient(server.url, timeout_s=120)
    # Used here first, so it holds a live connection pool when pickled.
    here = await client.generate(
        [9, 8, 7], {"max_tokens": 5, "temperature": 0, "ignore_eos": True}, session_id="child-session"
    )
    copy = pickle.loads(pickle.dumps(client))
    assert copy.base_url == client.base_url and copy.timeout_s == 120
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        there = await asyncio.wrap_future(pool.submit(_rollout_in_child, client, [9, 8, 7]))
    await client.aclose()
    assert there["pid"] != os.getpid()
    assert there["tokens"] == here["choices"][0]["token_ids"]
    assert there["states"] == ["ready", "ready"]
    # The blocking client pickles too.
    assert pickle.loads(pickle.dumps(Client(server.url))).engines()[0]["id"] == 0


async def test_two_thousand_concurrent_requests(server):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    before = scrape(server)
    n = 2000
    async with AsyncClient(server.url) as client:
        results = await asyncio.gather(
            *(
                client.generate([5 + i % 100, 6, 7], {"max_tokens": 4, "ignore_eos": True}, session_id=f"many-{i % 64}")
                for i in range(n)
            )
        )
    assert all(len(r["choices"][0]["token_ids"]) == 4 for r in results)
    after = scrape(server)
    per_engine = [
        total(
            after,
            "skyinfer_requests",
            "skyinfer_requests_total",
            route="/inference/v1/generate",
            status="200",
            engine=e,
        )
        - total(
            before,
            "skyinfer_requests",
            "skyinfer_requests_total",
            route="/inference/v1/generate",
            status="200",
            engine=e,
        )
        for e in ("0", "1")
    ]
    assert sum(per_engine) == n and min(per_engine) > n / 4, per_engine
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
