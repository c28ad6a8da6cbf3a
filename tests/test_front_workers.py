"""Front workers (``--front-workers 2``) as processes: what each process's death costs, and what the
control process keeps exact for them. Over fake engines (tools/fake_engine.py, started as real
processes by the real service), so that kills and restarts take a second; the data-plane, session,
pause, load and retry modules run against real engines behind front workers as well.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import psutil
import pytest

from support import ChildProcess, free_port, scrape, sse_lines, total

BENCH_FRONT = str(Path(__file__).resolve().parent.parent / "tools" / "bench_front.py")
MODEL = "bench-front-model"  # what bench_front's fake engines serve


class FakeFleet(ChildProcess):
    """``skyinfer serve`` over two fake engines, behind two front workers."""

    def __init__(self, log_path: Path, tokens_per_s: float = 0):
        port = free_port()
        argv = [sys.executable, BENCH_FRONT, "front", "--port", str(port), "--engines", "2", "--front-workers", "2"]
        super().__init__(argv, log_path, port, env={"FAKE_ENGINE_SCRIPT": json.dumps({"tokens_per_s": tokens_per_s})})

    def workers(self) -> list[psutil.Process]:
        return [c for c in psutil.Process(self.proc.pid).children() if "skyinfer.front_workers.worker" in c.cmdline()]

    def engines(self) -> list[dict]:
        return httpx.get(f"{self.url}/engines", timeout=10).json()["engines"]


@pytest.fixture
def fleet(tmp_path):
    # Streams of 100 tokens take 2 s: long enough to kill a worker under them.
    srv = FakeFleet(tmp_path / "server.log", tokens_per_s=50)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _completion(i: int) -> dict:
    return {"model": MODEL, "prompt": f"request {i}", "max_tokens": 4}


async def test_both_workers_answer_and_metrics_count_every_request(fleet):
    """Requests on new connections are spread over both workers (each spends CPU on them), and
    ``/metrics`` counts every one of them, summed over the workers."""
    workers = fleet.workers()
    assert len(workers) == 2
    before = [_cpu_s(w) for w in workers]
    # Enough that each worker's share is several clock ticks of CPU (200 once left one at 0.02 s).
    n = 600
    # A connection per request (the kernel hands each to one of the workers), 20 at a time: each
    # takes 80 ms (4 tokens at the fleet's 50 tokens/s).
    limits = httpx.Limits(max_connections=20, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=fleet.url, timeout=30, limits=limits) as http:
        answers = await asyncio.gather(*(http.post("/v1/completions", json=_completion(i)) for i in range(n)))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
    spent = [_cpu_s(w) - b for w, b in zip(workers, before)]
    assert all(s > 0.02 for s in spent), spent
    families = scrape(fleet)
    answered = sum(
        total(families, "skyinfer_requests", "skyinfer_requests_total", route="/v1/completions", engine=e, status="200")
        for e in ("0", "1")
    )
    assert answered == n
    latency = total(
        families,
        "skyinfer_request_duration_seconds",
        "skyinfer_request_duration_seconds_count",
        route="/v1/completions",
    )
    assert latency == n


async def _stream(http: httpx.AsyncClient, i: int, max_tokens: int = 100) -> tuple[str, int]:
    """A chat stream (100 tokens: 2 s) on a connection of its own: how it ended, and its token events."""
    messages = [{"role": "user", "content": f"stream {i}"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True}
    events = 0
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in sse_lines(r):
                events += line.startswith('data: {"id"')
                if line == "data: [DONE]":
                    return "done", events
    except httpx.TransportError:
        return "cut", events
    return "ended without [DONE]", events


def _client_ports(worker: psutil.Process, port: int) -> set[int]:
    """The callers' ports of the connections a worker holds on the service's port."""
    return {c.raddr.port for c in worker.net_connections(kind="tcp") if c.laddr.port == port and c.raddr}


async def test_a_killed_worker_costs_only_its_own_connections_and_is_replaced(fleet):
    """SIGKILL of a worker holding streams: exactly its streams are cut, the other worker's finish,
    the engine connections it held go back (nothing left in flight), a new worker takes its place
    within seconds, and every request after the kill is answered."""
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=fleet.url, timeout=60, limits=limits) as http:
        streams = [asyncio.create_task(_stream(http, i)) for i in range(12)]
        await asyncio.sleep(1.0)  # every stream has begun
        workers = fleet.workers()
        held = {w.pid: _client_ports(w, fleet.port) for w in workers}
        victim = max(workers, key=lambda w: len(held[w.pid]))
        assert sum(len(ports) for ports in held.values()) == 12 and held[victim.pid], held
        assert sum(e["in_flight"] for e in fleet.engines()) == 12
        victim.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        ended = await asyncio.wait_for(asyncio.gather(*streams), timeout=30)
        cut = [e for e in ended if e[0] == "cut"]
        assert len(cut) == len(held[victim.pid]), ended
        assert all(e == ("done", 100) for e in ended if e[0] != "cut"), ended
        # Requests keep being answered, by the worker left and then by the new one too.
        after = await asyncio.gather(*(http.post("/v1/completions", json=_completion(i)) for i in range(20)))
        assert all(r.status_code == 200 for r in after), [r.text for r in after if r.status_code != 200]
    deadline = time.monotonic() + 15
    while not (len(now := fleet.workers()) == 2 and victim.pid not in {w.pid for w in now}):
        assert time.monotonic() < deadline, now
        await asyncio.sleep(0.2)
    assert sum(e["in_flight"] for e in fleet.engines()) == 0
    print(f"\nFAULT front worker SIGKILL: replaced {time.monotonic() - killed_at:.1f}s after")


async def test_requests_are_held_through_workers_while_no_engine_serves(fleet):
    """Both engines killed: requests sent through the workers meanwhile wait in the control
    process's hold, and are answered once the engines are back."""
    pids = [e["pid"] for e in fleet.engines()]
    for pid in pids:
        psutil.Process(pid).send_signal(signal.SIGKILL)
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=fleet.url, timeout=60, limits=limits) as http:
        deadline = time.monotonic() + 10
        while any(e["state"] == "ready" for e in fleet.engines()):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        answers = await asyncio.gather(*(http.post("/v1/completions", json=_completion(i)) for i in range(16)))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
    assert {e["pid"] for e in fleet.engines()}.isdisjoint(pids)


async def test_a_killed_control_process_takes_its_workers_and_engines_with_it(fleet):
    """SIGKILL of the control process: its workers see their channel close and exit, the engines
    their lifeline, and the port is free again."""
    tree = psutil.Process(fleet.proc.pid).children(recursive=True)
    assert len([p for p in tree if p in fleet.workers()]) == 2
    fleet.proc.kill()
    killed_at = time.monotonic()
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]
    print(f"\nFAULT control process SIGKILL: every worker and engine gone {time.monotonic() - killed_at:.1f}s after")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{fleet.url}/health", timeout=5)


async def test_sigterm_lets_the_workers_finish_their_streams_then_stops_everything(fleet):
    """SIGTERM of the control process with streams in flight on both workers: the workers stop
    accepting, every stream finishes in full, and every process exits (the front with 0)."""
    tree = psutil.Process(fleet.proc.pid).children(recursive=True)
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=fleet.url, timeout=60, limits=limits) as http:
        streams = [asyncio.create_task(_stream(http, i)) for i in range(8)]
        await asyncio.sleep(0.5)
        assert sum(e["in_flight"] for e in fleet.engines()) == 8
        fleet.proc.send_signal(signal.SIGTERM)
        ended = await asyncio.wait_for(asyncio.gather(*streams), timeout=30)
    assert ended == [("done", 100)] * 8
    assert await asyncio.to_thread(fleet.proc.wait, 30) == 0
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


async def _new_connection(port: int) -> str:
    """What a new connection to the port gets: "refused", or the status line of its answer."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return "refused"
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        return (await reader.readline()).decode().strip()
    finally:
        writer.close()


async def test_sigterm_refuses_new_connections_at_once_while_the_workers_drain(fleet):
    """Issue 43: once SIGTERM begins the drain, no process holds the port's socket open, so a new
    connection is refused at once instead of waiting in a backlog no one accepts from (and being
    reset when the drain ends); the streams in flight still finish in full."""
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=fleet.url, timeout=60, limits=limits) as http:
        # 250 tokens at 50 tokens/s: the drain takes 5 s.
        streams = [asyncio.create_task(_stream(http, i, max_tokens=250)) for i in range(4)]
        deadline = time.monotonic() + 10
        while sum(e["in_flight"] for e in fleet.engines()) != 4:
            assert time.monotonic() < deadline, fleet.engines()
            await asyncio.sleep(0.05)
        fleet.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)  # the workers have had their SIGTERM and stopped accepting
        tried_at = time.monotonic()
        try:
            got = await asyncio.wait_for(_new_connection(fleet.port), timeout=2)
        except asyncio.TimeoutError:
            got = "no answer in 2 s"
        took = time.monotonic() - tried_at
        assert not any(s.done() for s in streams), "the drain ended before the new connection was tried"
        assert got == "refused" or got.startswith("HTTP/1.1 "), got
        ended = await asyncio.wait_for(asyncio.gather(*streams), timeout=30)
    assert ended == [("done", 250)] * 4
    assert await asyncio.to_thread(fleet.proc.wait, 30) == 0
    print(f"\nSHUTDOWN new connection during the drain: {got!r} in {took * 1000:.0f} ms")


async def test_what_a_worker_does_not_answer_is_passed_on_to_the_control_process(fleet):
    """Admin calls, a session's end, engine views and unknown paths reach the control process as
    they came (an ``Expect: 100-continue`` answered by the worker, not passed on); their answers
    come back unchanged."""
    async with aiohttp.ClientSession(fleet.url) as http:
        async with http.post("/pause", params={"mode": "keep"}, json={}, expect100=True) as r:
            assert r.status == 200, await r.text()
            assert [e["result"]["status"] for e in (await r.json())["engines"]] == ["paused", "paused"]
        assert [e["state"] for e in fleet.engines()] == ["paused", "paused"]
        async with http.post("/resume") as r:
            assert r.status == 200
        async with http.post("/v1/completions", json=_completion(0), headers={"X-Session-ID": "s-1"}) as r:
            engine = int(r.headers["X-Skyinfer-Engine"])
        async with http.post("/finish_session", json={"session_id": "s-1"}) as r:
            assert (await r.json()) == {"status": "finished", "session_id": "s-1", "engine": engine}
        async with http.post("/pause", params={"mode": "sideways"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "mode"
        async with http.get("/no/such/route") as r:
            assert r.status == 404 and (await r.json())["error"]["type"] == "NotFoundError"
    assert [e["state"] for e in fleet.engines()] == ["ready", "ready"]
