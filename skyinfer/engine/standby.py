"""A spare engine process: imported, and waiting for the front's word to become an engine.

A cold engine process pays for Python's, torch's and vLLM's imports before vLLM even starts
loading the model (``docs/benchmarks.rst`` has the figures). So the front keeps one *spare* per engine
(``skyinfer/fleet/spares.py``): the engine's own command line with ``--standby`` added, started once
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

A *loaded* spare (``--loaded``; the front's ``--loaded-spares``, on CPU by default) goes further
before it says it stands by: it builds the whole engine (vLLM's EngineCore and workers, the model
loaded from the checkpoint, the KV cache), everything but the socket. Its start order then costs
the socket alone: the restart of an engine is the catch-up of the fleet's weights from a peer.
vLLM's processes that are spawned (on a GPU; on CPU they are forked, ``cpu_platform.py``) import
torch and vLLM again, seconds each: what an imports-only spare cannot save. A loaded spare holds
a whole engine's memory (its KV cache included) and cannot take a changed environment: the front
starts a cold engine instead (``spares.py``). Its vLLM processes write through the spare's relay
for their whole life; the relay goes on with the engine's prefix and tail file once the order
came.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

SPARE_LOG_SUFFIX = ".spare"


def spare_prefix(log_prefix: str) -> str:
    """What a spare writes before each of its lines while it waits: its engine's prefix, marked."""
    return f"{log_prefix}(spare) " if log_prefix else "(spare) "


class Standby:
    """A spare process while it waits: its output relayed as a spare's, its life tied to the
    front's, its slot's cores, its warm-up done (``warm_up``: the imports; a loaded spare then
    builds its engine too, in ``server.serve_engine``)."""

    def __init__(self, ns: argparse.Namespace, warm_up: Callable[[], None]):
        self._ns = ns
        self.loaded = ns.loaded
        # Where a cold engine's output goes (the front's): an imports-only spare's engine relay,
        # forked once the order came, writes there, not through the spare's.
        self._inherited = (os.dup(1), os.dup(2))
        self._relay = None
        if ns.output_tail is not None:
            # First, while this process has no other thread: the relay is a fork of it. A loaded
            # spare's vLLM processes, started while it waits, write through this relay for their
            # whole life: it is told to go on as the engine's once the order came (``become_engine``).
            from .output import relay_output

            then = (ns.log_prefix, ns.output_tail) if self.loaded else None
            self._relay = relay_output(spare_prefix(ns.log_prefix), ns.output_tail + SPARE_LOG_SUFFIX, then)
        if ns.lifeline_fd is not None:
            from .lifeline import die_with_front

            die_with_front(ns.lifeline_fd)
        if ns.cpus:
            # Its start-up competes with its own slot's engine alone, as the engine's processes do.
            os.sched_setaffinity(0, {int(c) for c in ns.cpus.split(",")})
        self.began = time.monotonic()
        # The output relay forks again once the order came: what it imports is imported now.
        with contextlib.suppress(ImportError):
            import setproctitle  # noqa: F401
        warm_up()

    def stand_by(self) -> dict:
        """Say that it stands by (on ``--report-fd``), and wait for the start order: the order, or
        exit if the front let the spare go."""
        report = {"standing_by": True, "pid": os.getpid(), "warm_up_s": round(time.monotonic() - self.began, 2)}
        if self.loaded:
            report["loaded"] = True
        if self._ns.report_fd is not None:
            _write_line(self._ns.report_fd, report)
            os.close(self._ns.report_fd)
        order = _read_order(0)
        if order is None:
            sys.exit(0)
        return order

    def become_engine(self, order: dict) -> None:
        """Go on as the slot's engine: the order's environment applied (an imports-only spare's),
        nothing to read, the output where the engine's goes."""
        if self.loaded and (order.get("env") or order.get("unset")):
            # Its engine was built with the old environment; the front sends it none (spares.py).
            raise SystemExit("a loaded spare's start order changed its environment: it cannot take it")
        for name in order.get("unset", ()):
            os.environ.pop(name, None)
        os.environ.update(order.get("env", {}))
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        if self.loaded:
            # Its vLLM processes write through the spare's relay: it goes on as the engine's.
            for fd in self._inherited:
                os.close(fd)
            if self._relay is not None:
                os.kill(self._relay, signal.SIGUSR1)
            return
        # Its output where the front's goes (the spare's relay, its last writer gone, ends). Its
        # own relay, forked next, holds nothing of the spare's.
        for fd, original in zip((1, 2), self._inherited):
            os.dup2(original, fd)
            os.close(original)
        if self._relay is not None:
            # Reaped once it has written its last words, never waited for here: the front's stderr may be slow.
            threading.Thread(target=os.waitpid, args=(self._relay, 0), name="skyinfer-spare-relay", daemon=True).start()


def stand_by(ns: argparse.Namespace, warm_up: Callable[[], None]) -> Standby:
    """Set up as a spare and warm up. An imports-only spare then waits for the front's start order
    and returns with its environment applied, the lifeline already watched; a loaded spare returns
    at once, to build its engine first (``server.serve_engine`` waits for the order)."""
    standby = Standby(ns, warm_up)
    if not standby.loaded:
        standby.become_engine(standby.stand_by())
    return standby


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
