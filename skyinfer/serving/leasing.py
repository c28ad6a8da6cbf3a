"""Which engine answers a request, and the hold on one of its connections while it does.

A *lease* is both: the routing decision (session, prompt group, adapter, stored response, least
loaded; held while no engine serves) and one of the engine's connection slots, kept until the
answer is over. In one front process the lease comes from the registry in-process
(``LocalLeases``); a front worker (``front_workers``) asks the control process for it, which
runs the same ``lease_engine`` there. Routing state therefore stays in one process however many
relay.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Collection
from typing import Protocol

import attrs

from ..errors import ApiError
from ..fleet.registry import EngineRegistry


@attrs.frozen
class Ask:
    """What a request's engine is picked by."""

    session_id: str | None = None
    # A stable hash of the prompt's start (the same in every process); None: no group affinity.
    group: int | None = None
    # The request's ``model``: an adapter's name picks only engines holding the fleet's version.
    model: str | None = None
    # Responses' previous_response_id: only the engine storing it can continue it.
    previous_response: str | None = None


class NotConnected(Exception):
    """No connection to the engine could be opened; nothing of the request was sent."""

    def __init__(self, message: str, engine: Engine):
        super().__init__(message)
        self.engine = engine


class Engine(Protocol):
    """What the relay needs of a leased engine (an ``EngineRecord``, or a worker's mirror of one)."""

    engine_id: int
    socket_path: str
    weight_version: str | None
    adapters: dict[str, str]

    @property
    def client(self): ...


@attrs.frozen
class Grant:
    engine: Engine
    # The adapter the request asks for (its version goes on the answer); None: the base model.
    adapter: str | None


class Leases(Protocol):
    hold_requests_s: float

    def lease(self, ask: Ask, exclude: Collection[int]) -> contextlib.AbstractAsyncContextManager[Grant]:
        """The engine for ``ask`` with one of its connections held; raises NoEngineAvailable,
        EngineBusy, NotConnected or ApiError."""

    def has_other_member(self, engine_id: int) -> bool: ...

    def note_retried(self, engine_id: int) -> None: ...

    def note_second_death(self, engine_id: int) -> None: ...

    def remember_response(self, response_id: str, engine_id: int) -> None: ...


def _pinned_engine(registry: EngineRegistry, previous: str, session_id: str | None) -> int | None:
    """The engine that stores the response a Responses request continues, if this front saw it."""
    engine = registry.stored_responses.engine_of(previous)
    bound = registry.router.engine_of(session_id) if session_id and engine is not None else None
    if bound is not None and bound != engine:
        raise ApiError(
            f"session {session_id!r} is on engine {bound}, but previous_response_id {previous!r} is stored on"
            f" engine {engine}, the only one that can continue it: drop the session id or start a new chain",
            status=409,
            param="previous_response_id",
        )
    return engine


async def adapter_for(registry: EngineRegistry, ask: Ask) -> str | None:
    return await registry.adapter_for(ask.model) if ask.model is not None and registry.has_adapters else None


@contextlib.asynccontextmanager
async def lease_engine(registry: EngineRegistry, ask: Ask, exclude: Collection[int]) -> AsyncIterator[Grant]:
    """Pick the engine (waiting up to the hold while none serves) and hold one of its connections."""
    adapter = await adapter_for(registry, ask)
    pinned = _pinned_engine(registry, ask.previous_response, ask.session_id) if ask.previous_response else None
    # Picked afresh each time: a session stays on its engine while that one serves; a request
    # without a session may go to another.
    engine = await registry.pick_held(
        session_id=ask.session_id, exclude=exclude, group_key=ask.group, adapter=adapter, pinned=pinned
    )
    async with engine.in_flight():
        # The engine may have gone down while the request waited for a connection.
        if engine.client is None or engine.client.closed or not engine.serves:
            raise NotConnected(f"it is {engine.state.value}", engine)
        yield Grant(engine, adapter)


class LocalLeases:
    """Leases from the registry in this process (one front process)."""

    def __init__(self, registry: EngineRegistry):
        self.registry = registry
        self.hold_requests_s = registry.hold_requests_s

    def lease(self, ask: Ask, exclude: Collection[int]) -> contextlib.AbstractAsyncContextManager[Grant]:
        return lease_engine(self.registry, ask, exclude)

    def has_other_member(self, engine_id: int) -> bool:
        return any(r.engine_id != engine_id for r in self.registry.members())

    def note_retried(self, engine_id: int) -> None:
        self.registry.records[engine_id].retried_elsewhere += 1

    def note_second_death(self, engine_id: int) -> None:
        self.registry.records[engine_id].ended_at_second_death += 1

    def remember_response(self, response_id: str, engine_id: int) -> None:
        self.registry.stored_responses.record(response_id, engine_id)
