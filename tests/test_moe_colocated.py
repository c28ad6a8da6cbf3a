"""Colocated pushes into mixture-of-experts engines (shared memory, as a trainer on the same host
pushes between its own steps): each architecture of test_moe.py, one engine each, put to sleep at
level 1 and 2 around the push as SkyRL's colocated trainer does."""

from __future__ import annotations

from pathlib import Path

import pytest

from skyinfer.demo_model import MOE_CONFIGS, build_demo_moe_model

from moe_pushes import MoeFleet
from support import ServerProcess, module_servers

ARCHITECTURES = sorted(MOE_CONFIGS)


def _launch(demo_model: Path, logs: Path) -> dict[str, ServerProcess]:
    return {
        architecture: ServerProcess(
            build_demo_moe_model(logs / architecture, architecture),
            engines=1,
            log_path=logs / f"{architecture}.log",
            extra_args=("--colocate", "--dtype", "float32", "--hold-requests", "1", "--warm-spares", "0"),
        )
        for architecture in ARCHITECTURES
    }


colocated_moe = module_servers(__name__, _launch)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def moe(request, colocated_moe) -> MoeFleet:
    server = colocated_moe[request.param]
    return MoeFleet(server, Path(server.model))


def test_colocated_pushes_land_exactly_after_either_sleep(moe, tmp_path):
    """The weights served pushed back after a level-1 sleep change nothing; new weights land within
    0.05 of transformers; after a level-2 sleep (the weights discarded), the first weights pushed
    back serve exactly what the fresh engine served."""
    moe.push(moe.checkpoint, "same", tmp_path, "--transport", "shm", "--colocated-step", "1")
    moe.assert_serves_fresh()
    new = moe.modified(seed=6)
    moe.push(new, "new", tmp_path, "--transport", "shm", "--colocated-step", "1")
    moe.assert_matches_transformers(new, tmp_path)
    moe.push(moe.checkpoint, "back", tmp_path, "--transport", "shm", "--colocated-step", "2")
    moe.assert_serves_fresh()
