"""SIGTERM: stop accepting, let in-flight requests finish within the grace, leave no process, and
nothing of vLLM's in /dev/shm."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
from pathlib import Path

import httpx
import psutil

from forked_python import ForkedPopen
from support import (
    NO_SPARES,
    TRAINER,
    WORKER_PROCESSES,
    ServerProcess,
    admit_while_paused,
    left_in_shm,
    module_servers,
    process_tree,
    shm_segments,
)

GRACE_S = 8
# Each server's own engine template: what a SIGTERM must take with it is the front's process tree.
OWN_TEMPLATE = ("--engine-templates", "auto")


def _launch(demo_model: Path, logs: Path) -> dict[str, ServerProcess]:
    """One-engine servers for the SIGTERM tests, started together, each on a core of its own (an
    engine given both cores runs two OpenMP threads, and two such engines on two cores crawl);
    each test stops its own; no test restarts an engine, so no spares. The SIGKILL test is in
    test_supervision (it kills that module's server)."""
    return {
        "finish": ServerProcess(
            demo_model,
            engines=1,
            log_path=logs / "finish.log",
            extra_args=("--shutdown-grace", "60", *NO_SPARES, *OWN_TEMPLATE),
            cpus={0},
            env=WORKER_PROCESSES,
        ),
        "grace": ServerProcess(
            demo_model,
            engines=1,
            log_path=logs / "grace.log",
            extra_args=("--shutdown-grace", str(GRACE_S), *NO_SPARES, *OWN_TEMPLATE),
            cpus={1},
            env=WORKER_PROCESSES,
        ),
    }


stoppable = module_servers(__name__, _launch)


def assert_nothing_left(tree: list[psutil.Process], segments: set[str]) -> None:
    """No process of the server's lives on, and none of the segments they mapped is left in /dev/shm
    (vLLM's shutdown force-kills its processes before they unlink theirs)."""
    _, alive = psutil.wait_procs(tree, timeout=5)
    assert not alive, f"left behind: {[(p.pid, p.name()) for p in alive]}"
    assert segments, "vLLM's processes mapped no segment in /dev/shm: nothing to check"
    assert not left_in_shm(segments), f"left in /dev/shm: {left_in_shm(segments)} of {sorted(segments)}"


async def test_sigterm_lets_in_flight_requests_finish(stoppable):
    srv = stoppable["finish"]
    tree = process_tree(srv)
    segments = shm_segments(tree)
    body = {"model": srv.model, "prompt": "finish me", "max_tokens": 600, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
        tasks = await admit_while_paused(http, (http.post("/v1/completions", json=body) for _ in range(8)))
        assert (await http.post("/resume")).status_code == 200
        srv.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert not any(t.done() for t in tasks), "the requests finished before the signal landed"
        # No longer accepting: a new connection is refused while the old ones finish.
        try:
            async with httpx.AsyncClient(timeout=5) as fresh:
                refused = await fresh.get(f"{srv.url}/health")
            raise AssertionError(f"a new connection was served during shutdown: {refused.status_code}")
        except httpx.ConnectError:
            pass
        results = await asyncio.gather(*tasks)
    # Finished in full, the requests were not cut off by the 60 s grace; the engines then exit
    # within seconds (the wait is a deadline).
    for r in results:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 600
    assert await asyncio.to_thread(srv.proc.wait, 60) == 0, srv.log_tail()
    assert_nothing_left(tree, segments)


async def test_grace_period_bounds_the_shutdown(stoppable, demo_model):
    """Requests that cannot finish (held by a pause) are waited for through their share of the
    grace, then cut off (the server's log says so), and a push stuck mid-transfer (its trainer
    stopped sending) does not hold the shutdown up: the server exits within seconds of the grace,
    not at the push's 60 s timeout."""
    srv = stoppable["grace"]
    tree = process_tree(srv)
    segments = shm_segments(tree)
    trainer = ForkedPopen(
        [TRAINER, srv.url, str(demo_model / "model.safetensors"), "v-stuck", "--hang-after", "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            held = {"model": srv.model, "prompt": "held", "max_tokens": 16}
            tasks = await admit_while_paused(http, (http.post("/v1/completions", json=held) for _ in range(4)))
            assert await asyncio.to_thread(trainer.stdout.readline) == "hanging\n"
            assert (await http.get("/weight_info")).json()["update_phase"] == "receiving"
            srv.proc.send_signal(signal.SIGTERM)
            # A deadline, not a measure: the 8 s grace bounds the shutdown, and 30 s leaves room for
            # a busy machine; held up by the stuck push, it would last the push's 60 s timeout (the
            # trainer's) or more.
            code = await asyncio.to_thread(srv.proc.wait, 30)
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        trainer.kill()
    assert code == 0, srv.log_tail()
    # The requests had the in-flight share of the grace (all of it but the engines' quarter), and
    # were cut off only when it ran out: the server's drain says so.
    in_flight_s = GRACE_S - GRACE_S / 4
    log = srv.log_path.read_text(errors="replace")
    cut = re.findall(r"(\d+) request\(s\) still running after (\d+)s; cutting them off", log)
    assert [int(after) for _, after in cut] == [in_flight_s] and int(cut[0][0]) >= len(tasks), cut or srv.log_tail()
    assert all(isinstance(o, httpx.HTTPError) or o.status_code >= 500 for o in outcomes), outcomes
    assert_nothing_left(tree, segments)
