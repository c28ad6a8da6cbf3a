"""Colocated RL on CPU: a server started with --colocate, two real engines, trainers in processes of
their own pushing through shared memory, in the order colocated trainers step (sleep, train, wake the
weights, push, wake the KV cache), with faults at each phase.

Correctness is judged against a transformers float32 forward pass of the pushed weights (the
engines serve float32). Every fault ends with no segment of skyinfer's left in /dev/shm, no engine
restarted that did not die or hang, and the next push succeeding at the first try.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import time
from pathlib import Path

import attrs
import httpx
import pytest
import torch

from forked_python import run_python
from pushes import (
    assert_engines_match,
    modified_weights,
    push_more,
    run_trainer,
    save,
    start_trainer,
    two_pushes_into_one_segment,
)
from support import (
    ServerProcess,
    admit_while_paused,
    engine_socket,
    is_openai_error,
    module_servers,
    run_example,
    sse_lines,
    vllm_process,
)

SKYRL_CLIENT = Path(__file__).with_name("skyrl_client.py")
ABORTED = "a weight update was aborted"


def _launch(demo_model: Path, logs: Path) -> ServerProcess:
    return ServerProcess(
        demo_model,
        engines=2,
        log_path=logs / "server.log",
        # float32 for logprobs compared with transformers' float32 forward; a short transfer
        # timeout for the hung-engine case; probes fast enough for a test.
        extra_args=(
            "--colocate",
            "--dtype",
            "float32",
            "--weight-transfer-timeout",
            "8",
            "--health-interval",
            "1",
            "--health-timeout",
            "4",
            # A request no engine can serve (stale after a level-2 sleep) is answered after a second.
            "--hold-requests",
            "1",
        ),
    )


colocated = module_servers(__name__, _launch)


@attrs.define
class Pushes:
    demo_model: Path
    directory: Path
    count: int = 0

    def next(self) -> tuple[dict[str, torch.Tensor], Path, str]:
        """New weights, saved for a trainer process, and the version they are pushed as."""
        self.count += 1
        weights = modified_weights(self.demo_model, seed=40 + self.count)
        return weights, save(weights, self.directory / f"push-{self.count}.safetensors"), f"colocated-{self.count}"


@pytest.fixture(scope="module")
def pushes(demo_model, tmp_path_factory) -> Pushes:
    return Pushes(demo_model, tmp_path_factory.mktemp("pushes"))


def engines(server) -> list[dict]:
    return server.engines()


def residency(server) -> list[tuple]:
    return [(e["state"], e["sleep_level"], e["asleep"]) for e in engines(server)]


def vllm_conditions(server) -> list[dict]:
    """What each engine's vLLM says of itself, asked on the engine's own socket."""
    said = []
    for e in engines(server):
        with httpx.Client(
            transport=httpx.HTTPTransport(uds=engine_socket(server, e["id"])), base_url="http://e"
        ) as own:
            said.append(own.get("/conditions", timeout=30).json())
    return said


def admin(server, path: str, **params) -> dict:
    r = httpx.post(f"{server.url}{path}", params=params, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def colocated_push(server, path: Path, version: str, *extra: str, level: int = 1) -> subprocess.CompletedProcess:
    """A trainer process's colocated step: sleep (unless asleep), wake the weights, push, wake the KV cache."""
    return run_trainer(server, path, version, "--transport", "shm", "--colocated-step", str(level), *extra)


def wait_until(predicate, timeout_s: float = 240, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.5)
    return value


def test_skyrl_colocated_syncs_at_levels_1_and_2_say_what_vllm_says(colocated, demo_model, pushes):
    """SkyRL's RemoteInferenceClient steps as SkyRL's colocated trainer does, with a push from a
    trainer process of its own between the two wake-ups, at sleep level 1 and then 2: after each
    call every engine's reported state matches vLLM's own is_sleeping, and after the last both
    engines serve the pushed weights."""
    sockets = ",".join(engine_socket(colocated, e["id"]) for e in engines(colocated))
    for level in (1, 2):
        weights, path, version = pushes.next()
        done = run_python(
            [
                SKYRL_CLIENT,
                colocated.url,
                colocated.model,
                "--colocated",
                str(level),
                str(path),
                version,
                sockets,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        steps = json.loads(done.stdout.strip().splitlines()[-1])
        for step in steps:
            reported = [(e["paused"], e["sleeping"]) for e in step["engines"]]
            assert reported == [(v["paused"], v["sleeping"]) for v in step["vllm"]], step
            assert step["skyrl_is_sleeping"] == any(v["sleeping"] for v in step["vllm"])
        states = {
            s["after"]: [(e["state"], e["sleep_level"], e["asleep"], e["stale_reason"]) for e in s["engines"]]
            for s in steps
        }
        discarded = "a level-2 sleep discarded its weights: push weights before it serves" if level == 2 else None
        assert states == {
            "sleep": [("sleeping", level, ["kv_cache", "weights"], discarded)] * 2,
            "wake_up weights": [("sleeping", level, ["kv_cache"], discarded)] * 2,
            "push": [("sleeping", level, ["kv_cache"], None)] * 2,
            "wake_up kv_cache": [("ready", None, [], None)] * 2,
        }, states
        assert [e["weight_version"] for e in steps[-1]["engines"]] == [version, version]
        assert_engines_match(colocated, colocated.model, demo_model, weights, version)
    assert not colocated.shm_files()


def test_a_level_2_wake_without_a_push_serves_nothing_and_says_why(colocated, demo_model, pushes):
    admin(colocated, "/sleep", level="2")
    admin(colocated, "/wake_up")
    assert [c["sleeping"] for c in vllm_conditions(colocated)] == [False, False]
    assert residency(colocated) == [("stale", None, [])] * 2
    r = httpx.post(
        f"{colocated.url}/v1/completions", json={"model": colocated.model, "prompt": "x", "max_tokens": 2}, timeout=30
    )
    assert (
        r.status_code == 503
        and is_openai_error(r)
        and "level-2 sleep discarded its weights" in r.json()["error"]["message"]
    )
    assert "held 1s" in r.json()["error"]["message"] and int(r.headers["Retry-After"]) > 0
    info = httpx.get(f"{colocated.url}/weight_info", timeout=30).json()
    assert all("level-2 sleep" in e["stale_reason"] for e in info["engines"])
    assert httpx.get(f"{colocated.url}/ready", timeout=30).status_code == 503
    # The push that was missing: into engines that are up and running (stale), which it pauses for itself.
    weights, path, version = pushes.next()
    trainer = run_trainer(colocated, path, version, "--transport", "shm")
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    assert residency(colocated) == [("ready", None, [])] * 2
    assert_engines_match(colocated, colocated.model, demo_model, weights, version)


@pytest.mark.parametrize("staged", [(), ("--staged",)], ids=["pausing", "staged"])
async def test_a_push_into_running_engines_holds_their_requests(colocated, demo_model, pushes, staged):
    """Neither paused nor asleep: the push pauses the engines (keep) for itself, for the whole
    transfer or (staged) for the swap alone, the engines having copied the segment while they
    generated; so 32 requests in flight (half streamed chats, half token-route requests) all
    complete in full, across the new version, no EngineCore dies and no segment is left."""
    before = [(e["pid"], e["restarts"]) for e in engines(colocated)]
    old_version = engines(colocated)[0]["weight_version"]
    # Long enough to be still generating when the update call, made once every stream has its first
    # tokens, reaches the engines.
    tokens = 800
    chat = {
        "model": colocated.model,
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    weights, path, version = pushes.next()
    # The trainer's process is up, its segment written, before the requests start (its start-up takes
    # seconds on a busy machine): its update call is made once they generate.
    trainer = start_trainer(colocated, path, version, "--transport", "shm", "--hold-before-update", *staged)
    try:
        assert (await asyncio.to_thread(trainer.stdout.readline)).strip() == "before update"
        async with httpx.AsyncClient(base_url=colocated.url, timeout=300) as http:
            streaming = [asyncio.Event() for _ in range(16)]

            async def streamed(i: int) -> tuple[list[str], int]:
                reasons, used = [], 0
                body = {**chat, "messages": [{"role": "user", "content": f"stream {i}"}]}
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in sse_lines(r):
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            assert "error" not in chunk, chunk
                            streaming[i].set()
                            reasons += [c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")]
                            used = (chunk.get("usage") or {}).get("completion_tokens", used)
                return reasons, used

            async def generated(i: int) -> dict:
                r = await http.post(
                    "/inference/v1/generate",
                    json={"token_ids": [7 + i, 8, 9], "sampling_params": {"max_tokens": tokens, "ignore_eos": True}},
                )
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]

            tasks = [asyncio.create_task(streamed(i)) for i in range(16)] + [
                asyncio.create_task(generated(i)) for i in range(16)
            ]
            await asyncio.wait_for(asyncio.gather(*(started.wait() for started in streaming)), 120)
            assert not any(task.done() for task in tasks), "a request ended before the push"
            trainer.stdin.write("go\n")
            trainer.stdin.flush()
            out, err = await asyncio.to_thread(trainer.communicate, timeout=180)
            assert trainer.returncode == 0, out + err
            results = await asyncio.wait_for(asyncio.gather(*tasks), 240)
    finally:
        trainer.kill()
    for reasons, used in results[:16]:
        assert (reasons, used) == (["length"], tokens)
    spans = [[s["version"] for s in choice["weight_versions"]] for choice in results[16:]]
    assert all(len(choice["token_ids"]) == tokens for choice in results[16:])
    assert any(s == [old_version, version] for s in spans), spans  # ran across the push
    assert [(e["pid"], e["restarts"]) for e in engines(colocated)] == before
    assert residency(colocated) == [("ready", None, [])] * 2
    assert not colocated.shm_files()
    assert_engines_match(colocated, colocated.model, demo_model, weights, version)


async def test_a_slow_trainer_waiting_for_the_fleet_is_not_aborted(colocated, demo_model, pushes):
    """The trainer's silence limit is 3 s. Between its start and update calls a wait-mode pause
    takes the fleet while 16 long requests drain, and its update call waits behind it for longer
    than the limit; then the requests are aborted, which ends the drain. The trainer was there all
    along: its push is not aborted, and lands. (Shared memory: no collective whose own timeout would
    end a transfer that waits.)"""
    weights, path, version = pushes.next()
    # 16 requests of 4,000 tokens (the model's context is 4,096): a drain of several seconds on a
    # fast day, cut short once it has held the update call past the limit (a drain left to its end
    # took longer than the front's engine call, 8 s here, on a slow one).
    body = {"model": colocated.model, "prompt": "drain slowly", "max_tokens": 4000, "ignore_eos": True}
    trainer = start_trainer(colocated, path, version, "--transport", "shm", "--hold-before-update", "--timeout", "3")
    try:
        async with httpx.AsyncClient(base_url=colocated.url, timeout=300) as http:
            draining = await admit_while_paused(
                http, (http.post("/v1/completions", json={**body, "prompt": f"drain {i}"}) for i in range(16))
            )
            assert (await asyncio.to_thread(trainer.stdout.readline)).strip() == "before update"
            assert (await http.post("/resume")).status_code == 200
            pausing = asyncio.create_task(http.post("/pause", params={"mode": "wait"}))
            await asyncio.sleep(0.5)
            assert not pausing.done(), "the requests drained at once: the pause held nothing up"
            trainer.stdin.write("go\n")
            trainer.stdin.flush()
            # The trainer makes its update call as it reads "go", and prints a line once the call
            # returns. A second past the 3 s silence limit, no line yet: the call is still waiting
            # behind the pause, longer than the limit (seen while it waits, not timed afterwards).
            returned = asyncio.ensure_future(asyncio.to_thread(trainer.stdout.readline))
            await asyncio.sleep(3 + 1)
            assert not returned.done(), f"the update call ended within the silence limit: {returned.result()!r}"
            assert not pausing.done(), "the drain ended before the limit: the update call waited on nothing"
            assert (await http.post("/abort_requests", json={})).json()["aborted"] == 16
            took = await asyncio.wait_for(returned, 300)
            out, err = await asyncio.to_thread(trainer.communicate, timeout=300)
            assert trainer.returncode == 0, took + out + err
            assert took.startswith("update took "), took
            assert (await pausing).status_code == 200
            for r in await asyncio.gather(*draining):
                choice = r.json()["choices"][0]
                assert r.status_code == 200 and choice["finish_reason"] == "abort", r.text
                assert 0 < r.json()["usage"]["completion_tokens"] < 4000, r.text
            assert (await http.post("/resume")).status_code == 200
    finally:
        trainer.kill()
    assert not colocated.shm_files()
    await asyncio.to_thread(assert_engines_match, colocated, colocated.model, demo_model, weights, version)


def test_bad_transfer_metadata_is_refused_before_any_engine_touches_a_weight(colocated, demo_model):
    prefix = httpx.post(f"{colocated.url}/init_weight_transfer", json={"init_info": {}}, timeout=60).json()[
        "segment_prefix"
    ]
    small = Path(f"/dev/shm/{prefix}{'a' * 32}")
    small.write_bytes(b"\0" * 1024)
    # /weight_info names the prefix /init_weight_transfer answered: the leftover checks go by it.
    assert colocated.shm_files("pushes") == colocated.shm_files() == [str(small)]
    norm = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[128]]}
    state_before = [(e["state"], e["weight_version"], e["pid"]) for e in engines(colocated)]
    cases = {
        "path in the name": ({**norm, "segment": "../../etc/passwd", "offsets": [0]}, "update_info.segment"),
        "slash in the name": ({**norm, "segment": f"{prefix}x/y", "offsets": [0]}, "update_info.segment"),
        "another server's": (
            {**norm, "segment": f"skyinfer-00000000-{'b' * 32}", "offsets": [0]},
            "update_info.segment",
        ),
        "missing": ({**norm, "segment": f"{prefix}{'c' * 32}", "offsets": [0]}, "update_info.segment"),
        "past the end": ({**norm, "segment": small.name, "offsets": [768]}, "update_info.segment"),
        "misaligned": ({**norm, "segment": small.name, "offsets": [2]}, "update_info"),
        "offsets missing": ({**norm, "segment": small.name}, "update_info.offsets"),
        "wrong shape": ({**norm, "shapes": [[7]], "segment": small.name, "offsets": [0]}, None),
        "wrong dtype": ({**norm, "dtype_names": ["int8"], "segment": small.name, "offsets": [0]}, None),
        "unknown tensor": ({**norm, "names": ["model.no_such.weight"], "segment": small.name, "offsets": [0]}, None),
    }
    try:
        for case, (update_info, param) in cases.items():
            r = httpx.post(f"{colocated.url}/update_weights", json={"update_info": update_info}, timeout=60)
            assert r.status_code == 400 and is_openai_error(r), (case, r.text)
            assert r.json()["error"]["param"] == param, (case, r.text)
        assert small.exists(), "a refused update removed a segment it had not accepted"
    finally:
        small.unlink()
    info = httpx.get(f"{colocated.url}/weight_info", timeout=30).json()
    assert info["update_phase"] == "idle" and not any(e["receiving"] for e in info["engines"])
    assert [(e["state"], e["weight_version"], e["pid"]) for e in engines(colocated)] == state_before


def test_fuzzed_shared_memory_updates_are_4xx_and_change_nothing(colocated):
    """Mutants of a valid shared-memory update, with the engines out of any transfer: each is a 4xx
    in the OpenAI shape (400 for what the checks refuse, 409 for the rest), nothing changes."""
    from test_fuzz import bodies

    prefix = httpx.post(f"{colocated.url}/init_weight_transfer", json={"init_info": {}}, timeout=60).json()[
        "segment_prefix"
    ]
    assert httpx.post(f"{colocated.url}/shutdown_weight_transfer_engine", timeout=60).status_code == 200
    segment = Path(f"/dev/shm/{prefix}{'d' * 32}")
    segment.write_bytes(b"\0" * 4096)
    seed = {
        "update_info": {
            "names": ["model.norm.weight", "model.layers.0.input_layernorm.weight"],
            "dtype_names": ["float32", "float32"],
            "shapes": [[128], [128]],
            "segment": segment.name,
            "offsets": [0, 512],
        },
        "weight_version": "fuzzed",
    }
    before = [(e["state"], e["weight_version"], e["pid"]) for e in engines(colocated)]
    statuses: dict[int, int] = {}
    try:
        with httpx.Client(base_url=colocated.url, timeout=60) as http:
            for body in bodies(300, [seed], random.Random(29)):
                r = http.post("/update_weights", content=body, headers={"Content-Type": "application/json"})
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                assert 400 <= r.status_code < 500 and is_openai_error(r), (body, r.status_code, r.text)
    finally:
        segment.unlink(missing_ok=True)
    assert 400 in statuses and 409 in statuses, statuses
    assert [(e["state"], e["weight_version"], e["pid"]) for e in engines(colocated)] == before


@pytest.mark.parametrize("phase", ["segment", "update", "finish"])
def test_a_trainer_killed_mid_push_costs_no_restart_and_leaves_no_segment(colocated, demo_model, pushes, phase):
    """The trainer dies after writing its segment and before /update_weights, while that call is in
    flight, or before /finish_weight_update, inside a colocated step (engines asleep, weights awake).
    No engine restarts; the engines either never began (and serve as before) or are held out as
    stale; no segment is left; the next trainer's push succeeds at the first try."""
    before = [(e["pid"], e["restarts"]) for e in engines(colocated)]
    _, path, version = pushes.next()
    dead = colocated_push(colocated, path, version, "--die-at", phase, "--timeout", "3")
    fault_at = time.monotonic()
    assert dead.returncode == 9, dead.stdout + dead.stderr
    # The trainer's 3 s silence limit ends the update in seconds; one left open never ends. Deadlines
    # of 30 s: generous on a busy machine.
    wait_until(lambda: httpx.get(f"{colocated.url}/weight_info", timeout=30).json()["update_phase"] == "idle", 30)
    wait_until(lambda: not colocated.shm_files(), 30, "a segment of skyinfer's is left in /dev/shm")
    settled = time.monotonic() - fault_at
    assert [(e["pid"], e["restarts"]) for e in engines(colocated)] == before
    stale = [e["stale_reason"] for e in engines(colocated)]
    if phase == "segment":
        assert stale == [None, None]  # no engine had begun the update
    else:
        assert all(reason and reason.startswith(ABORTED) for reason in stale), stale
    assert residency(colocated) == [("sleeping", 1, ["kv_cache"])] * 2
    weights, path, version = pushes.next()
    trainer = colocated_push(colocated, path, version)
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    assert_engines_match(colocated, colocated.model, demo_model, weights, version)
    assert not colocated.shm_files()
    print(f"\nFAULT colocated trainer SIGKILL at {phase}: settled {settled:.1f}s")


def test_a_trainer_writes_every_push_into_the_segment_it_made_once(colocated, demo_model, pushes):
    """One trainer process pushes three times. Its first push makes its segment; the second writes
    other weights into the same file (same name, same inode), which the server left in place and
    every engine serves exactly (the engines' workers kept their mapping of it). A new init removes
    it (a trainer starting over); the trainer's next push makes another and lands exactly. The
    trainer's exit removes the last one."""
    trainer, segment = two_pushes_into_one_segment(colocated, demo_model, pushes, "shm")
    try:
        # Another trainer's init: the server removes every segment of its trainers.
        admin_post = httpx.post(f"{colocated.url}/init_weight_transfer", json={"init_info": {}}, timeout=120)
        assert admin_post.status_code == 200, admin_post.text
        assert not colocated.shm_files("pushes")
        weights, path, version = pushes.next()
        push_more(trainer, path, version)
        [remade] = colocated.shm_files("pushes")
        assert remade != segment
        assert_engines_match(colocated, colocated.model, demo_model, weights, version)
        trainer.stdin.close()
        assert trainer.wait(60) == 0, trainer.stderr.read()
    finally:
        trainer.kill()
    assert not colocated.shm_files("pushes")


def test_engines_hung_or_killed_while_the_fleet_sleeps_come_back_in_its_state(colocated, demo_model, pushes):
    """The fleet asleep (level 1) with its weights awake. Engine 1's EngineCore stops (SIGSTOP)
    right before the trainer's update call: the push times out on it and fails; engine 0 ends the
    update in its own process and is held out; engine 1, which cannot end it, is restarted (kept
    stopped until then). While
    it restarts, engine 0's EngineCore is SIGKILLed. Both come back as new processes asleep with
    their weights awake, as the fleet is, from the checkpoint on disk (stale), vLLM's own state
    saying the same, never serving meanwhile; the next push covers both."""
    admin(colocated, "/sleep", level="1")
    admin(colocated, "/wake_up", tags="weights")
    pid0, pid1 = (e["pid"] for e in engines(colocated))
    core = vllm_process(pid1, "EngineCore")
    try:
        _, path, version = pushes.next()
        failed = run_trainer(colocated, path, version, "--transport", "shm", "--stop-before-update", str(core.pid))
        assert failed.returncode == 3 and "refused 504" in failed.stdout, failed.stdout + failed.stderr
        assert engines(colocated)[0]["pid"] == pid0 and engines(colocated)[0]["stale_reason"].startswith(ABORTED)
        wait_until(lambda: engines(colocated)[1]["pid"] != pid1, 60, "engine 1 was not restarted")
    finally:
        if core.is_running():
            core.send_signal(signal.SIGCONT)
    vllm_process(pid0, "EngineCore").send_signal(signal.SIGKILL)
    fault_at = time.monotonic()
    wait_until(
        lambda: all(e["pid"] not in (pid0, pid1) and e["state"] == "sleeping" for e in engines(colocated)),
        240,
        "no restart",
    )
    restarted_in = time.monotonic() - fault_at
    assert residency(colocated) == [("sleeping", 1, ["kv_cache"])] * 2
    assert all(e["stale_reason"].startswith("it restarted from the checkpoint on disk") for e in engines(colocated))
    assert [c["sleeping"] for c in vllm_conditions(colocated)] == [True, True]
    assert not colocated.shm_files()
    weights, path, version = pushes.next()
    trainer = colocated_push(colocated, path, version)
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    assert residency(colocated) == [("ready", None, [])] * 2
    assert_engines_match(colocated, colocated.model, demo_model, weights, version)
    print(f"\nFAULT EngineCore SIGKILL while asleep: back asleep in {restarted_in:.1f}s")


def test_the_colocated_rl_loop_example(colocated):
    done = run_example("rl_loop.py", "--url", colocated.url, "--iterations", "3", "--colocate")
    lines = done.stdout.strip().splitlines()
    assert sum(line.startswith("iter ") and "wake+push" in line for line in lines) == 3
    summary = json.loads(lines[-1])
    assert summary["versions_seen"][1:] == [["step-1"], ["step-2"]] and summary["final_version"] == "step-3"
    info = httpx.get(f"{colocated.url}/weight_info", timeout=30).json()
    assert [e["weight_version"] for e in info["engines"]] == ["step-3", "step-3"]
    assert residency(colocated) == [("ready", None, [])] * 2
    assert not colocated.shm_files()
