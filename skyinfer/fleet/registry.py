"""The registry: every engine's record, the fleet's intent and weight version, the adapters the
fleet serves, and the lock that orders changes to the fleet."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Collection

import attrs
from aiohttp import web

from ..errors import ApiError
from .routing import Candidate, SessionRouter, StoredResponses
from .state import (
    DISCARDED_BY_SLEEP,
    HAS_CONDITIONS,
    LIFECYCLE_STEPS,
    EngineRecord,
    Lifecycle,
    NoEngineAvailable,
    Residency,
)

log = logging.getLogger("skyinfer.state")


@attrs.frozen
class Adapter:
    """A LoRA adapter as the fleet serves it: its version, and where engines load that version from."""

    version: str
    # Per engine (a pushed adapter: each engine's own copy).
    paths: dict[int, str]
    # Its directory in the adapter store: removed once a newer version replaces it.
    directory: str
    revision: int

    def path_for(self, engine_id: int) -> str:
        # An engine that restarted loads any engine's copy: they are the same bytes.
        return self.paths.get(engine_id) or next(iter(self.paths.values()))


class EngineRegistry:
    def __init__(self, records: list[EngineRecord], router: SessionRouter | None = None, hold_requests_s: float = 0.0):
        self.records = records
        self.router = router or SessionRouter()
        # How long a request that finds no engine serving waits for one.
        self.hold_requests_s = hold_requests_s
        # Set (and replaced) whenever an engine may have begun to serve: held requests look again.
        self._may_serve = asyncio.Event()
        self.stored_responses = StoredResponses()
        # The version of the last completed push; None while engines serve what they loaded.
        self.fleet_weight_version: str | None = None
        # What the last control calls asked of every engine: a new engine process is brought to it.
        self.intent = Residency()
        # The LoRA adapters the fleet serves. A request for one goes only to an engine
        # that holds it at the fleet's version.
        self.fleet_adapters: dict[str, Adapter] = {}
        # Adapters being unloaded, and those an engine failed to unload (until loaded again): their
        # requests are answered 404 here, as vLLM would, since such an engine may still hold one.
        self.unloaded_adapters: set[str] = set()
        # Adapters being loaded across the fleet: their requests wait until the load ends (on every
        # engine, or rolled back).
        self._adapters_changing: dict[str, asyncio.Event] = {}
        # Held by every fleet operation (control calls, weight transfer, adapters) while it runs:
        # one at a time across the fleet. A routing decision (``pick``) never awaits, so it needs no
        # lock, and an engine being brought up takes it only to check that nothing moved meanwhile
        # (``changes``).
        self.lock = asyncio.Lock()
        # Fleet operations completed: an engine brought to the fleet's state while it changed is
        # brought again.
        self.changes = 0

    @contextlib.asynccontextmanager
    async def fleet_change(self):
        """One fleet operation: the fleet's lock held, counted in ``changes`` once over."""
        async with self.lock:
            try:
                yield
            finally:
                self.changes += 1

    def set_lifecycle(self, record: EngineRecord, new: Lifecycle) -> None:
        old = record.lifecycle
        if old is new:
            return
        if new not in LIFECYCLE_STEPS[old]:
            raise RuntimeError(f"engine {record.engine_id}: illegal step {old.value} -> {new.value}")
        record.lifecycle = new
        if new is Lifecycle.UP:
            self._look_again()
        else:
            # Whatever the old process was, the next one starts fresh.
            record.residency, record.stale, record.mid_update = Residency(), None, False
            record.delta_base = None
            record.staging = None  # a staging copy lives and dies with its process
            record.adapters = {}
            record.in_transfer_group = record.transfer_engine_open = False
        log.info("engine %d: %s -> %s", record.engine_id, old.value, new.value)

    def set_residency(self, record: EngineRecord, residency: Residency) -> None:
        """Record where an engine's scheduler and memory now are (up, or being brought up)."""
        assert record.lifecycle in HAS_CONDITIONS, record.lifecycle
        if residency != record.residency:
            record.residency = residency
            log.info("engine %d: %s (%s)", record.engine_id, record.state.value, residency.describe())

    def record_call(self, record: EngineRecord, operation: str, **params) -> None:
        """What a successful pause, resume, sleep or wake-up did to an engine."""
        self.set_residency(record, record.residency.after(operation, **params))
        if operation == "sleep" and params.get("level") == 2:
            self.set_stale(record, DISCARDED_BY_SLEEP)

    def set_stale(self, record: EngineRecord, reason: str | None) -> None:
        """Hold an engine out of routing because its weights are not the fleet's (``reason``),
        or (None) let it serve again."""
        assert record.lifecycle in HAS_CONDITIONS, record.lifecycle
        if reason != record.stale:
            record.stale = reason
            if reason is None:
                self._look_again()
            log.info("engine %d: %s%s", record.engine_id, record.state.value, f" ({reason})" if reason else "")

    def holds_adapter(self, record: EngineRecord, adapter: str | None) -> bool:
        if adapter is None:
            return True
        served = self.fleet_adapters.get(adapter)
        return served is not None and record.adapters.get(adapter) == served.version

    def up(self) -> list[EngineRecord]:
        return [r for r in self.records if r.up]

    def members(self) -> list[EngineRecord]:
        """The fleet: every engine but the retired ones, which take no part in admin calls,
        weight transfers or readiness."""
        return [r for r in self.records if not r.retired]

    def serving(self) -> list[EngineRecord]:
        return [r for r in self.records if r.serves]

    @contextlib.contextmanager
    def changing_adapter(self, name: str):
        """While an adapter changes on the engines, its new requests wait (``adapter_for``)."""
        changed = self._adapters_changing[name] = asyncio.Event()
        try:
            yield
        finally:
            del self._adapters_changing[name]
            changed.set()

    @property
    def has_adapters(self) -> bool:
        return bool(self.fleet_adapters or self._adapters_changing or self.unloaded_adapters)

    async def adapter_for(self, model: object) -> str | None:
        """The fleet adapter a request's ``model`` names, once it has settled; None if none."""
        if not isinstance(model, str):
            return None
        while (changing := self._adapters_changing.get(model)) is not None:
            await changing.wait()
        if model in self.unloaded_adapters:
            raise ApiError(f"The model `{model}` does not exist.", status=404, param="model")
        return model if model in self.fleet_adapters else None

    def _look_again(self) -> None:
        self._may_serve.set()
        self._may_serve = asyncio.Event()

    async def pick_held(self, **how) -> EngineRecord:
        """``pick``; while no engine can serve the request (all restarting, or stale until the next
        push), wait up to ``hold_requests_s`` for one that can."""
        deadline = time.monotonic() + self.hold_requests_s
        while True:
            may_serve = self._may_serve  # before the pick: a change after it sets this one
            try:
                return self.pick(**how)
            except NoEngineAvailable:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(may_serve.wait(), remaining)

    def pick(
        self,
        session_id: str | None = None,
        exclude: Collection[int] = (),
        group_key: int | None = None,
        adapter: str | None = None,
        pinned: int | None = None,
    ) -> EngineRecord:
        """The engine for a request; ``pinned``: the only engine that can answer it (the one
        storing the response it continues)."""
        live = [r for r in self.serving() if r.engine_id not in exclude and self.holds_adapter(r, adapter)]
        if pinned is not None:
            live = [r for r in live if r.engine_id == pinned]
            if not live:
                raise NoEngineAvailable(
                    f"engine {pinned}, which stores the previous response, is {self.records[pinned].state.value}"
                )
            return live[0]
        if not live:
            states = ", ".join(
                f"engine {r.engine_id} {r.state.value}" + (f": {r.stale}" if r.stale else "") for r in self.records
            )
            served = self.fleet_adapters.get(adapter) if adapter else None
            serving = f" adapter {adapter!r} at version {served.version}" if served else ""
            raise NoEngineAvailable(f"no engine can serve{serving} right now ({states})")
        chosen = self.router.choose([Candidate(r.engine_id, r.in_flight_count) for r in live], session_id, group_key)
        return self.records[chosen]


# The app's registry: every route that reads or changes the engines finds it here.
REGISTRY = web.AppKey("registry", EngineRegistry)
