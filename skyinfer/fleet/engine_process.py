"""One engine child process: its command line and environment, its start (cold, or by the slot's
warm spare), its readiness and its stop. The supervisor owns these; the spares start from their command line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from typing import Protocol

import aiohttp

from ..config import COLOCATED_GPU_MEMORY_UTILIZATION, ENGINE_COMMAND, ServeConfig
from ..devices import platform_engine_args
from ..engine.output import read_tail
from ..engine_wire import EXTENSION_PATH, STACKS_SIGNAL, STAGED_SWAP_ENV
from ..transfer import transport_for
from .engine_calls import unix_client
from .engine_templates import EngineTemplates, ForkedProcess, how_it_exited, kill_group
from .shm_leftovers import mapped_segments, remove_segments
from .state import EngineRecord

__all__ = ["EngineProcess", "EngineStartError", "WarmSpare"]

# Its lines are the supervisor's, as they always were (the log names the supervisor).
log = logging.getLogger("skyinfer.supervisor")

START_PROGRESS_EVERY_S = 10.0


class EngineStartError(RuntimeError):
    """An engine process did not come up: it exited, or did not answer in time."""


class WarmSpare(Protocol):
    """What ``EngineProcess.spawn`` asks of the slot's warm spare (``spares.Spare``, which starts
    from an ``EngineProcess``'s command line: this module does not import it)."""

    proc: asyncio.subprocess.Process | ForkedProcess
    # Its imports are done (a loaded spare's engine is built): it stands by.
    waiting: bool
    # It builds the whole engine before it stands by.
    loaded: bool

    def take_over(self, env: dict[str, str]) -> bool: ...

    def kill(self) -> None: ...


class EngineProcess:
    """One engine child process, in its own process group so that stopping it
    also stops vLLM's EngineCore and worker processes beneath it."""

    def __init__(self, record: EngineRecord, config: ServeConfig, templates: EngineTemplates):
        self.record = record
        self.config = config
        # Where its processes fork from, when they may (``forks``).
        self.templates = templates
        self.proc: asyncio.subprocess.Process | ForkedProcess | None = None
        # The end of the engine's output, which the engine keeps itself (engine/output.py).
        self.output_tail = os.path.splitext(record.socket_path)[0] + ".log"
        # For the restart backoff: consecutive crashes, and when it last became ready (0: not up since).
        self.crashes = 0
        self.ready_since = 0.0
        # vLLM's segments in /dev/shm that its processes map: removed once they are gone (shm_leftovers.py).
        self.shm_segments: set[str] = set()

    @property
    def spare_loads(self) -> bool:
        """Whether its spares build the whole engine before they wait (``--loaded-spares``)."""
        setting = self.config.loaded_spares
        return setting == "on" or (setting == "auto" and self.record.devices.kind == "cpu")

    @property
    def forks(self) -> bool:
        """Whether its processes fork from an engine template (``--engine-templates``): skyinfer's
        engine on CPU, where an engine start is mostly imports."""
        return (
            self.config.engine_templates == "auto"
            and self.record.devices.kind == "cpu"
            and self.config.engine_command == ENGINE_COMMAND
        )

    def argv(self, lifeline_fd: int, report_fd: int | None = None) -> list[str]:
        """Its arguments, the engine program's own and vLLM's; with ``report_fd``, a spare's
        (spares.py), which reports there."""
        c = self.config
        # Its own sizes: engines of a fleet may differ (--engine-sizes).
        size = self.record.parallel
        vllm_args = [
            "--model",
            c.model,
            # Imported by vLLM in every worker: registers the gloo weight-transfer backend.
            "--worker-extension-cls",
            EXTENSION_PATH,
            "--tensor-parallel-size",
            str(size.tensor),
            "--pipeline-parallel-size",
            str(size.pipeline),
            "--data-parallel-size",
            str(size.data),
            *platform_engine_args(
                self.record.devices.kind,
                c.engine_args,
                c.colocate,
                COLOCATED_GPU_MEMORY_UTILIZATION,
                transport_for(self.record.devices.kind, c.colocate, c.weight_transport).backend,
            ),
            *c.engine_args,
        ]
        own = [] if report_fd is None else ["--standby", "--report-fd", str(report_fd)]
        if report_fd is not None and self.spare_loads:
            own.append("--loaded")
        own += [
            "--socket",
            self.record.socket_path,
            "--lifeline-fd",
            str(lifeline_fd),
            "--output-tail",
            self.output_tail,
            "--log-prefix",
            f"[engine {self.record.engine_id}] ",
        ]
        if self.record.devices.kind == "cpu":
            own += ["--cpus", ",".join(str(core) for core in self.record.devices.ids)]
        return [*own, "--", *vllm_args]

    def env(self) -> dict[str, str]:
        """The environment it starts with (a spare's start order carries it too)."""
        env = {**os.environ, **self.record.devices.env, "PYTHONUNBUFFERED": "1"}
        if self.config.allow_pickled_ipc:
            # vLLM's ipc backend unpickles ipc_handles_pickled only with it (the operator's opt-in).
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if self.config.staged_swap != "auto":
            env[STAGED_SWAP_ENV] = self.config.staged_swap
        return env

    async def spawn(self, lifeline_fd: int, spare: WarmSpare | None = None) -> None:
        """Start the engine; it dies with whoever holds the write end of ``lifeline_fd``'s pipe.
        With ``spare`` (the slot's, alive): the spare becomes the engine's process, unless it
        cannot (it died meanwhile), when a cold one starts."""
        for stale in (self.record.socket_path, self.output_tail, self.output_tail + ".1"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        env = self.env()
        if spare is not None and not spare.take_over(env):
            spare.kill()  # it could not take the order: dead, or as good as
            spare = None
        if spare is not None:
            self.proc = spare.proc
            self.record.pid = self.proc.pid
            log.info(
                "engine %d: its warm spare, pid %d, takes over on %s%s",
                self.record.engine_id,
                self.proc.pid,
                self.record.devices.describe(),
                ("" if spare.waiting else " (still loading)" if spare.loaded else " (still importing)"),
            )
            return
        self.proc = await self.start_process(self.argv(lifeline_fd), env, lifeline_fd)
        self.record.pid = self.proc.pid
        log.info(
            "engine %d: started pid %d on %s%s",
            self.record.engine_id,
            self.proc.pid,
            self.record.devices.describe(),
            " (forked from its template)" if isinstance(self.proc, ForkedProcess) else "",
        )

    async def start_process(
        self,
        argv: list[str],
        env: dict[str, str],
        lifeline_fd: int,
        *,
        report_fd: int | None = None,
        stdin: int | None = None,
    ) -> asyncio.subprocess.Process | ForkedProcess:
        """Start the engine program with ``argv`` (``argv()``'s: the engine's, or its spare's) and
        ``env``: forked from its template if it ``forks`` and the template can, otherwise cold. It
        holds ``lifeline_fd`` (and ``report_fd``), and ``stdin`` (None: /dev/null). Its output goes
        to the front's stderr, relayed by the engine itself: never through here."""
        fds = (lifeline_fd, *(() if report_fd is None else (report_fd,)))
        if self.forks:
            forked = await self.templates.fork(argv, env, lifeline_fd, fds, stdin)
            if forked is not None:
                return forked
        return await asyncio.create_subprocess_exec(
            *self.config.engine_command,
            *argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL if stdin is None else stdin,
            # A group of its own: stopping it, or its lifeline running out, takes vLLM's processes too.
            start_new_session=True,
            pass_fds=fds,
        )

    @property
    def exited(self) -> bool:
        return self.proc is None or self.proc.returncode is not None

    async def wait_ready(self, timeout_s: float) -> tuple[aiohttp.ClientSession, dict]:
        """Wait until the engine answers on its socket; return a client for it and what it serves."""
        started = time.monotonic()
        next_report = started + START_PROGRESS_EVERY_S
        while True:
            if self.exited:
                # Its relay may still be writing its last words.
                await asyncio.sleep(0.2)
                tail = read_tail(self.output_tail)
                raise EngineStartError(
                    f"engine {self.record.engine_id} {how_it_exited(self.proc.returncode)} "
                    f"during start-up; its last output:\n{tail}"
                )
            if os.path.exists(self.record.socket_path):
                client = unix_client(self.record.socket_path)
                try:
                    async with client.get(
                        "/info", timeout=aiohttp.ClientTimeout(total=self.config.engine_probe_timeout_s)
                    ) as resp:
                        if resp.status == 200:
                            info = await resp.json()
                            self.shm_segments |= mapped_segments(self.proc.pid)
                            log.info("engine %d: up in %.1fs", self.record.engine_id, time.monotonic() - started)
                            return client, info
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass
                await client.close()
            now = time.monotonic()
            if now - started > timeout_s:
                raise EngineStartError(f"engine {self.record.engine_id} not ready after {timeout_s:.0f}s")
            if now >= next_report:
                next_report += START_PROGRESS_EVERY_S
                # vLLM's own start-up lines come through prefixed "[engine i]"; this says who is still waiting.
                log.info("engine %d: still starting (%.0fs)", self.record.engine_id, now - started)
            await asyncio.sleep(0.5)

    async def write_stacks(self, wait_s: float = 0.5) -> None:
        """Have the engine process write its threads' stacks to its output (what a hung one was
        doing), and give it ``wait_s`` to before it is killed."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                self.proc.send_signal(STACKS_SIGNAL)
            await asyncio.sleep(wait_s)

    def kill(self) -> None:
        """SIGKILL the engine's whole process group at once (a hung engine ignores SIGTERM)."""
        if self.proc is not None and self.proc.returncode is None:
            kill_group(self.proc)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM the engine (it shuts vLLM down cleanly), then SIGKILL its whole group."""
        if self.proc is None:
            return
        if self.proc.returncode is None:
            # Those made since it came up too (its group is still its own: its leader is not reaped).
            self.shm_segments |= mapped_segments(self.proc.pid)
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                log.warning("engine %d: no exit %.0fs after SIGTERM; killing", self.record.engine_id, timeout_s)
        # Whatever the engine left behind in its group (EngineCore, workers) goes too.
        kill_group(self.proc)
        await self.proc.wait()
        # Nothing of its group runs again: what vLLM's processes did not unlink goes now.
        segments, self.shm_segments = self.shm_segments, set()
        if removed := remove_segments(segments):
            log.info(
                "engine %d: removed %d segment(s) its processes left in /dev/shm", self.record.engine_id, len(removed)
            )
