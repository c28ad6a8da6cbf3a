"""The one place that writes errors in the OpenAI shape.

``{"error": {"message": ..., "type": ..., "param": ..., "code": <http status>}}``
is what vLLM's own server and the OpenAI SDK use; the SDK maps the HTTP
status to its exception classes and shows ``message``. A refusal a client can
act on by itself says so with a string ``code`` instead (``TRANSFER_GROUP_GONE``).
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("skyinfer.errors")

_TYPE_BY_STATUS = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """``code``: what a client may act on without reading the message (default: the status)."""
    err_type = _TYPE_BY_STATUS.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": code or status}}


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=orjson.dumps(error_body(status, message, param)),
        content_type="application/json",
        headers=headers,
    )


def json_response(payload, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json", headers=headers)


class ApiError(Exception):
    """A refusal the caller must see, raised anywhere under a handler: the
    middleware answers it with ``status`` in the OpenAI shape, ``details``
    (each engine's answer, say) beside the error."""

    status = 400
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        param: str | None = None,
        details: dict | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code
        self.param = param
        self.details = details or {}


# The engines are not (or no longer) in the trainer's weight-transfer group: form it again
# (POST /init_weight_transfer) and retry. skyinfer's trainer helpers do so by themselves.
TRANSFER_GROUP_GONE = "transfer_group_gone"
# A staged push's staging copies would not fit in the memory the host has: push without staged.
STAGING_DOES_NOT_FIT = "staging_does_not_fit"
# The weight update a chunk, finish or verify belongs to was abandoned by the server (its trainer
# fell silent, a new trainer set up a transfer, an engine failed it): start the push over
# (POST /start_weight_update, or /init_weight_transfer). skyinfer's trainer helpers do so by themselves.
UPDATE_ABANDONED = "update_abandoned"
# An update named its layout alone (update_info.layout) and this server was never given it, or let go
# of it: send that update_info in full. skyinfer's trainer helpers do so by themselves.
UNKNOWN_LAYOUT = "unknown_layout"
# A delta push (update_info.delta) some engine cannot take: it serves another version than the delta's
# base (restarted, caught up, held out), or its model takes dense pushes only (mixture of experts,
# quantized layers). Push dense; skyinfer's trainer helpers do so by themselves.
DELTA_BASE_MISMATCH = "delta_base_mismatch"
DELTA_NOT_APPLICABLE = "delta_not_applicable"


class BadRequest(ApiError, ValueError):
    """Bad input: 400."""


def parse_json_object(body: bytes) -> dict:
    """Parse a request body that must be a JSON object; BadRequest says what is wrong."""
    if not body:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(payload).__name__}")
    return payload


# What an admin route's body must be sent as (parameters such as ``; charset=utf-8`` are fine).
ADMIN_BODY_TYPE = "application/json"


async def admin_json_body(request: web.Request, *, required: bool = False) -> dict | None:
    """The JSON object an admin route's body carries, or None for an empty body (vLLM's admin routes
    take query strings: ``curl -X POST`` with no body works, whatever its Content-Type).

    A non-empty body is read only when sent as ``application/json``, else it is a 415: a web page
    can make a browser POST ``text/plain`` (or a form) cross-site without asking the server first,
    and such a body must never pause, sleep or re-weight the fleet. ``required``: an empty body is a
    400 too (a route with nothing to do without one)."""
    raw = await request.read()
    if not raw:
        if required:
            raise BadRequest("request body is empty; expected a JSON object")
        return None
    # aiohttp's content_type: the media type alone, lower case; application/octet-stream when none is sent.
    if request.content_type.lower() != ADMIN_BODY_TYPE:
        sent = request.headers.get("Content-Type")
        raise ApiError(
            f"{request.path} takes a JSON body only as Content-Type {ADMIN_BODY_TYPE}, and this one came "
            f"{'as ' + repr(sent) if sent else 'with no Content-Type'}: send the body as {ADMIN_BODY_TYPE} "
            "(or send no body, the parameters in the query string)",
            status=415,
        )
    return parse_json_object(raw)


@web.middleware
async def openai_errors_middleware(request: web.Request, handler):
    """The one place that turns exceptions into answers, in the OpenAI shape:
    refusals (``ApiError``), aiohttp's own HTTP errors (unknown route, body
    too large, ...) and any exception nobody foresaw, which is a 500 whose
    traceback goes to the log."""
    try:
        return await handler(request)
    except ApiError as exc:
        return json_response(
            {**error_body(exc.status, str(exc), exc.param, exc.code), **exc.details}, status=exc.status
        )
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        return error_response(exc.status, message, headers=_passthrough_headers(exc))
    except Exception as exc:
        if isinstance(exc, ConnectionResetError) or request.writer.output_size > 0:
            raise  # the client is gone, or has part of an answer already: nothing more can be sent
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"internal error while serving {request.method} {request.path}: {exc!r}")


def _passthrough_headers(exc: web.HTTPException) -> dict[str, str]:
    # 405 must keep its Allow header.
    allow = exc.headers.get("Allow")
    return {"Allow": allow} if allow else {}


class _OpenAIErrorsRequestHandler(RequestHandler):
    """aiohttp's per-connection handler, answering what its HTTP parser refuses
    (too many or too long headers, a bad request line or header value) in the
    OpenAI shape; those requests never reach the app's middlewares."""

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None):
        # aiohttp's own: logs, and raises if part of an answer was already sent.
        super().handle_error(request, status, exc, message)
        text = message if message and status != 500 else HTTPStatus(status).phrase
        response = error_response(status, text)
        response.force_close()
        return response


class _OpenAIErrorsServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _OpenAIErrorsRequestHandler(self, loop=self._loop, **self._kwargs)


class OpenAIErrorsAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer even HTTP parser errors in the OpenAI shape."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _OpenAIErrorsServer
        return server
