"""Shared fixtures: the demo model and a real skyinfer server with two vLLM engines.

Engines take 20-30 s to start, so one two-engine server serves the whole
session; tests that must stop or break a server start their own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import ServerProcess, running

from skyinfer.demo_model import build_demo_model


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture(scope="session")
def server(demo_model, tmp_path_factory):
    """One skyinfer server with two real vLLM engines, shared by the session."""
    # float32: greedy tokens compared across batch shapes must not flip on bf16 rounding.
    srv = ServerProcess(
        demo_model, engines=2, log_path=tmp_path_factory.mktemp("logs") / "server.log", extra_args=("--dtype", "float32")
    )
    with running(srv):
        yield srv


@pytest.fixture(scope="session")
def model_name(server) -> str:
    return server.model
