"""Two skyinfer nodes (separate servers on localhost) behind a real vllm-router, one weight group."""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from skyinfer.client import MultiNodeClient, SkyinferError

from lora_support import assert_serves, make_adapter
from pushes import assert_engines_match, modified_weights, run_trainer, save, sessions_per_engine
from support import NO_SPARES, ChildProcess, ServerProcess, free_port, module_servers, running, scrape, total

ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent))


class RouterProcess(ChildProcess):
    """``vllm-router`` with session affinity on X-Session-ID, as the multi-node guide (docs) gives it."""

    ready_path = "/v1/models"

    def __init__(self, worker_urls: list[str], log_path: Path):
        port = free_port()
        argv = [
            ROUTER,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *worker_urls,
            "--policy",
            "consistent_hash",
        ]
        super().__init__(argv, log_path, port)


def _launch(demo_model: Path, logs: Path) -> list[ServerProcess]:
    # Each node on a core of its own, as separate machines would be: nodes sharing
    # cores starve each other's weight-transfer threads.
    return [
        ServerProcess(
            demo_model,
            engines=1,
            log_path=logs / f"node{k}.log",
            cpus={k},
            # No test restarts an engine here: no spare.
            extra_args=("--dtype", "float32", "--enable-lora", "--max-lora-rank", "8", *NO_SPARES),
        )
        for k in range(2)
    ]


nodes = module_servers(__name__, _launch)


@pytest.fixture(scope="module")
def router(nodes, tmp_path_factory):
    assert ROUTER, "vllm-router is not installed (pip install -e .[test])"
    with running(RouterProcess([n.url for n in nodes], tmp_path_factory.mktemp("router") / "router.log")) as proc:
        yield proc


def completions_per_node(nodes) -> list[float]:
    return [
        total(scrape(n), "skyinfer_requests", "skyinfer_requests_total", route="/v1/chat/completions", status="200")
        for n in nodes
    ]


def test_router_serves_openai_clients_with_session_affinity(nodes, router):
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    assert model == nodes[0].model
    chat = [{"role": "user", "content": "through the router"}]
    out = client.chat.completions.create(model=model, messages=chat, max_tokens=4, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4

    def send(session: str, times: int) -> list[float]:
        before = completions_per_node(nodes)
        for _ in range(times):
            client.chat.completions.create(
                model=model, messages=chat, max_tokens=2, extra_headers={"X-Session-ID": session}
            )
        return [a - b for a, b in zip(completions_per_node(nodes), before)]

    # A session for each node (the hash ring decides which).
    session_on: dict[int, str] = {}
    for i in range(40):
        moved = send(f"affinity-{i}", 1)
        session_on.setdefault(moved.index(1), f"affinity-{i}")
        if len(session_on) == 2:
            break
    assert set(session_on) == {0, 1}, "40 sessions all hashed to one node"
    # 20 requests of one session land on that session's node, every one.
    for node, session in session_on.items():
        moved = send(session, 20)
        assert moved[node] == 20 and sum(moved) == 20, f"session {session} spread over nodes: {moved}"


def test_one_trainer_pushes_an_adapter_to_both_nodes_without_a_shared_disk(nodes, demo_model, model_name, tmp_path):
    """Each node keeps its adapters in a directory of its own (a temporary one each): the
    adapter travels over the one gloo group, never through a file both nodes see."""
    adapter = make_adapter(demo_model, tmp_path / "adapter", seed=11)
    trainer = run_trainer(
        nodes[0], adapter, "multi-node-lora-1", "--adapter", "policy", url=",".join(n.url for n in nodes)
    )
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr[-3000:]
    for node in nodes:
        assert httpx.get(f"{node.url}/weight_info", timeout=30).json()["adapters"] == {"policy": "multi-node-lora-1"}
        assert_serves(
            node, model_name, demo_model, "policy", adapter, "multi-node-lora-1", sessions_per_engine(node, model_name)
        )


def test_one_trainer_push_updates_both_nodes(nodes, demo_model, tmp_path):
    client = MultiNodeClient([n.url for n in nodes])
    assert httpx.get(f"{nodes[0].url}/get_world_size").json()["world_size"] == 1
    weights = modified_weights(demo_model, seed=7)
    # One trainer process, one gloo group of world size 3: the trainer and one worker per node.
    trainer = run_trainer(
        nodes[0], save(weights, tmp_path / "w.safetensors"), "multi-node-1", url=",".join(n.url for n in nodes)
    )
    assert trainer.returncode == 0, trainer.stdout + trainer.stderr
    for node in nodes:
        info = httpx.get(f"{node.url}/weight_info", timeout=30).json()
        assert info["weight_version"] == "multi-node-1"
        assert_engines_match(node, node.model, demo_model, weights, "multi-node-1")
    info = asyncio.run(_weight_info(client))
    assert info["weight_version"] == "multi-node-1" and len(info["nodes"]) == 2

    # A trainer's next push is a delta on what both nodes serve: it carries only what changed, and
    # every node's engine ends with exactly the new weights.
    delta = modified_weights(demo_model, seed=8)
    trainer = run_trainer(
        nodes[0],
        save(delta, tmp_path / "delta.safetensors"),
        "multi-node-2",
        "--delta-from",
        str(tmp_path / "w.safetensors"),
        url=",".join(n.url for n in nodes),
    )
    assert trainer.returncode == 0 and "sending a delta" in trainer.stdout, trainer.stdout + trainer.stderr
    for node in nodes:
        sent = httpx.get(f"{node.url}/weight_info", timeout=30).json()["last_push"]["bytes"]
        assert sent["sent"] < sent["dense"], sent
        assert_engines_match(node, node.model, demo_model, delta, "multi-node-2")


async def _weight_info(client: MultiNodeClient) -> dict:
    async with client:
        return await client.weight_info()


async def test_a_stopped_node_is_reported_and_the_other_keeps_serving(nodes, router):
    client = MultiNodeClient([n.url for n in nodes], router_url=router.url, retries=0)
    async with client:
        assert (await client.pause(mode="keep"))["status"] == "paused"
        assert (await client.resume())["status"] == "resumed"
        nodes[1].stop()
        with pytest.raises(SkyinferError) as failed:
            await client.pause(mode="keep")
        assert nodes[1].url in failed.value.message and nodes[0].url not in failed.value.message
        assert [n["status"] for n in failed.value.body["nodes"]] == [200, 503]
        # The live node did pause; resuming reports the dead one again, and resumes the live one.
        with pytest.raises(SkyinferError):
            await client.resume()
        assert not await client.nodes[0].is_paused()
        with pytest.raises(SkyinferError):
            await client.engines()
        # The router takes the dead node out; every session is then served by the live one.
        deadline = time.monotonic() + 90
        ok_in_a_row = 0
        while ok_in_a_row < 10:
            assert time.monotonic() < deadline, "the router kept sending requests to the stopped node"
            try:
                await client.complete("still there?", max_tokens=2, session_id=f"after-stop-{ok_in_a_row}")
                ok_in_a_row += 1
            except SkyinferError:
                ok_in_a_row = 0
                await asyncio.sleep(1)
        for i in range(20):
            out = await client.complete("still there?", max_tokens=2, session_id=f"after-stop-many-{i}")
            assert out["usage"]["completion_tokens"] == 2
