"""Fast unit tests of routing policy, device layout, adapter checks and the demo model; no engines."""

from __future__ import annotations

import asyncio
import collections
import inspect
import json
import os
import re
import subprocess
import sys

import orjson
import pytest

from skyinfer.config import ServeConfig
from skyinfer.demo_model import VOCAB_SIZE, build_demo_model
from skyinfer.devices import plan_engine_devices, split_cores, split_gpus
from skyinfer.fleet.routing import Candidate, SessionRouter
from skyinfer.front.app import build_registry
from skyinfer.ranks import LayoutError
from skyinfer.serving.proxy import prompt_group


def candidates(*loads: int) -> list[Candidate]:
    return [Candidate(i, load) for i, load in enumerate(loads)]


def test_router_sticks_and_prefers_least_loaded():
    router = SessionRouter()
    first = router.choose(candidates(0, 0), "a")
    assert all(router.choose(candidates(5, 5), "a") == first for _ in range(10))
    # A new session goes to the less loaded engine.
    assert router.choose(candidates(3, 0), "b") == 1
    assert router.choose(candidates(0, 3), "c") == 0
    # Without a session: least loaded.
    assert router.choose(candidates(2, 1, 0)) == 2


def test_router_spreads_sequential_sessions_and_requests():
    router = SessionRouter()
    sessions = collections.Counter(router.choose(candidates(0, 0, 0), f"s{i}") for i in range(30))
    assert sessions == {0: 10, 1: 10, 2: 10}
    plain = collections.Counter(router.choose(candidates(0, 0)) for _ in range(10))
    assert plain == {0: 5, 1: 5}


def test_router_moves_session_off_a_missing_engine():
    router = SessionRouter()
    assert router.choose(candidates(0, 0), "s") in (0, 1)
    bound = router.engine_of("s")
    survivor = 1 - bound
    assert router.choose([Candidate(survivor, 0)], "s") == survivor
    assert router.engine_of("s") == survivor
    assert router.session_count(bound) == 0 and router.session_count(survivor) == 1


def test_router_forgets_oldest_sessions_beyond_limit():
    router = SessionRouter(max_sessions=3)
    for i in range(5):
        router.choose(candidates(0, 0), f"s{i}")
    assert router.engine_of("s0") is None and router.engine_of("s1") is None
    assert router.engine_of("s4") is not None
    assert router.session_count(0) + router.session_count(1) == 3


def test_router_ends_finished_and_idle_sessions():
    now = [0.0]
    router = SessionRouter(idle_ttl_s=60, clock=lambda: now[0])
    cands = [Candidate(0, 0), Candidate(1, 0)]
    a, b = router.choose(cands, "a"), router.choose(cands, "b")
    assert {a, b} == {0, 1}
    assert router.finish("a") == a and router.finish("a") is None and router.finish("never") is None
    assert router.engine_of("a") is None and router.session_count(a) == 0
    now[0] = 50.0
    router.choose(cands, "b")  # in use: stays
    now[0] = 100.0
    router.choose(cands, "c")
    assert router.engine_of("b") == b
    now[0] = 111.0  # b idle 61 s, c 11 s
    router.choose(cands, "c")
    assert router.engine_of("b") is None and router.session_count(b) == 0 and router.engine_of("c") is not None


def test_router_moves_a_session_off_a_far_busier_engine_at_its_next_request():
    router = SessionRouter(rebalance_factor=2)
    bound = router.choose(candidates(0, 0), "s")
    other = 1 - bound

    def loads(on_bound: int, on_other: int) -> list[Candidate]:
        return sorted([Candidate(bound, on_bound), Candidate(other, on_other)], key=lambda c: c.engine_id)

    assert router.choose(loads(4, 1), "s") == bound  # 4 <= 2 x (1 + 1): its prefix cache is worth the wait
    assert router.moves == {}
    assert router.choose(loads(5, 1), "s") == other
    assert router.moves == {bound: 1} and router.session_count(bound) == 0 and router.session_count(other) == 1
    assert router.choose(loads(0, 2), "s") == other  # 2 <= 2 x (0 + 1): stays where it moved
    # Factor 0: sessions never move for load.
    never = SessionRouter()
    first = never.choose(candidates(0, 0), "t")
    assert never.choose([Candidate(first, 100), Candidate(1 - first, 0)], "t") == first and never.moves == {}


def test_router_keeps_a_prompt_group_on_one_engine_within_its_slack():
    router = SessionRouter(group_prefix_chars=64, group_slack=8)
    first = router.choose(candidates(0, 0), group_key=7)
    other = 1 - first

    def loads(on_first: int, on_other: int) -> list[Candidate]:
        return sorted([Candidate(first, on_first), Candidate(other, on_other)], key=lambda c: c.engine_id)

    # The group's samples follow its first one while that engine is within 8 requests of the other.
    assert [router.choose(loads(n, 0), group_key=7) for n in range(1, 9)] == [first] * 8
    # Another group starts where the load is least, and keeps to it.
    assert router.choose(loads(8, 0), group_key=9) == other
    assert router.choose(loads(8, 3), group_key=9) == other
    # Beyond the slack the group moves, and later samples follow it there.
    assert router.choose(loads(11, 2), group_key=7) == other
    assert router.choose(loads(0, 5), group_key=7) == other
    # Without a group key, least-loaded as before.
    assert router.choose(loads(3, 1)) == other


def test_group_key_is_the_prompts_first_characters():
    def key_of(body: bytes, prefix_chars: int):
        return prompt_group(body, prefix_chars)

    body = {"model": "m", "prompt": "p" * 40 + "tail A", "seed": 1, "max_tokens": 4}
    key = key_of(orjson.dumps(body), 30)
    # Same prompt, other sampling fields and key order: the same group.
    assert key_of(orjson.dumps({"seed": 2, **body, "temperature": 1.0}), 30) == key
    # A prompt that differs after the first 30 characters too; one that differs early does not.
    assert key_of(orjson.dumps({**body, "prompt": "p" * 40 + "tail B"}), 30) == key
    assert key_of(orjson.dumps({**body, "prompt": "q" + "p" * 40}), 30) != key
    messages = [{"role": "user", "content": "same question"}]
    assert key_of(orjson.dumps({"messages": messages, "n": 1}), 1024) == key_of(
        orjson.dumps({"messages": messages, "seed": 3}), 1024
    )
    # No prompt, not JSON, or not an object: no key.
    assert key_of(b'{"model": "m"}', 30) is None
    assert key_of(b'{"prompt": ', 30) is None
    assert key_of(b"[1, 2]", 30) is None


def test_router_refuses_empty_candidates():
    with pytest.raises(ValueError):
        SessionRouter().choose([], "s")


def test_cpu_layout_gives_disjoint_cores():
    cores = sorted(os.sched_getaffinity(0))
    plans = plan_engine_devices("cpu", workers_per_engine=(1,) * len(cores), cpu_kvcache_gib=3)
    seen = [p.ids for p in plans]
    assert sorted(i for ids in seen for i in ids) == cores
    assert all(p.env["VLLM_CPU_KVCACHE_SPACE"] == "3" for p in plans)
    assert [p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in plans] == [str(c) for c in cores]


def test_vllms_kv_cache_option_takes_the_place_of_cpu_kvcache_gib(tmp_path):
    """vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE override --kv-cache-memory-bytes: given the
    latter, the engines' environment leaves the variable out."""
    given = ServeConfig(model="m", engines=1, engine_args=("--kv-cache-memory-bytes", "134217728"))
    default = ServeConfig(model="m", engines=1, cpu_kvcache_gib=2)
    assert "VLLM_CPU_KVCACHE_SPACE" not in build_registry(given, "cpu", str(tmp_path)).records[0].devices.env
    assert build_registry(default, "cpu", str(tmp_path)).records[0].devices.env["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_layout_that_does_not_fit_is_an_error():
    too_many = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(LayoutError, match="CPU cores"):
        plan_engine_devices("cpu", workers_per_engine=(1,) * too_many)


def test_demo_model_is_deterministic_and_well_formed(tmp_path):
    a = build_demo_model(tmp_path / "a")
    b = build_demo_model(tmp_path / "b")
    files = sorted(p.name for p in a.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["head_dim"] == 64 and config["tie_word_embeddings"] is True
    tokenizer = json.loads((a / "tokenizer.json").read_text())
    assert len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"]) >= VOCAB_SIZE - 3


def test_demo_model_cli_writes_a_loadable_model(tmp_path):
    out = tmp_path / "cli-model"
    subprocess.run([sys.executable, "-m", "skyinfer", "demo-model", str(out)], check=True, capture_output=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == VOCAB_SIZE == len(tokenizer)
    text = "a b c 123 hello"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_router_ignores_session_counts_for_sessionless_requests():
    router = SessionRouter()
    for i in range(4):
        router.choose([Candidate(0, 0)], f"pinned-{i}")  # engine 0 holds 4 sessions
    plain = collections.Counter(router.choose(candidates(0, 0)) for _ in range(10))
    assert plain == {0: 5, 1: 5}
    assert router.choose(candidates(0, 0), "new") == 1


def test_gpu_layout_gives_each_engine_its_own_group():
    plans = split_gpus([0, 1, 2, 3, 4, 5, 6, 7], workers_per_engine=(4, 4))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["0,1,2,3", "4,5,6,7"]
    assert [p.ids for p in plans] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert all(p.sleep_frees_memory for p in plans)
    # Respects what CUDA_VISIBLE_DEVICES left visible, in its order.
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in split_gpus([3, 1], (1, 1))] == ["3", "1"]
    with pytest.raises(LayoutError, match="need 6 GPUs, but 4 are visible"):
        split_gpus([0, 1, 2, 3], workers_per_engine=(2, 2, 2))


def test_gpu_engines_use_vllms_own_sampler_where_flashinfer_is_missing(monkeypatch):
    """vLLM 0.33's EngineCore died at start-up on an H200 without FlashInfer (docs/gpu-runs/2026-11-26-h200)."""
    import importlib.util

    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert split_gpus([0], (1,))[0].env == {"CUDA_VISIBLE_DEVICES": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert split_gpus([0], (1,))[0].env == {"CUDA_VISIBLE_DEVICES": "0"}
    # The operator's own setting is inherited as it is.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in split_gpus([0], (1,))[0].env


def test_cpu_layout_splits_cores_between_engines_and_ranks():
    plans = split_cores(list(range(8)), workers_per_engine=(2, 2), cpu_kvcache_gib=1)
    assert [p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in plans] == ["0,1|2,3", "4,5|6,7"]
    assert not any(p.sleep_frees_memory for p in plans)


def test_packing_cuts_chunks_where_vllm_does_and_round_trips():
    import torch
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    from skyinfer.transfer.packing import TensorMeta, pack, pack_into, plan_chunks, unpack

    sizes = [10, 300, 5, 700, 1, 64, 999, 3, 256, 256]
    tensors = [(f"t{i}", torch.randn(n)) for i, n in enumerate(sizes)]
    buffer = 1024
    source, vllm_chunks = iter(tensors), []
    while (chunk := pack_tensors(source, lambda item: item[1], buffer)) is not None:
        vllm_chunks.append((chunk.names, chunk.packed_tensor))
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    ours = list(plan_chunks(metas, buffer))
    assert [[m.name for m in c] for c in ours] == [names for names, _ in vllm_chunks]
    by_name = dict(tensors)
    for chunk, (_, vllm_packed) in zip(ours, vllm_chunks, strict=True):
        packed = pack([by_name[m.name] for m in chunk])
        assert torch.equal(packed, vllm_packed)
        # Into a buffer larger than the chunk, other bytes in it (a kept bucket's last push's).
        reused = torch.full((4096,), 255, dtype=torch.uint8)
        assert torch.equal(pack_into(reused, [by_name[m.name] for m in chunk]), vllm_packed)
        for name, tensor in unpack(packed, chunk):
            assert torch.equal(tensor, by_name[name])


def test_rank_layout_offsets_and_world_size():
    from skyinfer.ranks import RankLayout

    layout = RankLayout.build(base_offset=1, world_size=6, workers_per_engine=(2, 2, 1))
    assert [layout.rank_offset(i) for i in range(3)] == [1, 3, 5]
    # A second node's server starts after the first node's workers.
    node2 = RankLayout.build(base_offset=6, world_size=9, workers_per_engine=(1, 1, 1))
    assert [node2.rank_offset(i) for i in range(3)] == [6, 7, 8]
    with pytest.raises(LayoutError, match="world_size >= 6"):
        RankLayout.build(1, 5, (2, 2, 1))
    with pytest.raises(LayoutError, match="at least 1"):
        RankLayout.build(0, 6, (2, 2, 1))


def test_client_satisfies_vllm_weight_sync_protocol():
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient

    from skyinfer.client import AsyncClient, Client

    assert isinstance(Client("http://127.0.0.1:1"), VLLMWeightSyncClient)
    # As Python 3.12+ checks a protocol: attributes of the class itself, not __getattr__.
    members = [n for n, v in vars(VLLMWeightSyncClient).items() if not n.startswith("_") and callable(v)]
    assert len(members) >= 4
    for name in members:
        assert callable(inspect.getattr_static(Client, name)), name
    for name in ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"):
        assert inspect.getattr_static(Client, name).__doc__ == getattr(AsyncClient, name).__doc__
    assert list(inspect.signature(Client.abort).parameters) == ["self", "request_ids", "all_requests"]


async def test_engine_connections_queue_in_arrival_order_and_refuse_past_the_cap():
    import prometheus_client

    from skyinfer.admin.metrics import ServiceMetrics
    from skyinfer.devices import EngineDevices
    from skyinfer.fleet.registry import EngineRegistry
    from skyinfer.fleet.state import EngineBusy, EngineRecord

    record = EngineRecord(0, EngineDevices("cpu", ((0,),), {}), "/nonexistent.sock", connection_limit=2, queue_limit=2)
    registry = EngineRegistry([record])
    sent, release = [], asyncio.Event()

    async def request(i: int) -> None:
        async with record.in_flight():
            sent.append(i)
            await release.wait()

    tasks = []
    for i in range(4):
        tasks.append(asyncio.create_task(request(i)))
        await asyncio.sleep(0.01)
    assert sent == [0, 1] and record.in_flight_count == 4 and record.queued == 2
    with pytest.raises(EngineBusy):
        async with record.in_flight():
            pass
    assert record.refused == 1 and record.in_flight_count == 4
    text = prometheus_client.generate_latest(ServiceMetrics(registry).prom).decode()
    assert 'skyinfer_engine_queued{engine="0"} 2.0' in text
    assert 'skyinfer_engine_queue_refusals_total{engine="0"} 1.0' in text
    release.set()
    await asyncio.gather(*tasks)
    assert sent == [0, 1, 2, 3] and record.in_flight_count == record.queued == 0
    # Without a cap, any number waits.
    record.queue_limit = 0
    release.clear()
    tasks = [asyncio.create_task(request(i)) for i in range(4, 40)]
    await asyncio.sleep(0.05)
    assert record.queued == 34
    release.set()
    await asyncio.gather(*tasks)
    assert sent == list(range(40))


async def test_an_unforeseen_exception_in_a_handler_is_an_openai_500(aiohttp_client, caplog, demo_model, tmp_path):
    from aiohttp import web

    from skyinfer.config import ServeConfig
    from skyinfer.front.app import create_app

    async def broken(_request):
        return {}["no such key"]

    # The front's own middleware chain (metrics, draining, errors, keys) around a handler with a bug.
    front = create_app(ServeConfig(model=str(demo_model), device="cpu", socket_dir=str(tmp_path)))
    app = web.Application(middlewares=list(front.middlewares))
    app.router.add_get("/broken", broken)
    client = await aiohttp_client(app)
    r = await client.get("/broken")
    assert r.status == 500 and r.content_type == "application/json"
    err = (await r.json())["error"]
    assert err["code"] == 500 and err["type"] == "InternalServerError" and "KeyError" in err["message"]
    assert any(rec.exc_info and rec.exc_info[0] is KeyError for rec in caplog.records)
    # The server goes on serving.
    assert (await client.get("/broken")).status == 500


def test_engine_output_is_prefixed_per_line_and_its_tail_file_is_bounded(tmp_path):
    from skyinfer.engine.output import TAIL_LINES, _TailFile, prefixed, read_tail

    # A line may arrive in pieces: the prefix goes where a line begins, never inside one.
    assert prefixed(b"a\nb", b"[e] ", True) == b"[e] a\n[e] b"
    assert prefixed(b"c\nd\n", b"[e] ", False) == b"c\n[e] d\n"
    assert prefixed(b"\n\n", b"[e] ", True) == b"[e] \n[e] \n"
    path = str(tmp_path / "engine-0.log")
    tail = _TailFile(path, 200)
    for i in range(100):
        tail.write(f"line {i}\n".encode())
    tail.write(b"w" * 500 + b"\n")  # longer than a whole generation: its end is kept
    assert os.path.getsize(path) <= 200 and os.path.getsize(path + ".1") <= 200
    lines = read_tail(path).splitlines()
    assert lines[-1] == "w" * 199 and len(lines) <= TAIL_LINES
    assert read_tail(str(tmp_path / "never-written.log")) == ""


async def test_a_request_no_engine_can_serve_is_held_then_refused_with_retry_after(
    aiohttp_client, demo_model, tmp_path
):
    """The front's data path over engines that never come up (none is started): a request waits
    --hold-requests-s for one, then gets a 503 in the OpenAI shape saying why, with Retry-After."""
    import time

    from skyinfer.config import ServeConfig
    from skyinfer.front.app import create_app

    front = create_app(ServeConfig(model=str(demo_model), device="cpu", socket_dir=str(tmp_path), hold_requests_s=0.6))
    front.cleanup_ctx.clear()  # no engine processes: every engine stays "starting"
    client = await aiohttp_client(front)
    started = time.monotonic()
    # Refused once the hold runs out; held for ever, it would wait on: a 30 s deadline.
    r = await asyncio.wait_for(client.post("/v1/completions", json={"model": str(demo_model), "prompt": "x"}), 30)
    held = time.monotonic() - started
    assert r.status == 503 and int(r.headers["Retry-After"]) > 0
    err = (await r.json())["error"]
    assert (
        err["type"] == "ServiceUnavailableError"
        and "engine 0 starting" in err["message"]
        and "held 0.6s" in err["message"]
    )
    # Cannot flake: the front refuses only once its clock has passed the hold's 0.6 s (a loop on
    # time.monotonic() in EngineRegistry.pick_held), counted from after ``started``.
    assert held >= 0.6, held


def test_wire_models_take_query_or_body_refuse_contradictions_and_say_what_is_wrong():
    from multidict import MultiDict

    from skyinfer.transfer.protocol import UpdateMetadata
    from skyinfer.wire import PauseParams, WakeUpParams, WireError

    assert PauseParams.from_request(MultiDict(), {"mode": "keep", "unknown": 1}).mode == "keep"
    both = PauseParams.from_request(MultiDict(mode="keep"), {"mode": "keep", "clear_cache": "false"})
    assert (both.mode, both.clear_cache) == ("keep", False)
    assert both.to_query() == [("mode", "keep"), ("clear_cache", "false")]
    wake = WakeUpParams.from_request(MultiDict([("tags", "weights"), ("tags", "kv_cache")]))
    assert wake.to_query() == [("tags", "weights"), ("tags", "kv_cache")]
    for query, body, param, says in [
        (MultiDict(mode="keep"), {"mode": "abort"}, "mode", "'keep' in the query string but 'abort' in the body"),
        (MultiDict([("mode", "keep"), ("mode", "wait")]), None, "mode", "given 2 times"),
        (MultiDict(clear_cache="maybe"), None, "clear_cache", "valid boolean"),
    ]:
        with pytest.raises(WireError) as refused:
            PauseParams.from_request(query, body)
        assert refused.value.param == param and says in str(refused.value), refused.value
    for info, param, says in [
        (
            {"names": ["a", "a"], "dtype_names": ["float32"] * 2, "shapes": [[1], [1]]},
            "update_info",
            "names a tensor twice",
        ),
        (
            {"names": ["a"], "dtype_names": ["float32"], "shapes": [[-1]]},
            "update_info.shapes.0.0",
            "greater than or equal to 0",
        ),
        ({"names": ["a"], "dtype_names": ["f"], "shapes": [[1]]}, "update_info.dtype_names.0", "unknown dtype 'f'"),
        ({"names": ["a"], "shapes": [[1]]}, "update_info.dtype_names", "is required"),
        ([1], "update_info", "must be a JSON object"),
    ]:
        with pytest.raises(WireError) as refused:
            UpdateMetadata.parse(info, ("update_info",))
        assert refused.value.param == param and says in str(refused.value), refused.value
    # TRL's async GRPO client says its tensors are in checkpoint format; the contrary cannot be served.
    from skyinfer.wire import StartRequest

    assert StartRequest.parse({"is_checkpoint_format": True}).update_info is None
    with pytest.raises(WireError, match="is_checkpoint_format"):
        StartRequest.parse({"is_checkpoint_format": False})
    # A version label travels in a response header: nothing that could break one is taken.
    from skyinfer.wire import FinishRequest

    for label in ("step\r\nX-Evil: 1", "", " padded ", "é"):
        with pytest.raises(WireError) as refused:
            FinishRequest.parse({"weight_version": label})
        assert refused.value.param == "weight_version"


def test_every_vllm_name_resolves_in_the_installed_vllm():
    from skyinfer import vllm_api

    # Each is imported for real from the first of its modules that has it.
    resolved = {name: getattr(vllm_api, name) for name in vllm_api.NAMES}
    assert all(value is not None for value in resolved.values())
    assert resolved["make_arg_parser"].__module__ in vllm_api.NAMES["make_arg_parser"]
    with pytest.raises(AttributeError, match="add it to NAMES"):
        vllm_api.AsyncLLM  # noqa: B018 - not in the table: skyinfer does not use it


def test_adapter_checks_name_the_first_problem():
    from skyinfer.weights.adapters import AdapterError, check_adapter
    from skyinfer.weights.checkpoint import CheckpointSpec

    base = CheckpointSpec({"model.layers.0.self_attn.q_proj.weight": (256, 128)}, {})
    config = {"peft_type": "LORA", "r": 8}
    a, b = (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    )
    check_adapter(config, {a: (8, 128), b: (256, 8)}, base, max_rank=16)
    # PEFT's names with the adapter's own name in them are the same tensors.
    check_adapter(config, {a.replace("lora_A.", "lora_A.default."): (8, 128), b: (256, 8)}, base, max_rank=16)
    refused = {
        "rank 8; the engines take at most --max-lora-rank 4": ({a: (8, 128), b: (256, 8)}, config, 4),
        "do not fit its weight [256, 128]": ({a: (8, 64), b: (256, 8)}, config, 16),
        "not both lora_A and lora_B": ({a: (8, 128)}, config, 16),
        "not a LoRA A or B matrix": ({a: (8, 128), b: (256, 8), "model.norm.weight": (128,)}, config, 16),
        "does not have": (
            {a.replace("q_proj", "x_proj"): (8, 128), b.replace("q_proj", "x_proj"): (256, 8)},
            config,
            16,
        ),
        "the adapter config says r=4": ({a: (8, 128), b: (256, 8)}, {"r": 4}, 16),
        "only LoRA adapters": ({a: (8, 128), b: (256, 8)}, {"peft_type": "IA3", "r": 8}, 16),
        "DoRA": ({a: (8, 128), b: (256, 8)}, {**config, "use_dora": True}, 16),
        "no tensors": ({}, config, 16),
    }
    for says, (shapes, cfg, max_rank) in refused.items():
        with pytest.raises(AdapterError, match=re.escape(says)):
            check_adapter(cfg, shapes, base, max_rank)


def test_stored_responses_remember_the_newest_per_engine():
    from skyinfer.fleet.routing import StoredResponses

    stored = StoredResponses(max_entries=2)
    stored.record("resp_a", 0)
    stored.record("resp_b", 1)
    stored.record("resp_a", 0)  # used again: newest
    stored.record("resp_c", 1)
    assert [stored.engine_of(r) for r in ("resp_a", "resp_b", "resp_c", "resp_x")] == [0, None, 1, None]


async def test_the_silence_timer_firing_is_the_verdict_even_a_moment_early():
    """The event loop may run the silence timer up to a millisecond before its deadline (uvloop's
    resolution): a dead trainer's update must be abandoned all the same. A weight call begun since,
    or one the server accepted (the deadline moved), clears the verdict."""
    from skyinfer.weights.phases import Phase, UpdateMachine

    machine = UpdateMachine(lambda phase: None)
    machine.open(staged=False)
    silent = []
    machine.call_ended(True, 100.0, lambda: silent.append(1))
    assert not machine.silence_timed_out
    machine._silent(lambda: silent.append(1))  # as the loop runs it, well before the deadline
    assert silent == [1] and machine.silence_timed_out
    machine.call_began()
    assert not machine.silence_timed_out  # the trainer may be back: judged when the call ends
    machine.call_ended(True, 100.0, lambda: None)
    assert not machine.silence_timed_out and machine.current.silence_timer is not None
    machine.end()
    assert machine.phase is Phase.IDLE and not machine.silence_timed_out


def test_a_chat_stream_parsed_as_it_goes_is_not_continued_and_an_answer_parsed_whole_is():
    """Reasoning parsers and tool-call parsers read a chat stream from its first token: such a
    stream is not continued on another engine. tests/test_continuation.py kills an engine under a
    tool-parsed stream (its server runs a tool parser); this, the reasoning case (a reasoning parser
    on that server would refuse every chat stream its other tests continue)."""
    from skyinfer.engine.continuation import why_chat_stream_not_continued
    from skyinfer.vllm_api import ChatCompletionRequest

    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    stream = ChatCompletionRequest(**chat, stream=True)
    assert "reasoning (qwen3" in why_chat_stream_not_continued(stream, "qwen3")
    assert why_chat_stream_not_continued(stream, None) is None
    assert why_chat_stream_not_continued(ChatCompletionRequest(**chat), "qwen3") is None
    with_tools = ChatCompletionRequest(**chat, stream=True, tools=[tool])
    assert "tool calls" in why_chat_stream_not_continued(with_tools, None)
    declined = ChatCompletionRequest(**chat, stream=True, tools=[tool], tool_choice="none")
    assert why_chat_stream_not_continued(declined, None) is None


@pytest.mark.parametrize("backend", ["GlooBackend", "NcclBackend", "SharedMemoryBackend", "IpcBackend"])
def test_every_backend_keeps_a_failed_chunk_for_the_engine_to_ask(backend):
    """A chunk that fails in a worker is kept for ``skyinfer_update_outcome``, not raised through
    vLLM's executor (whose other ranks' answers would stay queued); the IPC backend once raised, and
    the engine then failed every push asking for an outcome it did not keep (GPU run 2026-11-27)."""
    from skyinfer.engine import backends

    receiver = object.__new__(getattr(backends, backend))  # no group, no model: the chunk fails first
    receiver.update_weights({"names": ["w"], "dtype_names": ["no-such-dtype"], "shapes": [[1]]})
    assert receiver.update_failure is not None


async def test_a_worker_call_reads_every_data_parallel_rank_and_fails_on_any():
    """vLLM's collective_rpc returns data-parallel rank 0's answers alone: skyinfer asks each rank's
    EngineCore (vLLM's call_utility_all_async) and reads them all, in worker order; a failure on
    rank 1's worker fails the call, named."""
    from types import SimpleNamespace

    from skyinfer.engine.worker_calls import WorkerFailed, every_worker_answers, on_every_worker

    asked = []

    class EngineCore:  # vLLM's client of a data-parallel-2 engine, each rank tp 2
        def __init__(self, rank_1_fails: bool):
            self.rank_1_fails = rank_1_fails

        async def call_utility_all_async(self, method, *args):
            asked.append((method, args))
            second = {"skyinfer_worker_failed": "RuntimeError: out of memory"} if self.rank_1_fails else {"ok": 3}
            return [[{"ok": 0}, {"ok": 1}], [{"ok": 2}, second]]

    engine = SimpleNamespace(engine_core=EngineCore(rank_1_fails=False))
    assert await on_every_worker(engine, "skyinfer_status", "x") == [{"ok": 0}, {"ok": 1}, {"ok": 2}, {"ok": 3}]
    assert asked == [("collective_rpc", ("skyinfer_status", None, ("x",), None))]
    engine.engine_core.rank_1_fails = True
    with pytest.raises(WorkerFailed, match=r"^worker 3: RuntimeError: out of memory$"):
        await on_every_worker(engine, "skyinfer_status")
    assert len(await every_worker_answers(engine, "skyinfer_status")) == 4


@pytest.mark.parametrize("caller_paused", [False, True])
async def test_a_staged_swap_runs_inside_a_keep_pause(aiohttp_client, caller_paused):
    """The swap, the new version and the KV reset are three EngineCore calls: a step between two of
    them labels a token of the old weights with the new version (seen in CI). The engine is
    keep-paused before any of them and resumed after all three; an engine its caller paused is
    neither paused again nor resumed. The version and the reset follow the swap, in either order."""
    from aiohttp import web

    from skyinfer.engine.appkeys import ENGINE_CLIENT, KV_EPOCHS
    from skyinfer.engine.weights import KvEpochs, swap_staged

    calls = []

    class EngineCore:
        async def call_utility_all_async(self, method, rpc, *args):
            calls.append(rpc)
            return [[{"tensors": 26, "installed": "by pointer"}]]

        async def pause_scheduler_async(self, *, mode, clear_cache):  # a keep pause keeping the caches
            calls.append(f"pause {mode} clear_cache={clear_cache}")

    class Engine:
        engine_core = EngineCore()

        async def is_paused(self):
            return caller_paused

        async def resume_generation(self):
            calls.append("resume")

        async def update_weight_version(self, version):
            await asyncio.sleep(0)  # arrives late, as the version can
            calls.append(f"version {version}")

        async def reset_prefix_cache(self, reset_running_requests):
            calls.append(f"reset running={reset_running_requests}")

    app = web.Application()
    app[ENGINE_CLIENT], app[KV_EPOCHS] = Engine(), KvEpochs()
    app.router.add_post("/swap_staged", swap_staged)
    client = await aiohttp_client(app)
    r = await client.post("/swap_staged", json={"weight_version": "v2", "kv": "recompute"})
    assert r.status == 200 and (await r.json())["weight_version"] == "v2"
    after_swap = {"version v2", "reset running=True"}
    if caller_paused:
        assert calls[0] == "skyinfer_swap_staged" and set(calls[1:]) == after_swap and len(calls) == 3
    else:
        assert calls[:2] == ["pause keep clear_cache=False", "skyinfer_swap_staged"] and calls[-1] == "resume"
        assert set(calls[2:-1]) == after_swap and len(calls) == 5


def test_the_front_imports_no_torch():
    """The front reads checkpoints' names and configs and relays bytes: torch (most of a front's
    start-up CPU and about 190 MiB of its memory, measured) is for the engines and trainers."""
    code = "import sys, skyinfer.front.app, skyinfer.front.service, skyinfer.front_workers.worker; print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def _onednn_int8_linear(x, weight, weight_scale):
    """vLLM's CPU int8 W8A8 kernel's own oneDNN path (dynamic per-token, symmetric input)."""
    import torch
    from vllm import _custom_ops as ops

    from skyinfer.vllm_api import onednn_scaled_int8_quant

    handler = ops.create_onednn_scaled_mm(weight.t(), weight_scale, torch.float32, True, False, 32)
    codes, scale, _ = onednn_scaled_int8_quant(x, None, None, True)
    out = torch.empty(x.shape[0], weight.shape[0])
    ops.onednn_scaled_mm(handler, codes, out, scale, None, None, None)
    return out, codes, scale


def test_int8_layers_compute_exactly_where_onednn_saturates():
    """A W8A8 layer of full-range int8 weights against int64 arithmetic on the same int8 input:
    skyinfer's float32 path exact on any CPU; vLLM's oneDNN path off by far more than rounding
    exactly where ``int8_gemm_saturates`` says (these machines' AVX2 cores), exact elsewhere."""
    import torch

    from skyinfer.engine.cpu_setup import int8_gemm_saturates, int8_linear_exactly

    g = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (96, 512), dtype=torch.int8, generator=g)  # [out, in], as loaded
    weight_scale = torch.rand(96, 1, generator=g) * 0.01 + 0.001
    bias = torch.randn(96, generator=g)
    x = torch.randn(5, 512, generator=g)
    onednn, codes, scale = _onednn_int8_linear(x, weight, weight_scale)
    exact = (codes.long() @ weight.t().long()).double() * scale.double() * weight_scale.double().t()
    ours = int8_linear_exactly(x, weight.t().float(), weight_scale, None, None, True, bias)
    assert (ours.double() - bias.double() - exact).abs().max() < 1e-4 * exact.abs().max()
    onednn_error = ((onednn.double() - exact).abs().max() / exact.abs().max()).item()
    assert (onednn_error > 0.01) == int8_gemm_saturates(), onednn_error


def test_a_forked_helper_script_runs_as_its_own_python_would(tmp_path):
    """The tests' trainers and clients fork from one Python (tests/forked_python.py): each must get
    its arguments, directory, environment and pipes, exit with its own status, die of a signal as a
    process does, and leave nothing of the server's imports in its namespace."""
    from forked_python import ForkedPopen, run_python

    script = tmp_path / "helper.py"
    script.write_text(
        "import os, sys\n"
        "print(__name__, sys.argv[1:], os.getcwd(), os.environ.get('HELPER'), 'torch' in globals(), flush=True)\n"
        "for line in sys.stdin:\n"
        "    print('echo', line.strip(), flush=True)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    done = run_python(
        [script, "3"], input="a\nb\n", capture_output=True, text=True, cwd=tmp_path, env={"HELPER": "x"}, timeout=60
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.splitlines() == [f"__main__ ['3'] {tmp_path} x False", "echo a", "echo b"]
    held = ForkedPopen([script, "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert held.stdout.readline().startswith("__main__ ['0']")
    with pytest.raises(subprocess.TimeoutExpired):
        held.wait(0.2)
    held.kill()
    assert held.wait(30) == -9


def test_a_gpu_worker_stages_a_quantized_push_on_its_gpu_or_in_pinned_host_memory_or_refuses(monkeypatch):
    """Where a worker keeps a quantized model's staged push, from its GPU's free memory and the
    host's (each a device figure, stood in here): its GPU while it has room beside the headroom,
    else pinned host memory, else refused naming both; a CPU worker keeps it in its memory."""
    import torch

    from skyinfer.engine import staging

    gpu = torch.device("cuda", 1)
    free = {"gpu": staging.DEVICE_HEADROOM_BYTES + 100, "host": staging.HOST_HEADROOM_BYTES + 1000}
    monkeypatch.setattr(staging, "_gpu_free_bytes", lambda device: free["gpu"])
    monkeypatch.setattr(staging, "host_memory_available", lambda: free["host"])
    assert staging.staging_place(torch.device("cpu"), 10**12) == (torch.device("cpu"), False)
    assert staging.staging_place(gpu, 50) == (gpu, False)
    assert staging.staging_place(gpu, 150) == (torch.device("cpu"), True)
    free["host"] = staging.HOST_HEADROOM_BYTES + 100
    with pytest.raises(RuntimeError, match=r"no room for a staging copy .* the GPU has .* the host .* without staged"):
        staging.staging_place(gpu, 150)


async def test_a_fork_order_the_template_cannot_take_leaves_no_order_waiting():
    """A template whose channel is gone by the time an order is sent: the fork fails at once, and
    no order is left for the template's close to fail later (an exception nobody would read)."""
    import socket

    from skyinfer.fleet.engine_templates import _Template

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.setblocking(False)
    template = _Template(None, ours, answer_timeout_s=5.0)
    template.ready.cancel()  # nobody waits for this one to be ready
    theirs.close()
    with pytest.raises(OSError):
        await template.fork(["--socket", "x"], {}, [], None)
    assert template._orders == {}
    template.close()
