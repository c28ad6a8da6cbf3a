"""The front's view of its engines: one record per engine, its state machine, the registry."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging

import aiohttp
import attrs

from .devices import EngineDevices
from .routing import Candidate, SessionRouter

log = logging.getLogger("skyinfer.state")


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    STOPPED = "stopped"
    DEAD = "dead"


# Which state may follow which; anything else is a bug in the caller.
_TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    EngineState.STARTING: frozenset({EngineState.READY, EngineState.DEAD, EngineState.STOPPING}),
    EngineState.READY: frozenset({EngineState.DEAD, EngineState.STOPPING}),
    EngineState.DEAD: frozenset({EngineState.STOPPING, EngineState.STOPPED}),
    EngineState.STOPPING: frozenset({EngineState.STOPPED, EngineState.DEAD}),
    EngineState.STOPPED: frozenset(),
}

SERVING_STATES = frozenset({EngineState.READY})


class NoEngineAvailable(RuntimeError):
    pass


@attrs.define(eq=False)
class EngineRecord:
    engine_id: int
    devices: EngineDevices
    socket_path: str
    state: EngineState = EngineState.STARTING
    pid: int | None = None
    # Requests the front has in flight on this engine.
    load: int = 0
    # HTTP client over this engine's Unix socket; set once it is ready.
    client: aiohttp.ClientSession | None = None

    @contextlib.contextmanager
    def in_flight(self):
        self.load += 1
        try:
            yield
        finally:
            self.load -= 1

    def describe(self) -> dict:
        return {
            "id": self.engine_id,
            "state": self.state.value,
            "pid": self.pid,
            "devices": self.devices.describe(),
            "load": self.load,
        }


class EngineRegistry:
    def __init__(self, records: list[EngineRecord], max_sessions: int):
        self.records = records
        self.router = SessionRouter(max_sessions)
        # Held across multi-step, awaiting changes to an engine (start, stop,
        # restart). Routing itself never awaits, so it needs no lock.
        self.lock = asyncio.Lock()

    def set_state(self, record: EngineRecord, new: EngineState) -> None:
        old = record.state
        if old is new:
            return
        if new not in _TRANSITIONS[old]:
            raise RuntimeError(f"engine {record.engine_id}: illegal transition {old.value} -> {new.value}")
        record.state = new
        log.info("engine %d: %s -> %s", record.engine_id, old.value, new.value)

    def serving(self) -> list[EngineRecord]:
        return [r for r in self.records if r.state in SERVING_STATES]

    def pick(self, session_id: str | None = None) -> EngineRecord:
        live = self.serving()
        if not live:
            states = ", ".join(f"engine {r.engine_id} {r.state.value}" for r in self.records)
            raise NoEngineAvailable(f"no engine can serve right now ({states})")
        chosen = self.router.choose([Candidate(r.engine_id, r.load) for r in live], session_id)
        return self.records[chosen]
