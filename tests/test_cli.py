"""The command line as a user runs it: ``skyinfer status`` exit codes, and ``skyinfer serve``
exiting when an engine cannot start."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import psutil

from support import ServerProcess, free_port, restore_fleet


def status(url: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "skyinfer", "status", url], capture_output=True, text=True, timeout=120
    )


async def test_status_exit_codes(server):
    ready = status(server.url)
    assert ready.returncode == 0, ready.stderr
    rows = ready.stdout.splitlines()
    assert rows[0].split()[:2] == ["ENGINE", "STATE"] and [r.split()[1] for r in rows[1:3]] == ["ready", "ready"]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
        try:
            paused = status(server.url)
        finally:
            await restore_fleet(http)
    # Up, but not every engine ready: 3.
    assert paused.returncode == 3 and "paused" in paused.stdout, paused
    unreachable = status(f"http://127.0.0.1:{free_port()}")
    assert unreachable.returncode == 1 and "skyinfer status" in unreachable.stderr


def test_serve_exits_when_an_engine_cannot_start(demo_model, tmp_path):
    # The demo model's context is 4096 tokens: vLLM refuses the engine arguments while starting.
    srv = ServerProcess(
        demo_model, engines=1, log_path=tmp_path / "server.log", extra_args=("--max-model-len", "65536")
    )
    try:
        code = srv.proc.wait(180)
        log = srv.log_tail(400)
        assert code == 1, log
        # The front says which engine failed and quotes the end of its output, vLLM's reason included.
        assert "engine 0 exited with code" in log and "65536" in log, log
        (engine_pid,) = re.findall(r"engine 0: started pid (\d+)", log)
        assert not psutil.pid_exists(int(engine_pid))
    finally:
        srv.stop()
