"""Peer catch-up (skyinfer/weights/catchup.py): an engine that comes back while the fleet serves a
pushed version copies it from a healthy peer engine through shared memory, verified by vLLM's
checksums before it serves, while the other engine serves on.

Real engines, on a server of this module's own (two float32 engines, probes every second): a
killed EngineCore and an operator's restart catch up by themselves, an operator's catch-up works
and is refused where it makes no sense, engines with no healthy peer wait for the next push, a push
that arrives during a catch-up wins, and a source that dies mid-way leaves the target stale and
nothing in /dev/shm. Each case checks what the engines serve against a transformers forward pass.
The front's own logic (source choice, refusals, pushes winning) runs over fake engines first.
"""

from __future__ import annotations

import asyncio
import glob
import signal
import time
from pathlib import Path

import httpx
from fakes import calls, fake_fleet, kill, script, until

from skyinfer.devices import EngineDevices
from skyinfer.fleet.registry import REGISTRY, EngineRegistry
from skyinfer.fleet.state import EngineRecord, Lifecycle, Residency
from skyinfer.weights.catchup import CATCH_UP, CatchUp
from skyinfer.weights.checkpoint import safetensors_shapes

from pushes import (
    PROMPTS,
    assert_engines_match,
    greedy_completion,
    modified_weights,
    run_trainer,
    save,
    sessions_per_engine,
    start_trainer,
)
from support import ServerProcess, engine_socket, module_servers, vllm_process


def catch_up_files(app) -> list[str]:
    """The app's catch-ups' files (the suite's other lanes' servers catch up meanwhile)."""
    return glob.glob(f"/dev/shm/{app[CATCH_UP].prefix}*")


# -- the front's logic, over fake engines ----------------------------------------------------------


def test_the_source_serves_the_fleets_version_at_the_targets_size_least_loaded_first():
    sizes = [(1, 1), (1, 1), (2, 1), (1, 1), (1, 1), (1, 1)]
    records = [
        EngineRecord(i, EngineDevices("cpu", ((i,),), {}), f"/nonexistent-{i}.sock", parallel=size)
        for i, size in enumerate(sizes)
    ]
    registry = EngineRegistry(records)
    for record in records:
        registry.set_lifecycle(record, Lifecycle.UP)
        record.weight_version = "v1"
    registry.fleet_weight_version = "v1"
    target = records[0]
    registry.set_stale(target, "it restarted")
    records[1].in_flight_count = 7
    records[3].weight_version = "v0"  # serves another version
    records[4].in_flight_count = 2
    registry.set_residency(records[5], Residency(paused=True, sleep_level=1, asleep=frozenset({"weights"})))
    sources = CatchUp(registry, None, 10)._sources(target)  # type: ignore[arg-type]
    # 2: another size; 3: another version; 5: its weights asleep. The least loaded first.
    assert [r.engine_id for r in sources] == [4, 1]
    registry.set_stale(records[4], "its weights differ")
    assert [r.engine_id for r in CatchUp(registry, None, 10)._sources(target)] == [1]  # type: ignore[arg-type]


async def push(client, group_init, demo_model, version: str) -> None:
    """A fake push of every tensor of the checkpoint (it brings stale engines in)."""
    shapes = safetensors_shapes(demo_model / "model.safetensors")
    names = sorted(shapes)
    whole = {"names": names, "dtype_names": ["float32"] * len(names), "shapes": [list(shapes[n]) for n in names]}
    assert (await client.post("/init_weight_transfer", json={"init_info": group_init})).status == 200
    r = await client.post("/update_weights", json={"update_info": whole, "weight_version": version})
    assert r.status == 200, await r.text()


async def test_over_fake_engines_a_restart_catches_up_refusals_say_why_and_pushes_win(
    aiohttp_client, demo_model, tmp_path, group_init
):
    app, client = await fake_fleet(aiohttp_client, demo_model, tmp_path, hold_requests_s=5)
    records = app[REGISTRY].records
    assert (await client.post("/engines/7/catch_up")).status == 404
    r = await client.post("/engines/1/catch_up")
    assert r.status == 409 and "not stale" in (await r.json())["error"]["message"]

    # A crash after a push: the new process copies v1 from engine 0 and serves.
    await push(client, group_init, demo_model, "v1")
    pid = kill(app, 1)
    await until(lambda: asyncio.sleep(0, records[1].pid != pid and records[1].up and records[1].stale is None))
    assert records[1].weight_version == "v1"
    assert (await calls(app, 0)).get("/export_weights") == 1 and (await calls(app, 1)).get("/import_weights") == 1
    assert not catch_up_files(app)

    # No healthy peer: both stale (a level-2 sleep discarded their weights).
    assert (await client.post("/sleep", params={"level": "2"})).status == 200
    assert (await client.post("/wake_up")).status == 200
    r = await client.post("/engines/1/catch_up")
    assert r.status == 409 and "no healthy engine holds v1" in (await r.json())["error"]["message"]
    await push(client, group_init, demo_model, "v2")

    # A push while engine 0 writes its files: the push wins, engine 1 imports nothing.
    await script(app, 0, {"delay_s": {"/export_weights": 1.5}})
    pid = kill(app, 1)
    await until(lambda: asyncio.sleep(0, records[1].pid != pid and (records[1].stale or "").startswith("catching")))
    await push(client, group_init, demo_model, "v3")
    assert records[1].stale is None and records[1].weight_version == "v3"
    await asyncio.sleep(2)  # the export ends; the catch-up gives way
    assert "/import_weights" not in await calls(app, 1)
    assert [r.stale for r in records] == [None, None] and not catch_up_files(app)

    # An operator's catch-up of an engine held out: 200 with what was done.
    await script(app, 0, {})
    app[REGISTRY].set_stale(records[1], "its weights differ from the fleet's")
    r = await client.post("/engines/1/catch_up")
    assert r.status == 200, await r.text()
    body = await r.json()
    assert (body["engine"], body["source"], body["weight_version"]) == (1, 0, "v3") and body["seconds"] >= 0
    assert records[1].stale is None


# -- real engines ------------------------------------------------------------------------------------


def _launch(demo_model: Path, logs: Path) -> ServerProcess:
    extra = ("--dtype", "float32", "--health-interval", "1", "--hold-requests", "1")
    return ServerProcess(demo_model, engines=2, log_path=logs / "server.log", extra_args=extra)


peer_server = module_servers(__name__, _launch)


def greedy_answers(server, model_name) -> dict[int, list[tuple[list[int], list[float]]]]:
    """Each engine's greedy tokens and their logprobs on PROMPTS."""
    answers = {}
    for engine, session in sessions_per_engine(server, model_name).items():
        answers[engine] = []
        for prompt in PROMPTS:
            choice = greedy_completion(server, model_name, prompt, session, max_tokens=12).json()["choices"][0]
            answers[engine].append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    return answers


def assert_engines_agree(server, model_name) -> None:
    """Both engines give the same greedy tokens, their logprobs within 1e-3."""
    answers = greedy_answers(server, model_name)
    for (tokens_0, logprobs_0), (tokens_1, logprobs_1) in zip(answers[0], answers[1], strict=True):
        assert tokens_0 == tokens_1
        assert max(abs(a - b) for a, b in zip(logprobs_0, logprobs_1, strict=True)) < 1e-3


def wait_engines(server, predicate, what: str, timeout_s: float = 240) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while not predicate(engines := server.engines()):
        assert time.monotonic() < deadline, f"{what}: {engines}"
        time.sleep(0.2)
    return engines


def hold_engine_1_out(server) -> None:
    """Zero engine 1's weights behind the front's back; the fleet's checksum holds it out (stale)."""
    assert httpx.post(f"{server.url}/weight_checker", json={"action": "checksum"}, timeout=60).json()["agree"]
    transport = httpx.HTTPTransport(uds=engine_socket(server, 1))
    with httpx.Client(transport=transport, base_url="http://engine", timeout=60) as engine_1:
        assert engine_1.post("/weight_checker", json={"action": "reset"}).status_code == 200
    checked = httpx.post(f"{server.url}/weight_checker", json={"action": "checksum"}, timeout=60).json()
    assert checked["held_out"] == [1], checked
    assert [e["state"] for e in server.engines()] == ["ready", "stale"]


def pushed(server, demo_model, tmp_path: Path, seed: int, version: str):
    weights = modified_weights(demo_model, seed=seed)
    done = run_trainer(server, save(weights, tmp_path / f"{version}.safetensors"), version)
    assert done.returncode == 0, done.stdout + done.stderr
    return weights


def test_an_engine_core_killed_after_a_push_catches_up_from_its_peer(peer_server, model_name, demo_model, tmp_path):
    """A trainer pushes; engine 1's EngineCore is SIGKILLed. Engine 1 restarts from the checkpoint
    on disk and, with no push, copies the pushed weights from engine 0: it serves them (same greedy
    tokens as engine 0, logprobs within 1e-3, and within 0.05 of transformers'), while engine 0
    answers every request sent meanwhile. How long that took is printed (docs: benchmarks-journal), not
    judged: with no catch-up, engine 1 would stay stale until a push that never comes."""
    srv = peer_server
    weights = pushed(srv, demo_model, tmp_path, 71, "pushed-1")
    before = srv.engines()
    vllm_process(before[1]["pid"], "EngineCore").send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    served_meanwhile = 0
    body = {"model": model_name, "prompt": "meanwhile", "max_tokens": 2}
    while True:
        engine_1 = srv.engines()[1]
        if engine_1["pid"] != before[1]["pid"] and engine_1["state"] == "ready":
            break
        assert time.monotonic() - killed_at < 240, engine_1
        if engine_1["state"] != "ready":
            r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.headers["X-Skyinfer-Engine"] == "0", r.text
            served_meanwhile += 1
        time.sleep(0.2)
    back_in = time.monotonic() - killed_at
    print(
        f"\nCATCH-UP EngineCore SIGKILL -> serving pushed-1 again in {back_in:.1f}s ({served_meanwhile} served meanwhile)"
    )
    assert engine_1["weight_version"] == "pushed-1" and engine_1["restarts"] == before[1]["restarts"] + 1
    assert served_meanwhile > 0
    assert "engine 1 caught up with pushed-1 from engine 0" in srv.log_tail(2000)
    assert_engines_agree(srv, model_name)
    assert_engines_match(srv, model_name, demo_model, weights, "pushed-1")
    assert not srv.shm_files("catch_up")


def test_an_operators_restart_and_catch_up_and_what_is_refused(peer_server, model_name, demo_model):
    """POST /engines/1/restart: engine 1 comes back and catches up by itself. Held out again (its
    weights zeroed behind the front's back), POST /engines/1/catch_up brings it back, verified; a
    catch-up of an engine that is not stale is a 409, of one that does not exist a 404."""
    srv = peer_server
    r = httpx.post(f"{srv.url}/engines/1/restart", timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["engine"]["state"] == "stale", r.json()
    wait_engines(srv, lambda e: [x["state"] for x in e] == ["ready", "ready"], "no catch-up after the restart")
    assert srv.engines()[1]["weight_version"] == "pushed-1"

    refused = httpx.post(f"{srv.url}/engines/1/catch_up", timeout=60)
    assert refused.status_code == 409 and "not stale" in refused.json()["error"]["message"], refused.text
    assert httpx.post(f"{srv.url}/engines/9/catch_up", timeout=60).status_code == 404

    hold_engine_1_out(srv)
    r = httpx.post(f"{srv.url}/engines/1/catch_up", timeout=300)
    assert r.status_code == 200, r.text
    done = r.json()
    assert (done["engine"], done["source"], done["weight_version"]) == (1, 0, "pushed-1")
    print(f"\nCATCH-UP on request: {done['seconds']:.2f}s")
    assert [e["state"] for e in srv.engines()] == ["ready", "ready"]
    assert httpx.post(f"{srv.url}/weight_checker", json={"action": "checksum"}, timeout=60).json()["agree"]
    assert_engines_agree(srv, model_name)
    assert not srv.shm_files("catch_up")


async def test_a_push_during_a_catch_up_wins(peer_server, model_name, demo_model, tmp_path):
    """Engine 1 is held out and catching up from engine 0, whose EngineCore is stopped (SIGSTOP)
    while it would write its files; a trainer's push begins meanwhile. When engine 0 goes on, the
    catch-up gives way (409, engine 1 stale saying the push covers it) and the push lands on both."""
    srv = peer_server
    hold_engine_1_out(srv)
    weights = modified_weights(demo_model, seed=72)
    path = save(weights, tmp_path / "pushed-2.safetensors")
    trainer = start_trainer(srv, path, "pushed-2", "--one-call", "--hold-before-update")
    core_0 = vllm_process(srv.engines()[0]["pid"], "EngineCore")
    try:
        assert (await asyncio.to_thread(trainer.stdout.readline)).strip() == "before update"
        async with httpx.AsyncClient(base_url=srv.url, timeout=300) as http:
            core_0.send_signal(signal.SIGSTOP)
            try:
                catching_up = asyncio.ensure_future(http.post("/engines/1/catch_up"))
                await asyncio.to_thread(
                    wait_engines, srv, lambda e: (e[1]["stale_reason"] or "").startswith("catching up"), "no catch-up"
                )
                trainer.stdin.write("\n")
                trainer.stdin.flush()
                await asyncio.sleep(3)  # the push begins: it pauses engine 0, which waits for its EngineCore
                assert not catching_up.done()
            finally:
                core_0.send_signal(signal.SIGCONT)
            r = await catching_up
        out, err = await asyncio.to_thread(trainer.communicate, timeout=120)
    finally:
        trainer.kill()
    assert r.status_code == 409 and "a push arrived during its catch-up" in r.json()["error"]["message"], r.text
    assert trainer.returncode == 0 and "pushed pushed-2" in out, out + err
    assert [(e["state"], e["weight_version"]) for e in srv.engines()] == [("ready", "pushed-2")] * 2
    assert "catch-up from engine 0 abandoned: a push arrived" in srv.log_tail(2000)
    assert_engines_match(srv, model_name, demo_model, weights, "pushed-2")
    assert not srv.shm_files("catch_up")


async def test_a_source_that_dies_mid_catch_up_leaves_the_target_stale_and_nothing_behind(
    peer_server, model_name, demo_model, tmp_path
):
    """Engine 0's EngineCore is SIGKILLed while engine 1 catches up from it: the catch-up fails
    (502) naming the step, engine 1 stays stale saying so, no file is left in /dev/shm; engine 0
    comes back stale too (no healthy peer), and the next push brings both in."""
    srv = peer_server
    hold_engine_1_out(srv)
    core_0 = vllm_process(srv.engines()[0]["pid"], "EngineCore")
    async with httpx.AsyncClient(base_url=srv.url, timeout=300) as http:
        core_0.send_signal(signal.SIGSTOP)
        catching_up = asyncio.ensure_future(http.post("/engines/1/catch_up"))
        await asyncio.to_thread(
            wait_engines, srv, lambda e: (e[1]["stale_reason"] or "").startswith("catching up"), "no catch-up"
        )
        core_0.send_signal(signal.SIGKILL)
        r = await catching_up
    assert r.status_code == 502, r.text
    assert "catch-up from engine 0 failed at exporting its weights" in r.json()["error"]["message"], r.text
    engine_1 = srv.engines()[1]
    assert engine_1["state"] == "stale" and engine_1["stale_reason"].startswith("catch-up from engine 0 failed")
    assert not srv.shm_files("catch_up")
    engines = wait_engines(srv, lambda e: e[0]["state"] == "stale", "engine 0 did not come back")
    assert "no healthy engine holds pushed-2" in engines[0]["stale_reason"], engines
    weights = pushed(srv, demo_model, tmp_path, 73, "pushed-3")
    assert [e["state"] for e in srv.engines()] == ["ready", "ready"]
    assert_engines_match(srv, model_name, demo_model, weights, "pushed-3")


async def test_with_no_healthy_peer_both_wait_for_the_next_push(peer_server, model_name, demo_model, tmp_path):
    """Both engines restarted at once: neither has a peer to copy from, so each stays stale saying
    no healthy engine holds the fleet's version; the next push brings both in."""
    srv = peer_server
    async with httpx.AsyncClient(base_url=srv.url, timeout=300) as http:
        restarts = await asyncio.gather(http.post("/engines/0/restart"), http.post("/engines/1/restart"))
    assert [r.status_code for r in restarts] == [200, 200], [r.text for r in restarts]
    engines = wait_engines(
        srv,
        lambda e: all("no healthy engine holds pushed-3" in (x["stale_reason"] or "") for x in e),
        "the engines' reasons do not say why they wait",
        timeout_s=30,
    )
    assert [e["state"] for e in engines] == ["stale", "stale"]
    assert all(e["stale_reason"].startswith("it restarted from the checkpoint on disk") for e in engines)
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": model_name, "prompt": "x", "max_tokens": 2}, timeout=60)
    assert r.status_code == 503, r.text  # held a second (--hold-requests 1), then refused: nobody serves
    weights = pushed(srv, demo_model, tmp_path, 74, "pushed-4")
    assert [e["state"] for e in srv.engines()] == ["ready", "ready"]
    assert_engines_match(srv, model_name, demo_model, weights, "pushed-4")
    assert not srv.shm_files("catch_up")
