"""Faults that need no human, on one two-engine server whose processes the tests kill: a request
whose engine dies is answered by another engine (once), the engine comes back; an EngineCore killed
mid-push aborts the update fleet-wide without waiting for the group's timeout; an engine's output of
any length never stops it; an engine that cannot come back is retired and rejoins on request; while
no engine serves, requests are held; a killed front takes every process it started with it.

The server: float32 (logprobs compared with transformers'), probes fast enough for a test, one restart
in a row allowed (a restart counts as one in a row until the engine stays up 5 s), requests held up to
180 s, vLLM's request log on at DEBUG (a request's prompt and token ids on one line each).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from skyinfer.engine_wire import STACKS_SIGNAL

from forked_python import ForkedPopen
from pushes import assert_engines_match, modified_weights, run_trainer, save, start_trainer
from support import (
    FRONT_WORKERS,
    FRONTS,
    ONE_FRONT,
    TRAINER,
    WORKER_PROCESSES,
    WORKERS_ARGS,
    ServerProcess,
    admit_while_paused,
    engine_of,
    engine_socket,
    engine_tree,
    left_in_shm,
    module_servers,
    process_tree,
    running,
    scrape,
    shm_segments,
    sse_lines,
    total,
    vllm_process,
)

HOLD_S = 180
# The states of an engine whose process is up.
UP = {"ready", "stale", "paused", "sleeping", "receiving"}


def crash_process(demo_model, log_path, *more_args: str, worker_processes: bool = True) -> ServerProcess:
    return ServerProcess(
        demo_model,
        engines=2,
        log_path=log_path,
        extra_args=(
            *more_args,
            # Its own engine template: the last test finds it among the front's processes.
            "--engine-templates",
            "auto",
            "--dtype",
            "float32",
            "--health-interval",
            "1",
            "--health-timeout",
            "4",
            "--max-restarts",
            "1",
            "--restart-window",
            "5",
            "--hold-requests",
            str(HOLD_S),
            "--enable-log-requests",
        ),
        # vLLM's worker processes, whose message queues in /dev/shm the tests check are not left behind.
        env={"VLLM_LOGGING_LEVEL": "DEBUG", **(WORKER_PROCESSES if worker_processes else {})},
    )


def _launch(demo_model: Path, logs: Path) -> dict[str, ServerProcess]:
    # Its twin behind front workers starts beside it (one engine process after another: two
    # servers starting together are ready in about the time of one); the first test stops it. The
    # twin runs no /dev/shm check: its engines run their worker inside the EngineCore, the default.
    return {
        ONE_FRONT: crash_process(demo_model, logs / "server.log"),
        FRONT_WORKERS: crash_process(demo_model, logs / "workers.log", *WORKERS_ARGS, worker_processes=False),
    }


crash_servers = module_servers(__name__, _launch)


@pytest.fixture(scope="module")
def crash_server(crash_servers) -> ServerProcess:
    return crash_servers[ONE_FRONT]


def pids(server) -> list[tuple[int, int]]:
    return [(e["pid"], e["restarts"]) for e in server.engines()]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return value


async def wait_for_states(http, states: list[str], timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while (now := [e["state"] for e in (await http.get("/engines")).json()["engines"]]) != states:
        assert time.monotonic() < deadline, now
        await asyncio.sleep(0.5)


async def _timed(task) -> tuple[httpx.Response, float]:
    r = await task
    return r, time.monotonic()


async def _stream_past_first_token(http: httpx.AsyncClient, body: dict) -> tuple[int, asyncio.Task]:
    """A chat stream that has sent the caller a token: its engine, and a task reading the rest."""
    r = await http.send(http.build_request("POST", "/v1/chat/completions", json=body), stream=True)
    lines = sse_lines(r)
    first = await anext(line async for line in lines if line.startswith("data: {"))

    async def rest() -> list[str]:
        try:
            return [first, *[line async for line in lines if line.startswith("data: ")]]
        finally:
            await r.aclose()

    return engine_of(r), asyncio.create_task(rest())


# First: engine 1 dies; the next test kills it again as it comes back.
@pytest.mark.parametrize("front", FRONTS)
async def test_requests_on_a_killed_engine_are_answered_by_the_other(front, crash_servers):
    """Against one front process, and against front workers (the twin server, stopped after)."""
    if front == ONE_FRONT:
        await _requests_on_a_killed_engine_are_answered_by_the_other(crash_servers[ONE_FRONT])
        return
    with running(crash_servers[FRONT_WORKERS]) as srv:
        await _requests_on_a_killed_engine_are_answered_by_the_other(srv)


async def _requests_on_a_killed_engine_are_answered_by_the_other(crash_server):
    """32 requests over both engines (token route and chat) and 4 chat streams that have sent
    tokens, then SIGKILL of engine 1's EngineCore while they run: every request is answered 200 in
    full, those engine 1 held by engine 0, saying so; engine 1's streams go on on engine 0 from the
    tokens they had (test_continuation has it token for token), engine 0's finish; none hangs. (The same with the engine's whole process killed, running or
    paused, is in test_fake_fleet.)"""
    # Long enough that none finishes before the kill, 0.3 s after they start: with 16 requests on an
    # engine, the demo model decodes some tens of tokens a second for each.
    tokens = 600
    prompt_ids = list(range(5, 25))
    gen = {"token_ids": prompt_ids, "sampling_params": {"max_tokens": tokens, "ignore_eos": True, "temperature": 0}}
    chat = {"model": crash_server.model, "max_tokens": tokens, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=crash_server.url, timeout=300) as http:
        await wait_for_states(http, ["ready", "ready"])
        pid = (await http.get("/engines")).json()["engines"][1]["pid"]
        streams = [
            await _stream_past_first_token(
                http,
                {
                    **chat,
                    "max_tokens": 2 * tokens,
                    "stream": True,
                    "messages": [{"role": "user", "content": f"Stream {i}."}],
                },
            )
            for i in range(4)
        ]
        assert {engine for engine, _ in streams} == {0, 1}
        # Each prompt its own (no group affinity, which would keep a prompt on the engine that
        # answered it last): the least-loaded engine takes every other request.
        requests = [
            http.post("/inference/v1/generate", json={**gen, "token_ids": [100 + i, *prompt_ids]}) for i in range(16)
        ]
        requests += [
            http.post("/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": f"{i}. Go on."}]})
            for i in range(16)
        ]
        tasks = await admit_while_paused(http, requests, already_in_flight=len(streams))
        assert (await http.post("/resume")).status_code == 200
        await asyncio.sleep(0.3)  # decoding on both engines
        vllm_process(pid, "EngineCore").send_signal(signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)
        retried = [r for r in results if r.headers.get("X-Skyinfer-Retried-From") == "1"]
        assert len(retried) == 16, [(engine_of(r), r.headers.get("X-Skyinfer-Retried-From")) for r in results]
        for r in results:
            assert r.status_code == 200 and engine_of(r) == 0, r.text
            answered = r.json()["choices"][0].get("token_ids")
            assert (len(answered) if answered is not None else r.json()["usage"]["completion_tokens"]) == tokens
        for engine, stream in streams:
            events = await asyncio.wait_for(stream, timeout=240)
            assert not [e for e in events if '"error"' in e], events[-3:]
            assert '"finish_reason":"length"' in "".join(events), events[-3:]
            went_on = [e for e in events if '"skyinfer_continued"' in e]
            assert len(went_on) == (1 if engine == 1 else 0), (engine, went_on)


# Next: it finds engine 1 coming back from the previous test's kill (or kills it twice).
async def test_an_engine_that_cannot_come_back_is_retired_and_rejoins_on_request(crash_server, demo_model, tmp_path):
    """Engine 1 is killed each time it comes up: after its one allowed restart in a row it is
    retired. The other serves on; /ready is 200; a trainer's push over the remaining engine
    succeeds. POST /engines/1/restart brings it back while engine 0's process is SIGKILLed at rest:
    both come back stale (from the checkpoint on disk), with none of the segments the killed
    processes mapped left in /dev/shm, and 16 requests sent meanwhile are held, not refused. The trainer, still up, finds its group gone, forms it again by itself, and its push
    covers both engines; then the held requests are answered, on its weights. Prints how long the
    fleet took to be ready for a push and to serve again."""
    async with httpx.AsyncClient(base_url=crash_server.url, timeout=HOLD_S + 60) as http:
        await retire_engine_1(http)
        ready = await http.get("/ready")
        assert ready.status_code == 200 and ready.json()["retired"] == [1], ready.text
        assert (await http.get("/get_world_size")).json()["world_size"] == 1
        families = scrape(crash_server)
        assert total(families, "skyinfer_engine_state", "skyinfer_engine_state", engine="1", state="retired") == 1
        status = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "skyinfer", "status", crash_server.url],
            capture_output=True,
            text=True,
        )
        assert [row.split()[1] for row in status.stdout.splitlines()[1:3]] == ["ready", "retired"], status.stdout
        body = {"model": crash_server.model, "prompt": "p", "max_tokens": 4, "ignore_eos": True}
        served = {engine_of(await http.post("/v1/completions", json={**body, "prompt": f"p{i}"})) for i in range(8)}
        assert served == {0}
        # Fleet calls go to the fleet (engine 0) and are whole: the retired engine fails none.
        r = await http.post("/pause", params={"mode": "keep"})
        assert r.status_code == 200 and [e["engine"] for e in r.json()["engines"]] == [0], r.text
        assert (await http.post("/resume")).status_code == 200

    # A full push over the remaining engine, by a trainer that stays up (sized by /get_world_size).
    weights_1 = modified_weights(demo_model, seed=62)
    trainer = start_trainer(crash_server, save(weights_1, tmp_path / "w1.safetensors"), "one-engine", "--more")
    try:
        assert (await asyncio.to_thread(trainer.stdout.readline)).split() == ["pushed", "one-engine"]
        async with httpx.AsyncClient(base_url=crash_server.url, timeout=HOLD_S + 60) as http:
            assert (await http.get("/weight_info")).json()["weight_version"] == "one-engine"

            # Back on request, while engine 0's process is SIGKILLed at rest: both restart, both
            # come back stale (they loaded the checkpoint; the fleet serves one-engine), and no
            # engine serves until the next push. Requests sent meanwhile are held, not refused.
            restart = asyncio.create_task(http.post("/engines/1/restart"))
            while (await http.get("/engines")).json()["engines"][1]["state"] == "retired":
                await asyncio.sleep(0.05)
            engine_0 = (await http.get("/engines")).json()["engines"][0]
            segments = shm_segments(engine_tree(engine_0["pid"]))
            os.killpg(engine_0["pid"], signal.SIGKILL)
            killed_at = time.monotonic()
            while (await http.get("/engines")).json()["engines"][0]["state"] == "ready":
                await asyncio.sleep(0.05)
            held = [
                asyncio.create_task(http.post("/v1/completions", json={**body, "prompt": f"held {i}"}))
                for i in range(16)
            ]
            r = await restart
            assert r.status_code == 200, r.text
            back = r.json()["engine"]
            assert back["state"] == "stale" and back["stale_reason"].startswith("it restarted from the checkpoint"), (
                back
            )
            engines = await wait_up(http)
            ready_at = time.monotonic()
            assert engines[0]["pid"] != engine_0["pid"] and [e["state"] for e in engines] == ["stale", "stale"]
            # What the killed processes left in /dev/shm went before the restart.
            assert segments and not left_in_shm(segments), (left_in_shm(segments), segments)
            assert not any(task.done() for task in held), "a request was answered by an engine no push had reached"
            assert (await http.get("/get_world_size")).json()["world_size"] == 2

            # The trainer, still up: its group is gone (engine 0 is a new process, and the fleet
            # grew); it forms it again by itself and its push covers both engines.
            weights_3 = modified_weights(demo_model, seed=64)
            trainer.stdin.write(f"{save(weights_3, tmp_path / 'w3.safetensors')} both-again\n")
            trainer.stdin.flush()
            assert (await asyncio.to_thread(trainer.stdout.readline)).split() == ["pushed", "both-again"]
            await asyncio.wait(held, return_when=asyncio.FIRST_COMPLETED)
            served_at = time.monotonic()
            for r in await asyncio.gather(*held):
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
                assert r.headers["X-Weight-Version"] == "both-again"
    finally:
        trainer.kill()
        _, err = trainer.communicate()
    assert "setting it up again" in err, err[-2000:]
    assert [e["state"] for e in crash_server.engines()] == ["ready", "ready"]
    await asyncio.to_thread(assert_engines_match, crash_server, crash_server.model, demo_model, weights_3, "both-again")
    # Every engine process these kills brought up (spares taking over, rejoins) sized its KV cache by
    # the server's --kv-cache-memory-bytes (tests/support.py: 128K tokens), as the first two did.
    sizes = re.findall(r"KV cache size: ([\d,]+) tokens", crash_server.log_path.read_text(errors="replace"))
    assert len(sizes) > 2 and set(sizes) == {"131,072"}, sizes
    print(
        f"\nFAULT engine 0 SIGKILL at rest while engine 1 rejoins: ready for a push {ready_at - killed_at:.1f}s, "
        f"serving after the push {served_at - killed_at:.1f}s"
    )


async def retire_engine_1(http: httpx.AsyncClient) -> None:
    """Kill engine 1 each time it comes up until it is retired."""
    killed: list[int] = []
    deadline = time.monotonic() + 300
    while (engine := (await http.get("/engines")).json()["engines"][1])["state"] != "retired":
        if engine["state"] in UP and engine["pid"] not in killed:
            os.killpg(engine["pid"], signal.SIGKILL)
            killed.append(engine["pid"])
        assert len(killed) <= 2 and time.monotonic() < deadline, f"{engine['state']} after {len(killed)} kills"
        await asyncio.sleep(0.2)
    # The first death is restarted; the second, with one restart in a row allowed, retires it. The
    # previous test's kill is the first when engine 1 is still coming back from it.
    assert len(killed) in (1, 2), killed


async def wait_up(http: httpx.AsyncClient) -> list[dict]:
    deadline = time.monotonic() + 300
    while True:
        engines = (await http.get("/engines")).json()["engines"]
        if all(e["state"] in UP for e in engines):
            return engines
        assert time.monotonic() < deadline, engines
        await asyncio.sleep(0.2)


# Next: it pushes, moving the fleet past the checkpoint.
def test_engine_output_of_any_length_never_stops_an_engine(crash_server, demo_model, tmp_path):
    """Lines of 1 MiB written to each engine's output while it serves, and prompts of about 3,000
    tokens logged whole on every hot route: both engines keep serving in their own processes, every
    line reaches the server's log under its engine's prefix, and a push afterwards succeeds."""
    before = pids(crash_server)
    marker = f"wide-{time.monotonic_ns()}-"
    line = (marker + "x" * (1 << 20) + "\n").encode()
    for pid, _ in before:
        # The engine's own stderr: what vLLM, a traceback or a print() writes to.
        with open(f"/proc/{pid}/fd/2", "wb", buffering=0) as out:
            for _ in range(4):
                out.write(line)
    words = " ".join(f"w{i % 97}" for i in range(1200))
    tokens = httpx.post(
        f"{crash_server.url}/tokenize", json={"model": crash_server.model, "prompt": words}, timeout=60
    ).json()["tokens"]
    assert 2500 < len(tokens) < 3800, len(tokens)
    # Ids in an order no text tokenizes to, so that the log line found is the token route's.
    token_ids = [(i * 37) % 2000 + 3 for i in range(len(tokens))]
    bodies = {
        "/v1/completions": {"model": crash_server.model, "prompt": f"completion-{marker} {words}", "max_tokens": 4},
        "/v1/chat/completions": {
            "model": crash_server.model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": f"chat-{marker} {words}"}],
        },
        "/inference/v1/generate": {"token_ids": token_ids, "sampling_params": {"max_tokens": 4}},
    }
    for path, body in bodies.items():
        for engine in (0, 1):
            r = httpx.post(
                f"{crash_server.url}{path}", json=body, headers={"X-Session-ID": f"long-{engine}-{path}"}, timeout=120
            )
            assert r.status_code == 200, r.text
    assert pids(crash_server) == before
    assert [e["state"] for e in crash_server.engines()] == ["ready", "ready"]

    def logged() -> bool:
        log = crash_server.log_path.read_bytes()
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
    pushed = run_trainer(crash_server, save(weights, tmp_path / "w.safetensors"), "after-wide-lines")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert_engines_match(crash_server, crash_server.model, demo_model, weights, "after-wide-lines")
    assert pids(crash_server) == before


def test_an_engine_writes_its_threads_stacks_on_the_fronts_signal_and_serves_on(crash_server):
    """The signal the front sends an engine whose probes failed, before it kills it: each engine
    process writes every thread's stack to its output (the server's log, under its prefix), the
    thread serving its event loop among them, and serves on (fake_fleet's test: the front sends
    it to an engine whose loop is held). One engine at a time: two engines' relays write to the
    one log as their processes write, so stacks written at the same instant interleave mid-line."""
    before = pids(crash_server)
    for engine, (pid, _) in enumerate(before):
        start = crash_server.log_path.stat().st_size
        os.kill(pid, STACKS_SIGNAL)

        def written(engine: int = engine, start: int = start) -> bool:
            log = crash_server.log_path.read_bytes()[start:].decode(errors="replace")
            return f"[engine {engine}] Current thread 0x" in log and bool(
                re.search(rf'\[engine {engine}\]   File ".*skyinfer/engine/__main__\.py", line \d+ in main', log)
            )

        wait_for(written, 30, f"engine {engine}'s stacks are missing from the server's log")
    for engine in (0, 1):
        with httpx.Client(transport=httpx.HTTPTransport(uds=engine_socket(crash_server, engine)), timeout=30) as http:
            assert http.get("http://engine/health").status_code == 200
    r = httpx.post(
        f"{crash_server.url}/v1/completions",
        json={"model": crash_server.model, "prompt": "after the stacks", "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert pids(crash_server) == before


async def test_engine_core_killed_mid_receive_aborts_the_update_on_every_engine(crash_server, demo_model, tmp_path):
    """A one-call push is under way (the trainer has sent two tensors, its rollouts held by a
    keep-pause; each engine is inside its one ``/push`` call) when vLLM's EngineCore under engine 1
    is SIGKILLed. Every held request ends with finish
    reason "abort" on engine 0 (engine 1's are sent there once more; engine 0's weights are part
    new: it ends the update in its own process and drops what it held; the update is aborted for
    the whole fleet at once, not left to the group's 60 s timeout: 16 or more end within 30 s), or
    waits, as a request that finds no engine serving does. Engine 0 keeps its process; engine 1
    comes back paused, as the fleet is, with none of the segments its old processes mapped left in
    /dev/shm; both serve nothing (stale) until the next push, which works at once, and then what
    waited is answered in full on the pushed weights."""
    body = {"model": crash_server.model, "prompt": "under load", "max_tokens": 600, "ignore_eos": True}
    weights = modified_weights(demo_model, seed=31)
    path = save(weights, tmp_path / "w31.safetensors")
    async with httpx.AsyncClient(base_url=crash_server.url, timeout=HOLD_S + 60) as http:
        await wait_for_states(http, ["ready", "ready"])
        before = [e["pid"] for e in (await http.get("/engines")).json()["engines"]]
        tasks = await admit_while_paused(http, (http.post("/v1/completions", json=body) for _ in range(32)))
        trainer = ForkedPopen(
            [TRAINER, crash_server.url, str(path), "never-served", "--hang-after", "2", "--one-call"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert (await asyncio.to_thread(trainer.stdout.readline)).strip() == "hanging"
            assert (await http.get("/weight_info")).json()["update_phase"] == "receiving"
            segments = shm_segments(engine_tree(before[1]))
            vllm_process(before[1], "EngineCore").send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            requests = [asyncio.ensure_future(_timed(t)) for t in tasks]
            # Aborted with the update, they end in seconds; left to the group's timeout (the
            # trainer's 60 s), they would still wait: a 30 s deadline tells the two apart.
            deadline = time.monotonic() + 30
            while (done := sum(r.done() for r in requests)) < 16:
                assert time.monotonic() < deadline, f"{done} of 32 ended 30 s after the fault"
                await asyncio.sleep(0.1)
        finally:
            trainer.kill()
            trainer.wait()
        # Engine 0 in its own process, engine 1 in a new one, as paused as the fleet: stale until a push.
        deadline = time.monotonic() + 240
        while True:
            engines = (await http.get("/engines")).json()["engines"]
            if engines[1]["pid"] != before[1] and [e["state"] for e in engines] == ["stale", "stale"]:
                break
            assert time.monotonic() < deadline, engines
            await asyncio.sleep(0.5)
        ready_at = time.monotonic()
        assert engines[0]["pid"] == before[0] and [e["paused"] for e in engines] == [True, True]
        # What engine 1's processes left in /dev/shm (its EngineCore's message queues) went before its restart.
        assert segments and not left_in_shm(segments), (left_in_shm(segments), segments)
        late = asyncio.ensure_future(_timed(http.post("/v1/completions", json={**body, "prompt": "late"})))
        await asyncio.sleep(1)
        # Engine 0's own, and engine 1's sent there once more before it was held out, were aborted
        # (long since: both engines are stale, so no engine has anything to abort or serve); the rest
        # wait for an engine to serve.
        ended = [r for r in requests if r.done()]
        held = [r for r in requests if not r.done()]
        assert len(ended) >= 16, f"{len(ended)} of 32 ended"
        for task in ended:
            r, _ = task.result()
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort", r.text
            assert engine_of(r) == 0
        assert not late.done(), "an engine served weights no push finished"
        pushed = await asyncio.to_thread(run_trainer, crash_server, path, "after-enginecore-kill")
        assert pushed.returncode == 0, pushed.stdout + pushed.stderr
        assert (await http.post("/resume")).status_code == 200
        for r, _ in await asyncio.gather(late, *held):
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 600, r.text
            assert r.headers["X-Weight-Version"] == "after-enginecore-kill"
    await asyncio.to_thread(
        assert_engines_match, crash_server, crash_server.model, demo_model, weights, "after-enginecore-kill"
    )
    print(
        f"\nFAULT EngineCore SIGKILL mid-receive: ready for a push {ready_at - killed_at:.1f}s, "
        f"serving {time.monotonic() - killed_at:.1f}s"
    )


# Last: it kills this module's server.
async def test_sigkilled_front_takes_every_process_with_it(crash_server):
    """However the front dies, nothing it started lives on to hold devices, and the port serves again."""
    srv = crash_server
    tree = process_tree(srv)
    engine_pids = {e["pid"] for e in srv.engines()}
    # Both engines, and vLLM's processes beneath each; the engine template they were forked from.
    assert engine_pids <= {p.pid for p in tree} and {p.ppid() for p in tree} >= engine_pids
    assert [p for p in tree if "skyinfer.engine.template" in " ".join(p.cmdline())], [p.cmdline() for p in tree]
    body = {"model": srv.model, "prompt": "cut off", "max_tokens": 1500, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
        tasks = await admit_while_paused(http, (http.post("/v1/completions", json=body) for _ in range(8)))
        assert (await http.post("/resume")).status_code == 200
        srv.proc.kill()
        killed_at = time.monotonic()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(o, httpx.TransportError) for o in outcomes), outcomes
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, f"alive 10 s after the front was killed: {[(p.pid, p.name()) for p in alive]}"
    print(f"every process gone {time.monotonic() - killed_at:.1f}s after SIGKILL of the front")
    # The port serves again: nothing left behind listens on it (SO_REUSEADDR, as the
    # next server's, passes over the killed connections' TIME_WAIT, not over a listener).
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", srv.port))
        sock.listen()
