"""Crashes under load: a killed engine fails only its own requests, fast, with 503, and comes back."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import psutil
import pytest

from support import ServerProcess, engine_of


@pytest.fixture(scope="module")
def crash_server(demo_model, tmp_path_factory):
    srv = ServerProcess(demo_model, engines=2, log_path=tmp_path_factory.mktemp("crash") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def vllm_process(engine_pid: int, role: str) -> psutil.Process:
    """vLLM's EngineCore or worker process under one engine."""
    (proc,) = [p for p in psutil.Process(engine_pid).children(recursive=True) if role in " ".join(p.cmdline())]
    return proc


async def wait_for_states(http, states: list[str], timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while (now := [e["state"] for e in (await http.get("/engines")).json()["engines"]]) != states:
        assert time.monotonic() < deadline, now
        await asyncio.sleep(0.5)


@pytest.mark.parametrize("role", ["EngineCore", "Worker"])
async def test_killed_engine_fails_fast_and_comes_back(crash_server, role):
    body = {"model": crash_server.model, "prompt": "under load", "max_tokens": 2000, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=crash_server.url, timeout=120) as http:
        await wait_for_states(http, ["ready", "ready"])
        victim_pid = (await http.get("/engines")).json()["engines"][1]["pid"]
        # 32 requests admitted while paused, so all are in flight when the kill lands.
        assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
        tasks = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(32)]
        deadline = time.monotonic() + 30
        while sum(e["unfinished_requests"] or 0 for e in (await http.get("/engines")).json()["engines"]) != 32:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        assert (await http.post("/resume")).status_code == 200
        vllm_process(victim_pid, role).send_signal(signal.SIGKILL)
        killed_at = time.monotonic()

        async def timed(task):
            r = await task
            return r, time.monotonic() - killed_at

        results = await asyncio.gather(*(timed(t) for t in tasks))
        by_engine = {0: [], 1: []}
        for r, after in results:
            by_engine[engine_of(r)].append((r, after))
        assert len(by_engine[0]) == len(by_engine[1]) == 16
        for r, _ in by_engine[0]:
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2000
        for r, after in by_engine[1]:
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "ServiceUnavailableError"
            assert after < 5, f"a request on the killed engine took {after:.1f}s to fail"

        # New requests go to the live engine meanwhile.
        for i in range(4):
            r = await http.post("/v1/completions", json={**body, "max_tokens": 4}, headers={"X-Session-ID": f"new-{i}"})
            assert r.status_code == 200 and engine_of(r) == 0
        # The killed engine is restarted and serves again.
        await wait_for_states(http, ["ready", "ready"])
        assert (await http.get("/engines")).json()["engines"][1]["pid"] != victim_pid
        served = set()
        for i in range(10):
            r = await http.post("/v1/completions", json={**body, "max_tokens": 4})
            assert r.status_code == 200
            served.add(engine_of(r))
        assert served == {0, 1}


async def test_restarted_engine_must_rejoin_before_a_push(crash_server, demo_model):
    from safetensors.torch import load_file

    from skyinfer.trainer import GlooTrainer, WeightSyncError

    tensors = list(load_file(str(demo_model / "model.safetensors")).items())
    trainer = GlooTrainer(crash_server.url, timeout_s=60)
    await asyncio.to_thread(trainer.init)
    async with httpx.AsyncClient(base_url=crash_server.url, timeout=120) as http:
        victim_pid = (await http.get("/engines")).json()["engines"][1]["pid"]
        vllm_process(victim_pid, "EngineCore").send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 240
        while True:
            engines = (await http.get("/engines")).json()["engines"]
            if engines[1]["pid"] != victim_pid and [e["state"] for e in engines] == ["ready", "ready"]:
                break
            assert time.monotonic() < deadline, engines
            await asyncio.sleep(0.5)
        groups = [e["in_transfer_group"] for e in (await http.get("/weight_info")).json()["engines"]]
        assert groups == [True, False]
        # The new process is not in the trainer's group: refused up front, nothing restarted.
        with pytest.raises(WeightSyncError) as refused:
            await asyncio.to_thread(trainer.push, tensors, "v-stale-group")
        assert refused.value.status == 409 and "init_weight_transfer" in refused.value.message
        assert [e["state"] for e in (await http.get("/engines")).json()["engines"]] == ["ready", "ready"]
        await asyncio.to_thread(trainer.init)
        await asyncio.to_thread(trainer.push, tensors, "v-rejoined")
        assert (await http.get("/weight_info")).json()["weight_version"] == "v-rejoined"
