"""Keys, the bind rule and the body limit, on a real server started with keys; what admin bodies
and --allow-pickled-ipc need, over fake engines (tools/fake_engine.py)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import httpx
import openai
import orjson
import pytest
from aiohttp import web
from fakes import fake_fleet

from skyinfer.__main__ import _config_from_args, _serve_parser
from skyinfer.admin.metrics import RequestMetrics
from skyinfer.config import ServeConfig, is_loopback
from skyinfer.fleet.registry import REGISTRY
from skyinfer.front_workers.worker import WorkerSettings, create_worker_app
from skyinfer.serving.proxy import DATA_PLANE_POST

from support import ADMIN_KEY, API_KEY, app_routes, bearer, concrete
from test_errors import assert_openai_error

DATA_ROUTES = [
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/inference/v1/generate"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"), ("POST", "/finish_session"),
    *(("POST", path) for path in DATA_PLANE_POST[5:]), ("GET", "/tokenizer_info"),
    ("GET", "/v1/responses/{response_id}"), ("POST", "/v1/responses/{response_id}/cancel"),
]  # fmt: skip
ADMIN_ROUTES = [
    ("POST", "/pause"), ("POST", "/resume"), ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_paused"),
    ("GET", "/is_sleeping"), ("POST", "/reset_prefix_cache"), ("POST", "/abort_requests"), ("GET", "/get_world_size"),
    ("POST", "/init_weight_transfer"), ("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update"),
    ("POST", "/update_weights"), ("POST", "/finish_weight_update"), ("GET", "/weight_info"), ("GET", "/engines"),
    ("POST", "/shutdown_weight_transfer_engine"), ("POST", "/update_weight_version"), ("POST", "/weight_checker"),
    ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"), ("POST", "/update_lora_adapter"),
    ("GET", "/server_info"), ("GET", "/kv_event_sources"), ("POST", "/reset_mm_cache"),
    ("POST", "/reset_encoder_cache"), ("POST", "/collective_rpc"), ("POST", "/inference/v1/abort_requests"),
    ("POST", "/reload_weights"), ("POST", "/engines/{engine_id}/restart"), ("POST", "/engines/{engine_id}/catch_up"),
]  # fmt: skip
PUBLIC_ROUTES = [
    ("GET", "/health"), ("GET", "/ready"), ("GET", "/metrics"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/load"),
    ("GET", "/version"),
]  # fmt: skip


def test_every_protected_route_refuses_wrong_or_missing_keys(keyed_server, demo_model, tmp_path):
    every_route = app_routes(demo_model, tmp_path) - set(PUBLIC_ROUTES)
    # The lists above cover every route the server has: a new route must be classified here.
    assert every_route == set(DATA_ROUTES) | set(ADMIN_ROUTES)
    with httpx.Client(base_url=keyed_server.url, timeout=30) as http:
        for routes, wrong_keys in ((DATA_ROUTES, [ADMIN_KEY]), (ADMIN_ROUTES, [API_KEY])):
            for method, path in routes:
                for headers in (
                    {},
                    bearer("sk-nope"),
                    bearer(API_KEY[:-1]),
                    {"Authorization": API_KEY},
                    *(bearer(k) for k in wrong_keys),
                ):
                    r = http.request(method, concrete(path), headers=headers, json={})
                    assert_openai_error(r, 401)
                    assert r.headers["WWW-Authenticate"] == "Bearer"
        # Nothing was done on the way: the engine is neither paused nor asleep.
        assert http.get("/engines", headers=bearer(ADMIN_KEY)).json()["engines"][0]["state"] == "ready"


def test_right_keys_work(keyed_server):
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0)
    out = client.completions.create(
        model=keyed_server.model, prompt="hello", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    with httpx.Client(base_url=keyed_server.url, timeout=60, headers=bearer(ADMIN_KEY)) as http:
        assert http.post("/pause", params={"mode": "keep"}).status_code == 200
        assert http.get("/is_paused").json()["is_paused"] is True
        assert http.post("/resume").status_code == 200
        assert http.get("/get_world_size").json() == {"world_size": 1}
        # Past the key check, the route's own validation answers.
        assert_openai_error(http.post("/init_weight_transfer", json={}), 400)
    for method, path in PUBLIC_ROUTES:
        assert httpx.request(method, f"{keyed_server.url}{path}", timeout=30).status_code == 200


def test_oversized_body_is_413_and_service_goes_on(keyed_server):
    big = {"model": keyed_server.model, "prompt": "x " * (1024 * 1024), "max_tokens": 1}
    r = httpx.post(f"{keyed_server.url}/v1/completions", json=big, headers=bearer(API_KEY), timeout=60)
    err = assert_openai_error(r, 413)
    assert "size" in err["message"]
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model=keyed_server.model, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_non_loopback_bind_without_admin_key_refuses_to_start(demo_model):
    argv = [sys.executable, "-m", "skyinfer", "serve", "--model", str(demo_model), "--host", "0.0.0.0", "--port", "0"]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "--admin-key" in refused.stderr and "engine 0" not in refused.stderr
    # An API key alone does not open the admin routes to the network either.
    refused = subprocess.run([*argv, "--api-key", "k"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("example.org", False),
        ("", False),
    ],
)
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


PICKLES_NEED_A_KEY = "--allow-pickled-ipc needs an admin key"


def _serve_config(*argv: str) -> ServeConfig:
    """What ``skyinfer serve ARGV`` would run with (the parser reads SKYINFER_ADMIN_KEY when it is made)."""
    sub = argparse.ArgumentParser().add_subparsers()
    ns, extra = _serve_parser(sub).parse_known_args(list(argv))
    return _config_from_args(ns, extra)


def test_allow_pickled_ipc_needs_an_admin_key_on_any_address(demo_model, monkeypatch):
    """Pickled IPC handles run code in the engines: loopback is no excuse (a local process, or a web
    page in the operator's browser, reaches 127.0.0.1). Refused before any engine starts."""
    argv = [sys.executable, "-m", "skyinfer", "serve", "--model", str(demo_model), "--port", "0", "--colocate"]
    for host in ("127.0.0.1", "0.0.0.0"):
        more = ["--allow-unauthenticated-admin"] if host == "0.0.0.0" else []
        refused = subprocess.run(
            [*argv, "--host", host, *more, "--allow-pickled-ipc", "--api-key", "k"],  # an API key is not enough
            capture_output=True,
            text=True,
            timeout=30,  # refused before any engine starts: seconds
            env={k: v for k, v in os.environ.items() if k != "SKYINFER_ADMIN_KEY"},
        )
        assert refused.returncode == 2, refused.stderr
        assert PICKLES_NEED_A_KEY in refused.stderr and "--admin-key" in refused.stderr, refused.stderr
        assert "SKYINFER_ADMIN_KEY" in refused.stderr and "engine 0" not in refused.stderr
    monkeypatch.delenv("SKYINFER_ADMIN_KEY", raising=False)
    with pytest.raises(ValueError, match=PICKLES_NEED_A_KEY):
        _serve_config("--model", str(demo_model), "--colocate", "--allow-pickled-ipc")
    with pytest.raises(ValueError, match=PICKLES_NEED_A_KEY):
        _serve_config("--model", str(demo_model), "--colocate", "--allow-pickled-ipc", "--admin-key", "")
    keyed = _serve_config("--model", str(demo_model), "--colocate", "--allow-pickled-ipc", "--admin-key", ADMIN_KEY)
    assert keyed.allow_pickled_ipc and keyed.admin_key == ADMIN_KEY
    monkeypatch.setenv("SKYINFER_ADMIN_KEY", ADMIN_KEY)
    assert _serve_config("--model", str(demo_model), "--colocate", "--allow-pickled-ipc").admin_key == ADMIN_KEY


# A JSON body a browser may send cross-site without asking the server first (no CORS preflight):
# text/plain, a form's types, or no Content-Type at all ({}: none sent).
SIMPLE_REQUEST_TYPES = [
    {"Content-Type": "text/plain"},
    {"Content-Type": "text/plain;charset=UTF-8"},
    {"Content-Type": "application/x-www-form-urlencoded"},
    {"Content-Type": "multipart/form-data; boundary=b"},
    {"Content-Type": "application/octet-stream"},
    {},
]
ADMIN_BODIES = [
    ("/pause", {"mode": "keep"}),
    ("/sleep", {"level": 1}),
    ("/wake_up", {"tags": ["weights"]}),
    ("/abort_requests", {}),
    ("/init_weight_transfer", {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "world_size": 3}}),
    ("/finish_weight_update", {"weight_version": "cross-site"}),
    ("/update_weight_version", {"new_version": "cross-site"}),
    ("/v1/load_lora_adapter", {"lora_name": "cross-site", "lora_path": "/nonexistent"}),
    ("/collective_rpc", {"method": "execute_model"}),
]


async def _front_client(how: str, aiohttp_client, demo_model, tmp_path):
    """The control process's app over two fake engines, and a client of it: directly, or through a
    front worker's app (which passes every admin call on over the control process's Unix socket)."""
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    if how == "one front":
        return app, client
    control_socket = str(tmp_path / "c.sock")
    await web.UnixSite(client.server.runner, control_socket).start()
    settings = WorkerSettings(
        api_key=None, admin_key=None, group_prefix_chars=0, hold_requests_s=1, max_request_bytes=2**20, drain_s=1
    )
    # No data-plane request here: the worker needs no leases.
    return app, await aiohttp_client(create_worker_app(settings, None, RequestMetrics(), control_socket))


@pytest.mark.parametrize("how", ["one front", "front worker"])
async def test_admin_bodies_are_read_only_as_application_json(how, aiohttp_client, demo_model, tmp_path):
    """A JSON admin body sent as anything but application/json (what a web page can send
    cross-site) is a 415 in the OpenAI shape and changes nothing; as application/json it works; an
    empty body works whatever its type (vLLM's admin routes take query strings)."""
    app, client = await _front_client(how, aiohttp_client, demo_model, tmp_path)
    for path, body in ADMIN_BODIES:
        for headers in SIMPLE_REQUEST_TYPES:
            # skip_auto_headers: aiohttp would send a bytes body as application/octet-stream.
            r = await client.post(path, data=orjson.dumps(body), headers=headers, skip_auto_headers=["Content-Type"])
            answer = await r.json()
            assert r.status == 415, (path, headers, answer)
            err = answer["error"]
            assert set(err) >= {"message", "type", "param", "code"} and err["code"] == 415, answer
            assert err["type"] == "UnsupportedMediaTypeError"
            assert "send the body as application/json" in err["message"], err
    # Nothing was done: no engine paused, asleep, in a transfer group, relabelled or holding an adapter.
    assert (await (await client.get("/is_paused")).json())["is_paused"] is False
    assert (await (await client.get("/is_sleeping")).json())["is_sleeping"] is False
    info = await (await client.get("/weight_info")).json()
    assert info["weight_version"] is None and not info["adapters"], info
    assert all(e["state"] == "ready" and not e["in_transfer_group"] for e in info["engines"]), info
    assert all(not r.paused and not r.vllm_is_sleeping for r in app[REGISTRY].records)

    # The same body as application/json (parameters and the type's case are the sender's) is read.
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        r = await client.post("/pause", data=b'{"mode": "keep"}', headers={"Content-Type": content_type})
        assert r.status == 200 and (await r.json())["mode"] == "keep", await r.text()
        assert (await (await client.get("/is_paused")).json())["is_paused"] is True
        assert (await client.post("/resume")).status == 200
    r = await client.post("/pause", json={"mode": "sideways"})
    assert r.status == 400 and (await r.json())["error"]["param"] == "mode"
    # An empty body, with no Content-Type or any other, is fine: parameters in the query string.
    for headers in ({}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}):
        r = await client.post("/pause", params={"mode": "keep"}, headers=headers, skip_auto_headers=["Content-Type"])
        assert r.status == 200 and (await r.json())["mode"] == "keep", await r.text()
        r = await client.post("/resume", headers=headers, skip_auto_headers=["Content-Type"])
        assert r.status == 200, await r.text()
    assert (await (await client.get("/is_paused")).json())["is_paused"] is False
