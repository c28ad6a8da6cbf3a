"""Shared fixtures: the demo model and a real skyinfer server with two vLLM engines.

Engines take 20-30 s to start, so one two-engine server serves the whole
session; tests that must stop or break a server start their own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import running, two_float32_engines

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
def model_name(demo_model) -> str:
    """What every test server serves the demo model as (its path)."""
    return str(demo_model)
