"""Faults that need no human: an engine's output of any length, an engine that cannot come back,
no engine serving for a while. One two-engine server (float32, one restart in a row allowed,
requests held up to 180 s, vLLM's request log on at DEBUG, so that prompts are logged on one line),
real engine processes killed, trainers in processes of their own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pushes import assert_engines_match, modified_weights, run_trainer, save
from support import TRAINER, ServerProcess, engine_of, running, scrape, total

HOLD_S = 180
# The states of an engine whose process is up.
UP = {"ready", "stale", "paused", "sleeping", "receiving"}


@pytest.fixture(scope="module")
def recovery(demo_model, tmp_path_factory):
    srv = ServerProcess(
        demo_model,
        engines=2,
        log_path=tmp_path_factory.mktemp("recovery") / "server.log",
        extra_args=(
            "--dtype",
            "float32",
            "--max-restarts",
            "1",
            "--hold-requests",
            str(HOLD_S),
            "--health-interval",
            "1",
            "--health-timeout",
            "4",
            "--enable-log-requests",
        ),
        # vLLM logs a request's prompt and token ids (one line each request) at DEBUG.
        env={"VLLM_LOGGING_LEVEL": "DEBUG"},
    )
    with running(srv):
        yield srv


def pids(server) -> list[tuple[int, int]]:
    return [(e["pid"], e["restarts"]) for e in server.engines()]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return value


def test_engine_output_of_any_length_never_stops_an_engine(recovery, demo_model, tmp_path):
    """Lines of 1 MiB written to each engine's output while it serves, and prompts of about 3,000
    tokens logged whole on every hot route: both engines keep serving in their own processes, every
    line reaches the server's log under its engine's prefix, and a push afterwards succeeds."""
    before = pids(recovery)
    marker = f"wide-{time.monotonic_ns()}-"
    line = (marker + "x" * (1 << 20) + "\n").encode()
    for pid, _ in before:
        # The engine's own stderr: what vLLM, a traceback or a print() writes to.
        with open(f"/proc/{pid}/fd/2", "wb", buffering=0) as out:
            for _ in range(4):
                out.write(line)
    words = " ".join(f"w{i % 97}" for i in range(1200))
    tokens = httpx.post(f"{recovery.url}/tokenize", json={"model": recovery.model, "prompt": words}, timeout=60).json()[
        "tokens"
    ]
    assert 2500 < len(tokens) < 3800, len(tokens)
    # Ids in an order no text tokenizes to, so that the log line found is the token route's.
    token_ids = [(i * 37) % 2000 + 3 for i in range(len(tokens))]
    bodies = {
        "/v1/completions": {"model": recovery.model, "prompt": f"completion-{marker} {words}", "max_tokens": 4},
        "/v1/chat/completions": {
            "model": recovery.model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": f"chat-{marker} {words}"}],
        },
        "/inference/v1/generate": {"token_ids": token_ids, "sampling_params": {"max_tokens": 4}},
    }
    for path, body in bodies.items():
        for engine in (0, 1):
            r = httpx.post(
                f"{recovery.url}{path}", json=body, headers={"X-Session-ID": f"long-{engine}-{path}"}, timeout=120
            )
            assert r.status_code == 200, r.text
    assert pids(recovery) == before
    assert [e["state"] for e in recovery.engines()] == ["ready", "ready"]

    def logged() -> bool:
        log = recovery.log_path.read_bytes()
        # Each wide line whole (another process's write may land inside one: a pipe keeps only
        # writes of up to 4 KiB whole), and each prompt; the token route's as its ids.
        return (
            all(log.count(f"[engine {e}] {marker}".encode()) == 4 for e in (0, 1))
            and log.count(b"x" * 4096) >= 8 * 256 - 16
            and all(f"{route}-{marker}".encode() in log for route in ("completion", "chat"))
            and str(token_ids[:40])[1:-1].encode() in log
        )

    wait_for(logged, 30, "the wide lines or the logged prompts are missing from the server's log")
    weights = modified_weights(demo_model, seed=61)
    pushed = run_trainer(recovery, save(weights, tmp_path / "w.safetensors"), "after-wide-lines")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert_engines_match(recovery, recovery.model, demo_model, weights, "after-wide-lines")
    assert pids(recovery) == before


async def test_an_engine_that_cannot_come_back_is_retired_and_rejoins_on_request(recovery, demo_model, tmp_path):
    """Engine 1 is killed each time it comes up: after its one allowed restart it is retired. The
    other serves on; /ready is 200; a push over the remaining engine succeeds. POST
    /engines/1/restart brings it back, stale until the next push: the first trainer, still up,
    finds its group gone, forms it again by itself, and its push covers both engines. Then
    /reload_weights brings the fleet to the checkpoint on disk, and both engine processes are
    killed at rest: 16 requests sent while both restart are held and answered 200 once one serves.
    Prints how long the fleet took to serve again and to be ready for a push."""
    weights_1 = modified_weights(demo_model, seed=62)
    trainer = subprocess.Popen(
        [
            sys.executable,
            str(TRAINER),
            recovery.url,
            str(save(weights_1, tmp_path / "w1.safetensors")),
            "before-retire",
            "--more",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert (await asyncio.to_thread(trainer.stdout.readline)).split() == ["pushed", "before-retire"]
        async with httpx.AsyncClient(base_url=recovery.url, timeout=HOLD_S + 60) as http:
            await retire_engine_1(http)
            ready = await http.get("/ready")
            assert ready.status_code == 200 and ready.json()["retired"] == [1], ready.text
            assert (await http.get("/get_world_size")).json()["world_size"] == 1
            families = scrape(recovery)
            assert total(families, "skyinfer_engine_state", "skyinfer_engine_state", engine="1", state="retired") == 1
            status = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "skyinfer", "status", recovery.url],
                capture_output=True,
                text=True,
            )
            assert [row.split()[1] for row in status.stdout.splitlines()[1:3]] == ["ready", "retired"], status.stdout
            body = {"model": recovery.model, "prompt": "p", "max_tokens": 4, "ignore_eos": True}
            served = {engine_of(await http.post("/v1/completions", json={**body, "prompt": f"p{i}"})) for i in range(8)}
            assert served == {0}
            # Fleet calls go to the fleet (engine 0) and are whole: the retired engine fails none.
            r = await http.post("/pause", params={"mode": "keep"})
            assert r.status_code == 200 and [e["engine"] for e in r.json()["engines"]] == [0], r.text
            assert (await http.post("/resume")).status_code == 200

            # A full push over the remaining engine: a second trainer, sized by /get_world_size.
            weights_2 = modified_weights(demo_model, seed=63)
            pushed = await asyncio.to_thread(
                run_trainer, recovery, save(weights_2, tmp_path / "w2.safetensors"), "one-engine"
            )
            assert pushed.returncode == 0, pushed.stdout + pushed.stderr
            assert (await http.get("/weight_info")).json()["weight_version"] == "one-engine"

            # Back on request: stale (it loaded the checkpoint; the fleet serves one-engine).
            r = await http.post("/engines/1/restart")
            assert r.status_code == 200, r.text
            back = r.json()["engine"]
            assert back["state"] == "stale" and back["stale_reason"].startswith("it restarted from the checkpoint"), (
                back
            )
            assert (await http.get("/get_world_size")).json()["world_size"] == 2

        # The first trainer, still up: its group is gone (the second trainer's replaced it, and
        # the fleet grew); it forms it again by itself and its push covers both engines.
        weights_3 = modified_weights(demo_model, seed=64)
        trainer.stdin.write(f"{save(weights_3, tmp_path / 'w3.safetensors')} both-again\n")
        trainer.stdin.flush()
        assert (await asyncio.to_thread(trainer.stdout.readline)).split() == ["pushed", "both-again"]
    finally:
        trainer.kill()
        _, err = trainer.communicate()
    assert "setting it up again" in err, err[-2000:]
    assert [e["state"] for e in recovery.engines()] == ["ready", "ready"]
    await asyncio.to_thread(assert_engines_match, recovery, recovery.model, demo_model, weights_3, "both-again")

    async with httpx.AsyncClient(base_url=recovery.url, timeout=HOLD_S + 60) as http:
        # The trainers are done: the checkpoint on disk, in place, so that a restarted engine serves at once.
        r = await http.post("/reload_weights")
        assert r.status_code == 200 and [e["engine"] for e in r.json()["engines"]] == [0, 1], r.text
        engines = recovery.engines()
        for e in engines:
            os.killpg(e["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        while any(e["state"] == "ready" for e in (await http.get("/engines")).json()["engines"]):
            await asyncio.sleep(0.05)
        held = [
            asyncio.create_task(http.post("/v1/completions", json={**body, "prompt": f"held {i}"})) for i in range(16)
        ]
        await asyncio.wait(held, return_when=asyncio.FIRST_COMPLETED)
        served_at = time.monotonic()
        for r in await asyncio.gather(*held):
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        back = await wait_up(http)
        ready_at = time.monotonic()
    assert [e["pid"] for e in back] != [e["pid"] for e in engines] and [e["state"] for e in back] == ["ready", "ready"]
    assert served_at - killed_at > 5, "the requests were not held: the engines were never all down"
    print(
        f"\nFAULT both engine processes SIGKILL at rest: serving {served_at - killed_at:.1f}s, "
        f"ready for a push {ready_at - killed_at:.1f}s"
    )


async def retire_engine_1(http: httpx.AsyncClient) -> None:
    """Kill engine 1 each time it comes up (it comes back stale: the fleet's weights moved on) until it is retired."""
    killed: list[int] = []
    deadline = time.monotonic() + 300
    while (engine := (await http.get("/engines")).json()["engines"][1])["state"] != "retired":
        if engine["state"] in UP and engine["pid"] not in killed:
            os.killpg(engine["pid"], signal.SIGKILL)
            killed.append(engine["pid"])
        assert len(killed) <= 2 and time.monotonic() < deadline, f"{engine['state']} after {len(killed)} kills"
        await asyncio.sleep(0.2)
    # The first death is restarted; the second, with one restart in a row allowed, retires it.
    assert len(killed) == 2


async def wait_up(http: httpx.AsyncClient) -> list[dict]:
    deadline = time.monotonic() + 300
    while True:
        engines = (await http.get("/engines")).json()["engines"]
        if all(e["state"] in UP for e in engines):
            return engines
        assert time.monotonic() < deadline, engines
        await asyncio.sleep(0.2)
