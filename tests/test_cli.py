"""The command line as a user runs it: ``skyinfer status`` exit codes (table or ``--json``, the
same), and ``skyinfer serve`` exiting when an engine cannot start."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import httpx
import psutil
from fakes import fake_fleet

from support import ServerProcess, free_port, restore_fleet


def status(url: str, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "skyinfer", "status", url, *options], capture_output=True, text=True, timeout=120
    )


async def status_of(url: str, *options: str) -> tuple[int, str]:
    """``skyinfer status`` of a server in this event loop (a fake fleet's): its exit code and output."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "skyinfer", "status", url, *options, stdout=asyncio.subprocess.PIPE
    )
    stdout, _ = await asyncio.wait_for(process.communicate(), 120)
    return process.returncode, stdout.decode()


def test_status_json_of_a_server_that_cannot_be_reached_is_an_error_and_exit_1():
    url = f"http://127.0.0.1:{free_port()}"
    unreachable = status(url, "--json")
    # Not 0 with nothing to show: 1, as the table says it, and JSON still on stdout for a script.
    assert unreachable.returncode == 1, unreachable
    answer = json.loads(unreachable.stdout)
    assert answer["url"] == url and "cannot connect" in answer["error"], answer
    assert "skyinfer status" in unreachable.stderr


async def test_status_json_exits_as_the_table_does(aiohttp_client, demo_model, tmp_path):
    _, client = await fake_fleet(aiohttp_client, demo_model, tmp_path)
    url = str(client.make_url("")).rstrip("/")
    for options in ((), ("--json",)):
        code, out = await status_of(url, *options)
        assert code == 0, out
    assert [e["state"] for e in json.loads(out)["engines"]] == ["ready", "ready"]
    assert (await client.post("/pause", params={"mode": "keep"})).status == 200
    # Up, but not every engine ready: 3 either way.
    for options in ((), ("--json",)):
        code, out = await status_of(url, *options)
        assert code == 3 and "paused" in out, out
    assert {e["state"] for e in json.loads(out)["engines"]} == {"paused"}


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


def test_vllms_kv_cache_option_sizes_every_engines_kv_cache(server):
    """The suite's servers are given vLLM's own ``--kv-cache-memory-bytes`` (128 MiB, tests/support.py):
    it, not ``--cpu-kvcache-gib``'s 1 GiB (which vLLM's CPU platform would let override it), sizes
    each engine's KV cache, as vLLM says at start-up: 128K tokens of the float32 demo model (2
    layers, one KV head of 64: 1 KiB a token)."""
    assert server.engines()[0]["state"] in {"ready", "stale", "paused"}
    sizes = re.findall(r"KV cache size: ([\d,]+) tokens", server.log_path.read_text(errors="replace"))
    assert len(sizes) >= 2 and set(sizes) == {"131,072"}, sizes


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
