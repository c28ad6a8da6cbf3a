"""A spare engine process: imported, and waiting for the front's word to become an engine.

A cold engine process pays for Python's, torch's and vLLM's imports before vLLM even starts
loading the model (``docs/benchmarks.rst`` has the figures). So the front keeps one *spare* per engine
(``skyinfer/spares.py``): the engine's own command line with ``--standby`` added, started once
the fleet is ready. The spare

1. relays its output, each line prefixed ``[engine i] (spare)``, keeping the end in a tail file
   of its own (the engine's stays the engine's);
2. ties its life to the front's from the start (``lifeline``): a spare dies with the front, as
   an engine does;
3. imports what the engine will need (``warm_up``), and says so on ``--report-fd`` (one JSON
   line, ``{"standing_by": true, ...}``; the front shows it in ``GET /engines``);
4. blocks reading its *start order* from stdin: one JSON line, ``{"env": {...}, "unset": [...]}``,
   how the environment a cold engine of the slot would be started with now differs from the one
   the spare was started with (the same, unless the front's own changed meanwhile). End of file
   instead: the front let it go, and it exits.

The spare was started with its engine's whole command line (socket, log prefix, lifeline, cores,
vLLM's arguments: none of them changes over the service's life) and environment (the slot's
devices' ``CUDA_VISIBLE_DEVICES``, or ``VLLM_CPU_OMP_THREADS_BIND`` and ``VLLM_CPU_KVCACHE_SPACE``).
Once the order came it applies the order's changes (what torch and vLLM read when the engine is
built, the devices' variables among them, is read after this: neither torch's nor vLLM's import
initialises CUDA; a variable read at import time, vLLM's logging configuration, keeps the value
the spare started with), its stdin becomes ``/dev/null``, and it goes on as a cold engine does
from the start: its output relay (the engine's prefix and tail file), its cores, vLLM's arguments,
the socket. While it waits it runs on its slot's cores already.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable

SPARE_LOG_SUFFIX = ".spare"


def spare_prefix(log_prefix: str) -> str:
    """What a spare writes before each of its lines while it waits: its engine's prefix, marked."""
    return f"{log_prefix}(spare) " if log_prefix else "(spare) "


def stand_by(ns: argparse.Namespace, warm_up: Callable[[], None]) -> None:
    """Wait as a spare until the front's start order; return with its environment applied, the
    lifeline already watched. Exits if the front lets the spare go."""
    # Where a cold engine's output goes (the front's): the engine's relay, forked once the order
    # came, writes there, not through the spare's.
    inherited = (os.dup(1), os.dup(2))
    relay = None
    if ns.output_tail is not None:
        # First, while this process has no other thread: the relay is a fork of it.
        from .output import relay_output

        relay = relay_output(spare_prefix(ns.log_prefix), ns.output_tail + SPARE_LOG_SUFFIX)
    if ns.lifeline_fd is not None:
        from .lifeline import die_with_front

        die_with_front(ns.lifeline_fd)
    if ns.cpus:
        # Its imports compete with its own slot's engine alone, as the engine's processes do.
        os.sched_setaffinity(0, {int(c) for c in ns.cpus.split(",")})
    began = time.monotonic()
    # The output relay forks again once the order came: what it imports is imported now.
    with contextlib.suppress(ImportError):
        import setproctitle  # noqa: F401
    warm_up()
    report = {"standing_by": True, "pid": os.getpid(), "warm_up_s": round(time.monotonic() - began, 2)}
    if ns.report_fd is not None:
        _write_line(ns.report_fd, report)
        os.close(ns.report_fd)
    order = _read_order(0)
    if order is None:
        sys.exit(0)
    for name in order.get("unset", ()):
        os.environ.pop(name, None)
    os.environ.update(order.get("env", {}))
    # As a cold engine's: nothing to read, and its output where the front's goes (the spare's relay,
    # its last writer gone, ends). Its own relay, forked next, holds nothing of the spare's.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, original in zip((1, 2), inherited):
        os.dup2(original, fd)
        os.close(original)
    if relay is not None:
        # Reaped once it has written its last words, never waited for here: the front's stderr may be slow.
        threading.Thread(target=os.waitpid, args=(relay, 0), name="skyinfer-spare-relay", daemon=True).start()


def _write_line(fd: int, payload: dict) -> None:
    data = json.dumps(payload).encode() + b"\n"
    with contextlib.suppress(OSError):  # a front that is gone: the lifeline takes this process
        while data:
            data = data[os.write(fd, data) :]


def _read_order(fd: int) -> dict | None:
    """The start order (one JSON line); None at end of file before a whole line."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 65536)
        if not chunk:
            return None
        data += chunk
    return json.loads(data)
