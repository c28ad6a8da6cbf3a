"""Engine-side admin routes: each parses its typed parameters and makes one AsyncLLM call.

Ordering rules (resume only when paused, ...) live in the front, which
knows every engine's state; these handlers only carry the call out.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ..errors import error_response, json_response, parse_json_object
from ..wire import (
    AbortParams,
    PauseParams,
    ResetPrefixCacheParams,
    SleepParams,
    WakeUpParams,
    WeightCheckRequest,
    WireError,
)
from .appkeys import ENGINE_CLIENT
from .worker_calls import every_worker_answers

log = logging.getLogger("skyinfer.engine.admin")


async def pause(engine, mode: str, clear_cache: bool) -> None:
    """vLLM's ``pause_generation``; a keep pause that keeps the caches (a push's, a staged swap's)
    is the scheduler's pause alone. vLLM's own then sleeps 20 ms so that requests it ended have
    their last outputs delivered before it returns ("not required for correctness", its comment
    says): a keep pause ends none, and the tokens of the steps before it carry the weight version
    their EngineCore attached as it made them. A fifth to a third of a small model's push was that
    sleep (tools/bench_weight_sync.py --model demo)."""
    if mode == "keep" and not clear_cache:
        await engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
    else:
        await engine.pause_generation(mode=mode, clear_cache=clear_cache)


async def _pause(engine, request: web.Request) -> dict:
    p = PauseParams.from_request(request.query)
    await pause(engine, p.mode, p.clear_cache)
    return {"status": "paused", "mode": p.mode}


async def _resume(engine, request: web.Request) -> dict:
    await engine.resume_generation()
    return {"status": "resumed"}


async def _sleep(engine, request: web.Request) -> dict:
    p = SleepParams.from_request(request.query)
    await engine.sleep(p.level, p.mode)
    return {"status": "sleeping", "level": p.level}


async def _wake_up(engine, request: web.Request) -> dict:
    p = WakeUpParams.from_request(request.query)
    fully_awake = await engine.wake_up(list(p.tags) if p.tags else None)
    return {"status": "awake" if fully_awake else "sleeping", "fully_awake": fully_awake}


async def _reset_prefix_cache(engine, request: web.Request) -> dict:
    p = ResetPrefixCacheParams.from_request(request.query)
    reset = await engine.reset_prefix_cache(p.reset_running_requests, p.reset_external)
    return {"status": "reset" if reset else "not_reset", "reset": reset}


async def _conditions(engine, request: web.Request) -> dict:
    """What vLLM itself says, for the front to re-read after a call that failed or timed out."""
    return {"paused": await engine.is_paused(), "sleeping": await engine.is_sleeping()}


def _tracked_ids(engine, response_ids: tuple[str, ...] | None) -> list[str]:
    """Internal ids of the requests to abort: all of them, or those behind the given response ids.

    A completion's response id is ``cmpl-X`` while vLLM tracks prompt i as
    ``cmpl-X-i``, so a response id matches its per-prompt requests too.
    """
    processor = engine.output_processor
    states = processor.request_states
    if response_ids is None:
        # Parents of parallel sampling included, as vLLM's own /abort_requests does.
        return [*states.keys(), *processor.parent_requests.keys()]
    wanted = set(response_ids)
    return [
        internal_id
        for internal_id, state in states.items()
        if state.external_req_id in wanted or state.external_req_id.rpartition("-")[0] in wanted
    ]


async def abort(engine, response_ids: tuple[str, ...] | None = None) -> int:
    """Abort the requests behind ``response_ids`` (None: every request the engine holds); how many."""
    ids = _tracked_ids(engine, response_ids)
    await engine.abort(ids, internal=True)
    return len(ids)


async def _abort_requests(engine, request: web.Request) -> dict:
    body = await request.read()
    p = AbortParams.parse(parse_json_object(body) if body else {})
    return {"status": "aborted", "aborted": await abort(engine, p.request_ids)}


async def _weight_checker(engine, request: web.Request) -> dict:
    """vLLM's per-tensor digests of this engine's weights, or vLLM's reset (every weight zeroed).
    Comparing is the front's job: it knows what the fleet should hold."""
    body = await request.read()
    p = WeightCheckRequest.parse(parse_json_object(body) if body else {})
    if p.action == "reset":
        await every_worker_answers(engine, "reset_weights")
        return {"status": "reset"}
    checksums: dict[str, str] = {}
    for per_worker in await engine.compute_weight_checksums():
        checksums.update(per_worker)  # keys carry the worker's ranks
    return {"checksums": checksums}


def _admin_route(call: Callable[[Any, web.Request], Awaitable[dict]]):
    async def handler(request: web.Request) -> web.Response:
        try:
            return json_response(await call(request.app[ENGINE_CLIENT], request))
        except WireError as exc:
            return error_response(400, str(exc), exc.param)
        except ValueError as exc:
            return error_response(400, str(exc))
        except Exception as exc:
            log.exception("%s failed", request.path)
            return error_response(500, f"{request.path} failed in the engine: {exc!r}")

    return handler


def add_admin_routes(app: web.Application) -> None:
    for path, call in {
        "/pause": _pause,
        "/resume": _resume,
        "/sleep": _sleep,
        "/wake_up": _wake_up,
        "/reset_prefix_cache": _reset_prefix_cache,
        "/abort_requests": _abort_requests,
        "/weight_checker": _weight_checker,
    }.items():
        app.router.add_post(path, _admin_route(call))
    app.router.add_get("/conditions", _admin_route(_conditions))
