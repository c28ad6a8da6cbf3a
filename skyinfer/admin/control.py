"""Control plane: fan each admin call out to every engine at once and aggregate.

The answer is 200 only when every engine did what was asked. Otherwise it
is the OpenAI error shape with a non-2xx status (the engines' common status,
or 502 when they differ) plus each engine's own result, so a partial failure
is never hidden. Ordering mistakes are refused with 409 before any engine is
called.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiohttp import web

from ..errors import admin_json_body, error_body, json_response
from ..fleet.engine_calls import EngineReply, call_engine, failure
from ..fleet.registry import REGISTRY, EngineRegistry
from ..fleet.state import DISCARDED_BY_SLEEP, SLEEP_TAGS, EngineRecord, Residency, control_targets
from ..wire import AbortParams, PauseParams, QueryParams, ResetPrefixCacheParams, SleepParams, WakeUpParams, takes

log = logging.getLogger("skyinfer.control")

# The calls that move an engine's scheduler and memory (and the fleet's intent).
RESIDENCY_OPERATIONS = frozenset({"pause", "resume", "sleep", "wake_up"})
# Calls that never wait behind a fleet operation: an abort must be able to cut a wait-mode pause
# (which holds the fleet's lock until the requests drain) short.
LOCK_FREE_OPERATIONS = frozenset({"abort_requests"})


class ControlPlane:
    def __init__(self, registry: EngineRegistry, timeout_s: float):
        self.registry = registry
        self.timeout_s = timeout_s

    async def apply(
        self, operation: str, query: Any = None, body: dict | None = None, **params: Any
    ) -> list[EngineReply]:
        """Run ``/operation`` on every up engine it applies to; record what each engine now is.
        ``params``: what the residency transition needs (a sleep's ``level``, a wake-up's ``tags``)."""
        # One fleet operation at a time: a pause must not interleave with a resume.
        async with contextlib.nullcontext() if operation in LOCK_FREE_OPERATIONS else self.registry.fleet_change():
            targets, already_done = control_targets(operation, self.registry.up(), **params)
            outcomes = await asyncio.gather(
                *(call_engine(r, f"/{operation}", timeout_s=self.timeout_s, query=query, body=body) for r in targets)
            )
            if operation in RESIDENCY_OPERATIONS:
                await self._record(operation, targets, outcomes, params)
        unchanged = [
            EngineReply(r.engine_id, 200, {"status": "unchanged", "state": r.state.value}) for r in already_done
        ]
        # A retired engine is out of the fleet: no call waits on it, or fails for it.
        down = [
            EngineReply(r.engine_id, 503, {"error": f"engine is {r.state.value}"})
            for r in self.registry.members()
            if not r.up
        ]
        return sorted([*outcomes, *unchanged, *down], key=lambda o: o.engine_id)

    async def _record(
        self, operation: str, targets: list[EngineRecord], outcomes: list[EngineReply], params: dict
    ) -> None:
        """What the engines answered becomes each one's residency, and the fleet's intent once any
        engine did it (engines that are down take the intent when they come up); one that failed is
        asked what it is."""
        took_it = False
        for record, outcome in zip(targets, outcomes):
            if not record.up:
                continue  # it died meanwhile; its next process starts afresh
            if outcome.ok:
                self.registry.record_call(record, operation, **params)
                took_it = True
            else:
                log.warning("engine %d: %s failed: %s", record.engine_id, operation, outcome.message)
                await self.reread(record, operation, **params)
        if took_it:
            self.registry.intent = self.registry.intent.after(operation, **params)

    async def bring_to_intent(self, record: EngineRecord) -> None:
        """Bring an engine process to what the fleet was asked to be (paused, or asleep at its
        level with the same tags awake) before it counts as up: from a new process's fresh start,
        or (brought once already, the fleet moved meanwhile) from where it is, by way of awake."""
        intent = self.registry.intent
        if record.residency == intent:
            return
        steps: list[tuple[str, QueryParams, dict]] = []
        if record.residency.sleeping:
            steps.append(("wake_up", WakeUpParams(), {}))
        if record.residency.paused or record.residency.sleeping:
            steps.append(("resume", QueryParams(), {}))
        if intent.sleeping:
            assert intent.sleep_level is not None
            steps.append(("sleep", SleepParams(level=intent.sleep_level), {"level": intent.sleep_level}))
            awake = sorted(SLEEP_TAGS - intent.asleep)
            if intent.asleep and awake:  # a partial wake-up: those tags are back
                steps.append(("wake_up", WakeUpParams(tags=tuple(awake)), {"tags": awake}))
        elif intent.paused:
            steps.append(("pause", PauseParams(mode="keep"), {}))
        for operation, query, params in steps:
            if operation == "resume" and not record.residency.paused:
                continue  # the full wake-up resumed it
            reply = await call_engine(record, f"/{operation}", timeout_s=self.timeout_s, query=query.to_query())
            if not reply.ok:
                raise RuntimeError(f"bringing it to the fleet's state failed at {operation}: {reply.message}")
            self.registry.record_call(record, operation, **params)
        log.info("engine %d: brought to the fleet's state (%s)", record.engine_id, record.residency.describe())

    async def reread(self, record: EngineRecord, operation: str, **params: Any) -> None:
        """After a failed or timed-out call the engine may have done it anyway, or part of it: ask
        vLLM what it is. A sleep that failed counts as done where vLLM then says the engine sleeps
        (its memory may be released): pushes and resumes wait for a wake-up, and a level-2 one
        leaves the weights unknown (stale). An engine that does not answer keeps what it was."""
        reply = await call_engine(record, "/conditions", method="GET", timeout_s=self.timeout_s)
        if reply.ok and record.up:
            attempted = record.residency.after(operation, **params)
            residency = Residency.reread(record.residency, attempted, reply.body["paused"], reply.body["sleeping"])
            self.registry.set_residency(record, residency)
            if operation == "sleep" and params.get("level") == 2 and residency.sleeping:
                self.registry.set_stale(record, DISCARDED_BY_SLEEP)
        elif not reply.ok:
            log.warning("engine %d: its conditions are unknown: %s", record.engine_id, reply.message)


def aggregate(operation: str, outcomes: list[EngineReply], ok_body: dict) -> web.Response:
    engines = [o.as_json() for o in outcomes]
    failed = failure(operation, outcomes)
    if failed is None:
        return json_response({**ok_body, "engines": engines})
    status, message = failed
    return json_response({**error_body(status, message), "engines": engines}, status=status)


CONTROL = web.AppKey("control", ControlPlane)


async def _params(request: web.Request, params: type[QueryParams]):
    return params.from_request(request.query, await admin_json_body(request))


@takes(PauseParams)
async def _pause(request: web.Request) -> web.Response:
    """Pause every engine: ``abort`` ends the requests in flight, ``wait`` lets them finish,
    ``keep`` freezes them until ``/resume``. Requests sent meanwhile wait.

    If its caller leaves: the pause still lands (a wait-mode one once the requests drain) and the
    fleet is paused; a ``/resume`` sent meanwhile waits for it, then undoes it."""
    p = await _params(request, PauseParams)
    outcomes = await request.app[CONTROL].apply("pause", p.to_query(), mode=p.mode)
    return aggregate("pause", outcomes, {"status": "paused", "mode": p.mode})


async def _resume(request: web.Request) -> web.Response:
    """Resume every paused engine.

    If its caller leaves: the engines still resume; ``GET /engines`` shows them ready."""
    outcomes = await request.app[CONTROL].apply("resume")
    return aggregate("resume", outcomes, {"status": "resumed"})


@takes(SleepParams)
async def _sleep(request: web.Request) -> web.Response:
    """Put every engine to sleep: level 1 offloads the weights and drops the KV cache, level 2
    drops both (a push must follow), level 0 only pauses.

    If its caller leaves: the sleep still lands and the fleet is asleep; ``/wake_up`` wakes it. An
    engine whose sleep failed, and that vLLM then says sleeps, counts as asleep (its memory may be
    released) until a wake-up."""
    p = await _params(request, SleepParams)
    outcomes = await request.app[CONTROL].apply("sleep", p.to_query(), level=p.level)
    return aggregate("sleep", outcomes, {"status": "sleeping", "level": p.level})


@takes(WakeUpParams)
async def _wake_up(request: web.Request) -> web.Response:
    """Wake every engine, or only the memory ``tags`` name (``weights``, ``kv_cache``); fully
    awake engines run again.

    If its caller leaves: the engines still wake; ``GET /engines`` shows what is still asleep."""
    p = await _params(request, WakeUpParams)
    control = request.app[CONTROL]
    outcomes = await control.apply("wake_up", p.to_query(), tags=p.tags)
    # A partial wake-up (some tags) leaves engines asleep; a full one resumes them (vLLM).
    awake = not any(r.residency.sleeping for r in control.registry.records)
    return aggregate("wake_up", outcomes, {"status": "awake" if awake else "sleeping", "tags": list(p.tags or [])})


@takes(ResetPrefixCacheParams)
async def _reset_prefix_cache(request: web.Request) -> web.Response:
    """Drop every engine's prefix cache.

    If its caller leaves: every engine still drops it."""
    p = await _params(request, ResetPrefixCacheParams)
    outcomes = await request.app[CONTROL].apply("reset_prefix_cache", p.to_query())
    return aggregate("reset_prefix_cache", outcomes, {"status": "reset"})


@takes(AbortParams)
async def _abort_requests(request: web.Request) -> web.Response:
    """Abort the requests ``request_ids`` name (response ids), or every request in flight; never
    waits behind another fleet operation.

    If its caller leaves: the requests are still aborted."""
    p = AbortParams.parse(await admin_json_body(request) or {})
    outcomes = await request.app[CONTROL].apply("abort_requests", body=p.to_body())
    aborted = sum(o.body.get("aborted", 0) for o in outcomes if o.ok)
    return aggregate("abort_requests", outcomes, {"status": "aborted", "aborted": aborted})


def _flag_view(name: str, condition: str):
    async def view(request: web.Request) -> web.Response:
        """Whether any engine is (and each engine's own answer), as vLLM's route says it."""
        records = request.app[REGISTRY].records
        engines = [{"engine": r.engine_id, name: getattr(r, condition), "state": r.state.value} for r in records]
        return json_response({name: any(e[name] for e in engines), "engines": engines})

    return view


def add_control_routes(app: web.Application) -> None:
    app.router.add_post("/pause", _pause)
    app.router.add_post("/resume", _resume)
    app.router.add_post("/sleep", _sleep)
    app.router.add_post("/wake_up", _wake_up)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    app.router.add_post("/abort_requests", _abort_requests)
    # vLLM serves its token route's abort under this name too, with the same handler.
    app.router.add_post("/inference/v1/abort_requests", _abort_requests)
    # A sleeping engine is paused too (vLLM pauses its scheduler before sleeping).
    app.router.add_get("/is_paused", _flag_view("is_paused", "paused"))
    app.router.add_get("/is_sleeping", _flag_view("is_sleeping", "vllm_is_sleeping"))
