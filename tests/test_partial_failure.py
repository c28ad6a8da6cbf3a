"""An admin call that fails on one engine is reported per engine, never hidden behind a 200."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil

from support import ServerProcess


def test_control_call_with_one_engine_killed(demo_model, tmp_path):
    srv = ServerProcess(demo_model, engines=2, log_path=tmp_path / "server.log")
    try:
        srv.wait_ready()
        victim = srv.engines()[1]["pid"]
        # The engine and vLLM's processes beneath it share a process group.
        os.killpg(victim, signal.SIGKILL)
        psutil.wait_procs([psutil.Process(victim)], timeout=10)
        deadline = time.monotonic() + 10
        while srv.engines()[1]["state"] != "dead":
            assert time.monotonic() < deadline, "the front did not notice the engine died"
            time.sleep(0.1)

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
