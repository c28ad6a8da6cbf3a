"""An engine template: a process that imports what an engine needs once, then forks engines.

A cold engine process spends most of its start importing Python's, torch's and vLLM's modules
(about 13 of an engine's 16 CPU-seconds on CPU; ``docs/benchmarks.rst``). On CPU engines the front
(``skyinfer/engine_templates.py``) starts a template instead: ``python -m skyinfer.engine.template
--channel-fd N --lifeline-fd L``, with the engines' environment. It imports as a spare does
(``import_engine``), says ``{"ready": true, "env": {...}}`` on its channel, and then serves *fork
orders*: one message each on the channel (a ``SOCK_SEQPACKET`` socket), ``{"order": n, "argv":
[...], "env": {...}, "fds": [...], "stdin": bool, "cwd": "...", "cpus": [...]}`` with the file
descriptors the new process must hold attached (``SCM_RIGHTS``), in the order ``fds`` names their
numbers (the front's stdout and stderr among them), the stdin's last when ``stdin`` is true.

For each order it forks a child that starts a session of its own (its pid is its process group,
as a cold engine's), puts the passed descriptors at their numbers, takes the order's environment,
working directory and cores (the front's), and becomes ``python -m skyinfer.engine`` with the
order's arguments: everything an engine or a spare does from there is what it does when spawned.
The template answers ``{"order": n, "pid": p}``, reaps its children and reports each exit,
``{"pid": p, "code": c}`` (a negative code is the signal that ended it, as asyncio's). It exits
when the front's lifeline ends or its channel closes; its children live on (their lifelines are
their own).

A template shared by the servers of one machine (``--engine-template-socket``; the test suite's
servers share one) listens instead: ``python -m skyinfer.engine.template --listen PATH
--lifeline-fd L``. Each front connects (a ``SOCK_SEQPACKET`` connection is its channel, as above;
only a process of the template's own user is answered) and says ``{"env": {...}}``, its engines'
environment. The first front's becomes the template's, before it imports (where the ``PYTHON*``
variables, read when its interpreter started, are the template's own); every front is
answered ``{"ready": true, "env": {...}}`` with it, and forks from the template only where that is
its engines' environment too (a front whose is not starts a template of its own). Exits are
reported on the channel of the front that ordered the fork; a front that goes leaves the others
served. It exits when its lifeline (its starter's) ends.

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
    channel_or_socket.add_argument("--listen", metavar="PATH", help="a Unix socket the fronts connect to")
    parser.add_argument("--lifeline-fd", type=int, required=True, help="read end of its starter's lifeline pipe")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if ns.listen is None:
        _Template(socket.socket(fileno=ns.channel_fd), None, ns.lifeline_fd).serve()
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(ns.listen)
    listener.listen(16)
    try:
        _Template(None, listener, ns.lifeline_fd).serve()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(ns.listen)


class _Template:
    """Its channels (one, or one per front connected to its socket), its children, its loop."""

    def __init__(self, channel: socket.socket | None, listener: socket.socket | None, lifeline_fd: int):
        self.listener = listener
        self.lifeline_fd = lifeline_fd
        self.selector = selectors.DefaultSelector()
        self.channels: list[socket.socket] = []
        # Whose fork each running child was: its exit is reported there.
        self.children: dict[int, socket.socket] = {}
        self.env: dict[str, str] | None = None
        if channel is not None:
            self._add(channel)
            self._import()

    def _add(self, channel: socket.socket) -> None:
        self.channels.append(channel)
        self.selector.register(channel, selectors.EVENT_READ, channel)

    def _drop(self, channel: socket.socket) -> None:
        self.selector.unregister(channel)
        self.channels.remove(channel)
        channel.close()

    def _import(self) -> None:
        """Import what an engine needs, in the engines' environment (what libgomp reads on torch's
        import stays read), and tell every channel so."""
        self.env = dict(os.environ)  # before the imports, which may set variables of their own
        from .__main__ import import_engine

        import_engine()
        for channel in self.channels:
            _send(channel, {"ready": True, "env": self.env})

    def serve(self) -> None:
        # SIGCHLD wakes the loop below through a pipe; the handler itself does nothing.
        self.wake_read, self.wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(self.lifeline_fd, selectors.EVENT_READ, "lifeline")
        self.selector.register(self.wake_read, selectors.EVENT_READ, "child")
        if self.listener is not None:
            self.selector.register(self.listener, selectors.EVENT_READ, "front")
        while True:
            for key, _ in self.selector.select():
                if key.data == "child":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_read, 4096)
                    self._report_exits()
                elif key.data == "lifeline":
                    if not os.read(self.lifeline_fd, 1):
                        return  # its starter is gone
                elif key.data == "front":
                    self._connected()
                elif not self._order(key.data) and self.listener is None:
                    return  # its one front closed the channel

    def _connected(self) -> None:
        channel, _ = self.listener.accept()
        uid = struct.unpack("3i", channel.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
        if uid != os.getuid():
            channel.close()  # another user's process: a fork order is any engine command line
            return
        channel.settimeout(_HELLO_TIMEOUT_S)
        try:
            hello = json.loads(channel.recv(MAX_MESSAGE))
        except (OSError, ValueError):
            channel.close()
            return
        channel.settimeout(None)
        if self.env is None and _read_at_start(hello["env"]) != _read_at_start(os.environ):
            channel.close()  # its interpreter started in another environment than these engines'
            return
        self._add(channel)
        if self.env is None:
            keep_title()  # for its children's titles, their own command lines
            os.environ.clear()
            os.environ.update(hello["env"])
            self._import()
        else:
            _send(channel, {"ready": True, "env": self.env})

    def _order(self, channel: socket.socket) -> bool:
        """Serve one fork order from ``channel``; False once it closed."""
        try:
            data, fds, _, _ = socket.recv_fds(channel, MAX_MESSAGE, MAX_FDS)
        except OSError:
            data, fds = b"", []
        if not data:
            self._drop(channel)
            return False
        keep = (*self.channels, *(() if self.listener is None else (self.listener,)))
        pid = _fork(
            channel, json.loads(data), fds, self.selector, (*keep, self.lifeline_fd, self.wake_read, self.wake_write)
        )
        self.children[pid] = channel
        return True

    def _report_exits(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            channel = self.children.pop(pid, None)
            if channel is not None and channel in self.channels:
                _send(channel, {"pid": pid, "code": os.waitstatus_to_exitcode(status)})


def _read_at_start(env) -> dict[str, str]:
    """What Python reads of the environment when its interpreter starts (buffering, paths)."""
    return {name: value for name, value in env.items() if name.startswith("PYTHON")}


def _send(channel: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):  # a front that is gone reads nothing more
        channel.send(json.dumps(message).encode())


def _fork(channel: socket.socket, order: dict, fds: list[int], selector, keep: tuple) -> int:
    # The child goes on only once the front has its pid: a template that dies in between takes
    # the child with it (end of file on this pipe), so no engine runs that the front does not know.
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(go_write)
            if not os.read(go_read, 1):
                os._exit(0)
            os.close(go_read)
            selector.close()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            _take_descriptors(order, fds, keep)
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
    os.close(go_read)
    for fd in fds:
        os.close(fd)
    _send(channel, {"order": order["order"], "pid": pid})
    os.write(go_write, b"1")
    os.close(go_write)
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
