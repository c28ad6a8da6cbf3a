"""A web page cannot drive an unkeyed fleet's admin routes through the operator's browser
(``security.cross_site_refusal``); curl-like callers, the same origin and keyed callers still can.
Over fake engines (tools/fake_engine.py): the control process's app, directly or behind a front
worker's app (which passes admin calls on over the control process's Unix socket)."""

from __future__ import annotations

import httpx
import openai
import pytest
from aiohttp import web
from fakes import fake_fleet, states

from skyinfer.admin.metrics import RequestMetrics
from skyinfer.client import AsyncClient
from skyinfer.fleet.registry import REGISTRY
from skyinfer.front_workers.worker import WorkerSettings, create_worker_app

EVIL = "http://evil.example"
KEY = "cross-origin-admin-key"


async def _front_client(how: str, aiohttp_client, demo_model, tmp_path, **options):
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path, **options)
    if how == "one front":
        return app, client
    control_socket = str(tmp_path / "c.sock")
    await web.UnixSite(client.server.runner, control_socket).start()
    settings = WorkerSettings(
        api_key=None,
        admin_key=options.get("admin_key"),
        group_prefix_chars=0,
        hold_requests_s=1,
        max_request_bytes=2**20,
        drain_s=1,
    )
    # No data-plane request through the worker here: it needs no leases.
    return app, await aiohttp_client(create_worker_app(settings, None, RequestMetrics(), control_socket))


def _own_origin(client) -> str:
    return f"http://{client.host}:{client.port}"


async def _untouched(app, client) -> None:
    assert await states(client) == ["ready", "ready"]
    assert (await (await client.get("/is_paused")).json())["is_paused"] is False
    assert (await (await client.get("/is_sleeping")).json())["is_sleeping"] is False
    assert all(not r.paused and not r.vllm_is_sleeping for r in app[REGISTRY].records)


@pytest.mark.parametrize("how", ["one front", "front worker"])
async def test_a_web_page_cannot_pause_or_sleep_an_unkeyed_fleet(how, aiohttp_client, demo_model, tmp_path):
    """What a browser sends for another site's page (its Origin, its Sec-Fetch-Site, a rebound
    name) to an admin route with no key set is a 403 in the OpenAI shape that says what to do,
    and the fleet is untouched."""
    app, client = await _front_client(how, aiohttp_client, demo_model, tmp_path)
    port = client.port
    browser_calls = [
        {"Origin": EVIL},
        {"Origin": EVIL, "Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Origin": "null"},  # a sandboxed frame, a file:// page
        {"Origin": f"http://127.0.0.1:{port + 1}"},  # another server on this machine
        # DNS rebinding: evil.example pointed at 127.0.0.1, so the page and the server share an origin.
        {"Origin": f"http://evil.example:{port}", "Host": f"evil.example:{port}"},
        {"Sec-Fetch-Site": "same-origin", "Host": f"evil.example:{port}"},
    ]
    for path, params in (("/sleep", {"level": "1"}), ("/sleep", {"level": "2"}), ("/pause", {"mode": "abort"})):
        for headers in browser_calls:
            r = await client.post(path, params=params, headers=headers)
            answer = await r.json()
            assert r.status == 403, (path, headers, answer)
            err = answer["error"]
            assert set(err) >= {"message", "type", "param", "code"}, answer
            assert err["code"] == 403 and err["type"] == "PermissionDeniedError", answer
            message = err["message"]
            assert "--admin-key" in message and "without a browser" in message, message
    # Reads too: a rebound page could read their answers.
    for path in ("/engines", "/weight_info", "/is_sleeping"):
        for headers in ({"Origin": EVIL}, {"Sec-Fetch-Site": "same-origin", "Host": f"evil.example:{port}"}):
            assert (await client.get(path, headers=headers)).status == 403, (path, headers)
    await _untouched(app, client)


@pytest.mark.parametrize("how", ["one front", "front worker"])
async def test_the_same_origin_and_callers_without_a_browser_still_work(how, aiohttp_client, demo_model, tmp_path):
    app, client = await _front_client(how, aiohttp_client, demo_model, tmp_path)
    port = client.port
    allowed = [
        {},  # curl, requests, the trainers: no Origin, no Fetch metadata
        {"Origin": _own_origin(client), "Sec-Fetch-Site": "same-origin"},
        {"Origin": f"http://localhost:{port}", "Host": f"localhost:{port}"},
        {"Sec-Fetch-Site": "none"},  # the operator typed the URL
    ]
    for headers in allowed:
        r = await client.post("/pause", params={"mode": "keep"}, headers=headers)
        assert r.status == 200, (headers, await r.text())
        assert await states(client) == ["paused", "paused"]
        assert (await client.post("/resume", headers=headers)).status == 200
        assert (await client.get("/engines", headers=headers)).status == 200
    await _untouched(app, client)
    # Open routes stay open to pages: probes, and (as on vLLM) the data plane.
    assert (await client.get("/health", headers={"Origin": EVIL})).status == 200
    if how == "one front":
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"Origin": EVIL})
        assert r.status == 200, await r.text()


async def test_with_an_admin_key_the_key_decides(aiohttp_client, demo_model, tmp_path):
    """With an admin key set, the key is the protection: a cross-origin call with the right key is
    served (no browser page can send it: a keyed call needs a CORS preflight skyinfer does not
    answer), one without it is the 401 it always was."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path, admin_key=KEY)
    headers = {"Origin": EVIL, "Sec-Fetch-Site": "cross-site"}
    r = await client.post("/sleep", params={"level": "1"}, headers=headers)
    assert r.status == 401, await r.text()
    await _untouched(app, _Keyed(client))
    r = await client.post("/sleep", params={"level": "1"}, headers={**headers, "Authorization": f"Bearer {KEY}"})
    assert r.status == 200, await r.text()
    assert all(r.vllm_is_sleeping for r in app[REGISTRY].records)
    assert (await client.post("/wake_up", headers={"Authorization": f"Bearer {KEY}"})).status == 200


class _Keyed:
    """A test client that sends the admin key on every call."""

    def __init__(self, client):
        self._client = client

    async def get(self, path, **kwargs):
        return await self._client.get(path, headers={"Authorization": f"Bearer {KEY}"}, **kwargs)


async def test_the_clients_the_project_supports_are_not_taken_for_browsers(aiohttp_client, demo_model, tmp_path):
    """skyinfer's own client (aiohttp), httpx and the openai SDK send no Origin: their admin and
    data-plane calls pass on an unkeyed fleet as before."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    url = str(client.make_url("")).rstrip("/")
    async with AsyncClient(url) as sky:
        await sky.pause(mode="keep")
        assert await sky.is_paused() is True
        await sky.resume()
        await sky.sleep(level=1)
        assert await sky.is_sleeping() is True
        await sky.wake_up()
        assert [e["state"] for e in await sky.engines()] == ["ready", "ready"]
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.post("/sleep", params={"level": "1"})
        assert r.status_code == 200, r.text
        assert (await http.post("/wake_up")).status_code == 200
        assert (await http.get("/engines")).status_code == 200
    oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    try:
        assert [m.id async for m in oai.models.list()]
    finally:
        await oai.close()
    await _untouched(app, client)
