"""An admin call that fails on one engine is reported per engine, never hidden behind a 200."""

from __future__ import annotations

import signal
import time

import httpx
import psutil

from support import ServerProcess


def test_control_call_with_one_engine_killed(demo_model, tmp_path):
    srv = ServerProcess(demo_model, engines=2, log_path=tmp_path / "server.log")
    try:
        srv.wait_ready()
        engine_pid = srv.engines()[1]["pid"]
        # Kill only vLLM's EngineCore under engine 1: its engine process must
        # notice, exit, and so be marked dead by the front.
        (core,) = [p for p in psutil.Process(engine_pid).children() if "EngineCore" in " ".join(p.cmdline()) + p.name()]
        core.send_signal(signal.SIGKILL)
        psutil.wait_procs([psutil.Process(engine_pid)], timeout=15)
        deadline = time.monotonic() + 10
        # Dead, and soon restarting: either way out of rotation.
        while srv.engines()[1]["state"] not in ("dead", "restarting"):
            assert time.monotonic() < deadline, "the front did not notice the engine died"
            time.sleep(0.1)
        # The other engine serves on.
        for i in range(4):
            r = httpx.post(f"{srv.url}/v1/completions", json={"model": srv.model, "prompt": "x", "max_tokens": 2},
                           headers={"X-Session-ID": f"after-kill-{i}"}, timeout=60)  # fmt: skip
            assert r.status_code == 200 and r.headers["X-Skyinfer-Engine"] == "0"

        r = httpx.post(f"{srv.url}/pause", params={"mode": "keep"}, timeout=60)
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["error"]["code"] == 503 and "engine 1" in body["error"]["message"]
        assert [(e["engine"], e["status"]) for e in body["engines"]] == [(0, 200), (1, 503)]

        # The live engine did pause, and resumes; the dead one is still reported.
        assert srv.engines()[0]["state"] == "paused"
        r = httpx.post(f"{srv.url}/resume", timeout=60)
        assert r.status_code == 503
        assert [(e["engine"], e["status"]) for e in r.json()["engines"]] == [(0, 200), (1, 503)]
        assert srv.engines()[0]["state"] == "ready"
    finally:
        srv.stop()
