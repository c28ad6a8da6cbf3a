"""An engine template: a process that imports what an engine needs once, then forks engines.

A cold engine process spends most of its start importing Python's, torch's and vLLM's modules
(about 13 of an engine's 16 CPU-seconds on CPU; ``docs/benchmarks.rst``). On CPU engines the front
(``skyinfer/engine_templates.py``) starts a template instead: ``python -m skyinfer.engine.template
--channel-fd N --lifeline-fd L``, with the engines' environment. It imports as a spare does
(``import_engine``), says ``{"ready": true}`` on its channel, and then serves *fork orders*: one
message each on the channel (a ``SOCK_SEQPACKET`` socket), ``{"order": n, "argv": [...], "env":
{...}, "fds": [...], "stdin": bool}`` with the file descriptors the new process must hold attached
(``SCM_RIGHTS``), in the order ``fds`` names their numbers, the stdin's last when ``stdin`` is true.

For each order it forks a child that starts a session of its own (its pid is its process group,
as a cold engine's), puts the passed descriptors at their numbers, takes the order's environment
and becomes ``python -m skyinfer.engine`` with the order's arguments: everything an engine or a
spare does from there is what it does when spawned. The template answers ``{"order": n, "pid":
p}``, reaps its children and reports each exit, ``{"pid": p, "code": c}`` (a negative code is the
signal that ended it, as asyncio's). It exits when the front's lifeline ends or its channel closes;
its children live on (their lifelines are their own).

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
import sys
import traceback

from .output import name_process

# Read when vLLM's worker starts (the cores an engine's worker threads bind to), not at import:
# the one variable that may differ between the engines that a template forks.
VARIES_PER_ENGINE = frozenset({"VLLM_CPU_OMP_THREADS_BIND"})

# A fork order with its descriptors fits in far less.
MAX_MESSAGE = 1 << 20
MAX_FDS = 8
# Where passed descriptors wait in the child before they go to their numbers: above any of those.
_PARKING = 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m skyinfer.engine.template")
    parser.add_argument("--channel-fd", type=int, required=True, help="the front's SOCK_SEQPACKET socket")
    parser.add_argument("--lifeline-fd", type=int, required=True, help="read end of the front's lifeline pipe")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    channel = socket.socket(fileno=ns.channel_fd)

    from .__main__ import import_engine

    import_engine()
    # SIGCHLD wakes the loop below through a pipe; the handler itself does nothing.
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _send(channel, {"ready": True})

    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ, "order")
    selector.register(ns.lifeline_fd, selectors.EVENT_READ, "lifeline")
    selector.register(wake_read, selectors.EVENT_READ, "child")
    keep = (channel, ns.lifeline_fd, wake_read, wake_write)
    while True:
        for key, _ in selector.select():
            if key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_read, 4096)
                _report_exits(channel)
            elif key.data == "lifeline" and not os.read(ns.lifeline_fd, 1):
                return  # the front is gone
            elif key.data == "order":
                try:
                    data, fds, _, _ = socket.recv_fds(channel, MAX_MESSAGE, MAX_FDS)
                except OSError:
                    return
                if not data:
                    return  # the front closed the channel
                _fork(channel, json.loads(data), fds, selector, keep)


def _send(channel: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):  # a front that is gone reads nothing more
        channel.send(json.dumps(message).encode())


def _report_exits(channel: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(channel, {"pid": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(channel: socket.socket, order: dict, fds: list[int], selector, keep: tuple) -> None:
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
