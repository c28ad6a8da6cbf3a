"""One engine: vLLM's ``AsyncLLM`` in this process, served on a Unix socket: the hot routes through
vLLM's own OpenAI serving classes, every other route of ``vllm serve`` through vLLM's own app
(``vllm_app``)."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import sys
import time
import uuid
import zlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

import orjson
import prometheus_client
import pydantic
from aiohttp import web
from multidict import CIMultiDict

from ..engine_wire import CONTINUE_FIELD, CONTINUE_HEADER, ENGINE_DIED_HEADER, SESSION_HEADER
from ..errors import error_body, error_response, json_response, parse_json_object
from ..vllm_api import ErrorResponse, create_error_response
from . import continuation
from .adapters import add_adapter_routes
from .admin import add_admin_routes
from .appkeys import DATA_PARALLEL_SIZE, ENGINE_CLIENT, KV_EPOCHS, SERVING_CALLS, SERVING_STATE
from .refusals import constraints_conflict
from .standby import Standby
from .stream_end import choice_count, with_finish_reasons
from .vllm_app import add_vllm_app_routes
from .weights import KvEpochs, add_weight_routes
from .worker_calls import on_every_worker

__all__ = ["create_engine_app", "serve_engine"]

log = logging.getLogger("skyinfer.engine")


# vLLM's header naming the data-parallel rank that serves a request (its serving classes read it).
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"


class VllmRequestView:
    """What vLLM's serving classes read from a starlette ``Request``: headers and a state bag."""

    __slots__ = ("headers", "state")

    def __init__(self, request: web.Request):
        self.headers = _with_session_rank(request.headers, request.app[DATA_PARALLEL_SIZE])
        self.state = _StateBag()


def _with_session_rank(headers: Mapping[str, str], data_parallel_size: int) -> Mapping[str, str]:
    """The request's headers, with a session's data-parallel rank where the engine has several and
    the caller named none. vLLM balances each request among the ranks by load (and alternates
    between idle ones), so a session's next turn would land on a rank that has not cached its
    earlier ones; the session's id picks its rank instead, the same on every turn."""
    session = headers.get(SESSION_HEADER)
    if data_parallel_size < 2 or not session or DATA_PARALLEL_RANK_HEADER in headers:
        return headers
    pinned = CIMultiDict(headers)
    pinned[DATA_PARALLEL_RANK_HEADER] = str(zlib.crc32(session.encode()) % data_parallel_size)
    return pinned


class _StateBag:
    pass


def _validation_message(exc: pydantic.ValidationError) -> tuple[str, str | None]:
    errors = exc.errors(include_url=False, include_input=False)
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "union")))
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    first_loc = errors[0]["loc"] if errors else ()
    param = str(first_loc[0]) if first_loc else None
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return "; ".join(parts) + more, param


def _serving_route(
    adapter: pydantic.TypeAdapter, call: Callable[[Any], Callable[..., Awaitable[Any]]], chunk_object: str | None = None
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A handler that validates the body into vLLM's request type and calls one serving method.
    ``chunk_object``: the route streams OpenAI chunks of that type, each choice ending with a reason."""

    async def handler(request: web.Request) -> web.StreamResponse:
        calls = request.app[SERVING_CALLS]
        calls.add(task := asyncio.current_task())
        try:
            return await serve(request)
        finally:
            calls.discard(task)

    async def serve(request: web.Request) -> web.StreamResponse:
        track = None  # a body that is not JSON starts nothing to keep
        try:
            payload = parse_json_object(await request.read())
            track = continuation.begin(payload, from_front=CONTINUE_HEADER in request.headers)
            if conflict := constraints_conflict(payload):
                return error_response(400, conflict, "allowed_token_ids")
            parsed = adapter.validate_python(payload)
            continuation.note_request(track, parsed, request.app[SERVING_STATE])
            result = await call(request.app[SERVING_STATE])(parsed, VllmRequestView(request))
            if chunk_object is not None and isinstance(result, AsyncGenerator):
                result = with_finish_reasons(
                    result,
                    choice_count(parsed),
                    functools.partial(_fallback_head, chunk_object, int(time.time()), parsed.model),
                    continuation.finished_choices(track),
                )
            if track.resumed is not None and isinstance(result, AsyncGenerator):
                result = _continued(result, track)
            if request.path == TOKEN_ROUTE:
                result = _with_token_strings(result)
        except pydantic.ValidationError as exc:
            message, param = _validation_message(exc)
            return error_response(400, message, param)
        except Exception as exc:
            # vLLM's own mapping: its validation errors (raised by its model
            # validators too, not only by the serving call) are 400, not-found
            # 404, the rest 500.
            result = create_error_response(exc)
            if result.error.code >= 500:
                log.exception("%s failed", request.path)
        return await _respond(request, result, track)

    return handler


def _fallback_head(chunk_object: str, created: int, model: str) -> dict:
    """A stream's chunk head when vLLM sent no chunk to copy it from."""
    prefix = "chatcmpl" if chunk_object.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": chunk_object, "created": created, "model": model}


async def _continued(frames: AsyncGenerator[str, None], track) -> AsyncGenerator[str, None]:
    """A stream that goes on here from another engine, in the caller's stream's terms."""
    first = True
    try:
        async for frame in frames:
            if (frame := continuation.continued_frame(frame, track, first)) is not None:
                first = first and not frame.startswith("data: {")
                yield frame
    finally:
        await frames.aclose()


TOKEN_ROUTE = "/inference/v1/generate"
CHAT_CHUNK = "chat.completion.chunk"


def _name_tokens(entries: list[dict]) -> None:
    for entry in entries:
        if "token_id" in entry and "token" not in entry:
            entry["token"] = f"token_id:{entry['token_id']}"
        _name_tokens(entry.get("top_logprobs") or [])


def _named(payload: dict) -> dict:
    for choice in payload.get("choices") or []:
        if isinstance(logprobs := choice.get("logprobs"), dict):
            _name_tokens(logprobs.get("content") or [])
    return payload


async def _named_frames(frames: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    try:
        async for frame in frames:
            if frame.startswith("data: {") and '"token_id"' in frame:
                frame = "data: " + orjson.dumps(_named(orjson.loads(frame[6:]))).decode() + "\n\n"
            yield frame
    finally:
        await frames.aclose()


def _with_token_strings(result: Any) -> Any:
    """The token route's logprob entries also name their token as ``"token_id:N"``, the shape
    vLLM's token route had before 0.32 and TRL's and verifiers' clients still read; 0.32's
    fields stay, so clients of either shape read the same answer."""
    if isinstance(result, ErrorResponse):
        return result
    if isinstance(result, pydantic.BaseModel):
        return web.Response(body=orjson.dumps(_named(result.model_dump(mode="json"))), content_type="application/json")
    return _named_frames(result)


async def _respond(request: web.Request, result: Any, track=None) -> web.StreamResponse:
    if isinstance(result, ErrorResponse) and request.app[ENGINE_CLIENT].errored:
        # The engine died under this request: another engine goes on with it, from what it
        # generated here if anything (continuation.py), else from the start.
        message = f"the engine died while serving this request: {result.error.message}"
        if track is not None and track.calls:
            body = b'{"error":' + orjson.dumps(error_body(503, message)["error"]) + b","
            body += b'"' + CONTINUE_FIELD.encode() + b'":' + track.record() + b"}"
            headers = {ENGINE_DIED_HEADER: "1", CONTINUE_HEADER: "1"}
            return web.Response(status=503, body=body, content_type="application/json", headers=headers)
        return error_response(503, message, headers={ENGINE_DIED_HEADER: "1"})
    if isinstance(result, ErrorResponse):
        return web.Response(status=result.error.code, body=result.model_dump_json(), content_type="application/json")
    if isinstance(result, pydantic.BaseModel):
        return web.Response(body=result.model_dump_json(), content_type="application/json")
    if isinstance(result, web.Response):
        return result
    return await _stream_sse(request, result, track)


async def _stream_sse(request: web.Request, frames: AsyncGenerator[str, None], track=None) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    engine = request.app[ENGINE_CLIENT]
    try:
        async for frame in frames:
            if track is not None:
                if frame.startswith('data: {"error"') and engine.errored:
                    # The engine died under the stream: the front goes on with it elsewhere.
                    await response.write(continuation.marker(track))
                    break
                if track.first_frame is None and frame.startswith("data: {"):
                    track.first_frame = frame
            await response.write(frame.encode())
    finally:
        # Closing the generator on a dropped connection aborts the request in vLLM.
        await frames.aclose()
    await response.write_eof()
    return response


async def _models(request: web.Request) -> web.Response:
    models = await request.app[SERVING_STATE].openai_serving_models.show_available_models()
    return web.Response(body=models.model_dump_json(), content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    """Liveness, answered without a round trip to the EngineCore: the front
    probes it on a timer, and a long weight load must not read as a hang."""
    engine = request.app[ENGINE_CLIENT]
    try:
        await engine.check_health()
    except Exception as exc:  # EngineDeadError and friends
        return error_response(503, f"engine unhealthy: {exc}")
    return json_response({"pid": os.getpid(), "unfinished_requests": engine.get_num_unfinished_requests()})


async def _info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_CLIENT]
    # Every worker holds the same layers (its shard of each): the first one's answer.
    quantized_layers, *_ = await on_every_worker(engine, "skyinfer_quantized_layers")
    return json_response(
        {
            "weight_version": await engine.get_weight_version(),
            # The dtype weights are served in: pushed tensors must match it.
            "model_dtype": str(engine.model_config.dtype).removeprefix("torch."),
            # The layers served quantized (the checkpoint's, or an online quantization's): a push
            # must carry each whole.
            "quantized_layers": quantized_layers,
            # None: started without --enable-lora.
            "max_lora_rank": lora_config.max_lora_rank if (lora_config := engine.vllm_config.lora_config) else None,
        }
    )


async def _metrics(_request: web.Request) -> web.Response:
    # vLLM's stat loggers write to prometheus_client's default registry in this process.
    body = prometheus_client.generate_latest(prometheus_client.REGISTRY)
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


def create_engine_app(engine_client: Any, serving_state: Any) -> web.Application:
    """The engine's app. The hot routes (completions, chat, the token route, tokenize) call vLLM's own
    OpenAI serving classes, built by vLLM's ``init_app_state`` (``serving_state``), so request
    parsing, chat templates, logprobs and SSE framing are exactly vLLM's; vLLM's own app, added
    behind them (``vllm_app``), shares those serving objects."""
    from ..vllm_api import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, GenerateRequest, TokenizeRequest

    # Bodies come from the front, which enforces the user-facing limit.
    app = web.Application(client_max_size=1024**3)
    app[ENGINE_CLIENT] = engine_client
    app[SERVING_STATE] = serving_state
    app[SERVING_CALLS] = set()
    app[DATA_PARALLEL_SIZE] = engine_client.vllm_config.parallel_config.data_parallel_size
    serving = {
        "/v1/completions": (
            CompletionRequest,
            lambda s: s.openai_serving_completion.create_completion,
            "text_completion",
        ),
        "/v1/chat/completions": (
            ChatCompletionRequest,
            lambda s: s.openai_serving_chat.create_chat_completion,
            CHAT_CHUNK,
        ),
        TOKEN_ROUTE: (GenerateRequest, lambda s: s.serving_tokens.serve_tokens, None),
        "/tokenize": (TokenizeRequest, lambda s: s.serving_tokenization.create_tokenize, None),
        "/detokenize": (DetokenizeRequest, lambda s: s.serving_tokenization.create_detokenize, None),
    }
    for path, (request_type, call, chunk_object) in serving.items():
        app.router.add_post(path, _serving_route(pydantic.TypeAdapter(request_type), call, chunk_object))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/info", _info)
    app.router.add_get("/metrics", _metrics)
    add_admin_routes(app)
    add_weight_routes(app)
    add_adapter_routes(app)
    return app


# How long an engine whose EngineCore died gives the requests it served to answer with what they
# had generated (each answers as soon as vLLM tells it: milliseconds), before its process exits.
_LAST_ANSWERS_S = 2.0


async def _watch_engine_core(engine_client: Any, serving_calls: set[asyncio.Task]) -> None:
    """A dead EngineCore never recovers: once the requests it served have answered (their records,
    for another engine to go on from: continuation.py), the process exits at once, which tells
    the front; a graceful shutdown of what is left of vLLM could take seconds the restart waits for."""
    while not engine_client.errored:
        await asyncio.sleep(0.1)
    log.error("the engine died (%s); exiting", engine_client.dead_error)
    calls = {task for task in serving_calls if task is not asyncio.current_task()}
    if calls:
        await asyncio.wait(calls, timeout=_LAST_ANSWERS_S)
    await asyncio.sleep(0.05)  # the answers' last bytes, written by now, leave the socket
    logging.shutdown()
    os._exit(1)


async def _stand_by_loaded(spare: Standby, engine_client: Any) -> None:
    """Wait, built, for the start order; exit if the front lets the spare go, or its EngineCore dies meanwhile."""
    order_task = asyncio.ensure_future(asyncio.to_thread(spare.stand_by))
    while not order_task.done():
        if engine_client.errored:
            log.error("the spare's engine died while it stood by (%s); exiting", engine_client.dead_error)
            os._exit(1)
        await asyncio.wait({order_task}, timeout=0.5)
    spare.become_engine(order_task.result())
    # Written after the relay's switch: the engine's first line under its own prefix.
    print(f"spare pid {os.getpid()} takes over as the engine, built {time.monotonic() - spare.began:.1f}s before",
          file=sys.stderr, flush=True)  # fmt: skip


async def serve_engine(socket_path: str, args: Any, loaded_spare: Standby | None = None) -> None:
    """Build the engine and serve it on ``socket_path`` until stopped. A loaded spare's engine waits,
    built, for the front's start order before it takes the socket (standby.py)."""
    from ..vllm_api import build_app, build_async_engine_client, init_app_state

    def interrupt_start_up(*_):
        raise KeyboardInterrupt("terminated during start-up")

    # vLLM's start-up blocks the event loop; a signal must still stop it.
    signal.signal(signal.SIGTERM, interrupt_start_up)
    async with build_async_engine_client(args) as engine_client:
        supported_tasks = await engine_client.get_supported_tasks()
        vllm_app = build_app(args, supported_tasks, engine_client.model_config)
        await init_app_state(engine_client, vllm_app.state, args, supported_tasks)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        continuation.track_outputs(engine_client)
        kv_epochs = KvEpochs()
        kv_epochs.install(engine_client)
        app = create_engine_app(engine_client, vllm_app.state)
        watcher = asyncio.create_task(_watch_engine_core(engine_client, app[SERVING_CALLS]))
        app[KV_EPOCHS] = kv_epochs
        add_vllm_app_routes(app, vllm_app)
        # When the front drops a connection the handler is cancelled, and cancelling the generator
        # inside vLLM aborts the request in the engine.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        if loaded_spare is not None:
            await _stand_by_loaded(loaded_spare, engine_client)
        # The socket appearing is the signal to the front that this engine is ready.
        # As deep as the front's own listener: a burst of connects must queue, not fail with EAGAIN.
        site = web.UnixSite(runner, socket_path, backlog=4096)
        await site.start()
        log.info("engine ready on %s", socket_path)
        try:
            await stop.wait()
        finally:
            watcher.cancel()
            await runner.cleanup()
    if engine_client.errored:
        raise SystemExit(1)
