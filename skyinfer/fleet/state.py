"""The front's view of one engine: its record and its state model (the registry of them all is
``registry.py``).

The state model, defined once:

- ``Lifecycle``: where an engine's process is.
- ``Residency``: where an up engine's scheduler and memory are, as vLLM holds them: paused, or
  asleep at a level with some of its memory still released (a partial wake-up). The fleet's
  intent is a ``Residency`` too: what the last pause, resume, sleep and wake-up asked of every
  engine. A new engine process is brought to it before it counts as up.
- ``stale``: why an up engine's weights are not the fleet's (``None``: they are). A stale engine
  takes admin and weight calls and serves nothing until a push.
- ``mid_update`` (state ``receiving``): the engine is inside a weight update (vLLM's layerwise
  reload, or a staged swap), its layers part new: nothing may resume its scheduler until it ends.
- A weight update's phases: ``skyinfer/weights/phases.py``.
- Which call fits which state: ``CONTROL_VERDICTS`` and ``push_verdict``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable, Sequence

import aiohttp
import attrs

from ..devices import EngineDevices
from ..errors import ApiError
from ..ranks import EngineSize

log = logging.getLogger("skyinfer.state")


class Lifecycle(enum.Enum):
    """Where an engine's process is; its residency, staleness and update apply while it is up, and
    while a new process is brought to the fleet before it counts as up (``HAS_CONDITIONS``)."""

    STARTING = "starting"
    UP = "up"
    RESTARTING = "restarting"
    DEAD = "dead"
    STOPPING = "stopping"
    STOPPED = "stopped"
    # It could not come back (``--max-restarts`` failed restarts in a row), or it failed
    # ``--max-push-failures`` pushes in a row by itself: out of the fleet (no admin call, push or
    # readiness waits for it) until an operator restarts it.
    RETIRED = "retired"


L = Lifecycle
# Which step may follow which; anything else is a bug in the caller.
LIFECYCLE_STEPS: dict[Lifecycle, frozenset[Lifecycle]] = {
    L.STARTING: frozenset({L.UP, L.DEAD, L.STOPPING}),
    L.UP: frozenset({L.RESTARTING, L.DEAD, L.STOPPING}),
    L.RESTARTING: frozenset({L.UP, L.DEAD, L.STOPPING}),
    L.DEAD: frozenset({L.RESTARTING, L.STOPPING, L.STOPPED, L.RETIRED}),
    L.STOPPING: frozenset({L.STOPPED, L.DEAD}),
    L.STOPPED: frozenset(),
    L.RETIRED: frozenset({L.RESTARTING, L.STOPPING}),
}

# An engine's residency and staleness are set while it is up, and while a new process is
# brought to the fleet's intent before it counts as up.
HAS_CONDITIONS = frozenset({L.UP, L.STARTING, L.RESTARTING})

# vLLM's sleep tags: what a sleep of level 1 or 2 releases, and what wake_up(tags=...) brings back.
SLEEP_TAGS = frozenset({"weights", "kv_cache"})
# Why an engine is stale after a level-2 sleep: vLLM keeps no copy of the weights it releases.
DISCARDED_BY_SLEEP = "a level-2 sleep discarded its weights: push weights before it serves"


@attrs.frozen
class Residency:
    """An engine's scheduler and memory as vLLM holds them (or the fleet's intent for them).

    Follows vLLM 0.32's ``EngineCore.sleep`` / ``wake_up`` and its executor's sleeping tags: a
    sleep pauses the scheduler and (level 1 or 2) releases weights and KV cache; a wake-up
    brings tags back, and resumes the scheduler once nothing is asleep.
    """

    paused: bool = False
    # The level of the sleep the engine is in (0: scheduling only); None: not asleep.
    sleep_level: int | None = None
    # Memory still released: a subset of SLEEP_TAGS (empty at level 0).
    asleep: frozenset[str] = frozenset()

    @property
    def sleeping(self) -> bool:
        return self.sleep_level is not None

    @property
    def vllm_is_sleeping(self) -> bool:
        """vLLM's own ``is_sleeping``: its scheduler is paused or some memory is released."""
        return self.paused or bool(self.asleep)

    @property
    def weights_awake(self) -> bool:
        return "weights" not in self.asleep

    def after(
        self, operation: str, *, level: int = 1, tags: Sequence[str] | None = None, mode: str | None = None
    ) -> Residency:
        """What a successful ``operation`` leaves (a pause's ``mode`` decides what becomes of its
        requests, not where the engine is)."""
        if operation == "pause":
            return attrs.evolve(self, paused=True)
        if operation == "resume":
            return attrs.evolve(self, paused=False)
        if operation == "sleep":
            return Residency(paused=True, sleep_level=level, asleep=SLEEP_TAGS if level >= 1 else frozenset())
        if operation == "wake_up":
            return self._woken(tags)
        return self

    def _woken(self, tags: Sequence[str] | None) -> Residency:
        # vLLM drops "scheduling" from the tags; a tag that is not asleep makes it wake nothing.
        wanted = None if tags is None else {t for t in tags if t != "scheduling"}
        asleep = self.asleep
        if wanted is None:
            asleep = frozenset()
        elif wanted and wanted <= asleep:
            asleep = asleep - wanted
        # Fully awake: vLLM resumes the scheduler.
        return Residency() if not asleep else attrs.evolve(self, asleep=asleep)

    def describe(self) -> dict:
        return {"paused": self.paused, "sleep_level": self.sleep_level, "asleep": sorted(self.asleep)}

    @classmethod
    def reread(cls, known: Residency, attempted: Residency, vllm_paused: bool, vllm_sleeping: bool) -> Residency:
        """What an engine is after a call that failed (``attempted``: what it would have left),
        from vLLM's own two flags. They cannot say which tags sleep: where they agree with what the
        front knew, that stands; a sleep that failed may have released its memory all the same, so
        the engine counts as asleep (its weights too) until a wake-up, never as merely paused."""
        if not vllm_sleeping:
            return cls()
        if attempted.sleeping and not known.sleeping:
            return attempted
        if known.vllm_is_sleeping and known.paused == vllm_paused:
            return known
        return cls(paused=vllm_paused)


class EngineState(enum.Enum):
    """One word for an engine, as ``/engines``, ``/metrics`` and the CLI show it: its lifecycle
    step, or while it is up, its most telling condition."""

    STARTING = "starting"
    READY = "ready"
    PAUSED = "paused"
    SLEEPING = "sleeping"
    # Inside a weight update: paused (or asleep with its weights awake), its layers part new.
    RECEIVING = "receiving"
    # Up, but holding weights other than the fleet's (``stale`` says why): takes admin and
    # weight calls, serves nothing until a push.
    STALE = "stale"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    DEAD = "dead"
    RETIRED = "retired"


# An operation's verdict for one engine: it applies, it is already done (the engine is left
# as it is, e.g. resuming an engine that restarted while the others were paused), or a
# reason it is an ordering mistake (409).
APPLY, DONE = "apply", "done"
# A push into an engine that is running: skyinfer pauses it (keep) for the push and resumes
# it after, so no request is scheduled on half-loaded layers.
PAUSE_FOR_PUSH = "pause for the push"

_RECEIVING = (
    "it is receiving a weight update; POST /finish_weight_update first (an aborted one it is still ending"
    " ends by itself)"
)


def _pause(mode: str | None) -> Callable[[EngineRecord], str]:
    def verdict(r: EngineRecord) -> str:
        if r.residency.sleeping:
            return "it is sleeping; POST /wake_up first"
        if mode == "wait" and r.mid_update:
            # vLLM's wait mode lets the scheduler step until the requests drain: on half-loaded layers.
            return _RECEIVING + " (or pause with mode=keep)"
        return APPLY

    return verdict


def _resume(r: EngineRecord) -> str:
    if r.residency.sleeping:
        return "it is sleeping; POST /wake_up instead"
    if not r.residency.paused:
        return DONE
    return _RECEIVING if r.mid_update else APPLY


def _sleep(r: EngineRecord) -> str:
    if r.residency.sleeping:
        return "it is already sleeping"
    return _RECEIVING if r.mid_update else APPLY


def _wake_up(tags: Sequence[str] | None) -> Callable[[EngineRecord], str]:
    def verdict(r: EngineRecord) -> str:
        # vLLM wakes a paused engine too: it answers is_sleeping for both.
        if not r.residency.vllm_is_sleeping:
            return DONE
        if r.mid_update and not r.residency.after("wake_up", tags=tags).paused:
            return (
                "it is receiving a weight update: its scheduler must stay paused; wake it after /finish_weight_update"
            )
        return APPLY

    return verdict


def _always(_r: EngineRecord) -> str:
    return APPLY


# Every control operation over every combination of conditions, in one place.
CONTROL_VERDICTS: dict[str, Callable[..., Callable[[EngineRecord], str]]] = {
    "pause": lambda mode=None, **_: _pause(mode),
    "resume": lambda **_: _resume,
    "sleep": lambda **_: _sleep,
    "wake_up": lambda tags=None, **_: _wake_up(tags),
    "reset_prefix_cache": lambda **_: _always,
    "abort_requests": lambda **_: _always,
    "reset_mm_cache": lambda **_: _always,
    "reset_encoder_cache": lambda **_: _always,
    "collective_rpc": lambda **_: _always,
}
_NOTHING_TO_DO = {"resume": "it is not paused", "wake_up": "it is not sleeping"}


def push_verdict(r: EngineRecord) -> str:
    """Whether a weight update may start on an up engine: APPLY (paused, or asleep with its weights
    awake: the colocated push), PAUSE_FOR_PUSH (running), or why not."""
    if r.mid_update:
        # Between two updates: still ending an aborted one inside the trainer's broken transfer.
        return "it is still ending an aborted weight update; retry once it is stale (GET /engines)"
    if not r.residency.weights_awake:
        return "its weights are asleep; POST /wake_up?tags=weights first"
    if r.residency.paused:
        return APPLY
    return PAUSE_FOR_PUSH


class OrderingError(ApiError):
    """The call makes no sense in the engines' present state."""

    status = 409


def control_targets(
    operation: str, records: list[EngineRecord], **params
) -> tuple[list[EngineRecord], list[EngineRecord]]:
    """Split up engines into those ``operation`` applies to and those where it is already done.

    Raises OrderingError, naming each engine and why, when the call is a
    mistake for some engine, or would apply to none.
    """
    judge = CONTROL_VERDICTS[operation](**params)
    verdicts = [(r, judge(r)) for r in records]
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

    def __init__(self, message: str, engine_id: int, weight_version: str | None):
        super().__init__(message)
        self.engine_id = engine_id
        self.weight_version = weight_version


def _announce(record: EngineRecord, _attribute: attrs.Attribute, value):
    """attrs' setter hook: runs before the value is set, so the announcement waits a loop turn."""
    if record.on_change is not None:
        asyncio.get_running_loop().call_soon(record.on_change)
    return value


@attrs.define(eq=False)
class EngineRecord:
    engine_id: int
    devices: EngineDevices
    socket_path: str
    # Requests sent to the engine at once (one connection each); more wait in the front.
    connection_limit: int = 4096
    # Requests that may wait for a connection before new ones are refused; 0: no cap.
    queue_limit: int = 0
    # Its parallel sizes: its process is started with them, and its workers (tp x pp x dp of them)
    # take that many ranks of a trainer's group.
    parallel: EngineSize = attrs.field(default=EngineSize(), converter=EngineSize.of)
    lifecycle: Lifecycle = attrs.field(default=Lifecycle.STARTING, on_setattr=_announce)
    # While it is up: its scheduler and memory, why its weights are not the fleet's (None:
    # they are), whether it is inside a weight update. A new process starts with none of it.
    residency: Residency = Residency()
    stale: str | None = None
    # Between vLLM's start and finish of a weight update, or in a staged swap: its layers may be
    # part new (state "receiving"; weights/push.py sets and clears it).
    mid_update: bool = False
    # The weight version its workers can take a delta push on (transfer/delta.py): the one the last
    # push it finished gave it, where each worker said it could (its live weights, or a copy of
    # them kept); None after anything else wrote its weights (a catch-up, a new process).
    delta_base: str | None = None
    pid: int | None = attrs.field(default=None, on_setattr=_announce)
    # Requests the front holds for this engine: sent to it, or waiting to be.
    in_flight_count: int = 0
    # Of those, the ones waiting for a connection.
    queued: int = 0
    # Requests refused because the queue was full.
    refused: int = 0
    # Requests sent to another engine because this one died under them.
    retried_elsewhere: int = 0
    # Requests in flight at its death that another engine had died under before: ended, not sent to
    # a third (a request that kills engines must not walk through the fleet).
    ended_at_second_death: int = 0
    # HTTP client over this engine's Unix socket; set once it is ready.
    client: aiohttp.ClientSession | None = None
    # The weights it serves, as the engine reports them ("default": as loaded).
    weight_version: str | None = attrs.field(default=None, on_setattr=_announce)
    # The dtype it serves weights in.
    model_dtype: str | None = None
    # The layers it serves quantized, by vLLM's names, as it reports them at start.
    quantized_layers: tuple[str, ...] | None = None
    # The largest LoRA rank it takes; None: started without --enable-lora.
    max_lora_rank: int | None = None
    # The LoRA adapters it holds: name -> version (a new process holds none). Replaced, never
    # changed in place (``hold_adapter``, ``drop_adapter``), so that each change is announced.
    adapters: dict[str, str] = attrs.field(factory=dict, on_setattr=_announce)
    # Whether its workers are in the current trainer's weight-transfer group
    # (a new process never is).
    in_transfer_group: bool = False
    # While an /init_weight_transfer runs: where its rendezvous stands for this engine ("waiting
    # for the trainer at host:port" until the trainer listens, then "joining ..."); None otherwise.
    rendezvous: str | None = None
    # While a staged push runs (weights/staged.py): what its staging copy holds or will ("receiving"
    # and the bytes expected, then "staged", the bytes, and where: cpu, cuda, cpu pinned).
    staging: dict | None = None
    # Whether vLLM holds a weight-transfer engine (a communicator) from an init, even one whose
    # group broke since: it is shut down before the next init, or NCCL leaks it.
    transfer_engine_open: bool = False
    # Process replacements since the service started (crashes, failed transfers).
    restarts: int = 0
    # Its warm spare (spares.py): None (none, or --warm-spares 0), "starting" or "waiting".
    spare: str | None = None
    # Pushes in a row that this engine failed itself (the others did their part): at
    # ``--max-push-failures`` it is retired. A push it completes, or a new process, starts afresh.
    push_failures: int = 0
    # Called a loop turn after each change of what front workers mirror of it (the hub sends what
    # changed once): its process, lifecycle, weight version or adapters. Set by the front workers'
    # lease hub.
    on_change: Callable[[], None] | None = attrs.field(default=None, init=False)
    _connections: asyncio.Semaphore = attrs.field(init=False)
    # When each call the front has in flight to it must end by: while one runs, the engine may be
    # busy on the front's behalf (a rendezvous, a transfer, a drain), and a probe that times out
    # says nothing (one it answers unhealthy, or refuses, still does).
    _front_call_deadlines: list[float] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        self._connections = asyncio.Semaphore(self.connection_limit)

    @contextlib.contextmanager
    def answering_front(self, timeout_s: float):
        """While the front waits up to ``timeout_s`` for this engine to answer one of its calls."""
        deadline = time.monotonic() + timeout_s
        self._front_call_deadlines.append(deadline)
        try:
            yield
        finally:
            self._front_call_deadlines.remove(deadline)

    def busy_for_front(self) -> bool:
        """A call of the front's is in flight and within its deadline: a busy EngineCore is expected."""
        now = time.monotonic()
        return any(deadline > now for deadline in self._front_call_deadlines)

    def hold_adapter(self, name: str, version: str) -> None:
        self.adapters = {**self.adapters, name: version}

    def drop_adapter(self, name: str) -> None:
        if name in self.adapters:
            self.adapters = {k: v for k, v in self.adapters.items() if k != name}

    @property
    def up(self) -> bool:
        """Its process is up and takes admin and weight calls."""
        return self.lifecycle is Lifecycle.UP

    @property
    def retired(self) -> bool:
        return self.lifecycle is Lifecycle.RETIRED

    @property
    def serves(self) -> bool:
        """Requests may be routed to it. Paused and sleeping engines still take requests: vLLM
        queues them until resume / wake-up, which is what a trainer pausing for a push wants."""
        return self.up and self.stale is None

    @property
    def paused(self) -> bool:
        return self.residency.paused

    @property
    def vllm_is_sleeping(self) -> bool:
        """As vLLM's own ``is_sleeping`` answers: its scheduler is paused or some memory is released."""
        return self.residency.vllm_is_sleeping

    @property
    def state(self) -> EngineState:
        if not self.up:
            return EngineState(self.lifecycle.value)
        if self.mid_update:
            return EngineState.RECEIVING
        if self.residency.sleeping:
            return EngineState.SLEEPING
        if self.stale is not None:
            return EngineState.STALE
        return EngineState.PAUSED if self.residency.paused else EngineState.READY

    @contextlib.asynccontextmanager
    async def in_flight(self):
        """Hold one of the engine's connections for a request, waiting in arrival order for one."""
        if self.queue_limit and self._connections.locked() and self.queued >= self.queue_limit:
            self.refused += 1
            raise EngineBusy(
                f"engine {self.engine_id} has {self.queued} requests waiting; retry later",
                self.engine_id,
                self.weight_version,
            )
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
            "sleeping": self.vllm_is_sleeping,
            **{k: v for k, v in self.residency.describe().items() if k != "paused"},
            "stale": self.stale is not None,
            "stale_reason": self.stale,
            "receiving": self.mid_update,
            "rendezvous": self.rendezvous,
            "staging": self.staging,
            "pid": self.pid,
            "devices": self.devices.describe(),
            **self.parallel.describe(),
            "in_flight": self.in_flight_count,
            "queued": self.queued,
            "weight_version": self.weight_version,
            "model_dtype": self.model_dtype,
            # How many of its layers it serves quantized (each takes a push of all its tensors or none).
            "quantized_layers": None if self.quantized_layers is None else len(self.quantized_layers),
            "adapters": dict(self.adapters),
            "restarts": self.restarts,
            "spare": self.spare,
        }
