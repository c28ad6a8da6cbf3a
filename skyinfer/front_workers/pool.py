"""The control process's front workers: started on the port's socket, replaced when one dies.

The control process binds the port once and every worker accepts on that socket (the kernel
hands each new connection to one of them), as vLLM's API-server processes share theirs. A worker
that dies is started again after a second; the leases it held were released when its channel
closed. Workers log by themselves (their output is the service's).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

import attrs
import orjson
from aiohttp import web

from ..config import ServeConfig
from .worker import WorkerSettings

log = logging.getLogger("skyinfer.front_workers")

RESTART_DELAY_S = 1.0


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Thousands of rollout clients may connect at once.
    return socket.create_server((host, port), family=family, backlog=4096)


class FrontWorkers:
    """The control process's workers (``--front-workers N``)."""

    def __init__(self, config: ServeConfig, control_socket: str, leases_socket: str):
        self.count = config.front_workers
        self.control_socket = control_socket
        self.leases_socket = leases_socket
        self._settings = orjson.dumps(
            attrs.asdict(
                WorkerSettings(
                    api_key=config.api_key,
                    admin_key=config.admin_key,
                    group_prefix_chars=config.group_prefix_chars,
                    hold_requests_s=config.hold_requests_s,
                    max_request_bytes=config.max_request_bytes,
                    drain_s=config.shutdown_budget_s[0],
                )
            )
        )
        self._listening: socket.socket | None = None
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self._watchers: set[asyncio.Task] = set()
        self._stopping = False

    async def start(self, listening: socket.socket) -> None:
        self._listening = listening
        for index in range(self.count):
            await self._spawn(index)

    async def _spawn(self, index: int) -> None:
        fd = self._listening.fileno()
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "skyinfer.front_workers.worker",
            "--index",
            str(index),
            "--listen-fd",
            str(fd),
            "--control-socket",
            self.control_socket,
            "--leases-socket",
            self.leases_socket,
            stdin=asyncio.subprocess.PIPE,
            pass_fds=(fd,),
        )
        # Keys go on stdin, not the command line another user's ps would show.
        process.stdin.write(self._settings)
        process.stdin.close()
        self.processes[index] = process
        watcher = asyncio.ensure_future(self._watch(index, process))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        log.info("front worker %d: pid %d", index, process.pid)

    async def _watch(self, index: int, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        if self._stopping:
            return
        log.error(
            "front worker %d (pid %d) exited with %s; starting another in %.0fs",
            index,
            process.pid,
            code,
            RESTART_DELAY_S,
        )
        await asyncio.sleep(RESTART_DELAY_S)
        if not self._stopping:
            await self._spawn(index)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM: each worker drains its requests within ``timeout_s``; then SIGKILL. Once: a
        later call (the service's last resort on its way out) finds the workers stopped."""
        if self._stopping:
            return
        self._stopping = True
        # Close this process's copy of the port's socket first: while any process holds it open the
        # kernel keeps completing handshakes into a backlog no one accepts from, and a new client
        # hangs through the whole drain before it is reset. Each worker closes its own copy when
        # SIGTERM stops its site, so from then on a new connection is refused at once.
        if self._listening is not None:
            self._listening.close()
        running = [p for p in self.processes.values() if p.returncode is None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        waits = [asyncio.ensure_future(p.wait()) for p in running]
        if waits:
            _, late = await asyncio.wait(waits, timeout=timeout_s + 2)
            for process in running:
                if process.returncode is None:
                    log.warning("front worker pid %d did not stop in time; killing it", process.pid)
                    process.kill()
            if late:
                await asyncio.wait(late)
        for watcher in list(self._watchers):
            watcher.cancel()


FRONT_WORKERS = web.AppKey("front_workers", FrontWorkers)
