"""The front's view of its engines: one record per engine, its state machine, the registry."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging

import aiohttp
import attrs

from .devices import EngineDevices
from .errors import ApiError
from .routing import Candidate, SessionRouter

log = logging.getLogger("skyinfer.state")


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    PAUSED = "paused"
    SLEEPING = "sleeping"
    # Up, but holding weights older than the fleet's (restarted after a failed
    # transfer): takes admin and weight calls, serves nothing until a push.
    STALE = "stale"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    DEAD = "dead"


S = EngineState
# Which state may follow which; anything else is a bug in the caller.
_TRANSITIONS: dict[EngineState, frozenset[EngineState]] = {
    S.STARTING: frozenset({S.READY, S.STALE, S.DEAD, S.STOPPING}),
    S.READY: frozenset({S.PAUSED, S.SLEEPING, S.RESTARTING, S.DEAD, S.STOPPING}),
    S.PAUSED: frozenset({S.READY, S.SLEEPING, S.RESTARTING, S.DEAD, S.STOPPING}),
    S.SLEEPING: frozenset({S.READY, S.RESTARTING, S.DEAD, S.STOPPING}),
    S.STALE: frozenset({S.READY, S.RESTARTING, S.DEAD, S.STOPPING}),
    S.RESTARTING: frozenset({S.READY, S.STALE, S.DEAD, S.STOPPING}),
    S.DEAD: frozenset({S.RESTARTING, S.STOPPING, S.STOPPED}),
    S.STOPPING: frozenset({S.STOPPED, S.DEAD}),
    S.STOPPED: frozenset(),
}

# Paused and sleeping engines still take requests: vLLM queues them until
# resume / wake-up, which is what a trainer pausing for a weight push wants.
SERVING_STATES = frozenset({S.READY, S.PAUSED, S.SLEEPING})
# States in which an engine process is up and takes admin calls.
LIVE_STATES = SERVING_STATES | {S.STALE}

# Control operations: the states each applies to, and the states in which it
# is already done (that engine is left as it is, e.g. resuming an engine that
# restarted while the others were paused). Any other state is an ordering
# mistake (409), as is a call that applies to no engine at all.
CONTROL_APPLIES_TO: dict[str, frozenset[EngineState]] = {
    "pause": frozenset({S.READY, S.PAUSED, S.STALE}),
    "resume": frozenset({S.PAUSED}),
    "sleep": frozenset({S.READY, S.PAUSED}),
    "wake_up": frozenset({S.SLEEPING}),
    "reset_prefix_cache": LIVE_STATES,
    "abort_requests": LIVE_STATES,
}
CONTROL_ALREADY_DONE: dict[str, frozenset[EngineState]] = {
    "resume": frozenset({S.READY, S.STALE}),
    "wake_up": frozenset({S.READY, S.STALE}),
}

_ORDERING_HINTS = {
    ("resume", S.READY): "it is not paused",
    ("resume", S.SLEEPING): "it is sleeping; POST /wake_up instead",
    ("pause", S.SLEEPING): "it is sleeping; POST /wake_up first",
    ("sleep", S.SLEEPING): "it is already sleeping",
    ("sleep", S.STALE): "it is stale; push weights first",
    ("wake_up", S.READY): "it is not sleeping",
    ("wake_up", S.PAUSED): "it is paused, not sleeping; POST /resume instead",
}


class OrderingError(ApiError):
    """The call makes no sense in the engines' present state."""

    status = 409


def control_targets(operation: str, records: list[EngineRecord]) -> tuple[list[EngineRecord], list[EngineRecord]]:
    """Split live engines into those ``operation`` applies to and those already done.

    Raises OrderingError when some engine's state makes the call a mistake, or
    when it would apply to none.
    """
    applies, done = CONTROL_APPLIES_TO[operation], CONTROL_ALREADY_DONE.get(operation, frozenset())
    refused = [r for r in records if r.state not in applies | done]
    targets = [r for r in records if r.state in applies]
    if refused or not targets:
        reasons = refused or records
        raise OrderingError(
            f"cannot {operation}: "
            + "; ".join(
                f"engine {r.engine_id}: {_ORDERING_HINTS.get((operation, r.state), f'it is {r.state.value}')}"
                for r in reasons
            )
        )
    return targets, [r for r in records if r.state in done]


class NoEngineAvailable(RuntimeError):
    pass


class EngineBusy(RuntimeError):
    """The engine's queue of waiting requests is full; the caller may retry later."""


@attrs.define(eq=False)
class EngineRecord:
    engine_id: int
    devices: EngineDevices
    socket_path: str
    # Requests sent to the engine at once (one connection each); more wait in the front.
    connection_limit: int = 4096
    # Requests that may wait for a connection before new ones are refused; 0: no cap.
    queue_limit: int = 0
    state: EngineState = EngineState.STARTING
    pid: int | None = None
    # Requests the front holds for this engine: sent to it, or waiting to be.
    in_flight_count: int = 0
    # Of those, the ones waiting for a connection.
    queued: int = 0
    # Requests refused because the queue was full.
    refused: int = 0
    # HTTP client over this engine's Unix socket; set once it is ready.
    client: aiohttp.ClientSession | None = None
    # The weights it serves, as the engine reports them ("default": as loaded).
    weight_version: str | None = None
    # The dtype it serves weights in; pushed tensors must match.
    model_dtype: str | None = None
    # Whether its workers are in the current trainer's weight-transfer group
    # (a new process never is).
    in_transfer_group: bool = False
    # Process replacements since the service started (crashes, failed transfers).
    restarts: int = 0
    _connections: asyncio.Semaphore = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._connections = asyncio.Semaphore(self.connection_limit)

    @contextlib.asynccontextmanager
    async def in_flight(self):
        """Hold one of the engine's connections for a request, waiting in arrival order for one."""
        if self.queue_limit and self._connections.locked() and self.queued >= self.queue_limit:
            self.refused += 1
            raise EngineBusy(f"engine {self.engine_id} has {self.queued} requests waiting; retry later")
        self.in_flight_count += 1
        self.queued += 1
        try:
            try:
                await self._connections.acquire()
            finally:
                self.queued -= 1
            try:
                yield
            finally:
                self._connections.release()
        finally:
            self.in_flight_count -= 1

    def describe(self) -> dict:
        return {
            "id": self.engine_id,
            "state": self.state.value,
            "paused": self.state in (S.PAUSED, S.SLEEPING),
            "sleeping": self.state is S.SLEEPING,
            "pid": self.pid,
            "devices": self.devices.describe(),
            "in_flight": self.in_flight_count,
            "queued": self.queued,
            "weight_version": self.weight_version,
            "model_dtype": self.model_dtype,
            "restarts": self.restarts,
        }


class EngineRegistry:
    def __init__(self, records: list[EngineRecord], max_sessions: int):
        self.records = records
        self.router = SessionRouter(max_sessions)
        # The version of the last completed push; None while engines serve what they loaded.
        self.fleet_weight_version: str | None = None
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
        chosen = self.router.choose([Candidate(r.engine_id, r.in_flight_count) for r in live], session_id)
        return self.records[chosen]
