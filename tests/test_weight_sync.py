"""Weight sync with a real trainer process over gloo into two real engines.

The trainer runs in its own process without vLLM (tests/trainer_process.py).
Correctness is judged against a transformers float32 forward pass of the
pushed weights. The engines are the shared server's: afterwards the module
pushes the checkpoint back and leaves the transfer group (``restores_checkpoint``).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from forked_python import ForkedPopen
from pushes import (
    adamw_step,
    assert_engines_match,
    changed_elements,
    fleet_checksums,
    greedy,
    modified_weights,
    push_more,
    pushed_bytes,
    run_trainer,
    save,
    start_trainer,
)
from support import admit_while_paused, free_port, scrape, total

pytestmark = pytest.mark.usefixtures("restores_checkpoint")

PUSH_SECONDS = "skyinfer_weight_update_duration_seconds"


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


def test_a_trainers_next_push_names_its_layout_alone_and_is_applied_by_the_engines_plans(
    server, model_name, demo_model, tmp_path
):
    """One trainer process pushes twice (the second through ``--more``). The first gives its tensor
    list with its layout's id; the second names the layout alone, nothing per tensor in its call,
    and each engine's workers apply its tensors by the plans they recorded (where each lands in the
    live weights: transfer/plans.py), none recorded again, no loader run for them. Both land exactly."""
    first = modified_weights(demo_model, seed=7)
    trainer = start_trainer(server, save(first, tmp_path / "first.safetensors"), "v-plan-1", "--more")
    try:
        assert trainer.stdout.readline().split() == ["pushed", "v-plan-1"], trainer.stderr.read()
        assert_engines_match(server, model_name, demo_model, first, "v-plan-1")
        last = httpx.get(f"{server.url}/weight_info").json()["last_push"]
        assert last["layout"] == "given", last
        second = modified_weights(demo_model, seed=8)
        push_more(trainer, save(second, tmp_path / "second.safetensors"), "v-plan-2")
        assert_engines_match(server, model_name, demo_model, second, "v-plan-2")
        last = httpx.get(f"{server.url}/weight_info").json()["last_push"]
        assert last["layout"] == "named" and last["applied"] == "in place", last
        # A delta (the trainer's default): the tensors the second weights changed, each by its plan.
        changed = [name for name in first if not torch.equal(first[name], second[name])]
        assert last["plans_recorded"] == 0 and last["by_plan"] == len(changed) > 0, last
    finally:
        trainer.stdin.close()
        assert trainer.wait(timeout=60) == 0, trainer.stderr.read()


def test_a_delta_push_after_an_optimizer_step_lands_what_a_dense_push_of_the_same_weights_lands(
    server, model_name, demo_model
):
    """One AdamW step at a learning rate of 1e-6 over bfloat16 weights changes few of their bits:
    GlooTrainer's next push sends only those elements (their positions and values), which each
    engine writes where its apply plans put them. The engines then hold what a dense push of the
    same weights gives them (vLLM's checksums equal) and serve it (logprobs as transformers' give);
    the step reverted by a second delta, they hold the first weights again. A trainer whose base
    is not what the engines serve (another trainer pushed since) is refused its delta and pushes
    whole, by itself."""
    from skyinfer.client import Client
    from skyinfer.trainer import GlooTrainer

    first = {name: t.to(torch.bfloat16) for name, t in modified_weights(demo_model, seed=9).items()}
    stepped = adamw_step(first)
    elements = sum(t.numel() for t in first.values())
    changed = changed_elements(first, stepped)
    assert 0 < changed < elements / 10, (changed, elements)
    with Client(server.url) as client:
        trainer = GlooTrainer(server.url, timeout_s=60, client=client)
        trainer.init()
        dense_bytes = pushed_bytes(trainer, first, "delta-0")["dense"]
        assert dense_bytes == 2 * elements
        at_first = fleet_checksums(server)
        sent = pushed_bytes(trainer, stepped, "delta-1")
        # Each changed element: a 4-byte position and a 2-byte value (a few pieces' padding).
        assert sent["dense"] == dense_bytes and sent["sent"] <= 1.2 * 6 * changed + 64, (sent, changed)
        by_delta = fleet_checksums(server)
        assert by_delta != at_first
        assert_engines_match(server, model_name, demo_model, {n: t.float() for n, t in stepped.items()}, "delta-1")
        assert pushed_bytes(trainer, first, "delta-2")["sent"] < dense_bytes / 10
        assert fleet_checksums(server) == at_first

        whole = GlooTrainer(server.url, timeout_s=60, client=client, delta=False)
        whole.init()
        pushed_bytes(whole, first, "dense-0")
        assert pushed_bytes(whole, stepped, "dense-1")["sent"] == dense_bytes
        assert fleet_checksums(server) == by_delta
        trainer.init()
        assert pushed_bytes(trainer, first, "delta-3")["sent"] == dense_bytes  # its base, delta-2, is not served
        assert fleet_checksums(server) == at_first
        assert pushed_bytes(trainer, stepped, "delta-4")["sent"] < dense_bytes / 10  # delta-3 is
        assert fleet_checksums(server) == by_delta


def test_a_sharded_trainer_diffs_each_shard_where_it_lives(server, model_name, demo_model, tmp_path):
    """Two trainer processes, each holding half of every weight (DTensors sharded on their first
    dimension), push through ``ShardedPush``: after one AdamW step at 1e-6, each compares its own
    half with what it last pushed and sends rank 0 only the changed elements, which rank 0 pushes as
    one delta. No tensor that goes sparse is gathered whole; the engines then hold what a dense push
    of the same weights gives them."""
    from skyinfer.client import Client
    from skyinfer.trainer import GlooTrainer

    first = {name: t.to(torch.bfloat16) for name, t in modified_weights(demo_model, seed=10).items()}
    stepped = adamw_step(first)
    with Client(server.url) as client:
        whole = GlooTrainer(server.url, timeout_s=60, client=client, delta=False)
        whole.init()
        dense = pushed_bytes(whole, stepped, "dense-stepped")["dense"]
        by_dense = fleet_checksums(server)
        pushes = [f"{save(first, tmp_path / 'first.safetensors')}:sharded-0"]
        pushes.append(f"{save(stepped, tmp_path / 'stepped.safetensors')}:sharded-1")
        port = free_port()
        ranks = [
            ForkedPopen(
                [
                    Path(__file__).with_name("sharded_trainer.py"),
                    server.url,
                    str(rank),
                    str(port),
                    *pushes,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in (0, 1)
        ]
        said = [rank.communicate(timeout=240) for rank in ranks]
        assert [rank.returncode for rank in ranks] == [0, 0], said
        for rank, (out, _) in enumerate(said):
            tensors = len(first)
            assert f"rank {rank} pushed sharded-0: 0 sparse, {tensors} whole, {tensors} gathered" in out, out
            sparse, sent_whole, gathered = map(
                int, re.search(r"sharded-1: (\d+) sparse, (\d+) whole, (\d+) gathered", out).groups()
            )
            assert sparse > 0 and sparse + sent_whole <= tensors and gathered == sent_whole, out
        last = client.weight_info()["last_push"]
        assert last["weight_version"] == "sharded-1" and last["bytes"]["sent"] < dense / 10, last
        assert fleet_checksums(server) == by_dense
        assert_engines_match(server, model_name, demo_model, {n: t.float() for n, t in stepped.items()}, "sharded-1")


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
    r = httpx.post(
        f"{server.url}/inference/v1/generate",
        json={"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "ignore_eos": True}},
        timeout=60,
    )
    assert r.headers["X-Weight-Version"] == "v-one"
    assert r.json()["choices"][0]["weight_versions"] == [{"version": "v-one", "start": 0, "end": 4}]

    # A second push, with other weights, through a single /update_weights call.
    weights2 = modified_weights(demo_model, seed=2)
    trainer = run_trainer(server, save(weights2, tmp_path / "w2.safetensors"), "v-two", "--one-call")
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    assert_engines_match(server, model_name, demo_model, weights2, "v-two")
    # Where the one-call push went, stage by stage, each stage's own seconds within the whole.
    last = httpx.get(f"{server.url}/weight_info").json()["last_push"]
    assert last["weight_version"] == "v-two" and list(last["stages"]) == [
        "pause",
        "start",
        "receive",
        "finish",
        "resume",
    ]
    assert last["stages"]["receive"] > 0 and last["stages"]["finish"] > 0, last
    assert sum(last["stages"].values()) <= last["seconds"] < 60, last
    # A dense model's workers load a push straight into the weights they serve, then pack their CPU
    # kernels' copies again (the logprobs above would be the old weights' without the repack).
    assert last["applied"] == "in place" and last["load_s"] > 0 and last["repack_s"] > 0, last
    # Both pushes were timed, and the version is on the metrics too.
    families = scrape(server)
    assert total(families, PUSH_SECONDS, f"{PUSH_SECONDS}_count") - pushes_before == 2
    assert total(families, PUSH_SECONDS, f"{PUSH_SECONDS}_sum") > 0
    version_info = "skyinfer_engine_weight_version_info"
    assert {s.labels["engine"] for s in families[version_info] if s.labels["version"] == "v-two"} == {"0", "1"}


def test_a_push_in_buckets_received_ahead_of_its_loads_lands_exactly(server, model_name, demo_model, tmp_path):
    """Packed into buckets of 16 KiB (the demo model's 26 tensors in 16), each engine's worker
    receives the next bucket on a thread into one of two buffers it reuses while the one before is
    loaded: every weight lands where it belongs, and the engines serve exactly those weights."""
    weights = modified_weights(demo_model, seed=5)
    trainer = run_trainer(server, save(weights, tmp_path / "w.safetensors"), "v-buckets", "--bucket-bytes", "16384")
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    assert_engines_match(server, model_name, demo_model, weights, "v-buckets")
    last = httpx.get(f"{server.url}/weight_info").json()["last_push"]
    assert last["weight_version"] == "v-buckets" and last["applied"] == "in place", last


@pytest.mark.parametrize("how", ["session", "--one-call"])
def test_a_push_of_part_of_two_fused_projections_keeps_the_rest_as_served(
    server, model_name, demo_model, tmp_path, how
):
    """A push of two tensors, each one part of a projection the engines hold fused (q of q/k/v, up
    of gate/up). vLLM reloads a layer whole: the parts the push left out (k and v, gate) must be
    carried over from what is served, not served from fresh memory (vLLM 0.32 alone serves NaN)."""
    whole = modified_weights(demo_model, seed=6)
    pushed = run_trainer(server, save(whole, tmp_path / "whole.safetensors"), "v-whole", "--one-call")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    new = modified_weights(demo_model, seed=7)
    part = {name: new[name] for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight")}
    extra = [how] if how.startswith("--") else []
    pushed = run_trainer(server, save(part, tmp_path / "part.safetensors"), "v-part", *extra)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    assert_engines_match(server, model_name, demo_model, {**whole, **part}, "v-part")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda w: w.update({"model.layers.0.no_such_tensor.weight": torch.zeros(2)}), "unknown tensor"),
        (lambda w: w.update({"model.norm.weight": torch.zeros(7)}), "wrong shape"),
        # vLLM casts floating tensors on load; integers are no weights of this model.
        (lambda w: w.update({"model.norm.weight": w["model.norm.weight"].to(torch.int32)}), "wrong dtype"),
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
    update_info = {
        "names": names,
        "dtype_names": [str(weights[n].dtype).split(".")[-1] for n in names],
        "shapes": [list(weights[n].shape) for n in names],
    }
    r = httpx.post(f"{server.url}/update_weights", json={"update_info": update_info}, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/weight_info").json()["weight_version"] == version_before
    assert greedy(server, model_name, "bad-metadata") == before
    assert all(e["state"] == "ready" for e in server.engines())


async def test_trainer_that_never_joins_times_out_while_engines_serve(server, model_name):
    from support import free_port

    init_info = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": 3,
        "timeout_s": 6,
    }
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        # The init ends at its own 6 s timeout; one that ignored it would wait out the front's
        # default (120 s): a 60 s deadline tells the two apart on a busy machine.
        deadline = time.monotonic() + 60
        init = asyncio.create_task(http.post("/init_weight_transfer", json={"init_info": init_info}))
        await asyncio.sleep(1)
        served = []
        while not init.done():
            assert time.monotonic() < deadline, "the init still waits 60 s on, past its 6 s timeout"
            t = time.monotonic()
            r = await http.post("/v1/completions", json={"model": model_name, "prompt": "still here", "max_tokens": 4})
            assert r.status_code == 200
            served.append(time.monotonic() - t)
            await asyncio.sleep(0.2)
        r = await init
    assert r.status_code == 504, r.text
    assert "did not join" in r.json()["error"]["message"] and "within 6s" in r.json()["error"]["message"], r.text
    # Served while the init waited: each request but the last was answered before the init ended
    # (the loop sends the next only then), where engines it blocked would answer none before it ended.
    assert len(served) >= 3, served


async def test_the_fleet_is_relabelled_without_a_transfer(server, model_name):
    """vLLM's /update_weight_version on every engine: the label changes, the weights do not."""
    body = {"model": model_name, "prompt": "relabel", "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        before = await http.post("/v1/completions", json=body)
        r = await http.post("/update_weight_version", json={"new_version": "relabelled-7"})
        assert r.status_code == 200 and [e["status"] for e in r.json()["engines"]] == [200, 200], r.text
        info = (await http.get("/weight_info")).json()
        assert info["weight_version"] == "relabelled-7"
        assert [e["weight_version"] for e in info["engines"]] == ["relabelled-7"] * 2
        after = await http.post("/v1/completions", json=body)
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


async def abandon(http: httpx.AsyncClient, path: str, after_s: float, **kwargs) -> None:
    """A caller that gives up ``after_s`` into its call (its connection closes, as a client
    timeout or a Ctrl-C closes it)."""
    try:
        r = await asyncio.wait_for(http.post(path, **kwargs), after_s)
    except asyncio.TimeoutError:
        return
    raise AssertionError(f"{path} answered {r.status_code} before its caller gave up: {r.text}")


async def until_states(http: httpx.AsyncClient, wanted: set[str], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while {e["state"] for e in (await http.get("/engines")).json()["engines"]} - wanted:
        assert time.monotonic() < deadline, (await http.get("/engines")).json()
        await asyncio.sleep(0.5)


async def test_abandoned_restart_sleep_wait_pause_and_init_leave_a_fleet_that_pushes_and_serves(
    server, model_name, demo_model, tmp_path
):
    """Callers who give up half-way, one after another, as a trainer's client timeouts and an
    operator's Ctrl-C do: a restart of engine 1 (after 2 s of its bring-up), a level-1 sleep that
    waits for long requests, a wait-mode pause behind long requests (a resume sent a second after it waits for it and
    undoes it), an init naming an address where no trainer listens. Each runs to its end; then a
    real trainer process pushes and both engines serve its weights."""
    from support import free_port

    async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
        pid = server.engines()[1]["pid"]
        await abandon(http, "/engines/1/restart", 2)
        # Stale if the fleet serves a push: engine 1 came back with the checkpoint on disk.
        await until_states(http, {"ready", "stale"})
        assert server.engines()[1]["pid"] != pid
        body = {"model": model_name, "prompt": "a long one", "max_tokens": 1500, "ignore_eos": True}
        long = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(4)]
        await asyncio.sleep(1)
        await abandon(http, "/sleep", 0.5, params={"level": "1", "mode": "wait"})
        await until_states(http, {"sleeping"})
        assert (await http.post("/wake_up")).status_code == 200
        assert [r.status_code for r in await asyncio.gather(*long)] == [200] * 4
        long = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(4)]
        await asyncio.sleep(1)
        await abandon(http, "/pause", 0.5, params={"mode": "wait"})
        await asyncio.sleep(1)
        resumed = await http.post("/resume")
        assert resumed.status_code == 200, resumed.text
        assert [r.status_code for r in await asyncio.gather(*long)] == [200] * 4
        nobody = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 3, "timeout_s": 60}
        await abandon(http, "/init_weight_transfer", 1, json={"init_info": nobody})
        await until_states(http, {"ready", "stale"})
    weights = modified_weights(demo_model, seed=11)
    trainer = await asyncio.to_thread(run_trainer, server, save(weights, tmp_path / "w.safetensors"), "after-abandon")
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    await asyncio.to_thread(assert_engines_match, server, model_name, demo_model, weights, "after-abandon")
