"""Data plane: pick one engine for a request and relay bytes both ways.

Bodies pass through untouched unless they carry a ``session_id`` field, which
is moved to the ``X-Session-ID`` header (the engine validates bodies strictly
and reads the session from that header), or a ``skyinfer_continue`` field, the
front's own, which is dropped; a request that goes on from what an engine that
died generated goes to the next engine with that engine's record added. What
routing needs of a body (its ``model``, its prompt's start) is read off its
bytes: a body is parsed only when it carries one of those fields, names its
model in a way the bytes alone do not settle, or is a Responses request with a
``previous_response_id``.
A stream's chunks go to the client as the engine frames them (``stream_relay``);
every other answer, and a stream to an HTTP/1.0 caller, is read whole, then passed on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections.abc import Mapping

import aiohttp
import orjson
from aiohttp import web

from ..engine_wire import CONTINUE_FIELD, CONTINUE_HEADER, ENGINE_DIED_HEADER, NOT_CONTINUED_FIELD, SESSION_HEADER
from ..errors import error_body, error_response, parse_json_object
from ..fleet.state import EngineBusy, EngineRecord, NoEngineAvailable
from ..wire import checked_session_id
from . import stream_relay
from .body_bytes import RESPONSES_PATH, json_object, prompt_group, requested_model
from .leasing import Ask, Engine, Leases, NotConnected

log = logging.getLogger("skyinfer.proxy")

# This process's kept connections to the engines, for answers read whole.
ENGINE_CONNECTIONS = web.AppKey("engine_connections", stream_relay.EngineConnections)
# Where the data plane gets its engine from: the registry in this process, or the control process.
LEASES = web.AppKey("leases", Leases)
GROUP_PREFIX_CHARS = web.AppKey("group_prefix_chars", int)

ENGINE_HEADER = "X-Skyinfer-Engine"
WEIGHT_VERSION_HEADER = "X-Weight-Version"
# On an answer from a second engine: the id of the engine that died under the request first.
RETRIED_FROM_HEADER = "X-Skyinfer-Retried-From"
# On an answer that went on from what an engine that died had generated (not started over): its id.
CONTINUED_FROM_HEADER = "X-Skyinfer-Continued-From"
# On a relayed stream's request once its head is sent: (its response, its ``EngineAnswer``). What
# the request metrics count when the caller closes its connection before the handler returns: the
# openai SDK closes as soon as it reads ``data: [DONE]``, and such a request was answered all the same.
# (``web.RequestKey`` from aiohttp 3.14, which warns about a str key; a str before it.)
RELAYED_STREAM = web.RequestKey("relayed_stream", tuple) if hasattr(web, "RequestKey") else "skyinfer.relayed_stream"

# Requests one engine answers: every data route of ``vllm serve`` (the pooling
# ones too: an engine whose model cannot pool answers them 404, as vLLM does).
DATA_PLANE_POST = (
    "/v1/completions",
    "/v1/chat/completions",
    "/inference/v1/generate",
    "/tokenize",
    "/detokenize",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/chat/completions/batch",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/messages/render",
    "/v1/responses/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/generative_scoring",
    "/v1/systemone",
    "/invocations",
    "/v1/embeddings",
    "/v2/embed",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
)
DATA_PLANE_GET = ("/v1/models", "/version", "/tokenizer_info")

# Hop-by-hop headers, credentials meant for the front only, Expect (the front answered it), and the
# header by which an engine knows a continuation record as the front's own.
_NOT_FORWARDED = frozenset(
    h.lower()
    for h in (
        "Host", "Content-Length", "Connection", "Keep-Alive", "Transfer-Encoding", "TE", "Upgrade",
        "Authorization", "Accept-Encoding", "Proxy-Authorization", "Proxy-Connection", "Expect",
        CONTINUE_HEADER,
    )
)  # fmt: skip
_QUOTED_CONTINUE_FIELD = f'"{CONTINUE_FIELD}"'.encode()


def _front_fields(body: bytes) -> tuple[bytes, str | None]:
    """Move a top-level ``session_id`` out of a JSON body, and drop a ``skyinfer_continue`` (only the
    front may send an engine a record to go on from; an engine also takes one only with the front's
    header, as a name spelled with JSON escapes gets past this check); parse only when one may be there."""
    if b'"session_id"' not in body and _QUOTED_CONTINUE_FIELD not in body:
        return body, None
    payload = parse_json_object(body)
    if "session_id" not in payload and CONTINUE_FIELD not in payload:
        return body, None
    payload.pop(CONTINUE_FIELD, None)
    session_id = payload.pop("session_id", None)
    return orjson.dumps(payload), None if session_id is None else str(session_id)


# Waits before re-sending a request whose connection to an engine could not be
# opened (its socket's backlog full, or it is going away): nothing was sent, so
# sending again is safe. About 1.5 s in all.
CONNECT_RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.4, 0.8)
# What a refused request is told to wait before trying again: an engine's queue is full, or no
# engine served while the request was held (restarts take tens of seconds or more).
BUSY_RETRY_AFTER_S = 1
NONE_SERVING_RETRY_AFTER_S = 10


class _EngineDied(Exception):
    """The engine died under the request before any byte of its answer reached the caller."""

    def __init__(self, engine: Engine, answer: web.Response, record: bytes | None = None):
        super().__init__(engine.engine_id)
        self.engine_id = engine.engine_id
        # What the caller gets if the request is not sent again.
        self.answer = answer
        # What it generated (engine/continuation.py), to go on from on an engine with the same weights.
        self.going_on = None if record is None else _GoingOn(engine.engine_id, engine.weight_version, record)


class _StreamBrokeOff(Exception):
    """The engine died mid-stream, the caller's answer begun: another engine goes on with it."""

    def __init__(self, response: web.StreamResponse, going_on: _GoingOn):
        super().__init__(going_on.engine_id)
        self.response = response
        self.going_on = going_on


class _GoingOn:
    """A request an engine died under, and what it had generated: the record the next engine goes on from."""

    __slots__ = ("engine_id", "not_continued", "record", "weight_version")

    def __init__(self, engine_id: int, weight_version: str | None, record: bytes):
        self.engine_id = engine_id
        self.weight_version = weight_version
        self.record = record
        self.not_continued: str | None = orjson.loads(record).get(NOT_CONTINUED_FIELD)  # what a splice would lose

    @staticmethod
    def headers(headers: dict) -> dict:
        return {**headers, CONTINUE_HEADER: "1"}  # the record is the front's: an engine takes none without it

    def body(self, body: bytes) -> bytes:
        """The request's body with the record added, for the engine that goes on with it."""
        payload = parse_json_object(body)
        record = orjson.loads(self.record)
        record["from_engine"] = self.engine_id
        payload[CONTINUE_FIELD] = record
        return orjson.dumps(payload)


def add_data_plane_routes(app: web.Application) -> None:
    """The routes one engine answers (``forward``), and this process's connections to the engines."""

    async def engine_connections(app: web.Application):
        app[ENGINE_CONNECTIONS] = stream_relay.EngineConnections()
        yield
        app[ENGINE_CONNECTIONS].close()

    app.cleanup_ctx.append(engine_connections)
    for path in DATA_PLANE_POST:
        app.router.add_post(path, forward)
    for path in DATA_PLANE_GET:
        app.router.add_get(path, forward)


def _forwarded_headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}


async def forward(request: web.Request) -> web.StreamResponse:
    """One engine answers, with vLLM's own body for the route: the session's engine
    (``X-Session-ID``, or a ``session_id`` field), else the one holding the prompt's group, else
    the least loaded; ``X-Skyinfer-Engine`` and ``X-Weight-Version`` say which and with what."""
    body = await request.read()
    body, body_session = _front_fields(body)
    session_id = request.headers.get(SESSION_HEADER) or body_session
    if session_id:
        session_id = checked_session_id(
            session_id, SESSION_HEADER if SESSION_HEADER in request.headers else "session_id"
        )
    headers = _forwarded_headers(request)
    if session_id:
        headers[SESSION_HEADER] = session_id
    prefix_chars = request.app[GROUP_PREFIX_CHARS]
    ask = Ask(
        session_id=session_id or None,
        group=prompt_group(body, prefix_chars, request.path) if prefix_chars and not session_id else None,
        model=requested_model(body),
        previous_response=_previous_response(body) if request.path == RESPONSES_PATH else None,
    )
    leases = request.app[LEASES]
    try:
        return await _send(request, ask, body, headers)
    except _EngineDied as died:
        first_death = died
    except _StreamBrokeOff as broke:
        return await _go_on_streaming(request, ask, body, headers, broke)
    dead = first_death.engine_id
    if not leases.has_other_member(dead):
        return first_death.answer
    log.warning("engine %d died under %s %s: sending it to another engine", dead, request.method, request.path)
    leases.note_retried(dead)
    # Once, and never to the engine that died: a request that kills engines must not walk through the
    # fleet. If no other engine serves now, it waits for one like any request.
    going_on = first_death.going_on
    if going_on is not None and going_on.not_continued is not None:
        # Its caller has nothing yet: started over, the answer is the one it asked for.
        log.info("request on %s starts over: it cannot go on (%s)", request.path, going_on.not_continued)
        going_on = None
    try:
        return await _send(request, ask, body, headers, retried_from=dead, going_on=going_on)
    except _EngineDied as again:
        message = _second_death(request, body, dead, again.engine_id)
        return error_response(500, message, headers={ENGINE_HEADER: str(again.engine_id)})
    except _StreamBrokeOff as broke:
        message = _second_death(request, body, dead, broke.going_on.engine_id)
        return await _end_with_error(broke.response, None, message, status=500)


# The id of a stored response: the top-level "id" of an answer, or in a stream the "id" of the
# response in its first event (response.created).
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]+)"')


def _previous_response(body: bytes) -> str | None:
    """The stored response a Responses request continues (its engine alone can answer it)."""
    if b'"previous_response_id"' not in body:
        return None
    previous = (json_object(body) or {}).get("previous_response_id")
    return previous if isinstance(previous, str) else None


def _remember_response(request: web.Request, engine: Engine, head: bytes) -> None:
    """Record which engine stored a Responses answer, from the first bytes of its body."""
    if request.path == RESPONSES_PATH and (found := _RESPONSE_ID.search(head[:4096])):
        request.app[LEASES].remember_response(found.group(1).decode(), engine.engine_id)


async def _send(
    request: web.Request,
    ask: Ask,
    body: bytes,
    headers: dict,
    retried_from: int | None = None,
    going_on: _GoingOn | None = None,
) -> web.StreamResponse:
    """``going_on``: what the engine that died had generated, which an engine serving the same
    weights goes on from (another starts over)."""
    leases = request.app[LEASES]
    exclude = () if retried_from is None else (retried_from,)
    retried = {} if retried_from is None else {RETRIED_FROM_HEADER: str(retried_from)}
    for delay_s in (*CONNECT_RETRY_DELAYS_S, None):
        try:
            async with leases.lease(ask, exclude) as grant:
                engine = grant.engine
                extra_headers = {**retried, **_version_header(engine, grant.adapter)}
                sent, sent_headers = body, headers
                if going_on is not None and engine.weight_version == going_on.weight_version:
                    sent, sent_headers = going_on.body(body), going_on.headers(headers)
                    extra_headers[CONTINUED_FROM_HEADER] = str(going_on.engine_id)
                return await _relay(request, engine, sent, sent_headers, extra_headers)
        except NoEngineAvailable as exc:
            held = f" (held {leases.hold_requests_s:g}s)" if leases.hold_requests_s else ""
            return error_response(503, f"{exc}{held}", headers={"Retry-After": str(NONE_SERVING_RETRY_AFTER_S)})
        except EngineBusy as exc:
            busy = {ENGINE_HEADER: str(exc.engine_id), WEIGHT_VERSION_HEADER: exc.weight_version or ""}
            return error_response(503, str(exc), headers={"Retry-After": str(BUSY_RETRY_AFTER_S), **busy})
        except NotConnected as exc:
            engine = exc.engine
            if delay_s is None:
                return error_response(
                    503, f"engine {engine.engine_id} could not be reached: {exc}", headers=_own_headers(engine)
                )
            log.info("engine %d: %s; trying again in %.2fs", engine.engine_id, exc, delay_s)
            await asyncio.sleep(delay_s)
    raise AssertionError("unreachable: the last attempt returns")


def _own_headers(engine: Engine) -> dict[str, str]:
    return {ENGINE_HEADER: str(engine.engine_id), WEIGHT_VERSION_HEADER: engine.weight_version or ""}


def _version_header(engine: Engine, adapter: str | None) -> dict[str, str]:
    """An adapter's answer carries the adapter's version (the base weights' is in ``/weight_info``)."""
    return {} if adapter is None else {WEIGHT_VERSION_HEADER: engine.adapters.get(adapter, "")}


def _answer(
    request: web.Request,
    engine: Engine,
    status: int,
    upstream_headers: Mapping[str, str],
    payload: bytes,
    extra_headers: dict[str, str],
) -> web.Response:
    """An engine's whole answer as the caller gets it; ``_EngineDied`` if the engine says it died."""
    if ENGINE_DIED_HEADER in upstream_headers:
        # The engine's record of what it generated is the front's alone: the caller's answer is the error.
        record = None
        if CONTINUE_HEADER in upstream_headers and (died := json_object(payload)) is not None:
            record = died.pop(CONTINUE_FIELD, None)
            payload = orjson.dumps(died)
        answer = _buffered(status, upstream_headers, payload, {**_own_headers(engine), **extra_headers})
        raise _EngineDied(engine, answer, None if record is None else orjson.dumps(record))
    # Read once the engine answers: the version a kept request finished with.
    answer = _buffered(status, upstream_headers, payload, {**_own_headers(engine), **extra_headers})
    if status == 200:
        _remember_response(request, engine, payload)
    return answer


def _buffered(
    status: int, upstream_headers: Mapping[str, str], payload: bytes, own_headers: dict[str, str]
) -> web.Response:
    content_type = upstream_headers.get("Content-Type", "application/json")
    if status >= 400 and (message := _not_openai_error(payload, content_type)) is not None:
        # An error from below vLLM's handlers (aiohttp's, or FastAPI's 404 for a
        # route the model lacks): still the OpenAI shape.
        return error_response(status, message, headers=own_headers)
    return web.Response(status=status, body=payload, headers={**own_headers, "Content-Type": content_type})


def _not_openai_error(payload: bytes, content_type: str) -> str | None:
    """The message of an error body that is not in the OpenAI shape; None if it is."""
    if content_type.startswith("application/json"):
        try:
            body = orjson.loads(payload)
        except orjson.JSONDecodeError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return None
        if isinstance(body, dict) and "detail" in body:
            return str(body["detail"])[:1000]
    return payload.decode(errors="replace")[:1000]


async def forward_to(request: web.Request, engine: EngineRecord, body: bytes) -> web.Response:
    """``request`` as ``engine`` answers it, read whole: for lookups asked of several engines at once."""
    if engine.client is None or engine.client.closed:
        return error_response(503, f"engine {engine.engine_id} is {engine.state.value}", headers=_own_headers(engine))
    try:
        async with engine.client.request(
            request.method, request.rel_url, data=body or None, headers=_forwarded_headers(request)
        ) as upstream:
            return _buffered(upstream.status, upstream.headers, await upstream.read(), _own_headers(engine))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return _engine_failed(request, engine, exc)


def _engine_failed(request: web.Request, engine: Engine, exc: BaseException) -> web.Response:
    log.warning("engine %d: %s %s failed: %r", engine.engine_id, request.method, request.path, exc)
    message = f"engine {engine.engine_id} failed while serving the request: {exc!r}"
    return error_response(503, message, headers=_own_headers(engine))


async def _relay(
    request: web.Request, engine: Engine, body: bytes, headers: dict, extra_headers: dict[str, str]
) -> web.StreamResponse:
    """The engine's answer: a stream's chunks go to the caller as they come, any other answer read whole."""
    connections = request.app[ENGINE_CONNECTIONS]
    try:
        answer = await connections.send(engine.socket_path, request.method, request.raw_path, body, headers)
    except (OSError, asyncio.TimeoutError) as exc:
        raise NotConnected(repr(exc), engine) from None
    try:
        return await _relay_answer(request, engine, answer, extra_headers)
    finally:
        # Done, failed, or the caller went away (its handler cancelled): a stream's engine sees the
        # connection close and aborts what it still generates.
        answer.finish()


async def _relay_answer(
    request: web.Request, engine: Engine, answer: stream_relay.EngineAnswer, extra_headers: dict[str, str]
) -> web.StreamResponse:
    try:
        head = await answer.head()
        # A caller on HTTP/1.0 cannot take chunks: it gets a stream whole.
        if not head.event_stream or request.version < aiohttp.HttpVersion11:
            whole = await answer.body()
            if answer.continuation is not None:
                # Its EngineCore died mid-stream and nothing has reached the caller: the request
                # goes to another engine from its start.
                raise _EngineDied(engine, _engine_failed(request, engine, RuntimeError("its EngineCore died")))
            return _answer(request, engine, head.status, head.headers, whole, extra_headers)
        first = await answer.first_chunk()
    except stream_relay.EngineHangUp as exc:
        # Nothing has reached the caller: the request may still go to another engine.
        raise _EngineDied(engine, _engine_failed(request, engine, exc)) from None
    if first is None and answer.continuation is not None:
        failed = _engine_failed(request, engine, RuntimeError("its EngineCore died"))
        raise _EngineDied(engine, failed, answer.continuation)
    if head.status == 200 and first:
        _remember_response(request, engine, first)
    headers = {**_own_headers(engine), **extra_headers, "Content-Type": head.headers["Content-Type"]}
    response = web.StreamResponse(status=head.status, headers={**headers, "Cache-Control": "no-cache"})
    await response.prepare(request)
    request[RELAYED_STREAM] = (response, answer)
    if first is not None:
        await response.write(first)
        if first.endswith(stream_relay.DONE_EVENT):
            answer.delivered = True
        if request.transport is None:
            raise ConnectionResetError("the caller went away")
        try:
            await answer.relay_to(request.transport)
        except stream_relay.EngineHangUp as exc:
            # The engine broke off mid-stream; the status line is already sent.
            log.warning("engine %d: stream on %s broke off: %r", engine.engine_id, request.path, exc)
            return await _end_with_error(response, answer, f"engine {engine.engine_id} failed mid-stream: {exc!r}")
        if answer.continuation is not None:
            raise _StreamBrokeOff(response, _GoingOn(engine.engine_id, engine.weight_version, answer.continuation))
    return await _end(response, answer)


async def _end(response: web.StreamResponse, answer: stream_relay.EngineAnswer) -> web.StreamResponse:
    try:
        await response.write_eof()
    except ConnectionResetError:
        # The caller closed its connection before the end of the chunked body: once it has had the
        # whole answer (its [DONE], as the openai SDK closes), that is no failure of the request.
        if not answer.delivered:
            raise
    return response


async def _end_with_error(
    response: web.StreamResponse, answer: stream_relay.EngineAnswer | None, message: str, status: int = 503
) -> web.StreamResponse:
    """End a stream whose status line is sent with the front's own error event, and its [DONE]."""
    await response.write(b"data: " + orjson.dumps(error_body(status, message)) + b"\n\ndata: [DONE]\n\n")
    if answer is not None:
        answer.delivered = True  # all there is
    with contextlib.suppress(ConnectionResetError):  # the caller had all there is, and left
        await response.write_eof()
    return response


def _second_death(request: web.Request, body: bytes, first: int, second: int) -> str:
    """A request in flight at two engine deaths is not sent to a third: one that kills engines (a
    grammar, a sampling corner, a long-context bug) would otherwise take the whole fleet down, each
    engine coming back tens of seconds later. Counted, and logged so that an operator finds it;
    what the caller is told."""
    request.app[LEASES].note_second_death(second)
    digest = hashlib.sha256(body).hexdigest()[:16]
    request_id = request.headers.get("X-Request-Id", "-")
    log.error(
        "request in flight at two engine deaths (engines %d and %d), ended: request id %s, %s %s, body sha256 %s",
        first,
        second,
        request_id,
        request.method,
        request.path,
        digest,
    )
    return (
        f"the request was in flight when engine {first} died, and again when engine {second} died: it is not"
        f" sent to a third engine, in case it is what kills them (body sha256 {digest}, in the server's log)"
    )


async def _go_on_streaming(
    request: web.Request, ask: Ask, body: bytes, headers: dict, broke: _StreamBrokeOff
) -> web.StreamResponse:
    """The engine of a stream died after the caller had events: an engine serving the same weights
    goes on with it, its events relayed on the same answer; if that one dies too, none can, or the
    request cannot go on as it would have (``not_continued``), the caller gets the front's error event."""
    leases, response, going_on = request.app[LEASES], broke.response, broke.going_on
    dead = going_on.engine_id
    message = f"engine {dead} died mid-stream"
    if going_on.not_continued is not None:
        log.warning("engine %d died mid-stream on %s: the stream ends (%s)", dead, request.path, going_on.not_continued)
        message = f"{message}; the request cannot go on on another engine as it would have: {going_on.not_continued}"
        return await _end_with_error(response, None, message)
    log.warning("engine %d died mid-stream on %s: going on on another engine", dead, request.path)
    leases.note_retried(dead)
    if not leases.has_other_member(dead) or request.transport is None:
        return await _end_with_error(response, None, f"{message}, and no other engine serves")
    try:
        async with leases.lease(ask, (dead,)) as grant:
            engine = grant.engine
            if engine.weight_version != going_on.weight_version:
                return await _end_with_error(
                    response, None, f"{message}; engine {engine.engine_id} serves other weights"
                )
            answer = await request.app[ENGINE_CONNECTIONS].send(
                engine.socket_path, request.method, request.raw_path, going_on.body(body), going_on.headers(headers)
            )
            try:
                head = await answer.head()
                first = await answer.first_chunk() if head.status == 200 and head.event_stream else None
                if first is not None:
                    await response.write(first)
                    await answer.relay_to(request.transport)
                if answer.continuation is not None:
                    message = _second_death(request, body, dead, engine.engine_id)
                    return await _end_with_error(response, answer, message, status=500)
                if first is None:
                    return await _end_with_error(
                        response, answer, f"{message}; engine {engine.engine_id} answered {head.status}"
                    )
                return await _end(response, answer)
            finally:
                answer.finish()
    except (NoEngineAvailable, EngineBusy, NotConnected, OSError, asyncio.TimeoutError) as exc:
        return await _end_with_error(response, None, f"{message}; no engine could go on with it: {exc}")
    except stream_relay.EngineHangUp:
        # The next engine's process went away under it: a second death all the same.
        return await _end_with_error(response, None, _second_death(request, body, dead, engine.engine_id), status=500)
