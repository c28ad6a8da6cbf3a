"""The rest of ``vllm serve``'s route surface, answered for the whole fleet.

Data-plane routes are in ``proxy`` (one engine per request). Here are the
routes whose answer needs more than one engine: a stored response is looked
up on the engine that holds it, engine views are gathered per engine, cache
resets and ``/collective_rpc`` are fanned out like every admin call.
``NOT_SERVED`` names the few routes of vLLM's app skyinfer leaves out, each
with the reason (the docs list them; a test holds this module to vLLM's own
route table).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from ..errors import ApiError, admin_json_body, json_response
from ..fleet.engine_calls import call_engine
from ..fleet.registry import REGISTRY
from ..serving.proxy import forward_to
from .control import CONTROL, aggregate
from .health import health

NOT_SERVED = {
    "/openapi.json": "the OpenAPI schema of vLLM's FastAPI app, not of skyinfer's routes",
    "/docs": "FastAPI's interactive docs for vLLM's app; skyinfer's routes are in its docs (reference)",
    "/docs/oauth2-redirect": "part of FastAPI's interactive docs",
    "/redoc": "FastAPI's interactive docs for vLLM's app",
    "/scale_elastic_ep": "elastic expert parallelism rescales one Ray data-parallel engine; skyinfer's is fixed",
    "/is_scaling_elastic_ep": "elastic expert parallelism: see /scale_elastic_ep",
    "/start_draft_weight_update": "pushes to a speculative-decoding draft model are not in skyinfer's push protocol",
    "/release_kv_cache_memory": "leaves an engine paused with its KV cache freed, a condition the fleet does not track; "
    "use /sleep",
}

# Data-plane routes: a client reads back or cancels its own response.
STORED_RESPONSE_PATHS = ("/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel")
# Liveness and load, open like /health (vLLM's own key guards only /v1 routes).
PUBLIC = ("/ping", "/load", "/version")
# Views of one engine's own, answered with each engine's body.
_PER_ENGINE_VIEWS = ("/server_info", "/kv_event_sources", "/load")
# Admin calls vLLM answers per engine with nothing to aggregate but success.
_CACHE_RESETS = ("reset_mm_cache", "reset_encoder_cache")
COLLECTIVE_RPC_METHODS = web.AppKey("collective_rpc_methods", frozenset)


async def _stored_response(request: web.Request) -> web.StreamResponse:
    """``/v1/responses/{id}`` (and ``/cancel``): only the engine that ran a response stores it; asked
    of that one where this front saw it answer, else of every engine."""
    body = await request.read()
    registry = request.app[REGISTRY]
    holder = registry.stored_responses.engine_of(request.match_info["response_id"])
    serving = [r for r in registry.serving() if holder is None or r.engine_id == holder]
    if not serving:
        raise ApiError("no engine is serving", status=503)
    answers = await asyncio.gather(*(forward_to(request, record, body) for record in serving))
    found = [a for a in answers if a.status < 400]
    return (found or answers)[0]


def _per_engine_view(path: str):
    async def view(request: web.Request) -> web.Response:
        """vLLM's answer of every engine, under ``engines``; for ``/server_info`` one engine's
        fields also at the top level (``engine`` says whose), as vLLM answers it; for ``/load``
        the fleet's ``server_load``. The query is forwarded."""
        registry = request.app[REGISTRY]
        timeout_s = request.app[CONTROL].timeout_s
        up = registry.up()
        query = dict(request.query)
        replies = await asyncio.gather(
            *(call_engine(r, path, method="GET", timeout_s=timeout_s, query=query) for r in up)
        )
        body = {"engines": [reply.as_json() for reply in replies]}
        if path == "/server_info" and (first := next((reply for reply in replies if reply.ok), None)):
            # vLLM's shape at the top level (TRL reads vllm_config there): every engine serves the
            # same model and arguments (its parallel sizes aside, with --engine-sizes), so one
            # engine's answer stands for the fleet; "engine" says whose.
            body = {**first.body, "engine": first.engine_id, **body}
        if path == "/load":
            # vLLM's own key: what a load-aware client reads, summed over the fleet.
            body["server_load"] = sum(reply.body.get("server_load", 0) for reply in replies if reply.ok)
        return json_response(body)

    return view


def _cache_reset(operation: str):
    async def reset(request: web.Request) -> web.Response:
        """vLLM's cache reset on every engine, one answer per engine.

        If its caller leaves: every engine still resets it."""
        outcomes = await request.app[CONTROL].apply(operation)
        return aggregate(operation, outcomes, {"status": "reset"})

    return reset


async def _collective_rpc(request: web.Request) -> web.Response:
    """vLLM's ``collective_rpc`` on every engine, for the worker methods ``--allow-collective-rpc``
    allows (body: ``method``, ``args``, ``kwargs``, ``timeout``); any other is a 403.

    If its caller leaves: the call still runs on every engine."""
    body = await admin_json_body(request, required=True)
    method = body.get("method")
    if not isinstance(method, str) or not method:
        raise ApiError("'method' must be the name of a worker method", param="method")
    allowed = request.app[COLLECTIVE_RPC_METHODS]
    if method not in allowed:
        hint = f"allowed: {', '.join(sorted(allowed))}" if allowed else "none is allowed"
        raise ApiError(
            f"/collective_rpc runs arbitrary methods in every worker; {method!r} is not on the allow-list ({hint}). "
            f"Start skyinfer with --allow-collective-rpc {method} to allow it.",
            status=403,
            param="method",
        )
    outcomes = await request.app[CONTROL].apply("collective_rpc", body=body)
    return aggregate("collective_rpc", outcomes, {"status": "done"})


def add_vllm_routes(app: web.Application, collective_rpc_methods: tuple[str, ...]) -> None:
    app[COLLECTIVE_RPC_METHODS] = frozenset(collective_rpc_methods)
    get_path, cancel_path = STORED_RESPONSE_PATHS
    app.router.add_get(get_path, _stored_response)
    app.router.add_post(cancel_path, _stored_response)
    for path in _PER_ENGINE_VIEWS:
        app.router.add_get(path, _per_engine_view(path))
    for operation in _CACHE_RESETS:
        app.router.add_post(f"/{operation}", _cache_reset(operation))
    app.router.add_post("/collective_rpc", _collective_rpc)
    # SageMaker's liveness route is vLLM's /health.
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
