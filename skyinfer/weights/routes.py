"""The weight routes (vLLM 0.32's names and bodies): each parses its body, calls one method of
the app's ``WeightSync``, and answers JSON; errors map to the OpenAI error shape (errors.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ..errors import ApiError, admin_json_body, json_response
from ..wire import (
    FinishRequest,
    InitRequest,
    RelabelRequest,
    StartRequest,
    UpdateRequest,
    WeightCheckRequest,
    WireModel,
    takes,
)
from .catchup import CATCH_UP
from .sync import WEIGHT_SYNC, WeightSync

__all__ = ("add_weight_routes",)


def _sync_route(request_type: type[WireModel], handler: Callable[[WeightSync, Any], Awaitable[dict]]):
    async def call(sync: WeightSync, body: Any) -> dict:
        # No silence while a weight call runs, or waits for the registry's lock.
        sync.call_began()
        accepted = True
        try:
            return await handler(sync, body)
        except ApiError as exc:
            # Refused (bad input, wrong order): the trainer's silence is not broken by it.
            accepted = exc.status >= 500
            raise
        finally:
            sync.call_ended(accepted)

    @takes(request_type)
    async def route(request: web.Request) -> web.Response:
        body = request_type.parse(await admin_json_body(request) or {})
        # A trainer that dies mid-call does not cut the bookkeeping short (ending the update on
        # engines whose transfer broke): admin calls run to their end (abandoning.py).
        return json_response(await call(request.app[WEIGHT_SYNC], body))

    route.__doc__ = handler.__doc__
    return route


async def _init(sync: WeightSync, body: InitRequest) -> dict:
    """Set up the transfer with every engine of the fleet: the group's rendezvous (gloo, NCCL;
    the front gives each engine its ranks), or a colocated transport's settings.

    If its caller leaves: until its trainer listens at ``master_address:master_port`` no engine
    is asked anything, and the next init supersedes it at once; once the engines were asked, the
    rendezvous runs to its end or to the group's timeout. A 504 after the timeout says the trainer
    never listened (a wrong address costs the engines nothing)."""
    return await sync.group.init(body.init_info)


async def _start(sync: WeightSync, body: StartRequest) -> dict:
    """Open an update; ``update_info``, if given, is checked against the checkpoint (nothing is
    touched yet).

    If its caller leaves: the update stays open; a trainer silent for the group's timeout has gone,
    and the update is abandoned (its later calls are refused with ``update_abandoned``)."""
    return sync.push.start(body.update_info, body.staged)


async def _update(sync: WeightSync, body: UpdateRequest) -> dict:
    """Every engine receives the tensors ``update_info`` names while the trainer sends them;
    without an open update, start and finish too (``weight_version`` labels it). A staged update
    (``staged`` here for a one-call push, else at its ``/start_weight_update``) is received into
    staging copies while the engines generate, which stop only for the swap at its finish; ``kv``
    says whether running requests recompute their KV (exact) or keep it.

    If its caller leaves: the engines' side runs to its end (a broken transfer is aborted on every
    engine, which serve nothing until a push of the whole checkpoint, or ``/reload_weights``). A
    chunk of an update the server abandoned is a 409 ``update_abandoned``, never an update of its
    own. ``check_only``: answers what the call would be refused for, and nothing moves."""
    if body.check_only:
        return await sync.push.check_receive(body.update_info, body.kv, body.staged)
    return await sync.push.receive(body.update_info, body.weight_version, body.kv, body.staged)


async def _finish(sync: WeightSync, body: FinishRequest) -> dict:
    """Every engine serves the new weights under ``weight_version``; ``verify`` (or
    ``expected_checksums``) holds each to the others' weights.

    If its caller leaves: the finish still lands; ``GET /weight_info`` shows the version served."""
    return await sync.push.finish(body.weight_version, body.verifies, body.expected_checksums, body.kv)


async def _relabel(sync: WeightSync, body: RelabelRequest) -> dict:
    """Give the weights the fleet serves a new label, without a transfer.

    If its caller leaves: the label still changes."""
    return await sync.checks.relabel(body.new_version)


async def _check_weights(sync: WeightSync, body: WeightCheckRequest) -> dict:
    """vLLM's weight checker over the fleet: ``checksum`` (an engine that differs is held out),
    ``compare`` with a ``baseline``, or ``reset`` (zeroes the weights)."""
    return await sync.checks.check(body)


async def _reload(sync: WeightSync, body: WireModel) -> dict:
    """Every engine loads the checkpoint on disk again, in place (no restart).

    If its caller leaves: the load still runs to its end, as a push would."""
    return await sync.push.reload()


async def _shutdown(sync: WeightSync, body: WireModel) -> dict:
    """Every engine leaves the trainer's group.

    If its caller leaves: every engine still leaves it."""
    return await sync.group.shutdown()


async def _world_size(request: web.Request) -> web.Response:
    """The inference side of the transfer group: the fleet's workers (vLLM's answer)."""
    return json_response({"world_size": request.app[WEIGHT_SYNC].worker_count})


async def _weight_info(request: web.Request) -> web.Response:
    """The fleet's weight version, the update's phase, what the engines serve quantized and what a
    push must carry for it, and each engine's version, state and group; the last push that finished
    (``last_push``: its seconds from its first call and each stage's, ``pause``, ``start``,
    ``receive``, ``finish``, ``verify``, ``resume``, as the front timed them, or a one-call live
    push's slowest engine its own first four; how its tensors came, ``layout`` ``given`` or
    ``named``, and how the engines applied them: ``in place``, ``by_plan``, ``plans_recorded``, or
    ``layerwise reload``); the prefixes of the files this server makes in /dev/shm (its trainers'
    segments, its catch-ups' copies)."""
    sync = request.app[WEIGHT_SYNC]
    files = {"pushes": sync.transport.shm_segment_prefix, "catch_up": request.app[CATCH_UP].prefix}
    return json_response({**sync.info(), "shm_prefixes": files})


def add_weight_routes(app: web.Application) -> None:
    app.router.add_get("/get_world_size", _world_size)
    for path in ("/init_weight_transfer", "/init_weight_transfer_engine"):
        app.router.add_post(path, _sync_route(InitRequest, _init))
    app.router.add_post("/start_weight_update", _sync_route(StartRequest, _start))
    app.router.add_post("/update_weights", _sync_route(UpdateRequest, _update))
    app.router.add_post("/finish_weight_update", _sync_route(FinishRequest, _finish))
    app.router.add_post("/shutdown_weight_transfer_engine", _sync_route(WireModel, _shutdown))
    app.router.add_post("/update_weight_version", _sync_route(RelabelRequest, _relabel))
    app.router.add_post("/reload_weights", _sync_route(WireModel, _reload))
    app.router.add_post("/weight_checker", _sync_route(WeightCheckRequest, _check_weights))
    app.router.add_get("/weight_info", _weight_info)
