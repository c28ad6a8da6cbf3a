"""The fleet through faults: a real trainer process killed at each phase of a weight update,
concurrent admin calls under load, weights changed behind the front's back.

Every case ends with the same three checks:
(a) every request in flight at the fault completed with its full token count, or got an
    OpenAI-shaped error (or, where the engines abort what they held, finish reason "abort");
    none is left open: each has ended within 30 s (ENDED_WITHIN_S) of the fault, or of the
    resume that lets it end;
(b) every engine serves the old or the new weights under the right label (greedy logprobs
    within 0.05 of a transformers float32 forward of those weights), or serves nothing;
(c) the next push succeeds at the first attempt.
Each case prints the time until the fleet served again (docs: benchmarks-journal, "Faults").

The engines are the shared server's; the checkpoint is pushed back afterwards. Faults that
stop or kill the server's own processes live with that server: SIGTERM mid-push in
test_shutdown, an EngineCore SIGKILLed mid-receive in test_supervision.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from pathlib import Path

import attrs
import httpx
import pytest
import torch
from safetensors.torch import load_file

from pushes import assert_engines_match, modified_weights, run_trainer, save
from support import admit_while_paused, engine_of, engine_socket, restore_fleet, scrape, sse_lines, total

pytestmark = pytest.mark.usefixtures("restores_checkpoint")

TOKENS = 32
# Check (a)'s deadline. The requests a fault touches end in seconds (completed, failed or aborted);
# one left open would wait for its 120 s HTTP timeout, one failed by a timeout of the front's would
# take a minute or more.
ENDED_WITHIN_S = 30


@attrs.define
class Fleet:
    """What the shared server serves: each case leaves it serving its last push."""

    weights: dict[str, torch.Tensor]
    label: str
    pushes: int = 0

    def next_weights(self, demo_model: Path, tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path]:
        self.pushes += 1
        weights = modified_weights(demo_model, seed=20 + self.pushes)
        return weights, save(weights, tmp_path / f"push-{self.pushes}.safetensors")


def checkpoint(demo_model: Path) -> dict[str, torch.Tensor]:
    return {n: t.float() for n, t in load_file(str(demo_model / "model.safetensors")).items()}


@pytest.fixture(scope="module")
def fleet(demo_model) -> Fleet:
    # Other modules leave the checkpoint served under the label engines give what they load.
    return Fleet(checkpoint(demo_model), "default")


def request_body(model: str, i: int, stream: bool) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"fault {i}"}],
        "max_tokens": TOKENS,
        "ignore_eos": True,
    }
    return {**body, "stream": True, "stream_options": {"include_usage": True}} if stream else body


async def chat(http: httpx.AsyncClient, body: dict) -> tuple[int, dict]:
    """One request to its end: status, outcome (finish reasons and token count, or the error)."""
    if not body.get("stream"):
        r = await http.post("/v1/chat/completions", json=body)
        payload = r.json()
        if r.status_code != 200:
            return r.status_code, payload
        return (
            200,
            {"reasons": [payload["choices"][0]["finish_reason"]], "tokens": payload["usage"]["completion_tokens"]},
        )
    reasons, tokens, error = [], None, None
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(await r.aread())
        async for line in sse_lines(r):
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            error = chunk.get("error", error)
            reasons += [c["finish_reason"] for c in chunk.get("choices", []) if c.get("finish_reason")]
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return 200, {"reasons": reasons, "tokens": tokens, "error": error}


async def ended(requests: list[asyncio.Task]) -> list[tuple[int, dict]]:
    """Each request's outcome, once every one has ended: none may still be open ENDED_WITHIN_S on
    (waited for once the fleet can end them: right after the fault, or once it is resumed)."""
    _, still_open = await asyncio.wait(requests, timeout=ENDED_WITHIN_S)
    for request in still_open:
        request.cancel()
    assert not still_open, f"{len(still_open)} of {len(requests)} requests still open {ENDED_WITHIN_S} s on"
    return [request.result() for request in requests]


def assert_ended(
    outcomes: list[tuple[int, dict]],
    aborts_allowed: bool = False,
    aborted_by_fault: bool = False,
) -> None:
    """Check (a): each request completed in full, or failed in the OpenAI shape (or, where the fault
    aborts what the engines held, ended with finish reason "abort"); ``ended`` saw none left open."""
    for status, outcome in outcomes:
        if status != 200:
            assert outcome["error"]["code"] == status and outcome["error"]["message"], outcome
        elif outcome.get("error"):
            assert outcome["error"]["message"], outcome
        else:
            assert len(outcome["reasons"]) == 1, f"a choice ended without one finish reason: {outcome}"
            aborted = outcome["reasons"] == ["abort"]
            if not (aborted and (aborted_by_fault or aborts_allowed)):
                assert outcome["reasons"] == ["length"] and outcome["tokens"] == TOKENS, outcome


async def held_requests(http: httpx.AsyncClient, model: str, n: int = 8) -> list[asyncio.Task]:
    """Requests held by a keep-pause, as a trainer holds its rollouts for a push (half streaming)."""
    return await admit_while_paused(http, (chat(http, request_body(model, i, i % 2 == 1)) for i in range(n)))


async def wait_for_states(server, wanted: set[str], timeout_s: float = 240) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while not set(states := [e["state"] for e in await asyncio.to_thread(server.engines)]) <= wanted:
        assert time.monotonic() < deadline, states
        await asyncio.sleep(0.5)
    return states


async def push_next(
    server, fleet: Fleet, demo_model, tmp_path, label: str, *trainer_args: str, paused: bool = False
) -> None:
    """Check (c) and then (b): the next push succeeds at once and every engine serves it (checked
    by the caller once it resumes the fleet, if it pushed into a paused one)."""
    weights, path = fleet.next_weights(demo_model, tmp_path)
    trainer = await asyncio.to_thread(run_trainer, server, path, label, *trainer_args)
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    fleet.weights, fleet.label = weights, label
    if not paused:
        await asyncio.to_thread(assert_engines_match, server, server.model, demo_model, weights, label)


def report(fault: str, **seconds: float) -> None:
    print(f"\nFAULT {fault}: " + ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items()))


@pytest.mark.parametrize("phase", ["init", "start"])
async def test_trainer_killed_before_any_engine_is_touched(server, model_name, demo_model, tmp_path, fleet, phase):
    """SIGKILL after /init_weight_transfer, or after /start_weight_update: no engine had begun
    receiving, so the fleet keeps the old weights; a new trainer's group replaces the dead one's
    at once (a started update it left is dropped)."""
    _, path = fleet.next_weights(demo_model, tmp_path)
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        held = await held_requests(http, model_name)
        trainer = await asyncio.to_thread(run_trainer, server, path, "never-served", "--die-at", phase)
        fault_at = time.monotonic()
        assert trainer.returncode == 9, trainer.stdout + trainer.stderr
        assert (await http.get("/weight_info")).json()["update_phase"] == ("started" if phase == "start" else "idle")
        assert (await http.post("/resume")).status_code == 200
        assert_ended(await ended(held))
        served_at = time.monotonic()
    await asyncio.to_thread(assert_engines_match, server, model_name, demo_model, fleet.weights, fleet.label)
    started = time.monotonic()
    await push_next(server, fleet, demo_model, tmp_path, f"after-{phase}-kill")
    report(f"trainer SIGKILL after {phase}", serving=served_at - fault_at, next_push=time.monotonic() - started)


async def stale_without_restart(server, http: httpx.AsyncClient, model: str, pids: list[int], fault_at: float) -> float:
    """The engines hold part-new weights: both are held out (stale) in their own processes, and a
    request gets a 503 saying why. When that was reached, after the fault."""
    states = await wait_for_states(server, {"stale"}, timeout_s=30)
    ready_at = time.monotonic()
    assert states == ["stale", "stale"] and [e["pid"] for e in server.engines()] == pids, server.engines()
    assert all(e["stale_reason"].startswith("a weight update was aborted") for e in server.engines())
    r = await http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and "weight update was aborted" in r.json()["error"]["message"], r.text
    families = scrape(server)
    for engine in ("0", "1"):
        assert total(families, "skyinfer_engine_state", "skyinfer_engine_state", engine=engine, state="stale") == 1
    assert total(families, "skyinfer_weight_update_failures", "skyinfer_weight_update_failures_total") >= 1
    return ready_at - fault_at


@pytest.mark.parametrize(
    "sent",
    [("--one-call",), ("--bucket-bytes", "16384"), ("--bucket-bytes", "16384", "--delta-from", "FLEET")],
    ids=["tensors in one call", "buckets in a session", "a delta's buckets"],
)
async def test_trainer_killed_mid_transfer_costs_no_restart(server, model_name, demo_model, tmp_path, fleet, sent):
    """SIGKILL after two tensors of a one-call push (inside each engine's one call: the push paused
    the running engines in it, began the update, and waits in the receive), or after two buckets of
    16 KiB packed of a session's push (each engine's receiving thread then waits for the third in a
    buffer it reuses, while the second is loaded): every engine holds
    part-new weights. Each ends the update in its own process (no restart), aborts what it held,
    and serves nothing (stale) until the next push, which succeeds at the first try. The recovery
    path (pause twice, push, resume with every engine stale) answers per engine and is never
    half-applied."""
    if "FLEET" in sent:  # a delta on what the fleet serves (the trainer pushes it whole first)
        sent = tuple(str(save(fleet.weights, tmp_path / "base.safetensors")) if a == "FLEET" else a for a in sent)
    _, path = fleet.next_weights(demo_model, tmp_path)
    pids = [e["pid"] for e in server.engines()]
    restarts = [e["restarts"] for e in server.engines()]
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        held = await held_requests(http, model_name)
        trainer = await asyncio.to_thread(run_trainer, server, path, "never-served", "--die-after", "2", *sent)
        fault_at = time.monotonic()
        assert trainer.returncode == 9
        assert ("sending a delta" in trainer.stdout) == ("--delta-from" in sent), trainer.stdout
        assert_ended(await ended(held), aborted_by_fault=True)
        ready_for_push = await stale_without_restart(server, http, model_name, pids, fault_at)
        for _ in range(2):
            r = await http.post("/pause", params={"mode": "keep"})
            assert r.status_code == 200 and [e["status"] for e in r.json()["engines"]] == [200, 200], r.text
        assert [(e["state"], e["paused"]) for e in server.engines()] == [("stale", True)] * 2
        await push_next(server, fleet, demo_model, tmp_path, "after-mid-transfer-kill", paused=True)
        assert [e["state"] for e in server.engines()] == ["paused", "paused"]
        assert (await http.post("/resume")).status_code == 200
    await asyncio.to_thread(assert_engines_match, server, model_name, demo_model, fleet.weights, fleet.label)
    assert [(e["pid"], e["restarts"]) for e in server.engines()] == list(zip(pids, restarts))
    report(
        f"trainer SIGKILL after two {'tensors' if '--one-call' in sent else 'buckets'}",
        ready_for_push=ready_for_push,
        serving=time.monotonic() - fault_at,
    )


async def test_trainer_killed_before_finish_aborts_the_update_within_its_timeout(
    server, model_name, demo_model, tmp_path, fleet
):
    """SIGKILL after every tensor arrived, before /finish_weight_update: the engines hold the new
    weights under no label; the update is aborted when the trainer has been silent for its
    group's timeout, without a restart, as after a break mid-transfer."""
    _, path = fleet.next_weights(demo_model, tmp_path)
    pids = [e["pid"] for e in server.engines()]
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        held = await held_requests(http, model_name)
        trainer = await asyncio.to_thread(
            run_trainer, server, path, "never-served", "--die-at", "finish", "--timeout", "3"
        )
        fault_at = time.monotonic()
        assert trainer.returncode == 9
        # The silence limit (3 s), then the abort: the held requests end with it, in seconds (check (a)).
        assert_ended(await ended(held), aborted_by_fault=True)
        # An engine aborts what it held before it answers the front's abort; the update is over once
        # every engine has answered, moments later. One left open never ends: a 30 s deadline.
        deadline = time.monotonic() + 30
        while (phase := (await http.get("/weight_info")).json()["update_phase"]) != "idle":
            assert time.monotonic() < deadline, f"the update is still {phase!r} 30 s after the held requests ended"
            await asyncio.sleep(0.05)
        ready_for_push = await stale_without_restart(server, http, model_name, pids, fault_at)
        await restore_fleet(http)
        # The trainer is not coming back: the engines load the checkpoint on disk again, in place.
        r = await http.post("/reload_weights")
        assert r.status_code == 200 and r.json()["weight_version"] == "default", r.text
    assert [(e["pid"], e["state"]) for e in server.engines()] == [(pid, "ready") for pid in pids]
    fleet.weights, fleet.label = checkpoint(demo_model), "default"
    await asyncio.to_thread(assert_engines_match, server, model_name, demo_model, fleet.weights, fleet.label)
    report("trainer SIGKILL before finish", ready_for_push=ready_for_push, serving=time.monotonic() - fault_at)
    await push_next(server, fleet, demo_model, tmp_path, "after-finish-kill")


ADMIN_CALLS = ["pause?mode=abort", "pause?mode=wait", "pause?mode=keep", "resume", "sleep", "wake_up"]


async def test_concurrent_admin_calls_under_load_are_serialised(server, model_name, demo_model, tmp_path, fleet):
    """64 requests in flight (half streaming) and 20 concurrent pause(abort|wait|keep) / resume /
    sleep / wake_up calls: each call runs whole or is refused with 409; every request ends with a
    finish reason for each choice (an abort is one); the front's view of every engine is vLLM's."""
    rng = random.Random(11)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=128)) as http:

        async def admin(call: str) -> httpx.Response:
            await asyncio.sleep(rng.random() * 2)
            path, _, query = call.partition("?")
            return await http.post(f"/{path}", params=dict([query.split("=")]) if query else None)

        requests = [asyncio.create_task(chat(http, request_body(model_name, i, i % 2 == 1))) for i in range(64)]
        calls = [rng.choice(ADMIN_CALLS) for _ in range(20)]
        answers = await asyncio.gather(*(admin(c) for c in calls))
        fault_at = time.monotonic()
        for call, r in zip(calls, answers):
            assert r.status_code in (200, 409), f"{call}: {r.status_code} {r.text}"
            if r.status_code == 409:
                assert r.json()["error"]["type"] == "ConflictError" and "engine" in r.json()["error"]["message"]
        assert {r.status_code for r in answers} == {200, 409}, "20 random admin calls were all accepted or all refused"
        # Every engine is as the front says: vLLM's own answer, asked behind the front's back.
        for engine in server.engines():
            transport = httpx.AsyncHTTPTransport(uds=engine_socket(server, engine["id"]))
            async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=30) as direct:
                vllm_says = (await direct.get("/conditions")).json()
            assert vllm_says == {"paused": engine["paused"], "sleeping": engine["sleeping"]}, engine
        await restore_fleet(http)
        assert_ended(await ended(requests), aborts_allowed=True)
        served_at = time.monotonic()
    await asyncio.to_thread(assert_engines_match, server, model_name, demo_model, fleet.weights, fleet.label)
    await push_next(server, fleet, demo_model, tmp_path, "after-admin-race")
    report("64 in flight + 20 concurrent admin calls", serving=served_at - fault_at)


async def test_pushes_are_verified_and_an_engine_holding_other_weights_is_held_out(
    server, model_name, demo_model, tmp_path, fleet
):
    """vLLM's /weight_checker over the fleet: engines are held to the checksums they agreed on at
    a verified push; one whose weights change behind the front's back (vLLM's reset, through
    its own socket) is found out and serves nothing until the next push, which goes through
    pause, pause again, push, resume with that engine stale."""
    await push_next(server, fleet, demo_model, tmp_path, "verified", "--verify")
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        checked = (await http.post("/weight_checker", json={"action": "checksum"})).json()
        assert checked["agree"] and checked["held_out"] == [] and checked["weight_version"] == "verified"
        sums = checked["checksums"]
        assert len(sums) > 10 and all(k.startswith("dp0:pp0:pcp0:tp0:") for k in sums)
        assert [e["result"]["match"] for e in checked["engines"]] == [True, True]

        # compare reports against any baseline and holds nobody out.
        changed = next(iter(sums))
        r = await http.post("/weight_checker", json={"action": "compare", "baseline": {**sums, changed: "0" * 64}})
        assert r.status_code == 200 and not r.json()["match"] and r.json()["mismatches"] == [changed]
        assert [e["state"] for e in server.engines()] == ["ready", "ready"]
        refused = await http.post("/weight_checker", json={"action": "compare"})
        assert refused.status_code == 400 and "baseline" in refused.json()["error"]["message"]

        transport = httpx.AsyncHTTPTransport(uds=engine_socket(server, 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60) as engine1:
            assert (await engine1.post("/weight_checker", json={"action": "reset"})).status_code == 200
        fault_at = time.monotonic()
        checked = (await http.post("/weight_checker", json={"action": "checksum"})).json()
        assert not checked["agree"] and checked["held_out"] == [1] and checked["checksums"] == sums
        engine0, engine1 = (e["result"] for e in checked["engines"])
        assert engine0 == {"match": True, "mismatches": []}
        # vLLM's reset zeroes every weight the model holds as a tensor. On CPU the linear layers
        # compute with packed copies, and skyinfer keeps their weights beside them
        # (engine/worker_extension.py), so the checksums see those too; the demo model's biases
        # are zeros already.
        held = {k for k, digest in sums.items() if digest != hashlib.sha256(b"").hexdigest()}
        nonzero = {k for k in held if k.endswith(("embed_tokens.weight", "norm.weight", "proj.weight"))}
        assert len(nonzero) > 6 and not engine1["match"] and nonzero <= set(engine1["mismatches"]) <= held
        assert any(k.endswith("proj.weight") for k in engine1["mismatches"])
        assert [e["state"] for e in server.engines()] == ["ready", "stale"]
        for i in range(6):
            r = await http.post(
                "/v1/completions",
                json={"model": model_name, "prompt": "who serves?", "max_tokens": 2},
                headers={"X-Session-ID": f"held-out-{i}"},
            )
            assert r.status_code == 200 and engine_of(r) == 0
        served_at = time.monotonic()

        # The recovery path with one engine stale: pause, pause again, push, resume; each call
        # answers per engine, none is half-applied.
        for _ in range(2):
            r = await http.post("/pause", params={"mode": "keep"})
            assert r.status_code == 200 and [e["status"] for e in r.json()["engines"]] == [200, 200], r.text
        assert [(e["state"], e["paused"]) for e in server.engines()] == [("paused", True), ("stale", True)]
        # A push that does not verify fails loudly, and no engine serves it.
        expect = tmp_path / "stale-checksums.json"
        expect.write_text(json.dumps(sums))
        _, path = fleet.next_weights(demo_model, tmp_path)
        failed = await asyncio.to_thread(run_trainer, server, path, "unverified", "--expect", str(expect))
        assert failed.returncode == 3 and "refused 502" in failed.stdout and "differ" in failed.stdout, failed.stdout
        assert [e["state"] for e in server.engines()] == ["stale", "stale"]
        await push_next(server, fleet, demo_model, tmp_path, "reverified", "--verify", paused=True)
        assert [e["state"] for e in server.engines()] == ["paused", "paused"]
        r = await http.post("/resume")
        assert r.status_code == 200 and [e["status"] for e in r.json()["engines"]] == [200, 200], r.text
    assert [e["state"] for e in server.engines()] == ["ready", "ready"]
    await asyncio.to_thread(assert_engines_match, server, model_name, demo_model, fleet.weights, fleet.label)
    report("one engine's weights zeroed behind the front's back", serving=served_at - fault_at)
