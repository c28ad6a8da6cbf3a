#!/usr/bin/env python
"""A fake engine: answers the engine socket's routes as ``python -m skyinfer.engine`` does, with no
model behind them, for the front's own tests (its state machine, with scripted delays and
failures) and for benchmarking the front alone. Never a serving path.

The front starts it in place of the real engine (``ServeConfig.engine_command``) with the same
arguments; it takes the engine's own (socket, cores, lifeline, output relay) and, of vLLM's, only
the served model's name and the LoRA switches, but keeps them all for ``GET /fake/args``.
Its behaviour comes from the environment, or from ``POST /fake/script`` at any time:

* ``tokens_per_s``: how fast each request generates (0: as fast as it can);
* ``delay_s``: ``{path: seconds}`` to wait before answering a route;
* ``fail``: ``{path: status}`` to answer a route with an error;
* ``fail_after``: ``{path: status}`` to do what a route does, then answer it with an error (an
  engine that paused, or slept, and failed to say so);
* ``hang``: paths that never answer;
* ``block_s``: ``{path: seconds}`` to hold the whole event loop (``time.sleep``) before answering a
  route, as a handler that computes on the loop does: no other route answers meanwhile;
* ``die_after_events``: a completion or chat request ends as one whose EngineCore died after that
  many events: a stream with skyinfer's continuation record, any other answer with the 503 that
  carries it (engine/continuation.py). ``GET /fake/went_on`` lists the records of the requests it
  went on with (taken, as a real engine takes them, only with the front's ``X-Skyinfer-Continue``).

A staged push's chunks are kept as names (``/stage_weights``), swapped in or dropped. A one-call
push (``/push``) goes through the steps it stands for, each scripted as its own route
(``/pause``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``).
``GET /fake/calls`` says how many times each route was called; ``GET /fake/bodies`` the last JSON
body each of its weight, adapter-receive, reset and abort routes got (``{path: body}``: the
rank_offset an ``/init_weight_transfer`` told it, say); ``GET /fake/args`` the vLLM arguments it
was started with (``{"vllm_args": [...]}``: its ``--tensor-parallel-size``, say).

It serves the model vLLM's ``--model`` (or ``--served-model-name``) names, and 404s any other
model a request names, as vLLM does; with ``--enable-lora`` (and ``--max-lora-rank``) it holds
LoRA adapters by name, as the engine's own ``/adapters/*`` routes load them, and lists them in
``/v1/models``.

    FAKE_ENGINE_SCRIPT='{"tokens_per_s": 200, "delay_s": {"/pause": 2}}' python tools/fake_engine.py --socket S
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid

import orjson
import uvloop
from aiohttp import web

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from skyinfer.engine.__main__ import set_up_process
from skyinfer.engine_wire import (
    CONTINUE_FIELD,
    CONTINUE_HEADER,
    CONTINUE_MARKER,
    ENGINE_DIED_HEADER,
    push_failed_at,
)
from skyinfer.errors import error_body, error_response, json_response
from skyinfer.transfer.protocol import TensorLayouts, UnknownLayout, UpdateMetadata

SCRIPT = web.AppKey("script", dict)
STATE = web.AppKey("state", "FakeEngine")


class FakeEngine:
    """What a vLLM engine holds that the front reads back: its scheduler, memory, weights' label."""

    def __init__(
        self, served_model_name: str, max_lora_rank: int | None, vllm_args: list[str] | tuple[str, ...] = ()
    ) -> None:
        self.served_model_name = served_model_name
        # vLLM's arguments as the front gave them, for the tests.
        self.vllm_args = list(vllm_args)
        self.max_lora_rank = max_lora_rank
        # LoRA adapters it holds, by name: the directory each was loaded from.
        self.adapters: dict[str, str] = {}
        self.paused = False
        self.asleep: set[str] = set()
        self.weight_version = "default"
        self.updating = False
        # A staged push's copy: the tensor names it holds, and their bytes.
        self.staged: dict[str, int] = {}
        # The tensor layouts its pushes gave in full, as a worker keeps them.
        self.layouts = TensorLayouts()
        self.unfinished = 0
        self.resumed = asyncio.Event()
        self.resumed.set()
        # Calls of each route, for the tests.
        self.calls: dict[str, int] = {}
        # The records of requests it went on with (another engine died under them).
        self.went_on: list[dict] = []
        # The last body each weight (and reset) route got, for the tests.
        self.bodies: dict[str, dict] = {}

    def tensors(self, update_info: dict) -> UpdateMetadata:
        """The tensors an update_info names, its layout kept or read back as a worker does."""
        info = UpdateMetadata.parse(self.layouts.expand(update_info))
        self.layouts.given(info)
        return info

    def pause(self) -> None:
        self.paused = True
        self.resumed.clear()

    def resume(self) -> None:
        self.paused = False
        self.resumed.set()


def _hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)


async def _scripted_before(app: web.Application, path: str) -> int | None:
    """What the script makes ``path`` do before its work: hang, block, wait, or fail (its status)."""
    script = app[SCRIPT]
    if path in script.get("hang", ()):
        await asyncio.Event().wait()
    if seconds := script.get("block_s", {}).get(path):
        _hold_the_loop(seconds)
    if delay := script.get("delay_s", {}).get(path):
        await asyncio.sleep(delay)
    return script.get("fail", {}).get(path)


def _scripted_after(app: web.Application, path: str) -> int | None:
    """The status the script makes ``path`` fail with after its work, if any."""
    return app[SCRIPT].get("fail_after", {}).get(path)


def _scripted(handler):
    async def route(request: web.Request) -> web.StreamResponse:
        calls = request.app[STATE].calls
        calls[request.path] = calls.get(request.path, 0) + 1
        if status := await _scripted_before(request.app, request.path):
            return error_response(status, f"scripted failure of {request.path}")
        answer = await handler(request)
        if status := _scripted_after(request.app, request.path):
            return error_response(status, f"scripted failure of {request.path}, after doing it")
        return answer

    return route


async def _body(request: web.Request) -> dict:
    raw = await request.read()
    return orjson.loads(raw) if raw else {}


async def _generate(request: web.Request, tokens: int) -> None:
    """Wait while paused, then take the time ``tokens`` take at the scripted rate."""
    engine = request.app[STATE]
    await engine.resumed.wait()
    if rate := request.app[SCRIPT].get("tokens_per_s", 0):
        await asyncio.sleep(tokens / rate)


def _completion(kind: str, model: str, tokens: int, index_text: str) -> dict:
    choice = {"index": 0, "finish_reason": "length", "logprobs": None}
    if kind == "chat.completion":
        choice["message"] = {"role": "assistant", "content": index_text}
    else:
        choice["text"] = index_text
    return {
        "id": f"fake-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1},
    }


async def _openai(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    engine = request.app[STATE]
    model = body.get("model", engine.served_model_name)
    if model != engine.served_model_name and model not in engine.adapters:
        return error_response(404, f"The model `{model}` does not exist.")
    tokens = int(body.get("max_tokens") or 16)
    chat = request.path == "/v1/chat/completions"
    going_on = body.pop(CONTINUE_FIELD, None)
    if going_on is not None and CONTINUE_HEADER in request.headers:  # as a real engine, from the front only
        engine.went_on.append(going_on)
        tokens -= going_on.get("fake_tokens", 0)
    dies_after = request.app[SCRIPT].get("die_after_events")
    engine.unfinished += 1
    try:
        if dies_after is not None and not body.get("stream"):
            # As an engine whose EngineCore died mid-request: what it generated, for the next engine.
            record = {"calls": [], "fake_tokens": dies_after}
            body = b'{"error":{"message":"the engine died","code":503},"' + CONTINUE_FIELD.encode() + b'":'
            return web.Response(
                status=503,
                body=body + orjson.dumps(record) + b"}",
                content_type="application/json",
                headers={ENGINE_DIED_HEADER: "1", CONTINUE_HEADER: "1"},
            )
        if not body.get("stream"):
            await _generate(request, tokens)
            kind = "chat.completion" if chat else "text_completion"
            return json_response(_completion(kind, body.get("model", "fake"), tokens, "x" * tokens))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        head = {
            "id": f"fake-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", "fake"),
        }
        await engine.resumed.wait()
        rate = request.app[SCRIPT].get("tokens_per_s", 0)
        # Rendered once: the benchmark's fake engine must cost far less per event than the front.
        events = []
        for finish_reason in (None, "length"):
            choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
            choice.update({"delta": {"content": "x"}} if chat else {"text": "x"})
            events.append(b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n")
        for i in range(tokens):
            if rate:
                await asyncio.sleep(1 / rate)
            if i == dies_after:
                await response.write(CONTINUE_MARKER + orjson.dumps({"calls": [], "fake_tokens": i}) + b"\n\n")
                await response.write_eof()
                return response
            await response.write(events[i == tokens - 1])
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    finally:
        engine.unfinished -= 1


async def _tokens(request: web.Request) -> web.Response:
    body = await _body(request)
    tokens = int(body.get("sampling_params", {}).get("max_tokens") or 16)
    await _generate(request, tokens)
    engine = request.app[STATE]
    return json_response(
        {
            "request_id": f"fake-{uuid.uuid4().hex}",
            "choices": [
                {
                    "index": 0,
                    "token_ids": [7] * tokens,
                    "finish_reason": "length",
                    "weight_versions": [{"version": engine.weight_version, "tokens": tokens}],
                }
            ],
        }
    )


async def _info(request: web.Request) -> web.Response:
    engine = request.app[STATE]
    return json_response(
        {
            "weight_version": engine.weight_version,
            "model_dtype": "float32",
            "max_lora_rank": engine.max_lora_rank,
            "quantized_layers": [],
        }
    )


async def _models(request: web.Request) -> web.Response:
    engine = request.app[STATE]
    names = [engine.served_model_name, *engine.adapters]
    return json_response({"object": "list", "data": [{"id": name, "object": "model"} for name in names]})


async def _load_adapter(request: web.Request) -> web.Response:
    body = await _body(request)
    request.app[STATE].adapters[body["lora_name"]] = body["lora_path"]
    return json_response({"status": "loaded", "lora_name": body["lora_name"]})


async def _unload_adapter(request: web.Request) -> web.Response:
    name = (await _body(request))["lora_name"]
    held = request.app[STATE].adapters.pop(name, None)
    return json_response({"status": "unloaded" if held else "absent", "lora_name": name})


async def _health(request: web.Request) -> web.Response:
    return json_response({"pid": os.getpid(), "unfinished_requests": request.app[STATE].unfinished})


async def _conditions(request: web.Request) -> web.Response:
    engine = request.app[STATE]
    return json_response({"paused": engine.paused, "sleeping": engine.paused or bool(engine.asleep)})


async def _pause(request: web.Request) -> web.Response:
    request.app[STATE].pause()
    return json_response({"status": "paused", "mode": request.query.get("mode", "abort")})


async def _resume(request: web.Request) -> web.Response:
    request.app[STATE].resume()
    return json_response({"status": "resumed"})


async def _sleep(request: web.Request) -> web.Response:
    engine = request.app[STATE]
    engine.pause()
    level = int(request.query.get("level", "1"))
    engine.asleep = {"weights", "kv_cache"} if level else set()
    return json_response({"status": "sleeping", "level": level})


async def _wake_up(request: web.Request) -> web.Response:
    engine = request.app[STATE]
    tags = set(request.query.getall("tags", [])) or {"weights", "kv_cache"}
    engine.asleep -= tags
    if not engine.asleep:
        engine.resume()
    return json_response({"status": "awake" if not engine.asleep else "sleeping", "fully_awake": not engine.asleep})


def _step(status: str, then=None, **answer):
    async def handler(request: web.Request) -> web.Response:
        body = await _body(request)
        engine = request.app[STATE]
        engine.bodies[request.path] = body
        if then is not None:
            then(engine, body)
        return json_response({"status": status, "weight_version": engine.weight_version, **answer})

    return handler


async def _push(request: web.Request) -> web.Response:
    """A whole push in one call (the engine's ``/push``): the steps it stands for (its pause if
    asked, start, receive, finish), each as the script makes its own route behave, each timed; the
    first that fails is the answer, naming its step, what came before it done."""
    body = await _body(request)
    engine = request.app[STATE]
    engine.bodies[request.path] = body
    try:
        engine.tensors(body["update_info"])
    except UnknownLayout as exc:  # a worker's receive refuses it as it parses it
        return _push_failed("receive", 500, str(exc))
    steps = [("pause", "/pause", engine.pause)] if body.get("pause") else []
    steps += [
        ("start", "/start_weight_update", lambda: setattr(engine, "updating", True)),
        ("receive", "/update_weights", lambda: None),
        ("finish", "/finish_weight_update", lambda: _finish(engine, body)),
    ]
    # The event loop's clock, which its scripted delays are timed by (uvloop's, to the millisecond:
    # by time.monotonic a 0.6 s delay measured 0.5998 s).
    clock = asyncio.get_running_loop().time
    stages = {}
    for stage, path, step in steps:
        started = clock()
        if status := await _scripted_before(request.app, path):
            return _push_failed(stage, status, f"scripted failure of {path}")
        step()
        if status := _scripted_after(request.app, path):
            return _push_failed(stage, status, f"scripted failure of {path}, after doing it")
        stages[stage] = clock() - started
    return json_response(
        {"status": "finished", "weight_version": engine.weight_version, "applied": APPLIED, "stages": stages}
    )


def _push_failed(stage: str, status: int, message: str) -> web.Response:
    """A one-call push's failure, its step named as the engine names it."""
    return json_response(error_body(status, message, code=push_failed_at(stage)), status=status)


async def _stage_weights(request: web.Request) -> web.Response:
    """A staged push's chunk, kept as names and bytes: what the front checks before a swap."""
    body = await _body(request)
    engine = request.app[STATE]
    engine.bodies[request.path] = body
    names = engine.tensors(body["update_info"]).names
    for name in names:
        engine.staged[name] = body["update_nbytes"] // len(names)
    staged = {"bytes": sum(engine.staged.values()), "tensors": len(engine.staged), "seconds": 0.0, "place": "cpu"}
    return json_response({"status": "staged", **staged})


def _swap_staged(engine: FakeEngine, body: dict) -> None:
    engine.staged = {}
    engine.weight_version = body["weight_version"]


# How the fake's finish says it applied a push: as a dense model's workers do (receiving.py), able
# to take a delta on it.
APPLIED = {"applied": "in place", "base": True}


def _finish(engine: FakeEngine, body: dict) -> None:
    engine.updating = False
    if body.get("weight_version") is not None:
        engine.weight_version = body["weight_version"]


async def _weight_checker(request: web.Request) -> web.Response:
    """vLLM's weight checker, over weights the fake has none of: one digest, its label's."""
    engine = request.app[STATE]
    return json_response({"checksums": {"model.norm.weight": engine.weight_version}})


def _catch_up_file(body: dict) -> str:
    """The one file of a peer catch-up's (weights/catchup.py) a fake engine, one worker, writes or reads."""
    prefix = body["prefix"]
    if "/" in prefix or not prefix.startswith("skyinfer-"):
        raise ValueError(f"not a catch-up prefix: {prefix!r}")
    return os.path.join("/dev/shm", f"{prefix}rank0")


async def _export_weights(request: web.Request) -> web.Response:
    """A peer catch-up's export: the fake's "weights" are its label, written to its file."""
    body = await _body(request)
    engine = request.app[STATE]
    engine.bodies[request.path] = body
    with open(_catch_up_file(body), "xb") as f:
        f.write(orjson.dumps({"weights": engine.weight_version}))
    checksums = {"model.norm.weight": engine.weight_version}
    return json_response(
        {
            "status": "exported",
            "weight_version": engine.weight_version,
            "workers": 1,
            "tensors": 1,
            "bytes": 64,
            "checksums": checksums,
        }
    )


async def _import_weights(request: web.Request) -> web.Response:
    """A peer catch-up's import: the peer's "weights" (its label) become the fake's, as its checksum says."""
    body = await _body(request)
    engine = request.app[STATE]
    engine.bodies[request.path] = body
    with open(_catch_up_file(body), "rb") as f:
        engine.weight_version = orjson.loads(f.read())["weights"]
    return json_response({"status": "imported", "workers": 1, "tensors": 1})


async def _metrics(_request: web.Request) -> web.Response:
    return web.Response(text="", content_type="text/plain")


async def _went_on(request: web.Request) -> web.Response:
    return json_response(request.app[STATE].went_on)


async def _calls(request: web.Request) -> web.Response:
    return json_response(request.app[STATE].calls)


async def _bodies(request: web.Request) -> web.Response:
    return json_response(request.app[STATE].bodies)


async def _args(request: web.Request) -> web.Response:
    return json_response({"vllm_args": request.app[STATE].vllm_args})


async def _set_script(request: web.Request) -> web.Response:
    request.app[SCRIPT].clear()
    request.app[SCRIPT].update(await _body(request))
    return json_response(request.app[SCRIPT])


def create_fake_engine_app(
    script: dict, served_model_name: str, max_lora_rank: int | None, vllm_args: list[str] | tuple[str, ...] = ()
) -> web.Application:
    app = web.Application(client_max_size=1024**3)
    app[SCRIPT] = script
    app[STATE] = FakeEngine(served_model_name, max_lora_rank, vllm_args)
    posts = {
        "/v1/completions": _openai,
        "/v1/chat/completions": _openai,
        "/inference/v1/generate": _tokens,
        "/pause": _pause,
        "/resume": _resume,
        "/sleep": _sleep,
        "/wake_up": _wake_up,
        "/reset_prefix_cache": _step("reset"),
        "/abort_requests": _step("aborted"),
        "/init_weight_transfer": _step("joined"),
        "/shutdown_weight_transfer_engine": _step("left"),
        "/start_weight_update": _step("started", lambda e, b: setattr(e, "updating", True)),
        "/update_weights": _step("updated"),
        "/load_checkpoint": _step("loaded"),
        "/finish_weight_update": _step("finished", _finish, applied=APPLIED),
        "/push": _push,
        "/abort_weight_update": _step("aborted", lambda e, b: setattr(e, "updating", False)),
        "/stage_weights": _stage_weights,
        "/swap_staged": _step("swapped", _swap_staged),
        "/drop_staged": _step("dropped", lambda e, b: setattr(e, "staged", {})),
        "/update_weight_version": _step("relabelled", lambda e, b: setattr(e, "weight_version", b["new_version"])),
        "/export_weights": _export_weights,
        "/import_weights": _import_weights,
        "/reset_mm_cache": _step("reset"),
        "/reset_encoder_cache": _step("reset"),
        "/weight_checker": _weight_checker,
        "/adapters/receive": _step("received"),
        "/adapters/load": _load_adapter,
        "/adapters/unload": _unload_adapter,
    }
    for path, handler in posts.items():
        app.router.add_post(path, _scripted(handler))
    for path, handler in {
        "/info": _info,
        "/health": _health,
        "/conditions": _conditions,
        "/v1/models": _models,
    }.items():
        app.router.add_get(path, _scripted(handler))
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/fake/script", _set_script)
    app.router.add_get("/fake/calls", _calls)
    app.router.add_get("/fake/went_on", _went_on)
    app.router.add_get("/fake/bodies", _bodies)
    app.router.add_get("/fake/args", _args)
    return app


def _vllm_option(vllm_args: list[str], name: str, default: str | None = None) -> str | None:
    return vllm_args[vllm_args.index(name) + 1] if name in vllm_args else default


def _max_lora_rank(vllm_args: list[str]) -> int | None:
    """What vLLM would serve: LoRA adapters up to ``--max-lora-rank`` (its default 16) with ``--enable-lora``."""
    return int(_vllm_option(vllm_args, "--max-lora-rank", "16")) if "--enable-lora" in vllm_args else None


def main() -> None:
    # The engine's own arguments and process plumbing, as the real engine takes them; of vLLM's,
    # only the served model's name and the LoRA switches count (all are kept for /fake/args).
    ns, vllm_args = set_up_process(sys.argv[1:])
    if ns.loaded:
        # A loaded spare builds its engine before it stands by (nothing to build here): it then
        # waits for the start order, as the real engine's server does.
        ns.spare.become_engine(ns.spare.stand_by())
    script = orjson.loads(os.environ.get("FAKE_ENGINE_SCRIPT", "{}"))
    name = _vllm_option(vllm_args, "--served-model-name", _vllm_option(vllm_args, "--model", "fake"))
    app = create_fake_engine_app(script, name, _max_lora_rank(vllm_args), vllm_args)
    uvloop.install()  # as the real engine: its event loop is uvloop's
    web.run_app(app, path=ns.socket, print=None, handler_cancellation=True, access_log=None)


if __name__ == "__main__":
    main()
