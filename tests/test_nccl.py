"""The NCCL path, as a GPU runs it, on CPU: vLLM's own NCCL trainer engine
(``NCCLTrainerWeightTransferEngine``, packed and not) in a process of its own (tests/nccl_trainer.py)
pushes into two real engines of a server started with ``--weight-transport nccl``. Every line of
both sides is what a GPU runs, but NCCL's communicator (skyinfer's ``GlooCommunicator`` in its
place, on both sides) and CUDA's streams (the trainer's, stood in).

Judged as every push test is: greedy logprobs within 0.05 of a transformers float32 forward of the
weights pushed. Faults as for gloo: the trainer killed mid-push, an EngineCore killed mid-receive.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from forked_python import VLLM_PRELOAD, ForkedPopen, run_python
from pushes import assert_engines_match, modified_weights, save, sessions_per_engine
from support import NO_SPARES, ServerProcess, module_servers, vllm_process

NCCL_TRAINER = Path(__file__).with_name("nccl_trainer.py")


def _launch(demo_model: Path, logs: Path) -> ServerProcess:
    # A killed trainer's collectives end with the group's timeout.
    extra = (
        "--weight-transport",
        "nccl",
        "--dtype",
        "float32",
        "--weight-transfer-timeout",
        "20",
        "--hold-requests",
        "1",
        *NO_SPARES,
    )
    return ServerProcess(demo_model, engines=2, log_path=logs / "nccl.log", extra_args=extra)


nccl_server = module_servers(__name__, _launch)


def run_nccl_trainer(server, weights: Path, version: str, *extra: str) -> subprocess.CompletedProcess:
    return run_python(
        [NCCL_TRAINER, server.url, str(weights), version, *extra],
        capture_output=True,
        text=True,
        timeout=180,
        preload=VLLM_PRELOAD,
    )


def engines(server) -> list[dict]:
    return httpx.get(f"{server.url}/engines", timeout=30).json()["engines"]


def wait_states(server, states: list[str], timeout_s: float = 180) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = engines(server)
        if [e["state"] for e in found] == states:
            return found
        assert time.monotonic() < deadline, found
        time.sleep(0.5)


def test_the_server_receives_over_nccl_with_skyinfers_receiver(nccl_server):
    """Every engine runs skyinfer's NCCL backend (its receiver), as vLLM's config says."""
    info = httpx.get(f"{nccl_server.url}/server_info", params={"config_format": "json"}, timeout=30).json()
    info = info["vllm_config"]
    assert info["weight_transfer_config"] == {"backend": "skyinfer_nccl"}, info["weight_transfer_config"]


# (args, what it is): vLLM's default packing (one chunk of 1 GiB), chunks of 64 KiB (several), and a
# broadcast per tensor.
WIRES = {
    "packed": (),
    "packed in chunks": ("--buffer-bytes", str(64 * 1024)),
    "unpacked": ("--unpacked",),
}


@pytest.mark.parametrize("wire", list(WIRES))
def test_vllms_nccl_trainer_engine_pushes_into_every_engine(nccl_server, model_name, demo_model, tmp_path, wire):
    weights = modified_weights(demo_model, seed=30 + list(WIRES).index(wire))
    version = f"nccl-{wire.replace(' ', '-')}"
    pushed = run_nccl_trainer(nccl_server, save(weights, tmp_path / "w.safetensors"), version, *WIRES[wire])
    assert pushed.returncode == 0 and f"pushed {version}" in pushed.stdout, pushed.stdout + pushed.stderr[-3000:]
    assert_engines_match(nccl_server, model_name, demo_model, weights, version)


def test_a_push_of_part_of_a_fused_layer_keeps_the_rest_as_served(nccl_server, model_name, demo_model, tmp_path):
    """q of q/k/v and up of gate/up, alone: the engines keep k, v and gate as they serve them (vLLM's
    own NCCL backend serves NaN there, without an error)."""
    whole = modified_weights(demo_model, seed=36)
    pushed = run_nccl_trainer(nccl_server, save(whole, tmp_path / "whole.safetensors"), "nccl-whole")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr[-3000:]
    new = modified_weights(demo_model, seed=37)
    part = {name: new[name] for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight")}
    pushed = run_nccl_trainer(nccl_server, save(part, tmp_path / "part.safetensors"), "nccl-part", "--unpacked")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr[-3000:]
    assert_engines_match(nccl_server, model_name, demo_model, {**whole, **part}, "nccl-part")


def test_a_trainer_killed_mid_push_leaves_every_engine_stale_until_the_next_push(
    nccl_server, model_name, demo_model, tmp_path
):
    """The trainer dies after sending 3 tensors one at a time: no engine serves what it held (each
    stale, in its own process, saying why), and the next push lands whole."""
    pids = [e["pid"] for e in engines(nccl_server)]
    weights = modified_weights(demo_model, seed=38)
    path = save(weights, tmp_path / "w.safetensors")
    died = run_nccl_trainer(nccl_server, path, "nccl-never-served", "--unpacked", "--die-after", "3")
    assert died.returncode == 9, died.stdout + died.stderr[-3000:]
    stale = wait_states(nccl_server, ["stale", "stale"])
    assert [e["pid"] for e in stale] == pids and all("aborted" in e["stale_reason"] for e in stale), stale
    body = {"model": model_name, "prompt": "x", "max_tokens": 2}
    assert httpx.post(f"{nccl_server.url}/v1/completions", json=body, timeout=60).status_code == 503
    pushed = run_nccl_trainer(nccl_server, path, "nccl-after-the-dead-trainer")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr[-3000:]
    assert_engines_match(nccl_server, model_name, demo_model, weights, "nccl-after-the-dead-trainer")


def test_an_engine_core_killed_mid_receive_leaves_nothing_wrong_served(nccl_server, model_name, demo_model, tmp_path):
    """The trainer has sent 2 tensors and holds the transfer open when engine 1's EngineCore is
    SIGKILLed: engine 1 comes back in a new process, stale; engine 0, inside the trainer's
    broadcast, ends its part once the trainer dies, stale too; the next push lands whole on both."""
    weights = modified_weights(demo_model, seed=39)
    path = save(weights, tmp_path / "w.safetensors")
    before = engines(nccl_server)
    trainer = ForkedPopen(
        [NCCL_TRAINER, nccl_server.url, str(path), "nccl-never-served", "--unpacked", "--hang-after", "2"],
        stdout=subprocess.PIPE,
        text=True,
        preload=VLLM_PRELOAD,
    )
    try:
        assert trainer.stdout.readline().strip() == "hanging after 2 tensors"
        vllm_process(before[1]["pid"], "EngineCore").send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 180
        while (engine := engines(nccl_server)[1])["pid"] == before[1]["pid"] or engine["state"] != "stale":
            assert time.monotonic() < deadline, engine
            time.sleep(0.5)
    finally:
        trainer.kill()
        trainer.wait()
    wait_states(nccl_server, ["stale", "stale"])
    assert engines(nccl_server)[0]["pid"] == before[0]["pid"]
    pushed = run_nccl_trainer(nccl_server, path, "nccl-after-the-kill")
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr[-3000:]
    sessions_per_engine(nccl_server, model_name)
    assert_engines_match(nccl_server, model_name, demo_model, weights, "nccl-after-the-kill")
