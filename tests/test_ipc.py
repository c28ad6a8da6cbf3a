"""The CUDA IPC path, as a GPU runs it, on CPU: skyinfer's ``IPCTrainer`` in a process of its own
(tests/trainer_process.py ``--transport ipc``) pushes into two real engines of a colocated server
started with ``--weight-transport ipc``. Every line of both sides is what a GPU runs, but the
device primitive: the handle made and opened (CUDA IPC on a GPU; here torch's shared memory for CPU
tensors, in the same JSON fields, chosen by the device on each side).

Judged as every push test is (greedy logprobs within 0.05 of a transformers float32 forward of the
weights pushed), inside a colocated trainer's step; faults as for the shared-memory transport: the
trainer killed at each phase, an engine hung at the update, an EngineCore killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from pushes import assert_engines_match, modified_weights, run_trainer, save, two_pushes_into_one_segment
from support import ServerProcess, engine_tree, mapped_files, module_servers, vllm_process

ABORTED = "a weight update was aborted"


def _launch(demo_model: Path, logs: Path) -> ServerProcess:
    extra = (
        "--colocate",
        "--weight-transport",
        "ipc",
        "--dtype",
        "float32",
        # A hung engine's push times out in seconds; probes fast enough for a test.
        "--weight-transfer-timeout",
        "8",
        "--health-interval",
        "1",
        "--health-timeout",
        "4",
        "--hold-requests",
        "1",
    )
    return ServerProcess(demo_model, engines=2, log_path=logs / "ipc.log", extra_args=extra)


ipc_server = module_servers(__name__, _launch)


class Pushes:
    def __init__(self, demo_model: Path, directory: Path):
        self.demo_model, self.directory, self.count = demo_model, directory, 0

    def next(self) -> tuple[dict, Path, str]:
        self.count += 1
        weights = modified_weights(self.demo_model, seed=60 + self.count)
        return weights, save(weights, self.directory / f"push-{self.count}.safetensors"), f"ipc-{self.count}"


@pytest.fixture(scope="module")
def pushes(demo_model, tmp_path_factory) -> Pushes:
    return Pushes(demo_model, tmp_path_factory.mktemp("ipc-pushes"))


def ipc_push(server, path: Path, version: str, *extra: str, level: int = 1) -> subprocess.CompletedProcess:
    """A colocated trainer's step with ``IPCTrainer``: sleep, wake the weights, push, wake the KV cache."""
    return run_trainer(server, path, version, "--transport", "ipc", "--colocated-step", str(level), *extra)


def engines(server) -> list[dict]:
    return server.engines()


def mapped_by_engines(server) -> list[set[str]]:
    """Per engine, the trainers' segments its processes map (its workers' open packed buffers)."""
    prefix = httpx.get(f"{server.url}/weight_info", timeout=30).json()["shm_prefixes"]["pushes"]
    return [mapped_files(engine_tree(e["pid"]), prefix) for e in engines(server)]


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < deadline, what
        time.sleep(0.5)
    return value


def admin(server, path: str, **params) -> None:
    r = httpx.post(f"{server.url}{path}", params=params, timeout=120)
    assert r.status_code == 200, r.text


def test_the_server_receives_through_skyinfers_ipc_receiver(ipc_server):
    info = httpx.get(f"{ipc_server.url}/server_info", params={"config_format": "json"}, timeout=30).json()
    assert info["vllm_config"]["weight_transfer_config"] == {"backend": "skyinfer_ipc"}
    assert httpx.get(f"{ipc_server.url}/weight_info", timeout=30).json()["transport"] == "ipc"


@pytest.mark.parametrize("level", [1, 2])
def test_an_ipc_trainers_push_lands_on_every_engine(ipc_server, demo_model, pushes, level):
    """After a level-1 sleep (weights kept) or a level-2 one (weights discarded): each engine maps
    the trainer's tensors by their handles and serves them; the trainer's segments go with it."""
    weights, path, version = pushes.next()
    pushed = ipc_push(ipc_server, path, version, level=level)
    assert pushed.returncode == 0 and f"pushed {version}" in pushed.stdout, pushed.stdout + pushed.stderr[-3000:]
    assert_engines_match(ipc_server, ipc_server.model, demo_model, weights, version)


@pytest.mark.parametrize("phase", ["segment", "update", "finish"])
def test_a_trainer_killed_mid_push_costs_no_restart(ipc_server, demo_model, pushes, phase):
    """The trainer dies with its handles exported and before /update_weights, while that call is in
    flight, or before /finish_weight_update: no engine restarts; the engines either never began
    (and serve as before) or are held out as stale; the segment its handles named is gone; the next
    push lands."""
    before = [(e["pid"], e["restarts"]) for e in engines(ipc_server)]
    _, path, version = pushes.next()
    dead = ipc_push(ipc_server, path, version, "--die-at", phase, "--timeout", "3")
    assert dead.returncode == 9, dead.stdout + dead.stderr[-3000:]
    wait_until(
        lambda: httpx.get(f"{ipc_server.url}/weight_info", timeout=30).json()["update_phase"] == "idle",
        30,
        "the update stays open",
    )
    wait_until(lambda: not ipc_server.shm_files(), 30, "a segment of the trainer's handles is left in /dev/shm")
    # Nor held open by a worker: the buffer of an aborted update's trainer goes with the abort.
    assert mapped_by_engines(ipc_server) == [set(), set()]
    assert [(e["pid"], e["restarts"]) for e in engines(ipc_server)] == before
    stale = [e["stale_reason"] for e in engines(ipc_server)]
    if phase == "segment":
        assert stale == [None, None]  # no engine had begun the update
    else:
        assert all(reason and reason.startswith(ABORTED) for reason in stale), stale
    weights, path, version = pushes.next()
    pushed = ipc_push(ipc_server, path, version)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr[-3000:]
    assert_engines_match(ipc_server, ipc_server.model, demo_model, weights, version)


def test_an_ipc_trainer_packs_every_push_into_the_buffer_it_exported_once(ipc_server, demo_model, pushes):
    """One trainer process pushes twice, packed (``IPCTrainer``'s default). Its first push makes and
    exports its buffer (on a CPU, the stand-in's segment); every engine's worker opens it and keeps
    it open after the finish. The second push packs other weights into the same buffer (the same
    file), which the server left in place: every engine serves them exactly, read through the
    mapping it kept. The trainer's exit lets the buffer go."""

    def kept_open(segment: str) -> None:
        assert mapped_by_engines(ipc_server) == [{os.path.basename(segment)}] * 2

    trainer, _ = two_pushes_into_one_segment(ipc_server, demo_model, pushes, "ipc", kept_open)
    try:
        trainer.stdin.close()
        assert trainer.wait(60) == 0, trainer.stderr.read()
    finally:
        trainer.kill()
    assert not ipc_server.shm_files("pushes")


def test_an_engine_hung_at_the_update_is_restarted_and_one_killed_comes_back(ipc_server, demo_model, pushes):
    """The fleet asleep (level 1) with its weights awake. Engine 1's EngineCore stops (SIGSTOP)
    right before the trainer's update call: the push times out on it and fails, engine 0 ends the
    update in its own process (stale), engine 1 is restarted. Then engine 0's EngineCore is
    SIGKILLed: it comes back from the checkpoint (stale); the next push covers both, and no segment
    of the pushes is left in /dev/shm."""
    admin(ipc_server, "/sleep", level="1")
    admin(ipc_server, "/wake_up", tags="weights")
    pid0, pid1 = (e["pid"] for e in engines(ipc_server))
    core = vllm_process(pid1, "EngineCore")
    try:
        _, path, version = pushes.next()
        failed = run_trainer(ipc_server, path, version, "--transport", "ipc", "--stop-before-update", str(core.pid))
        assert failed.returncode == 3 and "refused 504" in failed.stdout, failed.stdout + failed.stderr[-3000:]
        assert engines(ipc_server)[0]["stale_reason"].startswith(ABORTED)
        wait_until(lambda: engines(ipc_server)[1]["pid"] != pid1, 60, "engine 1 was not restarted")
    finally:
        if core.is_running():
            core.send_signal(signal.SIGCONT)
    vllm_process(pid0, "EngineCore").send_signal(signal.SIGKILL)
    wait_until(
        lambda: all(e["pid"] not in (pid0, pid1) and e["state"] == "sleeping" for e in engines(ipc_server)),
        240,
        "no restart",
    )
    assert all(e["stale_reason"].startswith("it restarted from the checkpoint on disk") for e in engines(ipc_server))
    assert not ipc_server.shm_files()
    weights, path, version = pushes.next()
    pushed = ipc_push(ipc_server, path, version)
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr[-3000:]
    assert_engines_match(ipc_server, ipc_server.model, demo_model, weights, version)
    assert not ipc_server.shm_files()


def test_a_packed_update_one_handle_for_all_its_tensors_lands(ipc_server, demo_model, pushes):
    """vLLM's packed form, as its IPC trainer engine sends each chunk: one buffer's handle and each
    tensor's size in it. Each worker opens the buffer once and copies every tensor out of it; the
    weights land. (Sent from this process, with the stand-in's handle, as that trainer would.)"""
    from skyinfer.transfer.ipc import HOST_MEMORY_UUID, encode_handle, export_handles
    from skyinfer.transfer.packing import dtype_name, pack

    weights, _path, version = pushes.next()
    init = httpx.post(f"{ipc_server.url}/init_weight_transfer", json={"init_info": {"packed": True}}, timeout=120)
    assert init.status_code == 200, init.text
    names = sorted(weights)
    segment = f"{init.json()['segment_prefix']}{uuid.uuid4().hex}"
    (handle,) = export_handles([pack([weights[name] for name in names])], segment)
    update_info = {
        "names": names,
        "dtype_names": [dtype_name(weights[name].dtype) for name in names],
        "shapes": [list(weights[name].shape) for name in names],
        "ipc_handles": {HOST_MEMORY_UUID: encode_handle(handle)},
        "tensor_sizes": [weights[name].numel() * weights[name].element_size() for name in names],
    }
    try:
        body = {"update_info": update_info, "weight_version": version}
        r = httpx.post(f"{ipc_server.url}/update_weights", json=body, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        Path(f"/dev/shm/{segment}").unlink(missing_ok=True)
    assert_engines_match(ipc_server, ipc_server.model, demo_model, weights, version)
