"""Engine templates, the front's side: CPU engines (and their spares) forked from a process that
imported torch and vLLM once, instead of started cold (``engine/template.py`` is the template's
side and says why).

* One template per engine environment, apart from what differs between engines and is read only
  when the engine is built (``VARIES_PER_ENGINE``): a fleet of equal engines has one. It starts
  when the first engine of that environment does, with the engines' lifeline (it dies with the
  front, as they do), in a session of its own.
* A forked process is the engine's process as a spawned one is (its own session and process
  group, its lifeline, its output relay); the supervisor sees it through ``ForkedProcess``, which
  answers what it asks of an asyncio process. Its exit code comes from the template, its parent;
  its end from a pidfd, which does not need the template: a template that died leaves its engines
  serving, and their ends still seen (their codes then unknown: ``UNKNOWN_EXIT``). Signals go
  through that pidfd too (its process group's as well, from Linux 6.9; before, by the group's
  number), not by the pid, which the template reaps (and the system may give another process)
  before the front learns the code.
* A forked process goes on only once the front has its pid (its go-ahead, ``engine/template.py``):
  a fork order the front gave up on (a template that answered late) starts no engine beside the
  one the front then starts cold.
* The templates of a machine's servers (``--engine-template-socket``: a host that starts one per
  engine environment) are connected to instead, if the host is of the front's own user (the front
  sends it its engines' environment, keys and tokens among it); where they cannot be reached, the
  front starts its own. The front never kills a shared one; its engines are the front's as any other.
* A template that cannot fork (it died, never came up, or does not answer within the front's
  probe timeout: hung) is dropped: that start is cold, and the next one of its environment starts
  a new template. A shared one whose host says it is done importing has the probe timeout to say
  it is ready, too. Templates are never the reason an engine does not start.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import sys
import weakref
from collections.abc import Mapping, Sequence

from ..engine.template import MAX_FDS, MAX_MESSAGE, environment_key, peer_uid

__all__ = ["UNKNOWN_EXIT", "EngineTemplates", "ForkedProcess", "how_it_exited", "kill_group"]

log = logging.getLogger("skyinfer.supervisor")

# The exit code of a forked process whose template died before it: nobody reaped it for us.
UNKNOWN_EXIT = -255


def how_it_exited(code: int | None) -> str:
    """For the logs: "exited with code -9", or the code unknown."""
    if code == UNKNOWN_EXIT:
        return "exited with an unknown code (its engine template is gone)"
    return f"exited with code {code}"


# How long a forked process's end waits for its template's word on its code.
_CODE_WAIT_S = 2.0
# pidfd_send_signal's flag (Linux 6.9): to the process group of the pidfd's process, the group
# whose id is the pid the pidfd holds, even once that process is gone; never one that took the
# same number since.
_PIDFD_SIGNAL_PROCESS_GROUP = 1 << 2


class ForkedProcess:
    """A process a template forked: ``pid``, ``returncode`` (None while it runs), ``wait()`` and
    ``send_signal()``, as an ``asyncio.subprocess.Process``."""

    def __init__(self, pid: int):
        self.pid = pid
        # Opened while the process waits for its go-ahead (it has not ended, unless something
        # killed it meanwhile): the process itself, whoever gets its pid once its template reaped it.
        self._pidfd = os.pidfd_open(pid)
        weakref.finalize(self, os.close, self._pidfd)
        self.returncode: int | None = None
        self._code: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._ended = asyncio.Event()
        self._watch = asyncio.create_task(self._watch_end())

    def exited_with(self, code: int) -> None:
        """Its template reaped it."""
        if not self._code.done():
            self._code.set_result(code)

    async def _watch_end(self) -> None:
        loop = asyncio.get_running_loop()
        gone = loop.create_future()
        loop.add_reader(self._pidfd, lambda: gone.done() or gone.set_result(None))
        try:
            await gone
        finally:
            loop.remove_reader(self._pidfd)
        try:
            self.returncode = await asyncio.wait_for(asyncio.shield(self._code), _CODE_WAIT_S)
        except asyncio.TimeoutError:
            self.returncode = UNKNOWN_EXIT
        self._ended.set()

    async def wait(self) -> int:
        await self._ended.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """ProcessLookupError if it ended before its code came; nothing once ``returncode`` is set."""
        if self.returncode is None:
            signal.pidfd_send_signal(self._pidfd, sig)

    def kill_group(self) -> None:
        """SIGKILL it, and its process group: what is left of it after it ended too."""
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)  # it may not lead its group yet
        try:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL, None, _PIDFD_SIGNAL_PROCESS_GROUP)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            os.killpg(self.pid, signal.SIGKILL)  # a kernel before 6.9: by its number


def kill_group(proc: asyncio.subprocess.Process | ForkedProcess) -> None:
    """SIGKILL the process group that ``proc`` leads (an engine's or a spare's: vLLM's processes
    with it), if any of it is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if isinstance(proc, ForkedProcess):
            proc.kill_group()
        else:
            os.killpg(proc.pid, signal.SIGKILL)


class _Template:
    """One template process and its channel."""

    def __init__(self, proc: asyncio.subprocess.Process | None, channel: socket.socket, answer_timeout_s: float):
        # None: a shared template's, not the front's to kill.
        self.proc = proc
        self.answer_timeout_s = answer_timeout_s
        self.channel = channel
        self.ready = asyncio.get_running_loop().create_future()
        self._orders: dict[int, asyncio.Future[int]] = {}
        self._next_order = 0
        self._forked: dict[int, ForkedProcess] = {}
        # Exits reported before the fork's answer was read: the pid is the order's.
        self._early_exits: dict[int, int] = {}
        self.closed = False
        # A shared one's host answers at once, and its template too unless the host says that it is
        # still importing: until then, its ready is due within the probe timeout (else it is hung).
        self._hang_check = (
            None
            if proc is not None
            else asyncio.get_running_loop().call_later(answer_timeout_s, self._no_answer, answer_timeout_s)
        )
        asyncio.get_running_loop().add_reader(channel.fileno(), self._read)

    def _no_answer(self, timeout_s: float) -> None:
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"did not answer within {timeout_s:g}s"))

    def _read(self) -> None:
        try:
            data = self.channel.recv(MAX_MESSAGE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close()
            return
        message = json.loads(data)
        if message.get("importing") and self._hang_check is not None:
            self._hang_check.cancel()  # its imports take what a start may take
        elif message.get("ready"):
            self.ready.done() or self.ready.set_result(message.get("env"))
        elif "order" in message:
            future = self._orders.pop(message["order"], None)
            if future is not None and not future.done():
                future.set_result(message["pid"])
        elif "code" in message:
            forked = self._forked.pop(message["pid"], None)
            if forked is not None:
                forked.exited_with(message["code"])
            else:
                self._early_exits[message["pid"]] = message["code"]

    async def fork(
        self, argv: Sequence[str], env: Mapping[str, str], fds: Sequence[int], stdin: int | None
    ) -> ForkedProcess:
        order = self._next_order
        self._next_order += 1
        # Where it runs and on which cores, the front's (a shared template's may differ).
        message = {
            "order": order,
            "argv": list(argv),
            "env": dict(env),
            "fds": list(fds),
            "stdin": stdin is not None,
            "cwd": os.getcwd(),
            "cpus": sorted(os.sched_getaffinity(0)),
        }
        # The child's go-ahead, written once its pid is here; closed unwritten if it is not.
        go_read, go_write = os.pipe()
        passed = [go_read, *fds, *(() if stdin is None else (stdin,))]
        assert len(passed) <= MAX_FDS
        answer = self._orders[order] = asyncio.get_running_loop().create_future()
        try:
            try:
                # A small message into an empty socket buffer: it does not block.
                socket.send_fds(self.channel, [json.dumps(message).encode()], passed)
            finally:
                os.close(go_read)
            # A fork takes milliseconds: a template that does not answer is hung, and dropped.
            pid = await asyncio.wait_for(answer, self.answer_timeout_s)
            forked = self._adopt(pid)
            os.write(go_write, b"1")  # one byte into an empty pipe: it does not block
        finally:
            os.close(go_write)
            # An order not sent, or not answered in time, waits for nothing more (a late answer
            # finds no order and is dropped; its child gets no go-ahead).
            self._orders.pop(order, None)
        return forked

    def _adopt(self, pid: int) -> ForkedProcess:
        forked = ForkedProcess(pid)
        if pid in self._early_exits:
            forked.exited_with(self._early_exits.pop(pid))
        else:
            self._forked[pid] = forked
        return forked

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._hang_check is not None:
            self._hang_check.cancel()
        # Their codes can no longer come: what ends from now on ends with an unknown one.
        for forked in self._forked.values():
            forked.exited_with(UNKNOWN_EXIT)
        self._forked.clear()
        asyncio.get_running_loop().remove_reader(self.channel.fileno())
        self.channel.close()
        for future in (self.ready, *self._orders.values()):
            if not future.done():
                future.set_exception(ConnectionError("the engine template is gone"))
        self._orders.clear()

    @property
    def alive(self) -> bool:
        return not self.closed and (self.proc is None or self.proc.returncode is None)

    def kill(self) -> None:
        self.close()
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


class EngineTemplates:
    """The front's templates, by engine environment."""

    def __init__(self, start_timeout_s: float, answer_timeout_s: float, shared_socket: str | None = None):
        # How long a template may take to import; how long to answer a fork order.
        self.start_timeout_s = start_timeout_s
        self.answer_timeout_s = answer_timeout_s
        self.shared_socket = shared_socket
        # The environments the shared template is not of: their own templates, always.
        self._not_shared: set[tuple] = set()
        self._templates: dict[tuple, _Template] = {}
        self._starting: dict[tuple, asyncio.Task] = {}

    async def fork(
        self, argv: Sequence[str], env: Mapping[str, str], lifeline_fd: int, fds: Sequence[int], stdin: int | None
    ) -> ForkedProcess | None:
        """Fork ``python -m skyinfer.engine <argv>`` from the template of ``env``, holding ``fds``
        at their numbers (and ``stdin``); None if no template could (the caller starts it cold)."""
        key = environment_key(env)
        try:
            template = await self._template(key, env, lifeline_fd)
            # Its output the front's, as a cold engine's (a shared template's is not).
            return await template.fork(argv, env, (*fds, 1, 2), stdin)
        except (OSError, ConnectionError, asyncio.TimeoutError) as error:
            log.warning("engine template: cannot fork (%s); this engine starts cold", error)
            self._drop(key)
            return None

    async def _template(self, key: tuple, env: Mapping[str, str], lifeline_fd: int) -> _Template:
        template = self._templates.get(key)
        if template is not None and template.alive:
            return template
        self._drop(key)
        # Engines that start together wait for the same template.
        if key not in self._starting:
            self._starting[key] = asyncio.create_task(self._shared_or_own(key, env, lifeline_fd))
        try:
            template = await asyncio.shield(self._starting[key])
        finally:
            self._starting.pop(key, None)
        self._templates[key] = template
        return template

    async def _shared_or_own(self, key: tuple, env: Mapping[str, str], lifeline_fd: int) -> _Template:
        if self.shared_socket is not None and key not in self._not_shared:
            try:
                return await self._connect(key, env)
            except (OSError, ConnectionError, asyncio.TimeoutError) as error:
                self._not_shared.add(key)
                log.warning(
                    "engine template: the shared one at %s %s; this server starts its own", self.shared_socket, error
                )
        return await self._start(env, lifeline_fd)

    async def _connect(self, key: tuple, env: Mapping[str, str]) -> _Template:
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        channel.setblocking(False)
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().sock_connect(channel, self.shared_socket), self.answer_timeout_s
            )
            # What it is sent (the engines' environment: keys, tokens) and its children's output
            # are for the front's user alone, as a host answers that user's fronts alone.
            if (uid := peer_uid(channel)) != os.getuid():
                raise ConnectionError(f"is another user's (uid {uid}): it is not sent these engines' environment")
            await asyncio.get_running_loop().sock_sendall(channel, json.dumps({"env": dict(env)}).encode())
        except BaseException:
            channel.close()
            raise
        template = _Template(None, channel, self.answer_timeout_s)
        try:
            # The first server to connect waits for the imports, the others for an answer.
            theirs = await asyncio.wait_for(asyncio.shield(template.ready), self.start_timeout_s)
        except BaseException:
            template.kill()
            raise
        differ = sorted(dict(environment_key(theirs or {})).items() ^ set(key))
        if differ:
            template.kill()
            names = ", ".join(sorted({name for name, _ in differ}))
            raise ConnectionError(f"is of another environment than these engines ({names} differ)")
        log.info("engine template: engines of this environment fork from the shared one at %s", self.shared_socket)
        return template

    async def _start(self, env: Mapping[str, str], lifeline_fd: int) -> _Template:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "skyinfer.engine.template",
                "--channel-fd",
                str(theirs.fileno()),
                "--lifeline-fd",
                str(lifeline_fd),
                env=dict(env),
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=(theirs.fileno(), lifeline_fd),
            )
        finally:
            theirs.close()
        ours.setblocking(False)
        template = _Template(proc, ours, self.answer_timeout_s)
        try:
            await asyncio.wait_for(asyncio.shield(template.ready), self.start_timeout_s)
        except BaseException:
            template.kill()
            raise
        log.info("engine template: pid %d ready, engines of its environment fork from it", proc.pid)
        return template

    def _drop(self, key: tuple) -> None:
        template = self._templates.pop(key, None)
        if template is not None:
            template.kill()
            if template.proc is None:
                # Not asked again: a template that failed once may hang next time.
                self._not_shared.add(key)
                log.warning(
                    "engine template: the shared one at %s failed; this server starts its own", self.shared_socket
                )

    async def stop(self) -> None:
        """Kill every template of the front's own and close the channels to shared ones, which the
        front never kills (their engines are the supervisor's to stop)."""
        for task in self._starting.values():
            task.cancel()
        templates, self._templates = list(self._templates.values()), {}
        for template in templates:
            template.kill()
        for template in templates:
            if template.proc is not None:
                await template.proc.wait()
