"""Shared fixtures: the demo model and a real skyinfer server with two vLLM engines.

Engines take 30-45 s to start, so one two-engine server serves every module that can share it
(modules that push weights into it restore the checkpoint after them), and a one-engine server
with keys serves the security and load tests; tests that must stop or break a server start their
own. tests/server_plan.py orders the modules so that each shared server stops after its last user.
"""

from __future__ import annotations

import inspect
import socket
from pathlib import Path

import httpx
import httpx2
import pytest

from skyinfer.demo_model import build_demo_model

import support
from server_plan import LANES, PLAN, session_server
from support import (
    FRONT_WORKERS,
    WORKERS_ARGS,
    keyed_one_engine,
    launched,
    restore_checkpoint,
    running,
    two_float32_engines,
)

# Each module's time and the suite's peak memory, printed at the end (tests/suite_report.py).
pytest_plugins = ("suite_report",)

# httpx (and httpx2, the openai and anthropic SDKs' fork of it) makes an SSL context for every
# client, loading each certificate of the machine's CA bundle, and its module-level calls
# (httpx.get, httpx.post) make a client a call: 20-30 ms of CPU each on these machines, for tests
# that speak plain HTTP to 127.0.0.1 (40% of the first lane's pytest, sampled by py-spy). One
# context, made once, is every client's default in the tests' processes.
_ONE_SSL_CONTEXT = httpx.create_ssl_context()
for _httpx in (httpx, httpx2):
    for _name in ("request", "stream", "get", "post", "put", "patch", "delete", "head", "options"):
        _call = inspect.unwrap(getattr(_httpx, _name))
        _call.__kwdefaults__ = {**_call.__kwdefaults__, "verify": _ONE_SSL_CONTEXT}
    for _client in (_httpx.Client, _httpx.AsyncClient):
        _client.__init__.__kwdefaults__ = {**_client.__init__.__kwdefaults__, "verify": _ONE_SSL_CONTEXT}


def pytest_configure(config) -> None:
    # The order modules run in and how long the session's servers live (tests/server_plan.py).
    config.pluginmanager.register(PLAN, "server-plan")
    support.REAL_SERVERS_ALLOWED = config.getoption("--lane") != "front"


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish() -> None:
    # After the session's servers stopped (server_plan.py), their engines with them.
    support.stop_shared_engine_template()


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--lane",
        choices=LANES,
        help="only the modules that start no vLLM engine (front), or only the others (engines), or one of the"
        " two halves of those (engines-1, engines-2); tools/run-tests runs front, engines-1 and engines-2 at once"
        " (tests/server_plan.py)",
    )
    parser.addoption(
        "--fuzz-full",
        action="store_true",
        help="fuzz with the whole corpus (35,925 bodies on the shared server; .ci/run does); by default a 25th"
        " of it, drawn from the same seeded generator",
    )


@pytest.fixture(scope="session")
def fuzz_share(request) -> float:
    """The part of each fuzz corpus a run sends."""
    return 1.0 if request.config.getoption("--fuzz-full") else 0.04


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    model = build_demo_model(tmp_path_factory.mktemp("demo-model"))
    PLAN.demo_model, PLAN.tmp_path_factory = model, tmp_path_factory  # for launching servers ahead
    return model


@pytest.fixture(scope="session")
def server(one_front_server):
    return one_front_server


@pytest.fixture(scope="session")
def one_front_server(request, demo_model, tmp_path_factory):
    """One skyinfer server with two real vLLM engines, shared by the session.

    When the session needs the keyed server too, it is launched at the same
    time: an engine starts one process after another, so a third engine
    starting beside two costs little more than the two.
    """
    items = request.session.items
    if any("keyed_server" in item.fixturenames for item in items):
        request.getfixturevalue("_keyed_process")
    if any(f"[{FRONT_WORKERS}" in item.name for item in items):
        request.getfixturevalue("_workers_process")
        if any("keyed_server" in item.fixturenames and f"[{FRONT_WORKERS}" in item.name for item in items):
            request.getfixturevalue("_keyed_workers_process")
    srv = two_float32_engines(demo_model, tmp_path_factory.mktemp("logs") / "server.log")
    with running(session_server("one_front_server", srv)):
        yield srv


@pytest.fixture(scope="session")
def _workers_process(demo_model, tmp_path_factory):
    """The shared server's twin behind two front workers: what the modules that run both ways use
    the second time."""
    srv = two_float32_engines(demo_model, tmp_path_factory.mktemp("workers") / "server.log", *WORKERS_ARGS)
    yield from launched(session_server("_workers_process", srv))


@pytest.fixture(scope="module")
def restores_checkpoint(server):
    """For modules that push weights into the shared server: afterwards it serves the
    checkpoint again, outside any transfer group, whatever the module's tests did."""
    yield
    restore_checkpoint(server)


@pytest.fixture(scope="session")
def _keyed_process(demo_model, tmp_path_factory):
    srv = keyed_one_engine(demo_model, tmp_path_factory.mktemp("keyed") / "server.log")
    yield from launched(session_server("_keyed_process", srv))


@pytest.fixture(scope="session")
def keyed_server(_keyed_process):
    """One engine behind API and admin keys, shared by the security and load tests."""
    _keyed_process.wait_ready()
    return _keyed_process


@pytest.fixture(scope="session")
def _keyed_workers_process(demo_model, tmp_path_factory):
    """The keyed server behind two front workers (the load tests' second way)."""
    srv = keyed_one_engine(demo_model, tmp_path_factory.mktemp("keyed-workers") / "server.log", *WORKERS_ARGS)
    yield from launched(session_server("_keyed_workers_process", srv))


@pytest.fixture(scope="session")
def model_name(demo_model) -> str:
    """What every test server serves the demo model as (its path)."""
    return str(demo_model)


@pytest.fixture
def group_init():
    """A gloo group's init_info whose trainer listens (the front asks engines to join only then):
    a socket nobody accepts on, as a trainer's store before its group forms."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        yield {"master_address": "127.0.0.1", "master_port": listening.getsockname()[1], "world_size": 3}
