"""Keys, the bind rule and the body limit, on a real server started with keys."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from skyinfer.proxy import DATA_PLANE_POST
from skyinfer.security import is_loopback

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
    ("POST", "/reload_weights"), ("POST", "/engines/{engine_id}/restart"),
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
