"""Crashes under load: a request whose engine dies is answered by another engine (once; mid-push,
where the whole fleet's update is aborted, it fails fast with 503), the engine comes back; a killed
front takes every process it started with it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from safetensors.torch import load_file

from pushes import assert_engines_match, modified_weights, run_trainer, save
from support import (
    TRAINER,
    ServerProcess,
    admit_while_paused,
    engine_of,
    process_tree,
    running,
    scrape,
    total,
    vllm_process,
)


@pytest.fixture(scope="module")
def crash_server(demo_model, tmp_path_factory):
    srv = ServerProcess(
        demo_model,
        engines=2,
        log_path=tmp_path_factory.mktemp("crash") / "server.log",
        # Probes fast enough for a test; 3 in a row must fail.
        # float32, for logprobs compared with transformers' float32 forward.
        # A request that finds no engine serving (mid-push faults) is answered after a second's hold.
        extra_args=(
            "--health-interval",
            "1",
            "--health-timeout",
            "4",
            "--dtype",
            "float32",
            "--hold-requests",
            "1",
            # Engine 1 dies six times in this module, each time some seconds after it came
            # up: each crash counts as the first (a restart after 1 s), none retires it.
            "--restart-window",
            "5",
            "--max-restarts",
            "10",
        ),
    )
    with running(srv):
        yield srv


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
    lines = r.aiter_lines()
    first = await anext(line async for line in lines if line.startswith("data: {"))

    async def rest() -> list[str]:
        try:
            return [first, *[line async for line in lines if line.startswith("data: ")]]
        finally:
            await r.aclose()

    return engine_of(r), asyncio.create_task(rest())


# First: engine 1 restarts four times, and comes back ready only while the fleet serves the checkpoint.
async def test_requests_on_a_killed_engine_are_answered_by_the_other(crash_server):
    """32 requests over both engines (token route and chat) and 4 chat streams that have sent
    tokens, then SIGKILL of engine 1's EngineCore, or of its whole process, while they run or
    while the fleet is paused (keep): every request is answered 200 in full, those engine 1 held by
    engine 0, saying so; engine 1's streams end with an error event, engine 0's finish; none hangs."""
    # Long enough that none finishes before the kill: the demo model decodes hundreds of tokens a second.
    tokens = 1500
    prompt_ids = list(range(5, 25))
    gen = {"token_ids": prompt_ids, "sampling_params": {"max_tokens": tokens, "ignore_eos": True, "temperature": 0}}
    chat = {
        "model": crash_server.model,
        "messages": [{"role": "user", "content": "Go on."}],
        "max_tokens": tokens,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(base_url=crash_server.url, timeout=300) as http:
        cases = (("EngineCore", False), ("process", False), ("EngineCore", True), ("process", True))
        for case, (kill, paused) in enumerate(cases):
            await wait_for_states(http, ["ready", "ready"])
            pid = (await http.get("/engines")).json()["engines"][1]["pid"]
            streams = [
                await _stream_past_first_token(
                    http,
                    {
                        **chat,
                        "max_tokens": 2 * tokens,
                        "stream": True,
                        "messages": [{"role": "user", "content": f"Stream {case}.{i}."}],
                    },
                )
                for i in range(4)
            ]
            assert {engine for engine, _ in streams} == {0, 1}
            # Each prompt its own, in each case too (no group affinity, which would keep a prompt on the
            # engine that answered it last): the least-loaded engine takes every other request.
            requests = [
                http.post("/inference/v1/generate", json={**gen, "token_ids": [100 + 16 * case + i, *prompt_ids]})
                for i in range(16)
            ]
            requests += [
                http.post(
                    "/v1/chat/completions",
                    json={**chat, "messages": [{"role": "user", "content": f"{case}.{i}. Go on."}]},
                )
                for i in range(16)
            ]
            tasks = await admit_while_paused(http, requests, already_in_flight=len(streams))
            if not paused:
                assert (await http.post("/resume")).status_code == 200
                await asyncio.sleep(0.3)  # decoding on both engines
            if kill == "EngineCore":
                vllm_process(pid, "EngineCore").send_signal(signal.SIGKILL)
            else:
                os.killpg(pid, signal.SIGKILL)
            if paused:
                # Engine 1's requests wait on engine 0, paused like any new request, until resume.
                while (await http.get("/engines")).json()["engines"][1]["state"] == "paused":
                    await asyncio.sleep(0.1)
                assert (await http.post("/resume")).status_code == 503  # engine 1 is down: said, not hidden
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)
            retried = [r for r in results if r.headers.get("X-Skyinfer-Retried-From") == "1"]
            assert len(retried) == 16, (
                kill,
                paused,
                [(engine_of(r), r.headers.get("X-Skyinfer-Retried-From")) for r in results],
            )
            for r in results:
                assert r.status_code == 200 and engine_of(r) == 0, (kill, paused, r.text)
                answered = r.json()["choices"][0].get("token_ids")
                assert (len(answered) if answered is not None else r.json()["usage"]["completion_tokens"]) == tokens
            for engine, stream in streams:
                events = await asyncio.wait_for(stream, timeout=240)
                errors = [e for e in events if '"error"' in e]
                if engine == 1:
                    assert errors, (kill, paused, events[-3:])
                else:
                    assert not errors and '"finish_reason":"length"' in "".join(events), (kill, paused, events[-3:])
        await wait_for_states(http, ["ready", "ready"])


# Next: it needs engines that load what the fleet serves (the checkpoint); its push moves the
# fleet past it.
async def test_a_hung_engine_and_a_failing_restart_both_end_revived_and_out_of_the_group(crash_server, demo_model):
    """Two faults, one per engine, so that the two restarts overlap.

    Engine 1 hangs (SIGSTOP): its health probes declare it dead, its requests are answered in full
    by engine 0 and its sticky session moves there. Then engine 0 dies and its restart itself fails with an
    error nobody planned for (its socket path is a directory, so spawning raises
    IsADirectoryError): it must not stay "restarting"; it is declared dead again, retried after
    twice the backoff, and comes back. Both come back outside the trainer's transfer group: the
    server says so, and the trainer's next push forms the group again by itself.
    """
    from skyinfer.trainer import GlooTrainer

    body = {"model": crash_server.model, "prompt": "hang on", "max_tokens": 600, "ignore_eos": True}
    tensors = [(n, t.float()) for n, t in load_file(str(demo_model / "model.safetensors")).items()]
    trainer = GlooTrainer(crash_server.url, timeout_s=60)
    async with httpx.AsyncClient(base_url=crash_server.url, timeout=120) as http:
        await wait_for_states(http, ["ready", "ready"])
        await asyncio.to_thread(trainer.init)
        before = (await http.get("/engines")).json()["engines"]
        restarts_before = total(
            scrape(crash_server), "skyinfer_engine_restarts", "skyinfer_engine_restarts_total", engine="1"
        )
        sticky = {}
        for i in range(8):
            r = await http.post(
                "/v1/completions", json={**body, "max_tokens": 2}, headers={"X-Session-ID": f"hung-{i}"}
            )
            sticky.setdefault(engine_of(r), f"hung-{i}")
        assert set(sticky) == {0, 1}
        # Each prompt its own (no group affinity): half of them on each engine.
        tasks = await admit_while_paused(
            http, (http.post("/v1/completions", json={**body, "prompt": f"hang on {i}"}) for i in range(16))
        )
        assert (await http.post("/resume")).status_code == 200
        os.kill(before[1]["pid"], signal.SIGSTOP)
        hung_at = time.monotonic()
        # Declared dead after 3 failed probes (1 s apart, 4 s timeout each).
        while (await http.get("/health")).json()["engines"][1]["state"] == "ready":
            assert time.monotonic() - hung_at < 30, "the hung engine was never declared dead"
            await asyncio.sleep(0.2)
        results = await asyncio.gather(*tasks)
        assert sum(r.headers.get("X-Skyinfer-Retried-From") == "1" for r in results) == 8
        for r in results:
            assert r.status_code == 200 and engine_of(r) == 0, r.text
            assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]
        # Its sticky session moved to the live engine.
        r = await http.post("/v1/completions", json={**body, "max_tokens": 2}, headers={"X-Session-ID": sticky[1]})
        assert r.status_code == 200 and engine_of(r) == 0
        # An admin call meanwhile is reported per engine, never hidden behind a 200: the live
        # engine applies it, the dead one is named.
        assert (await http.get("/engines")).json()["engines"][1]["state"] in ("dead", "restarting")
        r = await http.post("/pause", params={"mode": "keep"})
        assert r.status_code == 503 and "engine 1" in r.json()["error"]["message"], r.text
        assert [(e["engine"], e["status"]) for e in r.json()["engines"]] == [(0, 200), (1, 503)]
        assert (await http.get("/engines")).json()["engines"][0]["state"] == "paused"
        r = await http.post("/resume")
        assert r.status_code == 503 and [(e["engine"], e["status"]) for e in r.json()["engines"]] == [
            (0, 200),
            (1, 503),
        ]
        assert (await http.get("/engines")).json()["engines"][0]["state"] == "ready"

        # While engine 1 restarts: engine 0 dies, and the path its new process must listen on is taken.
        argv = psutil.Process(before[0]["pid"]).cmdline()
        socket_path = argv[argv.index("--socket") + 1]
        log_start = len(crash_server.log_path.read_text(errors="replace"))
        os.killpg(before[0]["pid"], signal.SIGKILL)
        while (await http.get("/engines")).json()["engines"][0]["state"] != "dead":
            await asyncio.sleep(0.02)
        # Within the restart backoff (1 s or more).
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
        os.mkdir(socket_path)
        try:
            deadline = time.monotonic() + 60
            while (log := crash_server.log_path.read_text(errors="replace")[log_start:]).count("IsADirectoryError") < 1:
                assert time.monotonic() < deadline, log[-3000:]
                await asyncio.sleep(0.2)
            assert (await http.get("/engines")).json()["engines"][0]["state"] in ("dead", "restarting")
        finally:
            os.rmdir(socket_path)
        await wait_for_states(http, ["ready", "ready"])
        after = (await http.get("/engines")).json()["engines"]
        assert after[1]["pid"] != before[1]["pid"]
        assert (
            not psutil.pid_exists(before[1]["pid"]) or psutil.Process(before[1]["pid"]).status() == psutil.STATUS_ZOMBIE
        )
        assert after[0]["pid"] != before[0]["pid"] and after[0]["restarts"] >= before[0]["restarts"] + 2
        # The attempt after the failed one waited twice as long.
        log = crash_server.log_path.read_text(errors="replace")[log_start:]
        delays = [float(d) for d in re.findall(r"engine 0: restarting in ([0-9.]+)s", log)]
        assert len(delays) >= 2 and all(b == 2 * a for a, b in itertools.pairwise(delays)), delays
        served = {
            engine_of(await http.post("/v1/completions", json={**body, "prompt": f"{i}", "max_tokens": 2}))
            for i in range(6)
        }
        assert served == {0, 1}
        restarts = total(scrape(crash_server), "skyinfer_engine_restarts", "skyinfer_engine_restarts_total", engine="1")
        assert restarts == restarts_before + 1

        groups = [e["in_transfer_group"] for e in (await http.get("/weight_info")).json()["engines"]]
        assert groups == [False, False]
        # The new processes are not in the trainer's group: a push is refused up front with a code
        # that says so, nothing restarted; the trainer's own push sets the group up again by itself.
        r = await http.post("/start_weight_update")
        assert r.status_code == 409 and r.json()["error"]["code"] == "transfer_group_gone", r.text
        assert "init_weight_transfer" in r.json()["error"]["message"]
        assert [e["state"] for e in (await http.get("/engines")).json()["engines"]] == ["ready", "ready"]
        await asyncio.to_thread(trainer.push, tensors, "v-rejoined")
        assert (await http.get("/weight_info")).json()["weight_version"] == "v-rejoined"


# After the hung-engine test, whose push moves the fleet past the checkpoint.
async def test_engine_core_killed_mid_receive_aborts_the_update_on_every_engine(crash_server, demo_model, tmp_path):
    """A push is under way (the trainer has sent two tensors, its rollouts held by a keep-pause)
    when vLLM's EngineCore under engine 1 is SIGKILLed. Every held request ends within seconds,
    with finish reason "abort" on engine 0 (engine 1's are sent there once more; engine 0's weights
    are part new: it ends the update in its own process and drops what it held; the update is
    aborted for the whole fleet, not left to the group's timeout), or a 503. Engine 0 keeps its process; engine 1 comes
    back paused, as the fleet is; both serve nothing (stale) and the next push works at once."""
    body = {"model": crash_server.model, "prompt": "under load", "max_tokens": 600, "ignore_eos": True}
    weights = modified_weights(demo_model, seed=31)
    path = save(weights, tmp_path / "w31.safetensors")
    async with httpx.AsyncClient(base_url=crash_server.url, timeout=120) as http:
        await wait_for_states(http, ["ready", "ready"])
        before = [e["pid"] for e in (await http.get("/engines")).json()["engines"]]
        tasks = await admit_while_paused(http, (http.post("/v1/completions", json=body) for _ in range(32)))
        trainer = subprocess.Popen(
            [sys.executable, str(TRAINER), crash_server.url, str(path), "never-served", "--hang-after", "2"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert (await asyncio.to_thread(trainer.stdout.readline)).strip() == "hanging"
            assert (await http.get("/weight_info")).json()["update_phase"] == "receiving"
            vllm_process(before[1], "EngineCore").send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            results = await asyncio.gather(*(_timed(t) for t in tasks))
        finally:
            trainer.kill()
            trainer.wait()
        ended = collections.Counter()
        for r, at in results:
            if r.status_code == 200:
                assert r.json()["choices"][0]["finish_reason"] == "abort", r.text
                ended[f"abort on engine {engine_of(r)}"] += 1
            else:
                assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError", r.text
                ended["503"] += 1
            assert at - killed_at < 5, f"a request took {at - killed_at:.1f}s to end"
        # Engine 1's were sent once more, to engine 0, before it was held out: ended there.
        assert sum(ended.values()) == 32 and set(ended) <= {"503", "abort on engine 0"}, ended
        # Engine 0 in its own process, engine 1 in a new one, as paused as the fleet: stale until a push.
        deadline = time.monotonic() + 240
        while True:
            engines = (await http.get("/engines")).json()["engines"]
            if engines[1]["pid"] != before[1] and [e["state"] for e in engines] == ["stale", "stale"]:
                break
            assert time.monotonic() < deadline, engines
            r = await http.post("/v1/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 503, "an engine served weights no push finished"
            await asyncio.sleep(0.5)
        ready_at = time.monotonic()
        assert engines[0]["pid"] == before[0] and [e["paused"] for e in engines] == [True, True]
        pushed = await asyncio.to_thread(run_trainer, crash_server, path, "after-enginecore-kill")
        assert pushed.returncode == 0, pushed.stdout + pushed.stderr
        assert (await http.post("/resume")).status_code == 200
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
    # Both engines, and vLLM's processes beneath each.
    assert engine_pids <= {p.pid for p in tree} and {p.ppid() for p in tree} >= engine_pids
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
