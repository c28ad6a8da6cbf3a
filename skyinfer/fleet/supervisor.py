"""Start, watch and stop the engine child processes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from ..config import ServeConfig
from ..errors import ApiError, json_response
from .engine_process import EngineProcess, EngineStartError
from .engine_templates import EngineTemplates, how_it_exited
from .registry import EngineRegistry
from .spares import Spares
from .state import EngineRecord, Lifecycle, OrderingError

# An engine that served this long before it died restarts at once (unless ``--max-restarts``
# retires it); one that died sooner (or never came up) waits out the backoff, doubling per crash
# in a row.
SERVED_BEFORE_AN_IMMEDIATE_RESTART_S = 10.0

log = logging.getLogger("skyinfer.supervisor")


async def _close_client(record: EngineRecord) -> None:
    """Drop an engine's client: gone from the record first, so that nobody picks up a session
    that is closing (it raises rather than fail like an unreachable engine)."""
    client, record.client = record.client, None
    if client is not None:
        await client.close()


class Supervisor:
    """Owns the engine processes behind an ``EngineRegistry``."""

    def __init__(self, registry: EngineRegistry, config: ServeConfig):
        self.registry = registry
        self.config = config
        # CPU engines (and their spares) fork from these instead of importing torch and vLLM again.
        self.templates = EngineTemplates(
            config.engine_start_timeout_s, config.engine_probe_timeout_s, config.engine_template_socket
        )
        self.processes = {r.engine_id: EngineProcess(r, config, self.templates) for r in registry.records}
        # Warm spares: a restart takes the slot's, if alive, instead of starting a cold process.
        self.spares = Spares(registry, self.processes, config.warm_spares > 0, config.engine_start_timeout_s)
        # Engines hold the read end; only this process holds the write end, so
        # when it dies, however it dies, they die with it (engine/lifeline.py).
        self._lifeline: tuple[int, int] | None = None
        self._start_task: asyncio.Task | None = None
        # Brings a new engine process to the fleet and marks it up (bringup.py).
        self.bring_up: Callable[[EngineRecord], Awaitable[None]] | None = None
        # Exit watchers and restarts running in the background.
        self._tasks: set[asyncio.Task] = set()

    def _in_background(self, coro, process: EngineProcess) -> asyncio.Task:
        """Watch, probe or restart ``process`` beside the caller.

        Nobody awaits these tasks, so a failure nobody foresaw would otherwise
        vanish and leave the engine in whatever state it had (``restarting``
        for ever): it is logged, and the engine is declared dead, which
        revives it (one stopping, already dead or retired is left as it is).
        """
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._background_done, process))
        return task

    def _background_done(self, process: EngineProcess, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        log.error(
            "engine %d: supervision task %s failed",
            process.record.engine_id,
            task.get_coro().__qualname__,
            exc_info=task.exception(),
        )
        self._declare_dead(process, "its supervision failed")

    def _declare_dead(self, process: EngineProcess, reason: str) -> None:
        """Out of rotation now, its processes killed (its requests cut off at once; those whose caller
        has nothing yet may go to another engine: proxy.py), revived after a backoff or retired
        (``_revive``). Nothing for an engine stopping, already dead or retired."""
        record = process.record
        if record.lifecycle in (Lifecycle.STOPPING, Lifecycle.STOPPED, Lifecycle.DEAD, Lifecycle.RETIRED):
            return
        log.error("engine %d: %s", record.engine_id, reason)
        self.registry.set_lifecycle(record, Lifecycle.DEAD)
        process.kill()
        self._in_background(self._revive(process), process)

    def start(self) -> None:
        """Start every engine in parallel; ``wait_ready`` reports the outcome."""
        self._lifeline = os.pipe()
        self.spares.start(self._lifeline[0])
        self._start_task = asyncio.create_task(self._start_all())

    async def wait_ready(self) -> None:
        assert self._start_task is not None
        await asyncio.shield(self._start_task)

    async def _start_all(self) -> None:
        started = time.monotonic()
        await asyncio.gather(*(self._launch(p) for p in self.processes.values()))
        log.info("all %d engine(s) ready in %.1fs", len(self.processes), time.monotonic() - started)
        for record in self.registry.records:
            if record.up:
                self.spares.want(record.engine_id)

    async def _launch(self, process: EngineProcess) -> None:
        assert self._lifeline is not None
        await process.spawn(self._lifeline[0], self.spares.take(process.record.engine_id))
        self._in_background(self._watch_exit(process), process)
        await self._become_ready(process)

    async def _become_ready(self, process: EngineProcess) -> None:
        record = process.record
        client, info = await process.wait_ready(self.config.engine_start_timeout_s)
        if record.lifecycle not in (Lifecycle.STARTING, Lifecycle.RESTARTING):
            await client.close()  # stopped while starting
            return
        record.client = client
        process.ready_since = time.monotonic()
        record.weight_version = info["weight_version"]
        record.model_dtype = info["model_dtype"]
        record.quantized_layers = tuple(info["quantized_layers"])
        record.max_lora_rank = info["max_lora_rank"]
        record.push_failures = 0
        assert self.bring_up is not None
        await self.bring_up(record)
        if record.up:
            self._in_background(self._probe(process), process)

    async def _probe(self, process: EngineProcess) -> None:
        """Probe one engine process's health on a timer; a hung engine is dead.

        A killed process is noticed by ``_watch_exit``; this catches the one
        that is there but no longer answers.
        """
        c = self.config
        record, proc = process.record, process.proc
        failures = 0
        while process.proc is proc and proc.returncode is None:
            await asyncio.sleep(c.health_interval_s)
            client = record.client
            if not record.up or client is None:
                continue
            slow = False
            try:
                async with client.get("/health", timeout=aiohttp.ClientTimeout(total=c.health_timeout_s)) as resp:
                    healthy = resp.status == 200
            except asyncio.TimeoutError:
                healthy, slow = False, True
            except aiohttp.ClientError:
                healthy = False
            if slow and record.busy_for_front():
                # Busy on the front's behalf (a rendezvous, a transfer, a drain): that call's own
                # deadline judges it, and its process is watched. An engine that answers that it is
                # dead (its EngineCore gone), or no longer takes connections, is dead all the same.
                log.info(
                    "engine %d: health probe timed out during a call of the front's: not counted", record.engine_id
                )
                continue
            failures = 0 if healthy else failures + 1
            if failures and failures < c.health_failures:
                log.warning("engine %d: health probe failed (%d of %d)", record.engine_id, failures, c.health_failures)
            if failures >= c.health_failures and process.proc is proc and record.up:
                log.error(
                    "engine %d: %d health probes failed in a row; its threads' stacks follow, then it is killed",
                    record.engine_id,
                    failures,
                )
                await process.write_stacks()
                if process.proc is proc:
                    self._declare_dead(process, "killed after its failed health probes")
                return

    async def restart(self, record: EngineRecord, reason: str) -> None:
        """Replace an engine's process; it comes back stale if the fleet's weights moved on."""
        process = self.processes[record.engine_id]
        log.warning("engine %d: restarting (%s)", record.engine_id, reason)
        record.restarts += 1
        self.registry.set_lifecycle(record, Lifecycle.RESTARTING)
        # Nothing on it is worth finishing (it died, or holds weights no push finished): killed
        # first, its requests see the connection drop at once, streams included (those whose
        # caller has nothing yet may go to another engine: proxy.py).
        process.kill()
        await process.stop(self.config.engine_stop_timeout_s)
        await _close_client(record)
        try:
            await self._launch(process)
        except Exception:  # whatever went wrong, the engine must not stay "restarting"
            log.exception("engine %d: restart failed", record.engine_id)
            self._declare_dead(process, "its restart failed")
            return
        if record.up:
            # Up again: its next restart is warm too, once the fleet is steady.
            self.spares.want(record.engine_id)

    def retire(self, record: EngineRecord, reason: str) -> None:
        """Take an engine that stays up but keeps failing out of the fleet, as a restart-looping one
        is: its processes killed, no admin call, push or readiness waits for it, until
        ``POST /engines/{id}/restart``."""
        log.error(
            "engine %d: retired: %s; POST /engines/%d/restart brings it back",
            record.engine_id,
            reason,
            record.engine_id,
        )
        self.registry.set_lifecycle(record, Lifecycle.DEAD)
        process = self.processes[record.engine_id]
        process.kill()
        self.registry.set_lifecycle(record, Lifecycle.RETIRED)
        self._in_background(_close_client(record), process)

    def restart_in_background(self, record: EngineRecord, reason: str) -> None:
        """Take an engine out of rotation now; replace its process beside the caller."""
        self.registry.set_lifecycle(record, Lifecycle.RESTARTING)
        self._in_background(self.restart(record, reason), self.processes[record.engine_id])

    async def _watch_exit(self, process: EngineProcess) -> None:
        """An engine process that exits unasked is dead: stop routing to it at once."""
        assert process.proc is not None
        proc = process.proc
        code = await proc.wait()
        record = process.record
        if proc is process.proc and record.lifecycle not in (
            Lifecycle.STOPPING,
            Lifecycle.STOPPED,
            Lifecycle.DEAD,
            Lifecycle.RESTARTING,
        ):
            self._declare_dead(process, f"process {proc.pid} {how_it_exited(code)}")

    async def _revive(self, process: EngineProcess) -> None:
        """Restart a crashed engine, backing off while it keeps crashing; retire it once it has
        needed more restarts in a row than it may have."""
        record = process.record
        # An engine that stayed up a while starts afresh; one whose restart failed, or that died
        # again soon after, adds to its failures.
        served_s = time.monotonic() - process.ready_since if process.ready_since else 0.0
        if served_s > self.config.restart_window_s:
            process.crashes = 0
        process.ready_since = 0.0
        if process.crashes >= self.config.max_restarts:
            log.error(
                "engine %d: retired: it needed %d restarts in a row (--max-restarts %d), none staying up %.0fs; "
                "POST /engines/%d/restart brings it back",
                record.engine_id,
                process.crashes + 1,
                self.config.max_restarts,
                self.config.restart_window_s,
                record.engine_id,
            )
            self.registry.set_lifecycle(record, Lifecycle.RETIRED)
            return
        delay = min(self.config.restart_backoff_max_s, self.config.restart_backoff_s * 2**process.crashes)
        if served_s >= SERVED_BEFORE_AN_IMMEDIATE_RESTART_S:
            # It served a while: no restart loop to slow down (its death still counts toward --max-restarts).
            delay = 0.0
        process.crashes += 1
        log.warning("engine %d: restarting in %.1fs (crash %d)", record.engine_id, delay, process.crashes)
        await asyncio.sleep(delay)
        if record.lifecycle is Lifecycle.DEAD:
            await self.restart(record, "it died")

    async def restart_on_request(self, record: EngineRecord) -> None:
        """An operator's restart (``POST /engines/{id}/restart``): a retired engine rejoins the fleet,
        with its failures forgotten; returns once it is up (it raises if it did not come up). The
        restart is the supervisor's from the start: a caller who gives up leaves it running to its
        end, never an engine "restarting" for ever."""
        if record.lifecycle not in (Lifecycle.UP, Lifecycle.DEAD, Lifecycle.RETIRED):
            raise OrderingError(f"engine {record.engine_id} is {record.state.value}: restart it once that is over")
        process = self.processes[record.engine_id]
        process.crashes = 0
        self.registry.set_lifecycle(record, Lifecycle.RESTARTING)
        await asyncio.shield(self._in_background(self.restart(record, "an operator asked for it"), process))
        if not record.up:
            raise EngineStartError(f"engine {record.engine_id} did not come back: it is {record.state.value}")

    async def stop(self, timeout_s: float) -> None:
        """Stop every engine: SIGTERM, then SIGKILL after ``timeout_s``."""
        # No restart may race the shutdown.
        for task in [self._start_task, *self._tasks]:
            if task is not None and not task.done():
                task.cancel()
                # A failure was reported where it happened; none may stop the shutdown.
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        # Spares hold no engine: killed at once, before anything could start another.
        await self.spares.stop()
        # Not under the registry's lock: a push may hold it for as long as its
        # transfer times out, and the shutdown must end within its grace. What
        # the push does next fails on stopping engines, and restarts none.
        for record in self.registry.records:
            if record.lifecycle is not Lifecycle.STOPPED:
                self.registry.set_lifecycle(record, Lifecycle.STOPPING)
        await asyncio.gather(*(self._stop_one(p, timeout_s) for p in self.processes.values()))
        await self.templates.stop()
        if self._lifeline is not None:
            for fd in self._lifeline:
                os.close(fd)
            self._lifeline = None

    async def _stop_one(self, process: EngineProcess, timeout_s: float) -> None:
        record = process.record
        await _close_client(record)
        await process.stop(timeout_s)
        self.registry.set_lifecycle(record, Lifecycle.STOPPED)


SUPERVISOR = web.AppKey("supervisor", Supervisor)


async def _restart_engine(request: web.Request) -> web.Response:
    """``POST /engines/{id}/restart``: replace one engine's process, and answer once it is up (a
    retired engine rejoins the fleet; stale until the next push if the fleet's weights moved on).

    If its caller leaves: the restart runs to its end (the engine comes up, or is declared dead
    and revived); ``GET /engines`` shows it, and a second restart meanwhile is a 409."""
    supervisor = request.app[SUPERVISOR]
    records = supervisor.registry.records
    engine_id = request.match_info["engine_id"]
    if not engine_id.isdigit() or int(engine_id) >= len(records):
        raise ApiError(f"no engine {engine_id!r}: engines are 0 to {len(records) - 1}", status=404, param="engine_id")
    record = records[int(engine_id)]
    try:
        await supervisor.restart_on_request(record)
    except EngineStartError as exc:
        raise ApiError(str(exc), status=503) from None
    return json_response({"status": "restarted", "engine": record.describe()})


def add_supervisor_routes(app: web.Application) -> None:
    app.router.add_post("/engines/{engine_id}/restart", _restart_engine)
