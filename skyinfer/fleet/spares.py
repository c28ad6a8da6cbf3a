"""Warm spares: per engine, a process that waits to become it.

A restart used to start a cold process, which pays for Python's, torch's and vLLM's imports
before vLLM even starts loading the model. With ``--warm-spares 1`` (the default) each engine
slot has a *spare*: the engine's own command line with ``--standby`` (``engine/standby.py``),
started once the fleet is ready. When the slot's engine dies, or an operator restarts it, the
supervisor sends the spare its start order and the spare becomes the engine's process (its pid,
its process group); a cold process is started only when the slot has no live spare that can
take the order (a loaded one cannot take a changed environment: below).

* What a spare does first: on CPU engines (``--loaded-spares auto``, or ``on``) it builds the
  whole engine, vLLM's EngineCore (and the worker processes of an engine of several workers)
  with the model and KV cache, everything but the socket; the order then costs the socket alone. Otherwise (GPUs: a second engine would not fit beside the first) it imports.
  A loaded spare cannot take a changed environment: its slot's restart then starts cold.
* When spares start: one at a time, and only while the fleet is steady (every engine up, or
  retired): after the fleet's start, and after an engine that restarted is up again, so that a
  spare's start does not compete with an engine's for the CPU, unless it had begun before
  another engine died: it goes on starting.
* A spare's life: tied to the front's by the lifeline from its first instant, as an engine's;
  stopping the service kills every spare. A spare that dies unasked is not replaced at once: its
  slot restarts cold, and gets a new spare once its engine is up again.
* What it costs: an importing spare holds its imports' memory (about 0.6 GiB on CPU) and takes
  a few seconds of a core to start; a loaded one a whole engine's (``docs/benchmarks.rst``).
* What a spare that goes leaves: nothing. A spare is SIGKILLed with its process group, vLLM's
  processes and their resource tracker among them, which would have unlinked vLLM's segments in
  ``/dev/shm``: those its processes map, noted once it stands by and again as it is killed, are
  removed once it is (``shm_leftovers.py``), as an engine's when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import TYPE_CHECKING

from ..engine.output import read_tail
from ..engine.standby import SPARE_LOG_SUFFIX
from .engine_templates import how_it_exited, kill_group
from .registry import EngineRegistry
from .shm_leftovers import mapped_segments, remove_segments
from .state import Lifecycle

if TYPE_CHECKING:
    from .engine_process import EngineProcess
    from .engine_templates import ForkedProcess

log = logging.getLogger("skyinfer.spares")

# How often the pool looks again whether the fleet is steady enough to start a spare.
_POLL_S = 1.0


class Spare:
    """One spare process of an engine slot: importing (or building its engine), then waiting for its start order on stdin."""

    def __init__(
        self,
        engine_id: int,
        proc: asyncio.subprocess.Process | ForkedProcess,
        order_fd: int,
        env: dict[str, str],
        loaded: bool,
    ):
        self.engine_id = engine_id
        self.proc = proc
        # It builds the whole engine before it stands by (engine/standby.py).
        self.loaded = loaded
        self._order_fd: int | None = order_fd
        # The environment it was started with: the start order carries what differs from it.
        self.env = env
        # It said it stands by (its imports are done).
        self.waiting = False
        # It was sent its start order: it is the engine's process now, no longer a spare.
        self.taken = False
        # vLLM's segments in /dev/shm that its processes map: removed once they are killed.
        self.shm_segments: set[str] = set()

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def take_over(self, env: dict[str, str]) -> bool:
        """Send the start order: the spare becomes the engine's process, with ``env`` (the whole
        environment a cold start would get now). False if it can no longer take it (it died)."""
        if not self.alive or self._order_fd is None:
            return False
        order = {
            "env": {name: value for name, value in env.items() if self.env.get(name) != value},
            "unset": sorted(self.env.keys() - env.keys()),
        }
        if self.loaded and (order["env"] or order["unset"]):
            return False  # its engine was built with the environment it started with
        data = json.dumps(order).encode() + b"\n"
        try:
            # Small (what changed since it started), into a pipe's buffer: it never blocks.
            while data:
                data = data[os.write(self._order_fd, data) :]
        except OSError:
            return False
        finally:
            self._close_order()
        self.taken = True
        return True

    def _close_order(self) -> None:
        fd, self._order_fd = self._order_fd, None
        if fd is not None:
            os.close(fd)

    def note_segments(self) -> None:
        """Note the segments its processes map now (its group's: ``pid`` leads it while it runs)."""
        if self.alive:
            self.shm_segments |= mapped_segments(self.proc.pid)

    def kill(self) -> None:
        """Kill it (it holds no engine: nothing to shut down), with anything it started, and
        remove the segments of vLLM's that its processes mapped."""
        self._close_order()
        self.note_segments()
        kill_group(self.proc)
        # SIGKILLed, its processes run no more code that would use them.
        segments, self.shm_segments = self.shm_segments, set()
        if removed := remove_segments(segments):
            log.info(
                "engine %d: removed %d segment(s) its spare's processes left in /dev/shm", self.engine_id, len(removed)
            )

    async def dismiss(self) -> None:
        self.kill()
        await self.proc.wait()


class Spares:
    """The engine slots' spares: started one at a time while the fleet is steady; taken by restarts."""

    def __init__(
        self, registry: EngineRegistry, processes: dict[int, EngineProcess], enabled: bool, start_timeout_s: float
    ):
        self.registry = registry
        self.processes = processes
        self.enabled = enabled
        self.start_timeout_s = start_timeout_s
        self._spares: dict[int, Spare] = {}
        # Slots that want a spare once the fleet is steady.
        self._wanted: set[int] = set()
        self._lifeline_fd: int | None = None
        self._task: asyncio.Task | None = None
        self._watchers: set[asyncio.Task] = set()
        self._stopping = False

    def start(self, lifeline_fd: int) -> None:
        """Spares may start from now on (once wanted), each holding a read end of ``lifeline_fd``'s pipe."""
        self._lifeline_fd = lifeline_fd

    def want(self, engine_id: int) -> None:
        """The slot's engine is up: give it a spare (unless it has one) once the fleet is steady."""
        if not self.enabled or self._lifeline_fd is None or self._stopping:
            return
        self._wanted.add(engine_id)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())

    def take(self, engine_id: int) -> Spare | None:
        """The slot's spare, if one is alive, for its engine's restart: it is no longer the slot's spare."""
        spare = self._spares.pop(engine_id, None)
        self._show(engine_id, None)
        if spare is not None and not spare.alive:
            spare.kill()  # what it left: its end of the order pipe
            return None
        return spare

    async def stop(self) -> None:
        """Kill every spare; none starts again."""
        self._stopping = True
        tasks = [t for t in (self._task, *self._watchers) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        spares, self._spares = list(self._spares.values()), {}
        await asyncio.gather(*(spare.dismiss() for spare in spares))

    def _show(self, engine_id: int, state: str | None) -> None:
        self.registry.records[engine_id].spare = state

    def _steady(self) -> bool:
        return all(r.lifecycle in (Lifecycle.UP, Lifecycle.RETIRED) for r in self.registry.records)

    async def _run(self) -> None:
        while self._wanted:
            if not self._steady():
                await asyncio.sleep(_POLL_S)
                continue
            engine_id = min(self._wanted)
            self._wanted.discard(engine_id)
            if engine_id in self._spares and self._spares[engine_id].alive:
                continue
            try:
                await self._start(engine_id)
            except Exception:  # a spare is an optimisation: its failure must not stop the others'
                log.exception("engine %d: its spare could not start", engine_id)

    async def _start(self, engine_id: int) -> None:
        assert self._lifeline_fd is not None
        process = self.processes[engine_id]
        tail = process.output_tail + SPARE_LOG_SUFFIX
        for stale in (tail, tail + ".1"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        env = process.env()
        order_read, order_write = os.pipe()
        report_read, report_write = os.pipe()
        try:
            # Its start order comes on stdin; it says it stands by on the report pipe.
            proc = await process.start_process(
                process.argv(self._lifeline_fd, report_fd=report_write),
                env,
                self._lifeline_fd,
                report_fd=report_write,
                stdin=order_read,
            )
        except BaseException:
            os.close(order_write)
            os.close(report_read)
            raise
        finally:
            os.close(order_read)
            os.close(report_write)
        spare = Spare(engine_id, proc, order_write, env, process.spare_loads)
        self._spares[engine_id] = spare
        self._show(engine_id, "starting")
        log.info("engine %d: starting a warm spare, pid %d", engine_id, proc.pid)
        watcher = asyncio.create_task(self._watch(spare, tail))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        report = await _first_line(report_read, proc, self.start_timeout_s)
        if spare.taken or not spare.alive:
            return
        if report is None:
            log.warning(
                "engine %d: its spare (pid %d) did not stand by within %.0fs; killed",
                engine_id,
                proc.pid,
                self.start_timeout_s,
            )
            await spare.dismiss()
            return
        spare.waiting = True
        # Those of a loaded one's engine, built by now (an importing one maps none).
        spare.note_segments()
        self._show(engine_id, "waiting")
        log.info(
            "engine %d: warm spare pid %d stands by (%s in %.1fs)",
            engine_id,
            proc.pid,
            "its engine built" if spare.loaded else "imported",
            report["warm_up_s"],
        )

    async def _watch(self, spare: Spare, tail: str) -> None:
        """A spare that exits unasked leaves its slot without one until its engine is up again."""
        code = await spare.proc.wait()
        if spare.taken or self._stopping or self._spares.get(spare.engine_id) is not spare:
            return
        spare.kill()  # its end of the order pipe
        del self._spares[spare.engine_id]
        self._show(spare.engine_id, None)
        # Its relay may still be writing its last words.
        await asyncio.sleep(0.2)
        log.warning(
            "engine %d: its spare (pid %d) %s; the engine's next restart starts cold; its last output:\n%s",
            spare.engine_id,
            spare.proc.pid,
            how_it_exited(code),
            read_tail(tail),
        )


async def _first_line(fd: int, proc: asyncio.subprocess.Process | ForkedProcess, timeout_s: float) -> dict | None:
    """The spare's report (one JSON line on ``fd``, which this closes); None if it exits, or
    says nothing within ``timeout_s``."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    pipe = os.fdopen(fd, "rb", buffering=0)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    line_task = asyncio.ensure_future(reader.readline())
    exit_task = asyncio.ensure_future(proc.wait())
    try:
        done, _ = await asyncio.wait({line_task, exit_task}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if line_task not in done:
            return None
        with contextlib.suppress(ValueError):
            report = json.loads(line_task.result())
            if isinstance(report, dict) and report.get("standing_by"):
                return report
        return None
    finally:
        for task in (line_task, exit_task):
            task.cancel()
        transport.close()
