"""Staged pushes on real engines: the engines receive a push into staging copies while they
generate, and pause only for the swap; a fault while staging costs the live weights nothing.

Two float32 engines of the demo model, a trainer in its own process (tests/trainer_process.py)
pushing with ``GlooTrainer.push(..., staged=True)``. The colocated (shared-memory) case is in
test_colocated.py, with that module's server.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from pushes import assert_engines_match, fleet_checksums, modified_weights, run_trainer, save, start_trainer
from support import ServerProcess, engine_socket, module_servers, sse_lines, two_float32_engines, vllm_process

# Tokens each request in flight generates: enough to be running across the push.
TOKENS = 1200


def _launch(demo_model: Path, logs: Path) -> ServerProcess:
    # A trainer that hangs holds the collective this long before the group's own timeout ends it.
    return two_float32_engines(demo_model, logs / "server.log", "--weight-transfer-timeout", "60")


staged_server = module_servers(__name__, _launch)


def engines(server) -> list[dict]:
    return server.engines()


def wait_engines(server, predicate, what: str, timeout_s: float = 240) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while not predicate(found := engines(server)):
        assert time.monotonic() < deadline, f"{what}: {found}"
        time.sleep(0.2)
    return found


def wait_update_idle(server, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while (info := weight_info(server))["update_phase"] != "idle":
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    return info


@pytest.fixture(scope="module")
def fleet(demo_model) -> dict:
    """The weights the module's server serves, as the tests push them: version and tensors."""
    return {"version": "default", "weights": demo_weights(demo_model)}


def next_staged_push_lands(server, demo_model, fleet: dict, tmp_path, seed: int, version: str) -> None:
    """A new trainer process's staged push lands at its first try, on every engine."""
    new = modified_weights(demo_model, seed=seed)
    pushed = run_trainer(server, save(new, tmp_path / "next.safetensors"), version, "--staged")
    assert pushed.returncode == 0 and f"pushed {version}" in pushed.stdout, pushed.stdout + pushed.stderr
    assert_engines_match(server, server.model, demo_model, new, version)
    fleet.update(version=version, weights=new)


async def hanging_staged_push(server, path, version: str):
    """A trainer process that sends 3 tensors of a staged push and hangs, holding the transfer open
    for its group's timeout (20 s: the silence that abandons its update, and what a receive the
    engines dropped stays blocked in)."""
    trainer = start_trainer(server, path, version, "--staged", "--hang-after", "3", "--timeout", "20")
    line = await asyncio.wait_for(asyncio.to_thread(trainer.stdout.readline), 120)
    assert line.strip() == "hanging", line + trainer.stderr.read()
    return trainer


def weight_info(server) -> dict:
    return httpx.get(f"{server.url}/weight_info", timeout=60).json()


def demo_weights(demo_model) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
    weights = {name: t.clone() for name, t in model.state_dict().items()}
    weights.pop("lm_head.weight", None)
    return weights


def forward_logprobs(demo_model, weights: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Next-token logprobs at every position of ``ids``: a transformers float32 forward over the whole prefix."""
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


async def generate(http: httpx.AsyncClient, i: int, prompt: list[int] | None = None, max_tokens: int = TOKENS) -> dict:
    """A greedy token-route request with its logprobs, on the engine of session ``i``."""
    body = {
        "token_ids": prompt or [11 + i, 12, 13, 14],
        "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "logprobs": 0},
    }
    r = await http.post("/inference/v1/generate", json=body, headers={"X-Session-ID": f"staged-{i}"})
    assert r.status_code == 200, r.text
    return {"prompt": body["token_ids"], **r.json()["choices"][0]}


async def stream_to_its_end(http: httpx.AsyncClient, model: str, i: int) -> list[str]:
    """A streamed completion's finish reasons."""
    body = {"model": model, "prompt": f"stream {i}", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    reasons = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in sse_lines(r):
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                reasons += [c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")]
    return reasons


async def test_a_staged_push_under_32_requests_serves_the_new_weights_from_one_step_boundary_on(
    staged_server, demo_model, fleet, tmp_path
):
    """16 streams and 16 token-route requests run while a trainer process pushes staged. Every
    request goes on to its end; its spans say where the new weights began; every token from
    there on has the logprob a transformers float32 forward of the new weights over the whole
    prefix gives (the KV recomputed), every token before it the old weights'."""
    before = [(e["pid"], e["restarts"]) for e in engines(staged_server)]
    old_version, old = fleet["version"], fleet["weights"]
    assert {e["weight_version"] for e in weight_info(staged_server)["engines"]} == {old_version}
    new = modified_weights(demo_model, seed=5)
    path = save(new, tmp_path / "staged.safetensors")
    async with httpx.AsyncClient(base_url=staged_server.url, timeout=300) as http:
        streams = [asyncio.create_task(stream_to_its_end(http, staged_server.model, i)) for i in range(16)]
        requests = [asyncio.create_task(generate(http, i)) for i in range(16)]
        await asyncio.sleep(0.5)
        trainer = await asyncio.to_thread(run_trainer, staged_server, path, "staged-1", "--staged")
        assert trainer.returncode == 0, trainer.stdout + trainer.stderr
        # What the engines serve from here on, whatever this test finds below: the next tests start from it.
        fleet.update(version="staged-1", weights=new)
        results = await asyncio.wait_for(asyncio.gather(*requests), 240)
        ended = await asyncio.wait_for(asyncio.gather(*streams), 240)
    assert [(e["pid"], e["restarts"]) for e in engines(staged_server)] == before
    assert ended == [["length"]] * 16
    crossed = 0
    for choice in results:
        assert len(choice["token_ids"]) == TOKENS
        spans = choice["weight_versions"]
        assert [s["version"] for s in spans] in ([old_version, "staged-1"], ["staged-1"], [old_version]), spans
        boundary = spans[-1]["start"] if spans[-1]["version"] == "staged-1" else TOKENS
        crossed += 0 < boundary < TOKENS
        ids = choice["prompt"] + choice["token_ids"]
        got = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        prompt = len(choice["prompt"])
        before_push = forward_logprobs(demo_model, old, ids)
        after_push = forward_logprobs(demo_model, new, ids)
        for k, token in enumerate(choice["token_ids"]):
            reference = (after_push if k >= boundary else before_push)[prompt - 1 + k, token].item()
            assert abs(got[k] - reference) < 0.05, f"token {k} (boundary {boundary}): {got[k]} vs {reference}"
    assert crossed, "no request ran across the push"
    assert_engines_match(staged_server, staged_server.model, demo_model, new, "staged-1")


async def test_a_trainer_killed_mid_staging_costs_the_live_weights_nothing_and_the_next_push_lands(
    staged_server, demo_model, fleet, tmp_path
):
    """A trainer hangs after 3 tensors of a staged push. Meanwhile the engines serve on, at the old
    version, and /engines shows each one's staging copy being received. It is SIGKILLed: every copy
    is dropped, no engine restarted or stale, the live weights are the old ones exactly; a new
    trainer's staged push lands at its first try."""
    before = [(e["pid"], e["restarts"]) for e in engines(staged_server)]
    doomed = save(modified_weights(demo_model, seed=6), tmp_path / "doomed.safetensors")
    trainer = await hanging_staged_push(staged_server, doomed, "never-served")
    try:
        staging = wait_engines(staged_server, lambda es: all(e["staging"] for e in es), "staging shown")
        assert [e["staging"]["state"] for e in staging] == ["receiving", "receiving"]
        assert all(e["staging"]["bytes_expected"] > 0 for e in staging)
        assert weight_info(staged_server)["update_phase"] == "staging"
        r = httpx.post(
            f"{staged_server.url}/v1/completions",
            json={"model": staged_server.model, "prompt": "still serving?", "max_tokens": 8},
            timeout=60,
        )
        assert r.status_code == 200 and r.headers["X-Weight-Version"] == fleet["version"], r.text
    finally:
        trainer.kill()
        trainer.wait()
    info = wait_update_idle(staged_server)
    assert [(e["engine"], e["stale_reason"], e["weight_version"]) for e in info["engines"]] == [
        (0, None, fleet["version"]),
        (1, None, fleet["version"]),
    ]
    assert [(e["pid"], e["restarts"], e["staging"]) for e in engines(staged_server)] == [(*b, None) for b in before]
    assert_engines_match(staged_server, staged_server.model, demo_model, fleet["weights"], fleet["version"])

    next_staged_push_lands(staged_server, demo_model, fleet, tmp_path, seed=7, version="staged-2")


async def test_an_engine_core_killed_mid_staging_costs_only_that_engine(staged_server, demo_model, fleet, tmp_path):
    """Engine 1's EngineCore is SIGKILLed while a staged push is being received. The push is
    dropped: engine 0 keeps its process and its live weights, serving the old version throughout;
    engine 1 restarts and takes the fleet's weights from engine 0; the next staged push lands."""
    before = engines(staged_server)
    doomed = save(modified_weights(demo_model, seed=8), tmp_path / "doomed.safetensors")
    trainer = await hanging_staged_push(staged_server, doomed, "never-served")
    try:
        wait_engines(staged_server, lambda es: all(e["staging"] for e in es), "staging shown")
        vllm_process(before[1]["pid"], "EngineCore").send_signal(signal.SIGKILL)
        info = wait_update_idle(staged_server)
        assert info["engines"][0]["stale_reason"] is None
        assert info["engines"][0]["weight_version"] == fleet["version"]
    finally:
        trainer.kill()
        trainer.wait()
    back = wait_engines(
        staged_server,
        lambda es: [e["state"] for e in es] == ["ready", "ready"] and es[1]["restarts"] == before[1]["restarts"] + 1,
        "engine 1 back, caught up",
    )
    assert (back[0]["pid"], back[0]["restarts"]) == (before[0]["pid"], before[0]["restarts"])
    assert [e["weight_version"] for e in weight_info(staged_server)["engines"]] == [fleet["version"]] * 2
    assert_engines_match(staged_server, staged_server.model, demo_model, fleet["weights"], fleet["version"])

    next_staged_push_lands(staged_server, demo_model, fleet, tmp_path, seed=9, version="staged-3")


async def test_an_engine_restarted_between_staging_and_the_swap_costs_only_that_engine(
    staged_server, demo_model, fleet, tmp_path
):
    """Every chunk of a staged push is staged on both engines; then engine 1's EngineCore is
    SIGKILLed, and the trainer finishes once engine 1 is back: /engines shows its new process with
    no staging copy; the finish swaps the push in on engine 0, which never stops serving and is
    never stale; engine 1, left behind, catches up with the new version from engine 0. Both then
    serve it exactly."""
    before = engines(staged_server)
    new = modified_weights(demo_model, seed=10)
    trainer = start_trainer(
        staged_server, save(new, tmp_path / "new.safetensors"), "swapped-alone", "--staged", "--hold-before-finish"
    )
    try:
        line = await asyncio.wait_for(asyncio.to_thread(trainer.stdout.readline), 120)
        assert line.strip() == "before finish", line + trainer.stderr.read()
        staged = engines(staged_server)
        assert [e["staging"]["state"] for e in staged] == ["staged", "staged"], staged
        vllm_process(before[1]["pid"], "EngineCore").send_signal(signal.SIGKILL)
        back = wait_engines(
            staged_server,
            lambda es: es[1]["pid"] != before[1]["pid"] and es[1]["state"] in ("ready", "stale"),
            "engine 1 back",
        )
        assert back[1]["staging"] is None, back[1]  # a new process holds no copy
        assert back[0]["staging"]["state"] == "staged"
        trainer.stdin.write("finish\n")
        trainer.stdin.flush()
        out, err = await asyncio.to_thread(trainer.communicate, timeout=120)
        assert trainer.returncode == 0 and "pushed swapped-alone" in out, out + err
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    info = weight_info(staged_server)
    assert info["engines"][0]["stale_reason"] is None and info["engines"][0]["weight_version"] == "swapped-alone"
    caught_up = wait_engines(
        staged_server,
        lambda es: (
            [e["state"] for e in es] == ["ready", "ready"]
            and [e["weight_version"] for e in es] == ["swapped-alone"] * 2
        ),
        "engine 1 caught up with the swapped version",
    )
    assert (caught_up[0]["pid"], caught_up[0]["restarts"]) == (before[0]["pid"], before[0]["restarts"])
    assert_engines_match(staged_server, staged_server.model, demo_model, new, "swapped-alone")
    fleet.update(version="swapped-alone", weights=new)


def kept_kv_logprobs(demo_model, old, new, ids: list[int], first_new: int) -> torch.Tensor:
    """Next-token logprobs from position ``first_new`` on, as an engine that kept its KV computes
    them: positions before it hold the old weights' keys and values, the rest the new weights'."""
    models = []
    for weights in (old, new):
        model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
        model.load_state_dict(weights, strict=False)
        model.tie_weights()
        models.append(model)
    with torch.no_grad():
        kept = models[0](torch.tensor([ids[:first_new]]), use_cache=True).past_key_values
        return models[1](torch.tensor([ids[first_new:]]), past_key_values=kept).logits[0].float().log_softmax(-1)


async def test_a_staged_push_that_keeps_the_kv_goes_on_over_the_old_keys_and_values(
    staged_server, demo_model, fleet, tmp_path
):
    """With kv "keep", the requests running across the push are not recomputed: every token from
    the boundary on has the logprob of the new weights attending over the old weights' keys and
    values of the tokens before it (checked against transformers with the old model's cache), and
    a request sent after the push on the same engine, whose prompt is one of those requests' prompt
    and output, is computed whole by the new weights: no prefix the old weights cached is reused."""
    old_version, old = fleet["version"], fleet["weights"]
    new = modified_weights(demo_model, seed=10)
    path = save(new, tmp_path / "kept.safetensors")
    async with httpx.AsyncClient(base_url=staged_server.url, timeout=300) as http:
        requests = [asyncio.create_task(generate(http, i)) for i in range(16)]
        await asyncio.sleep(0.5)
        trainer = await asyncio.to_thread(run_trainer, staged_server, path, "kept-1", "--staged", "--kv", "keep")
        assert trainer.returncode == 0, trainer.stdout + trainer.stderr
        # What the engines serve from here on, whatever this test finds below: the next tests start from it.
        fleet.update(version="kept-1", weights=new)
        results = await asyncio.wait_for(asyncio.gather(*requests), 240)
        first = results[0]
        after = await generate(http, 0, first["prompt"] + first["token_ids"][:600], max_tokens=32)
    crossed = 0
    for choice in results:
        spans = choice["weight_versions"]
        if [s["version"] for s in spans] != [old_version, "kept-1"]:
            continue
        crossed += 1
        boundary = spans[-1]["start"]
        ids = choice["prompt"] + choice["token_ids"]
        prompt = len(choice["prompt"])
        # The new weights' first forward ran over the last token the old ones sampled.
        reference = kept_kv_logprobs(demo_model, old, new, ids, prompt + boundary - 1)
        got = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        for i, token in enumerate(choice["token_ids"][boundary:]):
            assert abs(got[boundary + i] - reference[i, token].item()) < 0.05, f"token {boundary + i}"
    assert crossed, "no request ran across the push"
    assert [s["version"] for s in after["weight_versions"]] == ["kept-1"]
    whole = forward_logprobs(demo_model, new, after["prompt"] + after["token_ids"])
    got = [entry["logprob"] for entry in after["logprobs"]["content"]]
    prompt = len(after["prompt"])
    assert max(abs(g - whole[prompt - 1 + k, t].item()) for k, (g, t) in enumerate(zip(got, after["token_ids"]))) < 0.05


def test_a_staged_push_of_part_of_two_fused_projections_keeps_the_rest_as_served(
    staged_server, demo_model, fleet, tmp_path
):
    """A staged push of two tensors, each one part of a projection the engines hold fused (q of
    q/k/v, up of gate/up): on CPU the push is staged in the model's own layout, so the rest of each
    fused projection, and every weight the push left out, must be carried over from what is served."""
    new = modified_weights(demo_model, seed=21)
    part = {name: new[name] for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight")}
    pushed = run_trainer(staged_server, save(part, tmp_path / "part.safetensors"), "part-1", "--staged")
    assert pushed.returncode == 0 and "pushed part-1" in pushed.stdout, pushed.stdout + pushed.stderr
    served = {**fleet["weights"], **part}
    fleet.update(version="part-1", weights=served)
    assert_engines_match(staged_server, staged_server.model, demo_model, served, "part-1")


def test_a_staged_push_leaves_the_weights_a_live_push_of_the_same_weights_leaves(
    staged_server, demo_model, fleet, tmp_path
):
    """Bit for bit (vLLM's checksums of every tensor the workers compute with): the staged path
    packs each layer it writes as the live path's reload does."""
    new = modified_weights(demo_model, seed=22)
    path = save(new, tmp_path / "new.safetensors")
    before = fleet_checksums(staged_server)
    after = []
    for version, how in (("live-22", ()), ("staged-22", ("--staged",))):
        pushed = run_trainer(staged_server, path, version, *how)
        assert pushed.returncode == 0 and f"pushed {version}" in pushed.stdout, pushed.stdout + pushed.stderr
        after.append(fleet_checksums(staged_server))
    live, staged = after
    assert staged.keys() == live.keys() and [k for k in live if staged[k] != live[k]] == [] and live != before
    fleet.update(version="staged-22", weights=new)
    assert_engines_match(staged_server, staged_server.model, demo_model, new, "staged-22")


def prefix_cache_hits(engine: httpx.Client) -> float:
    """vLLM's prefix-cache hits (tokens) so far, from one engine's own metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(engine.get("/metrics").text)
    return sum(s.value for f in families for s in f.samples if s.name == "vllm:prefix_cache_hits_total")


def test_a_swap_that_fails_leaves_the_engines_version_and_cached_prefixes_as_they_were(staged_server, fleet):
    """The version and the KV reset go to the EngineCore only after every worker swapped: a swap
    that fails (here: engine 1 asked, behind the front's back, to swap a push it never staged) takes
    nothing else with it. Sent beside the swap, they landed after its failure: the old weights
    labelled with the new version, their cached prefixes dropped."""
    prompt = {"model": staged_server.model, "prompt": "A prefix the engine caches. " * 60, "max_tokens": 1}
    transport = httpx.HTTPTransport(uds=engine_socket(staged_server, 1))
    with httpx.Client(transport=transport, base_url="http://engine", timeout=60) as engine_1:
        assert engine_1.post("/v1/completions", json=prompt).status_code == 200  # its blocks cached
        hits_before = prefix_cache_hits(engine_1)
        r = engine_1.post("/swap_staged", json={"weight_version": "never-swapped", "kv": "recompute"})
        assert r.status_code == 500 and "no staged push" in r.text, r.text
        assert engine_1.get("/info").json()["weight_version"] == fleet["version"]
        assert engine_1.get("/conditions").json() == {"paused": False, "sleeping": False}
        assert engine_1.post("/v1/completions", json=prompt).status_code == 200
        assert prefix_cache_hits(engine_1) > hits_before  # found what it cached before the swap
