"""vLLM's own FastAPI app, served in-process behind the engine's aiohttp server.

Every route ``vllm serve`` registers (dev mode included) that the engine does
not serve itself reaches vLLM's app through a plain ASGI call: the request's
bytes go in, vLLM's answer streams out. The app shares the engine's
``AsyncLLM`` and the serving objects ``init_app_state`` built, so behaviour is
vLLM's own, routes vLLM adds in a new release arrive without code here, and
the only vLLM interfaces used are its app builder and its app state.

Disconnects: aiohttp cancels the handler when the front drops the connection
(``handler_cancellation``); the cancellation reaches vLLM's handler, whose
generator abort the request in the engine, as under uvicorn.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from ..errors import error_response
from .refusals import constraints_conflict, nested_too_deep

log = logging.getLogger(__name__)

VLLM_APP = web.AppKey("vllm_app", Any)  # vLLM's FastAPI (ASGI) application

# Hop-by-hop headers belong to one connection; aiohttp frames the answer itself.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})


def _conflict(body: bytes) -> str | None:
    try:
        return constraints_conflict(orjson.loads(body))
    except orjson.JSONDecodeError:
        return None  # vLLM's app answers a body that is not JSON


def _scope(request: web.Request) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.raw_path.split("?", 1)[0].encode("latin-1"),
        "query_string": request.query_string.encode("latin-1"),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()],
        "client": ("127.0.0.1", 0),
        "server": ("localhost", 0),
    }


async def serve_with_vllm_app(request: web.Request) -> web.StreamResponse:
    """Answer ``request`` with vLLM's app."""
    body = await request.read()
    if refusal := nested_too_deep(body) or (b'"allowed_token_ids"' in body and _conflict(body)):
        return error_response(400, refusal)
    body_sent = False
    finished = asyncio.Event()
    response: web.StreamResponse | None = None

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        # Starlette listens for a disconnect while it streams; ours is a cancellation.
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal response
        if message["type"] == "http.response.start":
            headers = CIMultiDict(
                (k.decode("latin-1"), v.decode("latin-1"))
                for k, v in message.get("headers", ())
                if k.decode("latin-1").lower() not in _HOP_BY_HOP
            )
            response = web.StreamResponse(status=message["status"], headers=headers)
            await response.prepare(request)
        elif message["type"] == "http.response.body":
            assert response is not None, "ASGI body before start"
            if chunk := message.get("body", b""):
                await response.write(chunk)

    try:
        await request.app[VLLM_APP](_scope(request), receive, send)
    except Exception:
        # Starlette answers an unhandled error with a 500 and then raises it for the
        # server to log: log it, and finish that answer rather than break the connection.
        if response is None:
            raise
        log.exception("vLLM's app failed on %s %s after answering %d", request.method, request.path, response.status)
    finally:
        finished.set()
    if response is None:
        raise RuntimeError(f"vLLM's app sent no answer to {request.method} {request.path}")
    await response.write_eof()
    return response


def add_vllm_app_routes(app: web.Application, vllm_app: Any) -> None:
    """Everything the engine's own routes do not match goes to vLLM's app (added last)."""
    app[VLLM_APP] = vllm_app
    app.router.add_route("*", "/{tail:.*}", serve_with_vllm_app)
