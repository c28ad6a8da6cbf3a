"""The lease channel between front workers and the control process: both sides in one module.

Each worker keeps one Unix-socket connection to the control process, carrying newline-delimited
JSON messages. The worker asks for a lease per request (``lease``); the control process runs the
same ``lease_engine`` as a single front process does (routing, hold, connection slot) and answers
``granted`` or why not; the worker relays the request to the engine itself and says ``release``
when the answer is over (or the caller went away). So routing state (sessions, groups, loads,
queues, stored responses, holds) is exact, in one process, and the relay's CPU is the workers'.

The control process also tells every worker what it mirrors of each engine (socket, process,
weight version, adapters, membership) whenever that changes, so that an answer carries the
version the engine held when it answered; and it asks workers for their request metrics at
scrape time. A worker whose channel closes has lost its control process and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Collection

import aiohttp
import attrs
import orjson

from ..errors import ApiError
from ..fleet.engine_calls import unix_client
from ..fleet.registry import EngineRegistry
from ..fleet.state import EngineBusy, EngineRecord, NoEngineAvailable
from ..serving.leasing import Ask, Grant, NotConnected, lease_engine

log = logging.getLogger("skyinfer.front_workers")

# A worker that does not answer a metrics request within this is left out of that scrape.
METRICS_TIMEOUT_S = 5.0


def _frame(message: dict) -> bytes:
    return orjson.dumps(message) + b"\n"


class _Lines(asyncio.Protocol):
    """Newline-delimited JSON messages in, each handed to ``on_message``."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        start = 0
        while (end := self._buffer.find(b"\n", start)) >= 0:
            self.on_message(orjson.loads(self._buffer[start:end]))
            start = end + 1
        del self._buffer[:start]

    def send(self, message: dict) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_frame(message))

    def on_message(self, message: dict) -> None:
        raise NotImplementedError


# -- the control process's side -------------------------------------------------------------


def _mirrored(record: EngineRecord) -> dict:
    return {
        "id": record.engine_id,
        "socket_path": record.socket_path,
        "pid": record.pid,
        "weight_version": record.weight_version,
        "adapters": record.adapters,
        "member": not record.retired,
    }


def _refusal(exc: Exception) -> dict:
    """Why a lease was not granted, as the worker raises it again."""
    if isinstance(exc, NoEngineAvailable):
        return {"refused": "none", "message": str(exc)}
    if isinstance(exc, EngineBusy):
        return {"refused": "busy", "message": str(exc), "engine": exc.engine_id, "version": exc.weight_version}
    if isinstance(exc, NotConnected):
        return {"refused": "not_connected", "message": str(exc), "engine": exc.engine.engine_id}
    if isinstance(exc, ApiError):
        return {"refused": "api", "message": str(exc), "status": exc.status, "param": exc.param, "code": exc.code}
    log.error("a lease failed: %r", exc, exc_info=exc)
    return {"refused": "api", "message": f"the front failed: {exc!r}", "status": 500, "param": None, "code": None}


class _WorkerLink(_Lines):
    """One worker's connection, as the control process sees it."""

    def __init__(self, hub: LeaseHub):
        super().__init__()
        self.hub = hub
        self.leases: dict[int, asyncio.Task] = {}
        self._metrics: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.hub.links.add(self)
        self.send(self.hub.engines_message())

    def connection_lost(self, exc) -> None:
        # The worker is gone: whatever it held goes back (connection slots, queue places).
        self.hub.links.discard(self)
        for task in self.leases.values():
            task.cancel()
        for future in self._metrics.values():
            if not future.done():
                future.set_result(None)

    def on_message(self, message: dict) -> None:
        op = message["op"]
        if op == "lease":
            lease_id = message["id"]
            ask = Ask(*message["ask"])
            self.leases[lease_id] = asyncio.ensure_future(self._hold(lease_id, ask, message["exclude"]))
        elif op == "release":
            task = self.leases.pop(message["id"], None)
            if task is not None:
                task.cancel()
        elif op == "retried":
            self.hub.registry.records[message["engine"]].retried_elsewhere += 1
        elif op == "second_death":
            self.hub.registry.records[message["engine"]].ended_at_second_death += 1
        elif op == "response":
            self.hub.registry.stored_responses.record(message["response_id"], message["engine"])
        elif op == "metrics":
            future = self._metrics.pop(message["id"], None)
            if future is not None and not future.done():
                future.set_result(message["text"])

    async def _hold(self, lease_id: int, ask: Ask, exclude: Collection[int]) -> None:
        """Grant the lease and hold it until the worker releases it (this task is cancelled)."""
        try:
            async with lease_engine(self.hub.registry, ask, exclude) as grant:
                record = grant.engine
                self.send({"id": lease_id, "granted": _mirrored(record), "adapter": grant.adapter})
                await asyncio.Future()  # until released
        except Exception as exc:
            self.leases.pop(lease_id, None)
            self.send({"id": lease_id, **_refusal(exc)})

    async def metrics_text(self) -> str | None:
        request_id = next(self._ids)
        future = self._metrics[request_id] = asyncio.get_running_loop().create_future()
        self.send({"op": "metrics", "id": request_id})
        try:
            return await asyncio.wait_for(future, METRICS_TIMEOUT_S)
        except asyncio.TimeoutError:
            return None
        finally:
            self._metrics.pop(request_id, None)


class LeaseHub:
    """The control process's end: leases from its registry, for every worker connected."""

    def __init__(self, registry: EngineRegistry):
        self.registry = registry
        self.links: set[_WorkerLink] = set()
        self._server: asyncio.AbstractServer | None = None
        self._last_sent: bytes | None = None
        for record in registry.records:
            record.on_change = self._engines_changed

    async def start(self, socket_path: str) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _WorkerLink(self), socket_path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for link in list(self.links):
                link.transport.close()
            await self._server.wait_closed()

    def engines_message(self) -> dict:
        return {"op": "engines", "engines": [_mirrored(r) for r in self.registry.records]}

    def _engines_changed(self) -> None:
        message = self.engines_message()
        framed = _frame(message)
        # Several changes in one loop turn each schedule this: send what changed once.
        if framed == self._last_sent:
            return
        self._last_sent = framed
        for link in self.links:
            link.send(message)

    async def worker_metrics(self) -> list[str]:
        """Every worker's request metrics (Prometheus text), asked of each now."""
        texts = await asyncio.gather(*(link.metrics_text() for link in list(self.links)))
        return [t for t in texts if t is not None]


# -- a worker's side ------------------------------------------------------------------------


@attrs.define(eq=False)
class MirroredEngine:
    """A worker's copy of what the relay needs of an engine; its own client to the engine's socket."""

    engine_id: int
    socket_path: str
    pid: int | None = None
    weight_version: str | None = None
    adapters: dict[str, str] = attrs.field(factory=dict)
    member: bool = True
    client: aiohttp.ClientSession | None = None
    _closing: asyncio.Future | None = None

    def update(self, mirrored: dict) -> None:
        if mirrored["pid"] != self.pid:
            # A new process: connections kept to the old one are useless.
            if self.client is not None:
                self._closing = asyncio.ensure_future(self.client.close())
            self.client = unix_client(self.socket_path) if mirrored["pid"] is not None else None
            self.pid = mirrored["pid"]
        self.weight_version = mirrored["weight_version"]
        self.adapters = mirrored["adapters"]
        self.member = mirrored["member"]


class RemoteLeases(_Lines):
    """A worker's end: ``Leases`` asked of the control process."""

    def __init__(self, hold_requests_s: float, metrics_text: Callable[[], str]):
        super().__init__()
        self.hold_requests_s = hold_requests_s
        self._metrics_text = metrics_text
        self.engines: dict[int, MirroredEngine] = {}
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        # Done when the channel closes: the control process is gone, and so is this worker.
        self.closed: asyncio.Future = asyncio.get_running_loop().create_future()
        self._engines_known = asyncio.Event()

    @classmethod
    async def connect(cls, socket_path: str, hold_requests_s: float, metrics_text: Callable[[], str]) -> RemoteLeases:
        loop = asyncio.get_running_loop()
        _, leases = await loop.create_unix_connection(lambda: cls(hold_requests_s, metrics_text), socket_path)
        known = asyncio.ensure_future(leases._engines_known.wait())
        await asyncio.wait({known, leases.closed}, return_when=asyncio.FIRST_COMPLETED)
        if not known.done():
            known.cancel()
            raise ConnectionError("the front's control process closed the channel before it said what its engines are")
        return leases

    def connection_lost(self, exc) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(NoEngineAvailable("the front's control process is gone"))
        if not self.closed.done():
            self.closed.set_result(None)

    def on_message(self, message: dict) -> None:
        if "id" in message and message.get("op") is None:
            future = self._pending.pop(message["id"], None)
            if future is not None and not future.done():
                future.set_result(message)
        elif message["op"] == "engines":
            for mirrored in message["engines"]:
                self._mirror(mirrored)
            self._engines_known.set()
        elif message["op"] == "metrics":
            self.send({"op": "metrics", "id": message["id"], "text": self._metrics_text()})

    def _mirror(self, mirrored: dict) -> MirroredEngine:
        engine = self.engines.get(mirrored["id"])
        if engine is None:
            engine = self.engines[mirrored["id"]] = MirroredEngine(mirrored["id"], mirrored["socket_path"])
        engine.update(mirrored)
        return engine

    @contextlib.asynccontextmanager
    async def lease(self, ask: Ask, exclude: Collection[int]) -> AsyncIterator[Grant]:
        lease_id = next(self._ids)
        answer = self._pending[lease_id] = asyncio.get_running_loop().create_future()
        self.send({"op": "lease", "id": lease_id, "ask": attrs.astuple(ask), "exclude": list(exclude)})
        try:
            reply = await answer
            if "granted" not in reply:
                raise self._refused(reply)
            yield Grant(self._mirror(reply["granted"]), reply["adapter"])
        finally:
            self._pending.pop(lease_id, None)
            self.send({"op": "release", "id": lease_id})

    def _refused(self, reply: dict) -> Exception:
        kind, message = reply["refused"], reply["message"]
        if kind == "none":
            return NoEngineAvailable(message)
        if kind == "busy":
            return EngineBusy(message, reply["engine"], reply["version"])
        if kind == "not_connected":
            return NotConnected(message, self.engines[reply["engine"]])
        return ApiError(message, status=reply["status"], param=reply["param"], code=reply["code"])

    def has_other_member(self, engine_id: int) -> bool:
        return any(e.member and e.engine_id != engine_id for e in self.engines.values())

    def note_retried(self, engine_id: int) -> None:
        self.send({"op": "retried", "engine": engine_id})

    def note_second_death(self, engine_id: int) -> None:
        self.send({"op": "second_death", "engine": engine_id})

    def remember_response(self, response_id: str, engine_id: int) -> None:
        self.send({"op": "response", "response_id": response_id, "engine": engine_id})

    async def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        await asyncio.gather(*(e.client.close() for e in self.engines.values() if e.client is not None))
