"""The front's view of its engines: one record per engine, its state machine, the registry."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable, Collection

import aiohttp
import attrs

from .devices import EngineDevices
from .errors import ApiError
from .routing import Candidate, SessionRouter

log = logging.getLogger("skyinfer.state")


class Lifecycle(enum.Enum):
    """Where an engine's process is; conditions (paused, asleep, stale) apply only while it is up."""

    STARTING = "starting"
    UP = "up"
    RESTARTING = "restarting"
    DEAD = "dead"
    STOPPING = "stopping"
    STOPPED = "stopped"


L = Lifecycle
# Which step may follow which; anything else is a bug in the caller.
_LIFECYCLE_STEPS: dict[Lifecycle, frozenset[Lifecycle]] = {
    L.STARTING: frozenset({L.UP, L.DEAD, L.STOPPING}),
    L.UP: frozenset({L.RESTARTING, L.DEAD, L.STOPPING}),
    L.RESTARTING: frozenset({L.UP, L.DEAD, L.STOPPING}),
    L.DEAD: frozenset({L.RESTARTING, L.STOPPING, L.STOPPED}),
    L.STOPPING: frozenset({L.STOPPED, L.DEAD}),
    L.STOPPED: frozenset(),
}


class EngineState(enum.Enum):
    """One word for an engine, as ``/engines``, ``/metrics`` and the CLI show it: its lifecycle
    step, or while it is up, its most telling condition."""

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


# An admin operation's verdict for one engine: it applies, it is already done
# (the engine is left as it is, e.g. resuming an engine that restarted while
# the others were paused), or a reason it is an ordering mistake (409).
APPLY, DONE = "apply", "done"


def _pause(r: EngineRecord) -> str:
    return "it is sleeping; POST /wake_up first" if r.sleeping else APPLY


def _resume(r: EngineRecord) -> str:
    if r.sleeping:
        return "it is sleeping; POST /wake_up instead"
    return APPLY if r.paused else DONE


def _sleep(r: EngineRecord) -> str:
    if r.sleeping:
        return "it is already sleeping"
    return "it is stale; push weights first" if r.stale else APPLY


def _wake_up(r: EngineRecord) -> str:
    if r.sleeping:
        return APPLY
    return "it is paused, not sleeping; POST /resume instead" if r.paused else DONE


# Every control operation over every combination of conditions, in one place.
CONTROL_VERDICTS: dict[str, Callable[[EngineRecord], str]] = {
    "pause": _pause,
    "resume": _resume,
    "sleep": _sleep,
    "wake_up": _wake_up,
    "reset_prefix_cache": lambda r: APPLY,
    "abort_requests": lambda r: APPLY,
    "reset_mm_cache": lambda r: APPLY,
    "reset_encoder_cache": lambda r: APPLY,
    "collective_rpc": lambda r: APPLY,
}
_NOTHING_TO_DO = {"resume": "it is not paused", "wake_up": "it is not sleeping"}


class OrderingError(ApiError):
    """The call makes no sense in the engines' present state."""

    status = 409


def control_targets(operation: str, records: list[EngineRecord]) -> tuple[list[EngineRecord], list[EngineRecord]]:
    """Split up engines into those ``operation`` applies to and those where it is already done.

    Raises OrderingError, naming each engine and why, when the call is a
    mistake for some engine, or would apply to none.
    """
    verdicts = [(r, CONTROL_VERDICTS[operation](r)) for r in records]
    refused = [(r, v) for r, v in verdicts if v not in (APPLY, DONE)]
    targets = [r for r, v in verdicts if v == APPLY]
    if refused or not targets:
        reasons = refused or [(r, _NOTHING_TO_DO.get(operation, f"it is {r.state.value}")) for r in records]
        raise OrderingError(f"cannot {operation}: " + "; ".join(f"engine {r.engine_id}: {why}" for r, why in reasons))
    return targets, [r for r, v in verdicts if v == DONE]


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
    lifecycle: Lifecycle = Lifecycle.STARTING
    # Conditions of an engine that is up, as vLLM holds them (a new process has none).
    paused: bool = False
    sleeping: bool = False
    stale: bool = False
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
    # The largest LoRA rank it takes; None: started without --enable-lora.
    max_lora_rank: int | None = None
    # The LoRA adapters it holds: name -> version (a new process holds none).
    adapters: dict[str, str] = attrs.field(factory=dict)
    # Whether its workers are in the current trainer's weight-transfer group
    # (a new process never is).
    in_transfer_group: bool = False
    # Process replacements since the service started (crashes, failed transfers).
    restarts: int = 0
    _connections: asyncio.Semaphore = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._connections = asyncio.Semaphore(self.connection_limit)

    @property
    def up(self) -> bool:
        """Its process is up and takes admin and weight calls."""
        return self.lifecycle is Lifecycle.UP

    @property
    def serves(self) -> bool:
        """Requests may be routed to it. Paused and sleeping engines still take requests: vLLM
        queues them until resume / wake-up, which is what a trainer pausing for a push wants."""
        return self.up and not self.stale

    @property
    def state(self) -> EngineState:
        if not self.up:
            return EngineState(self.lifecycle.value)
        if self.stale:
            return EngineState.STALE
        if self.sleeping:
            return EngineState.SLEEPING
        return EngineState.PAUSED if self.paused else EngineState.READY

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
            "paused": self.paused,
            "sleeping": self.sleeping,
            "stale": self.stale,
            "pid": self.pid,
            "devices": self.devices.describe(),
            "in_flight": self.in_flight_count,
            "queued": self.queued,
            "weight_version": self.weight_version,
            "model_dtype": self.model_dtype,
            "adapters": dict(self.adapters),
            "restarts": self.restarts,
        }


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
    def __init__(self, records: list[EngineRecord], router: SessionRouter | None = None):
        self.records = records
        self.router = router or SessionRouter()
        # The version of the last completed push; None while engines serve what they loaded.
        self.fleet_weight_version: str | None = None
        # The LoRA adapters the fleet serves. A request for one goes only to an engine
        # that holds it at the fleet's version.
        self.fleet_adapters: dict[str, Adapter] = {}
        # Adapters being loaded across the fleet: their requests wait until every engine has it.
        self._adapters_changing: dict[str, asyncio.Event] = {}
        # Held across multi-step, awaiting changes to an engine (start, stop,
        # restart). Routing itself never awaits, so it needs no lock.
        self.lock = asyncio.Lock()

    def set_lifecycle(self, record: EngineRecord, new: Lifecycle) -> None:
        old = record.lifecycle
        if old is new:
            return
        if new not in _LIFECYCLE_STEPS[old]:
            raise RuntimeError(f"engine {record.engine_id}: illegal step {old.value} -> {new.value}")
        record.lifecycle = new
        if new is not Lifecycle.UP:
            # Whatever the old process was, the next one starts fresh.
            record.paused = record.sleeping = record.stale = False
            record.adapters = {}
        log.info("engine %d: %s -> %s", record.engine_id, old.value, new.value)

    def set_conditions(self, record: EngineRecord, **conditions: bool) -> None:
        """Record what an up engine now is (paused, sleeping, stale)."""
        assert record.up and set(conditions) <= {"paused", "sleeping", "stale"}, (record.lifecycle, conditions)
        changed = {k: v for k, v in conditions.items() if getattr(record, k) != v}
        for name, value in changed.items():
            setattr(record, name, value)
        if changed:
            log.info("engine %d: %s (%s)", record.engine_id, record.state.value,
                     ", ".join(f"{k}={v}" for k, v in changed.items()))  # fmt: skip

    def holds_adapter(self, record: EngineRecord, adapter: str | None) -> bool:
        if adapter is None:
            return True
        served = self.fleet_adapters.get(adapter)
        return served is not None and record.adapters.get(adapter) == served.version

    def up(self) -> list[EngineRecord]:
        return [r for r in self.records if r.up]

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
        return bool(self.fleet_adapters or self._adapters_changing)

    async def adapter_for(self, model: object) -> str | None:
        """The fleet adapter a request's ``model`` names, once it has settled; None if none."""
        if not isinstance(model, str):
            return None
        while (changing := self._adapters_changing.get(model)) is not None:
            await changing.wait()
        return model if model in self.fleet_adapters else None

    def pick(
        self,
        session_id: str | None = None,
        exclude: Collection[int] = (),
        group_key: int | None = None,
        adapter: str | None = None,
    ) -> EngineRecord:
        live = [r for r in self.serving() if r.engine_id not in exclude and self.holds_adapter(r, adapter)]
        if not live:
            states = ", ".join(f"engine {r.engine_id} {r.state.value}" for r in self.records)
            served = self.fleet_adapters.get(adapter) if adapter else None
            serving = f" adapter {adapter!r} at version {served.version}" if served else ""
            raise NoEngineAvailable(f"no engine can serve{serving} right now ({states})")
        chosen = self.router.choose([Candidate(r.engine_id, r.in_flight_count) for r in live], session_id, group_key)
        return self.records[chosen]
