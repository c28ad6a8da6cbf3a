"""Weight sync with a real trainer process over gloo into two real engines.

The trainer runs in its own process without vLLM (tests/trainer_process.py).
Correctness is judged against a transformers float32 forward pass of the
pushed weights. The engines are the shared server's: afterwards the module
pushes the checkpoint back and leaves the transfer group (``restores_checkpoint``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from support import TRAINER, admit_while_paused, engine_of, engine_socket, scrape, total

pytestmark = pytest.mark.usefixtures("restores_checkpoint")

PUSH_SECONDS = "skyinfer_weight_update_duration_seconds"

PROMPTS = ["The quick brown fox", "Reinforcement learning updates a policy", "def main():"]


def modified_weights(demo_model: Path, seed: int) -> dict[str, torch.Tensor]:
    """The demo model's weights, float32, with some scaled, some re-randomized, the embeddings changed."""
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, tensor in model.state_dict().items():
        t = tensor.clone()
        if "layers.0.self_attn.q_proj" in name or "layers.1.mlp.up_proj" in name:
            t *= 1.25 + 0.25 * seed
        elif "layers.1.mlp.down_proj.weight" in name or "layers.0.self_attn.o_proj" in name:
            t = torch.randn(t.shape, generator=g) * 0.2
        elif "embed_tokens" in name:
            t += torch.randn(t.shape, generator=g) * 0.1
        weights[name] = t.contiguous()
    weights.pop("lm_head.weight", None)  # tied to the embeddings
    return weights


def save(weights: dict[str, torch.Tensor], path: Path) -> Path:
    save_file(weights, str(path))
    return path


def run_trainer(
    server, weights_file: Path, version: str, *extra: str, timeout_s: float = 180, url: str | None = None
) -> subprocess.CompletedProcess:
    """The trainer as a separate process; ``url`` may list several nodes, comma-separated."""
    return subprocess.run(
        [sys.executable, str(TRAINER), url or server.url, str(weights_file), version, *extra],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def reference_logprobs(demo_model: Path, weights: dict[str, torch.Tensor], prompt_ids: list[int], out_ids: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    ids = torch.tensor([prompt_ids + out_ids])
    with torch.no_grad():
        logprobs = model(ids).logits[0].float().log_softmax(-1)
    start = len(prompt_ids) - 1
    return [logprobs[start + i, tok].item() for i, tok in enumerate(out_ids)]


def sessions_per_engine(server, model_name) -> dict[int, str]:
    engines = len(server.engines())
    found: dict[int, str] = {}
    for i in range(20):
        r = httpx.post(f"{server.url}/v1/completions", json={"model": model_name, "prompt": "x", "max_tokens": 1},
                       headers={"X-Session-ID": f"ws-{i}"}, timeout=60)  # fmt: skip
        found.setdefault(engine_of(r), f"ws-{i}")
    assert set(found) == set(range(engines))
    return found


def assert_engines_match(server, model_name, demo_model, weights, version):
    for engine, session in sessions_per_engine(server, model_name).items():
        for prompt in PROMPTS:
            prompt_ids = httpx.post(f"{server.url}/tokenize", json={"model": model_name, "prompt": prompt}, timeout=30).json()["tokens"]
            r = httpx.post(
                f"{server.url}/v1/completions",
                json={"model": model_name, "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 1,
                      "return_token_ids": True, "ignore_eos": True},  # fmt: skip
                headers={"X-Session-ID": session},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            assert engine_of(r) == engine
            assert r.headers["X-Weight-Version"] == version
            choice = r.json()["choices"][0]
            expected = reference_logprobs(demo_model, weights, prompt_ids, choice["token_ids"])
            got = choice["logprobs"]["token_logprobs"]
            diff = max(abs(a - b) for a, b in zip(got, expected, strict=True))
            assert diff < 0.05, f"engine {engine}, {prompt!r}: logprobs differ by {diff:.4f}"


def greedy(server, model_name, session: str) -> list[int]:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": model_name, "prompt": "unchanged?", "max_tokens": 12, "temperature": 0, "return_token_ids": True},
        headers={"X-Session-ID": session},
        timeout=60,
    )
    return r.json()["choices"][0]["token_ids"]


def test_weight_transfer_methods_drive_a_push(server, model_name, demo_model):
    """The sync client's weight calls, as vLLM's trainer-side code would make them (via GlooTrainer):
    a session of calls, then the one-call path; each leaves the engines serving what was pushed,
    whatever they served before (the examples push to this server too)."""
    from skyinfer.client import Client
    from skyinfer.trainer import GlooTrainer

    modified = modified_weights(demo_model, seed=5)
    # The checkpoint's own weights, in the served dtype.
    checkpoint = {n: t.float() for n, t in load_file(str(demo_model / "model.safetensors")).items()}
    with Client(server.url) as client:
        trainer = GlooTrainer(server.url, timeout_s=60, client=client)
        trainer.init()
        trainer.push(list(modified.items()), "client-push")
        assert client.weight_info()["weight_version"] == "client-push"
        assert_engines_match(server, model_name, demo_model, modified, "client-push")
        trainer.push(list(checkpoint.items()), "client-push-2", one_call=True)
        assert client.weight_info()["weight_version"] == "client-push-2"
        assert_engines_match(server, model_name, demo_model, checkpoint, "client-push-2")
        after = client.generate([5, 6, 7], {"max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert after["choices"][0]["weight_versions"] == [{"version": "client-push-2", "start": 0, "end": 4}]


async def test_push_under_keep_pause_then_logprobs_match_transformers(server, model_name, demo_model, tmp_path):
    assert httpx.get(f"{server.url}/get_world_size").json()["world_size"] == 2
    pushes_before = total(scrape(server), PUSH_SECONDS, f"{PUSH_SECONDS}_count")
    weights = modified_weights(demo_model, seed=1)
    weights_file = save(weights, tmp_path / "w1.safetensors")
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
        body = {"model": model_name, "max_tokens": 64, "ignore_eos": True, "return_token_ids": True}
        tasks = await admit_while_paused(
            http, (http.post("/v1/completions", json={**body, "prompt": f"in flight {i}"}) for i in range(8))
        )
        trainer = await asyncio.to_thread(run_trainer, server, weights_file, "v-one")
        assert trainer.returncode == 0, trainer.stdout + trainer.stderr
        assert not any(t.done() for t in tasks)
        assert (await http.post("/resume")).status_code == 200
        results = await asyncio.gather(*tasks)
    for r in results:
        assert r.status_code == 200
        choice = r.json()["choices"][0]
        assert (choice["finish_reason"], len(choice["token_ids"])) == ("length", 64)
    info = httpx.get(f"{server.url}/weight_info").json()
    assert info["weight_version"] == "v-one"
    assert [e["weight_version"] for e in info["engines"]] == ["v-one", "v-one"]
    assert_engines_match(server, model_name, demo_model, weights, "v-one")
    # The token route also reports vLLM's per-token version spans.
    r = httpx.post(f"{server.url}/inference/v1/generate",
                   json={"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "ignore_eos": True}}, timeout=60)  # fmt: skip
    assert r.headers["X-Weight-Version"] == "v-one"
    assert r.json()["choices"][0]["weight_versions"] == [{"version": "v-one", "start": 0, "end": 4}]

    # A second push, with other weights, through a single /update_weights call.
    weights2 = modified_weights(demo_model, seed=2)
    trainer = run_trainer(server, save(weights2, tmp_path / "w2.safetensors"), "v-two", "--one-call")
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    assert_engines_match(server, model_name, demo_model, weights2, "v-two")
    # Both pushes were timed, and the version is on the metrics too.
    families = scrape(server)
    assert total(families, PUSH_SECONDS, f"{PUSH_SECONDS}_count") - pushes_before == 2
    assert total(families, PUSH_SECONDS, f"{PUSH_SECONDS}_sum") > 0
    version_info = "skyinfer_engine_weight_version_info"
    assert {s.labels["engine"] for s in families[version_info] if s.labels["version"] == "v-two"} == {"0", "1"}


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda w: w.update({"model.layers.0.no_such_tensor.weight": torch.zeros(2)}), "unknown tensor"),
        (lambda w: w.update({"model.norm.weight": torch.zeros(7)}), "wrong shape"),
        (lambda w: w.update({"model.norm.weight": w["model.norm.weight"].to(torch.bfloat16)}), "wrong dtype"),
    ],
)
def test_bad_metadata_is_refused_before_any_transfer(server, model_name, demo_model, tmp_path, change, message):
    version_before = httpx.get(f"{server.url}/weight_info").json()["weight_version"]
    before = greedy(server, model_name, "bad-metadata")
    weights = modified_weights(demo_model, seed=3)
    change(weights)
    trainer = run_trainer(server, save(weights, tmp_path / "bad.safetensors"), "v-bad")
    assert trainer.returncode == 3, trainer.stdout + trainer.stderr
    assert "refused 400" in trainer.stdout and message in trainer.stdout
    # The same metadata straight to /update_weights (the one-call path): 400 too.
    names = list(weights)
    update_info = {"names": names, "dtype_names": [str(weights[n].dtype).split(".")[-1] for n in names],
                   "shapes": [list(weights[n].shape) for n in names]}  # fmt: skip
    r = httpx.post(f"{server.url}/update_weights", json={"update_info": update_info}, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/weight_info").json()["weight_version"] == version_before
    assert greedy(server, model_name, "bad-metadata") == before
    assert all(e["state"] == "ready" for e in server.engines())


async def test_trainer_that_never_joins_times_out_while_engines_serve(server, model_name):
    from support import free_port

    init_info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 3, "timeout_s": 6}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        started = time.monotonic()
        init = asyncio.create_task(http.post("/init_weight_transfer", json={"init_info": init_info}))
        await asyncio.sleep(1)
        served = []
        while not init.done():
            t = time.monotonic()
            r = await http.post("/v1/completions", json={"model": model_name, "prompt": "still here", "max_tokens": 4})
            assert r.status_code == 200
            served.append(time.monotonic() - t)
            await asyncio.sleep(0.2)
        r = await init
        elapsed = time.monotonic() - started
    assert r.status_code == 504, r.text
    assert "did not join" in r.json()["error"]["message"]
    assert elapsed < 6 + 10
    assert len(served) >= 3 and max(served) < 5, served


async def test_trainer_dying_mid_transfer_restarts_engines_stale_until_next_push(server, model_name, demo_model, tmp_path):
    weights = modified_weights(demo_model, seed=4)
    weights_file = save(weights, tmp_path / "w4.safetensors")
    # The fleet moves past the checkpoint on disk, which restarted engines load.
    assert (await asyncio.to_thread(run_trainer, server, weights_file, "v-before-crash")).returncode == 0
    # Requests held by a keep-pause under the push end, however the push ends.
    body = {"model": model_name, "prompt": "held through a crash", "max_tokens": 64, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:

        async def ended(request) -> tuple[httpx.Response, float]:
            return await request, time.monotonic()

        held = await admit_while_paused(http, (ended(http.post("/v1/completions", json=body)) for _ in range(8)))
        trainer = await asyncio.to_thread(run_trainer, server, weights_file, "v-dies", "--die-after", "3")
        died = time.monotonic()
        assert trainer.returncode == 9
        for r, at in await asyncio.gather(*held):
            if r.status_code != 200:
                assert r.status_code == 503 and r.json()["error"]["code"] == 503, r.text
                assert at - died < 5, f"a held request ended {at - died:.1f}s after the trainer died"
            else:
                assert r.json()["usage"]["completion_tokens"] == 64
    # Every engine was receiving: each is restarted, and comes back stale.
    deadline = time.monotonic() + 240
    seen = set()
    while True:
        states = [e["state"] for e in server.engines()]
        seen.update(states)
        if states == ["stale", "stale"]:
            break
        assert time.monotonic() < deadline, states
        r = httpx.post(f"{server.url}/v1/completions", json={"model": model_name, "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503, "a stale or restarting engine served a request"
        time.sleep(1)
    assert "restarting" in seen
    families = scrape(server)
    for engine in ("0", "1"):
        assert total(families, "skyinfer_engine_restarts", "skyinfer_engine_restarts_total", engine=engine) >= 1
        assert total(families, "skyinfer_engine_state", "skyinfer_engine_state", engine=engine, state="stale") == 1
    assert total(families, "skyinfer_weight_update_failures", "skyinfer_weight_update_failures_total") >= 1
    r = httpx.post(f"{server.url}/v1/completions", json={"model": model_name, "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"

    # The recovery path: pause (twice: a retried call is harmless), push, resume, with every
    # engine stale; each call answers per engine, none is half-applied.
    for _ in range(2):
        r = httpx.post(f"{server.url}/pause", params={"mode": "keep"}, timeout=60)
        assert r.status_code == 200 and [e["status"] for e in r.json()["engines"]] == [200, 200], r.text
    assert [(e["state"], e["paused"]) for e in server.engines()] == [("stale", True)] * 2
    trainer = run_trainer(server, weights_file, "v-after-crash")
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    assert [e["state"] for e in server.engines()] == ["paused", "paused"]
    assert httpx.post(f"{server.url}/resume", timeout=60).status_code == 200
    assert [e["state"] for e in server.engines()] == ["ready", "ready"]
    assert_engines_match(server, model_name, demo_model, weights, "v-after-crash")


async def test_the_fleet_is_relabelled_without_a_transfer(server, model_name):
    """vLLM's /update_weight_version on every engine: the label changes, the weights do not."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        before = await http.post("/v1/completions", json={"model": model_name, "prompt": "relabel", "max_tokens": 4,
                                                          "temperature": 0, "return_token_ids": True})  # fmt: skip
        r = await http.post("/update_weight_version", json={"new_version": "relabelled-7"})
        assert r.status_code == 200 and [e["status"] for e in r.json()["engines"]] == [200, 200], r.text
        info = (await http.get("/weight_info")).json()
        assert info["weight_version"] == "relabelled-7"
        assert [e["weight_version"] for e in info["engines"]] == ["relabelled-7"] * 2
        after = await http.post("/v1/completions", json={"model": model_name, "prompt": "relabel", "max_tokens": 4,
                                                         "temperature": 0, "return_token_ids": True})  # fmt: skip
        assert after.headers["X-Weight-Version"] == "relabelled-7"
        assert after.json()["choices"][0]["token_ids"] == before.json()["choices"][0]["token_ids"]
        refused = await http.post("/update_weight_version", json={"new_version": ""})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "new_version"


async def test_an_update_the_trainer_leaves_is_aborted_and_the_group_can_be_left(server):
    """A trainer that goes silent after /start_weight_update does not wedge weight sync: the
    update is aborted after the group's timeout. vLLM's /shutdown_weight_transfer_engine takes
    every engine out of the group."""
    from skyinfer.trainer import GlooTrainer

    trainer = GlooTrainer(server.url, timeout_s=4)
    await asyncio.to_thread(trainer.init)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            assert (await http.post("/start_weight_update", json={"is_checkpoint_format": True})).status_code == 200
            # While it lasts, a second update is an ordering mistake.
            refused = await http.post("/start_weight_update")
            assert refused.status_code == 409 and "is started" in refused.json()["error"]["message"]
            assert (await http.get("/weight_info")).json()["update_phase"] == "started"
            deadline = time.monotonic() + 10
            while (info := (await http.get("/weight_info")).json())["update_phase"] != "idle":
                assert time.monotonic() < deadline, info
                await asyncio.sleep(0.2)
            # Nothing had touched the engines: they serve on, still in the group.
            assert [(e["state"], e["in_transfer_group"]) for e in info["engines"]] == [("ready", True)] * 2
            assert (await http.post("/start_weight_update")).status_code == 200
            # Leaving the group ends the started update too.
            left = await http.post("/shutdown_weight_transfer_engine")
            assert left.status_code == 200 and [e["status"] for e in left.json()["engines"]] == [200, 200], left.text
            info = (await http.get("/weight_info")).json()
            assert info["update_phase"] == "idle" and not any(e["in_transfer_group"] for e in info["engines"])
            refused = await http.post("/start_weight_update")
            assert refused.status_code == 409 and "init_weight_transfer" in refused.json()["error"]["message"]
    finally:
        trainer.close()



async def test_pushes_are_verified_and_an_engine_holding_other_weights_is_held_out(server, model_name, demo_model, tmp_path):
    """vLLM's /weight_checker over the fleet: engines are held to the checksums they agreed on
    at a verified push; one whose weights change behind the front's back stops serving."""
    weights = modified_weights(demo_model, seed=5)
    weights_file = save(weights, tmp_path / "w5.safetensors")
    pushed = await asyncio.to_thread(run_trainer, server, weights_file, "v-verified", "--verify")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        checked = (await http.post("/weight_checker", json={"action": "checksum"})).json()
        assert checked["agree"] and checked["held_out"] == [] and checked["weight_version"] == "v-verified"
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

        # Zero engine 1's weights through vLLM's reset, behind the front's back.
        transport = httpx.AsyncHTTPTransport(uds=engine_socket(server, 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=60) as engine1:
            assert (await engine1.post("/weight_checker", json={"action": "reset"})).status_code == 200
        checked = (await http.post("/weight_checker", json={"action": "checksum"})).json()
        assert not checked["agree"] and checked["held_out"] == [1] and checked["checksums"] == sums
        engine0, engine1 = (e["result"] for e in checked["engines"])
        assert engine0 == {"match": True, "mismatches": []}
        # vLLM's reset zeroes every weight the model holds as a tensor; on CPU the linear layers'
        # weights live in oneDNN's packed buffers, their parameters are empty (sha256 of nothing).
        # (and the demo model's biases are zeros already).
        held = {k for k, digest in sums.items() if digest != hashlib.sha256(b"").hexdigest()}
        nonzero = {k for k in held if k.endswith(("embed_tokens.weight", "norm.weight"))}
        assert len(nonzero) == 6 and not engine1["match"] and nonzero <= set(engine1["mismatches"]) <= held
        assert [e["state"] for e in server.engines()] == ["ready", "stale"]
        for i in range(6):
            r = await http.post("/v1/completions", json={"model": model_name, "prompt": "who serves?", "max_tokens": 2},
                                headers={"X-Session-ID": f"held-out-{i}"})  # fmt: skip
            assert r.status_code == 200 and engine_of(r) == 0

        # A push the engines do not verify against fails loudly and serves nothing unverified.
        expect = tmp_path / "stale-checksums.json"
        expect.write_text(json.dumps(sums))
        weights = modified_weights(demo_model, seed=6)
        weights_file = save(weights, tmp_path / "w6.safetensors")
        failed = await asyncio.to_thread(run_trainer, server, weights_file, "v-unverified", "--expect", str(expect))
        assert failed.returncode == 3 and "refused 502" in failed.stdout and "differ" in failed.stdout, failed.stdout
        assert [e["state"] for e in server.engines()] == ["stale", "stale"]

    # The next push brings every engine back, verified.
    pushed = await asyncio.to_thread(run_trainer, server, weights_file, "v-reverified", "--verify")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert [e["state"] for e in server.engines()] == ["ready", "ready"]
    assert_engines_match(server, model_name, demo_model, weights, "v-reverified")
