"""Shared fixtures: the demo model and a real skyinfer server with two vLLM engines.

Engines take 30-45 s to start, so one two-engine server serves the whole
session, and a one-engine server with keys serves the security and load tests;
tests that must stop or break a server start their own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import keyed_one_engine, running, two_float32_engines

from skyinfer.demo_model import build_demo_model


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture(scope="session")
def server(demo_model, tmp_path_factory):
    """One skyinfer server with two real vLLM engines, shared by the session."""
    with running(two_float32_engines(demo_model, tmp_path_factory.mktemp("logs") / "server.log")) as srv:
        yield srv


@pytest.fixture(scope="session")
def push_server(demo_model, tmp_path_factory):
    """Two engines like the shared server's, for the tests and examples that push weights:
    pushed weights would change the answers other tests compare against, and a trainer
    that dies leaves engines in its transfer group."""
    with running(two_float32_engines(demo_model, tmp_path_factory.mktemp("push") / "server.log")) as srv:
        yield srv


@pytest.fixture(scope="session")
def keyed_server(demo_model, tmp_path_factory):
    """One engine behind API and admin keys, shared by the security and load tests."""
    with running(keyed_one_engine(demo_model, tmp_path_factory.mktemp("keyed") / "server.log")) as srv:
        yield srv


@pytest.fixture(scope="session")
def model_name(demo_model) -> str:
    """What every test server serves the demo model as (its path)."""
    return str(demo_model)
