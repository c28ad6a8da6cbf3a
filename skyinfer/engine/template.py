"""An engine template: a process that imports what an engine needs once, then forks engines.

A cold engine process spends most of its start importing Python's, torch's and vLLM's modules
(about 13 of an engine's 16 CPU-seconds on CPU; ``docs/benchmarks-journal.rst``). On CPU engines the front
(``skyinfer/fleet/engine_templates.py``) starts a template instead: ``python -m skyinfer.engine.template
--channel-fd N --lifeline-fd L``, with the engines' environment. It imports as a spare does
(``import_engine``), says ``{"ready": true, "env": {...}}`` on its channel, and then serves *fork
orders*: one message each on the channel (a ``SOCK_SEQPACKET`` socket), ``{"order": n, "argv":
[...], "env": {...}, "fds": [...], "stdin": bool, "cwd": "...", "cpus": [...]}`` with file
descriptors attached (``SCM_RIGHTS``): first the read end of the front's *go-ahead* pipe, then
those the new process must hold, in the order ``fds`` names their numbers (the front's stdout and
stderr among them), the stdin's last when ``stdin`` is true.

For each order it forks a child, which waits for the front's go-ahead: one byte on that pipe, which
the front writes once it has the child's pid (end of file instead: the front gave up on the order,
or is gone, and the child exits before it does anything). It then starts a session of its own (its
pid is its process group, as a cold engine's), puts the passed descriptors at their numbers, takes
the order's environment, working directory and cores (the front's), and becomes ``python -m
skyinfer.engine`` with the order's arguments: everything an engine or a spare does from there is
what it does when spawned.
The template answers ``{"order": n, "pid": p}``, reaps its children and reports each exit,
``{"pid": p, "code": c}`` (a negative code is the signal that ended it, as asyncio's). It exits
when the front's lifeline ends or its channel closes; its children live on (their lifelines are
their own).

Templates shared by the servers of one machine (``--engine-template-socket``; the test suite's
servers share them): ``python -m skyinfer.engine.template --listen PATH --lifeline-fd L`` starts a
*host*, which imports nothing. Each front connects (only a process of the host's own user is
answered; the front checks the same of the host) and says ``{"env": {...}}``, its engines'
environment; the host answers ``{"importing": bool}`` and hands the connection (a ``SOCK_SEQPACKET``
one: the front's channel, as above) to the template of that environment, all but
``VARIES_PER_ENGINE``, forking one (its child, which takes that environment and imports) the first
time. ``importing`` is true until the template has said on its socket to the host that its imports
are done: a front waits that long for its answer, else the probe timeout. A front whose
``PYTHON*`` variables (read when an interpreter starts) are not the host's is not served. The
template answers the front ``{"ready": true, "env": {...}}`` and serves its orders;
exits are reported on the channel of the front that ordered the fork, and a front that goes
leaves the others served. Host and templates exit when the host's lifeline (its starter's) ends.

Why the environment matters: libgomp reads ``OMP_*`` when torch loads it, in the template, so the
front keeps one template per engine environment, apart from the variables read only when the
engine is built (``VARIES_PER_ENGINE``). A fork copies only the thread that forks: the child
starts with none of the threads torch's import started in the template (blocked in calls that
hold nothing the engine uses, as in a spare), and starts its own.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import shlex
import signal
import socket
import struct
import sys
import traceback
from dataclasses import dataclass

from .output import keep_title, name_process

# Read when vLLM's worker starts (the cores an engine's worker threads bind to), not at import:
# the one variable that may differ between the engines that a template forks.
VARIES_PER_ENGINE = frozenset({"VLLM_CPU_OMP_THREADS_BIND"})

# A fork order with its descriptors fits in far less.
MAX_MESSAGE = 1 << 20
MAX_FDS = 8
# How long a front that connected has to say its engines' environment.
_HELLO_TIMEOUT_S = 10.0
# Where passed descriptors wait in the child before they go to their numbers: above any of those.
_PARKING = 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m skyinfer.engine.template")
    channel_or_socket = parser.add_mutually_exclusive_group(required=True)
    channel_or_socket.add_argument("--channel-fd", type=int, help="the front's SOCK_SEQPACKET socket")
    channel_or_socket.add_argument("--listen", metavar="PATH", help="host templates for the fronts that connect here")
    parser.add_argument("--lifeline-fd", type=int, required=True, help="read end of its starter's lifeline pipe")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if ns.listen is None:
        _Template(ns.lifeline_fd, channel=socket.socket(fileno=ns.channel_fd)).serve()
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(ns.listen)
    listener.listen(16)
    try:
        _Host(listener, ns.lifeline_fd).serve()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(ns.listen)


def environment_key(env) -> tuple:
    """What of an engine's environment its template must share: all but ``VARIES_PER_ENGINE``."""
    return tuple(sorted((name, value) for name, value in env.items() if name not in VARIES_PER_ENGINE))


def peer_uid(channel: socket.socket) -> int:
    """The user of the process at the other end of a Unix socket (for a connected client, of the
    process that listened)."""
    _, uid, _ = struct.unpack("3i", channel.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def _wake_on_children() -> tuple[int, int]:
    """SIGCHLD wakes a loop through the pipe returned (read end first); the handler does nothing."""
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return wake_read, wake_write


def _drain(fd: int) -> None:
    with contextlib.suppress(BlockingIOError):
        os.read(fd, 4096)


def _reaped() -> list[tuple[int, int]]:
    """The children that ended, with their codes (negative: the signal, as asyncio's)."""
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, os.waitstatus_to_exitcode(status)))


class _Template:
    """Its channels (its front's, or those its host hands it), its children, its loop."""

    def __init__(self, lifeline_fd: int, channel: socket.socket | None = None, handoff: socket.socket | None = None):
        self.lifeline_fd = lifeline_fd
        # Given the front's channel: it ends with it. Else the host's socket, which hands channels over.
        self.handoff = handoff
        self.selector = selectors.DefaultSelector()
        self.channels: list[socket.socket] = []
        # Whose fork each running child was: its exit is reported there.
        self.children: dict[int, socket.socket] = {}
        if channel is not None:
            self._add(channel)
        self.env = dict(os.environ)  # before the imports, which may set variables of their own
        from .__main__ import import_engine

        import_engine()
        for channel in self.channels:
            _send(channel, {"ready": True, "env": self.env})
        if handoff is not None:
            _send(handoff, {"imported": True})  # the host tells the fronts that connect from now on

    def _add(self, channel: socket.socket) -> None:
        self.channels.append(channel)
        self.selector.register(channel, selectors.EVENT_READ, channel)

    def _drop(self, channel: socket.socket) -> None:
        self.selector.unregister(channel)
        self.channels.remove(channel)
        channel.close()

    def serve(self) -> None:
        self.wake = _wake_on_children()
        self.selector.register(self.lifeline_fd, selectors.EVENT_READ, "lifeline")
        self.selector.register(self.wake[0], selectors.EVENT_READ, "child")
        if self.handoff is not None:
            self.selector.register(self.handoff, selectors.EVENT_READ, "handoff")
        while True:
            for key, _ in self.selector.select():
                if key.data == "child":
                    _drain(self.wake[0])
                    self._report_exits()
                elif key.data == "lifeline":
                    if not os.read(self.lifeline_fd, 1):
                        return  # its starter is gone
                elif key.data == "handoff":
                    if not self._handed_over():
                        return  # its host is gone
                elif not self._order(key.data) and self.handoff is None:
                    return  # its one front closed the channel

    def _handed_over(self) -> bool:
        """A front's channel from the host; False once the host is gone."""
        try:
            _, fds, _, _ = socket.recv_fds(self.handoff, 16, 1)
        except OSError:
            return False
        if not fds:
            return False
        channel = socket.socket(fileno=fds[0])
        self._add(channel)
        _send(channel, {"ready": True, "env": self.env})
        return True

    def _order(self, channel: socket.socket) -> bool:
        """Serve one fork order from ``channel``; False once it closed."""
        try:
            data, fds, _, _ = socket.recv_fds(channel, MAX_MESSAGE, MAX_FDS)
        except OSError:
            data, fds = b"", []
        if not data:
            self._drop(channel)
            return False
        mine = (*self.channels, *(() if self.handoff is None else (self.handoff,)))
        pid = _fork(channel, json.loads(data), fds, self.selector, (*mine, self.lifeline_fd, *self.wake))
        self.children[pid] = channel
        return True

    def _report_exits(self) -> None:
        for pid, code in _reaped():
            channel = self.children.pop(pid, None)
            if channel is not None and channel in self.channels:
                _send(channel, {"pid": pid, "code": code})


@dataclass
class _Hosted:
    """A template the host started: its pid, the socket that hands it channels (where it says
    that its imports are done), and whether it said so."""

    pid: int
    handoff: socket.socket
    imported: bool = False

    def importing(self) -> bool:
        if not self.imported:
            with contextlib.suppress(OSError):  # BlockingIOError: not yet
                self.imported = bool(self.handoff.recv(MAX_MESSAGE, socket.MSG_DONTWAIT))
        return not self.imported


class _Host:
    """The templates of one machine's servers, one per engine environment, and the socket they
    connect to; it imports nothing itself."""

    def __init__(self, listener: socket.socket, lifeline_fd: int):
        self.listener = listener
        self.lifeline_fd = lifeline_fd
        # Engine environment -> its template.
        self.templates: dict[tuple, _Hosted] = {}

    def serve(self) -> None:
        keep_title()  # before a template replaces its environment: for its children's titles
        wake = _wake_on_children()
        selector = selectors.DefaultSelector()
        selector.register(self.listener, selectors.EVENT_READ, "front")
        selector.register(self.lifeline_fd, selectors.EVENT_READ, "lifeline")
        selector.register(wake[0], selectors.EVENT_READ, "child")
        while True:
            for key, _ in selector.select():
                if key.data == "child":
                    _drain(wake[0])
                    ended = {pid for pid, _ in _reaped()}
                    for env_key, hosted in list(self.templates.items()):
                        if hosted.pid in ended:
                            hosted.handoff.close()
                            del self.templates[env_key]
                elif key.data == "lifeline":
                    if not os.read(self.lifeline_fd, 1):
                        return  # its starter is gone (its templates see the same lifeline end)
                else:
                    self._connected(selector, wake)

    def _connected(self, selector, wake: tuple[int, int]) -> None:
        channel, _ = self.listener.accept()
        with channel:
            if peer_uid(channel) != os.getuid():
                return  # another user's process: a fork order is any engine command line
            channel.settimeout(_HELLO_TIMEOUT_S)
            try:
                env = json.loads(channel.recv(MAX_MESSAGE))["env"]
            except (OSError, ValueError, KeyError, TypeError):
                return
            if _read_at_start(env) != _read_at_start(os.environ):
                return  # an interpreter started in another environment than these engines'
            env_key = environment_key(env)
            if env_key not in self.templates:
                self.templates[env_key] = self._start(env, selector, wake, channel)
            hosted = self.templates[env_key]
            # Before its template's answer: how long the front is to wait for it.
            _send(channel, {"importing": hosted.importing()})
            with contextlib.suppress(OSError):  # a template that just died: the front sees the channel close
                socket.send_fds(hosted.handoff, [b"c"], [channel.fileno()])

    def _start(self, env: dict, selector, wake: tuple[int, int], channel: socket.socket) -> _Hosted:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                selector.close()
                # The host's own, and the front's connection: the template gets it handed over, so
                # that it closes when the template ends (an engine forked later holds no copy).
                for item in (self.listener, ours, channel, *(hosted.handoff for hosted in self.templates.values())):
                    item.close()
                signal.set_wakeup_fd(-1)
                for fd in wake:
                    os.close(fd)
                os.environ.clear()
                os.environ.update(env)
                _Template(self.lifeline_fd, handoff=theirs).serve()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        theirs.close()
        return _Hosted(pid, ours)


def _read_at_start(env) -> dict[str, str]:
    """What Python reads of the environment when its interpreter starts (buffering, paths)."""
    return {name: value for name, value in env.items() if name.startswith("PYTHON")}


def _send(channel: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):  # a front that is gone reads nothing more
        channel.send(json.dumps(message).encode())


def _fork(channel: socket.socket, order: dict, fds: list[int], selector, keep: tuple) -> int:
    # The first descriptor is the front's go-ahead pipe: the child goes on only once the front has
    # its pid. End of file instead (the front gave up on the order, or is gone; or this template
    # died before it answered, and the front's order failed) ends it at once: no engine runs that
    # the front does not supervise, however late this template serves the order.
    go, passed = fds[0], fds[1:]
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if not os.read(go, 1):
                os._exit(0)
            os.close(go)
            selector.close()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            _take_descriptors(order, passed, keep)
            os.chdir(order["cwd"])
            os.sched_setaffinity(0, order["cpus"])
            # What ps shows: the engine's own command line (quoted as a shell would), not the
            # template's. Before the environment is cleared: setproctitle finds its room next to it.
            name_process(shlex.join([sys.executable, "-m", "skyinfer.engine", *order["argv"]]))
            os.environ.clear()
            os.environ.update(order["env"])
            sys.argv = ["python -m skyinfer.engine", *order["argv"]]
            from .__main__ import main as engine_main

            engine_main(order["argv"])
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    for fd in fds:
        os.close(fd)
    _send(channel, {"order": order["order"], "pid": pid})
    return pid


def _take_descriptors(order: dict, fds: list[int], keep: tuple) -> None:
    """In the child: the passed descriptors at the numbers the order names, stdin from the order
    (or /dev/null); the template's own closed."""
    parked = [os.dup2(fd, _PARKING + i, inheritable=False) for i, fd in enumerate(fds)]
    for fd in fds:
        os.close(fd)
    for item in keep:
        with contextlib.suppress(OSError):
            os.close(item if isinstance(item, int) else item.detach())
    stdin = parked.pop() if order.get("stdin") else os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    for number, fd in zip(order["fds"], parked, strict=True):
        os.dup2(fd, number)
        os.close(fd)


if __name__ == "__main__":
    main()
