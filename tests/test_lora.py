"""LoRA adapters across the fleet, with real PEFT adapters, real engines and a real trainer process.

Judged against transformers + peft in float32: an adapter's greedy logprobs on
every engine, after path loads, in-place reloads and pushes over the transfer
group, two adapters at once, sleep and wake, bad adapters, a trainer killed
mid-push, an engine hung during a load, and engines killed while
adapters are loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from lora_support import LONG_PROMPT, assert_serves, complete, make_adapter, served_vs_reference, write_adapter
from pushes import run_trainer, sessions_per_engine
from support import ServerProcess, engine_socket, is_openai_error, module_servers, run_example, vllm_process

pytestmark = pytest.mark.timeout(900)

MAX_RANK = 16


def _launch(demo_model: Path, logs: Path) -> ServerProcess:
    (logs / "adapter-store").mkdir()
    return ServerProcess(
        demo_model,
        engines=2,
        log_path=logs / "server.log",
        extra_args=(
            "--dtype",
            "float32",
            "--enable-lora",
            "--max-lora-rank",
            str(MAX_RANK),
            "--max-loras",
            "2",
            "--adapter-dir",
            str(logs / "adapter-store"),
            # How long the hung-engine cases wait for the engine that does not answer.
            "--weight-transfer-timeout",
            "10",
        ),
    )


lora_server = module_servers(__name__, _launch)


@pytest.fixture(scope="module")
def adapter_store(lora_server) -> Path:
    """The server's --adapter-dir."""
    return lora_server.log_path.parent / "adapter-store"


@pytest.fixture(scope="module")
def adapters(demo_model, tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(demo_model, root / name, seed) for name, seed in (("A", 1), ("B", 2), ("C", 3), ("D", 4))
    }


@pytest.fixture(scope="module")
def sessions(lora_server, model_name) -> dict[int, str]:
    """A sticky session on each engine."""
    return sessions_per_engine(lora_server, model_name)


def load(server, name: str, path, version: str | None = None, inplace: bool = False) -> httpx.Response:
    body = {
        "lora_name": name,
        "lora_path": str(path),
        "load_inplace": inplace,
        **({"version": version} if version else {}),
    }
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=120)


def fleet_adapters(server) -> dict[str, str]:
    info = httpx.get(f"{server.url}/weight_info", timeout=30).json()
    per_engine = [e["adapters"] for e in info["engines"]]
    assert all(held == info["adapters"] for held in per_engine), (info["adapters"], per_engine)
    return info["adapters"]


def engine_models(server, engine: int) -> set[str]:
    """What one engine itself lists, asked behind the front's back."""
    transport = httpx.HTTPTransport(uds=engine_socket(server, engine))
    with httpx.Client(transport=transport, base_url="http://engine", timeout=30) as http:
        return {m["id"] for m in http.get("/v1/models").json()["data"]}


def test_an_adapter_serves_its_peft_weights_on_every_engine_and_leaves_the_base_alone(
    lora_server, demo_model, model_name, adapters, sessions
):
    before = {e: complete(lora_server, model_name, LONG_PROMPT, s).json()["choices"][0] for e, s in sessions.items()}
    r = load(lora_server, "policy", adapters["A"], "policy-1")
    assert r.status_code == 200, r.text
    assert_serves(lora_server, model_name, demo_model, "policy", adapters["A"], "policy-1", sessions)
    # The adapter really changes the model: the base model's reference is far from what it serves.
    far, _ = served_vs_reference(lora_server, model_name, demo_model, "policy", None, LONG_PROMPT, sessions[0])
    assert far > 0.5
    for engine, session in sessions.items():
        after = complete(lora_server, model_name, LONG_PROMPT, session)
        assert after.headers["X-Weight-Version"] == "default"
        choice = after.json()["choices"][0]
        assert choice["token_ids"] == before[engine]["token_ids"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(
            before[engine]["logprobs"]["token_logprobs"], abs=1e-4
        )
        assert engine_models(lora_server, engine) == {model_name, "policy"}
    assert "policy" in {m["id"] for m in httpx.get(f"{lora_server.url}/v1/models", timeout=30).json()["data"]}
    assert fleet_adapters(lora_server) == {"policy": "policy-1"}


def test_reload_in_place_serves_the_new_weights_read_once_never_stale_cache(
    lora_server, demo_model, model_name, adapters, sessions, adapter_store
):
    # Blocks of the long prompt are now cached on each engine, computed with A.
    for session in sessions.values():
        complete(lora_server, "policy", LONG_PROMPT, session)
    assert load(lora_server, "policy", adapters["B"], "policy-2").status_code == 400  # not in place: refused
    r = load(lora_server, "policy", adapters["B"], "policy-2", inplace=True)
    assert r.status_code == 200, r.text
    assert_serves(lora_server, model_name, demo_model, "policy", adapters["B"], "policy-2", sessions)
    # Read once: with its files gone, the adapter keeps serving (vLLM #33791 re-read them on every step).
    (version_dir,) = list(adapter_store.iterdir())
    hidden = adapter_store.parent / "hidden-adapter"
    shutil.move(version_dir, hidden)
    try:
        assert_serves(lora_server, model_name, demo_model, "policy", adapters["B"], "policy-2", sessions)
    finally:
        shutil.move(hidden, version_dir)


def test_a_pushed_adapter_replaces_the_old_one_on_every_engine(lora_server, demo_model, model_name, adapters, sessions):
    done = run_trainer(lora_server, adapters["C"], "policy-3", "--adapter", "policy")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    # The long prompt's blocks were cached with B: a stale block would show here.
    assert_serves(lora_server, model_name, demo_model, "policy", adapters["C"], "policy-3", sessions)
    assert fleet_adapters(lora_server) == {"policy": "policy-3"}


def test_two_adapters_at_once_each_with_its_weights_and_version(
    lora_server, demo_model, model_name, adapters, sessions
):
    r = load(lora_server, "critic", adapters["D"], "critic-1")
    assert r.status_code == 200, r.text
    assert_serves(lora_server, model_name, demo_model, "critic", adapters["D"], "critic-1", sessions)
    assert_serves(lora_server, model_name, demo_model, "policy", adapters["C"], "policy-3", sessions)
    assert fleet_adapters(lora_server) == {"policy": "policy-3", "critic": "critic-1"}


def test_sleep_and_wake_keep_the_adapters(lora_server, demo_model, model_name, adapters, sessions):
    assert httpx.post(f"{lora_server.url}/sleep", params={"level": 1}, timeout=120).status_code == 200
    assert httpx.post(f"{lora_server.url}/wake_up", timeout=120).status_code == 200
    assert_serves(lora_server, model_name, demo_model, "critic", adapters["D"], "critic-1", sessions)
    assert_serves(lora_server, model_name, demo_model, "policy", adapters["C"], "policy-3", sessions)


def test_bad_adapters_are_refused_naming_the_problem_and_nothing_is_loaded(
    lora_server, demo_model, model_name, adapters, tmp_path
):
    unknown = httpx.post(
        f"{lora_server.url}/v1/completions", json={"model": "nobody", "prompt": "x", "max_tokens": 2}, timeout=30
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == 404
    rank, hidden = MAX_RANK * 2, 128
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    prefix = "base_model.model.model.layers.0.self_attn"
    bad = {
        "missing": (tmp_path / "nowhere", "does not exist"),
        "rank": (make_adapter(demo_model, tmp_path / "rank", seed=5, rank=rank), f"rank {rank}"),
        "shape": (
            write_adapter(
                tmp_path / "shape",
                config,
                {
                    f"{prefix}.q_proj.lora_A.weight": torch.zeros(8, hidden // 2),
                    f"{prefix}.q_proj.lora_B.weight": torch.zeros(hidden, 8),
                },
            ),
            "'model.layers.0.self_attn.q_proj'",
        ),
        "module": (
            write_adapter(
                tmp_path / "module",
                config,
                {
                    f"{prefix}.z_proj.lora_A.weight": torch.zeros(8, hidden),
                    f"{prefix}.z_proj.lora_B.weight": torch.zeros(hidden, 8),
                },
            ),
            "does not have",
        ),
        "pickle": (write_adapter(tmp_path / "pickle", config, {}), "safetensors only"),
    }
    (tmp_path / "pickle" / "adapter_model.safetensors").rename(tmp_path / "pickle" / "adapter_model.bin")
    for case, (path, says) in bad.items():
        r = load(lora_server, f"bad-{case}", path)
        assert r.status_code == 400, (case, r.text)
        assert says in r.json()["error"]["message"], (case, r.json())
    # A push with a wrong shape is refused before any byte moves: the trainer hears it, nothing hangs.
    done = run_trainer(lora_server, bad["shape"][0], "bad-push", "--adapter", "bad-push")
    assert done.returncode == 3 and "refused 400" in done.stdout and "q_proj" in done.stdout, (
        done.stdout + done.stderr[-2000:]
    )
    assert load(lora_server, "critic", adapters["A"]).status_code == 400  # already loaded, not in place
    assert (
        httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "nobody"}, timeout=30).status_code
        == 404
    )
    assert fleet_adapters(lora_server) == {"policy": "policy-3", "critic": "critic-1"}
    for engine in (0, 1):
        assert engine_models(lora_server, engine) == {model_name, "policy", "critic"}


def fuzzed_adapter_bodies(rng: random.Random, paths: list[str], model_name: str) -> list[tuple[str, object]]:
    """Bodies of every wrong kind for the adapter routes, and some right ones for names nobody uses."""
    names = ["", "policy", "critic", model_name, "x" * 5000, "../../etc", "é💥", None, 7, ["policy"], "fuzz-new"]
    values = [None, True, 3, -1, 1e308, "", "x" * 5000, [], {}, "a\r\nX-Evil: 1", "\u0000", "%00", "é💥"]
    out = []
    for _ in range(200):
        route = rng.choice(["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/update_lora_adapter"])
        # Unloading a name the fleet serves would succeed: those names only go to the load routes.
        name = rng.choice(
            names if route != "/v1/unload_lora_adapter" else [n for n in names if n not in ("policy", "critic")]
        )
        body = {
            "lora_name": name,
            "lora_path": rng.choice(paths + values),
            "load_inplace": rng.choice([True, False, "yes", None]),
            "version": rng.choice([*values, "ok-1"]),
            "peft_config": rng.choice([{}, {"r": 8}, {"r": "8"}, None, []]),
            "update_info": rng.choice([{}, {"names": ["x"], "dtype_names": ["float32"], "shapes": [[2]]}, None, []]),
        }
        for key in rng.sample(list(body), rng.randint(0, 3)):
            del body[key]
        out.append((route, rng.choice([body, body, body, [body], "not json", b"\xff\xfe"])))
    return out


def test_fuzzed_adapter_calls_get_4xx_and_change_nothing(lora_server, model_name, adapters, tmp_path):
    pids = [e["pid"] for e in lora_server.engines()]
    before = fleet_adapters(lora_server)
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "adapter_config.json").write_text("{not json")
    (tmp_path / "garbage" / "adapter_model.safetensors").write_bytes(b"\x00" * 7)
    paths = [str(tmp_path / "file"), str(tmp_path / "garbage"), "/nonexistent", "relative/dir", "/tmp\x00x", "/"]
    statuses, offenders = {}, []
    with httpx.Client(base_url=lora_server.url, timeout=60) as http:
        for route, body in fuzzed_adapter_bodies(random.Random(1122), paths, model_name):
            r = http.post(route, content=body) if isinstance(body, (str, bytes)) else http.post(route, json=body)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if not (400 <= r.status_code < 500 and is_openai_error(r)):
                offenders.append((route, str(body)[:200], r.status_code, r.text[:300]))
    print("adapter routes:", sorted(statuses.items()))
    assert not offenders, offenders[:10]
    assert fleet_adapters(lora_server) == before
    assert [e["pid"] for e in lora_server.engines()] == pids
    for engine in (0, 1):
        assert engine_models(lora_server, engine) == {model_name, *before}


def test_trainer_killed_mid_push_leaves_the_fleet_serving_and_the_next_push_works(
    lora_server, demo_model, model_name, adapters, sessions
):
    pids = [e["pid"] for e in lora_server.engines()]
    started = time.monotonic()
    died = run_trainer(lora_server, adapters["A"], "policy-4", "--adapter", "policy", "--die-after", "3")
    assert died.returncode == 9, died.stdout + died.stderr[-2000:]
    # The engines' side of the transfer broke; the adapter they serve did not change, and nothing waits.
    deadline = time.monotonic() + 60
    while httpx.get(f"{lora_server.url}/weight_info", timeout=30).json()["engines"][0]["in_transfer_group"]:
        assert time.monotonic() < deadline, "the broken push was never noticed"
        time.sleep(0.5)
    print(f"broken push noticed {time.monotonic() - started:.1f}s after the trainer started")
    assert [e["pid"] for e in lora_server.engines()] == pids
    assert fleet_adapters(lora_server) == {"policy": "policy-3", "critic": "critic-1"}
    assert_serves(lora_server, model_name, demo_model, "policy", adapters["C"], "policy-3", sessions)
    done = run_trainer(lora_server, adapters["A"], "policy-4", "--adapter", "policy")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert_serves(lora_server, model_name, demo_model, "policy", adapters["A"], "policy-4", sessions)


async def _wait_ready(http: httpx.AsyncClient, restarts: list[int], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        engines = (await http.get("/engines")).json()["engines"]
        if [e["state"] for e in engines] == ["ready", "ready"] and [e["restarts"] for e in engines] == restarts:
            return
        assert time.monotonic() < deadline, engines
        await asyncio.sleep(0.5)


async def test_a_hung_load_is_rolled_back_and_killed_engines_come_back_with_the_adapters(
    lora_server, demo_model, model_name, adapters
):
    """Engine 1 hangs (SIGSTOP) during a load: engine 0 is put back, engine 1 (its adapters
    unknown) restarted, and the call answers per engine. Meanwhile engine 0's EngineCore is
    SIGKILLed. Both come back with exactly the fleet's adapters, at the fleet's versions."""
    engines = lora_server.engines()
    restarts = [e["restarts"] for e in engines]
    async with httpx.AsyncClient(base_url=lora_server.url, timeout=300) as http:
        os.kill(engines[1]["pid"], signal.SIGSTOP)
        try:
            r = await http.post("/v1/load_lora_adapter", json={"lora_name": "extra", "lora_path": str(adapters["B"])})
        finally:
            # The front may already have killed and reaped the hung engine.
            with contextlib.suppress(ProcessLookupError):
                os.kill(engines[1]["pid"], signal.SIGCONT)
        assert r.status_code == 504, r.text
        assert [(e["engine"], e["status"]) for e in r.json()["engines"]] == [(0, 200), (1, 504)]
        vllm_process(engines[0]["pid"], "EngineCore").send_signal(signal.SIGKILL)
        await _wait_ready(http, [restarts[0] + 1, restarts[1] + 1])
        missing = await http.post("/v1/completions", json={"model": "extra", "prompt": "x", "max_tokens": 2})
        assert missing.status_code == 404, missing.text
    assert fleet_adapters(lora_server) == {"policy": "policy-4", "critic": "critic-1"}
    sessions = sessions_per_engine(lora_server, model_name)
    assert_serves(lora_server, model_name, demo_model, "policy", adapters["A"], "policy-4", sessions)
    assert_serves(lora_server, model_name, demo_model, "critic", adapters["D"], "critic-1", sessions)
    for engine in (0, 1):
        assert engine_models(lora_server, engine) == {model_name, "policy", "critic"}


def test_an_unloaded_adapter_leaves_every_engine_and_the_store(lora_server, model_name, adapters, adapter_store):
    """An unload takes the adapter off every engine (each says so itself) and its version out of
    the store; a request naming it is a 404 and the other adapters serve on. (An unload one engine
    does not answer is in test_fake_fleet.)"""
    stored = set(adapter_store.iterdir())
    assert load(lora_server, "doomed", adapters["B"], version="doomed-1").status_code == 200
    assert all("doomed" in engine_models(lora_server, engine) for engine in (0, 1))
    r = httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "doomed"}, timeout=60)
    assert r.status_code == 200 and [(e["engine"], e["status"]) for e in r.json()["engines"]] == [(0, 200), (1, 200)]
    for engine in (0, 1):
        assert engine_models(lora_server, engine) == {model_name, "policy", "critic"}
    assert set(adapter_store.iterdir()) == stored
    assert fleet_adapters(lora_server) == {"policy": "policy-4", "critic": "critic-1"}
    body = {"prompt": "x", "max_tokens": 2}
    gone = httpx.post(f"{lora_server.url}/v1/completions", json={**body, "model": "doomed"}, timeout=60)
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError", gone.text
    kept = httpx.post(f"{lora_server.url}/v1/completions", json={**body, "model": "policy"}, timeout=60)
    assert kept.status_code == 200, kept.text


def test_the_lora_rl_loop_example_pushes_a_trained_adapter_each_iteration(lora_server):
    done = run_example("rl_loop_lora.py", "--url", lora_server.url, "--iterations", "3")
    lines = done.stdout.strip().splitlines()
    assert len([line for line in lines if line.startswith("iter ")]) == 3
    summary = json.loads(lines[-1])
    # Rollouts of iteration k ran on the adapter of step k (the example asserts it per rollout).
    assert summary["versions_seen"] == [["rl-policy-step-0"], ["rl-policy-step-1"], ["rl-policy-step-2"]]
    assert summary["final_version"] == "rl-policy-step-3"
    assert all(it["loss"] == it["loss"] for it in summary["iterations"])  # no NaN from the optimizer step
    assert fleet_adapters(lora_server)["rl-policy"] == "rl-policy-step-3"
    # The base weights were never touched.
    assert summary["base_version"] is None
