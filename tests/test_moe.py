"""Pushes into mixture-of-experts engines, judged against transformers float32 and against a fresh
engine: a tiny random Qwen3-MoE (8 experts, top 2, an expert width vLLM's CPU kernel pads) and a tiny
Qwen2-MoE (a shared expert beside 4 routed ones), each served by two float32 engines.

Each push path in turn: pause-push (gloo), staged, ``/reload_weights``, a peer's catch-up after an
EngineCore is killed, and a push whose trainer is killed halfway. A push of the weights served
must leave every logprob as it was (1e-6); new weights must land within 0.05 of transformers; the
first weights pushed back must give exactly what a fresh engine gave; a staged push must leave the
weights a live push of the same weights leaves, installed as on CPU (Qwen3-MoE) or as on GPUs
(Qwen2-MoE, ``--staged-swap in-place``)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from skyinfer.demo_model import MOE_CONFIGS, build_demo_moe_model

from forked_python import VLLM_PRELOAD, run_python
from moe_pushes import MoeFleet
from pushes import adamw_step, fleet_checksums, pushed_bytes, run_trainer, save, sessions_per_engine
from support import ServerProcess, free_port, module_servers, two_float32_engines, vllm_process

ARCHITECTURES = sorted(MOE_CONFIGS)


# The architecture whose staged pushes are installed as on GPUs (copied into the live tensors); the
# other's as on CPU (the live parameters pointed at the staged ones).
STAGED_IN_PLACE = "qwen2_moe"


def _launch(demo_model: Path, logs: Path) -> dict[str, ServerProcess]:
    servers = {}
    for architecture in ARCHITECTURES:
        model = build_demo_moe_model(logs / architecture, architecture)
        in_place = ("--staged-swap", "in-place") if architecture == STAGED_IN_PLACE else ()
        # A killed trainer's collective ends with the group's timeout.
        servers[architecture] = two_float32_engines(
            model, logs / f"{architecture}.log", "--weight-transfer-timeout", "30", *in_place
        )
    return servers


moe_servers = module_servers(__name__, _launch)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def moe(request, moe_servers) -> MoeFleet:
    return MoeFleet(moe_servers[request.param], Path(moe_servers[request.param].model))


def test_a_push_of_the_weights_served_changes_nothing(moe, tmp_path):
    """The checkpoint's own weights pushed back (pause-push): every engine serves exactly what it
    served fresh. vLLM alone moves the logprobs by 1.6 here: its reload skips the CPU kernel's packing."""
    moe.push(moe.checkpoint, "same", tmp_path)
    moe.assert_serves_fresh()


def test_new_weights_land_and_the_first_ones_come_back_exactly(moe, tmp_path):
    new = moe.modified(seed=1)
    moe.push(new, "new-1", tmp_path)
    moe.assert_matches_transformers(new, tmp_path)
    # Packed and padded after loading, the experts are reloaded as vLLM reloads a layer, not in place.
    last = httpx.get(f"{moe.server.url}/weight_info", timeout=60).json()["last_push"]
    assert last["weight_version"] == "new-1" and last["applied"] == "layerwise reload", last
    moe.push(moe.checkpoint, "back", tmp_path)
    moe.assert_serves_fresh()


def test_a_staged_push_lands_and_the_first_weights_come_back_exactly(moe, tmp_path):
    """Staged: received into a shadow of the live layers while the engines serve, each MoE layer
    padded and packed there by vLLM's own processing, then swapped in."""
    new = moe.modified(seed=2)
    moe.push(new, "staged-new", tmp_path, "--staged")
    moe.assert_matches_transformers(new, tmp_path)
    moe.push(moe.checkpoint, "staged-back", tmp_path, "--staged")
    moe.assert_serves_fresh()


def test_a_staged_push_leaves_the_weights_a_live_push_of_the_same_weights_leaves(moe, tmp_path):
    """Bit for bit (vLLM's checksums of every tensor the workers compute with, the experts as the
    kernel packed them): the staged path processes each layer as the live path's reload does, whether
    it installs the result by pointer (CPU) or by copying it into the live tensors (GPUs, and here
    ``STAGED_IN_PLACE``)."""
    moe.assert_staged_lands_as_live(moe.modified(seed=4), tmp_path)
    installed = "copied in place" if Path(moe.model_dir).name == STAGED_IN_PLACE else "by pointer"
    assert httpx.get(f"{moe.server.url}/weight_info", timeout=60).json()["last_staged_swap"]["installed"] == installed


def test_a_delta_push_after_an_optimizer_step_lands_what_a_dense_push_of_the_same_weights_lands(moe, tmp_path):
    """One AdamW step at 1e-6 over bfloat16 weights: GlooTrainer's next push sends only the elements
    it changed. The experts are packed and padded in what each engine serves, so each worker
    applies them to the copy of the checkpoint's tensors it kept from the push before, and reloads
    every layer they touch from it: vLLM's checksums then equal a dense push's of the same weights,
    the logprobs transformers' on them; the step reverted by a second delta, the first checksums
    come back."""
    from skyinfer.client import Client
    from skyinfer.trainer import GlooTrainer

    first = {name: t.to(torch.bfloat16) for name, t in moe.modified(seed=7).items()}
    stepped = adamw_step(first)
    with Client(moe.server.url) as client:
        trainer = GlooTrainer(moe.server.url, timeout_s=60, client=client)
        trainer.init()
        dense = pushed_bytes(trainer, first, "delta-0")["dense"]
        at_first = fleet_checksums(moe.server)
        assert pushed_bytes(trainer, stepped, "delta-1")["sent"] < dense / 10
        last = client.weight_info()["last_push"]
        assert last["applied"] == "layerwise reload", last
        by_delta = fleet_checksums(moe.server)
        assert by_delta != at_first
        moe.assert_matches_transformers({name: t.float() for name, t in stepped.items()}, tmp_path)
        assert pushed_bytes(trainer, first, "delta-2")["sent"] < dense / 10
        assert fleet_checksums(moe.server) == at_first

        whole = GlooTrainer(moe.server.url, timeout_s=60, client=client, delta=False)
        whole.init()
        assert pushed_bytes(whole, stepped, "dense-1")["sent"] == dense
        assert fleet_checksums(moe.server) == by_delta
    moe.push(moe.checkpoint, "back", tmp_path)
    moe.assert_serves_fresh()


def test_reload_weights_brings_the_checkpoint_back_exactly(moe, tmp_path):
    moe.push(moe.modified(seed=3), "new-3", tmp_path)
    moe.restore()
    moe.assert_serves_fresh()


def test_a_push_missing_an_expert_or_with_one_of_a_wrong_shape_is_refused_before_any_byte_moves(moe, tmp_path):
    """400, naming the layer or the tensor, whether the metadata comes with the start or with a
    one-call push; nothing is touched: every engine serves as it did fresh, none is held out."""
    left_out = "model.layers.1.mlp.experts.1.up_proj.weight"
    transposed = "model.layers.0.mlp.experts.0.down_proj.weight"
    partial = {name: t for name, t in moe.checkpoint.items() if name != left_out}
    wrong = {**moe.checkpoint, transposed: moe.checkpoint[transposed].t().contiguous()}
    for weights, said in ((partial, f"({left_out} left out)"), (wrong, f"wrong shape for {transposed!r}")):
        for how in ((), ("--one-call",)):
            done = run_trainer(moe.server, save(weights, tmp_path / "refused.safetensors"), "refused", *how)
            assert done.returncode == 3 and "refused 400" in done.stdout and said in done.stdout, done.stdout
    info = httpx.get(f"{moe.server.url}/weight_info", timeout=60).json()
    assert info["update_phase"] == "idle" and [e["stale_reason"] for e in info["engines"]] == [None, None], info
    moe.assert_serves_fresh()


def test_a_push_of_part_of_a_layers_experts_without_metadata_fails_at_its_finish_and_nothing_wrong_is_served(
    moe, tmp_path
):
    """vLLM's own trainer pieces open an update without its metadata: the experts left out show only
    at the finish. The layer keeps its old experts whole (vLLM alone would serve the left-out
    expert from fresh memory), the finish fails naming it, and no engine serves the mix: each is
    stale until the next push, which lands exactly."""
    new = moe.modified(seed=6)
    partial = {name: t for name, t in new.items() if name != "model.layers.1.mlp.experts.1.up_proj.weight"}
    done = run_python(
        [Path(__file__).with_name("vllm_trainer.py"), moe.server.url,
         str(save(partial, tmp_path / "partial.safetensors")), "partial", str(free_port())],
        capture_output=True, text=True, timeout=180, preload=VLLM_PRELOAD,
    )  # fmt: skip
    said = done.stdout + done.stderr[-3000:]
    assert done.returncode == 1 and "finish failed: 500" in said and "model.layers.1.mlp.experts" in said, said
    assert [e["state"] for e in moe.server.engines()] == ["stale", "stale"], moe.server.engines()
    r = httpx.post(
        f"{moe.server.url}/v1/completions", json={"model": moe.server.model, "prompt": "x", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 503, r.text
    moe.push(moe.checkpoint, "after-the-partial-push", tmp_path)
    moe.assert_serves_fresh()


def test_an_engine_killed_after_a_push_catches_up_from_its_peer_exactly(moe, tmp_path):
    """Engine 1's EngineCore is SIGKILLed after a push: it restarts from the checkpoint and copies
    its peer's weights (the experts in the packed layout both engines compute with). Its new
    process keeps no copy of the checkpoint's tensors to apply a delta on: the trainer's next push,
    a delta on what both engines serve, is refused and sent whole by the trainer itself, and the
    one after is a delta again; each lands exactly."""
    from skyinfer.client import Client
    from skyinfer.trainer import GlooTrainer

    new = {name: t.to(torch.bfloat16) for name, t in moe.modified(seed=4).items()}
    stepped = adamw_step(new)
    with Client(moe.server.url) as client:
        trainer = GlooTrainer(moe.server.url, timeout_s=60, client=client)
        trainer.init()
        dense = pushed_bytes(trainer, new, "caught-up")["dense"]
        before = moe.server.engines()
        vllm_process(before[1]["pid"], "EngineCore").send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 240
        while not ((e := moe.server.engines()[1])["pid"] != before[1]["pid"] and e["state"] == "ready"):
            assert time.monotonic() < deadline, e
            time.sleep(0.5)
        assert e["weight_version"] == "caught-up", e
        moe.sessions = sessions_per_engine(moe.server, moe.server.model)
        moe.assert_matches_transformers(new, tmp_path)

        trainer.init()  # the new process is not in the trainer's group
        assert pushed_bytes(trainer, stepped, "after-the-restart")["sent"] == dense
        moe.assert_matches_transformers(stepped, tmp_path)
        assert pushed_bytes(trainer, new, "a-delta-again")["sent"] < dense / 10
        moe.assert_matches_transformers(new, tmp_path)
    moe.restore()
    moe.assert_serves_fresh()


def test_a_trainer_killed_halfway_through_a_push_leaves_nothing_wrong_served(moe, tmp_path):
    """The trainer dies after sending a third of the tensors (some layers' experts only in part).
    No engine serves those weights: each is stale until the next push, which lands exactly."""
    new = moe.modified(seed=5)
    third = len(new) // 3
    done = run_trainer(moe.server, save(new, tmp_path / "half.safetensors"), "half", "--die-after", str(third))
    assert done.returncode == 9, done.stdout + done.stderr
    deadline = time.monotonic() + 120
    while [e["state"] for e in moe.server.engines()] != ["stale", "stale"]:
        assert time.monotonic() < deadline, moe.server.engines()
        time.sleep(0.5)
    r = httpx.post(
        f"{moe.server.url}/v1/completions", json={"model": moe.server.model, "prompt": "x", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 503, r.text
    moe.push(moe.checkpoint, "after-the-dead-trainer", tmp_path)
    moe.assert_serves_fresh()
